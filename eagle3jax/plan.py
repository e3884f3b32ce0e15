"""Sizing a deployment on paper: the real model, compiled without its weights.

``plan`` builds a target (and drafter) from published ``config.json`` files with abstract
arrays only (``nnx.eval_shape``; every parameter a ``ShapeDtypeStruct`` with the sharding the
rules give it, nothing of model size allocated), on a mesh of devices that need not exist (fake
CPU devices), and AOT-compiles the two programs ``generate`` runs, prefill and the speculative
decode loop, for batch ``B`` (run as ``generate`` runs it: padded to its bucket,
``generate.batch_bucket``) and cache length ``S``. It reports per device:

* ``weights``: the bytes of every parameter shard a device holds (quantized weights as stored:
  INT4 / FP8 values plus their scales);
* ``kv_cache``: the target's (and drafter's) caches, and the bytes per token;
* ``temp``: the compiled programs' temporary buffers (``compiled.memory_analysis()``; the larger
  of prefill and decode);
* ``total`` against the device memory, whether it fits, the largest batch at context ``S`` (the
  rows that fit, ``max_rows``, rounded down to a batch whose bucket fits) and the longest
  context at batch ``B`` that fit (temporaries scaled linearly with the rows from the compiled
  point: an estimate);

and per speculative round: FLOPs and bytes accessed (``compiled.cost_analysis()``), with a
roofline estimate of the round's time on the named device and the tokens/s that gives at a
stated acceptance length.

``cost_analysis`` counts a loop body once, and the layers run as ``lax.scan`` loops, so each
stack's per-layer cost is measured by compiling the round again with one layer of each scan
segment peeled out of its loop (``eagle3jax.stack.peeled``), and added for the iterations the
loops run beyond the one counted (see ``round_cost``). Mixture-of-experts layers are compiled
as a GPU would run them (``eagle3jax.moe.as_accelerator``): a decode round with up to four
(token, expert) pairs per local expert gathers each pair's expert (a loop-free program, counted
exactly; it reads at most 4x, at batch 1 on Kimi-K2.5 1.3x, the expert weights a grouped kernel
reads once); larger calls (prefill) run the ``tiles`` loop in place of ``ragged_dot``, whose
cost_analysis counts one tile. Costs come from XLA:CPU's optimised program (its fusion decisions, not a GPU's), so the
roofline is a first estimate, to be compared with a real run (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from eagle3jax import engine as eng
from eagle3jax import moe
from eagle3jax import stack as stack_lib
from eagle3jax.capture import CaptureSpec
from eagle3jax.deepseek_config import DEEPSEEK_MODEL_TYPES, hf_model_type
from eagle3jax.drafter import Eagle3Drafter, drafter_kv_repeat
from eagle3jax.generate import batch_bucket
from eagle3jax.sampling import SamplingParams
from eagle3jax.checks import is_integer
from eagle3jax.sharding import BATCH, SEQ, TENSOR, make_mesh, param_spec, shard
from eagle3jax.tree import TreeShape
from eagle3jax.semantics import standard_numpy

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Peak numbers of an accelerator (dense bf16 matmul FLOP/s, HBM bytes/s, HBM GiB)."""
  name: str
  flops_per_s: float
  hbm_bytes_per_s: float
  hbm_gib: float


DEVICES = {
    "h200": DeviceSpec("H200", 989e12, 4.8e12, 141.0),
    "h100": DeviceSpec("H100", 989e12, 3.35e12, 80.0),
}


def _abstract_state(module, mesh):
  """``(graphdef, state)`` of an abstract module, every leaf a ``ShapeDtypeStruct`` with its
  sharding on ``mesh``."""
  graphdef, state = nnx.split(module)

  def with_sharding(var):
    meta = var.get_metadata()
    value = var.get_value()
    spec = param_spec(meta["axes"], value.shape, mesh)
    return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                            sharding=NamedSharding(mesh, spec)))

  state = jax.tree.map(with_sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return graphdef, state


def _per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct``s (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def _drafter_capture(hf: dict, num_layers: int) -> CaptureSpec:
  """The drafter's capture ids; either convention reads the same amount, so ambiguous ids are
  read as outputs (ids clipped to the target's depth when the drafter is for a deeper one)."""
  from eagle3jax.capture_contract import resolve_capture  # pylint: disable=import-outside-toplevel
  eagle = hf.get("eagle_config") or {}
  recorded = eagle.get("aux_layer_convention", hf.get("aux_layer_convention"))
  spec, _, _ = resolve_capture(hf, num_layers, None if recorded else "output")
  return spec


def build(hf_cfg: dict, drafter_hf: dict | None, mesh, *, dtype=jnp.bfloat16,
          quantization: str = "keep"):
  """Abstract target and drafter for ``mesh``: ``(graphdef, params, target, drafter, capture)``
  where ``params`` are sharded ``ShapeDtypeStruct``s (``drafter`` None without a config)."""
  from eagle3jax.hf_target import target_factory  # pylint: disable=import-outside-toplevel
  cfg, factory, _, _ = target_factory(hf_cfg, mesh, dtype, quantization)
  target = nnx.eval_shape(factory)
  drafter, capture = None, None
  if drafter_hf is not None:
    from eagle3jax.capture_contract import check_pair  # pylint: disable=import-outside-toplevel
    from eagle3jax.drafter_io import config_from_hf  # pylint: disable=import-outside-toplevel
    capture = _drafter_capture(drafter_hf, cfg.num_hidden_layers)
    dcfg = config_from_hf(drafter_hf, capture)
    check_pair(target, dcfg)
    kv_repeat = drafter_kv_repeat(dcfg, mesh.shape[TENSOR])
    drafter = nnx.eval_shape(lambda: Eagle3Drafter(dcfg, kv_repeat=kv_repeat, dtype=dtype))
    drafter.embed_tokens = target.embed_tokens  # shared, as load_drafter does
  graphdef, params = _abstract_state((target, drafter), mesh)
  return graphdef, params, target, drafter, capture


def _lower(graphdef, params, target, capture, spec, batch, prompt_len, max_len):
  """Lowers prefill and the decode loop; returns (prefill, decode, abstract decode state)."""
  tokens = shard(jnp.zeros((batch, prompt_len), jnp.int32), (BATCH, SEQ))
  lengths = shard(jnp.full((batch,), prompt_len, jnp.int32), (BATCH,))
  keys = shard(jnp.zeros((batch, 2), jnp.uint32), (BATCH, None))
  dyn = eng.Dynamic(temperature=jnp.float32(0), top_p=jnp.float32(1),
                    eos=jnp.asarray(eng.eos_array()), max_new=jnp.int32(max_len))
  static = dict(spec=spec, max_len=max_len, out_size=max_len)
  prefill = eng._prefill_jit.lower(graphdef, params, tokens, lengths, keys, dyn, **static)
  st = jax.eval_shape(lambda p: eng._prefill_jit(graphdef, p, tokens, lengths, keys, dyn,
                                                 **static), params)
  decode = eng._decode_jit.lower(graphdef, params, st, dyn, jnp.int32(max_len), spec=spec)
  return prefill, decode, st


def _engine_spec(capture, steps, topk, draft_tokens):
  tree = None if capture is None else TreeShape(steps, topk,
                                                steps + 1 if topk == 1 else draft_tokens)
  return eng.EngineSpec(tree=tree, sampling=SamplingParams(greedy=True, top_k=0),
                        capture=capture)


def _layer_counts(target, capture) -> dict[int, tuple[int, int, int]]:
  """Per stack (by its first layer's global index): ``(layers, segments, segments of two or
  more layers)`` of one forward that captures ``capture``."""
  stacks = target.layer_stacks()
  bounds = stack_lib.stack_bounds(stacks)
  cuts = [] if capture is None else [i for i in capture.layer_ids if i >= 0]
  segs = stack_lib.segments(bounds, cuts)
  out = {}
  for s, (lo, hi) in enumerate(bounds):
    mine = [(a, b) for t, a, b in segs if t == s]
    out[lo] = (hi - lo, len(mine), sum(1 for a, b in mine if b - a >= 2))
  return out


def _cost(compiled) -> np.ndarray:
  cost = compiled.cost_analysis()
  return np.asarray([float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))])


def _peeled_costs(graphdef, params, target, capture, spec, batch, max_len, base, log):
  """``{stack offset: (layers, segments, cost of one layer as peeled)}`` (see ``round_cost``)."""
  out = {}
  for offset, (layers, nseg, npeel) in _layer_counts(target, capture).items():
    if npeel == 0:
      out[offset] = (layers, nseg, None)  # every segment is one layer: counted exactly
      continue
    t0 = time.perf_counter()
    # The trace caches do not see the peeling: clear them around the peeled program.
    jax.clear_caches()
    with stack_lib.peeled({offset}):
      _, decode, _ = _lower(graphdef, params, target, capture, spec, batch, 16, max_len)
      per_layer = (_cost(decode.compile()) - base) / npeel
    jax.clear_caches()
    if not (per_layer > 0).all():
      raise RuntimeError(f"peeling a layer of the stack at layer {offset} did not add to the "
                         f"round's cost ({per_layer}); the per-layer cost is unknown")
    log(f"  {target.num_layers}-layer model: a layer of the stack at layer {offset} "
        f"peeled, compiled in {time.perf_counter() - t0:.1f} s: {per_layer[0]:.4g} FLOPs, "
        f"{per_layer[1]:.4g} bytes per layer")
    out[offset] = (layers, nseg, per_layer)
  return out


def _shallow(hf_cfg: dict, drafter_hf: dict | None):
  """The config with about half the layers (DeepSeek: the MoE layers halved, the dense ones
  kept) and the drafter's capture ids scaled to it."""
  hf = copy.deepcopy(hf_cfg)
  text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
  total = text["num_hidden_layers"]
  dense = min(int(text.get("first_k_dense_replace") or 0), total) if hf_model_type(
      hf_cfg) in DEEPSEEK_MODEL_TYPES else 0
  rest = total - dense
  # Half the depth, but at least 6 layers where the model has more (below that XLA's fusion
  # choices make the per-layer cost of a peeled layer vary with depth).
  half = dense + (rest + 1) // 2 if rest else (total + 1) // 2
  text["num_hidden_layers"] = min(max(half, 6), total - 1)
  if drafter_hf is None:
    return hf, None
  dr = copy.deepcopy(drafter_hf)
  eagle = dict(dr.get("eagle_config") or {})
  key = "eagle_aux_hidden_state_layer_ids"
  ids = eagle.get(key, dr.get(key))
  if ids:
    scaled, n = [], text["num_hidden_layers"]
    for i in ids:
      j = min(max(round(i * n / total), -1), n - 1)
      while j in scaled:
        j += 1
      scaled.append(j)
    if scaled[-1] > n - 1:
      scaled = list(range(n - len(ids), n))
    eagle[key] = scaled
    dr["eagle_config"] = eagle
    dr.pop(key, None)
  return hf, dr


def round_cost(graphdef, params, target, capture, spec, *, batch, max_len, decode_compiled,
               hf_cfg=None, drafter_hf=None, mesh=None, dtype=jnp.bfloat16,
               quantization="keep", log=print) -> dict:
  """Per-device FLOPs and bytes accessed of one decode round at the real depth.

  ``cost_analysis`` counts a loop body once: the compiled round holds each scan segment's layer
  once. For each stack the round is compiled again with every segment's first layer peeled out
  of its scan (``eagle3jax.stack.peeled``); the difference is that stack's per-layer cost, and
  the round's cost is the scanned program's plus the layers its loops run beyond the one they
  count. A layer peeled out of its loop also counts a copy of the stacked cache it updates (a
  cost that grows with depth and that the loop, updating in place, does not pay), so the
  per-layer cost is measured again on a model of about half the depth (``hf_cfg`` given) and
  extrapolated to zero depth. Every other part of the round (the drafter, the commit over the
  stacked caches, sampling) is counted as compiled at the real size.
  """
  base = _cost(decode_compiled)
  real = _peeled_costs(graphdef, params, target, capture, spec, batch, max_len, base, log)
  shallow = None
  if hf_cfg is not None and any(p is not None for _, _, p in real.values()):
    hf2, dr2 = _shallow(hf_cfg, drafter_hf)
    g2, p2, t2, _, c2 = build(hf2, dr2, mesh, dtype=dtype, quantization=quantization)
    if 0 < t2.num_layers < target.num_layers:
      t0 = time.perf_counter()
      jax.clear_caches()
      spec2 = dataclasses.replace(spec, capture=c2)
      _, decode2, _ = _lower(g2, p2, t2, c2, spec2, batch, 16, max_len)
      base2 = _cost(decode2.compile())
      log(f"  {t2.num_layers}-layer model compiled in {time.perf_counter() - t0:.1f} s")
      log(f"  round at {target.num_layers} layers as compiled: {base[0]:.4g} FLOPs, "
          f"{base[1]:.4g} bytes; at {t2.num_layers}: {base2[0]:.4g}, {base2[1]:.4g}")
      shallow = (t2.num_layers,
                 _peeled_costs(g2, p2, t2, c2, spec2, batch, max_len, base2, log))
  total = base.copy()
  depth = target.num_layers
  for offset, (layers, nseg, per_layer) in real.items():
    if per_layer is None:
      continue
    if shallow is not None and shallow[1].get(offset, (0, 0, None))[2] is not None:
      d2, p2_ = shallow[0], shallow[1][offset][2]
      per_layer = np.maximum((depth * p2_ - d2 * per_layer) / (depth - d2), 0.0)
    total += (layers - nseg) * per_layer
  return {"flops": float(total[0]), "bytes": float(total[1])}


def _persistent_cache() -> str | None:
  """The persistent compilation cache directory compiles may read from, or None."""
  if not jax.config.jax_enable_compilation_cache:
    return None
  return jax.config.jax_compilation_cache_dir or None


@standard_numpy
def plan(hf_cfg: dict, drafter_hf: dict | None = None, *, data: int = 1, tensor: int = 8,
         hbm_gib: float | None = None, device: str = "h200", batch: int = 1,
         context: int = 32768, prompt_len: int | None = None, quantization: str = "keep",
         dtype=jnp.bfloat16, steps: int = 7, topk: int = 1, draft_tokens: int = 8,
         acceptance_lengths=(3.0, 5.0), with_cost: bool = True, log=print) -> dict:
  """Compiles the serving programs of a published config on a (fake) mesh and sizes them.

  Args:
    hf_cfg: the target's ``config.json`` dict (Kimi-K2.5's ``kimi_k25`` wrapper included).
    drafter_hf: an EAGLE-3 drafter ``config.json`` dict, or None (autoregressive decoding).
    data, tensor: mesh shape (needs ``data * tensor`` devices, fake CPU ones will do).
    hbm_gib: device memory (default: the device's).
    device: ``h200`` or ``h100`` (roofline peaks).
    batch, context: batch size and cache length to compile.
    prompt_len: prefill length compiled (prefill runs the prompt in one pass; default
      ``min(2048, context)``).
    quantization: ``keep`` (weights as the config declares them) or ``dequantize``.
    steps, topk, draft_tokens: draft tree (ignored without a drafter).
    acceptance_lengths: acceptance lengths to turn the roofline round time into tokens/s.
    with_cost: also fit the per-round cost (compiles three shallow variants).

  Returns:
    A JSON-ready dict (see the module docstring; keys ``fits``, ``per_device``, ``hbm_bytes``,
    ``max_batch``, ``max_context`` (at most the target's ``max_position_embeddings``;
    ``max_context_memory``: what memory alone would hold), ``flops_per_round``,
    ``bytes_per_round``,
    ``roofline_round_s``, ``compile_s`` (``compile_cache``: the persistent compilation cache
    directory the compiles may have read from instead of compiling, or None) and more).
  """
  if device not in DEVICES:
    raise ValueError(f"device={device!r}; choose one of {sorted(DEVICES)}")
  if quantization not in ("keep", "dequantize"):
    raise ValueError(f"quantization={quantization!r}; choose 'keep' or 'dequantize'")
  if prompt_len is None and is_integer(context):
    prompt_len = min(2048, context)
  for name, value in (("batch", batch), ("context", context), ("prompt_len", prompt_len)):
    if not is_integer(value) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive integer")
  if prompt_len > context:
    raise ValueError(f"prompt_len={prompt_len} exceeds context={context}: the prompt must fit "
                     "the cache; lower --prompt-len or raise --context")
  batch, context, prompt_len = int(batch), int(context), int(prompt_len)
  if hbm_gib is not None and not 0 < hbm_gib < float("inf"):
    raise ValueError(f"hbm_gib={hbm_gib!r} must be a positive number of GiB")
  dev = DEVICES[device]
  hbm = int((hbm_gib if hbm_gib is not None else dev.hbm_gib) * GIB)
  mesh = make_mesh(data, tensor)
  rows = batch_bucket(batch, data)  # what generate runs a batch of ``batch`` prompts as
  with jax.set_mesh(mesh), moe.as_accelerator():
    graphdef, params, target, drafter, capture = build(hf_cfg, drafter_hf, mesh, dtype=dtype,
                                                       quantization=quantization)
    limit = target.config.max_position_embeddings
    if context > limit:
      raise ValueError(f"context={context} exceeds the target's max_position_embeddings="
                       f"{limit}: it cannot serve that context; plan for at most {limit}")
    spec = _engine_spec(capture, steps, topk, draft_tokens)
    max_len = -(-(context + spec.slots_needed + spec.commit_width + 1) // 64) * 64
    t0 = time.perf_counter()
    prefill, decode, st = _lower(graphdef, params, target, capture, spec, rows, prompt_len,
                                 max_len)
    prefill_c = prefill.compile()
    decode_c = decode.compile()
    compile_s = time.perf_counter() - t0
    log(f"compiled prefill + decode loop in {compile_s:.1f} s")
    weights = _per_device_bytes(_abstract_state(target, mesh)[1])
    drafter_weights = _per_device_bytes(params) - weights  # the embedding is shared
    caches = [st.target_cache] + ([st.draft_cache] if st.draft_cache is not None else [])
    kv = sum(_per_device_bytes((c.k, c.v)) for c in caches)
    state = _per_device_bytes(st) - kv
    temp = max(prefill_c.memory_analysis().temp_size_in_bytes,
               decode_c.memory_analysis().temp_size_in_bytes)
    total = weights + drafter_weights + kv + state + temp
    local_rows = rows // data
    kv_per_token = kv / (local_rows * max_len)
    fixed = weights + drafter_weights
    per_seq = kv / local_rows + (temp + state) / local_rows
    max_rows = int(max(0, (hbm - fixed) // per_seq)) * data if per_seq else 0
    room = hbm - fixed - temp - state
    memory_context = int(max(0, room // (kv_per_token * local_rows))) if kv_per_token else 0
    max_context = min(memory_context, limit)  # memory may hold more than the model can serve
    result = {
        "config": hf_model_type(hf_cfg), "device": dev.name, "mesh": [data, tensor],
        "quantization": quantization, "batch": batch, "rows": rows, "context": context,
        "cache_slots": max_len, "prompt_len": prompt_len,
        "tree": None if spec.tree is None else [steps, topk, spec.tree.num_draft_tokens],
        "capture": None if capture is None else capture.as_list(),
        "per_device": {"weights": weights, "drafter_weights": drafter_weights, "kv_cache": kv,
                       "decode_state": state, "temp": temp, "total": total},
        "kv_bytes_per_token": kv_per_token, "hbm_bytes": hbm, "fits": total <= hbm,
        "max_batch": largest_batch(max_rows, data), "max_rows": max_rows,
        "max_context": max_context,
        "max_context_memory": memory_context, "max_position_embeddings": limit,
        "compile_s": compile_s, "compile_cache": _persistent_cache(),
    }
    if with_cost:
      t0 = time.perf_counter()
      cost = round_cost(graphdef, params, target, capture, spec, batch=rows, max_len=max_len,
                        decode_compiled=decode_c, hf_cfg=hf_cfg, drafter_hf=drafter_hf,
                        mesh=mesh, dtype=dtype, quantization=quantization, log=log)
      round_s = max(cost["flops"] / dev.flops_per_s, cost["bytes"] / dev.hbm_bytes_per_s)
      result.update({
          "flops_per_round": cost["flops"], "bytes_per_round": cost["bytes"],
          "roofline_round_s": round_s, "cost_compile_s": time.perf_counter() - t0,
          "roofline_tokens_per_s": {str(a): batch * (a if spec.tree else 1.0) / round_s
                                    for a in acceptance_lengths},
      })
  return result


def largest_batch(rows: int, data: int = 1) -> int:
  """The most prompts a batch can hold when memory holds ``rows`` rows: ``generate`` runs a
  batch as its bucket (``batch_bucket``), so 3 rows hold a batch of 2 (3 would run as 4)."""
  b = max(0, int(rows))
  while b and batch_bucket(b, data) > rows:
    b -= 1
  return b


def _max_context(result: dict) -> str:
  text = str(result["max_context"])
  memory = result.get("max_context_memory", result["max_context"])
  if memory > result["max_context"]:
    text += f" (the model's max_position_embeddings; memory would hold {memory})"
  return text


def markdown(result: dict) -> str:
  """A human-readable table of a ``plan`` result."""
  pd = result["per_device"]
  g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
  tree = result.get("tree")
  rows = [("mesh (data, tensor)", f"{tuple(result['mesh'])}"),
          ("draft tree (steps, topk, draft tokens)",
           "none: autoregressive" if tree is None else str(tuple(tree))),
          ("quantization", result["quantization"]),
          ("batch x context", f"{result['batch']} x {result['context']}" + (
              f" (runs as {result['rows']} rows: generate.batch_bucket)"
              if result.get("rows", result["batch"]) != result["batch"] else "")),
          ("weights / device", g(pd["weights"])),
          ("drafter weights / device", g(pd["drafter_weights"])),
          ("KV cache / device", g(pd["kv_cache"])),
          ("KV bytes per token / device", f"{result['kv_bytes_per_token']:.0f}"),
          ("compiled temporaries / device", g(pd["temp"])),
          ("total / device", g(pd["total"])),
          (f"fits {result['hbm_bytes'] / GIB:.0f} GiB", "yes" if result["fits"] else "no"),
          (f"max batch at {result['context']}", str(result["max_batch"]) + (
              f" ({result['max_rows']} rows would fit; a batch runs as its bucket)"
              if result.get("max_rows", result["max_batch"]) != result["max_batch"] else "")),
          (f"max context at batch {result['batch']}", _max_context(result)),
          ("compile (prefill + decode) here", f"{result['compile_s']:.1f} s" + (
              f" (persistent compilation cache {result['compile_cache']}: may be a read from "
              "it, not a compile)" if result.get("compile_cache") else ""))]
  if "roofline_round_s" in result:
    rows += [("FLOPs / round / device", f"{result['flops_per_round']:.3g}"),
             ("bytes / round / device", f"{result['bytes_per_round']:.3g}"),
             (f"roofline round on {result['device']}", f"{result['roofline_round_s'] * 1e3:.2f} ms")]
    rows += [(f"roofline tokens/s at acceptance {a}", f"{v:.0f}")
             for a, v in result["roofline_tokens_per_s"].items()]
  return "\n".join(["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
