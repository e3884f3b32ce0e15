"""DeepSeek-V3 / Kimi-K2 target model in Flax NNX: multi-head latent attention (MLA) and a
sigmoid-routed mixture of experts (reference: DeepSeek-V3 technical report, 2024).

Axis letters: B batch, T new tokens, S cache slots, D model, F MLP, V vocab, N heads, H head
dim, C latent (``kv_lora_rank``), R query latent (``q_lora_rank``), E experts.

The forward has the contract of ``eagle3jax.llama.LlamaForCausalLM`` (same arguments, same
returns, captures through ``CaptureSpec.annotate``), so the engine serves either.

MLA, absorbed form. Per token the cache holds only the normed latent ``ckv [C]`` (in
``cache.k[i]`` as ``[B, 1, S, C]``) and the roped shared key ``k_pe`` (in ``cache.v[i]`` as
``[B, 1, S, qk_rope_head_dim]``, de-interleaved as transformers leaves it). With
``kv_b_proj = [W_k | W_v]`` (``[C, N, nope]``, ``[C, N, v]``)::

    score[n, t, s] = (q_nope[t, n] @ W_k[:, n].T) . ckv[s] + q_pe[t, n] . k_pe[s]
    out[t, n]      = (sum_s p[n, t, s] ckv[s]) @ W_v[:, n]

which equals expanding every cached latent into per-head keys and values. The cache-less
full-sequence forward uses the same code with the new tokens as the whole key set. Attention
runs on the XLA path whatever ``attention_impl`` says (the Pallas kernel is for Llama heads).

MoE: routing and the routed experts live in ``eagle3jax.moe`` (dropless grouped matmuls over
the chosen (token, expert) pairs, expert-parallel under a mesh; the dense evaluation remains as
``impl="reference"``). Experts are stacked ``[E, ...]`` with the ``EXPERT`` axis first, sharded
over ``tensor``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3jax import attention as attn_lib
from eagle3jax import kv_cache as kv_lib
from eagle3jax import moe as moe_lib
from eagle3jax import quant
from eagle3jax import stack as stack_lib
from eagle3jax.decoder import DecoderLayer, DecoderLM
from eagle3jax.deepseek_config import DeepseekConfig
from eagle3jax.layers import RMSNorm, merge_heads, param
from eagle3jax.llama import ACT, LlamaMLP
from eagle3jax.quant import linear_param
from eagle3jax.quant_config import layer_schemes
from eagle3jax.rope import apply_rope
from eagle3jax.sharding import (BATCH, EMBED, EXPERT, HEAD_DIM, HEADS, LAYERS, LORA, SEQ,
                                VOCAB, out_spec)

# Cache layout: one shared "head" (never sharded), latent features replicated.
LATENT_CACHE_AXES = (LAYERS, BATCH, None, SEQ, LORA)
# transformers' DeepseekV3RMSNorm default, used by the q/kv latent norms.
LATENT_NORM_EPS = 1e-6


def rope_rotate(x: jax.Array, positions: jax.Array, cfg: DeepseekConfig) -> jax.Array:
  """RoPE on ``x [B, T, N, H]`` as transformers' DeepSeek-V3 does it.

  Interleaved pairs ``(x0, x1), (x2, x3) ...`` are first de-interleaved into halves, so the
  result is in the half-split layout; cos/sin are scaled by YaRN's attention factor.
  """
  if cfg.rope_interleave:
    x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  out = apply_rope(x, positions, cfg.rope.inv_frequencies(cfg.qk_rope_head_dim))
  factor = cfg.rope.attention_factor
  return out if factor == 1.0 else (out.astype(jnp.float32) * factor).astype(x.dtype)


class MLAttention(nnx.Module):
  """Multi-head latent attention; heads over ``tensor``, the down-projections replicated."""

  def __init__(self, cfg: DeepseekConfig, dtype, schemes=None):
    d, n, c = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    schemes = schemes or {}

    def linear(name, shape, axes, n_out):
      return linear_param(shape, axes, dtype, n_out=n_out,
                          scheme=schemes.get("self_attn." + name))

    if cfg.q_lora_rank is None:
      self.q_proj = linear("q_proj", (d, n, cfg.qk_head_dim), (EMBED, HEADS, HEAD_DIM), 2)
    else:
      r = cfg.q_lora_rank
      self.q_a_proj = linear("q_a_proj", (d, r), (EMBED, LORA), 1)
      self.q_a_layernorm = RMSNorm(r, LATENT_NORM_EPS, dtype, axes=(LORA,))
      self.q_b_proj = linear("q_b_proj", (r, n, cfg.qk_head_dim), (LORA, HEADS, HEAD_DIM), 2)
    self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", (d, c + cfg.qk_rope_head_dim),
                                     (EMBED, LORA), 1)
    self.kv_a_layernorm = RMSNorm(c, LATENT_NORM_EPS, dtype, axes=(LORA,))
    self.kv_b_proj = linear("kv_b_proj", (c, n, cfg.qk_nope_head_dim + cfg.v_head_dim),
                            (LORA, HEADS, HEAD_DIM), 2)
    self.o_proj = linear("o_proj", (n, cfg.v_head_dim, d), (HEADS, HEAD_DIM, EMBED), 1)
    self.cfg = cfg

  def latents(self, x, positions):
    """The per-token cache entries: normed ``ckv [B, T, 1, C]`` and roped ``k_pe [B, T, 1, Hr]``."""
    cfg = self.cfg
    kv = jnp.einsum("BTD,DC->BTC", x, self.kv_a_proj_with_mqa[...])
    ckv = self.kv_a_layernorm(kv[..., :cfg.kv_lora_rank])
    k_pe = rope_rotate(kv[..., None, cfg.kv_lora_rank:], positions, cfg)
    return ckv[:, :, None, :], k_pe

  def queries(self, x, positions):
    """``q_nope [B, T, N, nope]`` and roped ``q_pe [B, T, N, Hr]``."""
    cfg = self.cfg
    if cfg.q_lora_rank is None:
      q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...])
    else:
      qa = self.q_a_layernorm(jnp.einsum("BTD,DR->BTR", x, self.q_a_proj[...]))
      q = jnp.einsum("BTR,RNH->BTNH", qa, self.q_b_proj[...])
    q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    return q_nope, rope_rotate(q_pe, positions, cfg)

  def __call__(self, x, positions, k_buf, v_buf, lengths, tree_mask, impl):
    del impl  # MLA always runs the XLA path (see the module docstring)
    ckv, k_pe = self.latents(x, positions)
    q_nope, q_pe = self.queries(x, positions)
    if k_buf is None:  # full sequence: the new tokens are the whole key set
      keys, values = ckv[:, :, 0], k_pe[:, :, 0]
    else:  # kv_cache.LayerKV views: write the new latents, attend over the layer's slab
      k_buf, v_buf = k_buf.write(ckv, lengths), v_buf.write(k_pe, lengths)
      keys, values = k_buf.read()[:, 0], v_buf.read()[:, 0]  # [B, 1, S, C] -> [B, S, C]
    out = self.attend(q_nope, q_pe, keys, values, lengths, tree_mask)
    return merge_heads(out, self.o_proj[...], ACT), k_buf, v_buf

  def attend(self, q_nope, q_pe, ckv, k_pe, lengths, tree_mask):
    """Absorbed attention over latents ``ckv [B, S, C]``, ``k_pe [B, S, Hr]``: ``[B, T, N, v]``.

    Same visibility as ``eagle3jax.attention.attend``; slots past ``lengths + W`` are zeroed
    first so that garbage (NaN included) cannot reach the output.
    """
    cfg = self.cfg
    b, t, n, _ = q_nope.shape
    s, c = ckv.shape[1], ckv.shape[2]
    w = tree_mask.shape[-1]
    live = (jnp.arange(s, dtype=jnp.int32)[None, :] < (lengths[:, None] + w))[:, :, None]
    ckv = jnp.where(live, ckv, jnp.zeros((), ckv.dtype))
    k_pe = jnp.where(live, k_pe, jnp.zeros((), k_pe.dtype))
    w_kv = self.kv_b_proj[...]
    w_k, w_v = w_kv[..., :cfg.qk_nope_head_dim], w_kv[..., cfg.qk_nope_head_dim:]
    q_lat = jnp.einsum("BTNH,CNH->BTNC", q_nope, w_k,
                       out_sharding=out_spec((BATCH, SEQ, HEADS, LORA), (b, t, n, c)))
    score_spec = out_spec((BATCH, HEADS, SEQ, SEQ), (b, n, t, s))
    scores = (jnp.einsum("BTNC,BSC->BNTS", q_lat, ckv, preferred_element_type=jnp.float32,
                         out_sharding=score_spec)
              + jnp.einsum("BTNH,BSH->BNTS", q_pe, k_pe, preferred_element_type=jnp.float32,
                           out_sharding=score_spec))
    scores = scores * cfg.softmax_scale
    mask = attn_lib.visibility(lengths, tree_mask, s)[:, None, :, :]
    scores = jnp.where(mask, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(ckv.dtype)
    # In the cache's dtype: the product is rounded to it next anyway, and XLA:CPU has no
    # bfloat16 x bfloat16 = float32 dot for this contraction once the batch exceeds 1.
    o_lat = jnp.einsum("BNTS,BSC->BTNC", probs, ckv,
                       out_sharding=out_spec((BATCH, SEQ, HEADS, LORA), (b, t, n, c)))
    out = jnp.einsum("BTNC,CNH->BTNH", o_lat, w_v,
                     out_sharding=out_spec((BATCH, SEQ, HEADS, HEAD_DIM),
                                           (b, t, n, cfg.v_head_dim)))
    return out.astype(q_nope.dtype)


class MoE(nnx.Module):
  """Sigmoid-scored, group-limited (noaux_tc) routed experts plus shared experts."""

  def __init__(self, cfg: DeepseekConfig, dtype, schemes=None, impl: str = "auto"):
    d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    schemes = schemes or {}
    # The router stays float32 whatever the model dtype (as DeepSeek and transformers keep it).
    self.gate = param((d, e), (EMBED, None), jnp.float32)
    # Random init: normal, so that tests exercise the bias (checkpoints always carry it).
    self.e_score_correction_bias = param((e,), (None,), jnp.float32)
    # The F axis is not sharded: the tensor axis already splits the experts.
    # Quantized experts (eagle3jax.quant) hold values and scales [E, ...] sharded the same way.
    self.gate_proj = linear_param((e, d, f), (EXPERT, EMBED, None), dtype, n_out=1,
                                  scheme=schemes.get("mlp.gate_proj"))
    self.up_proj = linear_param((e, d, f), (EXPERT, EMBED, None), dtype, n_out=1,
                                scheme=schemes.get("mlp.up_proj"))
    self.down_proj = linear_param((e, f, d), (EXPERT, None, EMBED), dtype, n_out=1,
                                  scheme=schemes.get("mlp.down_proj"))
    if cfg.n_shared_experts:
      self.shared_experts = LlamaMLP(d, f * cfg.n_shared_experts, dtype, schemes,
                                     "mlp.shared_experts.")
    self.cfg = cfg
    self.routing_config = moe_lib.RoutingConfig.from_deepseek(cfg)
    # The expert-compute path (eagle3jax.moe.IMPLS); "auto" picks by token count.
    self.impl = impl

  def routing(self, x: jax.Array) -> jax.Array:
    """Combine weights ``[B, T, E]`` float32: zero except the chosen experts."""
    return moe_lib.combine_weights(x, self.gate[...], self.e_score_correction_bias[...],
                                   self.routing_config)

  def experts(self) -> moe_lib.Experts:
    """The routed experts' stacked matrices as held (quantized ones as ``QuantizedArrays``:
    the grouped paths dequantize only the experts the tokens chose)."""
    return moe_lib.Experts(quant.arrays(self.gate_proj), quant.arrays(self.up_proj),
                           quant.arrays(self.down_proj))

  def __call__(self, x):
    y = moe_lib.routed_experts(x, self.gate[...], self.e_score_correction_bias[...],
                               self.experts(), self.routing_config, self.impl, ACT,
                               (BATCH, SEQ, EXPERT, None))
    if self.cfg.n_shared_experts:
      y = y + self.shared_experts(x)
    return y


class DeepseekDecoderLayer(DecoderLayer):
  """``schemes``: quantized linears by path inside the layer (``quant_config.layer_schemes``)."""

  def __init__(self, cfg: DeepseekConfig, moe: bool, dtype, schemes=None):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.self_attn = MLAttention(cfg, dtype, schemes)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    if moe:
      self.mlp = MoE(cfg, dtype, schemes)
    else:
      self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, dtype, schemes)


class DeepseekForCausalLM(DecoderLM):
  """A DeepSeek-V3 / Kimi-K2 causal LM. Build with ``eagle3jax.load_target`` or
  ``eagle3jax.hf_deepseek.init_deepseek``. The forward is ``DecoderLM.__call__``; MLA always
  takes the XLA attention path (``attention_impl`` is accepted for the common contract)."""

  def __init__(self, cfg: DeepseekConfig, *, dtype=jnp.float32, schemes=None):
    """``schemes``: quantized linears by parameter name (``lm_head``, ``layers.{i}.<path>``;
    ``eagle3jax.quant_config.linear_schemes``); None: every weight plain."""
    d, v, n = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    schemes = schemes or {}
    self.config = cfg
    self.embed_tokens = param((v, d), (VOCAB, EMBED), dtype)
    # Two stacks, each run as scans (eagle3jax.stack): the dense layers below
    # first_k_dense_replace, then the MoE layers.
    k = min(cfg.first_k_dense_replace, n)
    if k:
      dense = layer_schemes(schemes, 0, k)
      self.dense_layers = stack_lib.stack_layers(
          lambda: DeepseekDecoderLayer(cfg, False, dtype, dense), k, 0)
    if n > k:
      moe = layer_schemes(schemes, k, n)
      self.moe_layers = stack_lib.stack_layers(
          lambda: DeepseekDecoderLayer(cfg, True, dtype, moe), n - k, k)
    self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = linear_param((d, v), (EMBED, VOCAB), dtype, n_out=1,
                                  scheme=schemes.get("lm_head"))

  def stacked_layers(self):
    stacks = []
    if hasattr(self, "dense_layers"):
      stacks.append((self.dense_layers, 0))
    if hasattr(self, "moe_layers"):
      stacks.append((self.moe_layers, min(self.config.first_k_dense_replace,
                                          self.config.num_hidden_layers)))
    return stacks

  # --- cache geometry, for the engine ---
  def allocate_cache(self, batch: int, max_len: int, fill=None) -> kv_lib.KVCache:
    """A latent cache: ``k[i]`` ``[B, 1, S, C]`` (normed ckv), ``v[i]`` ``[B, 1, S, Hr]``
    (roped k_pe), stacked over layers. Call under ``jax.set_mesh``; ``fill`` poisons it (tests
    use NaN)."""
    cfg = self.config
    return kv_lib.KVCache.allocate(self.num_layers, batch, max_len, 1, cfg.kv_lora_rank,
                                   self.dtype, fill, v_head_dim=cfg.qk_rope_head_dim,
                                   axes=LATENT_CACHE_AXES)
