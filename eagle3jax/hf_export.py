"""Writing a Llama-family target in the Hugging Face layout (``config.json`` +
``model.safetensors``), the inverse of ``eagle3jax.hf_target``: ``transformers`` and
``eagle3jax.load_target`` both load the result."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from eagle3jax.hf_target import hf_name_and_transform
from eagle3jax.params import path_str


def _inverse(name: str, cfg, value: np.ndarray, kv_repeat: int) -> np.ndarray:
  """Our parameter layout -> the HF tensor (the inverse of ``hf_name_and_transform``)."""
  d, n, h = cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim
  if kv_repeat > 1 and name.split(".")[-1] in ("k_proj", "v_proj", "k_bias", "v_bias"):
    value = value[..., ::kv_repeat, :] if value.ndim == 3 else value[::kv_repeat]
  leaf = name.split(".")[-1]
  if leaf in ("q_proj", "k_proj", "v_proj"):
    return value.reshape(d, -1).T
  if leaf == "o_proj":
    return value.reshape(n * h, d).T
  if leaf in ("q_bias", "k_bias", "v_bias"):
    return value.reshape(-1)
  if leaf in ("gate_proj", "up_proj", "down_proj", "lm_head"):
    return value.T
  return value


def save_target(target, path: str, *, dtype=ml_dtypes.bfloat16, extra_config=None) -> None:
  """Saves ``target`` (a ``LlamaForCausalLM``) as a Hugging Face checkpoint directory."""
  cfg = target.config
  os.makedirs(path, exist_ok=True)
  tensors = {}
  for p, var in nnx.to_flat_state(nnx.state(target, nnx.Param)):
    name = path_str(p)
    hf_name, _ = hf_name_and_transform(name, cfg)
    value = np.asarray(jax.device_get(var.get_value()), np.float32)
    tensors[hf_name] = np.ascontiguousarray(
        _inverse(name, cfg, value, target.kv_repeat).astype(dtype))
  safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"),
                              metadata={"format": "pt"})
  rope = cfg.rope
  hf = {
      "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM"}[cfg.model_type]],
      "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_hidden_layers,
      "num_attention_heads": cfg.num_attention_heads,
      "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.resolved_head_dim,
      "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
      "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_word_embeddings, "rope_theta": rope.theta,
      "rope_scaling": None if rope.rope_type == "default" else {
          "rope_type": rope.rope_type, "factor": rope.factor,
          "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
          "original_max_position_embeddings": rope.original_max_position_embeddings},
      "attention_bias": cfg.o_bias, "mlp_bias": False,
      "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1
                      else cfg.eos_token_ids[0],
      "torch_dtype": "bfloat16" if dtype == ml_dtypes.bfloat16 else "float32",
  }
  if cfg.model_type == "qwen2":
    hf.pop("attention_bias")
  hf.update(extra_config or {})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
