"""``generate``: host-side entry point of the engine (validation, padding buckets, stats)."""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3jax import checks
from eagle3jax import engine as eng
from eagle3jax.attention import ATTENTION_IMPLS
from eagle3jax import capture_contract as contract
from eagle3jax import model_kinds, monitor
from eagle3jax import params as params_lib
from eagle3jax.capture import CaptureSpec, as_capture_spec
from eagle3jax.decoder import DecoderLM
from eagle3jax.drafter import Eagle3Drafter
from eagle3jax.distributed import to_host, to_host_all
from eagle3jax.sampling import SamplingParams
from eagle3jax.sharding import BATCH, DATA, SEQ, shard
from eagle3jax.tree import TreeShape
from eagle3jax import semantics
from eagle3jax.semantics import standard_numpy

MIN_BUCKET = 16


@dataclasses.dataclass
class GenerateResult:
  """``tokens``: one list of new token ids per prompt; ``stats``: acceptance and speed."""
  tokens: list[list[int]]
  stats: dict


def prompt_bucket(n: int) -> int:
  """Prompts are padded to a power of two (>= 16): lengths in one bucket share a compilation."""
  return max(MIN_BUCKET, 1 << (int(n) - 1).bit_length())


def check_prompts(prompts, vocab_size: int, what: str = "prompts") -> list[list[int]]:
  """Validates token-id prompts (a list of lists, or a ``[B, T]`` integer array) on the host;
  returns them as lists of ints. ``what`` names them in the errors."""
  if isinstance(prompts, (np.ndarray, jax.Array)):
    if isinstance(prompts, jax.core.Tracer):
      raise TypeError("generate runs on the host (it checks the prompts and compiles its own "
                      "programs); call it outside jax.jit / jax.vmap")
    if prompts.ndim != 2:
      raise ValueError(f"{what} given as an array must be [B, T] integer token ids (every "
                       f"prompt the same length); got shape {tuple(prompts.shape)}: for one "
                       f"prompt pass [ids], for prompts of different lengths a list of lists")
    if prompts.shape[0] == 0 or prompts.shape[1] == 0:
      raise ValueError(f"{what} given as an array has shape {tuple(prompts.shape)}: it needs at "
                       "least one prompt of at least one token")
    prompts = list(np.asarray(prompts))
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
    raise ValueError(f"{what} must be a non-empty list of token-id lists (or a [B, T] integer "
                     f"array); got {type(prompts).__name__}")
  if all(isinstance(p, (int, np.integer)) for p in prompts):
    raise ValueError(f"{what} is a flat list of {len(prompts)} token ids; pass a list of "
                     "prompts, e.g. [ids] for one")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray, jax.Array)):
      raise ValueError(f"{what}[{i}] must be a list of token ids, got {type(p).__name__}")
    try:
      arr = np.asarray(p)
    except ValueError:
      raise ValueError(f"{what}[{i}] must be a flat list of token ids; it holds nested lists "
                       "of different lengths") from None
    if arr.size and arr.ndim != 1:
      raise ValueError(f"{what}[{i}] must be a flat list of token ids; got nested values of "
                       f"shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"{what}[{i}] must hold integer token ids; got {arr.dtype} values "
                       f"{arr.ravel()[:5].tolist()}")
    if not isinstance(p, (np.ndarray, jax.Array)) and any(
        isinstance(t, (bool, np.bool_)) for t in p):  # NumPy makes [True, 5] integers
      raise ValueError(f"{what}[{i}] holds booleans; token ids must be integers")
    p = [int(t) for t in arr]
    if not p:
      raise ValueError(f"{what}[{i}] is empty; every prompt needs at least one token")
    bad = [t for t in p if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"{what}[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
    out.append(p)
  return out


def batch_bucket(n: int, data: int = 1) -> int:
  """The rows a batch of ``n`` prompts runs as: 1, 2, 4 or 8, then a multiple of 8, rounded
  up to a multiple of ``data`` (the mesh's ``data`` axis, so the rows shard over it rather than
  being replicated). Batch sizes of one bucket share the compiled programs; the padding rows
  (``engine._prefill``: length 0) are done before the first round, but each round still
  computes them (at most 1.6x the rows asked, at 5; 1.33x at 3; at most 1.14x from 8 on)."""
  n = max(1, int(n))
  rows = 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8
  return -(-rows // data) * data


def _cache_len(need: int) -> int:
  return -(-need // 64) * 64


def output_bucket(max_new_tokens: int) -> int:
  """The new tokens a cache is sized for: a multiple of 64 up to 512, then four buckets per
  octave (640, 768, 896, 1024, 1280, ...). The engine stops each row at ``max_new_tokens``
  itself (a runtime value), so every length of a bucket runs the same programs; requests up to
  2048 new tokens share 16 output buckets rather than 32. The cost: the XLA attention path
  reads the whole cache, so a bucket above what is asked costs decode time (at most 63 slots
  up to 512, then at most 1.25x the tokens asked)."""
  n = max(1, int(max_new_tokens))
  if n <= 512:
    return _cache_len(n)
  quarter = (1 << (n - 1).bit_length()) // 8  # a quarter of the octave below
  return -(-n // quarter) * quarter


# The compiled prefill and decode programs, least recently used first. Bounded: a process that
# serves many targets, batch sizes, prompt buckets, output buckets or tree shapes would
# otherwise keep every program it ever compiled (on XLA:CPU each holds ~170 memory maps, and
# ~380 programs reach Linux's vm.max_map_count: LLVM then fails with "Cannot allocate memory").
MAX_COMPILED = 64
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_JITS: set = set()  # the jitted functions compiled through _compiled


def _compiled(name, fn, *args, **static):
  """AOT-compiles ``fn`` for these arguments once; later calls with the same shapes reuse it
  (the ``MAX_COMPILED`` most recently used programs are kept)."""
  leaves, treedef = jax.tree.flatten(args)
  key = (name, treedef, tuple(sorted(static.items(), key=lambda kv: kv[0])),
         bool(jax.config.jax_enable_x64),  # traced with 64-bit types or not
         tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves))
  hit = _COMPILED.get(key)
  if hit is not None:
    _COMPILED.move_to_end(key)
    return hit, 0.0
  t0 = time.perf_counter()
  hit = fn.lower(*args, **static).compile()
  _COMPILED[key] = hit
  _JITS.add(fn)
  _evict()
  return hit, time.perf_counter() - t0


def _evict() -> None:
  """Drops the least recently used programs beyond ``MAX_COMPILED``, and frees them."""
  if len(_COMPILED) <= MAX_COMPILED:
    return
  while len(_COMPILED) > MAX_COMPILED:
    _COMPILED.popitem(last=False)
  _drop_jit_caches()


def _drop_jit_caches() -> None:
  # ``jax.jit`` also keeps what it lowered, executables included, for the life of the process:
  # dropped so that only ``_COMPILED`` holds programs. (Clearing a jit's cache also clears
  # JAX's tracing cache of every jit, so it is done on eviction, not after every compile.)
  for f in _JITS:
    f.clear_cache()


def clear_compiled() -> None:
  """Frees every compiled prefill and decode program (the next ``generate`` compiles again),
  and the loaders' zero-fill programs."""
  _COMPILED.clear()
  _drop_jit_caches()
  params_lib.clear_programs()


def set_max_compiled(n: int) -> None:
  """Keeps at most ``n`` compiled programs (two per ``generate`` shape; default 64), evicting
  the least recently used now if more are held."""
  global MAX_COMPILED
  MAX_COMPILED = checks.integer("max_compiled", n, 1)
  _evict()


def start(target, drafter, prompts: list[list[int]], spec: eng.EngineSpec, *,
          max_new_tokens: int, eos: np.ndarray, seed: int = 0, temperature: float = 0.0,
          top_p: float = 1.0):
  """Pads ``prompts`` (token-id lists already checked against the vocabulary) to their bucket,
  sizes the cache and runs the (compiled, cached) prefill; call it inside
  ``jax.set_mesh(target.mesh)``. Returns ``(graphdef, params, state, dynamic,
  prefill seconds, compile seconds)``: what the decode loop, or ``eagle3jax.round_profile``,
  continues from."""
  b = len(prompts)
  rows = batch_bucket(b, target.mesh.shape[DATA])
  t = prompt_bucket(max(len(p) for p in prompts))
  new_bucket = output_bucket(max_new_tokens)
  max_len = _cache_len(t + new_bucket + spec.slots_needed + spec.commit_width + 1)
  out_size = new_bucket + spec.commit_width
  tokens = np.zeros((rows, t), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lengths = np.zeros((rows,), np.int32)  # 0: a padding row (engine._prefill)
  lengths[:b] = [len(p) for p in prompts]
  graphdef, params = nnx.split((target, drafter))
  # Row i's key is the i-th of ``split(key(seed), b)`` whatever the bucket; padding rows get
  # zeros (they never sample).
  real = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), b)))
  keys = np.zeros((rows,) + real.shape[1:], real.dtype)
  keys[:b] = real
  keys = shard(jnp.asarray(keys), (BATCH, None))
  dyn = eng.Dynamic(temperature=jnp.float32(temperature), top_p=jnp.float32(top_p),
                    eos=jnp.asarray(eos), max_new=jnp.int32(max_new_tokens))
  tokens_d = shard(jnp.asarray(tokens), (BATCH, SEQ))
  lengths_d = shard(jnp.asarray(lengths), (BATCH,))
  prefill, c1 = _compiled("prefill", eng._prefill_jit, graphdef, params, tokens_d, lengths_d,
                          keys, dyn, spec=spec, max_len=max_len, out_size=out_size)
  t0 = time.perf_counter()
  st = prefill(params, tokens_d, lengths_d, keys, dyn)
  jax.block_until_ready(st.out)
  return graphdef, params, st, dyn, time.perf_counter() - t0, c1


def _check_models(target, drafter) -> None:
  """The first two arguments are a target and a drafter (or None), in that order."""
  if isinstance(target, Eagle3Drafter) and isinstance(drafter, DecoderLM):
    raise ValueError("generate(target, drafter, ...) got the drafter first: pass the target "
                     "model first and the drafter second")
  model_kinds.require_target("target", target)
  if drafter is not None:
    model_kinds.require_drafter("drafter", drafter, " or None for autoregressive decoding")


@standard_numpy
def generate(target, drafter, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, num_steps: int = 5, topk: int = 1,
             num_draft_tokens: int = 6, capture: CaptureSpec | Sequence[int] | None = None,
             eos_ids: Sequence[int] | None = None, seed: int = 0,
             attention_impl: str | None = None,
             on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerateResult:
  """Generates continuations of ``prompts`` with EAGLE-3 speculative decoding.

  Args:
    target: a target from ``load_target``/``init_target``.
    drafter: a drafter from ``load_drafter``/``init_drafter``, or None for plain
      autoregressive decoding through the same target code (the baseline).
    prompts: list of token-id lists (lengths may differ), or a ``[B, T]`` integer array.
    max_new_tokens: new tokens per prompt at most.
    temperature: 0 for greedy; otherwise sampling with ``top_p`` and ``top_k``.
    num_steps, topk, num_draft_tokens: draft tree shape (``topk=1``: a chain of
      ``num_steps + 1`` tokens; then ``num_draft_tokens`` is set to ``num_steps + 1``).
      Without a drafter they, and ``capture``, are checked and unused.
    capture: None uses the drafter's recorded capture; any other must equal it.
    eos_ids: None takes the target config's EOS ids; ``[]`` disables stopping on EOS.
    seed: sampling seed, an integer in ``[-2**31, 2**32)`` (one key per row is derived from
      it). JAX keys hold 32 bits, so a negative seed is the key of ``seed + 2**32``.
    attention_impl: target attention (default: the Pallas kernel on GPU, XLA elsewhere).
    on_tokens: called after every round with the tokens emitted so far (streaming); this
      costs one host sync per round.

  Runs on the host (it checks its arguments, then runs compiled programs): call it outside
  ``jax.jit``. Wrong arguments (types, ranges, a drafter that does not fit the target, a
  capture other than the drafter's) raise ``ValueError`` naming the argument.

  Returns:
    ``GenerateResult(tokens, stats)``; stats hold ``accept_length_mean`` (mean accepted drafts
    + 1 per round), ``acceptance_per_position`` (the fraction of rounds that accepted at least
    d + 1 drafts), ``rounds``, ``accepted`` (the sum over rounds of accepted drafts + 1, so
    pooled acceptance over several calls is ``sum(accepted) / sum(rounds)``),
    ``rounds_per_row`` and ``accepted_per_row`` (the same per prompt, in order: what
    ``eagle3jax.acceptance_stats`` resamples for an interval), ``tokens_per_s``
    (excluding compilation), ``compile_s``, ``new_tokens``, ``accept_length_recorded`` (the
    drafter's recorded held-out acceptance at this tree shape; None without one, or without a
    drafter). With no round
    (``max_new_tokens=1``, or every row's first token an EOS id) ``accept_length_mean`` is
    None, and so is ``acceptance_per_position`` with a drafter (without one it is always
    ``[]``). In a multi-process run
    (``eagle3jax.distributed``) every process makes the same call and gets the same result.
  """
  _check_models(target, drafter)
  cfg = target.config
  prompts = check_prompts(prompts, cfg.vocab_size)
  max_new_tokens = checks.integer("max_new_tokens", max_new_tokens, 1)
  temperature, top_p = checks.real("temperature", temperature), checks.real("top_p", top_p)
  if not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature={temperature} must be a finite number >= 0")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")
  top_k = checks.integer("top_k", top_k, 0)
  if top_k > cfg.vocab_size:
    raise ValueError(f"top_k={top_k} must be in [0, vocab_size={cfg.vocab_size}]")
  if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
    raise ValueError("seed must be an integer, not a PRNG key: generate derives one key per "
                     "row from it")
  seed = checks.integer("seed", seed)
  if not -2**31 <= seed < 2**32:
    raise ValueError(f"seed={seed} must be in [-2**31, 2**32) (JAX keys hold 32 bits, so a "
                     "negative seed is the key of seed + 2**32, and larger seeds would repeat "
                     "these)")
  if on_tokens is not None and not callable(on_tokens):
    raise ValueError(f"on_tokens must be a function of the tokens so far, or None; got "
                     f"{type(on_tokens).__name__}")
  platform = target.mesh.devices.flat[0].platform
  impl = attention_impl or ("pallas" if platform == "gpu" else "xla")
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={impl!r}; choose one of {ATTENTION_IMPLS}")
  if impl == "pallas" and platform != "gpu":
    raise ValueError(f"attention_impl='pallas' compiles the Pallas kernel for GPUs; this "
                     f"target is on {platform}: use 'xla', or 'pallas_interpret' (the kernel "
                     "interpreted, for tests)")
  longest = max(len(p) for p in prompts)
  if max_new_tokens >= cfg.max_position_embeddings:
    raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt within the "
                     f"target's max_position_embeddings={cfg.max_position_embeddings}; lower it")
  if longest + max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(
        f"prompt too long: the longest prompt has {longest} tokens and max_new_tokens="
        f"{max_new_tokens}, which exceeds the target's max_position_embeddings="
        f"{cfg.max_position_embeddings}; shorten the prompt or lower max_new_tokens")
  # The tree and capture arguments are checked without a drafter too (then unused), so a
  # wrong value shared by a baseline call and a speculative one fails at both.
  if drafter is not None:
    contract.check_pair(target, drafter.config)
  num_steps, topk = checks.integer("num_steps", num_steps, 1), checks.integer("topk", topk, 1)
  if drafter is not None and topk > drafter.config.draft_vocab_size:
    raise ValueError(f"topk={topk} exceeds the drafter's draft_vocab_size="
                     f"{drafter.config.draft_vocab_size}")
  if topk == 1:
    num_draft_tokens = num_steps + 1
  num_draft_tokens = checks.integer("num_draft_tokens", num_draft_tokens)
  tree = TreeShape(num_steps, topk, num_draft_tokens)
  asked = as_capture_spec(capture)
  if asked is not None:  # out of range is said as such, not as "differs from the trained"
    asked.validate(cfg.num_hidden_layers)
  if drafter is None:
    tree, spec_capture = None, None
  else:
    contract.check_mesh(target, drafter.mesh)
    contract.check_served(target, drafter)
    spec_capture = contract.check_serving_capture(drafter, asked)
    if longest + max_new_tokens + num_steps > drafter.config.max_position_embeddings:
      warnings.warn(
          f"positions up to {longest + max_new_tokens + num_steps} exceed the drafter's "
          f"max_position_embeddings={drafter.config.max_position_embeddings} (its training "
          "length): its RoPE is untrained there and acceptance usually falls (output stays "
          "correct)", stacklevel=checks.outside_stacklevel())
  greedy = temperature == 0.0  # greedy decoding never reads top_k: not part of its programs
  spec = eng.EngineSpec(tree=tree, sampling=SamplingParams(greedy=greedy,
                                                           top_k=0 if greedy else int(top_k)),
                        capture=spec_capture, attention_impl=impl)
  if isinstance(eos_ids, (np.ndarray, jax.Array)):
    eos_ids = np.asarray(eos_ids).reshape(-1).tolist()
  if isinstance(eos_ids, (set, frozenset)):
    eos_ids = sorted(eos_ids)
  if eos_ids is not None and (isinstance(eos_ids, (str, bytes))
                              or not isinstance(eos_ids, Sequence)):
    raise ValueError(f"eos_ids={eos_ids!r} must be a list of token ids (or None for the "
                     "target config's, [] for none)")
  eos = (cfg.eos_token_ids if eos_ids is None else
         tuple(checks.integer(f"eos_ids[{i}]", e) for i, e in enumerate(eos_ids)))
  if any(not 0 <= e < cfg.vocab_size for e in eos):
    raise ValueError(f"eos_ids={list(eos)} must be token ids in [0, vocab_size="
                     f"{cfg.vocab_size})")
  eos_arr = eng.eos_array(eos)

  b = len(prompts)
  with jax.set_mesh(target.mesh):
    graphdef, params, st, dyn, prefill_s, c1 = start(
        target, drafter, prompts, spec, max_new_tokens=max_new_tokens, eos=eos_arr, seed=seed,
        temperature=temperature, top_p=top_p)
    budget = jnp.int32(1 if on_tokens else max_new_tokens + 1)
    decode, c2 = _compiled("decode", eng._decode_jit, graphdef, params, st, dyn, budget,
                           spec=spec)
    t0 = time.perf_counter()
    while True:
      st = decode(params, st, dyn, budget)
      if on_tokens is None:
        break
      out, out_len, done = to_host_all(st.out, st.out_len, st.done)  # one collective
      semantics.as_caller(on_tokens, [out[i, :out_len[i]].tolist() for i in range(b)])
      if done.all():
        break
    jax.block_until_ready(st.out)
    decode_s = time.perf_counter() - t0
  out = to_host(st.out)[:b]  # the rows past b pad the batch to its bucket
  out_len = to_host(st.out_len)[:b]
  result = [out[i, :out_len[i]].tolist() for i in range(b)]
  rounds = to_host(st.rounds)[:b]
  accepted = to_host(st.accepted)[:b]
  hist = to_host(st.hist)[:b].sum(axis=0)
  total_rounds = int(rounds.sum())
  # acceptance_per_position[d]: fraction of rounds that accepted at least d + 1 drafts.
  per_pos = ([float(hist[d + 1:].sum() / max(total_rounds, 1)) for d in range(len(hist) - 1)]
             if tree is not None else [])
  new_tokens = int(out_len.sum())
  if not total_rounds:  # every row ended at the prefill's token: no round, no acceptance
    per_pos = None if tree is not None else []
  stats = {
      "accept_length_mean": float(accepted.sum() / total_rounds) if total_rounds else None,
      "acceptance_per_position": per_pos,
      "rounds": total_rounds,
      "accepted": int(accepted.sum()),
      "rounds_per_row": [int(x) for x in rounds],
      "accepted_per_row": [int(x) for x in accepted],
      "new_tokens": new_tokens,
      "prefill_s": prefill_s,
      "decode_s": decode_s,
      "tokens_per_s": new_tokens / max(prefill_s + decode_s, 1e-9),
      "compile_s": c1 + c2,
  }
  if drafter is not None:
    monitor.compare(stats, drafter, tree.num_steps, tree.topk, tree.num_draft_tokens,
                    greedy=temperature == 0.0)
  else:
    stats["accept_length_recorded"] = None  # no drafter, no record: the key is always there
  return GenerateResult(result, stats)
