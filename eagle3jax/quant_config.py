"""A checkpoint's ``quantization_config``: what is implemented, what is refused, which linears.

Implemented:

* FP8 blocks (DeepSeek-V3, Kimi-K2): ``quant_method: fp8``, ``fmt: e4m3``, a
  ``weight_block_size [out, in]``, dynamic activation scaling (activations are computed in the
  model dtype, as transformers' dequantizing path does). Every linear except ``lm_head`` and
  ``modules_to_not_convert`` holds e4m3 ``weight`` plus float32 ``weight_scale_inv``.
* compressed-tensors INT4 (Kimi-K2.5, Kimi-K2-Thinking): ``quant_method: compressed-tensors``,
  ``quantization_status: compressed``, ``format: pack-quantized``, one config group targeting
  ``Linear`` with 4-bit symmetric ``int`` weights, ``strategy: group``, static scales, no
  activation quantization. Linears not in ``ignore`` hold ``weight_packed`` int32
  ``[out, in/8]``, ``weight_scale`` ``[out, in/group]`` and ``weight_shape``.

Anything else (another method, format, bit width, strategy, an asymmetric scheme, activation or
KV-cache quantization) is refused with a ``ValueError`` naming the field and its value.

``ignore`` entries are module names or ``re:`` patterns (``re.match``, as compressed-tensors
matches them), compared with the module name with and without a ``language_model.`` prefix.
Only linears are candidates: ``*_proj`` (and ``kv_a_proj_with_mqa``) and ``lm_head``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from eagle3jax.quant import FP8_BLOCK, INT4_GROUP, QuantScheme

LANGUAGE_MODEL = "language_model."
_CANDIDATE = re.compile(r"(^|.*\.)(\w+_proj|kv_a_proj_with_mqa|lm_head)$")
_FP8_FIELDS = frozenset({"quant_method", "fmt", "activation_scheme", "weight_block_size",
                         "modules_to_not_convert"})
_CT_FIELDS = frozenset({"quant_method", "quantization_status", "format", "config_groups",
                        "ignore", "kv_cache_scheme", "sparsity_config", "transform_config",
                        "global_compression_ratio", "version", "provider"})
# Weight fields of a config group and the values implemented (_ANY: harmless whatever it is).
_ANY = object()
_CT_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": True,
               "dynamic": False, "actorder": None, "block_structure": None,
               "group_size": _ANY, "observer": _ANY, "observer_kwargs": _ANY,
               "scale_dtype": _ANY, "zp_dtype": _ANY}


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
  """The parsed ``quantization_config`` of a checkpoint.

  Attributes:
    method: ``fp8`` or ``compressed-tensors``.
    scheme: the scheme of every quantized linear.
    ignore: module names and ``re:`` patterns left unquantized.
  """
  method: str
  scheme: QuantScheme
  ignore: tuple[str, ...] = ()

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "QuantizationConfig | None":
    """From a ``config.json`` dict (its ``quantization_config``, also at the top of a
    ``text_config`` wrapper); None when the checkpoint is not quantized."""
    q = hf.get("quantization_config")
    text = hf.get("text_config")
    if q is None and isinstance(text, Mapping):
      q = text.get("quantization_config")
    if q is None:
      return None
    if not isinstance(q, Mapping):
      raise ValueError(f"config field quantization_config={q!r} must be an object")
    method = q.get("quant_method")
    if method == "fp8":
      return _fp8(q)
    if method == "compressed-tensors":
      return _compressed_tensors(q)
    raise ValueError(f"config field quantization_config.quant_method={method!r} is not "
                     "supported (only 'fp8' and 'compressed-tensors')")

  def scheme_for(self, module: str) -> QuantScheme | None:
    """The scheme of HF module ``module`` (e.g. ``model.layers.3.mlp.experts.7.up_proj``),
    None when it is not a candidate linear or is ignored."""
    if not _CANDIDATE.match(module):
      return None
    names = {module, module[len(LANGUAGE_MODEL):] if module.startswith(LANGUAGE_MODEL)
             else LANGUAGE_MODEL + module}
    for pattern in self.ignore:
      for name in names:
        if pattern.startswith("re:"):
          if re.match(pattern[3:], name):
            return None
        elif pattern == name:
          return None
    return self.scheme


def _refuse(field: str, value, want: str):
  raise ValueError(f"config field quantization_config.{field}={value!r} is not supported "
                   f"({want})")


def _fp8(q) -> QuantizationConfig:
  unknown = sorted(set(q) - _FP8_FIELDS)
  if unknown:
    raise ValueError(f"config field quantization_config has fields eagle3jax does not "
                     f"implement for fp8: {unknown}")
  if q.get("fmt", "e4m3") != "e4m3":
    _refuse("fmt", q.get("fmt"), "only 'e4m3'")
  if q.get("activation_scheme", "dynamic") != "dynamic":
    _refuse("activation_scheme", q.get("activation_scheme"),
            "only 'dynamic'; static activation scales are not read")
  block = q.get("weight_block_size")
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in block)):
    _refuse("weight_block_size", block, "two positive integers [out, in] are needed; "
            "per-tensor FP8 is not supported")
  skip = q.get("modules_to_not_convert") or []
  if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
    _refuse("modules_to_not_convert", skip, "a list of module names is needed")
  return QuantizationConfig("fp8", QuantScheme(FP8_BLOCK, int(block[1]), int(block[0])),
                            ("lm_head",) + tuple(skip))


def _compressed_tensors(q) -> QuantizationConfig:
  unknown = sorted(set(q) - _CT_FIELDS)
  if unknown:
    raise ValueError(f"config field quantization_config has fields eagle3jax does not "
                     f"implement for compressed-tensors: {unknown}")
  if q.get("quantization_status") != "compressed":
    _refuse("quantization_status", q.get("quantization_status"), "only 'compressed'")
  if q.get("format") != "pack-quantized":
    _refuse("format", q.get("format"), "only 'pack-quantized'")
  for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
    if q.get(field):
      _refuse(field, q.get(field), "only null")
  groups = q.get("config_groups")
  if not isinstance(groups, Mapping) or len(groups) != 1:
    _refuse("config_groups", groups, "exactly one group is implemented")
  (gname, group), = groups.items()
  where = f"config_groups.{gname}"
  if group.get("targets") != ["Linear"]:
    _refuse(f"{where}.targets", group.get("targets"), "only ['Linear']")
  if group.get("format") not in (None, "pack-quantized"):
    _refuse(f"{where}.format", group.get("format"), "only 'pack-quantized'")
  for field in ("input_activations", "output_activations"):
    if group.get(field) is not None:
      _refuse(f"{where}.{field}", group.get(field), "activation quantization is not "
              "implemented: only null")
  weights = group.get("weights")
  if not isinstance(weights, Mapping):
    _refuse(f"{where}.weights", weights, "an object is needed")
  for field, value in weights.items():
    if field not in _CT_WEIGHTS:
      if value is not None:
        _refuse(f"{where}.weights.{field}", value, "not implemented")
      continue
    want = _CT_WEIGHTS[field]
    if want is not _ANY and value != want:
      _refuse(f"{where}.weights.{field}", value, f"only {want!r}")
  for field in ("num_bits", "type", "strategy", "symmetric"):
    if field not in weights:
      _refuse(f"{where}.weights.{field}", None, f"{_CT_WEIGHTS[field]!r} must be stated")
  size = weights.get("group_size")
  if not isinstance(size, int) or isinstance(size, bool) or size < 1 or size % 2:
    _refuse(f"{where}.weights.group_size", size, "a positive even integer is needed")
  ignore = q.get("ignore") or []
  if not isinstance(ignore, (list, tuple)) or not all(isinstance(s, str) for s in ignore):
    _refuse("ignore", ignore, "a list of module names and 're:' patterns is needed")
  return QuantizationConfig("compressed-tensors", QuantScheme(INT4_GROUP, size),
                            tuple(ignore))


# --- which of a model's linears are quantized ---

def linear_schemes(qcfg: QuantizationConfig | None, table, num_layers: int
                   ) -> dict[str, QuantScheme]:
  """Our parameter names (``lm_head``, ``layers.{i}.<path>``) -> scheme, for the linears of
  ``table`` (``eagle3jax.weights.WeightTable``) that ``qcfg`` quantizes. Stacked experts
  must agree: a layer's experts are one array."""
  if qcfg is None:
    return {}
  from eagle3jax import weights as weights_lib  # pylint: disable=import-outside-toplevel
  out = {}
  names = list(table.top) + [f"layers.{i}.{rest}" for i in range(num_layers)
                             for rest in table.layer(i)]
  for name in names:
    entry = table.entry(name)
    if weights_lib.linear_dims(entry.layout) is None:
      continue
    schemes = {qcfg.scheme_for(hf.removesuffix(".weight")) for hf in entry.hf_names}
    if len(schemes) > 1:
      raise ValueError(f"quantization_config quantizes some of {entry.hf_names[0]!r}'s "
                       "sibling experts and ignores others; a layer's experts must agree")
    scheme = schemes.pop()
    if scheme is not None:
      out[name] = scheme
  return out


def layer_schemes(schemes: Mapping[str, QuantScheme], start: int, end: int
                  ) -> dict[str, QuantScheme]:
  """The schemes of a layer stack ``[start, end)`` by path inside the layer; every layer of a
  stack must agree (a stack is one array per parameter)."""
  per_layer = []
  for i in range(start, end):
    prefix = f"layers.{i}."
    per_layer.append({k[len(prefix):]: v for k, v in schemes.items() if k.startswith(prefix)})
  for i, got in zip(range(start + 1, end), per_layer[1:]):
    if got != per_layer[0]:
      diff = sorted(set(got.items()) ^ set(per_layer[0].items()))
      raise ValueError(f"quantization_config treats layers {start} and {i} differently "
                       f"({diff[0][0]}); layers of one stack must agree")
  return per_layer[0] if per_layer else {}
