"""Quantized checkpoint tensors on the host: to the device layout of ``eagle3jax.quant``, or
dequantized (``load_target(..., quantization="dequantize")``).

Checkpoint layouts (per HF linear module ``M``, weight ``[out, in]``):

* FP8 blocks: ``M.weight`` e4m3 ``[out, in]`` and ``M.weight_scale_inv`` float32
  ``[ceil(out/bo), ceil(in/bi)]``; ``w = weight * scale_inv`` per block.
* compressed-tensors pack-quantized INT4: ``M.weight_packed`` int32 ``[out, ceil(in/8)]``
  (element ``i`` of a row at bits ``4*(i%8)`` of word ``i//8``, stored as ``q + 8``),
  ``M.weight_scale`` ``[out, ceil(in/group)]`` and ``M.weight_shape`` ``[out, in]``;
  ``w = q * scale`` per group.

Conversion works one module (one layer's experts) at a time, from memory-mapped tensors.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from eagle3jax import weights as weights_lib
from eagle3jax.quant import FP8_BLOCK, INT4_GROUP, INT4_OFFSET, QuantScheme

_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_BF16 = np.dtype(ml_dtypes.bfloat16)
# What a weight stored unquantized may be (casts to the parameter dtype are exact or rounding).
FLOAT_DTYPES = frozenset({_BF16, np.dtype(np.float16), np.dtype(np.float32),
                          np.dtype(np.float64)})


def _ceil(a: int, b: int) -> int:
  return -(-a // b)


def _in_groups(scale_rows: np.ndarray, n_in: int, size: int, g: int) -> np.ndarray:
  """``[out, ceil(n_in/size)]`` per-group scales -> ``[out, n_in/g]`` per ``g`` elements."""
  return scale_rows[:, (np.arange(n_in // g) * g) // size]


def _to_ours(flat: np.ndarray, linear: weights_lib.Linear, in_last: int) -> np.ndarray:
  """``[out, n]`` (``n`` a multiple of ``in / in_last``, e.g. packed bytes or groups) -> ours
  ``[*in_dims[:-1], in_last, *out_dims]`` with the last in dim resized to ``in_last``."""
  return flat.T.reshape(*linear.in_dims[:-1], in_last, *linear.out_dims)


def fp8_to_device(weight: np.ndarray, scale_inv: np.ndarray, scheme: QuantScheme,
                  linear: weights_lib.Linear, name: str = "weight"):
  """(values: the e4m3 bytes as uint8 ``[*in, *out]``, scale float32
  ``[*in[:-1], in_last/g, *out]``)."""
  out, n_in = math.prod(linear.out_dims), math.prod(linear.in_dims)
  if weight.dtype != _FP8:
    raise ValueError(f"{name} is {weight.dtype}, but quantization_config says it is float8 "
                     "e4m3; load with quantization='dequantize' or fix the config")
  if tuple(weight.shape) != (out, n_in):
    raise ValueError(f"{name} has shape {tuple(weight.shape)}, expected {(out, n_in)} "
                     "([out, in])")
  bo, bi = scheme.block_out, scheme.group_size
  want = (_ceil(out, bo), _ceil(n_in, bi))
  if tuple(scale_inv.shape) != want:
    raise ValueError(f"{name}_scale_inv has shape {tuple(scale_inv.shape)}; a {(out, n_in)} "
                     f"weight with {bo}x{bi} blocks needs {want}")
  in_last = linear.in_dims[-1]
  g = scheme.group(in_last)
  rows = np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0)[:out]
  scale = _to_ours(_in_groups(rows, n_in, bi, g), linear, in_last // g)
  return linear.to_ours(np.asarray(weight).view(np.uint8)), np.ascontiguousarray(scale)


def check_int4(packed: np.ndarray, scale: np.ndarray, shape, group_size: int,
               name: str = "weight", expected: tuple[int, int] | None = None) -> tuple[int, int]:
  """``(out, in)`` of a pack-quantized weight whose arrays fit each other and ``expected``
  (the model's ``[out, in]``, where known), or a ``ValueError`` naming the array: one check for
  both load paths (``keep`` and ``dequantize``)."""
  dims = tuple(int(x) for x in np.asarray(shape).reshape(-1))
  if len(dims) != 2 or (expected is not None and dims != tuple(expected)):
    raise ValueError(f"{name}_shape is {np.asarray(shape).tolist()}, expected "
                     f"{list(expected) if expected is not None else '[out, in]'} ([out, in])")
  out, n_in = dims
  if packed.dtype != np.int32 or tuple(packed.shape) != (out, _ceil(n_in, 8)):
    raise ValueError(f"{name}_packed is {packed.dtype} {tuple(packed.shape)}, expected int32 "
                     f"{(out, _ceil(n_in, 8))}")
  want = (out, _ceil(n_in, group_size))
  if tuple(scale.shape) != want:
    raise ValueError(f"{name}_scale has shape {tuple(scale.shape)}, expected {want} (groups "
                     f"of {group_size}, as quantization_config says)")
  if np.dtype(scale.dtype) not in FLOAT_DTYPES:
    raise ValueError(f"{name}_scale is {scale.dtype}, expected a float dtype")
  return out, n_in


def int4_to_device(packed: np.ndarray, scale: np.ndarray, shape: np.ndarray,
                   scheme: QuantScheme, linear: weights_lib.Linear, name: str = "weight"):
  """(values uint8 ``[*in[:-1], in_last/2, *out]``, scale bf16 ``[*in[:-1], in_last/g, *out]``)."""
  out, n_in = check_int4(packed, scale, shape, scheme.group_size, name,
                         (math.prod(linear.out_dims), math.prod(linear.in_dims)))
  if scale.dtype != _BF16:
    raise ValueError(f"{name}_scale is {scale.dtype}; INT4 scales are held as stored and "
                     "only bfloat16 is implemented (load with quantization='dequantize')")
  in_last = linear.in_dims[-1]
  if in_last % 2:
    raise ValueError(f"{name}: INT4 weights need an even in dim (got {in_last})")
  nibbles = np.ascontiguousarray(packed).astype("<i4").view(np.uint8)[:, :n_in // 2]
  values = _to_ours(nibbles, linear, in_last // 2)
  g = scheme.group(in_last)
  scales = _to_ours(_in_groups(np.asarray(scale), n_in, scheme.group_size, g), linear,
                    in_last // g)
  return np.ascontiguousarray(values), np.ascontiguousarray(scales)


def unpack_int4(packed: np.ndarray, n_in: int) -> np.ndarray:
  """``[out, ceil(n_in/8)]`` int32 -> int8 ``[out, n_in]`` in ``[-8, 7]``."""
  nibbles = np.ascontiguousarray(packed).astype("<i4").view(np.uint8)
  q = np.stack([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(packed.shape[0], -1)
  return (q[:, :n_in].astype(np.int8) - INT4_OFFSET).astype(np.int8)


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, shape, group_size: int,
                    name: str = "weight") -> np.ndarray:
  """float32 ``[out, in]``: unpacked values times their group's scale."""
  out, n_in = check_int4(packed, scale, shape, group_size, name)
  q = unpack_int4(packed, n_in).astype(np.float32)
  s = np.repeat(np.asarray(scale, np.float32), group_size, axis=1)[:, :n_in]
  return q * s


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """``w [out, in]`` (e4m3) times its per-block ``scale_inv [ceil(out/bo), ceil(in/bi)]``."""
  out, inn = w.shape
  bo, bi = block
  want = (_ceil(out, bo), _ceil(inn, bi))
  if tuple(scale_inv.shape) != want:
    raise ValueError(f"FP8 scale_inv has shape {tuple(scale_inv.shape)}; a {w.shape} weight "
                     f"with {bo}x{bi} blocks needs {want}")
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, 0), bi, 1)[:out, :inn]
  return np.asarray(w, np.float32) * scale


# --- reading a checkpoint ---

def _get(tensors, name: str, used: set):
  if name not in tensors:
    raise ValueError(f"checkpoint is missing weight {name!r}")
  used.add(name)
  return tensors.get(name)


def read_dequantized(tensors, name: str, qcfg, used: set) -> np.ndarray:
  """Tensor ``name`` (``M.weight``) as a float host array: e4m3 weights times their
  ``M.weight_scale_inv``, pack-quantized ``M.weight_packed`` unpacked times ``M.weight_scale``,
  others as stored. Every tensor read is recorded in ``used``."""
  module = name.removesuffix(".weight")
  if name not in tensors and module + ".weight_packed" in tensors:
    if qcfg is None or qcfg.scheme.kind != INT4_GROUP:
      raise ValueError(f"weight {module + '.weight_packed'!r} is pack-quantized but the "
                       "config has no compressed-tensors quantization_config")
    return dequantize_int4(_get(tensors, module + ".weight_packed", used),
                           _get(tensors, module + ".weight_scale", used),
                           _get(tensors, module + ".weight_shape", used),
                           qcfg.scheme.group_size, module + ".weight")
  w = _get(tensors, name, used)
  if w.dtype == _FP8:
    if qcfg is None or qcfg.scheme.kind != FP8_BLOCK:
      raise ValueError(f"weight {name!r} is float8 but the config has no fp8 "
                       "quantization_config")
    s = qcfg.scheme
    return dequantize_fp8(w, _get(tensors, name + "_scale_inv", used),
                          (s.block_out, s.group_size))
  if np.dtype(w.dtype) not in FLOAT_DTYPES:
    raise ValueError(f"tensor {name!r} is {w.dtype}: a weight held as stored must be one of "
                     f"{sorted(str(d) for d in FLOAT_DTYPES)} (float8 e4m3 and packed INT4 "
                     "need a quantization_config that says so)")
  return np.asarray(w)


def read_quantized(tensors, entry: weights_lib.Entry, scheme: QuantScheme, used: set):
  """``(values, scale)`` of a quantized parameter (``Linear`` or stacked ``Experts``) in the
  device layout, from checkpoint names ``entry.hf_names`` (``M.weight`` each)."""
  linear = weights_lib.linear_dims(entry.layout)
  pairs = []
  for hf in entry.hf_names:
    module = hf.removesuffix(".weight")
    if scheme.kind == FP8_BLOCK:
      pairs.append(fp8_to_device(_get(tensors, hf, used),
                                 _get(tensors, hf + "_scale_inv", used), scheme, linear, hf))
    else:
      if hf in tensors and module + ".weight_packed" not in tensors:
        raise ValueError(f"weight {hf!r} is stored unquantized but quantization_config "
                         "quantizes it (not in its ignore list); load with "
                         "quantization='dequantize' or fix the config")
      pairs.append(int4_to_device(_get(tensors, module + ".weight_packed", used),
                                  _get(tensors, module + ".weight_scale", used),
                                  _get(tensors, module + ".weight_shape", used), scheme,
                                  linear, hf))
  if isinstance(entry.layout, weights_lib.Experts):
    return np.stack([v for v, _ in pairs]), np.stack([s for _, s in pairs])
  return pairs[0]
