"""Loading Hugging Face DeepSeek-V3 / Kimi-K2 checkpoints into ``DeepseekForCausalLM``.

Each parameter is built from named HF tensors with an explicit transform (HF linear weights are
``[out, in]``; ours are ``[in, ...out]`` with heads split out; per-expert
``mlp.experts.{e}.*`` tensors are stacked into ``[E, ...]``). Every parameter must be found and
every checkpoint tensor used, except the multi-token-prediction layers (``model.layers.{L}.*``,
not part of the forward), rotary buffers, and, in a Kimi-K2.5 style checkpoint whose language
model lives under ``language_model.``, the other towers.

FP8 checkpoints (``quantization_config: {quant_method: fp8, weight_block_size: [bo, bi]}``)
store e4m3 weights with a ``<name>_scale_inv`` float per ``bo x bi`` block (the last blocks may
be partial); they are dequantised on the host (``w * scale_inv``) to the requested dtype.
"""

from __future__ import annotations

import re
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from eagle3jax.deepseek import DeepseekForCausalLM
from eagle3jax.deepseek_config import DeepseekConfig, unwrap_text_config
from eagle3jax.hf_target import refuse_unexpected
from eagle3jax.params import materialize, random_fill
from eagle3jax.safetensors_io import SafetensorsDir
from eagle3jax.sharding import single_device_mesh

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn),)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def fp8_block_size(hf: dict) -> tuple[int, int] | None:
  """The FP8 weight block of a config's ``quantization_config`` (None: not quantised)."""
  q = unwrap_text_config(hf).get("quantization_config")
  if q is None:
    return None
  method = q.get("quant_method")
  if method != "fp8":
    raise ValueError(f"config field quantization_config.quant_method={method!r} is not "
                     "supported (only 'fp8')")
  fmt = q.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise ValueError(f"config field quantization_config.fmt={fmt!r} is not supported "
                     "(only 'e4m3')")
  block = q.get("weight_block_size")
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(x, int) and x > 0 for x in block)):
    raise ValueError(f"config field quantization_config.weight_block_size={block!r} must be "
                     "two positive integers (per-block scales; per-tensor FP8 is not supported)")
  return int(block[0]), int(block[1])


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """``w [out, in]`` (e4m3) times its per-block ``scale_inv [ceil(out/bo), ceil(in/bi)]``."""
  out, inn = w.shape
  bo, bi = block
  want = (-(-out // bo), -(-inn // bi))
  if tuple(scale_inv.shape) != want:
    raise ValueError(f"FP8 scale_inv has shape {tuple(scale_inv.shape)}; a {w.shape} weight "
                     f"with {bo}x{bi} blocks needs {want}")
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, 0), bi, 1)[:out, :inn]
  return np.asarray(w, np.float32) * scale


def hf_sources(name: str, cfg: DeepseekConfig) -> tuple[list[str], Callable]:
  """Our parameter path -> (HF tensor names, transform of their host arrays to our layout)."""
  d, n = cfg.hidden_size, cfg.num_attention_heads
  one = lambda hf, fn: ([hf], lambda ws: fn(ws[0]))  # noqa: E731
  if name == "embed_tokens":
    return one("model.embed_tokens.weight", lambda w: w)
  if name == "lm_head":
    return one("lm_head.weight", lambda w: w.T)
  if name == "norm.weight":
    return one("model.norm.weight", lambda w: w)
  parts = name.split(".")
  assert parts[0] == "layers", name
  i = int(parts[1])
  prefix = f"model.layers.{i}."
  rest = ".".join(parts[2:])
  qk, c = cfg.qk_head_dim, cfg.kv_lora_rank
  table = {
      "input_layernorm.weight": ("input_layernorm.weight", lambda w: w),
      "post_attention_layernorm.weight": ("post_attention_layernorm.weight", lambda w: w),
      "self_attn.q_proj": ("self_attn.q_proj.weight", lambda w: w.T.reshape(d, n, qk)),
      "self_attn.q_a_proj": ("self_attn.q_a_proj.weight", lambda w: w.T),
      "self_attn.q_a_layernorm.weight": ("self_attn.q_a_layernorm.weight", lambda w: w),
      "self_attn.q_b_proj": ("self_attn.q_b_proj.weight",
                             lambda w: w.T.reshape(w.shape[1], n, qk)),
      "self_attn.kv_a_proj_with_mqa": ("self_attn.kv_a_proj_with_mqa.weight", lambda w: w.T),
      "self_attn.kv_a_layernorm.weight": ("self_attn.kv_a_layernorm.weight", lambda w: w),
      "self_attn.kv_b_proj": ("self_attn.kv_b_proj.weight",
                              lambda w: w.T.reshape(c, n, cfg.qk_nope_head_dim
                                                    + cfg.v_head_dim)),
      "self_attn.o_proj": ("self_attn.o_proj.weight",
                           lambda w: w.T.reshape(n, cfg.v_head_dim, d)),
      "mlp.gate": ("mlp.gate.weight", lambda w: w.T),
      "mlp.e_score_correction_bias": ("mlp.gate.e_score_correction_bias", lambda w: w),
  }
  for proj in ("gate_proj", "up_proj", "down_proj"):
    table[f"mlp.shared_experts.{proj}"] = (f"mlp.shared_experts.{proj}.weight", lambda w: w.T)
    if not cfg.is_moe_layer(i):
      table[f"mlp.{proj}"] = (f"mlp.{proj}.weight", lambda w: w.T)
    elif rest == f"mlp.{proj}":
      names = [f"{prefix}mlp.experts.{e}.{proj}.weight" for e in range(cfg.n_routed_experts)]
      return names, lambda ws: np.stack([np.asarray(w).T for w in ws])
  hf, fn = table[rest]
  return one(prefix + hf, fn)


def _ignorable(hf_name: str, cfg: DeepseekConfig, prefix: str) -> bool:
  if _IGNORED.match(hf_name) or not hf_name.startswith(prefix):
    return True
  m = _LAYER.match(hf_name[len(prefix):])
  return m is not None and int(m.group(1)) >= cfg.num_hidden_layers  # MTP layers


def load_deepseek(path: str, hf_cfg: dict, *, mesh: Mesh | None = None, dtype=jnp.bfloat16):
  """Loads a DeepSeek-V3 / Kimi-K2 checkpoint directory (``load_target`` dispatches here).

  Args:
    path: directory with ``config.json`` and safetensors files.
    hf_cfg: its parsed ``config.json``.
    mesh: a mesh from ``eagle3jax.sharding.make_mesh`` (default: one device).
    dtype: parameter dtype (FP8 weights are dequantised to it; the router stays float32).

  Returns:
    A ``DeepseekForCausalLM`` whose parameters are placed with their target shardings.

  Raises:
    ValueError: unsupported config values, missing or unexpected weights, shape mismatches.
  """
  mesh = mesh or single_device_mesh()
  cfg = DeepseekConfig.from_hf(hf_cfg)
  block = fp8_block_size(hf_cfg)
  tensors = SafetensorsDir(path)
  prefix = ("language_model." if "model.embed_tokens.weight" not in tensors
            and "language_model.model.embed_tokens.weight" in tensors else "")
  used = set()

  def read(hf):
    full = prefix + hf
    if full not in tensors:
      raise ValueError(f"checkpoint {path!r} is missing weight {full!r}")
    used.add(full)
    w = tensors.get(full)
    if w.dtype in _FP8:
      scale_name = full + "_scale_inv"
      if block is None or scale_name not in tensors:
        raise ValueError(f"weight {full!r} is float8 but the checkpoint has no "
                         f"{'quantization_config' if block is None else repr(scale_name)}")
      used.add(scale_name)
      return dequantize_fp8(w, tensors.get(scale_name), block)
    return np.asarray(w)

  def fill(name, shape, init):
    del init
    names, fn = hf_sources(name, cfg)
    ws = [read(hf) for hf in names]
    try:
      out = fn(ws)
    except ValueError:
      out = None
    if out is None or tuple(out.shape) != tuple(shape):
      raise ValueError(f"weight {prefix + names[0]!r} has shape {tuple(ws[0].shape)}, which "
                       f"does not fit the config (expected {shape} after the layout change)")
    return out

  model = materialize(lambda: DeepseekForCausalLM(cfg, dtype=dtype), mesh, fill)
  extra = [n for n in tensors.names if n not in used and not _ignorable(n, cfg, prefix)]
  if cfg.tie_word_embeddings:
    extra = [n for n in extra if n != prefix + "lm_head.weight"]
  refuse_unexpected(path, extra, cfg.model_type)
  model.mesh = mesh
  return model


def init_deepseek(cfg: DeepseekConfig, *, mesh: Mesh | None = None, dtype=jnp.float32,
                  seed: int = 0, std: float = 0.02):
  """A randomly initialised DeepSeek-family target (the same weights on every mesh)."""
  mesh = mesh or single_device_mesh()
  model = materialize(lambda: DeepseekForCausalLM(cfg, dtype=dtype), mesh,
                      random_fill(seed, std))
  model.mesh = mesh
  return model
