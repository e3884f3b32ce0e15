"""The public API under a caller's strict JAX numpy config.

Research code often sets ``jax_numpy_rank_promotion="raise"`` and
``jax_numpy_dtype_promotion="strict"``. The library's code is written for JAX's defaults, so
its entry points and the models' ``__call__`` run under them (``eagle3jax.semantics``): under
the strict config every flow below gives what it gives under the defaults, and the caller's own
code stays strict.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3jax
from eagle3jax import round_profile, training
from eagle3jax.tree import TreeShape

CFG = eagle3jax.LlamaConfig.tiny(num_hidden_layers=8)
CAPTURE = eagle3jax.CaptureSpec.eagle3_default(8)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
TREE = dict(num_steps=3, topk=2, num_draft_tokens=5)


def strict():
  return jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict")


def test_every_entry_point_runs_under_a_strict_numpy_config(tmp_path):
  target = eagle3jax.init_target(CFG)
  logits = np.asarray(eagle3jax.forward(target, [[1, 2, 3]], capture=CAPTURE).logits)
  baseline = eagle3jax.generate(target, None, PROMPTS, max_new_tokens=12, eos_ids=[]).tokens
  rank, dtype = strict()
  with rank, dtype:
    # Without the library's semantics these raised: rank in rms_norm, rope and the MoE router,
    # dtype in the decode loop's counters.
    with pytest.raises(ValueError, match="could not be broadcast"):
      _ = jnp.ones(3) + jnp.ones((2, 3))  # the caller's own code stays strict
    target = eagle3jax.init_target(CFG)
    np.testing.assert_array_equal(
        np.asarray(eagle3jax.forward(target, [[1, 2, 3]], capture=CAPTURE).logits), logits)
    with jax.set_mesh(target.mesh):  # the model traced inside the caller's own jit
      mine = jax.jit(lambda ids: target(ids)[0])(jnp.asarray([[1, 2, 3]]))
    np.testing.assert_allclose(np.asarray(mine), logits, rtol=1e-6, atol=1e-6)
    drafter = eagle3jax.init_drafter(eagle3jax.DrafterConfig.for_target(CFG, CAPTURE),
                                     target=target)
    out = eagle3jax.generate(target, drafter, PROMPTS, max_new_tokens=12, eos_ids=[], **TREE)
    assert out.tokens == baseline
    sampled = eagle3jax.generate(target, drafter, PROMPTS, max_new_tokens=6, eos_ids=[],
                                 temperature=0.8, top_p=0.9, top_k=5, **TREE)
    assert [len(t) for t in sampled.tokens] == [6, 6]
    seen = []  # the caller's callback runs under the caller's settings, not the library's
    eagle3jax.generate(target, drafter, PROMPTS, max_new_tokens=6, eos_ids=[],
                       on_tokens=lambda _: seen.append((jax.config.jax_numpy_rank_promotion,
                                                        jax.config.jax_numpy_dtype_promotion)))
    assert seen and set(seen) == {("raise", "strict")}
    inner = []  # a callback that calls the library again hands its own settings on

    def outer(_):
      with jax.numpy_rank_promotion("allow"):
        eagle3jax.generate(target, None, PROMPTS[:1], max_new_tokens=3, eos_ids=[],
                           on_tokens=lambda _: inner.append(jax.config.jax_numpy_rank_promotion))
    eagle3jax.generate(target, None, PROMPTS[:1], max_new_tokens=3, eos_ids=[],
                       on_tokens=outer)
    assert inner and set(inner) == {"allow"}
    eagle3jax.train_drafter(
        target, [[1, 2, 3, 4]] * 8, str(tmp_path / "d"),
        eagle3jax.TrainConfig(total_steps=2, warmup_steps=1, batch_size=4, seq_len=16,
                              max_new_tokens=8, draft_vocab_size=32),
        capture=CAPTURE, progress=False, heldout_prompts=[[1, 2, 3]])
    trained = eagle3jax.load_drafter(str(tmp_path / "d"), target=target)
    aux = eagle3jax.forward(target, [[1, 2, 3]], capture=CAPTURE).aux_hidden
    assert eagle3jax.draft_logits(trained, [[2, 3, 4]], aux).shape == (1, 3, 32)
    eagle3jax.save_drafter(trained, str(tmp_path / "again"), target=target)
    # The documented library functions under the entry points: the TTT loss, the miss
    # breakdown and the round profile.
    tokens = np.asarray([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, np.int32)
    mask = np.zeros_like(tokens, bool)
    mask[:, 3:] = True
    ids = np.arange(32) + np.asarray(trained.d2t[...])
    feats = training.target_features(target, tokens, CAPTURE, ids)
    with pytest.raises(ValueError, match="ttt_loss was called outside a mesh context"):
      training.ttt_loss(trained, feats, tokens, mask, steps=3)
    with jax.set_mesh(target.mesh):
      loss, _ = training.ttt_loss(trained, feats, tokens, mask, steps=3)
    assert np.isfinite(float(loss))
    # Work done later, outside the call that built it: the optimizer's init and update, and
    # the soft cross-entropy's custom gradient rules (jax.grad calls them directly).
    tx = training.make_optimizer(eagle3jax.TrainConfig(total_steps=4, warmup_steps=1))
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    updates, _ = tx.update(params, tx.init(params), params)
    assert np.isfinite(np.asarray(updates["w"])).all()
    grad = jax.grad(lambda x: training.soft_cross_entropy(x, jnp.full(4, 0.25)).sum())(
        jnp.ones((2, 4), jnp.bfloat16))
    assert grad.shape == (2, 4)
    assert training.miss_breakdown(target, trained, tokens, mask, steps=3).positions > 0
    profile = round_profile.profile_round(target, trained, [[1, 2, 3]], TreeShape(3, 1, 4),
                                          max_new_tokens=8, repeats=2)
    assert profile["round_ms"] > 0
    deepseek = eagle3jax.init_deepseek(eagle3jax.DeepseekConfig.tiny())
    assert [len(t) for t in eagle3jax.generate(deepseek, None, PROMPTS, max_new_tokens=4,
                                               eos_ids=[]).tokens] == [4, 4]
