"""A preallocated, static-shape KV cache with per-sequence lengths, stacked over layers.

Row ``b`` holds ``lengths[b]`` committed tokens in slots ``[0, lengths[b])``; slots beyond are
arbitrary (never assumed zero: readers mask them). A forward over new tokens writes them at
``lengths[b] ..`` without moving ``lengths``; the caller commits by setting new lengths.

Keys and values of all layers live in one array each, ``[L, B, S, K, H]``, so that the target's
layer scan (``eagle3jax.stack``) reads and writes layer ``i`` by index and the compiled program
holds one copy of the layer, whatever ``L`` is. A layer sees its slab through ``LayerKV``: it
writes only its ``T`` new tokens into the stacked buffer (in place) and reads the slab for
attention; the slab is never copied out and written back whole.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3jax.sharding import (BATCH, HEAD_DIM, KV_HEADS, LAYERS, SEQ, current_mesh, out_spec,
                                shard)

CACHE_AXES = (LAYERS, BATCH, SEQ, KV_HEADS, HEAD_DIM)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Keys and values ``[L, B, S, K, H]`` of every layer and committed lengths ``[B]`` (int32)."""
  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @property
  def num_layers(self) -> int:
    return self.k.shape[0]

  @property
  def batch_size(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes

  @classmethod
  def allocate(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
               dtype, fill: float | None = None, *, v_head_dim: int | None = None,
               axes=CACHE_AXES) -> "KVCache":
    """Allocates a cache (call under ``jax.set_mesh``). ``fill`` poisons it (tests use NaN).

    ``v_head_dim`` gives values another width than keys (MLA's latent cache); ``axes`` are the
    logical axes of one ``[L, B, S, K, H]`` buffer.
    """
    def buf(width):
      shape = (num_layers, batch, max_len, kv_heads, width)
      spec = out_spec(axes, shape)
      if fill is None:
        return jnp.zeros(shape, dtype, out_sharding=spec)
      return jnp.full(shape, fill, dtype, out_sharding=spec)
    lengths = shard(jnp.zeros((batch,), jnp.int32), (BATCH,))
    return cls(buf(head_dim), buf(head_dim if v_head_dim is None else v_head_dim), lengths)

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return dataclasses.replace(self, lengths=lengths)


@dataclasses.dataclass(frozen=True)
class LayerKV:
  """Layer ``index`` of a stacked buffer ``stacked [L, B, S, K, H]``.

  ``write`` puts a layer's new tokens into the stacked buffer at their slots (an in-place
  update of ``B * T`` rows inside the layer scan); ``read`` is the layer's ``[B, S, K, H]`` slab
  for attention. Copying the slab out and setting it back whole would move the whole cache
  twice per layer per call: at batch 128 that was most of a decode step.
  """
  stacked: jax.Array
  index: jax.Array | int

  def write(self, new: jax.Array, start: jax.Array) -> "LayerKV":
    """Writes ``new [B, T, K, H]`` at slots ``start[b] ..`` of this layer.

    One scatter with unique indices: XLA updates the buffer in place. (A ``vmap`` of
    ``dynamic_update_slice`` or a slab ``.at[i].set`` made XLA:CPU copy the whole stacked
    buffer per layer: 20x slower at batch 128.) Slots past the buffer are dropped (callers
    size caches so that none are).
    """
    b, t = new.shape[:2]
    rows = shard(jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)),
                 (BATCH, None))
    slots = shard(start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :],
                  (BATCH, None))
    kw = ({} if current_mesh() is None
          else dict(out_sharding=jax.typeof(self.stacked).sharding))
    stacked = self.stacked.at[self.index, rows, slots].set(
        new.astype(self.stacked.dtype), mode="drop", unique_indices=True, **kw)
    return LayerKV(stacked, self.index)

  def read(self) -> jax.Array:
    """This layer's ``[B, S, K, H]`` slab."""
    return self.stacked[self.index]
