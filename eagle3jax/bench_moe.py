"""MoE forward time against the number of experts at a fixed top-k: dense reference vs grouped.

``moe_scaling`` times the routed-expert forward (routing included, shared experts excluded) of
random layers with E experts for a verify-sized row of tokens (1 x 8) and a prefill-sized batch
(4 x 64), once with the dense ``moe_reference`` (every expert on every token) and once with the
grouped path ``auto`` picks. All (E, shape, path) programs are compiled first, then timed in
interleaved repetitions so that each repetition measures every program side by side on the same
machine state; medians of times and of per-repetition ratios are reported.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3jax import moe

SHAPES = ((1, 8), (4, 64))


def _layer(e: int, top_k: int, hidden: int, ffn: int, seed: int):
  rng = np.random.default_rng(seed)
  def w(*shape):
    return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)
  experts = moe.Experts(w(e, hidden, ffn), w(e, hidden, ffn), w(e, ffn, hidden))
  gate = w(hidden, e)
  bias = jnp.asarray(rng.normal(size=(e,)) * 0.1, jnp.float32)
  return gate, bias, experts, moe.RoutingConfig(num_experts=e, top_k=top_k)


def _time(fn, args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def moe_scaling(experts=(16, 64, 256), top_k: int = 4, hidden: int = 512, ffn: int = 256,
                repeats: int = 20, log=print) -> dict:
  """Median forward milliseconds per (E, tokens) for the reference and the grouped path, the
  median per-repetition ratio reference / grouped, and each time relative to the smallest E."""
  progs = {}
  for e in experts:
    gate, bias, ex, rc = _layer(e, top_k, hidden, ffn, seed=e)
    for b, t in SHAPES:
      x = jnp.asarray(np.random.default_rng(b * t).normal(size=(b, t, hidden)), jnp.float32)
      impl = moe.choose_impl(b * t, top_k, e)
      for path, chosen in (("reference", "reference"), ("grouped", impl)):
        fn = jax.jit(functools.partial(moe.routed_experts, rc=rc, impl=chosen))
        args = (x, gate, bias, ex)
        jax.block_until_ready(fn(*args))  # compile
        progs[(e, b, t, path)] = (fn, args, chosen)
  log(f"compiled {len(progs)} programs on {jax.default_backend()}")
  times = {key: [] for key in progs}
  for r in range(repeats):
    for key, (fn, args, _) in progs.items():
      times[key].append(_time(fn, args))
  rows = []
  base = experts[0]
  for b, t in SHAPES:
    for e in experts:
      ref, grp = (np.asarray(times[(e, b, t, p)]) for p in ("reference", "grouped"))
      ref0, grp0 = (np.asarray(times[(base, b, t, p)]) for p in ("reference", "grouped"))
      rows.append({
          "experts": e, "tokens": f"{b}x{t}", "impl": progs[(e, b, t, "grouped")][2],
          "reference_ms": 1e3 * statistics.median(ref),
          "grouped_ms": 1e3 * statistics.median(grp),
          "speedup": statistics.median(ref / grp),
          "reference_vs_base": statistics.median(ref / ref0),
          "grouped_vs_base": statistics.median(grp / grp0),
      })
  return {"backend": jax.default_backend(), "top_k": top_k, "hidden": hidden, "ffn": ffn,
          "repeats": repeats, "base_experts": base, "rows": rows}


def markdown(result: dict) -> str:
  base = result["base_experts"]
  lines = [f"| tokens | experts | reference ms | grouped ms (path) | reference / grouped | "
           f"reference vs E={base} | grouped vs E={base} |", "|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(f"| {r['tokens']} | {r['experts']} | {r['reference_ms']:.3f} | "
                 f"{r['grouped_ms']:.3f} ({r['impl']}) | {r['speedup']:.2f}x | "
                 f"{r['reference_vs_base']:.2f}x | {r['grouped_vs_base']:.2f}x |")
  return "\n".join(lines)
