"""Tiny random `transformers` checkpoints written by the tests themselves (no downloads)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _hf_config(kind: str, tied: bool, layers: int):
  common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tied,
                max_position_embeddings=256, rms_norm_eps=1e-5, eos_token_id=2)
  if kind == "llama":
    return transformers.LlamaConfig(rope_theta=5000.0, rope_scaling=dict(LLAMA3_SCALING),
                                    **common)
  if kind == "qwen2":
    return transformers.Qwen2Config(rope_theta=20000.0, **common)
  if kind == "qwen3":
    return transformers.Qwen3Config(rope_theta=30000.0, head_dim=12, **common)
  raise ValueError(kind)


_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
            "qwen3": transformers.Qwen3ForCausalLM}


def to_published_style(path: str) -> None:
  """Rewrites a transformers-5 config.json (rope_parameters) to the published style."""
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    cfg = json.load(f)
  params = dict(cfg.pop("rope_parameters"))
  cfg["rope_theta"] = params.pop("rope_theta")
  rope_type = params.pop("rope_type")
  cfg["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **params}
  with open(cfg_path, "w") as f:
    json.dump(cfg, f)


def make_checkpoint(path: str, kind: str = "llama", *, tied: bool = False, layers: int = 6,
                    style: str = "hf5", seed: int = 0):
  """Saves a tiny random model of ``kind`` to ``path``; returns the torch model (eval, fp32).

  Every weight is random (norm weights around 1, biases non-zero) so that no path hides.
  """
  torch.manual_seed(seed)
  model = _CLASSES[kind](_hf_config(kind, tied, layers)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
  model.save_pretrained(path, safe_serialization=True)
  if style == "published":
    to_published_style(path)
  return model


def hf_outputs(model, ids: np.ndarray):
  """Logits and the pre-norm residual stream after every layer (id -1 .. L-1) from torch."""
  last = {}
  handle = model.model.layers[-1].register_forward_hook(
      lambda mod, inp, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out))
  with torch.no_grad():
    out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True)
  handle.remove()
  hidden = [h.numpy() for h in out.hidden_states]
  layers = {-1: hidden[0]}
  n = len(hidden) - 1
  for i in range(n - 1):
    layers[i] = hidden[i + 1]
  layers[n - 1] = last["h"].numpy()
  return out.logits.numpy(), layers
