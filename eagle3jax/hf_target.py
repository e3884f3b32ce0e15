"""Loading Hugging Face Llama-family checkpoints into ``LlamaForCausalLM``.

Each HF tensor is mapped to one parameter with an explicit transform (HF linear weights are
``[out, in]``; ours are ``[in, ...out]`` with heads split out). Every model parameter must be
found and every checkpoint tensor must be used: missing or unexpected weights raise
``ValueError`` with the names.
"""

from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
from jax.sharding import Mesh

from eagle3jax.config import LlamaConfig
from eagle3jax.deepseek_config import DEEPSEEK_MODEL_TYPES, hf_model_type
from eagle3jax.llama import LlamaForCausalLM, kv_head_replication
from eagle3jax.params import materialize, random_fill
from eagle3jax.safetensors_io import SafetensorsDir
from eagle3jax.sharding import TENSOR, single_device_mesh

# Checkpoint tensors that are derived buffers, not weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


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


def hf_name_and_transform(name: str, cfg: LlamaConfig):
  """Our parameter path -> (HF tensor name, host transform to our logical layout)."""
  d, n, h, k = (cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim,
                cfg.num_key_value_heads)
  parts = name.split(".")
  if name == "embed_tokens":
    return "model.embed_tokens.weight", lambda w: w
  if name == "lm_head":
    return "lm_head.weight", lambda w: w.T
  if name == "norm.weight":
    return "model.norm.weight", lambda w: w
  assert parts[0] == "layers", name
  prefix = f"model.layers.{parts[1]}."
  rest = ".".join(parts[2:])
  table = {
      "self_attn.q_proj": ("self_attn.q_proj.weight", lambda w: w.T.reshape(d, n, h)),
      "self_attn.k_proj": ("self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, h)),
      "self_attn.v_proj": ("self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, h)),
      "self_attn.o_proj": ("self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, d)),
      "self_attn.q_bias": ("self_attn.q_proj.bias", lambda w: w.reshape(n, h)),
      "self_attn.k_bias": ("self_attn.k_proj.bias", lambda w: w.reshape(k, h)),
      "self_attn.v_bias": ("self_attn.v_proj.bias", lambda w: w.reshape(k, h)),
      "self_attn.o_bias": ("self_attn.o_proj.bias", lambda w: w),
      "self_attn.q_norm.weight": ("self_attn.q_norm.weight", lambda w: w),
      "self_attn.k_norm.weight": ("self_attn.k_norm.weight", lambda w: w),
      "input_layernorm.weight": ("input_layernorm.weight", lambda w: w),
      "post_attention_layernorm.weight": ("post_attention_layernorm.weight", lambda w: w),
      "mlp.gate_proj": ("mlp.gate_proj.weight", lambda w: w.T),
      "mlp.up_proj": ("mlp.up_proj.weight", lambda w: w.T),
      "mlp.down_proj": ("mlp.down_proj.weight", lambda w: w.T),
  }
  hf, fn = table[rest]
  return prefix + hf, fn


def refuse_unexpected(path: str, extra, model_type: str) -> None:
  """Raises ValueError naming checkpoint tensors that the model does not use."""
  if extra:
    raise ValueError(f"checkpoint {path!r} has unexpected weights {sorted(extra)[:8]}"
                     f"{' ...' if len(extra) > 8 else ''} that a {model_type} model with "
                     "this config does not use")


def _model_factory(cfg: LlamaConfig, mesh: Mesh, dtype):
  kv_repeat = kv_head_replication(cfg.num_attention_heads, cfg.num_key_value_heads,
                                  mesh.shape[TENSOR])
  return (lambda: LlamaForCausalLM(cfg, kv_repeat=kv_repeat, dtype=dtype)), kv_repeat


def load_target(path: str, *, mesh: Mesh | None = None, dtype=jnp.bfloat16):
  """Loads a Hugging Face Llama/Qwen2/Qwen3 or DeepSeek-V3/Kimi-K2 checkpoint directory.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or a sharded
      ``model.safetensors.index.json``).
    mesh: a mesh from ``eagle3jax.sharding.make_mesh`` (default: one device).
    dtype: parameter dtype.

  Returns:
    A ``LlamaForCausalLM`` (or, for ``model_type`` ``deepseek_v3``/``kimi_k2``, a
    ``DeepseekForCausalLM``, see ``eagle3jax.hf_deepseek``) whose parameters are placed with
    their target shardings.

  Raises:
    ValueError: unsupported config values, missing or unexpected weights, shape mismatches.
  """
  mesh = mesh or single_device_mesh()
  hf_cfg = read_config(path)
  if hf_model_type(hf_cfg) in DEEPSEEK_MODEL_TYPES:
    from eagle3jax.hf_deepseek import load_deepseek  # pylint: disable=import-outside-toplevel
    return load_deepseek(path, hf_cfg, mesh=mesh, dtype=dtype)
  cfg = LlamaConfig.from_hf(hf_cfg)
  tensors = SafetensorsDir(path)
  used = set()

  def fill(name, shape, init):
    del init
    hf, fn = hf_name_and_transform(name, cfg)
    if hf not in tensors:
      raise ValueError(f"checkpoint {path!r} is missing weight {hf!r} (needed for {name})")
    used.add(hf)
    w = tensors.get(hf)
    try:
      out = fn(w)
    except ValueError:
      raise ValueError(f"weight {hf!r} has shape {tuple(w.shape)}, which does not fit the "
                       f"config (expected {shape} after the layout change)") from None
    if tuple(out.shape) != tuple(shape):
      raise ValueError(f"weight {hf!r} has shape {tuple(w.shape)}, which does not fit the "
                       f"config (expected {shape} after the layout change)")
    return out

  factory, kv_repeat = _model_factory(cfg, mesh, dtype)
  model = materialize(factory, mesh, fill, kv_repeat)
  extra = [n for n in tensors.names if n not in used and not _IGNORED.match(n)]
  if cfg.tie_word_embeddings:
    extra = [n for n in extra if n != "lm_head.weight"]  # some tied checkpoints store a copy
  refuse_unexpected(path, extra, cfg.model_type)
  model.mesh = mesh
  return model


def init_target(cfg: LlamaConfig, *, mesh: Mesh | None = None, dtype=jnp.float32,
                seed: int = 0, std: float = 0.02):
  """A randomly initialised target (the same weights on every mesh for the same seed)."""
  mesh = mesh or single_device_mesh()
  factory, kv_repeat = _model_factory(cfg, mesh, dtype)
  model = materialize(factory, mesh, random_fill(seed, std), kv_repeat)
  model.mesh = mesh
  return model
