"""A preallocated, static-shape KV cache with per-sequence lengths.

Row ``b`` holds ``lengths[b]`` committed tokens in slots ``[0, lengths[b])``; slots beyond are
arbitrary (never assumed zero: readers mask them). ``extend`` writes new tokens at
``lengths[b] ..`` without moving ``lengths``; the caller commits by setting new lengths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3jax.sharding import BATCH, HEAD_DIM, KV_HEADS, SEQ, out_spec, shard

CACHE_AXES = (BATCH, SEQ, KV_HEADS, HEAD_DIM)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Per-layer keys and values ``[B, S, K, H]`` and committed lengths ``[B]`` (int32)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array

  @property
  def batch_size(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  @classmethod
  def allocate(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
               dtype, fill: float | None = None) -> "KVCache":
    """Allocates a cache (call under ``jax.set_mesh``). ``fill`` poisons it (tests use NaN)."""
    shape = (batch, max_len, kv_heads, head_dim)
    spec = out_spec(CACHE_AXES, shape)
    def buf():
      if fill is None:
        return jnp.zeros(shape, dtype, out_sharding=spec)
      return jnp.full(shape, fill, dtype, out_sharding=spec)
    lengths = shard(jnp.zeros((batch,), jnp.int32), (BATCH,))
    return cls(tuple(buf() for _ in range(num_layers)), tuple(buf() for _ in range(num_layers)),
               lengths)

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return dataclasses.replace(self, lengths=lengths)


def write(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes ``new [B, T, K, H]`` into ``buf [B, S, K, H]`` at slots ``start[b] ..``."""
  def one(b, n, s):
    return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), (s, 0, 0))
  return jax.vmap(one)(buf, new, shard(start.astype(jnp.int32), (BATCH,)))
