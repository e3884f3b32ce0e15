"""Accepting a verified draft tree: greedy and lossless sampling.

Both return, per row, the accepted node (``best``: the deepest accepted node, 0 when every
draft was rejected), the number of accepted drafts (its depth) and the bonus token.

* Greedy: node ``i`` is correct when its token equals the target's argmax at its parent; the
  accepted node is the deepest node whose whole path is correct; the bonus is the target's
  argmax there. This reproduces the target's own greedy decoding token for token.
* Sampling (recursive rejection with deterministic drafts, q = 1): at the current node, try
  its children in order; accept child x with probability p(x); on rejection set p(x) = 0 and
  renormalise; if a child is accepted, descend; otherwise draw the bonus from the residual
  distribution. Every emitted token is distributed exactly as the target's sampling.

Logits and distributions may be sharded over the vocabulary (``eagle3jax.vocab_parallel``):
the argmax, the probability of a draft token and the residual's mass are per-shard partial
results combined over the tensor axis, and the bonus draw's Gumbel noise is drawn in the
distribution's layout, so no row is ever gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3jax import vocab_parallel as vp
from eagle3jax.sharding import batch_major as bm, gather_rows, pick_rows


def greedy(logits: jax.Array, tokens: jax.Array, parent: jax.Array, depth: jax.Array,
           mask: jax.Array):
  """``logits [B, P, V]``, tree ``tokens/parent/depth [B, P]``, ``mask [B, P, P]``.

  Returns ``(best [B], accepted [B], bonus [B])``.
  """
  target = jnp.argmax(logits, axis=-1).astype(jnp.int32)                   # [B, P]
  correct = tokens == gather_rows(target, parent)
  correct = correct.at[:, 0].set(True)
  ok = jnp.all(~mask | correct[:, None, :], axis=-1)                       # [B, P]
  best = jnp.argmax(jnp.where(ok, depth, -1), axis=-1).astype(jnp.int32)
  accepted = pick_rows(depth, best)
  bonus = pick_rows(target, best)
  return best, accepted, bonus


def rejection_sample(probs: jax.Array, tokens: jax.Array, parent: jax.Array,
                     depth: jax.Array, keys: jax.Array, max_depth: int):
  """``probs [B, P, V]`` target distributions at each node; ``keys [B]`` one key per row.

  Batched over rows (no per-row vmap, so the batch keeps its mesh layout). Uniforms for the
  accept tests and Gumbel noise for the bonus draw come from each row's key.

  Returns ``(best [B], accepted [B], bonus [B])``.
  """
  b, p, v = probs.shape
  uniforms = vp.uniform_rows(keys, (max_depth, p))                            # [B, D, P]
  dist = vp.rows(probs[:, 0])                                                 # [B, V]
  gumbel = vp.gumbel_rows(jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys), dist)
  vocab = jnp.arange(v, dtype=jnp.int32)[None, :]
  cur = bm(jnp.zeros((b,), jnp.int32))
  descending = bm(jnp.ones((b,), bool))
  for level in range(max_depth):
    u_level = uniforms[:, level]                                                # [B, P]

    def try_child(j, carry, u_level=u_level, cur=cur, descending=descending):
      nxt, dist, found = carry
      par = jax.lax.dynamic_index_in_dim(parent, j, axis=1, keepdims=False)
      x = jax.lax.dynamic_index_in_dim(tokens, j, axis=1, keepdims=False)
      u = jax.lax.dynamic_index_in_dim(u_level, j, axis=1, keepdims=False)
      is_child = (par == cur) & descending & ~found
      px = jnp.sum(jnp.where(vocab == x[:, None], dist, 0.0), axis=-1)
      accept = is_child & (u < px)
      reject = is_child & ~accept
      zeroed = jnp.where(vocab == x[:, None], 0.0, dist)
      mass = jnp.sum(zeroed, axis=-1, keepdims=True)
      zeroed = zeroed / jnp.maximum(mass, 1e-30)
      # If rounding left no mass at all, keep the distribution rather than an all-zero one.
      dist = jnp.where(reject[:, None] & (mass > 0), zeroed, dist)
      return bm(jnp.where(accept, j, nxt)), vp.rows(dist), bm(found | accept)

    nxt, dist, found = jax.lax.fori_loop(1, p, try_child,
                                         (cur, dist, bm(jnp.zeros((b,), bool))))
    # Descend into the accepted child; its distribution becomes the next level's.
    dist = vp.rows(jnp.where(found[:, None], pick_rows(probs, nxt), dist))
    cur, descending = nxt, descending & found
  bonus = jnp.argmax(jnp.log(dist) + gumbel, axis=-1).astype(jnp.int32)
  return cur, pick_rows(depth, cur), bonus
