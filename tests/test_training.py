"""Drafter training: TTT mask, draft vocab, features = engine captures, falling loss, resume
after a kill, export -> load -> lossless decode, the script's flags and errors."""

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import eagle3jax
from eagle3jax import training
from eagle3jax.layers import rms_norm
from eagle3jax.rope import RopeConfig
from eagle3jax.training import ttt
from tests import engine_helpers
from tests.script_loader import load_script

CAPTURE = eagle3jax.CaptureSpec((1, 3, 6))
SEQ_LEN = 32
DRAFT_VOCAB = 64
# One set of step hyperparameters for every training test: they share one compilation.
CFG = training.TrainConfig(learning_rate=3e-3, warmup_steps=2, total_steps=30, batch_size=4,
                           seq_len=SEQ_LEN, ttt_steps=7, checkpoint_every=1000,
                           draft_vocab_size=DRAFT_VOCAB, max_new_tokens=24, seed=0)


def test_ttt_attention_mask_hand_worked():
  # T=3, step j=2. Columns: step-0 keys s=0..2 | step-1 keys | step-2 keys.
  # Query t sees step-0 keys s <= t (causal) and only key t of steps 1 and 2 (diagonal).
  expected = np.array([
      # s0 s1 s2 | d0 d1 d2 | e0 e1 e2
      [1, 0, 0, 1, 0, 0, 1, 0, 0],  # t = 0
      [1, 1, 0, 0, 1, 0, 0, 1, 0],  # t = 1
      [1, 1, 1, 0, 0, 1, 0, 0, 1],  # t = 2
  ], bool)
  np.testing.assert_array_equal(ttt.ttt_attention_mask(3, 2), expected)
  np.testing.assert_array_equal(ttt.ttt_attention_mask(3, 0), np.tril(np.ones((3, 3), bool)))


@pytest.fixture(scope="module")
def mesh():
  return eagle3jax.make_mesh(2, 1)  # batch split over data: the data-parallel path


@pytest.fixture(scope="module")
def target(mesh):
  # engine_helpers' tiny target with larger weights: std 0.1 gives near-uniform next-token
  # distributions (entropy 4.57 of ln(131) = 4.88 nats), which no drafter can fit much
  # better than a random one; std 0.5 gives LLM-like peaked ones (entropy ~1.6).
  return eagle3jax.init_target(engine_helpers.CFG, mesh=mesh, seed=0, std=0.5)


@pytest.fixture(scope="module")
def data(target):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 131, int(rng.integers(3, 8))).tolist() for _ in range(4)]
  return prompts, training.build_training_data(target, prompts, seq_len=SEQ_LEN,
                                               max_new_tokens=24)


def _drafter(target, data, seed=0):
  vocab = training.build_draft_vocab(data.responses(), target.config.vocab_size, DRAFT_VOCAB)
  dcfg = eagle3jax.DrafterConfig.for_target(target.config, CAPTURE,
                                            draft_vocab_size=DRAFT_VOCAB)
  return eagle3jax.init_drafter(dcfg, target=target, seed=seed, d2t=vocab.d2t)


def test_data_masks_only_responses(data):
  prompts, d = data
  for i, p in enumerate(prompts):
    np.testing.assert_array_equal(d.tokens[i, :len(p)], p)
    assert not d.loss_mask[i, :len(p)].any()
    assert d.loss_mask[i, len(p):d.lengths[i]].all()
    assert not d.loss_mask[i, d.lengths[i]:].any()


def test_draft_vocab_round_trip():
  seqs = [[5, 5, 5, 9, 9, 2, 7, 7, 7, 7], [9, 1, 3]]
  v = training.build_draft_vocab(seqs, vocab_size=12, draft_vocab_size=4)
  # counts: 7:4, 5:3, 9:3, then 1, 2, 3 with 1 each (ties -> smaller id: 1).
  np.testing.assert_array_equal(v.target_ids, [1, 5, 7, 9])
  np.testing.assert_array_equal(v.d2t, [1, 4, 5, 6])
  np.testing.assert_array_equal(np.flatnonzero(v.t2d), [1, 5, 7, 9])
  assert v.coverage == pytest.approx(11 / 13)
  target_ids = np.array([[9, 1], [7, 5]])
  draft = v.to_draft(target_ids)
  np.testing.assert_array_equal(draft, [[3, 0], [2, 1]])
  np.testing.assert_array_equal(v.to_target(draft), target_ids)
  np.testing.assert_array_equal(v.to_draft([2, 11]), [-1, -1])
  np.testing.assert_array_equal(v.to_target(np.arange(4)), v.target_ids)


def test_drafter_vocab_matches_init_drafter(target, data):
  _, d = data
  dr = _drafter(target, d)
  vocab = training.build_draft_vocab(d.responses(), 131, DRAFT_VOCAB)
  np.testing.assert_array_equal(np.asarray(dr.t2d[...]), vocab.t2d)
  with jax.set_mesh(target.mesh):
    ids = dr.to_target_ids(jnp.arange(DRAFT_VOCAB)[None])
  np.testing.assert_array_equal(np.asarray(ids)[0], vocab.target_ids)


@pytest.mark.parametrize("tied,tensor", [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_head_init_target_starts_from_the_targets_output_rows(target, data, tied, tensor,
                                                              monkeypatch):
  # tensor=2: the output embedding is vocabulary-sharded (an even vocabulary) and its rows are
  # taken on the devices.
  _, d = data
  if tied or tensor > 1:
    mesh = target.mesh if tensor == 1 else eagle3jax.make_mesh(1, tensor)
    cfg = dataclasses.replace(engine_helpers.CFG, tie_word_embeddings=tied,
                              vocab_size=engine_helpers.CFG.vocab_size + (tensor > 1))
    target = eagle3jax.init_target(cfg, mesh=mesh, seed=0, std=0.5)
    table = target.embed_tokens[...] if tied else target.lm_head[...]
    assert "tensor" in jax.typeof(table).sharding.spec or tensor == 1
  vocab = training.build_draft_vocab(d.responses(), target.config.vocab_size, DRAFT_VOCAB)
  dcfg = eagle3jax.DrafterConfig.for_target(target.config, CAPTURE,
                                            draft_vocab_size=DRAFT_VOCAB)
  from eagle3jax import drafter_io
  copied = []  # what reaches the host: the [D, N] head and the norm, never the [V, D] table
  host = drafter_io._host
  monkeypatch.setattr(drafter_io, "_host", lambda x: copied.append(x.shape) or host(x))
  dr = eagle3jax.init_drafter(dcfg, target=target, seed=0, d2t=vocab.d2t, head_init="target")
  monkeypatch.undo()
  assert sorted(copied) == [(target.config.hidden_size,),
                            (target.config.hidden_size, DRAFT_VOCAB)], copied
  out = (np.asarray(target.embed_tokens[...]).T if tied else np.asarray(target.lm_head[...]))
  np.testing.assert_array_equal(np.asarray(dr.lm_head[...]), out[:, vocab.target_ids])
  np.testing.assert_array_equal(np.asarray(dr.norm.weight[...]),
                                np.asarray(target.norm.weight[...]))
  # The rest is the seeded random initialisation, as with head_init="random".
  plain = eagle3jax.init_drafter(dcfg, target=target, seed=0, d2t=vocab.d2t)
  np.testing.assert_array_equal(np.asarray(dr.fc[...]), np.asarray(plain.fc[...]))
  assert not np.array_equal(np.asarray(plain.lm_head[...]), np.asarray(dr.lm_head[...]))
  # A drafter whose final hidden state is the target's scores the draft vocabulary as the
  # target scores those tokens.
  with jax.set_mesh(target.mesh):
    h = jax.random.normal(jax.random.key(0), (1, 3, target.config.hidden_size))
    ours = dr.logits(h)
    theirs = target.lm_logits(rms_norm(h, target.norm.weight[...], target.config.rms_norm_eps))
  np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs)[..., vocab.target_ids],
                             rtol=1e-5, atol=1e-5)


def test_head_init_is_checked_and_reaches_the_drafter(target, data, tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="head_init='zeros'"):
    training.TrainConfig(head_init="zeros")
  _, d = data
  dcfg = eagle3jax.DrafterConfig.for_target(target.config, CAPTURE,
                                            draft_vocab_size=DRAFT_VOCAB)
  with pytest.raises(ValueError, match="head_init='zeros'; choose one of"):
    eagle3jax.init_drafter(dcfg, target=target, head_init="zeros")
  seen = {}

  class Stop(Exception):
    pass

  def fake_init(*args, head_init="random", **kwargs):
    seen["head_init"] = head_init
    raise Stop

  from eagle3jax.training import trainer as trainer_mod
  monkeypatch.setattr(trainer_mod, "init_drafter", fake_init)
  prompts, _ = data
  with pytest.raises(Stop):
    training.train_drafter(target, prompts, str(tmp_path / "out"),
                           dataclasses.replace(CFG, head_init="target"), capture=CAPTURE,
                           checkpoint_dir=str(tmp_path / "state"), progress=False)
  assert seen == {"head_init": "target"}


def test_drafter_layer_step0_equals_drafter_call(target, data):
  _, d = data
  dr = _drafter(target, d)
  tokens = d.tokens[:2]
  aux = eagle3jax.forward(target, tokens, capture=CAPTURE).aux_hidden
  with jax.set_mesh(target.mesh):
    hidden = dr.project(aux)
    pos = jnp.broadcast_to(jnp.arange(SEQ_LEN), (2, SEQ_LEN))
    ref, _ = dr(jnp.asarray(tokens), hidden, pos)
    got, _, _ = ttt.drafter_layer(dr, jnp.asarray(tokens), hidden, pos, [], [],
                                  ttt.ttt_attention_mask(SEQ_LEN, 0))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-6)


def test_ttt_attention_mask_from_start_keeps_the_rows_it_computes():
  # Queries from `start` on: the full mask's rows start.., with the step >= 1 key blocks cut
  # to the same positions.
  t, start = 6, 2
  for step in range(4):
    full = ttt.ttt_attention_mask(t, step)
    cols = list(range(t)) + [i * t + s for i in range(1, step + 1) for s in range(start, t)]
    np.testing.assert_array_equal(ttt.ttt_attention_mask(t, step, start), full[start:][:, cols])
  with pytest.raises(ValueError, match="start=6"):
    ttt.ttt_attention_mask(6, 1, 6)


@pytest.mark.parametrize("mesh_shape,dtype", [((2, 1), jnp.float32), ((1, 2), jnp.float32),
                                               ((1, 4), jnp.float32), ((1, 2), jnp.bfloat16)])
def test_ttt_step_layer_equals_the_masked_layer(data, mesh_shape, dtype):
  # The unrolled steps' attention as step-0 scores plus the diagonal ones equals the plain
  # layer over the concatenated keys with ttt_attention_mask, in values and in gradients (of
  # every parameter and of the step-0 hidden state), from a start and from 0, with query heads
  # grouped over KV heads (8 over 2), on data- and tensor-parallel meshes (4 shards: the 2 KV
  # heads replicated), and in bfloat16 (XLA:CPU refuses some bfloat16 dot layouts).
  _, d = data
  tgt = eagle3jax.init_target(engine_helpers.CFG, mesh=eagle3jax.make_mesh(*mesh_shape),
                              dtype=dtype, seed=0, std=0.5)
  vocab = training.build_draft_vocab(d.responses(), tgt.config.vocab_size, DRAFT_VOCAB)
  dcfg = eagle3jax.DrafterConfig.for_target(tgt.config, CAPTURE, draft_vocab_size=DRAFT_VOCAB)
  dr = eagle3jax.init_drafter(dcfg, target=tgt, dtype=dtype, seed=0, d2t=vocab.d2t)
  tokens = jnp.asarray(d.tokens[:4])
  t = SEQ_LEN
  rtol = 1e-5 if dtype == jnp.float32 else 2e-2
  graphdef, params, rest = nnx.split(dr, training.TRAINABLE, ...)
  with jax.set_mesh(tgt.mesh):
    feats = training.target_features(tgt, d.tokens[:4], CAPTURE,
                                     np.arange(DRAFT_VOCAB) + np.asarray(dr.d2t[...]))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (4, t))
    weights = jax.random.normal(jax.random.key(1), (4, t, tgt.config.hidden_size), jnp.float32)

    def run(p, hidden, start, masked):
      drafter = nnx.merge(graphdef, p, rest)
      a0, k0, v0 = ttt.drafter_layer(drafter, tokens, hidden, pos, [], [],
                                     ttt.ttt_attention_mask(t, 0))
      h, past_k, past_v, outs = a0[:, start:], [k0], [v0], []
      for j in (1, 2, 3):
        tok_j, pos_j = jnp.roll(tokens, -j, axis=1)[:, start:], pos[:, start:] + j
        if masked:
          h, k, v = ttt.drafter_layer(drafter, tok_j, h, pos_j, past_k, past_v,
                                      ttt.ttt_attention_mask(t, j, start))
        else:
          h, k, v = ttt.ttt_step_layer(drafter, tok_j, h, pos_j, past_k, past_v)
        past_k, past_v, outs = past_k + [k], past_v + [v], outs + [h]
      loss = sum(jnp.sum(o.astype(jnp.float32) * weights[:, start:]) for o in outs)
      return loss, (outs, past_k)

    hidden = dr.project(feats.aux)
    for start in (0, 5):
      grad = jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True),
                     static_argnums=(2, 3))
      (_, (want_h, want_k)), (want_gp, want_gh) = grad(params, hidden, start, True)
      (_, (got_h, got_k)), (got_gp, got_gh) = grad(params, hidden, start, False)
      for j, (g, w) in enumerate(zip(got_h + got_k, want_h + want_k)):
        assert jax.typeof(g).sharding == jax.typeof(w).sharding and g.dtype == w.dtype
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=rtol,
                                   atol=rtol * 0.1 * float(np.abs(w).max()),
                                   err_msg=f"start {start}, output {j}")
      flat_want = dict(nnx.to_flat_state(want_gp))
      pairs = [(str(path), g[...], flat_want[path][...]) for path, g in
               nnx.to_flat_state(got_gp)] + [("hidden", got_gh, want_gh)]
      reached = {path for path, _, w in pairs if np.abs(np.asarray(w, np.float32)).max() > 0}
      for name in ("q_proj", "k_proj", "v_proj", "o_proj", "mlp", "hidden"):  # not fc or head
        assert any(name in path for path in reached), (name, reached)
      for path, g, w in pairs:
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=20 * rtol,
                                   atol=2 * rtol * float(np.abs(w).max()),
                                   err_msg=f"start {start}, gradient of {path}")
    with pytest.raises(ValueError, match="step 0's slab"):
      ttt.ttt_step_layer(dr, tokens, hidden, pos, [], [])


def test_loss_start_is_the_first_position_a_step_can_score():
  mask = np.zeros((3, 20), bool)
  mask[0, 12:], mask[1, 9:15], mask[2, 15:] = True, True, True
  assert ttt.loss_start(mask, 3) == 9 - 3 - 1
  assert ttt.loss_start(mask, 7) == 1
  assert ttt.loss_start(mask, 9) == 0
  assert ttt.loss_start(np.zeros((2, 5), bool), 3) == 0


def test_label_distribution_and_its_config():
  logits = jnp.asarray([[2.0, 1.0, 0.0, 2.0], [0.5, 3.0, -1.0, 1.0]])
  np.testing.assert_allclose(ttt.label_distribution(logits, 1.0), jax.nn.softmax(logits, -1),
                             rtol=1e-6)
  np.testing.assert_allclose(ttt.label_distribution(logits, 0.5),
                             jax.nn.softmax(2 * logits, -1), rtol=1e-6)
  np.testing.assert_array_equal(ttt.label_distribution(logits, 0.0),
                                [[0.5, 0, 0, 0.5], [0, 1, 0, 0]])   # ties shared
  for bad in (-0.5, float("inf"), float("nan")):
    with pytest.raises(ValueError, match="label_temperature"):
      training.TrainConfig(label_temperature=bad)


@pytest.mark.parametrize("first_response,label_temperature", [(3, 1.0), (12, 1.0), (12, 0.0)])
def test_ttt_loss_equals_the_plain_formula_values_and_gradients(target, data, first_response,
                                                                label_temperature):
  # Responses from position 12 on: with 3 steps, positions 0..7 take no loss and run only
  # step 0 (start = 8). The loss, the per-step accuracy and every gradient must equal the
  # plain formula's; start = 0 must too; with one-hot labels as well (whose gradients
  # differ from the soft labels').
  _, d = data
  dr = _drafter(target, d)
  tokens = jnp.asarray(d.tokens[:4])
  mask = d.loss_mask[:4] & (np.arange(SEQ_LEN)[None] >= first_response)
  steps = 3
  start = ttt.loss_start(mask, steps)
  assert start == max(0, first_response - steps - 1)
  graphdef, params, rest = nnx.split(dr, training.TRAINABLE, ...)
  with jax.set_mesh(target.mesh):
    feats = training.target_features(target, d.tokens[:4], CAPTURE,
                                     np.arange(DRAFT_VOCAB) + np.asarray(dr.d2t[...]))

    def ours(p, s):
      loss, m = ttt.ttt_loss(nnx.merge(graphdef, p, rest), feats, tokens, jnp.asarray(mask),
                             steps=steps, start=s, label_temperature=label_temperature)
      return loss, m["acc"]

    def ref(p, temperature=label_temperature):
      return ttt.reference_ttt_loss(nnx.merge(graphdef, p, rest), feats, tokens,
                                    jnp.asarray(mask), steps=steps,
                                    label_temperature=temperature)

    (want, want_acc), want_g = jax.jit(jax.value_and_grad(ref, has_aux=True))(params)
    if label_temperature != 1.0:  # the labels reach the gradient (an untrained head's loss is
      # about log N either way)
      soft_g = jax.jit(jax.grad(lambda p: ref(p, 1.0)[0]))(params)
      diff = optax.tree.norm(jax.tree.map(lambda a, b: a - b, soft_g, want_g))
      assert float(diff) > 0.1 * float(optax.tree.norm(soft_g))
    for s in sorted({0, start}):
      (got, got_acc), got_g = jax.jit(jax.value_and_grad(ours, has_aux=True),
                                      static_argnums=1)(params, s)
      np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
      np.testing.assert_allclose(np.asarray(got_acc), np.asarray(want_acc), atol=1e-6)
      flat_want = dict(nnx.to_flat_state(want_g))
      for path, g in nnx.to_flat_state(got_g):
        w = np.asarray(flat_want[path][...])
        np.testing.assert_allclose(np.asarray(g[...]), w, rtol=2e-4,
                                   atol=2e-6 * float(np.abs(w).max()) + 1e-9, err_msg=str(path))
    # with_hits (miss_breakdown's): step 0's hit at token i; over the response they average
    # to step 0's accuracy, and a later start leaves the hits from start + 2 on unchanged.
    hits = jax.jit(lambda p, s: ttt.ttt_loss(
        nnx.merge(graphdef, p, rest), feats, tokens, jnp.asarray(mask), steps=steps, start=s,
        label_temperature=label_temperature, with_hits=True)[1]["hit0"], static_argnums=1)
    h0 = np.asarray(hits(params, 0))
    assert h0.shape == mask.shape and h0.dtype == bool
    counted = mask & (np.arange(SEQ_LEN)[None] >= 2)
    assert h0[counted].any()                      # some hits, so the mean can be off
    np.testing.assert_allclose(h0[counted].mean(), float(want_acc[0]), atol=1e-6)
    hs = np.asarray(hits(params, start))
    np.testing.assert_array_equal(hs[:, start + 2:], h0[:, start + 2:])
    assert not hs[:, :start + 2].any()


@functools.partial(jax.jit, static_argnames=("graphdef", "capture"))
def _extend(graphdef, state, tokens, positions, cache, tree_mask, capture):
  return nnx.merge(graphdef, state)(tokens, positions, cache, tree_mask, capture)


def test_trainer_features_equal_transformers_and_engine_captures(target, data, tmp_path):
  import torch
  import transformers
  from eagle3jax.hf_export import save_target
  _, d = data
  trainer = training.Trainer(target, _drafter(target, d), d, CFG)
  with pytest.raises(AttributeError):
    trainer.capture = eagle3jax.CaptureSpec((0, 1, 2))  # fixed at construction
  tokens = d.tokens
  feats = trainer.features(tokens)
  aux = feats.aux
  # An independent computation: transformers' Llama on the exported weights; capture i is
  # hidden_states[i + 1] (none of (1, 3, 6) is the last of 8 layers, which HF normalises).
  save_target(target, str(tmp_path / "hf"), dtype=np.float32)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                         dtype=torch.float32).eval()
  with torch.no_grad():
    out = hf(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True)
  hs = [h.numpy() for h in out.hidden_states]
  ours = np.split(np.asarray(aux), len(CAPTURE.layer_ids), axis=-1)
  # Relative errors: std-0.5 weights make activations of magnitude ~1e3; neighbouring layers
  # differ by more than 0.3.
  for i, got in zip(CAPTURE.layer_ids, ours):
    errors = [np.linalg.norm(got - h) / np.linalg.norm(h) for h in hs[:-1]]
    assert errors[i + 1] < 1e-4 and int(np.argmin(errors)) == i + 1, (i, errors)
  # The logits reduced inside the forward's jit: the draft vocabulary's columns (exactly
  # eagle3jax.forward's, and transformers' within 1e-4) and the full-vocabulary argmax.
  ids = np.arange(DRAFT_VOCAB) + np.asarray(trainer.drafter.d2t[...])
  ours_full = np.asarray(eagle3jax.forward(target, tokens).logits)
  np.testing.assert_array_equal(np.asarray(feats.draft_logits), ours_full[..., ids])
  np.testing.assert_array_equal(np.asarray(feats.argmax), ours_full.argmax(-1))
  ref_logits = out.logits.numpy()[..., ids]
  assert (np.linalg.norm(np.asarray(feats.draft_logits) - ref_logits)
          < 1e-4 * np.linalg.norm(ref_logits))
  # The engine's path: prefill the first 13 tokens into a KV cache, extend by the rest.
  b, split = tokens.shape[0], 13
  graphdef, state = nnx.split(target)
  with jax.set_mesh(target.mesh):
    cache = target.allocate_cache(b, 64, fill=np.nan)
    parts = []
    for lo, hi in ((0, split), (split, SEQ_LEN)):
      t = hi - lo
      pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (b, t))
      causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
      _, ax, cache = _extend(graphdef, state, jnp.asarray(tokens[:, lo:hi]), pos, cache,
                             causal, CAPTURE)
      cache = cache.with_lengths(jnp.full((b,), hi, jnp.int32))
      parts.append(np.asarray(ax))
  # std-0.5 weights make activations of magnitude ~1e3: compare relative to that scale.
  scale = float(np.abs(np.asarray(aux)).max())
  np.testing.assert_allclose(np.concatenate(parts, axis=1), np.asarray(aux), atol=2e-5 * scale)


def test_loss_falls_on_fixed_batch_and_embedding_stays_frozen(target, data):
  _, d = data  # 4 sequences = one batch: every step sees the same batch
  embed_before = np.asarray(target.embed_tokens[...])
  trainer = training.Trainer(target, _drafter(target, d), d, CFG)
  records = trainer.train(progress=False)
  losses = [r["loss"] for r in records]
  print(f"\nTTT loss {losses[0]:.4f} -> {losses[-1]:.4f}; per-step acc "
        f"{[round(a, 3) for a in records[0]['acc']]} -> "
        f"{[round(a, 3) for a in records[-1]['acc']]}")
  assert len(losses) == CFG.total_steps
  assert losses[-1] < 0.8 * losses[0]
  assert np.mean(records[-1]["acc"]) > np.mean(records[0]["acc"])
  np.testing.assert_array_equal(np.asarray(target.embed_tokens[...]), embed_before)
  drafter = trainer.drafter
  assert drafter.embed_tokens is target.embed_tokens
  assert not any("embed_tokens" in ".".join(map(str, p))
                 for p, _ in nnx.to_flat_state(trainer.params))


def test_feature_cache_holds_what_each_batch_would_compute(target):
  # 7 sequences in batches of 4: the last batch is filled up and cut. Every row the cache
  # gives back is what the per-batch forward computes for it, in the same layout.
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 131, int(rng.integers(3, 8))).tolist() for _ in range(7)]
  responses = [rng.integers(3, 131, 24).tolist() for _ in range(7)]
  d = training.pack(prompts, responses, SEQ_LEN)
  ids = np.arange(DRAFT_VOCAB) * 2
  cache = training.FeatureCache(target, d, CAPTURE, ids, batch_size=4)
  assert cache.nbytes == 7 * SEQ_LEN * 4 * (CAPTURE.width(target.config.hidden_size)
                                            + DRAFT_VOCAB + 1)
  assert cache.nbytes == training.feature_cache_bytes(7, SEQ_LEN, 3 * 64, DRAFT_VOCAB)
  for idx in ([6, 0, 3, 5], [1, 2, 4, 6]):
    got = cache.take(np.asarray(idx))
    want = training.target_features(target, d.tokens[idx], CAPTURE, ids)
    for name in ("aux", "draft_logits", "argmax"):
      g, w = getattr(got, name), getattr(want, name)
      assert g.sharding == w.sharding and g.dtype == w.dtype, name
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6,
                                 err_msg=name)


def test_cached_features_train_as_computed_ones(target, data):
  # Two trainers from one initialisation over 6 sequences in batches of 4 (so batches cross
  # the epoch): the losses and parameters agree, with or without the cache.
  rng = np.random.default_rng(4)
  prompts = [rng.integers(3, 131, int(rng.integers(3, 8))).tolist() for _ in range(6)]
  d = training.build_training_data(target, prompts, seq_len=SEQ_LEN, max_new_tokens=24)
  runs = []
  for cached in (False, True):
    cfg = dataclasses.replace(CFG, cache_features=cached)
    trainer = training.Trainer(target, _drafter(target, data[1]), d, cfg)
    records = trainer.train(4, progress=False)
    assert (trainer._cache is not None) == cached
    runs.append(([r["loss"] for r in records], jax.device_get(trainer.params)))
  np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_feature_cache_refuses_what_it_cannot_hold(target, data, monkeypatch):
  _, d = data
  with pytest.raises(ValueError, match=r"TrainConfig.cache_features='yes' must be True or "):
    training.TrainConfig(cache_features="yes")
  from eagle3jax.training import data as data_lib
  # What the process could take: MemAvailable (page cache included), capped by a cgroup limit.
  assert data_lib._available_memory() > 0
  cgroup = {"/sys/fs/cgroup/memory.max": 2**30, "/sys/fs/cgroup/memory.current": 2**30 - 2**20}
  monkeypatch.setattr(data_lib, "_read_int", cgroup.get)
  assert data_lib._available_memory() == 2**20
  monkeypatch.setattr(data_lib, "_available_memory", lambda: 2**16)
  with pytest.raises(ValueError, match=r"cache_features would hold up to 0.1 MiB of target "
                     r"features \(4 sequences x 32 tokens x \(192 capture values \+ 64 draft "
                     r"logits\)\), more than half of the 0.1 MiB of memory available: set "
                     r"cache_features=False \(train_drafter.py --no-cache-features, "
                     r"make_demo.py --no-draft-cache-features\)"):
    training.FeatureCache(target, d, CAPTURE, np.arange(DRAFT_VOCAB), batch_size=4)
  monkeypatch.setattr(data_lib, "_available_memory", lambda: None)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match="multi-process run does not share: set "
                                       "cache_features=False"):
    training.FeatureCache(target, d, CAPTURE, np.arange(DRAFT_VOCAB), batch_size=4)


def test_resume_after_kill_matches_uninterrupted(target, tmp_path, caplog):
  # 7 sequences in batches of 4: the checkpoint of step 3 sits mid-epoch (cursor 5), so a
  # resume that lost the data cursor would train on other batches.
  rng = np.random.default_rng(5)
  prompts = [rng.integers(3, 131, int(rng.integers(3, 8))).tolist() for _ in range(7)]
  d = training.build_training_data(target, prompts, seq_len=SEQ_LEN, max_new_tokens=24)
  n, k = 7, 4
  cfg = training.TrainConfig(**{**CFG.__dict__, "checkpoint_every": 3})
  full = training.Trainer(target, _drafter(target, d), d, cfg)
  expected = [r["loss"] for r in full.train(n, progress=False)]

  ckpt = str(tmp_path / "ckpt")
  first = training.Trainer(target, _drafter(target, d), d, cfg, checkpoint_dir=ckpt)
  got = [r["loss"] for r in first.train(k, progress=False)]  # checkpoint at step 3 only
  del first  # killed after step 4: its step-4 work is lost
  hook, log_filters = sys.unraisablehook, list(logging.getLogger("asyncio").filters)
  resumed = training.Trainer(target, _drafter(target, d, seed=99), d, cfg,
                             checkpoint_dir=ckpt)
  # The failed-read filters are released once the reads succeeded (they stayed for good).
  assert sys.unraisablehook is hook
  assert logging.getLogger("asyncio").filters == log_filters
  assert resumed.step == 3 and resumed.position == training.DataPosition(1, 5)
  got = got[:3] + [r["loss"] for r in resumed.train(n - 3, progress=False)]
  assert resumed.step == n
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
  resumed.close()
  # Resumed with the feature cache switched on: the same losses, and no warning that the
  # recipe changed (the cache changes where the features come from, not what they are).
  ckpt2 = str(tmp_path / "ckpt2")
  first = training.Trainer(target, _drafter(target, d), d, cfg, checkpoint_dir=ckpt2)
  first.train(k, progress=False)
  del first
  with caplog.at_level(logging.WARNING, logger="eagle3jax"):
    resumed = training.Trainer(target, _drafter(target, d, seed=99), d,
                               dataclasses.replace(cfg, cache_features=True),
                               checkpoint_dir=ckpt2)
  assert "changed TrainConfig fields" not in caplog.text
  tail = [r["loss"] for r in resumed.train(n - 3, progress=False)]
  assert resumed._cache is not None
  np.testing.assert_allclose(tail, expected[3:], rtol=1e-5, atol=0)
  resumed.close()
  # A run asked for fewer steps than its checkpoint holds would export the later step.
  shorter = training.TrainConfig(**{**cfg.__dict__, "total_steps": 5})
  with pytest.raises(ValueError, match=r"checkpoint of step 6, past this run's total_steps=5"
                                       r".*Set total_steps to at least 6"):
    training.Trainer(target, _drafter(target, d), d, shorter, checkpoint_dir=ckpt)
  other = training.pack(prompts, [[7] * 5] * len(prompts), SEQ_LEN)
  with pytest.raises(ValueError, match="written for other training data"):
    training.Trainer(target, _drafter(target, d), other, cfg, checkpoint_dir=ckpt)
  # The checkpoint records its capture, target and draft vocabulary: resuming with another
  # raises and names both (instead of training or exporting its weights under the new ones).
  vocab = training.build_draft_vocab(d.responses(), target.config.vocab_size, DRAFT_VOCAB)
  other_capture = eagle3jax.init_drafter(eagle3jax.DrafterConfig.for_target(
      target.config, eagle3jax.CaptureSpec((1, 3, 5)), draft_vocab_size=DRAFT_VOCAB),
      target=target, d2t=vocab.d2t)
  with pytest.raises(ValueError, match=r"capture layers \[1, 3, 6\], but this run captures "
                                       r"\[1, 3, 5\]"):
    training.Trainer(target, other_capture, d, cfg, checkpoint_dir=ckpt)
  other_vocab = eagle3jax.init_drafter(eagle3jax.DrafterConfig.for_target(
      target.config, CAPTURE, draft_vocab_size=DRAFT_VOCAB), target=target,
      d2t=np.ones(DRAFT_VOCAB, int))  # target ids 1..64
  with pytest.raises(ValueError, match="another draft vocabulary"):
    training.Trainer(target, other_vocab, d, cfg, checkpoint_dir=ckpt)
  other_target = eagle3jax.init_target(engine_helpers.CFG, mesh=target.mesh, seed=5, std=0.5)
  with pytest.raises(ValueError, match="trained on another target"):
    training.Trainer(other_target, _drafter(other_target, d), d, cfg, checkpoint_dir=ckpt)


# Orbax's failed read of the damaged step leaves TensorStore callbacks aimed at its closed
# asyncio loop ("Event loop is closed", reported as unraisable exceptions: a traceback per
# array after the error); the trainer drops those, so any unraisable exception here fails.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_resume_refuses_another_drafter_and_names_damaged_checkpoints(target, tmp_path):
  """Checkpoint metadata is read and checked before the arrays: a drafter of another config
  used to meet orbax's shape error (or, same shapes, resume and export under the new config
  silently), and a damaged step a TensorStore traceback."""
  rng = np.random.default_rng(6)
  prompts = [rng.integers(3, 131, int(rng.integers(3, 8))).tolist() for _ in range(4)]
  d = training.build_training_data(target, prompts, seq_len=SEQ_LEN, max_new_tokens=24)
  cfg = training.TrainConfig(**{**CFG.__dict__, "checkpoint_every": 1})
  ckpt = tmp_path / "ckpt"
  first = training.Trainer(target, _drafter(target, d), d, cfg, checkpoint_dir=str(ckpt))
  first.train(2, progress=False)
  first.close()
  vocab = training.build_draft_vocab(d.responses(), target.config.vocab_size, DRAFT_VOCAB)
  for overrides, fields in (({"rms_norm_eps": 0.1}, r"rms_norm_eps=1e-0?6 there, 0.1 here"),
                            ({"intermediate_size": 16}, r"intermediate_size=\d+ there, 16 here")):
    other = eagle3jax.init_drafter(eagle3jax.DrafterConfig.for_target(
        target.config, CAPTURE, draft_vocab_size=DRAFT_VOCAB, **overrides), target=target,
        d2t=vocab.d2t)
    with pytest.raises(ValueError, match=r"step 2 in .* was trained as another drafter: config "
                                         r"fields " + fields):
      training.Trainer(target, other, d, cfg, checkpoint_dir=str(ckpt))
  # A damaged latest step is named with what to do; the one before it still resumes.
  state = ckpt / "2" / "state"
  for item in state.iterdir():
    if item.is_dir():
      shutil.rmtree(item)
  with pytest.raises(ValueError, match=r"step 2 in .* cannot be restored into this drafter "
                                       r"\(.*\); delete .*2 to resume from the checkpoint "
                                       r"before it"):
    training.Trainer(target, _drafter(target, d), d, cfg, checkpoint_dir=str(ckpt))
  shutil.rmtree(ckpt / "2")
  assert training.Trainer(target, _drafter(target, d), d, cfg,
                          checkpoint_dir=str(ckpt)).step == 1
  (ckpt / "5").mkdir()  # an empty step folder (a write that never started)
  with pytest.raises(ValueError, match=r"step 5 in .* has no readable metadata .*; delete "):
    training.Trainer(target, _drafter(target, d), d, cfg, checkpoint_dir=str(ckpt))


def test_failed_read_filters_drop_only_the_failed_reads_reports(monkeypatch, caplog):
  seen = []
  monkeypatch.setattr("sys.unraisablehook", seen.append)
  asyncio_log = logging.getLogger("asyncio")
  monkeypatch.setattr(asyncio_log, "filters", [])
  monkeypatch.setattr(training.trainer._FAILED_READS, "folders", set())
  training.trainer._quiet_failed_reads("/ckpt/2")
  training.trainer._quiet_failed_reads("/ckpt/3")  # installed once, not stacked
  assert asyncio_log.filters == [training.trainer._FAILED_READS]
  hook = sys.unraisablehook

  def report(exc, obj=None):
    sys.unraisablehook(types.SimpleNamespace(exc_type=type(exc), exc_value=exc,
                                             exc_traceback=None, err_msg=None, object=obj))
  report(RuntimeError("Event loop is closed"))
  report(RuntimeError("Event loop is closed"), obj="a finaliser")
  report(RuntimeError("something else"))
  report(ValueError("Event loop is closed"))
  assert [str(u.exc_value) for u in seen] == ["Event loop is closed", "something else",
                                              "Event loop is closed"]
  assert [u.object for u in seen] == ["a finaliser", None, None]
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    for path in ("/ckpt/2/state/", "/ckpt/20/state/", "/elsewhere/"):
      asyncio_log.error("Future exception was never retrieved\nfuture: <Future finished "
                        "exception=ValueError('NOT_FOUND: reading %s')>", path)
    asyncio_log.error("Task exception was never retrieved\nfuture: <Task finished "
                      "exception=ValueError('NOT_FOUND: reading /ckpt/3/state/')>")
    asyncio_log.error("Task was destroyed but it is pending: /ckpt/2/state/")
  assert [r.getMessage().split("reading ")[-1] for r in caplog.records] == [
      "/ckpt/20/state/')>", "/elsewhere/')>",
      "Task was destroyed but it is pending: /ckpt/2/state/"]
  # Released folder by folder; with none left, the filter and the hook go.
  training.trainer._release_failed_reads("/ckpt/2")
  assert sys.unraisablehook is hook and asyncio_log.filters
  training.trainer._release_failed_reads("/ckpt/3")
  assert sys.unraisablehook == seen.append and not asyncio_log.filters


def test_damaged_training_data_is_named(tmp_path):
  path = tmp_path / "data.npz"
  for content in (b"", b"PK\x03\x04 not a zip", b"just text"):
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"data.npz is not readable training data .*; delete "
                                         r"it to regenerate"):
      training.TrainingData.load(str(path))
  np.savez(path, tokens=np.zeros((1, 4), np.int32))
  with pytest.raises(ValueError, match=r"lacks \['lengths', 'loss_mask'\]"):
    training.TrainingData.load(str(path))


def test_train_drafter_checks_its_arguments_before_the_regeneration(target, tmp_path,
                                                                      monkeypatch):
  def no_regeneration(*args, **kwargs):
    raise AssertionError("regenerated before the arguments were checked")
  monkeypatch.setattr(training.trainer, "build_training_data", no_regeneration)
  prompts = [[5, 6, 7], [8, 9]]
  out = str(tmp_path / "out")
  cfg = training.TrainConfig(**{**CFG.__dict__, "total_steps": 4})

  def refused(message, prompts=prompts, out=out, config=cfg, **kwargs):
    with pytest.raises(ValueError, match=message):
      training.train_drafter(target, prompts, out, config, capture=CAPTURE, progress=False,
                             **kwargs)

  refused(r"heldout_shape=\(3, 1\) must be \(steps, topk, draft tokens\)",
          heldout_prompts=prompts, heldout_every=2, heldout_shape=(3, 1))
  refused(r"heldout_shape=\(0, 1, 4\): num_steps=0", heldout_prompts=prompts,
          heldout_shape=(0, 1, 4))
  refused(r"heldout_every=2.5 must be an integer", heldout_prompts=prompts, heldout_every=2.5)
  refused(r"heldout_prompts: the longest has 400 tokens, and measuring acceptance generates "
          r"128 after it, past the target's max_position_embeddings=512",
          heldout_prompts=[[5] * 400])
  refused(r"heldout_prompts\[0\] holds booleans", heldout_prompts=[[True, 5, 6]])
  refused(r"drafter config field rope.rope_type='yarn' is not supported",
          drafter_overrides={"rope": RopeConfig(rope_type="yarn", factor=2.0,
                                                original_max_position_embeddings=256)})
  refused(r"every prompt has at least seq_len=32 tokens", prompts=[[5] * 32, [6] * 40])
  # These two were refused only where they were reached: in the middle of the regeneration,
  # and at the first held-out measurement after training.
  refused(r"prompts\[1\] has 500 tokens, and the regeneration generates max_new_tokens=24 "
          r"after it, past the target's max_position_embeddings=512", prompts=[[5], [6] * 500])
  refused(r"heldout_shape=\(3, 8, 8\): topk=8 exceeds the draft vocabulary of 4 tokens",
          heldout_prompts=prompts, heldout_every=2, heldout_shape=(3, 8, 8),
          config=dataclasses.replace(cfg, draft_vocab_size=4))
  # A feature cache that would not fit was refused only at the first step.
  from eagle3jax.training import data as data_lib
  monkeypatch.setattr(data_lib, "_available_memory", lambda: 2**16)
  refused(r"cache_features would hold up to 0.1 MiB of target features \(2 sequences x 32 "
          r"tokens x \(192 capture values \+ 64 draft logits\)\)",
          config=dataclasses.replace(cfg, cache_features=True))
  # An out_dir holding another model (the target's own folder, say) would be overwritten.
  target_dir = tmp_path / "target"
  target_dir.mkdir()
  (target_dir / "config.json").write_text('{"model_type": "llama", "vocab_size": 131}')
  refused(r"holds .*config.json, which is not an EAGLE-3 drafter.s .*: saving there would "
          r"overwrite that model", out=str(target_dir))


def test_export_load_decode_is_lossless(target, data, tmp_path):
  prompts, _ = data
  out = str(tmp_path / "drafter")
  with pytest.raises(ValueError, match="heldout_every=10 needs heldout_prompts"):
    eagle3jax.train_drafter(target, prompts, out, CFG, capture=CAPTURE, progress=False,
                            heldout_every=10)
  # Refused before the data is regenerated, not after the training they would end.
  with pytest.raises(ValueError, match=r"heldout_prompts\[1\] has token ids outside"):
    eagle3jax.train_drafter(target, prompts, out, CFG, capture=CAPTURE, progress=False,
                            heldout_prompts=[[3, 4], [131]])
  with pytest.raises(ValueError, match="seq_len=513 exceeds the target's "
                                       "max_position_embeddings=512"):
    eagle3jax.train_drafter(target, prompts, out, dataclasses.replace(CFG, seq_len=513),
                            capture=CAPTURE, progress=False)
  with pytest.raises(ValueError, match="heldout_sources: 1 sources for 2 held-out prompts"):
    eagle3jax.train_drafter(target, prompts, out, CFG, capture=CAPTURE, progress=False,
                            heldout_prompts=prompts[:2], heldout_sources=["a.py"])
  assert not os.path.exists(out)
  result = eagle3jax.train_drafter(target, prompts, out, CFG, capture=CAPTURE,
                                   progress=False, heldout_prompts=prompts[:2],
                                   heldout_every=12, heldout_shape=(3, 1, 4),
                                   heldout_sources=["a.py", "b.py"])
  # The learning curve: held-out acceptance every 12 steps and at the last one, with the
  # per-prompt counts and their interval over the two sources.
  assert [p["step"] for p in result.curve] == [12, 24, 30]
  assert all(p["accept_length"] >= 1 and p["seconds"] >= 0 for p in result.curve)
  from eagle3jax import monitor
  from eagle3jax.acceptance_stats import PromptAcceptance, interval
  final = monitor.measure_acceptance(target, result.drafter, prompts[:2], ((3, 1, 4),),
                                     eos_ids=[])
  assert result.curve[-1]["accept_length"] == final["3,1,4"]
  for p in result.curve:
    m = PromptAcceptance(p["rounds"], p["accepted"])
    assert len(m.rounds) == 2 and round(m.length, 4) == p["accept_length"]
    assert p["interval"] == [round(x, 4) for x in interval(m, groups=["a.py", "b.py"])]
  from eagle3jax.demo import plot_curve
  plot_curve(result.curve, str(tmp_path / "curve.png"))
  assert (tmp_path / "curve.png").stat().st_size > 1000
  assert os.path.exists(os.path.join(out, "config.json"))
  assert 0 < result.vocab.coverage <= 1
  loaded = eagle3jax.load_drafter(out, target=target)
  assert loaded.config.capture == CAPTURE
  # The record's acceptance is the curve's measurement (without EOS; it stopped at EOS before).
  assert loaded.capture_record.acceptance_for(3, 1, 4) == final["3,1,4"]
  np.testing.assert_array_equal(np.asarray(loaded.d2t[...]), result.vocab.d2t)
  np.testing.assert_allclose(np.asarray(loaded.lm_head[...]),
                             np.asarray(result.drafter.lm_head[...]), atol=1e-6)
  base = eagle3jax.generate(target, None, prompts, max_new_tokens=20)
  spec = eagle3jax.generate(target, loaded, prompts, max_new_tokens=20)
  assert spec.tokens == base.tokens
  print(f"\ntrained drafter on its training prompts: accept_length_mean "
        f"{spec.stats['accept_length_mean']:.3f}")
  # A second call resumes from the finished checkpoint: no step is trained again.
  again = eagle3jax.train_drafter(target, prompts, out, CFG, capture=CAPTURE, progress=False)
  assert again.history == []
  # Other prompts (or another response length) against the kept data.npz: refused, where it
  # used to train on the old data with only a warning about the changed fields.
  for other_prompts, cfg in ((prompts[:3], CFG),
                             (prompts, dataclasses.replace(CFG, max_new_tokens=20))):
    with pytest.raises(ValueError, match="was regenerated from other prompts or regeneration "
                                         "settings"):
      eagle3jax.train_drafter(target, other_prompts, out, cfg, capture=CAPTURE,
                              progress=False)
  other_target = eagle3jax.init_target(engine_helpers.CFG, mesh=target.mesh, seed=5, std=0.5)
  with pytest.raises(ValueError, match="was regenerated by another target"):
    eagle3jax.train_drafter(other_target, prompts, out, CFG, capture=CAPTURE, progress=False)


def test_training_stops_at_a_non_finite_loss(target, data):
  # A drafter weight made infinite gives a NaN loss: the step raises before its update lands.
  prompts, d = data
  drafter = _drafter(target, d)
  fc = drafter.fc.get_value()  # the drafter's own weight, not the target's shared embedding
  bad = np.asarray(fc).copy()
  bad[0, 0] = np.inf
  drafter.fc.set_value(jax.device_put(bad, fc.sharding))
  trainer = training.Trainer(target, drafter, d, CFG)
  before = jax.tree.map(np.asarray, trainer.params)
  with pytest.raises(FloatingPointError, match=r"drafter training step 1: loss nan.*the update "
                                               r"was not applied"):
    trainer.train_step()
  assert trainer.step == 0
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, trainer.params))
  # The step donated its optimiser state (freed on accelerators): with no checkpoint to roll
  # back to, the trainer refuses to go on instead of failing on a deleted array.
  with pytest.raises(RuntimeError, match="stopped at a non-finite loss"):
    trainer.train_step()


def test_train_config_takes_numpy_numbers_and_refuses_negative_seeds():
  cfg = training.TrainConfig(learning_rate=np.float32(1e-3), total_steps=np.int64(200))
  assert cfg.learning_rate == pytest.approx(1e-3)
  with pytest.raises(ValueError, match=r"TrainConfig.seed=-1 must be an integer in \[0, "):
    training.TrainConfig(seed=-1)


@pytest.mark.parametrize("field, value", [("grad_clip", float("nan")),
                                          ("learning_rate", float("inf")),
                                          ("weight_decay", float("nan")),
                                          ("learning_rate", "1e-3"), ("b1", None)])
def test_train_config_refuses_non_finite_and_non_numbers(field, value):
  with pytest.raises(ValueError, match=f"TrainConfig.{field}=.* must be a finite number"):
    training.TrainConfig(**{field: value})


def _script():
  return load_script("train_drafter")


def test_script_help_documents_every_flag(capsys):
  with pytest.raises(SystemExit) as e:
    _script().run(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  for flag in ("--target", "--out", "--prompts", "--prompt-ids-file", "--config",
               "--capture", "--mesh", "--heldout-prompt-ids-file"):
    assert flag in text
  for f in training.TrainConfig.__dataclass_fields__:
    assert "--" + f.replace("_", "-") in text
  # ... each with a sentence, not only its name (a field added without one fell back to it).
  undocumented = set(training.TrainConfig.__dataclass_fields__) - set(_script()._FIELD_HELP)
  assert not undocumented, f"train_drafter.py has no help for {sorted(undocumented)}"


def test_script_config_and_flags(tmp_path):
  mod = _script()
  cfg_file = tmp_path / "cfg.json"
  cfg_file.write_text('{"learning_rate": 0.01, "ttt_steps": 3}')
  args = mod.build_parser(training.TrainConfig).parse_args(
      ["--target", "t", "--out", "o", "--prompt-ids-file", "p", "--config", str(cfg_file),
       "--ttt-steps", "5", "--b2", "0.99", "--cache-features"])
  cfg = mod._train_config(args, training.TrainConfig)
  assert (cfg.learning_rate, cfg.ttt_steps, cfg.b2) == (0.01, 5, 0.99)
  assert cfg.cache_features is True
  cfg_file.write_text('{"cache_features": true}')  # the flag overrides the file
  args = mod.build_parser(training.TrainConfig).parse_args(
      ["--target", "t", "--out", "o", "--prompt-ids-file", "p", "--config", str(cfg_file),
       "--no-cache-features"])
  assert mod._train_config(args, training.TrainConfig).cache_features is False
  args = mod.build_parser(training.TrainConfig).parse_args(
      ["--target", "t", "--out", "o", "--prompt-ids-file", "p", "--config", str(cfg_file)])
  assert mod._train_config(args, training.TrainConfig).cache_features is True
  cfg_file.write_text('{"cache_features": "false"}')
  args = mod.build_parser(training.TrainConfig).parse_args(
      ["--target", "t", "--out", "o", "--prompt-ids-file", "p", "--config", str(cfg_file)])
  with pytest.raises(ValueError, match="in a --config JSON file: true or false, not a string"):
    mod._train_config(args, training.TrainConfig)
  args = mod.build_parser(training.TrainConfig).parse_args(
      ["--target", "t", "--out", "o", "--prompt-ids-file", "p"])
  assert mod._train_config(args, training.TrainConfig).cache_features is False


def test_script_prompts_go_through_the_chat_template_as_decode_does(tmp_path):
  """--prompts lines were encoded raw while decode.py --prompt renders the target's chat
  template: an instruct target's drafter trained on contexts it would never serve."""
  from eagle3jax.text import TextCodec  # pylint: disable=import-outside-toplevel
  from tests.test_text import _saved  # pylint: disable=import-outside-toplevel
  _saved(tmp_path)  # a tokenizer with a chat template, as transformers saves it
  lines = tmp_path / "prompts.txt"
  lines.write_text("hello world\n\nworld hello\n")
  mod = _script()
  args = mod.build_parser(training.TrainConfig).parse_args(
      ["--target", str(tmp_path), "--out", "o", "--prompts", str(lines)])
  codec = TextCodec(str(tmp_path))
  got = mod._read_prompts(args)  # pylint: disable=protected-access
  assert got == [codec.encode_prompt("hello world"), codec.encode_prompt("world hello")]
  assert got[0] == [1, 5, 6, 3, 4, 7, 6]  # <s> user : hello world assistant :


def test_script_heldout_prompts_are_checked(tmp_path, capsys):
  prompts = tmp_path / "p.json"
  prompts.write_text("[[1, 2, 3]]")
  bad = tmp_path / "h.json"
  bad.write_text('[[1, 2], "x"]')
  for path, message in ((str(tmp_path / "none.json"), "does not exist"),
                        (str(bad), "must hold a non-empty JSON list of non-empty lists")):
    argv = ["--target", ".", "--out", "o", "--prompt-ids-file", str(prompts),
            "--heldout-prompt-ids-file", path]
    assert _script().run(argv) == 2
    err = capsys.readouterr().err
    assert f"--heldout-prompt-ids-file {path!r} {message}" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--target", "/nonexistent", "--out", "o", "--prompt-ids-file", "p"],
     "--target '/nonexistent' is not a directory"),
    (["--target", ".", "--out", "o", "--prompt-ids-file", "/nonexistent.json"],
     "--prompt-ids-file '/nonexistent.json' does not exist"),
    (["--target", ".", "--out", "o", "--prompts", "tests"],  # said "does not exist" before
     "--prompts 'tests' is a folder; give a file"),
    (["--target", ".", "--out", "o", "--prompt-ids-file", "p", "--mesh", "2"],
     "--mesh '2': expected DATA,TENSOR"),
    (["--target", ".", "--out", "o", "--prompt-ids-file", "p", "--warmup-steps", "5000"],
     "warmup_steps=5000 must be below total_steps"),
    # Named after a detour through the prompts' advice (--prompt-ids-file) before.
    (["--target", "models/default/drafter", "--out", "o", "--prompts", "p.txt"],
     "--target 'models/default/drafter' holds an EAGLE-3 drafter"),
])
def test_script_errors_are_one_line(argv, message, capsys):
  assert _script().run(argv) == 2
  err = capsys.readouterr().err
  assert message in err
  assert err.count("\n") == 1 and "Traceback" not in err


def test_miss_breakdown_equals_a_recount_from_the_serving_calls(mesh):
  # engine_helpers' copy drafter (it proposes the token two back, which random tiny targets
  # often repeat) hits some tokens and misses others. Every count must equal one made here from
  # eagle3jax.forward's full logits and the drafter's own serving call; the step-0 accuracy
  # must equal ttt_loss's; 5 rows in batches of 2 exercise the padded last batch.
  from eagle3jax.training import misses
  tgt = engine_helpers.target(mesh)
  dr = engine_helpers.copy_drafter(tgt)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 131, int(n)).tolist() for n in (4, 6, 5, 7, 4)]
  d = training.pack(prompts, training.regenerate(tgt, prompts, max_new_tokens=14), 20)
  gap_edges, position_edges = (0.05, 0.2), (3, 8)
  got = training.miss_breakdown(tgt, dr, d.tokens, d.loss_mask, steps=3, gap_edges=gap_edges,
                                position_edges=position_edges, batch_size=2)

  out = eagle3jax.forward(tgt, d.tokens, capture=engine_helpers.CAPTURE)
  logits = np.asarray(out.logits, np.float64)
  top2 = np.sort(logits, axis=-1)[..., -2:]
  gap = top2[..., 1] - top2[..., 0]
  argmax = logits.argmax(-1)
  b, t = d.tokens.shape
  with jax.set_mesh(tgt.mesh):
    shifted = jnp.asarray(np.pad(d.tokens[:, 1:], ((0, 0), (0, 1))))
    a, _ = dr(shifted, dr.project(out.aux_hidden), jnp.broadcast_to(jnp.arange(t), (b, t)))
    pred = np.asarray(dr.to_target_ids(jnp.argmax(dr.logits(a), -1)))
  valid = d.loss_mask.copy()
  valid[:, :2] = False
  rows, cols = np.nonzero(valid)                       # token u is predicted at u - 2
  hit = pred[rows, cols - 2] == argmax[rows, cols - 1]
  g = gap[rows, cols - 1]
  index = cols - np.argmax(d.loss_mask, axis=1)[rows]
  assert got.positions == len(rows) == int(d.loss_mask[:, 2:].sum())
  assert got.accuracy == pytest.approx(hit.mean())
  assert 0.1 < got.accuracy < 0.9                                  # hits and misses both
  assert got.step_accuracy[0] == pytest.approx(got.accuracy) and len(got.step_accuracy) == 3
  for bins, values, edges in ((got.by_gap, g, gap_edges), (got.by_position, index,
                                                           position_edges)):
    bounds = [0, *edges, np.inf]
    assert [(x.low, x.high) for x in bins] == list(zip(bounds[:-1], bounds[1:]))
    for x in bins:
      sel = (values >= x.low) & (values < x.high)
      assert x.fraction == pytest.approx(sel.mean())
      assert x.miss_share == pytest.approx((sel & ~hit).sum() / (~hit).sum())
      if sel.any():
        assert x.accuracy == pytest.approx(hit[sel].mean())
      else:
        assert np.isnan(x.accuracy)
  assert json.loads(json.dumps(got.to_dict()))["by_gap"][-1]["high"] is None
  assert misses.GAP_EDGES == tuple(sorted(misses.GAP_EDGES))


def test_miss_breakdown_on_a_vocabulary_sharded_target_equals_unsharded():
  # An even vocabulary is split over tensor=2: the top-2 gap comes from vocab_parallel.top_k
  # across the shards and must give the same breakdown as one shard.
  cfg = dataclasses.replace(engine_helpers.CFG, vocab_size=132)
  rng = np.random.default_rng(4)
  prompts = [rng.integers(3, 131, 5).tolist() for _ in range(4)]
  out = []
  for data_size, tensor in ((2, 1), (1, 2)):
    tgt = engine_helpers.target(eagle3jax.make_mesh(data_size, tensor), cfg)
    d = training.pack(prompts, training.regenerate(tgt, prompts, max_new_tokens=10), 16)
    out.append(json.dumps(training.miss_breakdown(
        tgt, engine_helpers.copy_drafter(tgt), d.tokens, d.loss_mask, steps=3,
        batch_size=2).to_dict()))
  assert out[0] == out[1]


@pytest.mark.parametrize("change, message", [
    (dict(loss_mask=np.zeros((2, 20), bool)), "no response token"),
    (dict(loss_mask=np.ones((2, 19), bool)), "the tokens' shape (2, 20); got (2, 19) bool"),
    (dict(gap_edges=(0.3, 0.1)), "gap_edges=(0.3, 0.1) must be positive and increasing"),
    (dict(position_edges=(0, 8)), "position_edges=(0, 8) must be positive"),
    (dict(steps=0), "steps=0"),
])
def test_miss_breakdown_input_errors(mesh, change, message):
  tgt = engine_helpers.target(mesh)
  args = dict(tokens=np.full((2, 20), 5), loss_mask=np.ones((2, 20), bool))
  args.update(change)
  with pytest.raises(ValueError, match=re.escape(message)):
    training.miss_breakdown(tgt, engine_helpers.copy_drafter(tgt), args.pop("tokens"),
                            args.pop("loss_mask"), **args)


@pytest.mark.parametrize("align_topk", [1, 16])
def test_token_alignment_equals_the_plain_formula_and_drops_what_decoding_never_reaches(
    target, data, align_topk):
  # align_topk k: step j at t takes no loss unless steps 0..j-1 at t each had a response
  # label and ranked the target's token in their top k. ttt_loss (windows from `start`, the
  # running mask) must equal the plain formula (full-length shifts) in loss, accuracy and
  # every gradient; the mask must change the gradient (it is not a no-op), and with k = N
  # (every rank passes) the chance to reach step j is the share of positions whose earlier
  # labels are all response tokens of the draft vocabulary, counted here in numpy.
  _, d = data
  dr = _drafter(target, d)
  tokens = jnp.asarray(d.tokens[:4])
  mask = d.loss_mask[:4] & (np.arange(SEQ_LEN)[None] >= 12)
  steps = 3
  start = ttt.loss_start(mask, steps)
  graphdef, params, rest = nnx.split(dr, training.TRAINABLE, ...)
  with jax.set_mesh(target.mesh):
    draft_ids = np.arange(DRAFT_VOCAB) + np.asarray(dr.d2t[...])
    feats = training.target_features(target, d.tokens[:4], CAPTURE, draft_ids)

    def ours(p, k):
      loss, m = ttt.ttt_loss(nnx.merge(graphdef, p, rest), feats, tokens, jnp.asarray(mask),
                             steps=steps, start=start, label_temperature=0.0, align_topk=k)
      return loss, m

    def ref(p, k):
      return ttt.reference_ttt_loss(nnx.merge(graphdef, p, rest), feats, tokens,
                                    jnp.asarray(mask), steps=steps, label_temperature=0.0,
                                    align_topk=k)

    (want, want_acc), want_g = jax.jit(jax.value_and_grad(ref, has_aux=True),
                                       static_argnums=1)(params, align_topk)
    (got, got_m), got_g = jax.jit(jax.value_and_grad(ours, has_aux=True),
                                  static_argnums=1)(params, align_topk)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_m["acc"]), np.asarray(want_acc), atol=1e-6)
    flat_want = dict(nnx.to_flat_state(want_g))
    for path, g in nnx.to_flat_state(got_g):
      w = np.asarray(flat_want[path][...])
      np.testing.assert_allclose(np.asarray(g[...]), w, rtol=2e-4,
                                 atol=2e-6 * float(np.abs(w).max()) + 1e-9, err_msg=str(path))
    alive = np.asarray(got_m["alive"])
    assert alive[0] == 1.0 and np.all(np.diff(alive) <= 0) and alive[-1] < 1.0
    (plain, plain_m), plain_g = jax.jit(jax.value_and_grad(ours, has_aux=True),
                                        static_argnums=1)(params, 0)
    np.testing.assert_allclose(np.asarray(plain_m["acc"]), np.asarray(got_m["acc"]))
    diff = optax.tree.norm(jax.tree.map(lambda a, b: a - b, plain_g, got_g))
    assert float(diff) > 1e-3 * float(optax.tree.norm(plain_g))

    everything = np.asarray(jax.jit(ours, static_argnums=1)(params, DRAFT_VOCAB)[1]["alive"])
  in_vocab = np.isin(np.asarray(feats.argmax), draft_ids)
  t = SEQ_LEN
  for j in range(steps):
    valid = np.zeros_like(mask)
    valid[:, :t - j - 2] = mask[:, j + 2:]           # label of step j at t: token t + j + 2
    reach = valid.copy()
    for i in range(j):                               # step i's label: response, in vocab
      lab = np.zeros_like(mask)
      lab[:, :t - i - 2] = mask[:, i + 2:] & in_vocab[:, i + 1:t - 1]
      reach &= lab
    np.testing.assert_allclose(everything[j], reach.sum() / valid.sum(), rtol=1e-6)


def test_align_topk_is_checked():
  for bad in (-1, 1.5, True, "1"):
    with pytest.raises(ValueError, match="align_topk"):
      training.TrainConfig(align_topk=bad)
  assert training.TrainConfig(align_topk=1).align_topk == 1
