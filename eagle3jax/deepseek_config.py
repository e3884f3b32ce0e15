"""Configuration of DeepSeek-V3 / Kimi-K2 targets (MLA attention, noaux_tc mixture of experts).

``DeepseekConfig.from_hf`` reads a Hugging Face ``config.json`` dict (``model_type``
``deepseek_v3`` or ``kimi_k2``; a Kimi-K2.5 style wrapper with the language model under
``text_config`` is unwrapped) in both rope styles, and *refuses* what the model does not
implement (other scoring or top-k methods, biases, unknown fields), naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from eagle3jax import checks
from eagle3jax.config import _IGNORED_HF_FIELDS
from eagle3jax.rope import SUPPORTED_ROPE_TYPES, RopeConfig

DEEPSEEK_MODEL_TYPES = ("deepseek_v3", "kimi_k2")

# Routing fields whose defaults differ: (DeepSeek's remote code, transformers' DeepseekV3Config).
_ROUTING_DEFAULTS = {"norm_topk_prob": (False, True), "routed_scaling_factor": (1.0, 2.5),
                     "n_group": (None, 8), "topk_group": (None, 4)}
# Fields read by ``from_hf`` or that do not change the forward pass (training-only losses,
# expert-parallel size, multi-token-prediction heads, derived sizes, quantisation (the
# loader's business)).
_KNOWN_HF_FIELDS = _IGNORED_HF_FIELDS | frozenset({
    "moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "qk_head_dim", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor", "n_group",
    "topk_group", "norm_topk_prob", "scoring_func", "topk_method", "moe_layer_freq",
    "rope_interleave", "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers",
    "num_mtp_layers", "output_router_logits", "router_aux_loss_coef", "quantization_config",
    "text_config",
})


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
  """A DeepSeek-V3 family decoder (DeepSeek-V3/R1, Kimi-K2).

  Attributes:
    vocab_size: V, the vocabulary size.
    hidden_size: D, the model width.
    intermediate_size: F of the dense SwiGLU MLP (layers below ``first_k_dense_replace``).
    moe_intermediate_size: F of each routed expert (shared experts: times
      ``n_shared_experts``).
    num_hidden_layers: L, the number of decoder layers.
    num_attention_heads: N, attention heads.
    q_lora_rank: rank of the query down-projection (``q_a_proj``); None: a full ``q_proj``.
    kv_lora_rank: C, width of the compressed (latent) key/value, the cached per-token state.
    qk_nope_head_dim: query/key head dims without rotary embedding.
    qk_rope_head_dim: query/key head dims with rotary embedding (one key shared by heads).
    v_head_dim: value head dim.
    n_routed_experts: E, routed experts per MoE layer.
    num_experts_per_tok: experts chosen per token.
    n_shared_experts: always-on experts (one SwiGLU of width ``n_shared * moe_intermediate``).
    first_k_dense_replace: layers ``0 .. first_k_dense_replace - 1`` use the dense MLP.
    routed_scaling_factor: multiplies the routing weights.
    n_group: expert groups for group-limited routing (must divide E).
    topk_group: groups a token may route to.
    norm_topk_prob: normalise the chosen experts' weights to sum to 1.
    rms_norm_eps: epsilon of the residual-stream norms (the q/kv latent norms use 1e-6, as
      DeepSeek's code does).
    rope: rotary settings (``yarn`` for the published checkpoints).
    rope_interleave: rotary pairs are interleaved ``(x0, x1), (x2, x3) ...`` (DeepSeek's
      layout); False: half-split pairs as Llama.
    max_position_embeddings: the context length.
    tie_word_embeddings: the LM head reuses the token embedding.
    model_type: ``deepseek_v3`` or ``kimi_k2``.
    eos_token_ids: token ids that end a sequence.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  moe_intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  q_lora_rank: int | None
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  n_routed_experts: int
  num_experts_per_tok: int
  n_shared_experts: int = 1
  first_k_dense_replace: int = 1
  routed_scaling_factor: float = 1.0
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = RopeConfig()
  rope_interleave: bool = True
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  model_type: str = "deepseek_v3"
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    checks.norm_eps("config field rms_norm_eps", self.rms_norm_eps)
    checks.int_fields(self, ("vocab_size", "hidden_size", "intermediate_size",
                             "moe_intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                             "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                             "num_experts_per_tok", "n_group", "topk_group"), 1, "config field")
    checks.int_fields(self, ("n_shared_experts", "first_k_dense_replace"), 0, "config field")
    object.__setattr__(self, "eos_token_ids", checks.token_ids(
        "config field eos_token_id", tuple(self.eos_token_ids), self.vocab_size))
    if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int)
                                         or self.q_lora_rank < 1):
      raise ValueError(f"config field q_lora_rank={self.q_lora_rank!r} must be a positive "
                       "integer or null")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"config field qk_rope_head_dim={self.qk_rope_head_dim} must be even")
    if self.n_routed_experts % self.n_group:
      raise ValueError(f"config field n_group={self.n_group} must divide "
                       f"n_routed_experts={self.n_routed_experts}")
    if self.topk_group > self.n_group:
      raise ValueError(f"config field topk_group={self.topk_group} exceeds "
                       f"n_group={self.n_group}")
    if self.experts_per_group < 2:
      raise ValueError(f"config field n_group={self.n_group}: groups are scored by their two "
                       f"best experts, so each needs >= 2 (n_routed_experts="
                       f"{self.n_routed_experts})")
    if self.num_experts_per_tok > self.topk_group * self.experts_per_group:
      raise ValueError(f"config field num_experts_per_tok={self.num_experts_per_tok} exceeds "
                       f"the {self.topk_group * self.experts_per_group} experts in "
                       f"topk_group={self.topk_group} groups")
    if self.model_type not in DEEPSEEK_MODEL_TYPES:
      raise ValueError(f"config field model_type={self.model_type!r} is not supported; "
                       f"supported: {DEEPSEEK_MODEL_TYPES}")

  @functools.cached_property
  def experts_per_group(self) -> int:
    return self.n_routed_experts // self.n_group

  @functools.cached_property
  def qk_head_dim(self) -> int:
    """Width of one query/key head: ``qk_nope_head_dim + qk_rope_head_dim``."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @functools.cached_property
  def softmax_scale(self) -> float:
    """``qk_head_dim ** -0.5`` with YaRN's ``mscale ** 2`` correction."""
    return self.rope.softmax_scale(self.qk_head_dim)

  def is_moe_layer(self, i: int) -> bool:
    return i >= self.first_k_dense_replace

  @classmethod
  def tiny(cls, **overrides) -> "DeepseekConfig":
    """A small config keeping every path alive (YaRN, grouped routing, shared expert)."""
    base = dict(vocab_size=131, hidden_size=64, intermediate_size=88, moe_intermediate_size=24,
                num_hidden_layers=4, num_attention_heads=8, q_lora_rank=40, kv_lora_rank=32,
                qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=2.5, n_group=2, topk_group=1, rms_norm_eps=1e-5,
                rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0,
                                original_max_position_embeddings=16, mscale=0.707,
                                mscale_all_dim=0.707),
                max_position_embeddings=512, eos_token_ids=(2,))
    base.update(overrides)
    return cls(**base)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "DeepseekConfig":
    """Builds the config from a Hugging Face ``config.json`` dict (both rope styles)."""
    hf = unwrap_text_config(hf)
    model_type = hf.get("model_type")
    if model_type not in DEEPSEEK_MODEL_TYPES:
      raise ValueError(f"config field model_type={model_type!r} is not supported by the "
                       f"DeepSeek-family target; supported: {DEEPSEEK_MODEL_TYPES}")
    unknown = sorted(k for k in hf if k not in _KNOWN_HF_FIELDS and not k.startswith("_"))
    if unknown:
      raise ValueError(f"config.json has fields eagle3jax does not implement: {unknown}. "
                       "Remove them if they are harmless, or use a supported model.")
    fixed = [("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
             ("moe_layer_freq", 1), ("attention_bias", False)]
    for field, want in fixed:
      if field in hf and hf[field] != want:
        raise ValueError(f"config field {field}={hf[field]!r} is not supported (only "
                         f"{want!r})")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                           "v_head_dim", "n_routed_experts", "num_experts_per_tok") if k not in hf]
    if missing:
      raise ValueError(f"config.json is missing required fields {missing}")
    routing = [k for k in _ROUTING_DEFAULTS if k not in hf]
    if routing:  # the weights cannot tell which default the model was trained with
      raise ValueError(
          f"config.json leaves out the routing fields {routing}, whose defaults differ "
          "between DeepSeek's own code and transformers ("
          + ", ".join(f"{k}: {a} against {b}" for k, (a, b) in _ROUTING_DEFAULTS.items()
                      if k in routing)
          + "); state them in config.json (the published configs do)")
    if not isinstance(hf["norm_topk_prob"], bool):
      raise ValueError(f"config field norm_topk_prob={hf['norm_topk_prob']!r} must be true or "
                       "false")
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return cls(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], n_routed_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        n_shared_experts=_count(hf, "n_shared_experts", 0),
        first_k_dense_replace=_count(hf, "first_k_dense_replace", 0),
        routed_scaling_factor=checks.hf_number(hf, "routed_scaling_factor", None),
        n_group=_count(hf, "n_group", 1), topk_group=_count(hf, "topk_group", 1),
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        rms_norm_eps=checks.hf_number(hf, "rms_norm_eps", 1e-6),
        rope=RopeConfig.from_hf(hf, rope_types=SUPPORTED_ROPE_TYPES),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        max_position_embeddings=checks.hf_number(hf, "max_position_embeddings", 4096, int),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        model_type=model_type, eos_token_ids=tuple(int(e) for e in eos_ids))


def _count(hf: Mapping[str, Any], key: str, if_null: int) -> int:
  """An integer field whose null (or absence) means ``if_null`` (no shared experts, no dense
  layers, one expert group), as in DeepSeek's own config class."""
  return if_null if hf.get(key) is None else checks.hf_number(hf, key, None, int)


def unwrap_text_config(hf: Mapping[str, Any]) -> dict:
  """The language-model part of a config: ``text_config`` when present (Kimi-K2.5 style,
  keeping a top-level ``quantization_config`` the text part lacks), else the dict itself."""
  hf = dict(hf)
  text = hf.get("text_config")
  if text is None:
    return hf
  text = dict(text)
  if "quantization_config" in hf and "quantization_config" not in text:
    text["quantization_config"] = hf["quantization_config"]
  return text


def hf_model_type(hf: Mapping[str, Any]) -> str | None:
  """``model_type`` of a config's language model (``text_config`` first)."""
  text = hf.get("text_config")
  if isinstance(text, Mapping) and "model_type" in text:
    return text["model_type"]
  return hf.get("model_type")
