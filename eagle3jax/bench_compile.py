"""Compile time against depth: the stacked-layer scan keeps the compiled program one layer
long, so compiling a deep target costs about what a shallow one does.

``compile_scaling`` builds random Llama targets of several depths (same width), then lowers
and compiles, for each, the two programs serving runs: the full-sequence forward with
captures (``eagle3jax.forward``'s jitted function) and the engine's speculative decode loop
(prefill + rounds, as ``generate`` compiles them). Depths are measured alternately, several
times, and the median compile times and their ratio to the shallowest depth are reported.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from eagle3jax import api, checks, engine as eng
from eagle3jax.capture import CaptureSpec
from eagle3jax.config import LlamaConfig
from eagle3jax.drafter import DrafterConfig
from eagle3jax.drafter_io import init_drafter
from eagle3jax.hf_target import init_target
from eagle3jax.sampling import SamplingParams
from eagle3jax.sharding import BATCH, SEQ, shard
from eagle3jax.tree import TreeShape


def _models(num_layers: int, mesh):
  cfg = LlamaConfig.tiny(num_hidden_layers=num_layers, hidden_size=128, intermediate_size=256,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=512)
  target = init_target(cfg, mesh=mesh)
  capture = (CaptureSpec.eagle3_default(num_layers) if num_layers >= 7 else
             CaptureSpec((0, num_layers // 2, num_layers - 1)))
  drafter = init_drafter(DrafterConfig.for_target(cfg, capture), target=target)
  return target, drafter, capture


def lowered_programs(num_layers: int, mesh=None, *, batch: int = 1, prompt_len: int = 32,
                     max_len: int = 128):
  """``{"forward": Lowered, "prefill": Lowered, "decode": Lowered}`` for a random target of
  ``num_layers`` layers (chain of 7 drafts)."""
  target, drafter, capture = _models(num_layers, mesh)
  tokens = jnp.zeros((batch, prompt_len), jnp.int32)
  spec = eng.EngineSpec(tree=TreeShape(7, 1, 8), sampling=SamplingParams(greedy=True, top_k=0),
                        capture=capture)
  out = {}
  with jax.set_mesh(target.mesh):
    g1, s1 = nnx.split(target)
    out["forward"] = api._forward.lower(g1, s1, tokens, capture)
    graphdef, params = nnx.split((target, drafter))
    tokens_d = shard(tokens, (BATCH, SEQ))
    lengths = shard(jnp.full((batch,), prompt_len, jnp.int32), (BATCH,))
    keys = shard(jnp.zeros((batch, 2), jnp.uint32), (BATCH, None))
    dyn = eng.Dynamic(temperature=jnp.float32(0), top_p=jnp.float32(1),
                      eos=jnp.asarray(eng.eos_array()), max_new=jnp.int32(16))
    out["prefill"] = eng._prefill_jit.lower(graphdef, params, tokens_d, lengths, keys, dyn,
                                            spec=spec, max_len=max_len, out_size=24)
    st = jax.eval_shape(lambda: eng._prefill_jit(graphdef, params, tokens_d, lengths, keys, dyn,
                                                 spec=spec, max_len=max_len, out_size=24))
    out["decode"] = eng._decode_jit.lower(graphdef, params, st, dyn, jnp.int32(16), spec=spec)
  return out


@contextlib.contextmanager
def without_persistent_cache():
  """Compiles in the block run XLA even where a persistent compilation cache is set
  (``JAX_COMPILATION_CACHE_DIR``, the test suite's): a hit there would time a read from disk.
  The cache's setting is restored after the block."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # JAX decides once per process whether to use the cache
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def compile_scaling(depths=(6, 48), repeats: int = 3, mesh=None, log=print) -> dict:
  """Median compile seconds per depth for the forward and the decode loop (prefill + rounds),
  and each depth's ratio to the first depth (never read from a persistent cache)."""
  if not depths or any(not checks.is_integer(d) or d < 3 for d in depths):
    raise ValueError(f"depths={list(depths)} must be layer counts >= 3 (the target captures "
                     "three distinct layers)")
  checks.integer("repeats", repeats, 1)
  with without_persistent_cache():
    return _compile_scaling(depths, repeats, mesh, log)


def _compile_scaling(depths, repeats, mesh, log) -> dict:
  times = {d: {"forward": [], "decode": []} for d in depths}
  for r in range(repeats):
    for d in depths:
      jax.clear_caches()  # each compile from scratch (XLA and JAX keep compiled programs)
      progs = lowered_programs(d, mesh)
      t0 = time.perf_counter()
      progs["forward"].compile()
      t1 = time.perf_counter()
      progs["prefill"].compile()
      progs["decode"].compile()
      t2 = time.perf_counter()
      times[d]["forward"].append(t1 - t0)
      times[d]["decode"].append(t2 - t1)
      log(f"repeat {r}: {d} layers: forward {t1 - t0:.2f} s, decode loop {t2 - t1:.2f} s")
  rows = []
  base = depths[0]
  for d in depths:
    row = {"layers": d}
    for k in ("forward", "decode"):
      row[k + "_s"] = statistics.median(times[d][k])
      row[k + "_range_s"] = [min(times[d][k]), max(times[d][k])]
      row[k + "_ratio"] = statistics.median(
          np.asarray(times[d][k]) / np.asarray(times[base][k]))
    rows.append(row)
  return {"depths": list(depths), "repeats": repeats, "rows": rows}


def markdown(result: dict) -> str:
  first = result["depths"][0]
  lines = [f"| layers | forward compile s (range) | ratio to {first} layers | decode-loop compile "
           f"s (range) | ratio to {first} layers |", "|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(
        f"| {r['layers']} | {r['forward_s']:.2f} ({r['forward_range_s'][0]:.2f}-"
        f"{r['forward_range_s'][1]:.2f}) | {r['forward_ratio']:.2f}x | {r['decode_s']:.2f} "
        f"({r['decode_range_s'][0]:.2f}-{r['decode_range_s'][1]:.2f}) | "
        f"{r['decode_ratio']:.2f}x |")
  return "\n".join(lines)
