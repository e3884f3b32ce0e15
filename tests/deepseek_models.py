"""Tiny random DeepSeek-V3 / Kimi-K2 checkpoints written by the tests themselves."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import safetensors.torch
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import (pack_to_int32,
                                                                   unpack_from_int32)

# Every path alive: YaRN (factor > 1, mscale == mscale_all_dim != 0, positions past 16),
# group-limited routing (2 groups, 1 allowed), a shared expert, one dense layer, q_lora.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
VOCAB = 97


# YaRN without mscale: cos/sin are scaled by 0.1 * ln(factor) + 1, the softmax scale is plain.
YARN_NO_MSCALE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def hf_config(*, layers: int = 4, q_lora_rank: int | None = 40, theta: float = 10000.0,
              yarn: dict | None = None):
  return transformers.DeepseekV3Config(
      vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
      n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32,
      q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=12,
      n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
      norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-5, eos_token_id=2,
      rope_parameters={"rope_theta": theta, **(yarn or YARN)})


def _rewrite_config(path: str, fn) -> None:
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    cfg = json.load(f)
  cfg = fn(cfg) or cfg
  with open(cfg_path, "w") as f:
    json.dump(cfg, f)


def to_published_style(cfg: dict) -> dict:
  """transformers-5 ``rope_parameters`` -> published ``rope_theta`` + ``rope_scaling``, plus
  the fields DeepSeek's own config carries."""
  params = dict(cfg.pop("rope_parameters"))
  cfg["rope_theta"] = params.pop("rope_theta")
  cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}
  cfg.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, ep_size=1,
             aux_loss_alpha=0.001, seq_aux=True)
  return cfg


def make_checkpoint(path: str, *, layers: int = 4, q_lora_rank: int | None = 40,
                    style: str = "hf5", model_type: str = "deepseek_v3", seed: int = 0,
                    yarn: dict | None = None):
  """Saves a tiny random DeepSeek-V3 to ``path``; returns the torch model (eval, fp32).

  Every weight is random (norms around 1), and so is ``e_score_correction_bias`` (a buffer,
  large enough to change which experts are chosen). ``model_type="kimi_k2"`` only rewrites the
  saved config (transformers builds the model as DeepSeek-V3).
  """
  torch.manual_seed(seed)
  model = transformers.DeepseekV3ForCausalLM(hf_config(layers=layers, q_lora_rank=q_lora_rank,
                                                       yarn=yarn))
  model = model.eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("gate.weight"):
        p.copy_(0.3 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.2 * torch.randn_like(b))
  model.save_pretrained(path, safe_serialization=True)
  if style == "published":
    _rewrite_config(path, to_published_style)
  if model_type != "deepseek_v3":
    _rewrite_config(path, lambda c: c.update(model_type=model_type))
  return model


_QUANTISED = re.compile(r".*(proj|proj_with_mqa)\.weight$")
FP8_MAX = 448.0


def quantize_blockwise(w: np.ndarray, block=(128, 128)):
  """e4m3 weight and per-block ``scale_inv`` (``w ~= q * scale_inv``), as DeepSeek stores them."""
  out, inn = w.shape
  bo, bi = block
  nb_o, nb_i = -(-out // bo), -(-inn // bi)
  scale = np.zeros((nb_o, nb_i), np.float32)
  q = np.zeros_like(w, np.float32)
  for r in range(nb_o):
    for c in range(nb_i):
      blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
      s = max(float(np.abs(blk).max()), 1e-12) / FP8_MAX
      scale[r, c] = s
      q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = blk / s
  q8 = torch.from_numpy(q).to(torch.float8_e4m3fn)
  return q8, torch.from_numpy(scale)


def to_fp8_checkpoint(src: str, dst: str, block=(128, 128)) -> None:
  """Copies checkpoint ``src`` to ``dst`` with every projection quantised to e4m3 blockwise."""
  os.makedirs(dst, exist_ok=True)
  tensors = safetensors.torch.load_file(os.path.join(src, "model.safetensors"))
  out = {}
  for name, w in tensors.items():
    if _QUANTISED.match(name) and w.ndim == 2:
      q, s = quantize_blockwise(w.float().numpy(), block)
      out[name] = q
      out[name + "_scale_inv"] = s
    else:
      out[name] = w
  safetensors.torch.save_file(out, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                "activation_scheme": "dynamic",
                                "weight_block_size": list(block)}
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)


def dequantized_copy(src: str, dst: str) -> None:
  """Writes FP8 checkpoint ``src`` back as float32 (``q * scale_inv`` per block) to ``dst``."""
  os.makedirs(dst, exist_ok=True)
  tensors = safetensors.torch.load_file(os.path.join(src, "model.safetensors"))
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  bo, bi = cfg.pop("quantization_config")["weight_block_size"]
  out = {}
  for name, w in tensors.items():
    if name.endswith("_scale_inv"):
      continue
    if w.dtype == torch.float8_e4m3fn:
      s = tensors[name + "_scale_inv"]
      full = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:w.shape[0], :w.shape[1]]
      w = w.float() * full
    out[name] = w
  safetensors.torch.save_file(out, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)


# --- Kimi-K2.5 as published: kimi_k25 wrapper, INT4 experts (compressed-tensors) ---

KIMI_K25_QUANT = {
    "quant_method": "compressed-tensors", "quantization_status": "compressed",
    "format": "pack-quantized", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": False, "actorder": None,
                    "block_structure": None, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def quantize_int4(w: np.ndarray, group: int = 32):
  """Symmetric INT4 per ``group`` in-elements of a row: (int8 ``q`` in [-8, 7], bf16 scale
  ``[out, ceil(in/group)]``) with ``w ~= q * scale``."""
  out, inn = w.shape
  n = -(-inn // group)
  pad = np.zeros((out, n * group), np.float32)
  pad[:, :inn] = w
  amax = np.abs(pad.reshape(out, n, group)).max(-1)
  scale = torch.from_numpy(np.maximum(amax, 1e-8) / 7.0).to(torch.bfloat16)
  full = scale.float().numpy().repeat(group, 1)[:, :inn]
  q = np.clip(np.round(w / full), -8, 7).astype(np.int8)
  return torch.from_numpy(q), scale


def to_kimi_k25_int4_checkpoint(src: str, dst: str, group: int = 32) -> None:
  """Copies DeepSeek-V3 checkpoint ``src`` to ``dst`` as Kimi-K2.5 publishes it: routed experts
  INT4 (packed with compressed-tensors' own ``pack_to_int32``), the rest as stored, text
  weights under ``language_model.``, a vision tensor, a ``kimi_k25`` config wrapper."""
  os.makedirs(dst, exist_ok=True)
  tensors = safetensors.torch.load_file(os.path.join(src, "model.safetensors"))
  out = {"vision_tower.patch_embed.proj.weight": torch.ones(4, 3),
         "mm_projector.linear_1.weight": torch.ones(2, 2)}
  for name, w in tensors.items():
    if _EXPERT.match(name):
      q, scale = quantize_int4(w.float().numpy(), group)
      module = "language_model." + name.removesuffix(".weight")
      out[module + ".weight_packed"] = pack_to_int32(q, 4)
      out[module + ".weight_scale"] = scale
      out[module + ".weight_shape"] = torch.tensor(list(w.shape))
    else:
      out["language_model." + name] = w
  safetensors.torch.save_file(out, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(src, "config.json")) as f:
    text = json.load(f)
  quant = json.loads(json.dumps(KIMI_K25_QUANT))
  quant["config_groups"]["group_0"]["weights"]["group_size"] = group
  cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
         "text_config": text, "vision_config": {"model_type": "moonvit"},
         "quantization_config": quant}
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)


def int4_dequantized_copy(src: str, dst: str) -> None:
  """Writes Kimi-K2.5-style INT4 checkpoint ``src`` as a plain float32 DeepSeek-V3 checkpoint
  (unpacked with compressed-tensors' ``unpack_from_int32``, times the scales)."""
  os.makedirs(dst, exist_ok=True)
  tensors = safetensors.torch.load_file(os.path.join(src, "model.safetensors"))
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  group = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
  out = {}
  for name, w in tensors.items():
    if not name.startswith("language_model.") or name.endswith(("_scale", "_shape")):
      continue
    name = name.removeprefix("language_model.")
    if name.endswith(".weight_packed"):
      module = "language_model." + name.removesuffix(".weight_packed")
      shape = torch.Size(tensors[module + ".weight_shape"].tolist())
      q = unpack_from_int32(w, 4, shape).float()
      s = tensors[module + ".weight_scale"].float().repeat_interleave(group, 1)[:, :shape[1]]
      out[name.removesuffix("_packed")] = q * s
    else:
      out[name] = w.float()
  safetensors.torch.save_file(out, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg["text_config"], f)
