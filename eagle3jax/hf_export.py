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

from eagle3jax.params import path_str
from eagle3jax.sharding import KV_HEADS, LAYERS
from eagle3jax.weights import llama_table, to_hf


def _unreplicate(value: np.ndarray, axes, kv_repeat: int) -> np.ndarray:
  """Undoes KV-head replication (``llama.kv_head_replication``) along the ``KV_HEADS`` axis."""
  if kv_repeat == 1 or KV_HEADS not in axes:
    return value
  index = [slice(None)] * value.ndim
  index[list(axes).index(KV_HEADS)] = slice(None, None, kv_repeat)
  return value[tuple(index)]


# What each model type's Hugging Face layout can say about the attention's extras.
_HF_ATTENTION = {
    "llama": "q/k/v and o biases together (attention_bias) and no q/k norms",
    "qwen2": "q/k/v biases, no o bias and no q/k norms",
    "qwen3": "q/k/v and o biases together (attention_bias), and q/k norms",
}


def check_savable(cfg) -> None:
  """Raises ``ValueError`` for a target config whose model type's Hugging Face layout cannot
  express its attention (``LlamaConfig`` accepts any combination, for research models):
  written anyway, transformers would load another model, or eagle3jax refuse the file."""
  want = {"llama": (cfg.o_bias, cfg.o_bias, False), "qwen2": (True, False, False),
          "qwen3": (cfg.o_bias, cfg.o_bias, True)}[cfg.model_type]
  if (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) != want:
    raise ValueError(
        f"save_target: a model_type={cfg.model_type!r} checkpoint has "
        f"{_HF_ATTENTION[cfg.model_type]}, but this config has qkv_bias={cfg.qkv_bias}, "
        f"o_bias={cfg.o_bias}, qk_norm={cfg.qk_norm}: no Hugging Face layout would load it "
        "as this model; change model_type or those fields")


def save_target(target, path: str, *, dtype=ml_dtypes.bfloat16, extra_config=None) -> None:
  """Saves ``target`` (a ``LlamaForCausalLM``) as a Hugging Face checkpoint directory.

  Raises:
    ValueError: the config's attention extras do not fit its model type's layout
      (``check_savable``).
  """
  cfg = target.config
  check_savable(cfg)
  os.makedirs(path, exist_ok=True)
  table = llama_table(cfg)
  tensors = {}
  for p, var in nnx.to_flat_state(nnx.state(target, nnx.Param)):
    axes = var.get_metadata()["axes"]
    value = np.asarray(jax.device_get(var.get_value()), np.float32)
    if axes[0] == LAYERS:  # stacked layers: one checkpoint tensor per layer
      first = var.get_metadata()["layer_offset"]
      sub = p[2:] if p[0] == "layer_split" else p[1:]  # one-layer stacks: layer_split.{n}.
      pieces = [(f"layers.{first + i}.{path_str(sub)}", value[i], axes[1:])
                for i in range(value.shape[0])]
    else:
      pieces = [(path_str(p), value, axes)]
    for name, v, ax in pieces:
      for hf_name, w in to_hf(table.entry(name), _unreplicate(v, ax, target.kv_repeat)).items():
        tensors[hf_name] = np.ascontiguousarray(w.astype(dtype))
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
      "rope_scaling": rope.to_hf(),
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
