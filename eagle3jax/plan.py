"""Sizing a deployment on paper: the real model, compiled without its weights.

``plan`` builds a target (and drafter) from published ``config.json`` files with abstract
arrays only (``nnx.eval_shape``; every parameter a ``ShapeDtypeStruct`` with the sharding the
rules give it, nothing of model size allocated), on a mesh of devices that need not exist (fake
CPU devices), and AOT-compiles the two programs ``generate`` runs, prefill and the speculative
decode loop, for batch ``B`` and cache length ``S``. It reports per device:

* ``weights``: the bytes of every parameter shard a device holds (quantized weights as stored:
  INT4 / FP8 values plus their scales);
* ``kv_cache``: the target's (and drafter's) caches, and the bytes per token;
* ``temp``: the compiled programs' temporary buffers (``compiled.memory_analysis()``; the larger
  of prefill and decode);
* ``total`` against the device memory, whether it fits, the largest batch at context ``S`` and
  the longest context at batch ``B`` that fit (temporaries scaled linearly with the batch from
  the compiled point: an estimate);

and per speculative round: FLOPs and bytes accessed (``compiled.cost_analysis()``), with a
roofline estimate of the round's time on the named device and the tokens/s that gives at a
stated acceptance length.

``cost_analysis`` counts a loop body once, and the layers run as ``lax.scan`` loops, so the
round's cost is measured on shallow variants of the same model compiled with the layer scans
unrolled (``eagle3jax.stack.unrolled``: 2 and 3 layers; DeepSeek: 1+1, 2+1 and 1+2 dense+MoE
layers), fitted linearly in the number of layers of each kind, and extrapolated to the real
depth. Costs come from XLA:CPU's optimised program (its fusion decisions, not a GPU's), so the
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
from eagle3jax import stack as stack_lib
from eagle3jax.capture import CaptureSpec
from eagle3jax.deepseek_config import DEEPSEEK_MODEL_TYPES, hf_model_type
from eagle3jax.drafter import Eagle3Drafter, drafter_kv_repeat
from eagle3jax.sampling import SamplingParams
from eagle3jax.sharding import BATCH, SEQ, TENSOR, make_mesh, param_spec, shard
from eagle3jax.tree import TreeShape

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
  from eagle3jax.drafter_io import resolve_capture  # pylint: disable=import-outside-toplevel
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
    from eagle3jax.drafter_io import check_pair, config_from_hf  # pylint: disable=import-outside-toplevel
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
                    eos=jnp.asarray([-1], jnp.int32), max_new=jnp.int32(max_len))
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


def _shallow(hf_cfg: dict, dense: int, moe: int | None) -> dict:
  """``hf_cfg`` with ``dense`` (+ ``moe``) layers (text_config of a wrapper included)."""
  hf = copy.deepcopy(hf_cfg)
  text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
  if moe is None:
    text["num_hidden_layers"] = dense
  else:
    text["num_hidden_layers"] = dense + moe
    text["first_k_dense_replace"] = dense
  return hf


def _shallow_drafter(drafter_hf, num_layers):
  if drafter_hf is None:
    return None
  hf = copy.deepcopy(drafter_hf)
  eagle = dict(hf.get("eagle_config") or {})
  eagle["eagle_aux_hidden_state_layer_ids"] = [-1, 0, num_layers - 1]
  eagle["aux_layer_convention"] = "output"
  hf["eagle_config"] = eagle
  hf.pop("eagle_aux_hidden_state_layer_ids", None)
  return hf


def round_cost(hf_cfg, drafter_hf, mesh, *, dtype, quantization, batch, max_len, steps, topk,
               draft_tokens, log=print) -> dict:
  """Per-device FLOPs and bytes accessed of one decode round at the real depth, fitted from
  shallow unrolled variants (see the module docstring)."""
  is_deepseek = hf_model_type(hf_cfg) in DEEPSEEK_MODEL_TYPES
  if is_deepseek:
    text = hf_cfg.get("text_config", hf_cfg)
    total = text["num_hidden_layers"]
    dense_n = min(int(text.get("first_k_dense_replace") or 0), total)
    variants, real = [(1, 1), (2, 1), (1, 2)], (dense_n, total - dense_n)
  else:
    total = (hf_cfg.get("text_config") or hf_cfg)["num_hidden_layers"]
    variants, real = [(2, None), (3, None)], (total, None)
  costs = []
  for dense, moe in variants:
    layers = dense + (moe or 0)
    hf = _shallow(hf_cfg, dense, moe)
    graphdef, params, target, drafter, capture = build(
        hf, _shallow_drafter(drafter_hf, layers), mesh, dtype=dtype, quantization=quantization)
    spec = _engine_spec(capture, steps, topk, draft_tokens)
    with stack_lib.unrolled():
      _, decode, _ = _lower(graphdef, params, target, capture, spec, batch, 16, max_len)
    t0 = time.perf_counter()
    cost = decode.compile().cost_analysis()
    log(f"  cost variant {dense}+{moe or 0} layers compiled in {time.perf_counter() - t0:.1f} s")
    costs.append((float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))))
  c = np.asarray(costs)
  if is_deepseek:
    per_dense, per_moe = c[1] - c[0], c[2] - c[0]
    base = c[0] - per_dense - per_moe
    est = base + real[0] * per_dense + real[1] * per_moe
  else:
    per_layer = c[1] - c[0]
    est = c[0] - 2 * per_layer + real[0] * per_layer
  return {"flops": float(est[0]), "bytes": float(est[1])}


def plan(hf_cfg: dict, drafter_hf: dict | None = None, *, data: int = 1, tensor: int = 8,
         hbm_gib: float | None = None, device: str = "h200", batch: int = 1,
         context: int = 32768, prompt_len: int = 2048, quantization: str = "keep",
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
    prompt_len: prefill length compiled (prefill runs the prompt in one pass).
    quantization: ``keep`` (weights as the config declares them) or ``dequantize``.
    steps, topk, draft_tokens: draft tree (ignored without a drafter).
    acceptance_lengths: acceptance lengths to turn the roofline round time into tokens/s.
    with_cost: also fit the per-round cost (compiles three shallow variants).

  Returns:
    A JSON-ready dict (see the module docstring; keys ``fits``, ``per_device``, ``hbm_bytes``,
    ``max_batch``, ``max_context``, ``flops_per_round``, ``bytes_per_round``,
    ``roofline_round_s``, ``compile_s`` and more).
  """
  if device not in DEVICES:
    raise ValueError(f"device={device!r}; choose one of {sorted(DEVICES)}")
  if quantization not in ("keep", "dequantize"):
    raise ValueError(f"quantization={quantization!r}; choose 'keep' or 'dequantize'")
  dev = DEVICES[device]
  hbm = int((hbm_gib if hbm_gib is not None else dev.hbm_gib) * GIB)
  mesh = make_mesh(data, tensor)
  if batch % data:
    raise ValueError(f"batch={batch} must be a multiple of the mesh's data={data}")
  with jax.set_mesh(mesh):
    graphdef, params, target, drafter, capture = build(hf_cfg, drafter_hf, mesh, dtype=dtype,
                                                       quantization=quantization)
    spec = _engine_spec(capture, steps, topk, draft_tokens)
    max_len = -(-(context + spec.slots_needed + spec.commit_width + 1) // 64) * 64
    t0 = time.perf_counter()
    prefill, decode, st = _lower(graphdef, params, target, capture, spec, batch,
                                 min(prompt_len, context), max_len)
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
    local_batch = batch // data
    kv_per_token = kv / (local_batch * max_len)
    fixed = weights + drafter_weights
    per_seq = kv / local_batch + (temp + state) / local_batch
    max_batch = int(max(0, (hbm - fixed) // per_seq)) * data if per_seq else 0
    room = hbm - fixed - temp - state
    max_context = int(max(0, room // (kv_per_token * local_batch))) if kv_per_token else 0
    result = {
        "config": hf_model_type(hf_cfg), "device": dev.name, "mesh": [data, tensor],
        "quantization": quantization, "batch": batch, "context": context,
        "cache_slots": max_len, "prompt_len": min(prompt_len, context),
        "tree": None if spec.tree is None else [steps, topk, spec.tree.num_draft_tokens],
        "capture": None if capture is None else capture.as_list(),
        "per_device": {"weights": weights, "drafter_weights": drafter_weights, "kv_cache": kv,
                       "decode_state": state, "temp": temp, "total": total},
        "kv_bytes_per_token": kv_per_token * data, "hbm_bytes": hbm, "fits": total <= hbm,
        "max_batch": max_batch, "max_context": max_context, "compile_s": compile_s,
    }
    if with_cost:
      t0 = time.perf_counter()
      cost = round_cost(hf_cfg, drafter_hf, mesh, dtype=dtype, quantization=quantization,
                        batch=batch, max_len=max_len, steps=steps, topk=topk,
                        draft_tokens=draft_tokens, log=log)
      round_s = max(cost["flops"] / dev.flops_per_s, cost["bytes"] / dev.hbm_bytes_per_s)
      result.update({
          "flops_per_round": cost["flops"], "bytes_per_round": cost["bytes"],
          "roofline_round_s": round_s, "cost_compile_s": time.perf_counter() - t0,
          "roofline_tokens_per_s": {str(a): batch * (a if spec.tree else 1.0) / round_s
                                    for a in acceptance_lengths},
      })
  return result


def markdown(result: dict) -> str:
  """A human-readable table of a ``plan`` result."""
  pd = result["per_device"]
  g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
  rows = [("mesh (data, tensor)", f"{tuple(result['mesh'])}"),
          ("quantization", result["quantization"]),
          ("batch x context", f"{result['batch']} x {result['context']}"),
          ("weights / device", g(pd["weights"])),
          ("drafter weights / device", g(pd["drafter_weights"])),
          ("KV cache / device", g(pd["kv_cache"])),
          ("KV bytes per token (all devices)", f"{result['kv_bytes_per_token']:.0f}"),
          ("compiled temporaries / device", g(pd["temp"])),
          ("total / device", g(pd["total"])),
          (f"fits {result['hbm_bytes'] / GIB:.0f} GiB", "yes" if result["fits"] else "no"),
          (f"max batch at {result['context']}", str(result["max_batch"])),
          (f"max context at batch {result['batch']}", str(result["max_context"])),
          ("compile (prefill + decode) here", f"{result['compile_s']:.1f} s")]
  if "roofline_round_s" in result:
    rows += [("FLOPs / round / device", f"{result['flops_per_round']:.3g}"),
             ("bytes / round / device", f"{result['bytes_per_round']:.3g}"),
             (f"roofline round on {result['device']}", f"{result['roofline_round_s'] * 1e3:.2f} ms")]
    rows += [(f"roofline tokens/s at acceptance {a}", f"{v:.0f}")
             for a, v in result["roofline_tokens_per_s"].items()]
  return "\n".join(["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
