"""The engine: greedy losslessness, batches, meshes, stopping, compile counts, bad input."""

import collections
import gc
import importlib

import jax
import numpy as np
import pytest

import eagle3jax
from eagle3jax import engine
from tests import engine_helpers as h

MAX_NEW = 20


@pytest.fixture(scope="module")
def pair():
  tgt = h.target()
  return tgt, h.copy_drafter(tgt)


@pytest.fixture(scope="module")
def baseline(pair):
  return eagle3jax.generate(pair[0], None, h.PROMPTS, max_new_tokens=MAX_NEW, eos_ids=[])


@pytest.mark.parametrize("steps,topk,tokens", [(3, 1, 4), (4, 3, 8), (5, 4, 12)])
def test_greedy_speculative_equals_autoregressive_batch3(pair, baseline, steps, topk, tokens):
  tgt, dr = pair
  out = eagle3jax.generate(tgt, dr, h.PROMPTS, max_new_tokens=MAX_NEW, num_steps=steps,
                           topk=topk, num_draft_tokens=tokens, eos_ids=[])
  assert out.tokens == baseline.tokens
  assert all(len(t) == MAX_NEW for t in out.tokens)
  # The copy drafter is right on repeats: drafts were accepted, at several depths.
  assert out.stats["accept_length_mean"] > 1.2
  assert out.stats["acceptance_per_position"][1] > 0
  assert len(out.stats["acceptance_per_position"]) == steps


def test_greedy_batch1_and_random_drafter(pair, baseline):
  tgt, dr = pair
  one = eagle3jax.generate(tgt, dr, h.PROMPTS[2:], max_new_tokens=MAX_NEW, num_steps=4,
                           topk=3, num_draft_tokens=8, eos_ids=[])
  assert one.tokens == baseline.tokens[2:]
  rnd = eagle3jax.generate(tgt, h.random_drafter(tgt), h.PROMPTS, max_new_tokens=MAX_NEW,
                           num_steps=3, topk=1, eos_ids=[])
  assert rnd.tokens == baseline.tokens


@pytest.mark.parametrize("mesh_shape,steps,topk,tokens", [((1, 8), 3, 1, 4),
                                                          ((1, 8), 4, 3, 8),
                                                          ((2, 4), 5, 4, 12)])
def test_greedy_on_a_mesh_equals_single_device(baseline, mesh_shape, steps, topk, tokens):
  mesh = eagle3jax.make_mesh(*mesh_shape)
  tgt = h.target(mesh)
  out = eagle3jax.generate(tgt, h.copy_drafter(tgt), h.PROMPTS, max_new_tokens=MAX_NEW,
                           num_steps=steps, topk=topk, num_draft_tokens=tokens, eos_ids=[])
  assert out.tokens == baseline.tokens


def test_pallas_kernel_in_engine_matches_xla(pair, baseline, monkeypatch):
  """The engine through the Pallas kernel (interpret mode) emits the XLA path's tokens, on a
  chain and on a branching tree; the kernel is counted, so a fallback to XLA fails."""
  from eagle3jax import kernels
  tgt, dr = pair
  calls = []
  real = kernels.tree_attention_sharded

  def counted(*args, **kwargs):
    calls.append(kwargs.get("interpret"))
    return real(*args, **kwargs)
  monkeypatch.setattr(kernels, "tree_attention_sharded", counted)
  jax.clear_caches()  # programs traced earlier in this process would not call it again
  for topk, tokens in ((1, 4), (3, 8)):
    calls.clear()
    out = eagle3jax.generate(tgt, dr, h.PROMPTS[:1], max_new_tokens=8, num_steps=3,
                             topk=topk, num_draft_tokens=tokens, eos_ids=[],
                             attention_impl="pallas_interpret")
    assert out.tokens == [baseline.tokens[0][:8]]
    assert calls and all(calls), (topk, calls)


def test_eos_and_finished_rows(pair, baseline):
  tgt, dr = pair
  # Stop on a token that row 1 emits at index 3 (and not before): row 1 ends there, the
  # others go on unchanged unless they emit it too.
  eos = baseline.tokens[1][3]
  expect = []
  for toks in baseline.tokens:
    expect.append(toks[:toks.index(eos) + 1] if eos in toks else toks)
  for drafter in (None, dr):
    out = eagle3jax.generate(tgt, drafter, h.PROMPTS, max_new_tokens=MAX_NEW, eos_ids=[eos],
                             num_steps=4, topk=3, num_draft_tokens=8)
    assert out.tokens == expect
  # eos_ids=None takes the config's EOS ids (2 here).
  cfg_eos = eagle3jax.generate(tgt, dr, h.PROMPTS, max_new_tokens=MAX_NEW, num_steps=3)
  for toks, full in zip(cfg_eos.tokens, baseline.tokens):
    assert toks == (full[:full.index(2) + 1] if 2 in full else full)


def test_no_recompilation_across_rounds_and_prompts_in_a_bucket(pair):
  tgt, dr = pair
  kw = dict(max_new_tokens=12, num_steps=3, topk=1, eos_ids=[])
  eagle3jax.generate(tgt, dr, [[1, 2, 3], [4, 5, 6, 7, 8]], **kw)
  before = engine.trace_count()
  # Other prompts of lengths in the same bucket (<= 16), more rounds: no new compilation.
  r = eagle3jax.generate(tgt, dr, [[9] * 11, [3, 4]], **kw)
  assert engine.trace_count() == before
  assert r.stats["compile_s"] == 0.0 and r.stats["rounds"] > 4
  streamed = []
  s = eagle3jax.generate(tgt, dr, [[9] * 11, [3, 4]], on_tokens=streamed.append, **kw)
  assert engine.trace_count() == before
  assert s.tokens == r.tokens and len(streamed) >= 2 and streamed[-1] == r.tokens


def test_lengths_in_one_output_bucket_share_the_compiled_programs(pair, baseline):
  tgt, dr = pair
  kw = dict(num_steps=3, topk=1, eos_ids=[])
  eagle3jax.generate(tgt, dr, h.PROMPTS, max_new_tokens=MAX_NEW, **kw)
  before = engine.trace_count()
  # max_new_tokens is a runtime value: every length up to 64 runs the same two programs.
  for n in (1, 7, 64 - 3):
    r = eagle3jax.generate(tgt, dr, h.PROMPTS, max_new_tokens=n, **kw)
    assert r.stats["compile_s"] == 0.0 and [len(t) for t in r.tokens] == [n] * 3
    assert [t[:min(n, MAX_NEW)] for t in r.tokens] == [t[:n] for t in baseline.tokens]
  assert engine.trace_count() == before


def test_output_buckets_grow_by_quarter_octaves():
  """Multiples of 64 up to 512, then four buckets per octave: each holds every length it
  serves, at most 63 slots or 1.25x more (the XLA attention reads the whole cache, so slack
  costs decode time), and lengths up to 2048 share 16 buckets (32 with multiples of 64
  throughout, which overflowed the 64 kept programs for a mixed request load)."""
  bucket = importlib.import_module("eagle3jax.generate").output_bucket
  assert [bucket(n) for n in (1, 64, 65, 512, 513, 640, 641, 1025, 2048, 2049)] == [
      64, 64, 128, 512, 640, 640, 768, 1280, 2048, 2560]
  sizes = [bucket(n) for n in range(1, 2049)]
  assert len(set(sizes)) == 16
  assert all(n <= b <= max(n + 63, 1.25 * n) for n, b in zip(range(1, 2049), sizes))


def test_batch_sizes_of_one_bucket_share_the_programs(pair, baseline):
  """Batches run as 1, 2, 4 or 8 rows, then a multiple of 8 (and of the mesh's data axis),
  padded with rows of length 0 that are done before the first round: 3 and 4 prompts run the
  same programs, the padding adds no tokens, rounds or acceptance, and a sampled row draws the
  same tokens whatever the batch around it."""
  bucket = importlib.import_module("eagle3jax.generate").batch_bucket
  assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 24]
  assert [bucket(1, 2), bucket(3, 2), bucket(1, 3), bucket(5, 3)] == [2, 4, 3, 9]
  tgt, dr = pair
  kw = dict(max_new_tokens=MAX_NEW, num_steps=3, topk=1, eos_ids=[])
  four = eagle3jax.generate(tgt, dr, h.PROMPTS + [[7, 7, 7]], **kw)
  before = engine.trace_count()
  three = eagle3jax.generate(tgt, dr, h.PROMPTS, **kw)
  assert engine.trace_count() == before and three.stats["compile_s"] == 0.0
  assert three.tokens == baseline.tokens == four.tokens[:3]
  assert three.stats["new_tokens"] == 3 * MAX_NEW
  ones = [eagle3jax.generate(tgt, dr, [p], **kw).stats for p in h.PROMPTS]
  assert three.stats["rounds"] == sum(s["rounds"] for s in ones)
  assert three.stats["accepted"] == sum(s["accepted"] for s in ones)
  hist = sum(np.asarray(s["acceptance_per_position"]) * s["rounds"] for s in ones)
  np.testing.assert_allclose(np.asarray(three.stats["acceptance_per_position"]) *
                             three.stats["rounds"], hist, rtol=1e-9)
  sample = dict(kw, max_new_tokens=8, temperature=1.0, seed=5, topk=2, num_draft_tokens=5)
  s3 = eagle3jax.generate(tgt, dr, h.PROMPTS, **sample)
  s4 = eagle3jax.generate(tgt, dr, h.PROMPTS + [[7, 7, 7]], **sample)
  assert s3.tokens == s4.tokens[:3]
  s5 = eagle3jax.generate(tgt, dr, h.PROMPTS + [[7, 7, 7], [8, 8]], **sample)  # 8 rows
  assert s5.tokens[:4] == s4.tokens


def test_greedy_top_k_and_the_number_of_eos_ids_compile_nothing_new(pair, baseline):
  """Greedy decoding never reads top_k, and the EOS ids are a padded runtime array: neither
  a top_k nor one, two or three EOS ids (Llama 3 has three) make new programs."""
  tgt, dr = pair
  kw = dict(max_new_tokens=MAX_NEW, num_steps=3, topk=1)
  eagle3jax.generate(tgt, dr, h.PROMPTS, eos_ids=[], **kw)
  before = engine.trace_count()
  for extra in (dict(top_k=5, eos_ids=[]), dict(eos_ids=[7]), dict(eos_ids=[7, 9, 11])):
    r = eagle3jax.generate(tgt, dr, h.PROMPTS, **extra, **kw)
    assert r.stats["compile_s"] == 0.0, extra
  assert engine.trace_count() == before
  assert eagle3jax.generate(tgt, dr, h.PROMPTS, top_k=5, eos_ids=[], **kw).tokens == (
      baseline.tokens)
  row = baseline.tokens[1]  # the padded array still stops on the second of two ids
  eos, other = row[3], next(t for t in range(100, 131) if t not in row[:4])
  r = eagle3jax.generate(tgt, dr, h.PROMPTS, eos_ids=[other, eos], **kw)
  assert r.tokens[1] == row[:row.index(eos) + 1]


def test_decoding_under_jax_enable_x64(pair, baseline):
  """With 64-bit types on, sums and argmaxes of int32 give int64: the decode loop keeps its
  carry's types, so greedy speculative decoding (chain and tree) still equals the target's own
  and sampling runs."""
  tgt, dr = pair
  # Programs are kept per 64-bit setting, so these are traced with 64-bit types on even after
  # the 32-bit ones of the same shapes.
  with jax.enable_x64(True):
    for topk, tokens in ((1, 4), (2, 6)):
      out = eagle3jax.generate(tgt, dr, h.PROMPTS, max_new_tokens=MAX_NEW, num_steps=3,
                               topk=topk, num_draft_tokens=tokens, eos_ids=[])
      assert out.tokens == baseline.tokens, (topk, tokens)
    sampled = eagle3jax.generate(tgt, dr, h.PROMPTS, max_new_tokens=8, temperature=1.0,
                                 top_p=0.9, eos_ids=[], num_steps=3, topk=2,
                                 num_draft_tokens=5, seed=3)
  # A seed draws the same tokens either way (the noise is float32, not the default float).
  assert sampled.tokens == eagle3jax.generate(
      tgt, dr, h.PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, eos_ids=[],
      num_steps=3, topk=2, num_draft_tokens=5, seed=3).tokens


def test_no_round_reports_no_acceptance(pair):
  # max_new_tokens=1: the prefill's token is the whole output, and no round runs.
  r = eagle3jax.generate(pair[0], pair[1], h.PROMPTS, max_new_tokens=1, num_steps=3,
                         eos_ids=[])
  assert r.stats["rounds"] == 0 and [len(t) for t in r.tokens] == [1, 1, 1]
  assert r.stats["accept_length_mean"] is None and r.stats["acceptance_per_position"] is None
  assert r.stats["accepted"] == 0


def test_accepted_total_counts_the_rounds_tokens(pair):
  """``accepted`` is the rounds' accepted drafts + 1 summed, so pooled acceptance over calls
  needs no mean x rounds arithmetic: every token after each row's prefill token came from a
  round, and only a row's last round may be cut short by max_new_tokens."""
  r = eagle3jax.generate(pair[0], pair[1], h.PROMPTS, max_new_tokens=MAX_NEW, num_steps=3,
                         topk=1, num_draft_tokens=4, eos_ids=[])
  st, rows = r.stats, len(h.PROMPTS)
  assert isinstance(st["accepted"], int) and st["rounds"] > 0
  assert st["accepted"] / st["rounds"] == pytest.approx(st["accept_length_mean"], rel=1e-12)
  after_prefill = st["new_tokens"] - rows
  assert after_prefill <= st["accepted"] < after_prefill + rows * 4


def test_compiled_programs_are_bounded_and_evicted_ones_freed(monkeypatch):
  """A process that compiles many shapes keeps at most MAX_COMPILED programs; an evicted one is
  freed (jax.jit's own cache let go of it too), so XLA:CPU's memory maps, ~170 a program, stay
  flat instead of reaching vm.max_map_count (LLVM then fails with 'Cannot allocate memory')."""
  generate_mod = importlib.import_module("eagle3jax.generate")
  # A cache of its own (the worker's other programs stay as they are) and a target of its own
  # (no other test compiled its programs); no bound while one shape's maps are measured.
  monkeypatch.setattr(generate_mod, "_COMPILED", collections.OrderedDict())
  monkeypatch.setattr(generate_mod, "MAX_COMPILED", 10**6)
  tgt = eagle3jax.init_target(eagle3jax.LlamaConfig.tiny(num_hidden_layers=2, vocab_size=57),
                              seed=0, std=0.1)

  def maps():
    gc.collect()
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)

  def run(batch):
    return eagle3jax.generate(tgt, None, [[1, 2, 3]] * batch, max_new_tokens=2, eos_ids=[])

  run(1)
  start = maps()
  run(2)  # what one more shape's prefill and decode programs hold
  per_shape = maps() - start
  assert per_shape > 0
  with pytest.raises(ValueError, match="max_compiled=0 must be an integer >= 1"):
    eagle3jax.set_max_compiled(0)
  eagle3jax.set_max_compiled(2)  # evicts batch 1's programs now
  assert len(generate_mod._COMPILED) == 2
  for batch in (4, 8, 16):  # three more batch buckets (generate.batch_bucket)
    assert run(batch).stats["compile_s"] > 0
  assert len(generate_mod._COMPILED) == 2
  # Only batch 16's programs are held now (batch 1's and 2's were evicted too); holding all
  # five shapes' programs would have grown the maps by about 4 * per_shape.
  assert maps() - start < 2 * per_shape, (maps() - start, per_shape)
  assert run(16).stats["compile_s"] == 0.0 and run(1).stats["compile_s"] > 0  # evicted
  eagle3jax.clear_compiled()
  assert not generate_mod._COMPILED and run(1).stats["compile_s"] > 0


def test_max_new_tokens_exact_and_stats(pair):
  tgt, dr = pair
  out = eagle3jax.generate(tgt, dr, h.PROMPTS, max_new_tokens=7, num_steps=5, topk=1,
                           eos_ids=[])
  assert [len(t) for t in out.tokens] == [7, 7, 7]
  for key in ("accept_length_mean", "acceptance_per_position", "rounds", "tokens_per_s"):
    assert key in out.stats
  assert 1.0 <= out.stats["accept_length_mean"] <= 6.0


def test_bad_input_messages(pair):
  tgt, dr = pair
  with pytest.raises(ValueError, match="non-empty list"):
    eagle3jax.generate(tgt, dr, [], max_new_tokens=4)
  with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
    eagle3jax.generate(tgt, dr, [[1], []], max_new_tokens=4)
  with pytest.raises(ValueError, match=r"prompts\[0\] has token ids outside \[0, 131\)"):
    eagle3jax.generate(tgt, dr, [[1, 500]], max_new_tokens=4)
  with pytest.raises(ValueError, match="prompt too long"):
    eagle3jax.generate(tgt, dr, [[1] * 500], max_new_tokens=20)
  with pytest.raises(ValueError, match="temperature=-1"):
    eagle3jax.generate(tgt, dr, [[1]], max_new_tokens=4, temperature=-1)
  with pytest.raises(ValueError, match="top_p=0"):
    eagle3jax.generate(tgt, dr, [[1]], max_new_tokens=4, temperature=1.0, top_p=0)
  with pytest.raises(ValueError, match="num_draft_tokens=50"):
    eagle3jax.generate(tgt, dr, [[1]], max_new_tokens=4, num_steps=2, topk=2,
                       num_draft_tokens=50)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    eagle3jax.generate(tgt, dr, [[1]], max_new_tokens=0)


def test_baseline_checks_the_tree_and_capture_it_does_not_use(pair):
  """Without a drafter, generate ignored capture='junk', num_steps=-3 and the like, which
  then failed only once a drafter was passed; and its stats lacked accept_length_recorded."""
  tgt, _ = pair
  for kw, message in ((dict(capture="junk"), "capture='junk' must be a CaptureSpec"),
                      (dict(num_steps=-3), "num_steps=-3 must be an integer >= 1"),
                      (dict(topk=0), "topk=0 must be an integer >= 1"),
                      (dict(topk=2, num_draft_tokens="x"), "num_draft_tokens='x' must be an "
                                                          "integer"),
                      (dict(num_steps=2, topk=2, num_draft_tokens=50), "num_draft_tokens=50"),
                      (dict(capture=[0, 99]), "out of range")):
    with pytest.raises(ValueError, match=message):
      eagle3jax.generate(tgt, None, [[1]], max_new_tokens=2, **kw)
  r = eagle3jax.generate(tgt, None, [[1]], max_new_tokens=2, num_steps=7, capture=[0, 1, 2])
  assert r.stats["accept_length_recorded"] is None


def test_chain_fast_path_builds_the_general_trees_chain():
  # topk == 1 takes _draft_chain (argmax, no pool or selection); the general EAGLE-2 code must
  # build the very same chain, tree arrays and drafter cache from the same state.
  import jax
  import jax.numpy as jnp
  import numpy as np
  from eagle3jax.sampling import SamplingParams
  from eagle3jax.tree import TreeShape
  tgt = h.target()
  dr = h.random_drafter(tgt, seed=3)
  spec = engine.EngineSpec(tree=TreeShape(4, 1, 5), sampling=SamplingParams(greedy=True),
                           capture=h.CAPTURE)
  tokens = jnp.asarray([h.PROMPTS[0]], jnp.int32)
  dyn = engine.Dynamic(temperature=jnp.float32(0), top_p=jnp.float32(1),
                       eos=jnp.asarray(engine.eos_array()), max_new=jnp.int32(8))
  with jax.set_mesh(tgt.mesh):
    st = engine._prefill(tgt, dr, tokens, jnp.asarray([tokens.shape[1]], jnp.int32),
                         jnp.zeros((1, 2), jnp.uint32), dyn, spec, 64, 16)
    chain = engine._draft_chain(dr, st, spec)
    general = engine._draft_tree(dr, st, spec)
  for name, a, b in zip(("tokens", "parent", "depth", "mask"), chain[:4], general[:4]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  for a, b in zip(jax.tree.leaves(chain[4]), jax.tree.leaves(general[4])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _commit_scatters(closed_jaxpr, num_layers: int) -> int:
  """Scatters in ``closed_jaxpr`` (nested jaxprs included) whose updates cover every layer of
  the stacked ``[L, B, K, S, H]`` cache at once: the commit's moves, ``[B, W, L, K, H]`` (a
  layer's own write scatters ``[B, T, K, H]``)."""
  import jax

  def walk(jaxpr):
    n = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scatter":
        upd = eqn.invars[2].aval
        n += upd.ndim == 5 and upd.shape[2] == num_layers
      for p in eqn.params.values():
        for sub in (p if isinstance(p, (list, tuple)) else [p]):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            n += walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            n += walk(sub)
    return n
  return walk(closed_jaxpr.jaxpr)


def test_chain_commit_moves_no_cache_slots():
  # A chain's accepted path is slots 0..acc, already at lengths + 0..acc where the verify wrote
  # them: its commit only sets the lengths, while a tree's moves its path's K/V (one gather
  # and scatter over all layers, for keys and for values). Outputs: the greedy tests above.
  import jax
  import jax.numpy as jnp
  import numpy as np
  from eagle3jax.sampling import SamplingParams
  from eagle3jax.sharding import BATCH, SEQ, shard
  from eagle3jax.tree import TreeShape
  tgt = h.target()
  dr = h.copy_drafter(tgt)
  tokens = jnp.asarray([h.PROMPTS[0]], jnp.int32)
  dyn = engine.Dynamic(temperature=jnp.float32(0), top_p=jnp.float32(1),
                       eos=jnp.asarray(engine.eos_array()), max_new=jnp.int32(8))
  specs = {tree.topk: engine.EngineSpec(tree=tree, sampling=SamplingParams(greedy=True),
                                        capture=h.CAPTURE)
           for tree in (TreeShape(4, 1, 5), TreeShape(4, 2, 6))}

  def prefill(spec):
    return engine._prefill(tgt, dr, shard(tokens, (BATCH, SEQ)),
                           shard(jnp.asarray([tokens.shape[1]], jnp.int32), (BATCH,)),
                           shard(jnp.zeros((1, 2), jnp.uint32), (BATCH, None)), dyn, spec, 64,
                           16)

  def round_(st, spec):
    draft = engine.phase_draft(dr, st, spec)
    logits, aux, tcache = engine.phase_verify(tgt, st, draft, spec)
    return tcache, engine.phase_accept_commit(st, draft, logits, aux, tcache, dyn, None, spec)

  counts = {}
  with jax.set_mesh(tgt.mesh):
    for topk, spec in specs.items():
      counts[topk] = _commit_scatters(
          jax.make_jaxpr(lambda s, spec=spec: round_(s, spec))(prefill(spec)), tgt.num_layers)
    # The chain's commit against the general one of the same path, in a round that accepted
    # drafts: the same K/V below the new lengths.
    spec = specs[1]
    st = prefill(spec)
    for _ in range(12):
      tcache, c = round_(st, spec)
      if int(c.acc[0]) > 0:
        break
      st = engine._spec_round(tgt, dr, st, dyn, spec)
    acc, w, m = int(c.acc[0]), spec.commit_width, int(st.target_cache.lengths[0])
    path = np.where(np.arange(w) <= acc, np.arange(w), 0)[None].astype(np.int32)
    moved = engine._commit_cache(tcache, jnp.asarray(path), c.new_m)
  assert counts == {1: 0, 2: 2}, counts
  assert acc > 0 and int(c.new_m[0]) == m + acc + 1
  n = m + acc + 1
  for got, want in ((c.target_cache.k, moved.k), (c.target_cache.v, moved.v)):
    np.testing.assert_array_equal(np.asarray(got)[:, :, :, :n], np.asarray(want)[:, :, :, :n])


def test_bfloat16_pair_decodes_a_batch():
  """A bfloat16 target and drafter decode a batch of two rows end to end (speculative and
  autoregressive): every attention of the programs takes bfloat16 slabs of the cache."""
  import jax.numpy as jnp
  tgt = eagle3jax.init_target(h.CFG, dtype=jnp.bfloat16, seed=0, std=0.1)
  cfg = eagle3jax.DrafterConfig.for_target(tgt.config, h.CAPTURE)
  dr = eagle3jax.init_drafter(cfg, target=tgt, seed=1, std=0.1)
  prompts = [[5, 7, 9, 11], [3, 4]]
  for drafter in (dr, None):
    out = eagle3jax.generate(tgt, drafter, prompts, max_new_tokens=6, eos_ids=[])
    assert [len(t) for t in out.tokens] == [6, 6]
