"""Where a speculative round goes: its phases timed one by one, in autoregressive-step units.

A round (``eagle3jax.engine``) is draft, verify, accept + commit, catch-up and emit; in serving
it is one ``while_loop`` body. Here each phase is compiled on its own from the engine's own
code (``engine.phase_*``), fed the real decoding state after a few rounds, with the cache it
updates donated (so in-place updates stay in place, as in the loop), and timed as the median
of many calls. The whole round and the autoregressive step are timed in the real loop
(``generate``'s decode seconds per round), alternating prompt by prompt so that drift in the
machine's speed hits both alike. ``other`` is the round minus the phases' sum: the emit, the
loop's own work, and (negative) the per-call dispatch that the separate phases pay and the
loop does not.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3jax import capture_contract as contract
from eagle3jax import checks
from eagle3jax import engine as eng
from eagle3jax.generate import _compiled, generate, start
from eagle3jax.monitor import AcceptanceWarning
from eagle3jax.sampling import SamplingParams
from eagle3jax.tree import TreeShape
from eagle3jax.semantics import standard_numpy

PHASES = ("draft", "verify", "accept_commit", "catch_up")


def _median_ms(fn, make_args, repeats: int) -> float:
  """Median wall time of ``fn(*make_args())`` (arguments built, and ready, before the clock)."""
  times = []
  for _ in range(repeats):
    args = make_args()
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@standard_numpy
def phase_times(target, drafter, prompt: list[int], tree: TreeShape, *,
                max_new_tokens: int = 128, warm_rounds: int = 4,
                repeats: int = 40) -> dict[str, float]:
  """Milliseconds of each phase of a greedy batch-1 round at ``tree`` (``PHASES``)."""
  contract.check_served(target, drafter, where="the drafter passed to phase_times")
  spec = eng.EngineSpec(tree=tree, sampling=SamplingParams(greedy=True, top_k=0),
                        capture=contract.check_serving_capture(drafter, None))
  with jax.set_mesh(target.mesh):
    graphdef, params, st, dyn, _, _ = start(target, drafter, [prompt], spec,
                                            max_new_tokens=max_new_tokens,
                                            eos=eng.eos_array())
    budget = jnp.int32(warm_rounds)
    decode, _ = _compiled("decode", eng._decode_jit, graphdef, params, st, dyn, budget,
                          spec=spec)
    st = decode(params, st, dyn, budget)

    def models(p):
      return nnx.merge(graphdef, p)

    def draft_fn(p, st, dcache):
      return eng.phase_draft(models(p)[1], dataclasses.replace(st, draft_cache=dcache),
                             spec)

    def verify_fn(p, st, tcache, draft):
      return eng.phase_verify(models(p)[0], dataclasses.replace(st, target_cache=tcache),
                              draft, spec)

    def commit_fn(st, draft, logits, aux, tcache, dyn):
      return eng.phase_accept_commit(st, draft, logits, aux, tcache, dyn, None, spec)

    def catch_up_fn(p, st, dcache, c):
      return eng.phase_catch_up(models(p)[1], st, dcache, c, spec)

    draft_j = jax.jit(draft_fn, donate_argnums=(2,))
    verify_j = jax.jit(verify_fn, donate_argnums=(2,))
    commit_j = jax.jit(commit_fn, donate_argnums=(4,))
    catch_up_j = jax.jit(catch_up_fn, donate_argnums=(2,))

    # One pass in order gives every phase its real inputs (and compiles it).
    draft = draft_j(params, st, _copy(st.draft_cache))
    logits, aux, tcache = verify_j(params, st, _copy(st.target_cache), draft)
    c = commit_j(st, draft, logits, aux, _copy(tcache), dyn)
    catch_up_j(params, st, _copy(draft.draft_cache), c)

    return {
        "draft": _median_ms(draft_j, lambda: (params, st, _copy(st.draft_cache)), repeats),
        "verify": _median_ms(verify_j, lambda: (params, st, _copy(st.target_cache), draft),
                             repeats),
        "accept_commit": _median_ms(
            commit_j, lambda: (st, draft, logits, aux, _copy(tcache), dyn), repeats),
        "catch_up": _median_ms(catch_up_j,
                               lambda: (params, st, _copy(draft.draft_cache), c), repeats),
    }


def check_new_tokens(max_new_tokens) -> int:
  """Timing rounds needs rounds: with one new token the prefill emits it and none runs."""
  if not checks.is_integer(max_new_tokens) or max_new_tokens < 2:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 2 to time "
                     "rounds (with 1 the prefill emits the only token and no round runs)")
  return int(max_new_tokens)


@standard_numpy
def loop_times(target, drafter, prompts, tree: TreeShape, *,
               max_new_tokens: int = 128) -> tuple[float, float]:
  """``(round ms, autoregressive step ms)`` in the real decode loop, batch 1, alternating.
  (The live monitor is silenced, as in ``monitor.measure_acceptance``: one hard prompt at
  batch 1 falls below half of the drafter's recorded mean without anything being wrong.)"""
  max_new_tokens = check_new_tokens(max_new_tokens)
  kw = dict(max_new_tokens=max_new_tokens, eos_ids=[])
  spec_kw = dict(num_steps=tree.num_steps, topk=tree.topk,
                 num_draft_tokens=tree.num_draft_tokens)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", AcceptanceWarning)
    generate(target, None, prompts[:1], **kw)              # compile
    generate(target, drafter, prompts[:1], **kw, **spec_kw)
    sec = {"ar": 0.0, "spec": 0.0}
    rounds = {"ar": 0, "spec": 0}
    for p in prompts:
      for name, d in (("ar", None), ("spec", drafter)):
        r = generate(target, d, [p], **kw, **(spec_kw if d is not None else {}))
        sec[name] += r.stats["decode_s"]
        rounds[name] += r.stats["rounds"]
  return 1e3 * sec["spec"] / rounds["spec"], 1e3 * sec["ar"] / rounds["ar"]


@standard_numpy
def profile_round(target, drafter, prompts, tree: TreeShape, *, max_new_tokens: int = 128,
                  repeats: int = 40) -> dict:
  """The breakdown of one tree shape: phase and round milliseconds and the same in
  autoregressive steps (``*_ar``)."""
  max_new_tokens = check_new_tokens(max_new_tokens)
  phases = phase_times(target, drafter, prompts[0], tree, max_new_tokens=max_new_tokens,
                       repeats=repeats)
  round_ms, ar_ms = loop_times(target, drafter, prompts, tree, max_new_tokens=max_new_tokens)
  out = {"ar_step_ms": ar_ms, "round_ms": round_ms, "round_ar": round_ms / ar_ms}
  for name in PHASES:
    out[f"{name}_ms"] = phases[name]
    out[f"{name}_ar"] = phases[name] / ar_ms
  out["other_ms"] = round_ms - sum(phases.values())
  out["other_ar"] = out["other_ms"] / ar_ms
  return out
