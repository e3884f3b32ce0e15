"""Drafter checkpoints (public layout) and the capture contract."""

import json
import logging
import warnings

import numpy as np
import pytest
import safetensors.numpy

import eagle3jax
import eagle3jax.training
from eagle3jax.capture import CaptureSpec
from eagle3jax.safetensors_io import SafetensorsFile
from tests import engine_helpers as h

# These drafters are random (untrained) and saved without a capture record, so the probe at
# load warns that they predict none of the target's tokens (tests/test_capture_contract.py
# asserts that warning); here it is expected.
pytestmark = pytest.mark.filterwarnings("ignore::eagle3jax.CaptureWarning")

PUBLIC_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d"}


@pytest.fixture(scope="module")
def tgt():
  return h.target()


def _inputs(tgt, capture):
  ids = np.random.default_rng(0).integers(0, 131, (2, 9))
  aux = eagle3jax.forward(tgt, ids, capture=capture).aux_hidden
  return np.roll(ids, -1, axis=1), aux


def _edit_config(path, fn):
  cfg = json.loads((path / "config.json").read_text())
  fn(cfg)
  (path / "config.json").write_text(json.dumps(cfg))


def test_round_trip_public_layout_without_embedding(tmp_path, tgt):
  d2t = np.sort(np.random.default_rng(3).choice(131, 50, replace=False)) - np.arange(50)
  cfg = eagle3jax.DrafterConfig.for_target(tgt.config, h.CAPTURE, draft_vocab_size=50)
  dr = eagle3jax.init_drafter(cfg, target=tgt, seed=4, std=0.1, d2t=d2t)
  eagle3jax.save_drafter(dr, str(tmp_path), include_embedding=False)
  st = SafetensorsFile(str(tmp_path / "model.safetensors"))
  assert set(st.names) == PUBLIC_KEYS  # no embed_tokens: the target's is shared
  assert st.shape("fc.weight") == (64, 3 * 64)
  assert st.shape("lm_head.weight") == (50, 64)
  saved = json.loads((tmp_path / "config.json").read_text())
  # Features of the drafter's own width: no target_hidden_size, with which the official
  # loader keeps a random embedding instead of the target's (this file has none).
  assert "target_hidden_size" not in saved and saved["hidden_size"] == 64
  assert saved["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [-1, 3, 6],
                                   "use_aux_hidden_state": True,
                                   "aux_layer_convention": "output"}
  loaded = eagle3jax.load_drafter(str(tmp_path), target=tgt)  # no argument needed
  assert loaded.config.capture == h.CAPTURE
  assert loaded.embed_tokens is tgt.embed_tokens  # shared, not copied
  ids, aux = _inputs(tgt, h.CAPTURE)
  np.testing.assert_array_equal(np.asarray(eagle3jax.draft_logits(dr, ids, aux)),
                                np.asarray(eagle3jax.draft_logits(loaded, ids, aux)))
  np.testing.assert_array_equal(np.asarray(loaded.d2t[...]), d2t)
  assert int(np.asarray(loaded.t2d[...]).sum()) == 50


def test_checkpoint_with_own_embedding(tmp_path, tgt):
  dr = h.random_drafter(tgt)
  eagle3jax.save_drafter(dr, str(tmp_path))
  f = str(tmp_path / "model.safetensors")
  st = SafetensorsFile(f)
  tensors = {n: np.array(st.get(n)) for n in st.names}
  own = np.random.default_rng(0).normal(size=(131, 64)).astype(np.float32)
  tensors["embed_tokens.weight"] = own
  del st
  safetensors.numpy.save_file(tensors, f)
  loaded = eagle3jax.load_drafter(str(tmp_path), target=tgt)
  assert loaded.own_embedding
  np.testing.assert_array_equal(np.asarray(loaded.embed_tokens[...]), own)
  # SGLang would serve it with the target's table: the re-export says so.
  with pytest.warns(eagle3jax.PortabilityWarning, match="carries its own token embedding"):
    eagle3jax.save_drafter(loaded, str(tmp_path / "again"))
  ids, aux = _inputs(tgt, h.CAPTURE)
  assert not np.allclose(np.asarray(eagle3jax.draft_logits(dr, ids, aux)),
                         np.asarray(eagle3jax.draft_logits(loaded, ids, aux)))


@pytest.fixture()
def default_capture_checkpoint(tmp_path, tgt):
  spec = CaptureSpec.eagle3_default(8)  # (1, 3, 4)
  cfg = eagle3jax.DrafterConfig.for_target(tgt.config, spec)
  eagle3jax.save_drafter(eagle3jax.init_drafter(cfg, target=tgt, seed=2), str(tmp_path))
  return tmp_path


def test_no_ids_means_official_default(default_capture_checkpoint, tgt):
  _edit_config(default_capture_checkpoint, lambda c: c.pop("eagle_config"))
  dr = eagle3jax.load_drafter(str(default_capture_checkpoint), target=tgt)
  assert dr.config.capture.layer_ids == (1, 3, 4)


def test_ids_without_convention_are_refused_then_resolved(default_capture_checkpoint, tgt,
                                                          caplog):
  # Public-layout config as vLLM/SGLang drafters ship it: ids, no convention.
  def public(c):
    c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
  _edit_config(default_capture_checkpoint, public)
  path = str(default_capture_checkpoint)
  with pytest.raises(ValueError) as err:
    eagle3jax.load_drafter(path, target=tgt)
  msg = str(err.value)
  assert "[2, 4, 5]" in msg and "[1, 3, 4]" in msg and "aux_layer_convention" in msg
  with caplog.at_level(logging.INFO, logger="eagle3jax"):
    dr = eagle3jax.load_drafter(path, target=tgt, aux_layer_convention="input")
  assert dr.config.capture.layer_ids == (1, 3, 4)
  assert "outputs of target layers [1, 3, 4]" in caplog.text
  dr = eagle3jax.load_drafter(path, target=tgt, aux_layer_convention="output")
  assert dr.config.capture.layer_ids == (2, 4, 5)
  with pytest.raises(ValueError, match="choose 'input', 'output' or 'auto'"):
    eagle3jax.load_drafter(path, target=tgt, aux_layer_convention="inputs")


def test_recorded_input_convention_and_contradiction(default_capture_checkpoint, tgt):
  def recorded(c):
    c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
                         "aux_layer_convention": "input"}
  _edit_config(default_capture_checkpoint, recorded)
  path = str(default_capture_checkpoint)
  assert eagle3jax.load_drafter(path, target=tgt).config.capture.layer_ids == (1, 3, 4)
  with pytest.raises(ValueError, match="contradicts the drafter config"):
    eagle3jax.load_drafter(path, target=tgt, aux_layer_convention="output")


def test_capture_count_must_match_fc(default_capture_checkpoint, tgt):
  def four(c):
    c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2, 3],
                         "aux_layer_convention": "output"}
  _edit_config(default_capture_checkpoint, four)
  with pytest.raises(ValueError, match="fc.weight takes 192 input features"):
    eagle3jax.load_drafter(str(default_capture_checkpoint), target=tgt)


def test_serving_with_other_captures_is_refused(tgt):
  """The seed's failure: [-1, ...] served to a drafter trained without the embedding."""
  cfg = eagle3jax.DrafterConfig.for_target(tgt.config, CaptureSpec((1, 3, 6)))
  dr = eagle3jax.init_drafter(cfg, target=tgt)
  with pytest.raises(ValueError) as err:
    eagle3jax.generate(tgt, dr, [[1, 2, 3]], max_new_tokens=4, capture=[-1, 1, 3])
  msg = str(err.value)
  assert "[-1, 1, 3]" in msg and "[1, 3, 6]" in msg and "trained on" in msg
  # The recorded spec (capture=None) or the same ids run.
  ok = eagle3jax.generate(tgt, dr, [[1, 2, 3]], max_new_tokens=4, capture=[1, 3, 6],
                          num_steps=3)
  assert len(ok.tokens[0]) == 4


def test_drafters_other_engines_would_misread_are_written_with_a_warning(tmp_path, tgt):
  """The official EAGLE-3 code builds fc for 3 captures, derives head_dim from hidden_size
  and always reads its own default layers; SGLang reads ids not starting at 1 as inputs of
  those layers. Such a drafter serves here as trained; its export says where it would not."""
  def problems(capture, **kw):
    cfg = eagle3jax.DrafterConfig.for_target(tgt.config, CaptureSpec(capture), **kw)
    dr = eagle3jax.init_drafter(cfg, target=tgt, seed=2)
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      eagle3jax.save_drafter(dr, str(tmp_path / "d"), target=tgt)
    found = [str(w.message) for w in seen if w.category is eagle3jax.PortabilityWarning]
    assert all(w.filename == __file__ for w in seen
               if w.category is eagle3jax.PortabilityWarning)  # names the caller's line
    return found[0] if found else ""
  assert problems((1, 3, 4)) == ""  # eagle3_default(8): every engine reads it alike
  msg = problems((2, 3, 4))
  assert "SGLang reads such ids as the inputs of those layers" in msg and "[1, 2, 3]" in msg
  assert "always reads layers [1, 3, 4] of a 8-layer target, not [2, 3, 4]" in msg
  assert "build fc for exactly 3" in problems((1, 4))
  assert "for which SGLang's capture list has no id" in problems((-1, 3, 4))
  msg = problems((1, 3, 4), num_attention_heads=2, num_key_value_heads=2, head_dim=16)
  assert "num_attention_heads=2 x head_dim=16 is not hidden_size=64" in msg
  # Said before a training starts, not after it (here the folder is refused next).
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.warns(eagle3jax.PortabilityWarning, match="build fc for exactly 3"), \
      pytest.raises(ValueError, match="is a file"):
    eagle3jax.training.train_drafter(
        tgt, [[1, 2, 3]] * 2, str(blocker),
        eagle3jax.training.TrainConfig(total_steps=1, warmup_steps=0, batch_size=2,
                                       seq_len=8, max_new_tokens=4),
        capture=[1, 4], progress=False)


def test_linear_rope_is_written_under_both_keys(tmp_path, tgt):
  """transformers reads rope_scaling's rope_type, the official EAGLE-3 code its type."""
  rope = eagle3jax.RopeConfig(theta=10000.0, rope_type="linear", factor=2.0)
  cfg = eagle3jax.DrafterConfig.for_target(tgt.config, CaptureSpec((1, 3, 4)), rope=rope)
  eagle3jax.save_drafter(eagle3jax.init_drafter(cfg, target=tgt, seed=2), str(tmp_path))
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 2.0}
  assert eagle3jax.load_drafter(str(tmp_path), target=tgt).config.rope == rope


def test_missing_d2t_with_reduced_vocab_is_an_error(tmp_path, tgt):
  cfg = eagle3jax.DrafterConfig.for_target(tgt.config, h.CAPTURE, draft_vocab_size=40)
  eagle3jax.save_drafter(eagle3jax.init_drafter(cfg, target=tgt, d2t=np.zeros(40, int)),
                         str(tmp_path))
  f = str(tmp_path / "model.safetensors")
  st = SafetensorsFile(f)
  tensors = {n: np.array(st.get(n)) for n in st.names if n != "d2t"}
  del st
  safetensors.numpy.save_file(tensors, f)
  with pytest.raises(ValueError, match="missing weight 'd2t'.*cannot be mapped"):
    eagle3jax.load_drafter(str(tmp_path), target=tgt)


def test_draft_logits_shape_errors(tgt):
  dr = h.random_drafter(tgt)
  with pytest.raises(ValueError, match=r"aux_hidden has shape \(1, 3, 5\)"):
    eagle3jax.draft_logits(dr, np.array([[1, 2, 3]]), np.zeros((1, 3, 5), np.float32))


def test_drafter_tree_step_ignores_unwritten_window_slots(tgt):
  """A tree level writes k keys inside a wider window; the window's other slots (later
  levels, other branches) and everything beyond may hold NaN without effect."""
  import jax
  import jax.numpy as jnp
  dr = h.random_drafter(tgt)
  outs = []
  for fill in (0.0, np.nan):
    with jax.set_mesh(dr.mesh):
      cache = dr.allocate_cache(1, 32, fill=fill)
      a0, cache = dr(jnp.array([[5, 6, 7, 8]]), jnp.ones((1, 4, 64)), jnp.arange(4)[None],
                     cache)                                  # prefix: slots 0..3
      cache = cache.with_lengths(jnp.array([4]))
      window = np.zeros((1, 2, 6), bool)
      window[0, 0, 2] = window[0, 1, 3] = True               # this level's own slots only
      a, _ = dr(jnp.array([[9, 10]]), jnp.ones((1, 2, 64)), jnp.array([[4, 4]]), cache,
                jnp.asarray(window), write_at=jnp.array([6]))
    outs.append(np.asarray(a))
  assert np.isfinite(outs[1]).all()
  np.testing.assert_allclose(outs[1], outs[0], atol=1e-6)
