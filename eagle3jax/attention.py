"""Attention of T new tokens over a KV cache plus a mask among the new tokens.

One semantics for every use (full sequence, prefill, chunked extend, tree verification, draft):
query ``i`` of row ``b`` sees cache keys ``[0, lengths[b])`` and new key ``j`` (stored at slot
``lengths[b] + j``) where ``tree_mask[b, i, j]``. ``tree_mask`` is ``[B, T, W]``: usually
``W == T`` (the new tokens are the keys after the prefix); the drafter's tree steps use a wider
window holding the earlier tree levels (XLA path only). A query that sees no key gets zeros. The
XLA path below materialises the ``[B, N, T, S]`` scores; ``eagle3jax.kernels.tree_attention`` is
the Pallas kernel with the same contract, chosen by ``attention_impl`` for calls of at most
``MAX_TREE_TOKENS`` (64) new tokens: decode steps, verification and the prefill of prompt
buckets up to 64. Calls of more new tokens (longer prefills, larger trees) take the XLA path
whatever ``attention_impl`` says, since the kernel holds the new tokens' keys and mask as single
tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3jax.sharding import BATCH, HEAD_DIM, KV_HEADS, SEQ, out_spec

ATTENTION_IMPLS = ("xla", "pallas", "pallas_interpret")


def default_attention_impl() -> str:
  """The Pallas kernel on GPU, the XLA path elsewhere."""
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def attend(q, k, v, lengths, tree_mask, *, scale: float, impl: str = "xla"):
  """Attention ``q [B, T, N, H]`` over ``k, v [B, K, S, H]`` (the cache's layout,
  ``eagle3jax.kv_cache``); returns ``[B, T, N, H]``.

  ``k``/``v`` already hold the new tokens at ``lengths[b] .. lengths[b] + T - 1``; slots beyond
  ``lengths[b] + T`` may hold anything (NaN included) and do not affect the result.
  """
  if impl == "xla" or tree_mask.shape[-1] != q.shape[1]:
    return _attend_xla(q, k, v, lengths, tree_mask, scale)
  if impl in ("pallas", "pallas_interpret"):
    # pylint: disable-next=import-outside-toplevel
    from eagle3jax.kernels import MAX_TREE_TOKENS, tree_attention_sharded
    if q.shape[1] > MAX_TREE_TOKENS:  # a long prefill or a large tree
      return _attend_xla(q, k, v, lengths, tree_mask, scale)
    mesh = jax.sharding.get_abstract_mesh()
    return tree_attention_sharded(q, k, v, lengths, tree_mask, mesh=mesh, sm_scale=scale,
                                  interpret=impl == "pallas_interpret")
  raise ValueError(f"attention_impl={impl!r}; choose one of {ATTENTION_IMPLS}")


def visibility(lengths: jax.Array, tree_mask: jax.Array, num_slots: int) -> jax.Array:
  """Boolean ``[B, T, S]``: may query ``i`` of row ``b`` read cache slot ``s``."""
  w = tree_mask.shape[-1]
  slots = jnp.arange(num_slots, dtype=jnp.int32)
  rel = slots[None, None, :] - lengths[:, None, None]                     # [B, 1, S]
  idx = jnp.broadcast_to(jnp.clip(rel, 0, w - 1), tree_mask.shape[:2] + (num_slots,))
  tree_vis = jnp.take_along_axis(tree_mask, idx, axis=2)                  # [B, T, S]
  return (rel < 0) | ((rel < w) & tree_vis)


def _attend_xla(q, k, v, lengths, tree_mask, scale):
  b, t, n, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  g = n // kh
  vis = visibility(lengths, tree_mask, s)                                 # [B, T, S]
  # Slots no query may read are arbitrary memory (NaN included). Their scores are replaced by
  # the mask below; their values must be zeroed too, or 0 * NaN reaches the output.
  live = jnp.any(vis, axis=1)[:, None, :, None]
  v = jnp.where(live, v, jnp.zeros((), v.dtype))
  qg = q.reshape(b, t, kh, g, h)
  scores = jnp.einsum("BTKGH,BKSH->BKGTS", qg, k, preferred_element_type=jnp.float32,
                      out_sharding=out_spec((BATCH, KV_HEADS, None, SEQ, SEQ),
                                            (b, kh, g, t, s)))
  scores = scores * scale
  scores = jnp.where(vis[:, None, None, :, :], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  # Heads-major output, then the small transpose to [B, T, K, G, H]: asked for directly, XLA
  # made v the left operand contracted over its slots, which XLA:CPU's dot does not take in
  # bfloat16.
  out = jnp.einsum("BKGTS,BKSH->BKGTH", probs, v, preferred_element_type=jnp.float32,
                   out_sharding=out_spec((BATCH, KV_HEADS, None, SEQ, HEAD_DIM),
                                         (b, kh, g, t, h)))
  out = out.transpose(0, 3, 1, 2, 4)                                      # [B, T, K, G, H]
  # A query that sees no key gets zeros, as in the kernel (softmax averaged every live value).
  out = jnp.where(jnp.any(vis, axis=-1)[:, :, None, None, None], out, 0)
  return out.reshape(b, t, n, h).astype(q.dtype)
