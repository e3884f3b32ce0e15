"""A preallocated, static-shape KV cache with per-sequence lengths, stacked over layers.

Row ``b`` holds ``lengths[b]`` committed tokens in slots ``[0, lengths[b])``; slots beyond are
arbitrary (never assumed zero: readers mask them). A forward over new tokens writes them at
``lengths[b] ..`` without moving ``lengths``; the caller commits by setting new lengths.

Keys and values of all layers live in one array each, ``[L, B, K, S, H]``, so that the target's
layer scan (``eagle3jax.stack``) reads and writes layer ``i`` by index and the compiled program
holds one copy of the layer, whatever ``L`` is. A layer sees its slab through ``LayerKV``: it
writes only its ``T`` new tokens into the stacked buffer (in place) and reads the slab for
attention; the slab is never copied out and written back whole.

Heads come before slots (``transformers``' ``[B, K, S, H]`` too): attention is a matmul per row
and KV head, and with ``S, H`` the two minor dims each head's slab is one contiguous operand.
With slots before heads XLA:CPU copied every layer's keys and values into that order at every
call: a quarter of an autoregressive step at batch 1 and 45% at batch 128.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from eagle3jax.sharding import (BATCH, HEAD_DIM, KV_HEADS, LAYERS, SEQ, current_mesh,
                                devices_along, out_spec, shard)

CACHE_AXES = (LAYERS, BATCH, KV_HEADS, SEQ, HEAD_DIM)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Keys and values ``[L, B, K, S, H]`` of every layer and committed lengths ``[B]`` (int32)."""
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
    return self.k.shape[3]

  @property
  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes

  @classmethod
  def allocate(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
               dtype, fill: float | None = None, *, v_head_dim: int | None = None,
               axes=CACHE_AXES) -> "KVCache":
    """Allocates a cache (call under ``jax.set_mesh``). ``fill`` poisons it (tests use NaN).

    ``v_head_dim`` gives values another width than keys (MLA's latent cache); ``axes`` are the
    logical axes of one ``[L, B, K, S, H]`` buffer.
    """
    def buf(width):
      shape = (num_layers, batch, kv_heads, max_len, width)
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
  """Layer ``index`` of a stacked buffer ``stacked [L, B, K, S, H]``.

  ``write`` puts a layer's new tokens into the stacked buffer at their slots (an in-place
  update of ``B * T`` rows inside the layer scan); ``read`` is the layer's ``[B, K, S, H]`` slab
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
    size caches so that none are). Rows sharded over ``data`` are written shard by shard
    (``update_rows``).
    """
    t = new.shape[1]

    def scatter(buf, new, start, index, **kw):
      b = new.shape[0]
      rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
      slots = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
      # Advanced indices around the K slice: the indexed view is [B, T, K, H], as ``new``.
      return buf.at[index, rows, :, slots].set(new.astype(buf.dtype), mode="drop",
                                               unique_indices=True, **kw)

    index = jnp.asarray(self.index, jnp.int32)
    return LayerKV(update_rows(scatter, self.stacked, (new, start.astype(jnp.int32)),
                               (index,)), self.index)

  def read(self) -> jax.Array:
    """This layer's ``[B, K, S, H]`` slab."""
    return self.stacked[self.index]


def as_slab(x: jax.Array) -> jax.Array:
  """New tokens ``[B, T, K, H]`` as a slab ``[B, K, T, H]`` (what ``LayerKV.read`` gives): the
  keys and values of a full-sequence forward, which has no cache."""
  return jnp.swapaxes(x, 1, 2)


def update_rows(fn, buf: jax.Array, row_args: tuple, scalars: tuple = ()) -> jax.Array:
  """``fn(buf, *row_args, *scalars)`` for a row-local update of a stacked cache buffer.

  ``buf`` is ``[L, B, K, S, H]`` and each of ``row_args`` is ``[B, ...]``: row ``b`` of every
  argument touches only row ``b`` of ``buf`` (cache writes, the commit's moves). When the rows
  are sharded over ``data`` the update runs shard by shard under ``jax.shard_map``, each device
  on its own rows with local row numbers: a plain scatter into a buffer sharded on an indexed
  dimension made the SPMD partitioner all-gather every update and its indices over ``data`` in
  every layer. Otherwise (no mesh, rows on one device, or layers or slots sharded, which no
  rule does) ``fn`` runs once, given the buffer's layout as ``out_sharding`` under a mesh.
  ``scalars`` are replicated. A row argument is ``[B]``, ``[B, T]`` (slots) or ``[B, T, K, H]``
  (new keys or values): its K and H follow the buffer's, T is never sharded.
  """
  mesh = current_mesh()
  if mesh is None:
    return fn(buf, *row_args, *scalars)
  sharding = jax.typeof(buf).sharding
  spec = tuple(sharding.spec) + (None,) * (buf.ndim - len(sharding.spec))
  if devices_along(mesh, spec[1:2]) == 1 or spec[0] is not None or spec[3] is not None:
    return fn(buf, *row_args, *scalars, out_sharding=sharding)
  # [B, T, K, H] beside the buffer's [.., K, S, H]: T unsharded, K and H as the buffer's.
  row_specs = tuple(P(spec[1], *((None, spec[2]) + spec[4:])[:a.ndim - 1]) for a in row_args)
  row_args = tuple(jax.reshard(a, s) for a, s in zip(row_args, row_specs))
  return jax.shard_map(fn, in_specs=(P(*spec),) + row_specs + (P(),) * len(scalars),
                       out_specs=P(*spec), check_vma=False)(buf, *row_args, *scalars)
