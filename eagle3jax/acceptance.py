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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3jax.sampling import sample
from eagle3jax.sharding import gather_rows, pick_rows


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

  Returns ``(best [B], accepted [B], bonus [B])``.
  """
  return jax.vmap(lambda pr, tk, pa, dp, key: _row(pr, tk, pa, dp, key, max_depth))(
      probs, tokens, parent, depth, keys)


def _row(probs, tokens, parent, depth, key, max_depth):
  p = tokens.shape[0]

  def level(_, carry):
    cur, dist, descending, key = carry

    def try_child(j, c):
      cur_next, dist, found, key = c
      key, sub = jax.random.split(key)
      is_child = (parent[j] == cur) & (j > 0) & descending & ~found
      x = tokens[j]
      accept = is_child & (jax.random.uniform(sub) < dist[x])
      reject = is_child & ~accept
      dist = jnp.where(reject, dist.at[x].set(0.0), dist)
      dist = jnp.where(reject, dist / jnp.maximum(jnp.sum(dist), 1e-30), dist)
      return (jnp.where(accept, j, cur_next), dist, found | accept, key)

    nxt, dist, found, key = jax.lax.fori_loop(1, p, try_child, (cur, dist, False, key))
    # Descend into the accepted child; its distribution becomes the next level's.
    dist = jnp.where(found, probs[nxt], dist)
    return nxt, dist, descending & found, key

  cur, dist, _, key = jax.lax.fori_loop(0, max_depth, level, (0, probs[0], True, key))
  bonus = sample(jax.random.fold_in(key, 1), dist)
  return jnp.int32(cur), depth[cur].astype(jnp.int32), bonus
