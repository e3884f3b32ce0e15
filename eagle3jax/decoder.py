"""What every target model shares: embedding, the layer loop with captures, the LM head.

``DecoderLM`` is the base of ``LlamaForCausalLM`` and ``DeepseekForCausalLM``. A subclass
provides ``config`` (``rms_norm_eps``, ``tie_word_embeddings``, ``num_hidden_layers``,
``hidden_size``), ``embed_tokens``, ``stacked_layers()`` (the stacked layer modules of
``eagle3jax.stack`` with the global index of their first layer; each layer is called as
``layer(x, positions, k_buf, v_buf, lengths, tree_mask, impl) -> (x, k_buf, v_buf)`` with
``kv_cache.LayerKV`` views as buffers), ``norm``,
``lm_head`` when untied, and ``allocate_cache``. The layers run as scans over segments that
end at the captured layers (``eagle3jax.stack``), or one by one after ``split_layers``. Captures follow ``eagle3jax.capture``: every
captured tensor goes through ``CaptureSpec.annotate`` here and nowhere else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3jax import kv_cache as kv_lib
from eagle3jax import stack as stack_lib
from eagle3jax.capture import EMBEDDING, CaptureSpec, as_capture_spec
from eagle3jax.layers import einsum, rms_norm
from eagle3jax.sharding import (BATCH, EMBED, SEQ, VOCAB, gather_rows, out_spec, require_mesh,
                                shard)
from eagle3jax.semantics import standard_numpy

ACT = (BATCH, SEQ, EMBED)


class DecoderLayer(nnx.Module):
  """A pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``. Subclasses
  create ``input_layernorm``, ``self_attn`` (returning ``(out, k_buf, v_buf)``),
  ``post_attention_layernorm`` and ``mlp``."""

  def __call__(self, x, positions, k_buf, v_buf, lengths, tree_mask, impl):
    a, k_buf, v_buf = self.self_attn(self.input_layernorm(x), positions, k_buf, v_buf,
                                     lengths, tree_mask, impl)
    x = shard(x + a, ACT)
    x = shard(x + self.mlp(self.post_attention_layernorm(x)), ACT)
    return x, k_buf, v_buf


class DecoderLM(nnx.Module):
  """Shared forward of decoder-only target models (see the module docstring)."""

  def layer_stacks(self):
    """``[(stack, global index of its first layer)]`` in order (one-layer stacks after
    ``split_layers``)."""
    if hasattr(self, "layer_split"):
      return list(zip(self.layer_split, self.split_offsets))
    return self.stacked_layers()

  def split_layers(self) -> None:
    """Replaces the layer stacks by one-layer stacks (``eagle3jax.stack.split_stack``): no
    weight copies per step on CPU, compile time proportional to depth. In place, once."""
    if hasattr(self, "layer_split"):
      return
    stacks = self.stacked_layers()
    parts = [p for stack, offset in stacks for p in stack_lib.split_stack(stack, offset)]
    for stack, _ in stacks:
      name = next(k for k, v in vars(self).items() if v is stack)
      delattr(self, name)
    self.layer_split = nnx.List([m for m, _ in parts])
    self.split_offsets = tuple(off for _, off in parts)

  @property
  def layer_loop(self) -> str:
    """``"split"`` after ``split_layers``, else ``"scan"``."""
    return "split" if hasattr(self, "layer_split") else "scan"

  @property
  def num_layers(self) -> int:
    return self.config.num_hidden_layers

  @property
  def hidden_size(self) -> int:
    return self.config.hidden_size

  @property
  def dtype(self):
    return self.embed_tokens.get_value().dtype

  def embed(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings ``[B, T, D]`` (vocab-parallel table gathered to the activation layout)."""
    table = self.embed_tokens[...]
    shape = tokens.shape + (table.shape[1],)
    return table.at[tokens].get(out_sharding=out_spec(ACT, shape))

  def lm_logits(self, x: jax.Array) -> jax.Array:
    """Float32 logits ``[B, T, V]`` from final-normed hidden states."""
    w = self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]
    logits = einsum("BTD,DV->BTV", x, w, (BATCH, SEQ, VOCAB))
    return logits.astype(jnp.float32)

  @standard_numpy
  def __call__(self, tokens, positions=None, cache: kv_lib.KVCache | None = None,
               tree_mask=None, capture: CaptureSpec | None = None, *,
               logits_index=None, attention_impl: str = "xla"):
    """Runs the model (the layer under ``eagle3jax.forward`` and the engine).

    With ``cache=None`` a full sequence (causal); with a cache, ``T`` new tokens appended after
    each row's committed prefix, new token ``i`` seeing new token ``j`` where
    ``tree_mask[b, i, j]``. Call it under ``jax.set_mesh(model.mesh)`` (in or out of
    ``jax.jit``): its weights and activations carry Explicit shardings of that mesh.
    ``eagle3jax.forward(model, tokens, capture=...)`` does this for a full sequence.

    Args:
      tokens: ``[B, T]`` int32.
      positions: ``[B, T]`` int32 RoPE positions (default ``0..T-1``).
      cache: a ``KVCache`` (from ``allocate_cache``) to extend, or None.
      tree_mask: ``[B, T, T]`` bool among the new tokens (default causal).
      capture: hidden states to return (a ``CaptureSpec`` or a list of layer ids), or None.
      logits_index: optional ``[B, M]`` int32: only compute logits at these new-token indices.
      attention_impl: ``"xla"`` or ``"pallas"`` (see ``eagle3jax.attention``).

    Returns:
      ``(logits [B, T or M, V] float32, aux [B, T, k*D] or None, cache)``; the returned cache
      holds the new entries at ``lengths[b] ..`` with ``lengths`` unchanged.
    """
    require_mesh("the model", "model", "or use eagle3jax.forward(model, tokens, capture=...)")
    capture = as_capture_spec(capture)
    b, t = tokens.shape
    tokens = shard(tokens.astype(jnp.int32), (BATCH, SEQ))
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    positions = shard(positions.astype(jnp.int32), (BATCH, SEQ))
    if tree_mask is None:
      tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    tree_mask = shard(tree_mask, (BATCH, SEQ, SEQ))
    lengths = jnp.zeros((b,), jnp.int32) if cache is None else cache.lengths
    lengths = shard(lengths, (BATCH,))

    x = shard(self.embed(tokens), ACT)
    captures = {}
    if capture is not None and EMBEDDING in capture.layer_ids:
      captures[EMBEDDING] = capture.annotate(x)

    def step(layer, x, k_buf, v_buf):
      return layer(x, positions, k_buf, v_buf, lengths, tree_mask, attention_impl)

    stacks = self.layer_stacks()
    bounds = stack_lib.stack_bounds(stacks)
    cuts = [] if capture is None else [i for i in capture.layer_ids if i >= 0]
    kv = None if cache is None else (cache.k, cache.v)
    for s, start, end in stack_lib.segments(bounds, cuts):
      stack, offset = stacks[s]
      x, kv = stack_lib.scan_layers(stack, offset, start, end, x, kv, step)
      if end - 1 in cuts:
        captures[end - 1] = capture.annotate(x)
    aux = capture.concat(captures) if capture is not None else None
    if logits_index is not None:
      x = gather_rows(x, logits_index)
    logits = self.lm_logits(rms_norm(x, self.norm.weight[...], self.config.rms_norm_eps))
    new_cache = None if cache is None else kv_lib.KVCache(kv[0], kv[1], lengths)
    return logits, aux, new_cache
