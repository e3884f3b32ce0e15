"""EAGLE-2 dynamic draft trees: expansion, selection, masks and positions (inside jit).

Per row, the tree is built from a *pool* of candidates in level order:

* level 1: the ``topk`` most likely children of the root (the last committed token);
* each later level: ``topk`` children of each of the ``topk`` frontier nodes (``topk**2``
  candidates), of which the global ``topk`` by cumulative log-probability form the next
  frontier.

The ``num_draft_tokens - 1`` best pool entries by cumulative log-probability are kept; since a
child never scores above its parent, the selection is ancestor-closed, and sorting it by pool
index puts parents before children. Node 0 is the root. With ``topk = 1`` the tree is a chain.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle3jax import checks
from eagle3jax import vocab_parallel as vp
from eagle3jax.sharding import batch_major as bm, gather_rows


# The draft loop is unrolled when traced (one drafter pass per level), so its compile time
# grows with the depth; EAGLE-3 drafts 3-8 levels. The candidate pool is held per row in every
# round. Past these a tree is refused before anything compiles.
MAX_STEPS = 64
MAX_POOL = 1 << 16


def max_draft_tokens(num_steps: int, topk: int) -> int:
  """The most tokens a tree of ``num_steps`` levels and ``topk`` branching can verify, root
  included: ``1 + topk + (num_steps - 1) * topk**2`` (its candidate pool plus the root)."""
  return 1 + topk + (num_steps - 1) * topk * topk


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """Static tree settings: ``num_steps`` drafted levels, ``topk`` branching, and the number of
  verified tokens ``num_draft_tokens`` (root included)."""
  num_steps: int
  topk: int
  num_draft_tokens: int

  def __post_init__(self):
    for name in ("num_steps", "topk", "num_draft_tokens"):
      object.__setattr__(self, name, checks.integer(name, getattr(self, name)))
    if self.num_steps < 1:
      raise ValueError(f"num_steps={self.num_steps} must be >= 1")
    if self.topk < 1:
      raise ValueError(f"topk={self.topk} must be >= 1")
    if self.num_steps > MAX_STEPS:
      raise ValueError(f"num_steps={self.num_steps}: at most {MAX_STEPS} drafted levels (the "
                       "draft loop is unrolled when compiled, so its compile time grows with "
                       "the depth; EAGLE-3 drafts 3-8)")
    if self.pool_size > MAX_POOL:
      raise ValueError(f"num_steps={self.num_steps}, topk={self.topk}: a candidate pool of "
                       f"{self.pool_size} tokens (topk + (num_steps - 1) * topk**2), more than "
                       f"{MAX_POOL}; lower topk or num_steps")
    if not 2 <= self.num_draft_tokens <= self.pool_size + 1:
      raise ValueError(
          f"num_draft_tokens={self.num_draft_tokens} must be between 2 and "
          f"{self.pool_size + 1} (1 + topk + (num_steps - 1) * topk**2) for num_steps="
          f"{self.num_steps}, topk={self.topk}")

  @property
  def pool_size(self) -> int:
    return max_draft_tokens(self.num_steps, self.topk) - 1

  @property
  def pool_levels(self) -> np.ndarray:
    """Depth (1-based level) of each pool entry."""
    levels = [1] * self.topk
    for j in range(2, self.num_steps + 1):
      levels += [j] * self.topk * self.topk
    return np.asarray(levels, np.int32)

  @property
  def tree_window(self) -> int:
    """Drafter cache slots used by tree levels in one round."""
    return max(1, (self.num_steps - 1) * self.topk)


def checked_shape(shape, name: str) -> TreeShape:
  """``shape`` ``(steps, topk, draft tokens)`` as a ``TreeShape``, or a ``ValueError`` naming
  ``name``. A chain (topk 1) must say ``steps + 1`` tokens: ``generate`` drafts that many
  whatever it is given, so a measurement labelled otherwise would be mislabelled (and a record
  keyed so never looked up)."""
  try:
    steps, topk, tokens = shape
  except (TypeError, ValueError):
    raise ValueError(f"{name}={shape!r} must be (steps, topk, draft tokens), e.g. (7, 1, 8)"
                     ) from None
  try:
    checked = TreeShape(steps, topk, tokens)
  except ValueError as e:
    raise ValueError(f"{name}={tuple(shape)!r}: {e}") from None
  if checked.topk == 1 and checked.num_draft_tokens != checked.num_steps + 1:
    raise ValueError(f"{name}={tuple(shape)!r}: a chain (topk 1) verifies steps + 1 = "
                     f"{checked.num_steps + 1} tokens")
  return checked


def select(pool_score: jax.Array, pool_parent: jax.Array, pool_token: jax.Array,
           root_token: jax.Array, shape: TreeShape):
  """Keeps the best ``num_draft_tokens - 1`` pool entries of each row.

  Args:
    pool_score: ``[B, M]`` cumulative log-probabilities.
    pool_parent: ``[B, M]`` parent pool index (-1: the root).
    pool_token: ``[B, M]`` target token ids.
    root_token: ``[B]`` the root (last committed) token.

  Returns:
    ``tokens [B, P]``, ``parent [B, P]`` (node index; the root is its own parent),
    ``depth [B, P]``, ``mask [B, P, P]`` (ancestor closure incl. self).
  """
  b, m = pool_score.shape
  p = shape.num_draft_tokens
  _, best = vp.top_k(pool_score, p - 1)
  sel = jnp.sort(best, axis=-1)                                            # [B, P-1]
  pp = gather_rows(pool_parent, sel)                      # [B, P-1]
  # Node index of each parent: where the parent's pool index sits in ``sel`` (+1 for the root).
  eq = pp[:, :, None] == sel[:, None, :]
  node_parent = jnp.where(jnp.any(eq, -1), jnp.argmax(eq, -1) + 1, 0).astype(jnp.int32)
  zero = bm(jnp.zeros((b, 1), jnp.int32))
  parent = jnp.concatenate([zero, bm(node_parent)], axis=1)
  levels = bm(jnp.broadcast_to(jnp.asarray(shape.pool_levels), (b, m)))
  depth = jnp.concatenate([zero, gather_rows(levels, sel)], axis=1)
  tokens = jnp.concatenate([bm(root_token[:, None]),
                            gather_rows(pool_token, sel)], 1)
  return tokens, parent, depth, ancestor_mask(parent, shape.num_steps)


def chain(batch: int, steps: int):
  """``(parent, depth, mask)`` of a chain of ``steps`` drafts below the root (``topk = 1``):
  what ``select`` returns for one, as constants. Each ``[B, P]`` / ``[B, P, P]``."""
  p = steps + 1
  const = lambda x: bm(jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape))  # noqa: E731
  return (const(np.maximum(np.arange(p, dtype=np.int32) - 1, 0)),
          const(np.arange(p, dtype=np.int32)), const(np.tril(np.ones((p, p), bool))))


def ancestor_mask(parent: jax.Array, max_depth: int) -> jax.Array:
  """``[B, P, P]``: node i sees node j iff j is i or an ancestor (root's parent is itself)."""
  b, p = parent.shape
  eye = bm(jnp.broadcast_to(jnp.eye(p, dtype=bool), (b, p, p)))
  mask, cur = eye, bm(jnp.broadcast_to(jnp.arange(p), (b, p)))
  for _ in range(max_depth):
    cur = gather_rows(parent, cur)
    mask = mask | jax.nn.one_hot(cur, p, dtype=bool)
  return mask


def path_of(mask_row: jax.Array, depth: jax.Array, length: int) -> jax.Array:
  """Node index at each depth ``0..length-1`` on the root-to-node path given by ``mask_row``
  ``[B, P]`` (0 past the node's depth)."""
  d = jnp.arange(length)[None, :, None]
  on = mask_row[:, None, :] & (depth[:, None, :] == d)                   # [B, L, P]
  return jnp.argmax(on, axis=-1).astype(jnp.int32)
