"""Tree attention over a KV cache: a Pallas kernel, its jnp reference and their input checks.

Speculative decoding verifies a *tree* of ``P`` drafted tokens in one target forward pass: query
``i`` of row ``b`` attends to the committed prefix ``[0, lengths[b])`` of the KV cache and to the
tree tokens (stored at ``lengths[b] + j``) that ``tree_mask[b, i, j]`` allows, i.e. its ancestors
and itself. Plain decode is the case ``P = 1``, ``tree_mask = [[True]]``.

Why a kernel: XLA materialises a ``[P, S]`` score matrix per head over the *whole* cache and
cannot skip cache blocks past each row's length, so a batch of short rows in a long cache pays for
the longest. The kernel is flash-decoding: a grid over (query-row blocks, cache splits, KV heads,
batch) where every program walks its split of the cache in ``block_s`` blocks with an online
softmax (float32 running max, sum and accumulator) and stops at ``lengths[b]``: its loop bound is
computed from ``lengths``, so blocks past the prefix are never read. The ``P`` tree keys are
gathered once by the wrapper and visited as one extra block under the tree mask; the splits are
merged with a log-sum-exp in XLA. All query heads that share a KV head are processed together
(GQA), so each cache block is read once per KV head.

Cache slots past ``lengths[b] + P`` may hold anything, NaN and Inf included: scores are masked with
``where`` and the value rows of masked keys are zeroed before ``p @ v`` so ``0 * NaN`` cannot leak.

The kernel lowers through Triton on NVIDIA GPUs and runs anywhere with ``interpret=True``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Finite "minus infinity": exp(_NEG - m) underflows to 0 and _NEG - _NEG is 0, never NaN.
_NEG = -1e30
# Smallest tile edge of the Triton dot lowering (M, N and K of a tl.dot are all >= 16).
_MIN_TILE = 16
# Programs the default split heuristic aims for: a few waves over an H200's 132 SMs.
_TARGET_PROGRAMS = 512
# Most tree tokens the kernel takes. Its programs hold all P tree keys and values and the
# ``[block_m, P]`` mask and scores as single tiles (step 2 below), so P is bounded like a cache
# block: at 64 a tile of 64 keys x 128 dims is 16 KiB in bf16. A prefill's P is the whole
# prompt bucket (up to thousands of tokens, megabytes a tile: past a GPU's shared memory and
# registers), so ``eagle3jax.attention.attend`` sends calls past 64 to the XLA path.
MAX_TREE_TOKENS = 64


def validate_inputs(q, k, v, lengths, tree_mask) -> None:
  """Checks shapes and dtypes of the tree attention inputs (uses only ``.shape``/``.dtype``).

  Args:
    q: ``[B, P, N, H]`` queries of the tree tokens.
    k: ``[B, K, S, H]`` key cache (``eagle3jax.kv_cache``'s layout), tree keys already written
      at ``lengths[b] + j``.
    v: ``[B, K, S, H]`` value cache, same layout as ``k``.
    lengths: ``[B]`` integer committed prefix length of each row.
    tree_mask: ``[B, P, P]`` bool, query ``i`` may see tree key ``j``.

  Raises:
    ValueError: naming the bad argument, its shape or dtype and what was expected.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if len(x.shape) != 4:
      layout = "[B, P, N, H]" if name == "q" else "[B, K, S, H]"
      raise ValueError(f"{name} must have rank 4 {layout}, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, "
                     f"v {v.dtype}")
  b, p, n, h = q.shape
  kv_heads, s = k.shape[1], k.shape[2]
  empty = [f"{d}={x}" for d, x in zip("BPNH", q.shape) if x == 0]
  if empty or s == 0:
    raise ValueError(f"q (shape {tuple(q.shape)} [B, P, N, H]) and k (shape "
                     f"{tuple(k.shape)} [B, K, S, H]) need non-empty dimensions; got "
                     f"{', '.join(empty + (['S=0'] if s == 0 else []))}")
  if tuple(v.shape) != tuple(k.shape):
    raise ValueError(f"v must have the shape of k {tuple(k.shape)} [B, K, S, H], got "
                     f"{tuple(v.shape)}")
  if k.shape[0] != b:
    raise ValueError(f"k has batch {k.shape[0]} (shape {tuple(k.shape)}) but q has batch {b} "
                     f"(shape {tuple(q.shape)})")
  if k.shape[3] != h:
    raise ValueError(f"k has head dim {k.shape[3]} (shape {tuple(k.shape)}) but q has head dim "
                     f"{h} (shape {tuple(q.shape)})")
  if kv_heads == 0 or n % kv_heads:
    raise ValueError(f"q heads N={n} must be a multiple of k heads K={kv_heads} (q shape "
                     f"{tuple(q.shape)}, k shape {tuple(k.shape)})")
  if s < p:
    raise ValueError(f"k has {s} cache slots (shape {tuple(k.shape)}), fewer than the P={p} "
                     "tree tokens it must hold")
  if tuple(lengths.shape) != (b,):
    raise ValueError(f"lengths must have shape [B] = ({b},), got {tuple(lengths.shape)}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must have an integer dtype, got {lengths.dtype}")
  if tuple(tree_mask.shape) != (b, p, p):
    raise ValueError(f"tree_mask must have shape [B, P, P] = {(b, p, p)}, got "
                     f"{tuple(tree_mask.shape)}")
  if tree_mask.dtype != jnp.bool_:
    raise ValueError(f"tree_mask must have dtype bool, got {tree_mask.dtype}")


def check_tree_tokens(p: int) -> None:
  """Raises ``ValueError`` when ``P`` tree tokens exceed what the kernel holds as one tile."""
  if p > MAX_TREE_TOKENS:
    raise ValueError(f"q has P={p} tree tokens; the kernel takes at most {MAX_TREE_TOKENS} (it "
                     "holds the tree's keys and mask as single tiles). Use the XLA path "
                     "(eagle3jax.attention.attend routes longer calls, such as a long prefill, "
                     "there) or a smaller tree")


def _default_scale(sm_scale, head_dim: int) -> float:
  return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def _precision(dtype):
  # float32 inputs: exact IEEE products (GPU default would be TF32); bf16/f16: tensor cores.
  return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def tree_attention_reference(q, k, v, lengths, tree_mask, *, sm_scale=None):
  """Plain-jnp tree attention: materialises ``[B, N, P, S]`` scores, float32 softmax.

  Same contract as :func:`tree_attention`; returns ``[B, P, N, H]`` in ``q``'s dtype.
  """
  validate_inputs(q, k, v, lengths, tree_mask)
  return _reference(q, k, v, lengths, tree_mask, sm_scale=_default_scale(sm_scale, q.shape[3]))


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _reference(q, k, v, lengths, tree_mask, *, sm_scale):
  b, p, n, h = q.shape
  kv_heads, s = k.shape[1], k.shape[2]
  empty = [f"{d}={x}" for d, x in zip("BPNH", q.shape) if x == 0]
  if empty or s == 0:
    raise ValueError(f"q (shape {tuple(q.shape)} [B, P, N, H]) and k (shape "
                     f"{tuple(k.shape)} [B, K, S, H]) need non-empty dimensions; got "
                     f"{', '.join(empty + (['S=0'] if s == 0 else []))}")
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, s - p)
  rel = jnp.arange(s, dtype=jnp.int32)[None, :] - lengths[:, None]       # [B, S] tree index
  idx = jnp.broadcast_to(jnp.clip(rel, 0, p - 1)[:, None, :], (b, p, s))
  tree_vis = jnp.take_along_axis(tree_mask, idx, axis=2)                 # [B, P, S]
  visible = (rel < 0)[:, None, :] | (((rel >= 0) & (rel < p))[:, None, :] & tree_vis)
  written = (rel < p)[:, None, :, None]                                  # [B, 1, S, 1]
  kf = jnp.where(written, k, 0).astype(jnp.float32)
  vf = jnp.where(written, v, 0).astype(jnp.float32)
  qf = q.astype(jnp.float32).reshape(b, p, kv_heads, n // kv_heads, h)
  scores = jnp.einsum("BPKGH,BKSH->BKGPS", qf, kf, precision=lax.Precision.HIGHEST) * sm_scale
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  m = scores.max(axis=-1, keepdims=True)
  probs = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))          # [B, K, G, P, S]
  denom = probs.sum(axis=-1)                                             # [B, K, G, P]
  out = jnp.einsum("BKGPS,BKSH->BPKGH", probs, vf, precision=lax.Precision.HIGHEST)
  denom = jnp.where(denom == 0, 1.0, denom).transpose(0, 3, 1, 2)[..., None]
  return (out / denom).reshape(b, p, n, h).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


def _tree_attention_kernel(
    lengths_ref,  # [1] int32
    q_ref,        # [bm, H] query rows (tree token i, group head g) of one KV head
    tmask_ref,    # [bm, Pp] int32 tree mask of those rows
    kt_ref,       # [Pp, H] tree keys (zero padded)
    vt_ref,       # [Pp, H] tree values (zero padded)
    k_ref,        # [S, H] key cache of one row and KV head
    v_ref,        # [S, H] value cache
    o_ref,        # [bm, H] float32 unnormalised output of this split
    m_ref,        # [bm] float32 running max of this split
    l_ref,        # [bm] float32 running sum of this split
    *, sm_scale: float, block_s: int, chunk: int,
):
  split = pl.program_id(1)
  length = lengths_ref[0]
  num_slots = k_ref.shape[0]
  q = q_ref[...]
  bm, h = q.shape
  precision = _precision(q.dtype)

  def update(carry, k, v, visible):
    acc, m, l = carry
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * sm_scale  # [bm, bs]
    s = jnp.where(visible, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)  # [bm, H]
    return acc * alpha[:, None] + pv, m_new, l * alpha + p.sum(axis=1)

  # This split covers prefix slots [lo, hi); past the prefix there is nothing to read.
  lo = split * chunk
  hi = jnp.minimum(lo + chunk, length)
  num_blocks = (jnp.maximum(hi - lo, 0) + block_s - 1) // block_s

  def prefix_block(t, carry):
    start = lo + t * block_s
    # A final block that would run past the cache end is read from S - block_s instead; the
    # slots it re-reads below `start` were counted by the previous block and are masked out.
    start_in = jnp.minimum(start, num_slots - block_s)
    slot = start_in + jnp.arange(block_s, dtype=jnp.int32)
    valid = (slot >= start) & (slot < hi)                                 # [bs]
    k = k_ref[pl.ds(start_in, block_s), :]
    v = jnp.where(valid[:, None], v_ref[pl.ds(start_in, block_s), :], 0)
    return update(carry, k, v, valid[None, :])

  carry = (jnp.zeros((bm, h), jnp.float32), jnp.full((bm,), _NEG, jnp.float32),
           jnp.zeros((bm,), jnp.float32))
  carry = lax.fori_loop(0, num_blocks, prefix_block, carry)
  # The tree keys are one more block; only split 0 counts them.
  tree_visible = (tmask_ref[...] != 0) & (split == 0)
  acc, m, l = update(carry, kt_ref[...], vt_ref[...], tree_visible)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def _next_pow2(x: int) -> int:
  return 1 if x <= 1 else 2 ** (x - 1).bit_length()


def _check_block(name: str, value) -> None:
  if not isinstance(value, int) or value < _MIN_TILE or value & (value - 1):
    raise ValueError(f"{name} must be a power of two >= {_MIN_TILE}, got {value!r}")


def tree_attention(q, k, v, lengths, tree_mask, *, sm_scale=None, interpret: bool = False,
                   block_s: int = 64, block_m: int = 64, num_splits: int | None = None,
                   num_warps: int = 4, num_stages: int = 2):
  """Tree attention of ``P`` tree tokens over a KV cache (Pallas kernel).

  Args:
    q: ``[B, P, N, H]`` queries; float32, bfloat16 or float16.
    k: ``[B, K, S, H]`` key cache with the tree keys at ``lengths[b] .. lengths[b] + P - 1``;
      slots past ``lengths[b] + P`` are ignored (they may hold NaN/Inf). ``N % K == 0``.
    v: ``[B, K, S, H]`` value cache, same layout.
    lengths: ``[B]`` integer committed prefix lengths, ``0 <= lengths[b] <= S - P`` (clipped to
      that range).
    tree_mask: ``[B, P, P]`` bool; query ``i`` sees tree key ``j`` iff ``tree_mask[b, i, j]``.
      ``P <= MAX_TREE_TOKENS`` (64).
    sm_scale: score scale, default ``1 / sqrt(H)``.
    interpret: run the kernel in the Pallas interpreter (any backend, e.g. CPU tests).
    block_s: cache slots per block (power of two >= 16; capped at the cache size).
    block_m: query rows (``P * N / K`` per KV head) per program (power of two >= 16).
    num_splits: cache splits per row (flash-decoding); default fills about
      ``_TARGET_PROGRAMS`` programs.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages of the block loop.

  Returns:
    ``[B, P, N, H]`` in ``q``'s dtype. A query that sees no key gets zeros.
  """
  validate_inputs(q, k, v, lengths, tree_mask)
  check_tree_tokens(q.shape[1])
  _check_block("block_s", block_s)
  _check_block("block_m", block_m)
  if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
    raise ValueError(f"num_splits must be a positive integer or None, got {num_splits!r}")
  return _tree_attention(
      q, k, v, lengths, tree_mask, sm_scale=_default_scale(sm_scale, q.shape[3]),
      interpret=bool(interpret), block_s=block_s, block_m=block_m, num_splits=num_splits,
      num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "interpret", "block_s", "block_m", "num_splits", "num_warps", "num_stages"))
def _tree_attention(q, k, v, lengths, tree_mask, *, sm_scale, interpret, block_s, block_m,
                    num_splits, num_warps, num_stages):
  b, p, n, h = q.shape
  kv_heads, s = k.shape[1], k.shape[2]
  empty = [f"{d}={x}" for d, x in zip("BPNH", q.shape) if x == 0]
  if empty or s == 0:
    raise ValueError(f"q (shape {tuple(q.shape)} [B, P, N, H]) and k (shape "
                     f"{tuple(k.shape)} [B, K, S, H]) need non-empty dimensions; got "
                     f"{', '.join(empty + (['S=0'] if s == 0 else []))}")
  g = n // kv_heads
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, s - p)

  # --- Step 1: tree keys/values out of the cache, before any padding ---
  take = jax.vmap(lambda x, start: lax.dynamic_slice_in_dim(x, start, p, axis=1))
  kt, vt = take(k, lengths), take(v, lengths)                            # [B, K, P, H]

  # --- Step 2: pad to Triton tile sizes (powers of two >= 16) ---
  hp = max(_MIN_TILE, _next_pow2(h))
  pp = max(_MIN_TILE, _next_pow2(p))
  rows = p * g                                                           # row r = i * G + g
  if rows <= block_m:
    block_m = max(_MIN_TILE, _next_pow2(rows))
  mp = -(-rows // block_m) * block_m
  num_m = mp // block_m
  if hp != h:  # copies the cache: only for head dims that are not a power of two
    k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, hp - h)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, hp - h)))
  if s < _MIN_TILE:
    k = jnp.pad(k, ((0, 0), (0, 0), (0, _MIN_TILE - s), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, _MIN_TILE - s), (0, 0)))
  s_in = k.shape[2]
  kt = jnp.pad(kt, ((0, 0), (0, 0), (0, pp - p), (0, hp - h)))
  vt = jnp.pad(vt, ((0, 0), (0, 0), (0, pp - p), (0, hp - h)))
  qg = q.reshape(b, p, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, rows, h)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, mp - rows), (0, hp - h)))        # [B, K, Mp, Hp]
  tmask = jnp.repeat(tree_mask, g, axis=1).astype(jnp.int32)             # [B, P*G, P]
  tmask = jnp.pad(tmask, ((0, 0), (0, mp - rows), (0, pp - p)))         # [B, Mp, Pp]

  # --- Step 3: split the cache (flash-decoding) ---
  block_s = min(block_s, 2 ** (s_in.bit_length() - 1))
  total_blocks = -(-s // block_s)
  if num_splits is None:
    num_splits = -(-_TARGET_PROGRAMS // (b * kv_heads * num_m))
  num_splits = max(1, min(num_splits, total_blocks))
  chunk = -(-total_blocks // num_splits) * block_s
  num_splits = -(-s // chunk)

  # --- Step 4: the kernel; grid (m block, split, kv head, row) ---
  kernel = functools.partial(_tree_attention_kernel, sm_scale=sm_scale, block_s=block_s,
                             chunk=chunk)
  cache_spec = pl.BlockSpec((None, None, s_in, hp), lambda mi, j, kh, bi: (bi, kh, 0, 0))
  tree_spec = pl.BlockSpec((None, None, pp, hp), lambda mi, j, kh, bi: (bi, kh, 0, 0))
  part_shape = (b, kv_heads, num_splits, mp)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(num_m, num_splits, kv_heads, b),
      in_specs=[
          pl.BlockSpec((1,), lambda mi, j, kh, bi: (bi,)),
          pl.BlockSpec((None, None, block_m, hp), lambda mi, j, kh, bi: (bi, kh, mi, 0)),
          pl.BlockSpec((None, block_m, pp), lambda mi, j, kh, bi: (bi, mi, 0)),
          tree_spec, tree_spec, cache_spec, cache_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, block_m, hp),
                       lambda mi, j, kh, bi: (bi, kh, j, mi, 0)),
          pl.BlockSpec((None, None, None, block_m), lambda mi, j, kh, bi: (bi, kh, j, mi)),
          pl.BlockSpec((None, None, None, block_m), lambda mi, j, kh, bi: (bi, kh, j, mi)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct(part_shape + (hp,), jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
      ],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="tree_attention",
  )(lengths, qg, tmask, kt, vt, k, v)

  # --- Step 5: merge the splits (log-sum-exp) and undo the layout ---
  weight = jnp.exp(m - m.max(axis=2, keepdims=True))                     # [B, K, splits, Mp]
  denom = (weight * l).sum(axis=2)                                       # [B, K, Mp]
  out = (weight[..., None] * o).sum(axis=2)                              # [B, K, Mp, Hp]
  out = out / jnp.where(denom == 0, 1.0, denom)[..., None]
  out = out[:, :, :rows, :h].reshape(b, kv_heads, p, g, h).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, p, n, h).astype(q.dtype)
