"""Llama-family target model (Llama, Qwen2, Qwen3) in Flax NNX.

Axis letters: B batch, T new tokens, S cache slots, D model, F MLP, V vocab, N query heads,
K kv heads, H head dim.

One forward serves every use: with ``cache=None`` it runs a full sequence (causal); with a
cache it appends ``T`` tokens at ``positions`` after each row's committed prefix, new token
``i`` seeing new token ``j`` only where ``tree_mask[b, i, j]`` (prefill is this with empty
rows and a causal mask; tree verification with the tree's ancestor mask). Captures follow
``eagle3jax.capture``.

KV heads on a tensor-parallel mesh: when the tensor axis does not divide K, the k/v
projections are replicated ``kv_repeat`` times (head ``k`` becomes heads ``k*r .. k*r+r-1``),
as serving engines do, so that every tensor rank owns the KV heads its query heads read.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3jax import attention as attn_lib
from eagle3jax import kv_cache as kv_lib
from eagle3jax import stack as stack_lib
from eagle3jax.config import LlamaConfig
from eagle3jax.decoder import ACT, DecoderLayer, DecoderLM
from eagle3jax.layers import RMSNorm, einsum, merge_heads, param
from eagle3jax.quant import linear_param
from eagle3jax.rope import apply_rope
from eagle3jax.sharding import EMBED, HEAD_DIM, HEADS, KV_HEADS, MLP, VOCAB


def kv_head_replication(num_heads: int, num_kv_heads: int, tensor: int) -> int:
  """How many times each KV head is replicated so ``tensor`` ranks each own whole KV heads.

  1 when ``tensor`` divides K (or when heads are not sharded at all because ``tensor`` does
  not divide N); otherwise ``lcm(K, tensor) / K``.
  """
  if num_kv_heads % tensor == 0 or num_heads % tensor:
    return 1
  return math.lcm(num_kv_heads, tensor) // num_kv_heads


class LlamaAttention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, kv_repeat: int, dtype):
    d, n, h = cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim
    k = cfg.num_key_value_heads * kv_repeat
    self.q_proj = param((d, n, h), (EMBED, HEADS, HEAD_DIM), dtype)
    self.k_proj = param((d, k, h), (EMBED, KV_HEADS, HEAD_DIM), dtype)
    self.v_proj = param((d, k, h), (EMBED, KV_HEADS, HEAD_DIM), dtype)
    self.o_proj = param((n, h, d), (HEADS, HEAD_DIM, EMBED), dtype)
    if cfg.qkv_bias:
      self.q_bias = param((n, h), (HEADS, HEAD_DIM), dtype, init="zeros")
      self.k_bias = param((k, h), (KV_HEADS, HEAD_DIM), dtype, init="zeros")
      self.v_bias = param((k, h), (KV_HEADS, HEAD_DIM), dtype, init="zeros")
    if cfg.o_bias:
      self.o_bias = param((d,), (EMBED,), dtype, init="zeros")
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
      self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
    self.cfg = cfg

  def __call__(self, x, positions, k_buf, v_buf, lengths, tree_mask, impl):
    cfg = self.cfg
    q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...])
    k = jnp.einsum("BTD,DKH->BTKH", x, self.k_proj[...])
    v = jnp.einsum("BTD,DKH->BTKH", x, self.v_proj[...])
    if cfg.qkv_bias:
      q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = cfg.rope.inv_frequencies(cfg.resolved_head_dim)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    if k_buf is None:  # full sequence: the new tokens are the whole key set
      keys, values = kv_lib.as_slab(k), kv_lib.as_slab(v)
    else:  # kv_cache.LayerKV views: write the new tokens, attend over the layer's slab
      k_buf, v_buf = k_buf.write(k, lengths), v_buf.write(v, lengths)
      keys, values = k_buf.read(), v_buf.read()
    out = attn_lib.attend(q, keys, values, lengths, tree_mask,
                          scale=1.0 / math.sqrt(q.shape[-1]), impl=impl)
    y = merge_heads(out, self.o_proj[...], ACT)
    if cfg.o_bias:
      y = y + self.o_bias[...]
    return y, k_buf, v_buf


class LlamaMLP(nnx.Module):
  """SwiGLU MLP; ``schemes`` (path -> ``QuantScheme``, paths ``prefix + "gate_proj"`` ...)
  quantizes its linears (``eagle3jax.quant``; DeepSeek's dense and shared-expert MLPs)."""

  def __init__(self, d: int, f: int, dtype, schemes=None, prefix: str = "mlp."):
    schemes = schemes or {}
    self.gate_proj = linear_param((d, f), (EMBED, MLP), dtype, n_out=1,
                                  scheme=schemes.get(prefix + "gate_proj"))
    self.up_proj = linear_param((d, f), (EMBED, MLP), dtype, n_out=1,
                                scheme=schemes.get(prefix + "up_proj"))
    self.down_proj = linear_param((f, d), (MLP, EMBED), dtype, n_out=1,
                                  scheme=schemes.get(prefix + "down_proj"))

  def __call__(self, x):
    gate = jnp.einsum("BTD,DF->BTF", x, self.gate_proj[...])
    up = jnp.einsum("BTD,DF->BTF", x, self.up_proj[...])
    return einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, self.down_proj[...], ACT)


class LlamaDecoderLayer(DecoderLayer):
  def __init__(self, cfg: LlamaConfig, kv_repeat: int, dtype):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.self_attn = LlamaAttention(cfg, kv_repeat, dtype)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, dtype)


class LlamaForCausalLM(DecoderLM):
  """A Llama/Qwen2/Qwen3 causal LM (forward: ``DecoderLM.__call__``). Build with
  ``eagle3jax.load_target`` or ``eagle3jax.init_target``; ``kv_repeat`` comes from the mesh."""

  def __init__(self, cfg: LlamaConfig, *, kv_repeat: int = 1, dtype=jnp.float32):
    d, v = cfg.hidden_size, cfg.vocab_size
    self.config = cfg
    self.kv_repeat = kv_repeat
    self.embed_tokens = param((v, d), (VOCAB, EMBED), dtype)
    # All layers in one stack [L, ...], run as a scan (eagle3jax.stack).
    self.layers = stack_lib.stack_layers(lambda: LlamaDecoderLayer(cfg, kv_repeat, dtype),
                                         cfg.num_hidden_layers)
    self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = param((d, v), (EMBED, VOCAB), dtype)

  def stacked_layers(self):
    return [(self.layers, 0)]

  # --- cache geometry, for the engine ---
  @property
  def cache_kv_heads(self) -> int:
    return self.config.num_key_value_heads * self.kv_repeat

  @property
  def cache_head_dim(self) -> int:
    return self.config.resolved_head_dim

  def allocate_cache(self, batch: int, max_len: int, fill=None) -> kv_lib.KVCache:
    return kv_lib.KVCache.allocate(self.num_layers, batch, max_len, self.cache_kv_heads,
                                   self.cache_head_dim, self.dtype, fill)
