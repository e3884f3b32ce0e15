"""The jitted speculative decoding engine: prefill, then rounds of draft, verify, accept, commit.

Axis letters as in the README; ``P`` tree nodes, ``W = num_steps + 1`` the most tokens one round
can commit, ``M`` the candidate pool. Each round, per row (shapes are static; per-row lengths
and stop state live in the ``DecodeState`` pytree):

1. Draft: the drafter's last pre-norm output gives the root's children; ``num_steps - 1``
   more drafter passes expand the frontier (``eagle3jax.tree``), writing tree K/V beyond the
   drafter's committed length.
2. Verify: one target extend over the P tree tokens with the ancestor mask, capturing aux
   hidden states.
3. Accept: greedy or lossless rejection sampling (``eagle3jax.acceptance``).
4. Commit: the accepted path's K/V are copied to contiguous target cache slots; the drafter
   runs once over the newly committed positions (target features of the path, next tokens),
   which replaces the tree K/V with real context and yields the next root output.

``drafter=None`` runs plain autoregressive decoding through the same target code.

Target and drafter logits stay sharded over the vocabulary (``tensor`` axis) through every step:
argmax, the tree's top-k, sampling and rejection sampling reduce them shard by shard
(``eagle3jax.vocab_parallel``); no step gathers a vocabulary row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from eagle3jax import acceptance, tree as tree_lib, vocab_parallel as vp
from eagle3jax.capture import CaptureSpec
from eagle3jax.kv_cache import KVCache, update_rows
from eagle3jax.sampling import SamplingParams, probabilities, sample
from eagle3jax.sharding import (BATCH, EMBED, batch_major as bm, gather_rows,
                                pick_rows, shard)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """Static settings of one compiled engine (part of the compilation key).

  Attributes:
    tree: draft tree shape, or None for autoregressive decoding.
    sampling: greedy or sampling (with static top-k).
    capture: target hidden states fed to the drafter.
    attention_impl: ``"xla"``, ``"pallas"`` or ``"pallas_interpret"`` for target attention.
  """
  tree: tree_lib.TreeShape | None
  sampling: SamplingParams
  capture: CaptureSpec | None
  attention_impl: str = "xla"

  @property
  def commit_width(self) -> int:
    return 1 if self.tree is None else self.tree.num_steps + 1

  @property
  def slots_needed(self) -> int:
    """Cache slots past the committed length that one round may write."""
    if self.tree is None:
      return 1
    return max(self.tree.num_draft_tokens, self.commit_width, self.tree.tree_window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
  """Everything that changes from round to round (a pytree; batch-major)."""
  target_cache: KVCache
  draft_cache: KVCache | None
  bonus: jax.Array          # [B] last emitted token, not yet in the target cache
  d_hidden: jax.Array | None  # [B, D] drafter pre-norm output at the last committed position
  out: jax.Array            # [B, O] emitted tokens
  out_len: jax.Array        # [B]
  done: jax.Array           # [B] bool
  keys: jax.Array           # [B, 2] uint32 per-row PRNG keys
  rounds: jax.Array         # [B] rounds while active
  accepted: jax.Array       # [B] sum over rounds of (accepted drafts + 1)
  hist: jax.Array           # [B, W] rounds by number of accepted drafts


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dynamic:
  """Per-call values that do not recompile."""
  temperature: jax.Array    # [] float32
  top_p: jax.Array          # [] float32
  eos: jax.Array            # [E] int32 (-1 padded; see eos_array)
  max_new: jax.Array        # [] int32


def eos_array(ids=()) -> np.ndarray:
  """``Dynamic.eos`` for these EOS ids: ``-1``-padded to at least 8 entries, then a power of
  two, so that the number of ids (Llama 3 has up to 3) does not change the compiled programs."""
  ids = tuple(int(i) for i in ids)
  out = np.full((max(8, 1 << (max(1, len(ids)) - 1).bit_length()),), -1, np.int32)
  out[:len(ids)] = ids
  return out


def _pick(spec: EngineSpec, logits, dyn: Dynamic, keys):
  """Next token per row from ``logits [B, V]`` (greedy or sampled with one key per row)."""
  if spec.sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  probs = probabilities(logits, dyn.temperature, dyn.top_p, spec.sampling.top_k)
  return sample(jax.vmap(jax.random.wrap_key_data)(keys), probs)


def _split_keys(keys):
  """Per-row key data ``[B, 2]`` -> (next keys, keys for this round)."""
  def one(k):
    a, b = jax.random.split(jax.random.wrap_key_data(k))
    return jax.random.key_data(a), jax.random.key_data(b)
  return jax.vmap(one)(keys)


def _write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes ``new [B, T]`` into ``buf [B, S]`` at columns ``start[b] ..`` of each row."""
  def one(b, n, s):
    return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), (s,))
  return jax.vmap(one)(buf, new, bm(start.astype(jnp.int32)))


def _emit(st: DecodeState, new: jax.Array, count: jax.Array, dyn: Dynamic):
  """Appends ``new[:, :count]`` to the output, applying EOS and ``max_new``; returns
  (out, out_len, finished)."""
  w = new.shape[1]
  new, count = bm(new), bm(count)
  out = _write_rows(st.out, new, st.out_len)
  d = jnp.arange(w)[None, :]
  is_eos = jnp.any(new[:, :, None] == dyn.eos[None, None, :], axis=-1) & (d < count[:, None])
  has_eos = jnp.any(is_eos, axis=-1)
  count = jnp.where(has_eos, jnp.argmax(is_eos, axis=-1) + 1, count)
  out_len = jnp.minimum(st.out_len + count, dyn.max_new)
  return out, out_len, has_eos | (out_len >= dyn.max_new)


def _commit_cache(cache: KVCache, path: jax.Array, new_lengths: jax.Array) -> KVCache:
  """Copies slots ``lengths + path[:, d]`` to ``lengths + d`` in every layer: one gather and
  one in-place scatter (unique indices) over ``[L, B, K, S, H]``, shard by shard when rows are
  sharded (``kv_cache.update_rows``); a per-layer loop of ``dynamic_update_slice`` made XLA:CPU
  copy the whole cache every round."""
  w = path.shape[1]
  src = bm(cache.lengths[:, None] + path)                                 # [B, W]
  dst = bm(cache.lengths[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :])

  def move(buf, src, dst, **kw):                                          # [L, B, K, S, H]
    b = src.shape[0]
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, w))
    get_kw = {}
    if kw:  # Explicit axes, rows not sharded: name the gathered layout
      spec = tuple(kw["out_sharding"].spec) + (None,) * buf.ndim
      get_kw = dict(out_sharding=P(spec[1], None, spec[0], spec[2], spec[4]))
    # Advanced indices around the K slice: the gathered view is [B, W, L, K, H].
    moved = buf.at[:, rows, :, src].get(mode="promise_in_bounds", **get_kw)
    return buf.at[:, rows, :, dst].set(moved, mode="drop", unique_indices=True, **kw)
  return KVCache(update_rows(move, cache.k, (src, dst)), update_rows(move, cache.v, (src, dst)),
                 new_lengths)


def _log_softmax(x):
  return jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)


def _draft_chain(drafter, st: DecodeState, spec: EngineSpec):
  """``topk == 1``: the tree is a chain of the drafter's argmax tokens, so the scores, the
  candidate pool and the selection of ``_draft_tree`` are skipped (same tokens, same tree)."""
  steps, window = spec.tree.num_steps, spec.tree.tree_window
  m = st.target_cache.lengths
  b = m.shape[0]

  def argmax_token(a):                                                     # [B, 1, D] -> [B, 1]
    return bm(drafter.to_target_ids(jnp.argmax(drafter.logits(a), axis=-1)).astype(jnp.int32))

  hidden = st.d_hidden[:, None]
  drafts = [argmax_token(hidden)]
  dcache = st.draft_cache
  for j in range(1, steps):
    # Step j's token sees the j tree slots written so far (the chain above it).
    anc = bm(jnp.broadcast_to(jnp.asarray(np.arange(window) < j), (b, 1, window)))
    hidden, dcache = drafter(drafts[-1], hidden, bm((m - 1 + j)[:, None]), dcache, anc,
                             write_at=m + j - 1)
    drafts.append(argmax_token(hidden))
  tokens = jnp.concatenate([bm(st.bonus[:, None])] + drafts, axis=1)      # [B, steps + 1]
  return (tokens,) + tree_lib.chain(b, steps) + (dcache,)


def _draft(drafter, st: DecodeState, spec: EngineSpec):
  """Builds the draft tree. Returns tree tokens, parent, depth, mask and the drafter cache."""
  if spec.tree.topk == 1:
    return _draft_chain(drafter, st, spec)
  return _draft_tree(drafter, st, spec)


def _draft_tree(drafter, st: DecodeState, spec: EngineSpec):
  """EAGLE-2 dynamic tree expansion and selection (any ``topk``)."""
  tree = spec.tree
  k, m = tree.topk, st.target_cache.lengths
  b = m.shape[0]
  vals, ids = vp.top_k(_log_softmax(drafter.logits(st.d_hidden[:, None])[:, 0]), k)
  toks = drafter.to_target_ids(ids)
  pool_tok, pool_score = [toks], [vals]
  pool_parent = [bm(jnp.full((b, k), -1, jnp.int32))]
  f_idx = bm(jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)))
  f_hidden = bm(jnp.broadcast_to(st.d_hidden[:, None], (b, k, st.d_hidden.shape[-1])))
  f_score, f_tok = bm(vals), bm(toks)
  window = tree.tree_window
  anc = bm(jnp.zeros((b, k, window), bool))
  dcache = st.draft_cache
  for j in range(1, tree.num_steps):
    slot0 = (j - 1) * k
    anc = anc | jax.nn.one_hot(slot0 + jnp.arange(k), window, dtype=bool)[None]
    positions = bm(jnp.broadcast_to((m - 1 + j)[:, None], (b, k)))
    a, dcache = drafter(f_tok, f_hidden, positions, dcache, anc, write_at=m + slot0)
    v2, i2 = vp.top_k(_log_softmax(drafter.logits(a)), k)                  # [B, k, k]
    cum = (f_score[:, :, None] + v2).reshape(b, k * k)
    c_tok = bm(drafter.to_target_ids(i2).reshape(b, k * k))
    cum = bm(cum)
    pool_tok.append(c_tok)
    pool_score.append(cum)
    pool_parent.append(jnp.repeat(f_idx, k, axis=1))
    f_score, sel = vp.top_k(cum, k)
    parent_f = sel // k
    f_idx = k + (j - 1) * k * k + sel
    f_hidden = gather_rows(a, parent_f)
    f_tok = gather_rows(c_tok, sel)
    anc = gather_rows(anc, parent_f)
  tokens, parent, depth, mask = tree_lib.select(
      jnp.concatenate(pool_score, 1), jnp.concatenate(pool_parent, 1),
      jnp.concatenate(pool_tok, 1), st.bonus, tree)
  return tokens, parent, depth, mask, dcache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draft:
  """A round's draft tree (step 1): ``tokens/parent/depth [B, P]``, ``mask [B, P, P]`` and the
  drafter cache holding the tree K/V beyond its committed length."""
  tokens: jax.Array
  parent: jax.Array
  depth: jax.Array
  mask: jax.Array
  draft_cache: KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Commit:
  """Steps 3-4 of a round: ``acc [B]`` accepted drafts, ``bonus [B]``, ``new_m [B]`` committed
  lengths, ``new_tokens [B, W]`` the next tokens at the committed positions, ``feats
  [B, W, k*Dt]`` their target features, and the target cache with the path committed."""
  acc: jax.Array
  bonus: jax.Array
  new_m: jax.Array
  new_tokens: jax.Array
  feats: jax.Array
  target_cache: KVCache


def phase_draft(drafter, st: DecodeState, spec: EngineSpec) -> Draft:
  """Step 1: the draft tree."""
  with jax.named_scope("draft"):
    return Draft(*_draft(drafter, st, spec))


def phase_verify(target, st: DecodeState, draft: Draft, spec: EngineSpec):
  """Step 2: one target extend over the tree; returns ``(logits, aux, target cache)``."""
  with jax.named_scope("verify"):
    return target(draft.tokens, st.target_cache.lengths[:, None] + draft.depth,
                  st.target_cache, draft.mask, spec.capture, attention_impl=spec.attention_impl)


def phase_accept_commit(st: DecodeState, draft: Draft, logits, aux, tcache: KVCache,
                        dyn: Dynamic, round_keys, spec: EngineSpec) -> Commit:
  """Steps 3-4: accept the draft, commit the path's K/V, gather the path's features."""
  w = spec.commit_width
  m = st.target_cache.lengths
  tokens, parent, depth, mask = draft.tokens, draft.parent, draft.depth, draft.mask
  with jax.named_scope("accept"):
    if spec.sampling.greedy:
      best, acc, bonus = acceptance.greedy(logits, tokens, parent, depth, mask)
    else:
      probs = probabilities(logits, dyn.temperature, dyn.top_p, spec.sampling.top_k)
      best, acc, bonus = acceptance.rejection_sample(
          probs, tokens, parent, depth, jax.vmap(jax.random.wrap_key_data)(round_keys),
          spec.tree.num_steps)
  with jax.named_scope("commit"):
    mask_row = pick_rows(mask, best)
    path = tree_lib.path_of(mask_row, depth, w)                              # [B, W]
    new_m = jnp.where(~st.done, m + acc + 1, m)
    if spec.tree.topk == 1:
      # A chain's slot d holds depth d, written at lengths + d by the verify: the accepted
      # path 0..acc is already where the commit would move it, so only the lengths change
      # (slots past them are stale either way and are overwritten next round).
      tcache = KVCache(tcache.k, tcache.v, new_m)
    else:
      tcache = _commit_cache(tcache, path, new_m)
    d = jnp.arange(w, dtype=jnp.int32)[None, :]
    after = gather_rows(tokens, jnp.concatenate([path[:, 1:], path[:, :1]], 1))
    new_tokens = jnp.where(d < acc[:, None], after, bonus[:, None])         # [B, W]
    feats = gather_rows(aux, path)                                           # [B, W, k*Dt]
  return Commit(acc, bonus, new_m, new_tokens, feats, tcache)


def phase_catch_up(drafter, st: DecodeState, dcache: KVCache, c: Commit, spec: EngineSpec):
  """Step 5: the drafter over the committed positions (real context replaces the tree K/V);
  returns ``(d_hidden [B, D], drafter cache)``."""
  w = spec.commit_width
  m = st.target_cache.lengths
  b = m.shape[0]
  with jax.named_scope("catch_up"):
    d = jnp.arange(w, dtype=jnp.int32)[None, :]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((w, w), bool)), (b, w, w))
    a, dcache = drafter(c.new_tokens, drafter.project(c.feats), m[:, None] + d,
                        dcache.with_lengths(m), causal)
    return pick_rows(a, c.acc), dcache.with_lengths(c.new_m)


def _spec_round(target, drafter, st: DecodeState, dyn: Dynamic, spec: EngineSpec):
  b = st.target_cache.lengths.shape[0]
  w = spec.commit_width
  active = ~st.done
  # Greedy rounds draw nothing: the keys stay as they are.
  keys, round_keys = (st.keys, None) if spec.sampling.greedy else _split_keys(st.keys)
  draft = phase_draft(drafter, st, spec)
  logits, aux, tcache = phase_verify(target, st, draft, spec)
  c = phase_accept_commit(st, draft, logits, aux, tcache, dyn, round_keys, spec)
  d_hidden, dcache = phase_catch_up(drafter, st, draft.draft_cache, c, spec)

  # --- Step 6: emit, stop ---
  out, out_len, finished = _emit(st, c.new_tokens, c.acc + 1, dyn)
  full = c.new_m + spec.slots_needed > c.target_cache.max_len
  keep = lambda new, old: jnp.where(  # noqa: E731
      active.reshape((b,) + (1,) * (new.ndim - 1)), new, old)
  return DecodeState(
      target_cache=c.target_cache, draft_cache=dcache, bonus=keep(c.bonus, st.bonus),
      d_hidden=keep(d_hidden.astype(st.d_hidden.dtype), st.d_hidden), out=keep(out, st.out),
      out_len=keep(out_len, st.out_len), done=st.done | finished | full, keys=keys,
      rounds=st.rounds + active, accepted=st.accepted + jnp.where(active, c.acc + 1, 0),
      hist=st.hist + (jax.nn.one_hot(c.acc, w, dtype=jnp.int32) * active[:, None]))


def _ar_round(target, st: DecodeState, dyn: Dynamic, spec: EngineSpec):
  m = st.target_cache.lengths
  b = m.shape[0]
  active = ~st.done
  keys, round_keys = _split_keys(st.keys)
  logits, _, tcache = target(st.bonus[:, None], m[:, None], st.target_cache,
                             jnp.ones((b, 1, 1), bool), attention_impl=spec.attention_impl)
  nxt = _pick(spec, logits[:, 0], dyn, round_keys)
  new_m = jnp.where(active, m + 1, m)
  out, out_len, finished = _emit(st, nxt[:, None], bm(jnp.ones((b,), jnp.int32)), dyn)
  full = new_m + spec.slots_needed > tcache.max_len
  return dataclasses.replace(
      st, target_cache=tcache.with_lengths(new_m), bonus=jnp.where(active, nxt, st.bonus),
      out=jnp.where(active[:, None], out, st.out), out_len=jnp.where(active, out_len, st.out_len),
      done=st.done | finished | full, keys=keys, rounds=st.rounds + active,
      accepted=st.accepted + active, hist=st.hist + active[:, None])


def _prefill(target, drafter, tokens, lengths, keys, dyn: Dynamic, spec: EngineSpec,
             max_len: int, out_size: int) -> DecodeState:
  """The state after the prompts ``tokens [B, T]`` (row b's first ``lengths[b]`` tokens) and
  their first new token. A row of ``lengths`` 0 only pads the batch to its bucket
  (``generate.batch_bucket``): it is done from the start, so it emits nothing after that first
  token, counts no round and never keeps the loop running."""
  b, t = tokens.shape
  live = lengths > 0  # a row of length 0 pads the batch to its bucket: done before it starts
  last = jnp.maximum(lengths, 1) - 1
  tcache = target.allocate_cache(b, max_len)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  logits, aux, tcache = target(tokens, None, tcache, causal, spec.capture,
                               logits_index=last[:, None],
                               attention_impl=spec.attention_impl)
  keys, first_keys = _split_keys(keys)
  first = _pick(spec, logits[:, 0], dyn, first_keys)
  tcache = tcache.with_lengths(lengths)
  dcache, d_hidden = None, None
  if drafter is not None:
    dcache = drafter.allocate_cache(b, max_len)
    s = jnp.arange(t)[None, :]
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    d_tok = jnp.where(s == (lengths - 1)[:, None], first[:, None], shifted)
    a, dcache = drafter(d_tok, drafter.project(aux), jnp.broadcast_to(s, (b, t)), dcache,
                        causal)
    d_hidden = pick_rows(a, last)
    d_hidden = shard(d_hidden, (BATCH, EMBED))
    dcache = dcache.with_lengths(lengths)
  w = spec.commit_width
  zeros = lambda *shape, dtype=jnp.int32: shard(  # noqa: E731
      jnp.zeros(shape, dtype), (BATCH,) + (None,) * (len(shape) - 1))
  st = DecodeState(
      target_cache=tcache, draft_cache=dcache, bonus=shard(first, (BATCH,)), d_hidden=d_hidden,
      out=zeros(b, out_size), out_len=zeros(b), done=zeros(b, dtype=bool),
      keys=shard(keys, (BATCH, None)), rounds=zeros(b), accepted=zeros(b), hist=zeros(b, w))
  out, out_len, finished = _emit(st, first[:, None], zeros(b) + 1, dyn)
  return dataclasses.replace(st, out=out, out_len=out_len, done=finished | ~live)


# --- jitted entry points (models are split outside jit and merged inside) ---

TRACES = {"prefill": 0, "decode": 0}


def _prefill_fn(graphdef, params, tokens, lengths, keys, dyn, spec, max_len, out_size):
  TRACES["prefill"] += 1
  target, drafter = nnx.merge(graphdef, params)
  return _prefill(target, drafter, tokens, lengths, keys, dyn, spec, max_len, out_size)


def _decode_fn(graphdef, params, st, dyn, max_rounds, spec):
  """Runs rounds until every row is done or ``max_rounds`` rounds have run."""
  TRACES["decode"] += 1
  target, drafter = nnx.merge(graphdef, params)

  def cond(carry):
    st, i = carry
    return jnp.any(~st.done) & (i < max_rounds)  # some row still decoding; round budget left

  def body(carry):
    st, i = carry
    new = (_ar_round(target, st, dyn, spec) if spec.tree is None
           else _spec_round(target, drafter, st, dyn, spec))
    # The carry keeps its integer types: under jax_enable_x64 sums and argmaxes of int32 give
    # int64, which while_loop refuses (every such value here fits int32). Floats are not cast:
    # a float of another dtype would be a bug, and while_loop names it.
    keep = lambda x, old: (x.astype(old.dtype)  # noqa: E731
                           if jnp.issubdtype(old.dtype, jnp.integer) else x)
    return jax.tree.map(keep, new, st), i + 1

  st, _ = jax.lax.while_loop(cond, body, (st, jnp.int32(0)))
  return st


_prefill_jit = jax.jit(_prefill_fn, static_argnames=("graphdef", "spec", "max_len", "out_size"))
_decode_jit = jax.jit(_decode_fn, static_argnames=("graphdef", "spec"), donate_argnums=(2,))


def trace_count() -> int:
  """How many times the engine's jitted functions have been traced (compiled) so far."""
  return TRACES["prefill"] + TRACES["decode"]
