"""Reductions over vocabulary-sharded logits, without gathering whole rows.

The target's and the drafter's LM heads are vocab-parallel, and their logits ``[..., V]`` keep
that layout (the activation rule of ``VOCAB`` is the ``tensor`` axis): each device holds
``V / n`` columns. At V = 163840 a full row per tree node is 640 KB of float32, so nothing in
the decode round or in training gathers rows. What each consumer needs is computed from
per-shard partial results and a small collective over ``tensor``:

* max, sum, softmax, ``argmax``: plain ``jnp`` reductions; under Explicit axes XLA reduces
  each shard and combines the partials (an all-reduce of ``[...]``, for ``argmax`` an
  all-gather of the ``n`` per-shard ``(max, index)`` pairs). ``jnp.argmax`` keeps its
  first-occurrence tie rule, so greedy tokens equal the single-device ones exactly.
* ``top_k``: per-shard top-k under ``shard_map``, an all-gather of the ``n * k`` candidates,
  a top-k of those; exact, ties to the lower index as ``jax.lax.top_k``. Over a whole last
  axis it still runs shard by shard when rows are sharded (no gather of rows over ``data``).
* ``nucleus_mask`` (top-p): a bisection on the float32 bit pattern of the probability
  threshold, each step one masked sum (an all-reduce of ``[...]``).
* ``gumbel_rows``: sampling noise drawn in the logits' layout; JAX's partitionable threefry
  gives every element the value it has unsharded, so a sharded mesh draws the same tokens.
* ``take_columns``: ``x[..., ids]`` for a replicated id list (the target's logits at the draft
  vocabulary in drafter training), each shard contributing its own columns.

Outside a mesh, or when ``n`` does not divide V (the rule then replicates the axis), every
function is its single-device formula.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from eagle3jax.sharding import BATCH, VOCAB, devices_along, shard

# The nucleus bisection runs over int32 bit patterns of probabilities in [0, 1]: 1.0 is
# 0x3F800000 < 2**30, so 31 halvings pin the threshold to one representable float.
_BISECTION_STEPS = 31


def _mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def _spec(x: jax.Array) -> tuple:
  """``x``'s partition spec, one entry per dimension (None outside a mesh)."""
  if _mesh() is None:
    return (None,) * x.ndim
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def vocab_axis(x: jax.Array) -> str | None:
  """The mesh axis that shards the last (vocabulary) dimension of ``x``, or None."""
  axis = _spec(x)[-1]
  if isinstance(axis, tuple):
    if len(axis) > 1:
      raise ValueError(f"vocabulary dimension sharded over several mesh axes {axis}; the "
                       "vocab-parallel reductions expect at most one (the tensor axis)")
    axis = axis[0] if axis else None
  return axis


def rows(x: jax.Array) -> jax.Array:
  """``x [B, V]`` laid out batch over ``data`` and vocabulary as the activation rules say
  (the vocab-parallel counterpart of ``batch_major`` for per-row distributions)."""
  return shard(x, (BATCH,) + (None,) * (x.ndim - 2) + (VOCAB,))


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``jax.lax.top_k(x, k)`` over the last axis of a vocabulary-sharded ``x [..., V]``.

  Returns ``(values [..., k], indices [..., k] int32)``, equal to the single-device result
  (same order, ties to the lower index), replicated over the vocabulary axis.
  """
  axis = vocab_axis(x)
  if axis is None:
    return _row_local_top_k(x, k)
  n = _mesh().shape[axis]
  local = x.shape[-1] // n
  kk = min(k, local)   # a shard holds at most ``local`` of the global top-k
  spec = _spec(x)
  last = x.ndim - 1

  def body(xl):
    vals, idx = jax.lax.top_k(xl, kk)
    idx = idx.astype(jnp.int32) + jax.lax.axis_index(axis).astype(jnp.int32) * local
    # Shard order then per-shard order: among equal values, lower global indices come first.
    vals = jax.lax.all_gather(vals, axis, axis=last, tiled=True)           # [..., n * kk]
    idx = jax.lax.all_gather(idx, axis, axis=last, tiled=True)
    best, pos = jax.lax.top_k(vals, k)
    return best, jnp.take_along_axis(idx, pos, axis=-1)

  out = P(*spec[:-1], None)
  return jax.shard_map(body, in_specs=P(*spec), out_specs=(out, out), check_vma=False)(x)


def _row_local_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``jax.lax.top_k`` of an ``x`` whose last axis is whole, run shard by shard (under
  ``shard_map``) when a leading axis is sharded over more than one device: the SPMD
  partitioner all-gathered a top-k's rows over ``data`` (every draft step of a tree, and its
  selection, on a data-sharded mesh)."""
  mesh, spec = _mesh(), _spec(x)
  if mesh is None or devices_along(mesh, spec[:-1]) == 1:
    return jax.lax.top_k(x, k)
  out = P(*spec[:-1], None)
  return jax.shard_map(lambda xl: tuple(jax.lax.top_k(xl, k)), in_specs=P(*spec),
                       out_specs=(out, out), check_vma=False)(x)


def take_columns(x: jax.Array, ids: jax.Array) -> jax.Array:
  """``x[..., ids]`` for ``x [..., V]`` (vocabulary-sharded or not) and ``ids [N]``.

  On a sharded ``x`` each shard fills the columns it holds and zeros elsewhere; a sum over
  the shards (a reduce-scatter when the mesh axis divides N) assembles ``[..., N]`` laid out
  over the vocabulary axis. Each value is copied, not computed: the result equals the
  single-device gather exactly.
  """
  ids = ids.astype(jnp.int32)
  axis = vocab_axis(x)
  if axis is None:
    if _mesh() is None:
      return x[..., ids]
    spec = _spec(x)
    return x.at[..., ids].get(out_sharding=P(*spec[:-1], None))
  n = _mesh().shape[axis]
  local = x.shape[-1] // n
  spec = _spec(x)
  scatter = ids.shape[0] % n == 0

  def body(xl, ids):
    li = ids - jax.lax.axis_index(axis).astype(jnp.int32) * local
    inside = (li >= 0) & (li < local)
    part = jnp.where(inside, jnp.take(xl, jnp.clip(li, 0, local - 1), axis=-1),
                     jnp.zeros((), x.dtype))
    if scatter:
      return jax.lax.psum_scatter(part, axis, scatter_dimension=x.ndim - 1, tiled=True)
    return jax.lax.psum(part, axis)

  out = P(*spec[:-1], axis if scatter else None)
  return jax.shard_map(body, in_specs=(P(*spec), P(None)), out_specs=out,
                       check_vma=False)(x, ids)


def nucleus_mask(probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """Top-p (nucleus) membership of each token of ``probs [..., V]`` (float32, rows sum to 1).

  A token is kept when the mass of the strictly more likely tokens is below ``top_p``: the
  smallest set of most likely tokens whose mass reaches ``top_p``, ties at its least likely
  member included, and always the most likely token (as ``transformers``). ``top_p >= 1``
  keeps every token (float32 sums can reach 1 before the tail).

  The set is ``probs >= t`` for the smallest threshold ``t`` with ``mass(probs > t) < top_p``.
  For non-negative floats the int32 bit pattern is monotone, so ``t`` is found by bisection
  on bit patterns: each step one masked sum per row, an all-reduce of ``[...]`` on a sharded
  vocabulary instead of a sort of whole rows.
  """
  bits = jax.lax.bitcast_convert_type(probs.astype(jnp.float32), jnp.int32)
  hi = jnp.max(bits, axis=-1)     # mass above the maximum: 0 (< top_p)
  lo = jnp.full_like(hi, -1)      # mass above -1: everything (>= top_p)

  def step(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    mass = jnp.sum(jnp.where(bits > mid[..., None], probs, 0.0), axis=-1)
    below = mass < top_p
    return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

  _, hi = jax.lax.fori_loop(0, _BISECTION_STEPS, step, (lo, hi))
  return (bits >= hi[..., None]) | (top_p >= 1.0)


def uniform_rows(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Float32 uniforms ``[B, *shape]``, row ``b`` from ``keys[b]``. On a mesh each row's draw is
  laid out explicitly (as ``gumbel_rows``): with keys sharded over data, the rbg PRNG's
  batching rule slices the key array, which Explicit sharding refuses."""
  # float32 whatever jax_enable_x64 says: a seed draws the same tokens either way.
  extra = {} if _mesh() is None else {"out_sharding": P()}
  return jax.vmap(lambda k: jax.random.uniform(k, shape, jnp.float32, **extra))(keys)


def gumbel_rows(keys: jax.Array, like: jax.Array) -> jax.Array:
  """Standard Gumbel noise ``[B, V]``, row ``b`` from ``keys[b]`` (typed keys ``[B]``), laid
  out like ``like [B, V]`` (each device draws only its columns; the values do not depend on
  the layout)."""
  v = like.shape[-1]
  if _mesh() is None:
    return jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
  # float32 whatever jax_enable_x64 says: a seed draws the same tokens either way.
  noise = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32,
                                               out_sharding=P(vocab_axis(like))))(keys)
  return jax.reshard(noise, P(*_spec(like)))
