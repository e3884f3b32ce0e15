"""Configuration of Llama-family targets (Llama, Qwen2, Qwen3).

``LlamaConfig.from_hf`` reads a Hugging Face ``config.json`` dict and *refuses* what the model
does not implement (another activation, sliding windows, MLP biases, unknown fields), naming
the field, instead of silently computing something else.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from eagle3jax import checks
from eagle3jax.rope import LLAMA_ROPE_TYPES, RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# transformers' head_dim when a config.json leaves it out (Qwen3Config's default is 128, not
# hidden_size // num_attention_heads as for Llama and Qwen2).
_DEFAULT_HEAD_DIM = {"qwen3": 128}
# Fields only an EAGLE-3 drafter's config.json has (a target's never does).
DRAFTER_CONFIG_FIELDS = frozenset({"draft_vocab_size", "target_hidden_size", "eagle_config"})

# Fields of Hugging Face configs that do not change the forward pass.
_IGNORED_HF_FIELDS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "initializer_range", "use_cache", "pad_token_id",
    "bos_token_id", "pretraining_tp", "attention_dropout", "_name_or_path", "tokenizer_class",
    "max_window_layers", "layer_types", "use_sliding_window", "sliding_window",
    "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "model_type",
    "eos_token_id", "tie_word_embeddings", "head_dim", "attention_bias", "mlp_bias",
    "hidden_act", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "auto_map",
    "use_return_dict", "tf_legacy_loss", "use_bfloat16", "torchscript", "pruned_heads",
    "tie_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "_attn_implementation_autoset", "generation_config", "embedding_multiplier",
})


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama-family decoder-only transformer.

  Attributes:
    vocab_size: V, the vocabulary size.
    hidden_size: D, the model width.
    intermediate_size: F, the SwiGLU MLP width.
    num_hidden_layers: L, the number of decoder layers.
    num_attention_heads: N, query heads.
    num_key_value_heads: K, key/value heads (GQA); must divide N.
    head_dim: H; ``hidden_size // num_attention_heads`` unless given (Qwen3 gives it).
    rms_norm_eps: epsilon of every RMSNorm.
    rope: rotary embedding settings.
    max_position_embeddings: context length the model was trained for.
    tie_word_embeddings: the LM head reuses the token embedding.
    qkv_bias: q/k/v projections have biases (Qwen2; Llama/Qwen3 ``attention_bias``).
    o_bias: the output projection has a bias (Llama/Qwen3 ``attention_bias``).
    qk_norm: RMSNorm over the head dim of q and k before RoPE (Qwen3).
    model_type: ``llama``, ``qwen2`` or ``qwen3``.
    eos_token_ids: token ids that end a sequence.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = RopeConfig()
  max_position_embeddings: int = 8192
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  qk_norm: bool = False
  model_type: str = "llama"
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    checks.norm_eps("config field rms_norm_eps", self.rms_norm_eps)
    checks.int_fields(self, ("vocab_size", "hidden_size", "intermediate_size",
                             "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads"), 1, "config field")
    object.__setattr__(self, "eos_token_ids", checks.token_ids(
        "config field eos_token_id", tuple(self.eos_token_ids), self.vocab_size))
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"config field num_key_value_heads={self.num_key_value_heads} must divide "
          f"num_attention_heads={self.num_attention_heads}")
    if self.head_dim is None and self.hidden_size % self.num_attention_heads:
      raise ValueError(
          f"config field hidden_size={self.hidden_size} is not divisible by "
          f"num_attention_heads={self.num_attention_heads}; give head_dim explicitly")
    if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
      raise ValueError(f"config field head_dim={self.head_dim} must be a positive even number")
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"config field model_type={self.model_type!r} is not supported; "
                       f"supported: {SUPPORTED_MODEL_TYPES}")
    if self.rope.rope_type not in LLAMA_ROPE_TYPES:
      raise ValueError(f"config field rope.rope_type={self.rope.rope_type!r} is not supported "
                       f"by Llama-family targets (they implement {LLAMA_ROPE_TYPES}; YaRN's "
                       "attention factor is implemented for DeepSeek-V3/Kimi-K2 only)")

  @functools.cached_property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.hidden_size // self.num_attention_heads

  @classmethod
  def tiny(cls, **overrides) -> "LlamaConfig":
    """A small config with distinct sizes, for tests."""
    base = dict(vocab_size=131, hidden_size=64, intermediate_size=88, num_hidden_layers=5,
                num_attention_heads=8, num_key_value_heads=2, head_dim=None,
                rope=RopeConfig(theta=10000.0), max_position_embeddings=512,
                eos_token_ids=(2,))
    base.update(overrides)
    return cls(**base)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "LlamaConfig":
    """Builds the config from a Hugging Face ``config.json`` dict (both rope styles)."""
    hf = dict(hf)
    model_type = hf.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"config field model_type={model_type!r} is not supported by the "
                       f"Llama-family target; supported: {SUPPORTED_MODEL_TYPES}")
    unknown = sorted(k for k in hf if k not in _IGNORED_HF_FIELDS and not k.startswith("_"))
    drafter_fields = sorted(set(unknown) & DRAFTER_CONFIG_FIELDS)
    if drafter_fields:
      raise ValueError(f"this config.json looks like an EAGLE-3 drafter's (fields "
                       f"{drafter_fields}), not a target's: pass it as the drafter "
                       "(--drafter / load_drafter) and the target model as the target")
    if unknown:
      raise ValueError(f"config.json has fields eagle3jax does not implement: {unknown}. "
                       "Remove them if they are harmless, or use a supported model.")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"config field hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window") or (model_type == "llama" and hf.get("sliding_window")):
      raise ValueError("config field use_sliding_window/sliding_window: sliding-window "
                       "attention is not supported")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
      raise ValueError(f"config field layer_types has non-full attention layers "
                       f"{sorted(set(layer_types))}: not supported")
    if hf.get("mlp_bias"):
      raise ValueError("config field mlp_bias=true is not supported")
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
      raise ValueError(f"config.json is missing required fields {missing}")
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=(hf["num_attention_heads"] if hf.get("num_key_value_heads") is None
                             else hf["num_key_value_heads"]),
        head_dim=(_DEFAULT_HEAD_DIM.get(model_type) if hf.get("head_dim") is None
                  else hf["head_dim"]),
        rms_norm_eps=checks.hf_number(hf, "rms_norm_eps", 1e-6),
        rope=RopeConfig.from_hf(hf),
        max_position_embeddings=checks.hf_number(hf, "max_position_embeddings", 8192, int),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        qk_norm=model_type == "qwen3",
        model_type=model_type,
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )
