"""The EAGLE-3 drafter: one Llama decoder layer over [token embedding, fused target features].

For drafter position ``s`` (reference: EAGLE-3, Li et al. 2025)::

    e_s = E[x_{s+1}]                       # the NEXT token's embedding (target's table)
    g_s = fc(concat(low_s, mid_s, high_s)) # 3D -> D, no bias; deeper draft steps: own a_{s-1}
    z_s = concat(input_layernorm(e_s), hidden_norm(g_s))          # [B, T, 2D]
    u_s = g_s + o_proj(Attn(q_proj(z), k_proj(z), v_proj(z)))     # residual from g
    a_s = u_s + mlp(post_attention_layernorm(u_s))
    logits_s = lm_head(norm(a_s))          # over the draft vocabulary

Draft ids map to target ids with ``i + d2t[i]``. The token embedding is the target's
``embed_tokens`` variable itself (shared, not copied) unless the checkpoint carries its own.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3jax import attention as attn_lib
from eagle3jax import checks
from eagle3jax import kv_cache as kv_lib
from eagle3jax.capture import CaptureSpec
from eagle3jax.layers import RMSNorm, einsum, merge_heads, param
from eagle3jax.llama import ACT, LlamaMLP, kv_head_replication
from eagle3jax.rope import LLAMA_ROPE_TYPES, RopeConfig, apply_rope
from eagle3jax.sharding import (BATCH, CAPTURE, EMBED, HEAD_DIM, HEADS, KV_HEADS, SEQ, VOCAB,
                                out_spec, require_mesh, shard)
from eagle3jax.semantics import standard_numpy


class Buffer(nnx.Variable):
  """A non-trainable array stored with the model (``d2t``, ``t2d``)."""


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  """An EAGLE-3 drafter.

  Attributes:
    hidden_size: D of the drafter.
    intermediate_size: F of its MLP.
    num_attention_heads: N.
    num_key_value_heads: K.
    head_dim: H (default ``hidden_size // num_attention_heads``).
    rms_norm_eps: epsilon of the norms.
    rope: rotary settings; ``rope_theta`` of the drafter config, 10000 when absent.
    max_position_embeddings: the drafter's trained context length.
    vocab_size: the target vocabulary size.
    draft_vocab_size: size of the draft vocabulary (rows of ``lm_head``).
    target_hidden_size: width of each captured target feature (default ``hidden_size``).
    capture: the target hidden states this drafter was trained on (project convention).
  """
  hidden_size: int
  intermediate_size: int
  num_attention_heads: int
  num_key_value_heads: int
  vocab_size: int
  draft_vocab_size: int
  capture: CaptureSpec
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = RopeConfig(theta=10000.0)
  max_position_embeddings: int = 2048
  target_hidden_size: int | None = None

  def __post_init__(self):
    checks.norm_eps("drafter config field rms_norm_eps", self.rms_norm_eps)
    checks.int_fields(self, ("hidden_size", "intermediate_size", "num_attention_heads",
                             "num_key_value_heads", "vocab_size", "draft_vocab_size"), 1,
                      "drafter config field")
    if self.head_dim is not None and (not checks.is_integer(self.head_dim) or self.head_dim < 2
                                      or self.head_dim % 2):
      raise ValueError(f"drafter config field head_dim={self.head_dim!r} must be a positive "
                       "even number (RoPE rotates pairs of dimensions)")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"drafter config num_key_value_heads={self.num_key_value_heads} must "
                       f"divide num_attention_heads={self.num_attention_heads}")
    if self.draft_vocab_size > self.vocab_size:
      raise ValueError(f"drafter config draft_vocab_size={self.draft_vocab_size} exceeds "
                       f"vocab_size={self.vocab_size}")
    if self.rope.rope_type not in LLAMA_ROPE_TYPES:
      raise ValueError(f"drafter config field rope.rope_type={self.rope.rope_type!r} is not "
                       f"supported: the drafter is a Llama layer and implements "
                       f"{LLAMA_ROPE_TYPES} (no YaRN attention factor), as the public EAGLE-3 "
                       "drafter layout other engines load")
    if not isinstance(self.capture, CaptureSpec):
      raise ValueError("drafter config capture must be a CaptureSpec")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.hidden_size // self.num_attention_heads

  @property
  def feature_size(self) -> int:
    """Width of one target feature (``target_hidden_size`` or ``hidden_size``)."""
    return self.target_hidden_size or self.hidden_size

  @classmethod
  def for_target(cls, target_cfg, capture: CaptureSpec, draft_vocab_size: int | None = None,
                 **overrides) -> "DrafterConfig":
    """A drafter shaped like one Llama layer of ``target_cfg``'s width (the usual EAGLE-3
    choice; for MLA targets such as DeepSeek-V3, a GQA-free Llama layer as Kimi-K2 drafters)."""
    heads = target_cfg.num_attention_heads
    base = dict(hidden_size=target_cfg.hidden_size,
                intermediate_size=target_cfg.intermediate_size,
                num_attention_heads=heads,
                num_key_value_heads=getattr(target_cfg, "num_key_value_heads", heads),
                head_dim=getattr(target_cfg, "head_dim", None),
                rms_norm_eps=target_cfg.rms_norm_eps,
                vocab_size=target_cfg.vocab_size,
                draft_vocab_size=(target_cfg.vocab_size if draft_vocab_size is None
                                  else draft_vocab_size), capture=capture,
                max_position_embeddings=target_cfg.max_position_embeddings)
    base.update(overrides)
    return cls(**base)


class DrafterAttention(nnx.Module):
  def __init__(self, cfg: DrafterConfig, kv_repeat: int, dtype):
    d, n, h = cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim
    k = cfg.num_key_value_heads * kv_repeat
    self.q_proj = param((2 * d, n, h), (EMBED, HEADS, HEAD_DIM), dtype)
    self.k_proj = param((2 * d, k, h), (EMBED, KV_HEADS, HEAD_DIM), dtype)
    self.v_proj = param((2 * d, k, h), (EMBED, KV_HEADS, HEAD_DIM), dtype)
    self.o_proj = param((n, h, d), (HEADS, HEAD_DIM, EMBED), dtype)
    self.cfg = cfg


class Eagle3Drafter(nnx.Module):
  """The drafter. Build with ``eagle3jax.load_drafter`` or ``eagle3jax.init_drafter``."""

  def __init__(self, cfg: DrafterConfig, *, kv_repeat: int = 1, own_embedding: bool = False,
               dtype=jnp.float32):
    d = cfg.hidden_size
    self.config = cfg
    self.kv_repeat = kv_repeat
    self.own_embedding = own_embedding
    if own_embedding:
      self.embed_tokens = param((cfg.vocab_size, d), (VOCAB, EMBED), dtype)
    self.fc = param((len(cfg.capture.layer_ids) * cfg.feature_size, d), (CAPTURE, EMBED), dtype)
    self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    self.self_attn = DrafterAttention(cfg, kv_repeat, dtype)
    self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    self.mlp = LlamaMLP(d, cfg.intermediate_size, dtype)
    self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    self.lm_head = param((d, cfg.draft_vocab_size), (EMBED, VOCAB), dtype)
    self.d2t = Buffer(jnp.zeros((cfg.draft_vocab_size,), jnp.int32), axes=(None,),
                      init="zeros")
    self.t2d = Buffer(jnp.zeros((cfg.vocab_size,), jnp.bool_), axes=(None,), init="ones")

  @property
  def dtype(self):
    return self.fc.get_value().dtype

  @property
  def cache_kv_heads(self) -> int:
    return self.config.num_key_value_heads * self.kv_repeat

  def allocate_cache(self, batch: int, max_len: int, fill=None) -> kv_lib.KVCache:
    return kv_lib.KVCache.allocate(1, batch, max_len, self.cache_kv_heads,
                                   self.config.resolved_head_dim, self.dtype, fill)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings ``[B, T, D]`` from the shared (or own) table."""
    table = self.embed_tokens[...]
    shape = tokens.shape + (table.shape[1],)
    return table.at[tokens].get(out_sharding=out_spec(ACT, shape)).astype(self.dtype)

  @standard_numpy
  def project(self, aux: jax.Array) -> jax.Array:
    """``fc``: fused target features ``[B, T, k*Dt]`` -> drafter hidden ``[B, T, D]``."""
    return einsum("BTC,CD->BTD", aux.astype(self.dtype), self.fc[...], ACT)

  @standard_numpy
  def logits(self, a: jax.Array) -> jax.Array:
    """Draft-vocab float32 logits from pre-norm outputs ``a [B, T, D]``."""
    out = einsum("BTD,DV->BTV", self.norm(a), self.lm_head[...], (BATCH, SEQ, VOCAB))
    return out.astype(jnp.float32)

  def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
    """Target ids of draft ids ``[B, ...]``: ``i + d2t[i]``."""
    axes = (BATCH,) + (None,) * (draft_ids.ndim - 1)
    offsets = self.d2t[...].at[draft_ids].get(out_sharding=out_spec(axes, draft_ids.shape))
    return draft_ids + offsets

  # The layer's maths is split in two so that training (eagle3jax.training.ttt), which attends
  # over keys of earlier unrolled steps, runs the projections and the output that serve; its
  # steps >= 1 attend with ttt.ttt_step_layer, tested equal to the masked attention.
  @property
  def attention_scale(self) -> float:
    return 1.0 / math.sqrt(self.config.resolved_head_dim)

  def attention_inputs(self, tokens, hidden, positions):
    """``(hidden, q [B,T,N,H], k [B,T,K,H], v)``: z = [norm(e), norm(hidden)], projected,
    RoPE on q and k."""
    cfg = self.config
    hidden = shard(hidden.astype(self.dtype), ACT)
    e = self.embed(tokens)
    z = jnp.concatenate([self.input_layernorm(e), self.hidden_norm(hidden)], axis=-1)
    attn = self.self_attn
    q = jnp.einsum("BTD,DNH->BTNH", z, attn.q_proj[...])
    k = jnp.einsum("BTD,DKH->BTKH", z, attn.k_proj[...])
    v = jnp.einsum("BTD,DKH->BTKH", z, attn.v_proj[...])
    inv_freq = cfg.rope.inv_frequencies(cfg.resolved_head_dim)
    return hidden, apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

  def attention_output(self, hidden, o):
    """``a``: residual from ``hidden`` (not the embedding), o_proj, then the SwiGLU MLP."""
    u = shard(hidden + merge_heads(o, self.self_attn.o_proj[...], ACT), ACT)
    return shard(u + self.mlp(self.post_attention_layernorm(u)), ACT)

  @standard_numpy
  def __call__(self, tokens, hidden, positions, cache: kv_lib.KVCache | None = None,
               tree_mask=None, write_at=None):
    """One drafter layer. Call it under ``jax.set_mesh(drafter.mesh)`` (the target's), in or
    out of ``jax.jit``; ``eagle3jax.draft_logits`` runs it for a full sequence.

    Args:
      tokens: ``[B, T]`` next-token ids (their embeddings are ``e``).
      hidden: ``[B, T, D]``: ``fc`` of target features, or the drafter's own earlier ``a``.
      positions: ``[B, T]`` RoPE positions.
      cache: the drafter's one-layer ``KVCache`` (None: attend among the T tokens only).
      tree_mask: ``[B, T, W]``: new token ``i`` sees window slot ``lengths[b] + j``.
      write_at: ``[B]`` slot where the T new keys are written (default ``cache.lengths``).

    Returns:
      ``(a [B, T, D] pre-norm outputs, cache)``.
    """
    require_mesh("the drafter", "drafter", "or use eagle3jax.draft_logits(drafter, ...)")
    b, t = tokens.shape
    if tree_mask is None:
      tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    hidden, q, k, v = self.attention_inputs(tokens, hidden, positions)
    if cache is None:
      k_buf, v_buf = kv_lib.as_slab(k), kv_lib.as_slab(v)
      lengths = jnp.zeros((b,), jnp.int32)
    else:
      lengths = cache.lengths
      start = lengths if write_at is None else write_at
      k_view = kv_lib.LayerKV(cache.k, 0).write(k, start)
      v_view = kv_lib.LayerKV(cache.v, 0).write(v, start)
      k_buf, v_buf = k_view.read(), v_view.read()
    o = attn_lib.attend(q, k_buf, v_buf, lengths, tree_mask, scale=self.attention_scale,
                        impl="xla")
    a = self.attention_output(hidden, o)
    new_cache = (None if cache is None
                 else kv_lib.KVCache(k_view.stacked, v_view.stacked, lengths))
    return a, new_cache


def drafter_kv_repeat(cfg: DrafterConfig, tensor: int) -> int:
  return kv_head_replication(cfg.num_attention_heads, cfg.num_key_value_heads, tensor)
