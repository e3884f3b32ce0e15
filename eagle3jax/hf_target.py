"""Loading Hugging Face target checkpoints: Llama / Qwen2 / Qwen3 and DeepSeek-V3 / Kimi-K2 /
Kimi-K2.5, through one body.

Each family gives a config parser, a model factory and its weight table
(``eagle3jax.weights``); ``_load`` maps every parameter to its checkpoint tensors, converts
them layer by layer from memory-mapped safetensors and places them with their shardings.
Every model parameter must be found and every checkpoint tensor used: missing or unexpected
weights raise ``ValueError`` with the names. Tensors that are not part of the language model's
forward are skipped: rotary buffers, DeepSeek's multi-token-prediction layers
(``model.layers.{L}.*``, as many as the config's ``num_nextn_predict_layers``; other layers
past ``num_hidden_layers`` mean the config does not describe the checkpoint and are refused),
and in a Kimi-K2.5 checkpoint (language model under ``language_model.``) the vision tower and
projector, named once in a log line.

Quantized checkpoints (``eagle3jax.quant_config``: FP8 blocks, compressed-tensors INT4) are
placed as stored with ``quantization="keep"``: each quantized module (a layer's experts
together) is converted to the device layout of ``eagle3jax.quant`` once, its values and scales
placed one after the other, so at most one layer's host copies exist at a time; with
``"dequantize"`` they are dequantized on the host.
"""

from __future__ import annotations

import json
import logging
import os
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from eagle3jax import checks, model_kinds
from eagle3jax.config import LlamaConfig
from eagle3jax.deepseek_config import DEEPSEEK_MODEL_TYPES, hf_model_type, unwrap_text_config
from eagle3jax.llama import LlamaForCausalLM, kv_head_replication
from eagle3jax.params import materialize, random_fill
from eagle3jax.quant import part_of
from eagle3jax.quant_config import QuantizationConfig, linear_schemes
from eagle3jax.quant_io import read_dequantized, read_quantized
from eagle3jax.safetensors_io import SafetensorsDir, check_finite
from eagle3jax.sharding import TENSOR, validate_mesh
from eagle3jax import stack as stack_lib
from eagle3jax import weights as weights_lib
from eagle3jax.semantics import standard_numpy

log = logging.getLogger("eagle3jax")

# Checkpoint tensors that are derived buffers, not weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
QUANTIZATION_MODES = ("keep", "dequantize")
# Where Kimi-K2.5 (KimiK25ForConditionalGeneration) keeps its language model.
LANGUAGE_MODEL = "language_model."
# Keys of DeepSeek's own inference configs (inference/configs/config_671B.json), which are not
# Hugging Face configs.
_DEEPSEEK_NATIVE_KEYS = frozenset({"dim", "inter_dim", "moe_inter_dim", "n_layers",
                                   "n_heads", "n_dense_layers"})


def read_config(path: str) -> dict:
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise ValueError(f"checkpoint directory {path!r} does not exist")
  if not os.path.exists(cfg_path):
    raise ValueError(f"{path!r} has no config.json")
  with open(cfg_path) as f:
    try:
      return json.load(f)
    except ValueError as e:
      raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None


def check_hf_config(hf: dict, where: str = "config.json") -> None:
  """Refuses configs that are not Hugging Face ``config.json`` files, naming what they are."""
  if not isinstance(hf, dict):
    raise ValueError(f"{where} must hold a JSON object")
  native = sorted(_DEEPSEEK_NATIVE_KEYS & set(hf))
  if "model_type" not in hf and native:
    raise ValueError(
        f"{where} is not a Hugging Face config: it has {native} and no model_type, the layout "
        "of DeepSeek's own inference configs (inference/configs/config_*.json). Use the "
        "config.json published with the Hugging Face checkpoint (model_type 'deepseek_v3').")


def refuse_unexpected(path: str, extra, model_type: str) -> None:
  """Raises ValueError naming checkpoint tensors that the model does not use."""
  if extra:
    raise ValueError(f"checkpoint {path!r} has unexpected weights {sorted(extra)[:8]}"
                     f"{' ...' if len(extra) > 8 else ''} that a {model_type} model with "
                     "this config does not use")


def _mtp_layers(hf_cfg: dict) -> int:
  """How many multi-token-prediction layers (``model.layers.{L}``, ``{L + 1}``, ...) a
  DeepSeek-family checkpoint may carry beyond its ``num_hidden_layers``; 0 for other models, so
  a Llama checkpoint with more layers than its config names is refused, not cut short."""
  if hf_model_type(hf_cfg) not in DEEPSEEK_MODEL_TYPES:
    return 0
  text = unwrap_text_config(hf_cfg)
  value = text.get("num_nextn_predict_layers", text.get("num_mtp_layers", 0)) or 0
  return int(value) if checks.is_integer(value) and value > 0 else 0


def target_factory(hf_cfg: dict, mesh: Mesh, dtype, quantization: str = "keep"):
  """(config, model factory, weight table, kv_repeat) of a parsed ``config.json``.

  ``quantization="keep"``: the linears the config's ``quantization_config`` quantizes are
  ``eagle3jax.quant.QuantizedParam``s; ``"dequantize"``: every weight plain.
  """
  check_hf_config(hf_cfg)
  if quantization not in QUANTIZATION_MODES:
    raise ValueError(f"quantization={quantization!r}; choose one of {QUANTIZATION_MODES}")
  if hf_model_type(hf_cfg) in DEEPSEEK_MODEL_TYPES:
    from eagle3jax.deepseek import DeepseekForCausalLM  # pylint: disable=import-outside-toplevel
    from eagle3jax.deepseek_config import DeepseekConfig  # pylint: disable=import-outside-toplevel
    cfg = DeepseekConfig.from_hf(hf_cfg)
    table = weights_lib.deepseek_table(cfg)
    qcfg = QuantizationConfig.from_hf(hf_cfg)
    schemes = (linear_schemes(qcfg, table, cfg.num_hidden_layers) if quantization == "keep"
               else {})
    return cfg, lambda: DeepseekForCausalLM(cfg, dtype=dtype, schemes=schemes), table, 1
  cfg = LlamaConfig.from_hf(hf_cfg)
  factory, kv_repeat = _llama_factory(cfg, mesh, dtype)
  return cfg, factory, weights_lib.llama_table(cfg), kv_repeat


def _llama_factory(cfg: LlamaConfig, mesh: Mesh, dtype):
  kv_repeat = kv_head_replication(cfg.num_attention_heads, cfg.num_key_value_heads,
                                  mesh.shape[TENSOR])
  return (lambda: LlamaForCausalLM(cfg, kv_repeat=kv_repeat, dtype=dtype)), kv_repeat


def _layer_loop(model, layer_loop: str):
  if layer_loop not in stack_lib.LAYER_LOOPS:
    raise ValueError(f"layer_loop={layer_loop!r}; choose one of {stack_lib.LAYER_LOOPS} "
                     "(eagle3jax.stack.default_layer_loop() picks for this backend)")
  if layer_loop == "split":
    model.split_layers()
  return model


@standard_numpy
def load_target(path: str, *, mesh: Mesh | None = None, dtype=jnp.bfloat16,
                quantization: str = "keep", layer_loop: str = "scan"):
  """Loads a Hugging Face Llama/Qwen2/Qwen3 or DeepSeek-V3/Kimi-K2/Kimi-K2.5 checkpoint.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or a sharded
      ``model.safetensors.index.json``).
    mesh: a mesh from ``eagle3jax.sharding.make_mesh`` (default: one device).
    dtype: parameter dtype (of quantized weights: the dtype they dequantize to).
    quantization: for FP8-block and compressed-tensors INT4 checkpoints (see
      ``eagle3jax.quant_config``): ``"keep"`` places the weights as stored (e4m3 / packed
      int4 plus their scales, sharded like the weight) and dequantizes them inside the jitted
      forward next to their matmul (``eagle3jax.quant``); ``"dequantize"`` dequantizes them on
      the host to ``dtype``.
    layer_loop: ``"scan"`` runs each stack of layers as a scan (compile time independent of
      depth: the seed's 61 layers); ``"split"`` holds one-layer stacks, which XLA:CPU runs
      without copying every layer's weights out of the stack per step (1.4-1.6x faster
      decoding of the demo target on CPU; compile time grows with depth).
      ``eagle3jax.stack.default_layer_loop()`` gives ``"split"`` on CPU.

  Returns:
    A ``LlamaForCausalLM`` (or, for ``model_type`` ``deepseek_v3``/``kimi_k2`` and Kimi-K2.5's
    ``kimi_k25`` wrapper, a ``DeepseekForCausalLM``) whose parameters are placed with their
    target shardings.

  Raises:
    ValueError: unsupported config values, missing or unexpected weights, shape mismatches.
  """
  mesh = validate_mesh(mesh)
  checks.float_dtype("dtype", dtype)
  hf_cfg = read_config(path)
  cfg, factory, table, kv_repeat = target_factory(hf_cfg, mesh, dtype, quantization)
  qcfg = QuantizationConfig.from_hf(hf_cfg)
  tensors = SafetensorsDir(path)
  prefix = (LANGUAGE_MODEL if "model.embed_tokens.weight" not in tensors
            and LANGUAGE_MODEL + "model.embed_tokens.weight" in tensors else "")
  used = set()
  last = {}  # the last quantized module converted: {name: {"values": ..., "scale": ...}}

  def read(hf):
    full = prefix + hf
    module = full.removesuffix(".weight")
    if full not in tensors and module + ".weight_packed" not in tensors:
      raise ValueError(f"checkpoint {path!r} is missing weight {full!r}")
    return read_dequantized(tensors, full, qcfg, used)

  def fill_quantized(name, part):
    module = name.rsplit(".", 1)[0]
    if module not in last:
      entry = table.entry(module)
      entry = weights_lib.Entry(tuple(prefix + n for n in entry.hf_names), entry.layout)
      try:
        values, scale = read_quantized(tensors, entry, qcfg.scheme, used)
      except ValueError as e:
        raise ValueError(f"checkpoint {path!r}: {e}") from None
      first = entry.hf_names[0]
      check_finite(values.view(ml_dtypes.float8_e4m3fn) if qcfg.scheme.kind == "fp8_block"
                   else values, first, f"checkpoint {path!r}")  # FP8 values are e4m3 bytes
      check_finite(scale, first.removesuffix(".weight") + " scales", f"checkpoint {path!r}")
      last.clear()
      last[module] = {"values": values, "scale": scale}
    return last[module][part]

  def fill(name, shape, init):
    quantized = part_of(init)
    if quantized is not None:
      return fill_quantized(name, quantized[1])
    entry = table.entry(name)
    ws = [read(hf) for hf in entry.hf_names]
    first = prefix + entry.hf_names[0]
    try:
      out = weights_lib.to_ours(entry, ws)
    except ValueError:
      out = None
    if out is None or tuple(out.shape) != tuple(shape):
      raise ValueError(f"weight {first!r} has shape {tuple(ws[0].shape)}, which does not fit "
                       f"the config (expected {shape} after the layout change)")
    check_finite(out, first, f"checkpoint {path!r}")
    return out

  model = materialize(factory, mesh, fill, kv_repeat)
  mtp = _mtp_layers(hf_cfg)
  extra, towers = [], []
  for n in tensors.names:
    if n in used or _IGNORED.match(n):
      continue
    if not n.startswith(prefix):
      towers.append(n)
      continue
    m = _LAYER.match(n[len(prefix):])
    if m is not None and cfg.num_hidden_layers <= int(m.group(1)) < cfg.num_hidden_layers + mtp:
      continue  # multi-token-prediction layers: not part of the forward
    extra.append(n)
  if towers:
    kinds = sorted({n.split(".")[0] for n in towers})
    log.info("target %s: skipped %d tensors outside the language model (%s)", path,
             len(towers), ", ".join(f"{k}.*" for k in kinds))
  head = prefix + "lm_head.weight"
  if cfg.tie_word_embeddings and head in extra:
    # A tied copy is harmless. A different head is not: transformers versions disagree on
    # which of the two they use, so refuse rather than pick one.
    extra.remove(head)
    stored = np.asarray(read("lm_head.weight"), np.float32)
    embed = np.asarray(read("model.embed_tokens.weight"), np.float32)
    if stored.shape != embed.shape or not np.array_equal(stored, embed):
      raise ValueError(
          f"checkpoint {path!r}: config.json says tie_word_embeddings=true, but its "
          f"{head!r} differs from the token embedding "
          + (f"(shape {stored.shape} against {embed.shape})" if stored.shape != embed.shape
             else f"(max |difference| {float(np.max(np.abs(stored - embed))):.3g})")
          + ": set tie_word_embeddings to false to use the stored head, or drop "
          "lm_head.weight to tie it")
  beyond = sorted({int(m.group(1)) for m in (_LAYER.match(n[len(prefix):]) for n in extra)
                   if m is not None and int(m.group(1)) >= cfg.num_hidden_layers})
  if beyond:
    raise ValueError(
        f"checkpoint {path!r} has weights of layers {beyond[:8]}{' ...' if len(beyond) > 8 else ''}"
        f" but its config.json says num_hidden_layers={cfg.num_hidden_layers}"
        + (f" (and num_nextn_predict_layers={mtp})" if mtp or hf_model_type(hf_cfg)
           in DEEPSEEK_MODEL_TYPES else "")
        + ": the config does not describe this checkpoint; fix num_hidden_layers")
  refuse_unexpected(path, extra, cfg.model_type)
  model.mesh = mesh
  return _layer_loop(model, layer_loop)


@standard_numpy
def init_target(cfg: LlamaConfig, *, mesh: Mesh | None = None, dtype=jnp.float32,
                seed: int = 0, std: float = 0.02, layer_loop: str = "scan"):
  """A randomly initialised target (the same weights on every mesh for the same seed);
  ``layer_loop`` as in ``load_target``."""
  model_kinds.require_config("init_target", cfg, LlamaConfig)
  mesh = validate_mesh(mesh)
  checks.float_dtype("dtype", dtype)
  factory, kv_repeat = _llama_factory(cfg, mesh, dtype)
  model = materialize(factory, mesh, random_fill(seed, std), kv_repeat)
  model.mesh = mesh
  return _layer_loop(model, layer_loop)
