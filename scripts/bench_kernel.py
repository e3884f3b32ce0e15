"""Times the tree attention Pallas kernel against XLA on verify-shaped problems.

Three implementations of the same attention, each jitted and timed on the same values (dpa on
a copy in its own ``[B, S, K, H]`` layout, made before the timing):

* ``kernel``: ``eagle3jax.kernels.tree_attention`` (Pallas, Triton on GPU).
* ``xla``: the engine's XLA path (``eagle3jax.attention.attend(impl="xla")``, what it runs without
  the kernel: ``[B, N, P, S]`` scores from inputs in their own dtype, float32 accumulation).
* ``dpa``: ``jax.nn.dot_product_attention`` with ``implementation="cudnn"`` (or ``"xla"`` when
  cuDNN rejects the problem; the row's ``dpa_impl`` says which ran; ``None`` would mean XLA in
  jax 0.10) and an equivalent boolean ``mask [B, 1, P, S]`` (broadcast over heads): slot ``s`` is visible
  to query ``i`` iff ``s < lengths[b]`` or (``0 <= s - lengths[b] < P`` and
  ``tree_mask[b, i, s - lengths[b]]``). Building that mask is part of the timed function, as it
  would be in an engine. Unlike the other two, dpa is not NaN-safe past ``lengths + P``; the
  benchmark cache holds no NaN.

``max_abs_err`` is the kernel's largest difference from ``tree_attention_reference`` (float32 at
``HIGHEST`` precision: the accuracy yardstick, too slow to be a fair baseline).

Each time is the median of ``--iters`` runs after a warmup, in microseconds. The kernel's
KV-read bandwidth counts the bytes it must read: ``2 * B * (lengths + P) * K * H * itemsize``.

  python3 scripts/bench_kernel.py [--out results.json]       # on a GPU
  python3 scripts/bench_kernel.py --interpret --small        # CPU smoke test
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3jax.attention import attend
from eagle3jax.flags import check_writable, positive_int, write_json
from eagle3jax.kernels import tree_attention, tree_attention_reference

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e
N_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def problems(small: bool):
  """(B, P, S, N, K, H) tuples."""
  if small:
    return [(b, p, 64, 4, 2, 16) for b in (1, 2) for p in (1, 4)]
  return [(b, p, s, N_HEADS, KV_HEADS, HEAD_DIM)
          for b in (1, 8) for p in (8, 64) for s in (1024, 8192, 32768)]


def chain_mask(b: int, p: int) -> jax.Array:
  """A tree of depth ``p / 2``: two chains from the root (nodes alternate between them)."""
  parent = [-1] + [max(i - 2, 0) for i in range(1, p)]
  mask = np.zeros((p, p), bool)
  for i in range(p):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parent[j]
  return jnp.asarray(np.broadcast_to(mask, (b, p, p)))


def dpa_attention(q, k, v, lengths, tree_mask, *, implementation):
  """``jax.nn.dot_product_attention`` under the tree mask; ``k, v [B, S, K, H]``."""
  p, s = q.shape[1], k.shape[1]
  rel = jnp.arange(s, dtype=jnp.int32)[None, :] - lengths[:, None]        # [B, S]
  idx = jnp.broadcast_to(jnp.clip(rel, 0, p - 1)[:, None, :], (q.shape[0], p, s))
  tree_vis = jnp.take_along_axis(tree_mask, idx, axis=2)                  # [B, P, S]
  mask = (rel < 0)[:, None, :] | (((rel >= 0) & (rel < p))[:, None, :] & tree_vis)
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                     implementation=implementation)


def time_us(fn, args, iters: int) -> float:
  jax.block_until_ready(fn(*args))  # compile + warmup
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e6


def bench_one(b, p, s, n, k, h, *, dtype, iters, interpret):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, p, n, h), np.float32), dtype)
  kc = jnp.asarray(rng.standard_normal((b, k, s, h), np.float32), dtype)  # the cache's layout
  vc = jnp.asarray(rng.standard_normal((b, k, s, h), np.float32), dtype)
  lengths = jnp.full((b,), s - p, jnp.int32)
  args = (q, kc, vc, lengths, chain_mask(b, p))
  # dot_product_attention takes [B, S, K, H]: its own copy, made before the timing.
  dpa_args = (q, jnp.swapaxes(kc, 1, 2), jnp.swapaxes(vc, 1, 2)) + args[3:]
  scale = 1.0 / h ** 0.5
  impls = {
      "kernel": jax.jit(functools.partial(tree_attention, sm_scale=scale, interpret=interpret)),
      "xla": jax.jit(functools.partial(attend, scale=scale, impl="xla")),
  }
  row = dict(B=b, P=p, S=s, N=n, K=k, H=h, dtype=jnp.dtype(dtype).name)
  for implementation in ("cudnn", "xla"):
    impls["dpa"] = jax.jit(functools.partial(dpa_attention, implementation=implementation))
    try:
      jax.block_until_ready(impls["dpa"](*dpa_args))
    except Exception:  # pylint: disable=broad-except  # cuDNN absent or shape unsupported
      if implementation == "xla":
        raise
      continue
    row["dpa_impl"] = implementation
    break
  err = jnp.abs(impls["kernel"](*args).astype(jnp.float32)
                - tree_attention_reference(*args, sm_scale=scale).astype(jnp.float32)).max()
  row["max_abs_err"] = float(err)
  for name, fn in impls.items():
    row[f"{name}_us"] = time_us(fn, dpa_args if name == "dpa" else args, iters)
  row["xla_over_kernel"] = row["xla_us"] / row["kernel_us"]
  row["dpa_over_kernel"] = row["dpa_us"] / row["kernel_us"]
  kv_bytes = 2 * b * s * k * h * jnp.dtype(dtype).itemsize     # lengths + P == S
  row["kernel_GBps"] = kv_bytes / (row["kernel_us"] * 1e-6) / 1e9
  row["pct_of_4.8TBps"] = 100 * kv_bytes / (row["kernel_us"] * 1e-6) / PEAK_BYTES_PER_S
  return row


HEADER = (f"{'B':>2} {'P':>3} {'S':>6} {'kernel_us':>10} {'xla_us':>10} {'dpa_us':>10} "
          f"{'xla/kern':>8} {'dpa/kern':>8} {'GB/s':>8} {'%4.8TB/s':>8} {'max_err':>8} {'dpa':>5}")


def format_row(r) -> str:
  return (f"{r['B']:>2} {r['P']:>3} {r['S']:>6} {r['kernel_us']:>10.1f} {r['xla_us']:>10.1f} "
          f"{r['dpa_us']:>10.1f} {r['xla_over_kernel']:>8.2f} {r['dpa_over_kernel']:>8.2f} "
          f"{r['kernel_GBps']:>8.1f} {r['pct_of_4.8TBps']:>8.1f} {r['max_abs_err']:>8.2g} {r['dpa_impl']:>5}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
  parser.add_argument("--small", action="store_true", help="tiny shapes for a smoke test")
  parser.add_argument("--iters", type=positive_int, default=None,
                      help="timed runs (default 20, 3 small)")
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  parser.add_argument("--out", help="write the rows as JSON to this file")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu" and not args.interpret:
    parser.error(f"backend is {jax.default_backend()}: the kernel needs a GPU or --interpret")
  if args.out:
    try:
      check_writable(args.out, "--out")
    except ValueError as e:
      parser.error(str(e))
  iters = args.iters or (3 if args.small else 20)
  print(f"tree attention, {jax.devices()[0].device_kind}, {args.dtype}, median of {iters}")
  print(HEADER)
  rows = []
  for shape in problems(args.small):
    row = bench_one(*shape, dtype=jnp.dtype(args.dtype), iters=iters, interpret=args.interpret)
    rows.append(row)
    print(format_row(row), flush=True)
  if args.out:
    return write_json(args.out, "--out", {"device": jax.devices()[0].device_kind, "rows": rows},
                      "bench_kernel.py")
  return 0


if __name__ == "__main__":
  sys.exit(main())
