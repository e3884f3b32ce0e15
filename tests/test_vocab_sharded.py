"""Vocabulary-parallel logits: the decode round, the drafter head and drafter training reduce
logits shard by shard (``eagle3jax.vocab_parallel``) and never gather whole rows.

The vocabulary sizes are chosen so that no other dimension equals them: the target's
V = 1064 (8 x 133) and the draft vocabulary's N = 1032 (8 x 129). A compiled program moves a
vocabulary row exactly when one of its collectives has a result with one of these dimensions.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import eagle3jax
from eagle3jax import engine as eng
from eagle3jax import sampling, training
from eagle3jax import vocab_parallel as vp
from eagle3jax.capture import CaptureSpec
from eagle3jax.deepseek_config import DeepseekConfig
from eagle3jax.training import data as data_lib, trainer as trainer_lib
from eagle3jax.tree import TreeShape
from tests import engine_helpers as h

V, N = 1064, 1032
VOCAB_DIMS = {V, N}
CFG = eagle3jax.LlamaConfig.tiny(num_hidden_layers=8, vocab_size=V, eos_token_ids=())
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                        r"reduce-scatter)(-start)?\(")


def vocab_collectives(hlo_text: str) -> list[str]:
  """Collectives of a compiled program whose result has a vocabulary-sized dimension."""
  bad = []
  for line in hlo_text.splitlines():
    m = COLLECTIVE.search(line)
    if not m or "=" not in line[:m.start()]:
      continue
    result = line[line.index("="):m.start()]
    dims = {int(d) for shape in re.findall(r"\[([\d,]+)\]", result) for d in shape.split(",")}
    if dims & VOCAB_DIMS:
      bad.append(line.strip()[:200])
  return bad


def test_the_inspection_sees_a_gathered_row():
  """The inspection can fail: a program that gathers logits rows is caught."""
  with jax.set_mesh(eagle3jax.make_mesh(1, 8)):
    x = jax.reshard(jnp.ones((2, V)), P(None, "tensor"))
    gathered = jax.jit(lambda x: jax.reshard(x, P()) * 2).lower(x).compile().as_text()
    reduced = jax.jit(lambda x: vp.top_k(x, 4)).lower(x).compile().as_text()
  assert vocab_collectives(gathered)
  assert not vocab_collectives(reduced)


def _reference_probabilities(logits, temperature, top_p, top_k):
  """The single-device definition: sort, cumulative mass, threshold."""
  logits = logits / max(temperature, 1e-6)
  if top_k > 0:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  probs = jax.nn.softmax(logits, axis=-1)
  ordered = -jnp.sort(-probs, axis=-1)
  before = jnp.cumsum(ordered, axis=-1) - ordered
  threshold = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
  probs = jnp.where((probs >= threshold) | (top_p >= 1.0), probs, 0.0)
  return probs / jnp.sum(probs, axis=-1, keepdims=True)


def test_reductions_on_sharded_rows_equal_single_device():
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(4, 3, V)) * 3).astype(np.float32)
  x[0, 0, 130:140] = 9.0          # a tie spanning two shards (133 columns each)
  x[1, 2, [5, 700, 1063]] = 8.0   # ties in three shards
  ids = np.sort(rng.choice(V, N, replace=False)).astype(np.int32)
  keys = jax.random.split(jax.random.key(3), 4)
  ref_gumbel = np.asarray(jax.vmap(lambda k: jax.random.gumbel(k, (V,)))(keys))
  with jax.set_mesh(eagle3jax.make_mesh(2, 4)):
    xs = jax.reshard(jnp.asarray(x), P("data", None, "tensor"))
    vals, idx = jax.jit(lambda x: vp.top_k(x, 12))(xs)
    ref_vals, ref_idx = jax.lax.top_k(jnp.asarray(x), 12)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: jnp.argmax(x, -1))(xs)),
                                  x.argmax(-1))
    cols = jax.jit(vp.take_columns)(xs, jnp.asarray(ids))
    assert jax.typeof(cols).sharding.spec[-1] == "tensor"
    np.testing.assert_array_equal(np.asarray(cols), x[..., ids])
    np.testing.assert_array_equal(np.asarray(jax.jit(vp.take_columns)(xs, ids[:61])),
                                  x[..., ids[:61]])
    for top_k, top_p in [(0, 1.0), (0, 0.9), (20, 0.5), (300, 0.95), (7, 0.3), (0, 0.01)]:
      got = jax.jit(lambda l, tk=top_k, tp=top_p: sampling.probabilities(
          l, jnp.float32(0.8), jnp.float32(tp), tk))(xs)
      ref = np.asarray(_reference_probabilities(jnp.asarray(x), 0.8, top_p, top_k))
      np.testing.assert_array_equal(np.asarray(got) > 0, ref > 0)   # the same kept sets
      np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-7)
    like = jax.reshard(jnp.zeros((4, V)), P("data", "tensor"))
    noise = jax.jit(vp.gumbel_rows)(keys, like)
    assert jax.typeof(noise).sharding.spec == P("data", "tensor")
    np.testing.assert_array_equal(np.asarray(noise), ref_gumbel)   # layout-independent draws


def test_top_k_over_rows_sharded_on_data_gathers_no_rows():
  """A top-k over a whole last axis (the tree's draft steps, its pool selection) with rows
  sharded over ``data`` runs shard by shard: no all-gather, single-device values and indices
  (ties included). The check can fail: ``jax.lax.top_k`` there all-gathers the rows."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(4, 3, 37)).astype(np.float32)
  x[2, 1, [3, 9, 30]] = 5.0
  ref_vals, ref_idx = jax.lax.top_k(jnp.asarray(x), 6)
  with jax.set_mesh(eagle3jax.make_mesh(2, 4)):
    xs = jax.reshard(jnp.asarray(x), P("data"))
    text = lambda f: jax.jit(f).lower(xs).compile().as_text()  # noqa: E731
    assert "all-gather" in text(lambda x: jax.lax.top_k(x, 6))
    assert "all-gather" not in text(lambda x: vp.top_k(x, 6))
    vals, idx = jax.jit(lambda x: vp.top_k(x, 6))(xs)
  assert jax.typeof(idx).sharding.spec[0] == "data"
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))


DEEPSEEK = DeepseekConfig.tiny(vocab_size=V, num_hidden_layers=3, eos_token_ids=())


@pytest.mark.parametrize("family,tree", [("llama", (4, 3, 8)), ("deepseek", (3, 1, 4))])
def test_greedy_tokens_on_tensor8_equal_tensor1(family, tree):
  def make(mesh):
    if family == "llama":
      return h.target(mesh, CFG), h.CAPTURE
    return eagle3jax.init_deepseek(DEEPSEEK, mesh=mesh, seed=0, std=0.1), CaptureSpec((-1, 0, 2))

  one, _ = make(None)
  ref = eagle3jax.generate(one, None, h.PROMPTS, max_new_tokens=24, eos_ids=[]).tokens
  tgt, capture = make(eagle3jax.make_mesh(1, 8))
  assert jax.typeof(tgt.lm_head[...]).sharding.spec == P(None, "tensor")
  steps, topk, draft = tree
  out = eagle3jax.generate(tgt, h.full_vocab_copy_drafter(tgt, capture), h.PROMPTS, max_new_tokens=24,
                           num_steps=steps, topk=topk, num_draft_tokens=draft, eos_ids=[])
  assert out.tokens == ref
  assert out.stats["accept_length_mean"] > 1.0   # drafts were accepted: acceptance ran


@pytest.fixture(scope="module")
def sharded_pair():
  """Target V on tensor=8 and a drafter with its own draft vocabulary N."""
  mesh = eagle3jax.make_mesh(1, 8)
  tgt = h.target(mesh, CFG)
  dcfg = eagle3jax.DrafterConfig.for_target(CFG, h.CAPTURE, draft_vocab_size=N)
  d2t = np.sort(np.random.default_rng(2).choice(V, N, replace=False)) - np.arange(N)
  dr = eagle3jax.init_drafter(dcfg, target=tgt, seed=1, std=0.1, d2t=d2t.astype(np.int32))
  return mesh, tgt, dr


@pytest.mark.parametrize("greedy", [True, False])
def test_compiled_round_moves_no_vocabulary_row(sharded_pair, greedy):
  """The decode loop (draft tree with the drafter's top-k, verify, greedy or rejection
  sampling with top-k and top-p, commit) compiled on tensor=8."""
  mesh, tgt, dr = sharded_pair
  spec = eng.EngineSpec(tree=TreeShape(3, 2, 5),
                        sampling=sampling.SamplingParams(greedy=greedy, top_k=0 if greedy else 5),
                        capture=h.CAPTURE)
  text = h.decode_program_text(mesh, tgt, dr, spec, batch=2, temperature=1.0, top_p=0.9)
  assert "all-gather" in text          # the small candidate exchanges are there
  assert vocab_collectives(text) == []


def test_training_features_and_step_move_no_vocabulary_row(sharded_pair):
  mesh, tgt, dr = sharded_pair
  rng = np.random.default_rng(4)
  tokens = rng.integers(0, V, (2, 24)).astype(np.int32)
  ids = np.arange(N) + np.asarray(dr.d2t[...])
  feats = training.target_features(tgt, tokens, h.CAPTURE, ids)
  ref = np.asarray(eagle3jax.forward(tgt, tokens).logits)
  np.testing.assert_array_equal(np.asarray(feats.draft_logits), ref[..., ids])
  np.testing.assert_array_equal(np.asarray(feats.argmax), ref.argmax(-1))
  # The feature program returns no [B, T, V] array and moves no vocabulary row.
  graphdef, state = nnx.split(tgt)
  with jax.set_mesh(mesh):
    lowered = data_lib._features.lower(graphdef, state, jnp.asarray(tokens), jnp.asarray(ids),
                                       h.CAPTURE)
    assert all(V not in x.shape for x in jax.tree.leaves(lowered.out_info))
    assert vocab_collectives(lowered.compile().as_text()) == []
  # The train step: TTT over the drafter's vocab-parallel head.
  cfg = trainer_lib.step_config(training.TrainConfig(ttt_steps=2, warmup_steps=1,
                                                     total_steps=2))
  gd, params, rest = nnx.split(dr, trainer_lib.TRAINABLE, ...)
  with jax.set_mesh(mesh):
    opt_state = training.make_optimizer(cfg).init(params)
    mask = jnp.ones(tokens.shape, bool)
    text = trainer_lib.optimizer_step.lower(gd, cfg, params, rest, opt_state, feats,
                                         jnp.asarray(tokens), mask).compile().as_text()
  assert vocab_collectives(text) == []
