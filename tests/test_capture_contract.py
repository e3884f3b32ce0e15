"""The capture contract (eagle3jax.capture_contract): every silent case of issue 13 refused or
detected, and no false alarm for a correct pair on the meshes and dtypes the tests use."""

import dataclasses
import json
import os
import re
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eagle3jax
from eagle3jax import capture_contract as contract
from eagle3jax import monitor
from eagle3jax.drafter_io import config_from_hf
from eagle3jax.safetensors_io import SafetensorsFile
from tests import engine_helpers as H

TRAINED = H.CAPTURE  # (-1, 3, 6): the copy drafter reads the embedding capture
IDS = "eagle_aux_hidden_state_layer_ids"


@pytest.fixture(scope="module")
def target():
  return H.target()


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
  """A copy drafter saved with its capture record (and the embedding, by default)."""
  path = str(tmp_path_factory.mktemp("drafter"))
  eagle3jax.save_drafter(H.copy_drafter(target), path, target=target,
                         acceptance={"3,1,4": 3.5})
  return path


def _copy(saved, tmp_path, *, ids=None, convention="output", record=True):
  path = str(tmp_path / "d")
  shutil.copytree(saved, path)
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    cfg = json.load(f)
  if ids is not None:
    cfg["eagle_config"][IDS] = ids
  if convention is None:
    cfg["eagle_config"].pop("aux_layer_convention")
  else:
    cfg["eagle_config"]["aux_layer_convention"] = convention
  with open(cfg_path, "w") as f:
    json.dump(cfg, f)
  if not record:
    os.remove(os.path.join(path, contract.RECORD_FILE))
  return path


def _rewrite_tensor(path, name, fn):
  file = os.path.join(path, "model.safetensors")
  st = SafetensorsFile(file)
  tensors = {n: np.array(st.get(n)) for n in st.names}
  del st
  tensors[name] = fn(tensors[name])
  safetensors.numpy.save_file(tensors, file)


# --- the record ---------------------------------------------------------------------------

def test_save_writes_record_and_embedding(saved, target):
  with open(os.path.join(saved, contract.RECORD_FILE)) as f:
    rec = json.load(f)
  assert rec["capture"] == list(TRAINED.layer_ids) and rec["convention"] == "output"
  assert len(rec["calibration_ids"]) == contract.CALIBRATION_TOKENS
  assert rec["heldout_acceptance"] == {"3,1,4": 3.5}
  st = SafetensorsFile(os.path.join(saved, "model.safetensors"))
  np.testing.assert_array_equal(st.get("embed_tokens.weight"),
                                np.asarray(target.embed_tokens[...]))


def test_record_covers_the_lm_head(saved, target, tmp_path):
  """A target that differed from the drafter's only in its untied LM head passed the record
  (features, embedding and final norm all match) and decoded at acceptance 1."""
  rec = contract.read_record(saved)
  assert np.asarray(rec.lm_head).shape == (contract.CALIBRATION_TOKENS, contract.PROJECTION_DIM)
  other = H.target()
  other.lm_head.set_value(other.lm_head[...][:, ::-1])  # another head, all else the same
  with pytest.raises(ValueError, match=r"was not trained on this target: its record .* does "
                                       r"not match this target .*LM head [1-9]"):
    eagle3jax.load_drafter(saved, target=other)
  # A record written before the head was recorded still loads (its head is not checked).
  old = _copy(saved, tmp_path)
  file = os.path.join(old, contract.RECORD_FILE)
  with open(file) as f:
    data = json.load(f)
  del data["target_fingerprint"]["lm_head"]
  with open(file, "w") as f:
    json.dump(data, f)
  assert "verified" in eagle3jax.load_drafter(old, target=target).capture_explanation


def test_save_checks_the_acceptance_before_writing_anything(saved, target, tmp_path):
  path = tmp_path / "d"
  shutil.copytree(saved, path)
  before = {f: (path / f).read_bytes() for f in os.listdir(path)}
  dr = eagle3jax.load_drafter(str(path), target=target)
  for bad in ({"3,1,4": 5.0}, {"3,1,4": True}, {"0,1,2": 1.0}):
    with pytest.raises(ValueError, match=r"heldout_acceptance .*from 1 to steps \+ 1"):
      eagle3jax.save_drafter(dr, str(path), target=target, acceptance=bad)
    assert {f: (path / f).read_bytes() for f in os.listdir(path)} == before


def test_probe_warns_when_no_reading_predicts_the_target(target, tmp_path):
  """Without a record, a drafter of another target (here: an untrained one) loaded without a
  word; the probe now warns when it agrees with the target's tokens under no reading."""
  path = str(tmp_path / "random")
  eagle3jax.save_drafter(H.random_drafter(target), path)  # no target=: no record
  assert contract.read_record(path) is None
  with pytest.warns(contract.CaptureWarning, match=r"predicts the target's next token at most "
                                                   r"0\.\d\d of the time"):
    dr = eagle3jax.load_drafter(path, target=target)
  assert "probed top-1 agreement" in dr.capture_explanation
  # ... and a drafter loaded without any check cannot be saved with a record vouching for it.
  unchecked = eagle3jax.load_drafter(path, target=target, verify_capture=False)
  with pytest.raises(ValueError, match=r"no capture record and was loaded with "
                                       r"verify_capture=False: a record written now would vouch "
                                       r"for a capture nobody checked"):
    eagle3jax.save_drafter(unchecked, str(tmp_path / "laundered"), target=target)
  eagle3jax.save_drafter(unchecked, str(tmp_path / "plain"))  # no record: allowed
  assert contract.read_record(str(tmp_path / "plain")) is None


@pytest.mark.parametrize("dtype,mesh", [(jnp.float32, (1, 1)), (jnp.bfloat16, (2, 4))])
def test_correct_pair_loads_silently_on_any_mesh_and_dtype(saved, dtype, mesh):
  tgt = eagle3jax.init_target(H.CFG, mesh=eagle3jax.make_mesh(*mesh), seed=0, std=0.1,
                              dtype=dtype)
  dr = eagle3jax.load_drafter(saved, target=tgt)
  assert "capture record verified" in dr.capture_explanation
  assert dr.config.capture == TRAINED
  assert not dr.own_embedding and dr.embed_tokens is tgt.embed_tokens  # shared, not copied


def test_seed_rewrite_is_refused_naming_the_trained_layers(saved, target, tmp_path):
  # The seed's bug: the embedding added to the list, the last layer dropped.
  path = _copy(saved, tmp_path, ids=[-1, 1, 3])
  with pytest.raises(ValueError, match=r"configured to capture target layers \[-1, 1, 3\].*"
                                       r"those of layers \[-1, 3, 6\]"):
    eagle3jax.load_drafter(path, target=target)
  # verify_capture=False is the escape hatch for users who know better.
  dr = eagle3jax.load_drafter(path, target=target, verify_capture=False)
  assert dr.config.capture.layer_ids == (-1, 1, 3)


def test_wrong_convention_is_refused_and_auto_is_settled_by_the_record(saved, target,
                                                                       tmp_path):
  # Trained outputs [-1, 3, 6] are inputs [0, 4, 7]; recorded as outputs they are wrong.
  wrong = _copy(saved, tmp_path, ids=[0, 4, 7], convention="output")
  with pytest.raises(ValueError, match=r"those of layers \[-1, 3, 6\]"):
    eagle3jax.load_drafter(wrong, target=target)
  shutil.rmtree(wrong)
  ambiguous = _copy(saved, tmp_path, ids=[0, 4, 7], convention=None)
  dr = eagle3jax.load_drafter(ambiguous, target=target, aux_layer_convention="auto")
  assert dr.config.capture == TRAINED and "settled by the capture record" in \
      dr.capture_explanation
  with pytest.raises(ValueError, match=r"those of layers \[-1, 3, 6\]"):
    eagle3jax.load_drafter(ambiguous, target=target, aux_layer_convention="output")
  # "auto" with the check off is refused only where two readings fit: here only 'input' does
  # (layer 8 is past this 8-layer target), so there is nothing to measure and it loads.
  single = _copy(saved, tmp_path / "single", ids=[2, 5, 8], convention=None)
  dr = eagle3jax.load_drafter(single, target=target, aux_layer_convention="auto",
                              verify_capture=False)
  assert dr.config.capture.layer_ids == (1, 4, 7)


def test_other_target_of_the_same_shape_is_refused(saved):
  other = eagle3jax.init_target(H.CFG, seed=7, std=0.1)
  with pytest.raises(ValueError, match="was not trained on this target"):
    eagle3jax.load_drafter(saved, target=other)


def test_record_from_a_larger_vocabulary_is_named(saved, target, tmp_path):
  path = _copy(saved, tmp_path)
  file = os.path.join(path, contract.RECORD_FILE)
  with open(file) as f:
    rec = json.load(f)
  rec["calibration_ids"][2] = target.config.vocab_size + 40
  with open(file, "w") as f:
    json.dump(rec, f)
  with pytest.raises(ValueError, match=r"calibration tokens go up to id 171, beyond this "
                                       r"target's vocab_size=131"):
    eagle3jax.load_drafter(path, target=target)


def test_corrupt_record_is_named(saved, target, tmp_path):
  path = _copy(saved, tmp_path)
  file = os.path.join(path, contract.RECORD_FILE)
  with open(file) as f:
    good = json.load(f)
  feats = good["features"]
  nan_feat = {**feats, "6": [[float("nan")] + r[1:] for r in feats["6"]]}
  fp = good["target_fingerprint"]
  for bad, why in (({"version": 1, "capture": [1]}, "missing field 'calibration_ids'"), ([], "not a JSON object"),
                   ({**good, "heldout_acceptance": "x"}, "heldout_acceptance is not a JSON "
                                                          "object"),
                   ({**good, "calibration_ids": good["calibration_ids"][:2]}, "at least 4"),
                   ({**good, "calibration_ids": [-3] + good["calibration_ids"][1:]},
                    "below 0"),
                   # One NaN used to drop out of max() and switch the capture's check off.
                   ({**good, "features": nan_feat}, "features of capture 6 holds NaN"),
                   ({**good, "calibration_ids": [1e400] + good["calibration_ids"][1:]},
                    "not an integer"),
                   ({**good, "projection_seed": -1}, "below 0"),
                   ({**good, "projection_dim": 8}, "projection_dim 8"),
                   ({**good, "convention": "input"}, "convention 'input'"),
                   ({**good, "capture": [6, 3, -1]}, "ascending"),
                   ({**good, "heldout_acceptance": {"3,1,4": "4.5"}}, "from 1 to steps"),
                   ({**good, "heldout_acceptance": {"nonsense": 2.0}}, "'steps,topk,tokens'"),
                   ({**good, "heldout_acceptance": {"3,1,4": 0.5}}, "from 1 to steps"),
                   # Past steps + 1 (a round's most) made the monitor warn on a correct pair.
                   ({**good, "heldout_acceptance": {"3,1,4": 5.0}}, "from 1 to steps \\+ 1"),
                   ({**good, "heldout_acceptance": {"0,0,0": 1.0}}, "steps and topk >= 1"),
                   ({**good, "features": {**feats, "6": [[str(x) for x in r]
                                                         for r in feats["6"]]}},
                    "holds str"),
                   ({**good, "features": {**feats, "6": [r[:8] for r in feats["6"]]}},
                    r"features of capture 6 has shape \[32, 8\]"),
                   ({**good,
                     "target_fingerprint": {**fp, "final_norm": fp["final_norm"][:8]}},
                    "final_norm has shape"),
                   ({**good, "target_layers": 6}, "beyond its target_layers=6")):
    with open(file, "w") as f:
      json.dump(bad, f)
    with pytest.raises(ValueError, match="not a valid eagle3jax capture record") as e:
      eagle3jax.load_drafter(path, target=target)
    assert e.match(why), (why, str(e.value))
  with open(file, "w") as f:
    f.write("[" * 100000 + "]" * 100000)
  with pytest.raises(ValueError, match="is not valid JSON"):
    eagle3jax.load_drafter(path, target=target)


def test_ids_given_twice_must_agree(saved, target, tmp_path):
  path = _copy(saved, tmp_path)
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    cfg = json.load(f)
  with open(cfg_path, "w") as f:
    json.dump({**cfg, IDS: [0, 4, 7], "aux_layer_convention": "input"}, f)
  with pytest.raises(ValueError, match=r"gives eagle_aux_hidden_state_layer_ids twice, "
                                       r"\[-1, 3, 6\] in eagle_config and \[0, 4, 7\]"):
    eagle3jax.load_drafter(path, target=target)


def test_a_neighbouring_layer_that_barely_changes_is_not_waved_through(target, tmp_path):
  """Layer 6's update scaled by 0.05: the record of [-1, 3, 6] is within FAST_TOL of layer 5
  too (0.015), but layer 6 matches far better (0.0), so config [-1, 3, 5] is refused by name.
  (At 1e-3 the two layers' features agree to 0.0003 and either may serve.)"""
  from flax import nnx
  model = H.target()
  graphdef, state = nnx.split(model)
  flat = dict(nnx.to_flat_state(state))
  for path, var in flat.items():
    if any(k in path for k in ("o_proj", "down_proj")):
      arr = var[...]
      var[...] = arr.at[6].multiply(0.05)
  quiet = nnx.merge(graphdef, nnx.from_flat_state(flat))
  path = str(tmp_path / "d")
  eagle3jax.save_drafter(H.copy_drafter(quiet), path, target=quiet)
  with open(os.path.join(path, "config.json")) as f:
    cfg = json.load(f)
  cfg["eagle_config"][IDS] = [-1, 3, 5]
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  rec = contract.read_record(path)
  fast = contract.compare_record(rec, quiet, [4, 5, 6])
  assert fast.errors[2][5] <= contract.FAST_TOL  # the old fast path passed this
  with pytest.raises(ValueError, match=r"are those of layers \[-1, 3, 6\]"):
    eagle3jax.load_drafter(path, target=quiet)


def test_a_target_with_nan_hidden_states_is_named(saved):
  from flax import nnx
  model = H.target()
  graphdef, state = nnx.split(model)
  flat = dict(nnx.to_flat_state(state))
  for path, var in flat.items():
    if "down_proj" in path:
      var[...] = var[...].at[5].set(jnp.nan)
  broken = nnx.merge(graphdef, nnx.from_flat_state(flat))
  with pytest.raises(ValueError, match=r"hidden states at layers \[5, 6, 7\] .* hold NaN"):
    eagle3jax.load_drafter(saved, target=broken)


def test_generate_checks_the_drafter_against_the_target_it_is_given(saved, target):
  """A drafter checked for one target and served with another of the same shapes, or with
  its capture changed after loading, is refused by generate (it used to run silently)."""
  dr = eagle3jax.load_drafter(saved, target=target)
  kw = dict(max_new_tokens=4, num_steps=3, eos_ids=[])
  eagle3jax.generate(target, dr, [[5, 6, 7]], **kw)
  other = eagle3jax.init_target(H.CFG, seed=7, std=0.1)
  with pytest.raises(ValueError, match="shares the token embedding of another target"):
    eagle3jax.generate(other, dr, [[5, 6, 7]], **kw)
  dr.config = dataclasses.replace(dr.config, capture=eagle3jax.CaptureSpec((-1, 3, 5)))
  with pytest.raises(ValueError, match=r"configured to capture target layers \[-1, 3, 5\]"):
      eagle3jax.generate(target, dr, [[5, 6, 7]], **kw)
  dr.config = dataclasses.replace(dr.config, capture=TRAINED)
  eagle3jax.generate(target, dr, [[5, 6, 7]], **kw)  # put right, it serves again


def test_generate_notices_replaced_weights_copies_and_recordless_capture_changes(saved):
  from flax import nnx
  mine = H.target()
  dr = eagle3jax.load_drafter(saved, target=mine)
  kw = dict(max_new_tokens=4, num_steps=3, eos_ids=[])
  eagle3jax.generate(mine, dr, [[5, 6, 7]], **kw)
  # The same target object with another target's weights put in: checked again, refused.
  nnx.update(mine, nnx.state(eagle3jax.init_target(H.CFG, seed=7, std=0.1)))
  with pytest.raises(ValueError, match="was not trained on this target"):
    eagle3jax.generate(mine, dr, [[5, 6, 7]], **kw)
  # An opt-out survives a copy of the drafter (it is an attribute, not a side table).
  skip = eagle3jax.load_drafter(saved, target=mine, verify_capture=False)
  eagle3jax.generate(mine, nnx.clone(skip), [[5, 6, 7]], **kw)
  # No record: a capture changed after initialisation cannot be checked, so it is refused,
  # in generate and in a save that would write a record for it.
  fresh = H.target()
  plain = H.random_drafter(fresh)
  plain.config = dataclasses.replace(plain.config, capture=eagle3jax.CaptureSpec((-1, 3, 5)))
  with pytest.raises(ValueError, match=r"no capture record, and its capture was changed to "
                                       r"\[-1, 3, 5\]"):
    eagle3jax.generate(fresh, plain, [[5, 6, 7]], **kw)
  with pytest.raises(ValueError, match="the drafter being saved has no capture record"):
    eagle3jax.save_drafter(plain, "/nonexistent/never-written", target=fresh)


def test_save_never_launders_a_record(saved, target, tmp_path):
  """A new record is taken only after the old one is checked against the target and capture
  it is about to vouch for, and a record that disagrees with the config is not dropped."""
  other = eagle3jax.init_target(H.CFG, seed=7, std=0.1)
  own = eagle3jax.load_drafter(saved, target=other, verify_capture=False)
  with pytest.raises(ValueError, match="the drafter being saved was not trained on this target"):
    eagle3jax.save_drafter(own, str(tmp_path / "a"), target=other)
  dr = eagle3jax.load_drafter(_copy(saved, tmp_path, ids=[-1, 3, 5]), target=target,
                              verify_capture=False)
  with pytest.raises(ValueError, match=r"configured to capture target layers \[-1, 3, 5\]"):
    eagle3jax.save_drafter(dr, str(tmp_path / "b"), target=target)
  with pytest.raises(ValueError, match=r"trained on target layers \[-1, 3, 6\], but its "
                                       r"config captures \[-1, 3, 5\]"):
    eagle3jax.save_drafter(dr, str(tmp_path / "c"))
  # The same drafter with its capture put right saves, and its record carries over.
  dr.config = dataclasses.replace(dr.config, capture=TRAINED)
  eagle3jax.save_drafter(dr, str(tmp_path / "d"))
  assert contract.read_record(str(tmp_path / "d")).capture == TRAINED.layer_ids


def test_a_record_is_written_only_for_a_pairing_that_was_checked(target, tmp_path):
  """A drafter without a record gets one from save_drafter(target=X) only if it was
  initialised for X, loaded for X with its probe agreeing, or agrees with X when probed at
  the save: a drafter checked on one target and saved for another, or one whose probe
  warned, used to get a record that then vouched for the wrong pairing on every later
  load."""
  from flax import nnx
  other = eagle3jax.init_target(H.CFG, seed=7, std=0.1)  # same shapes, other weights
  for_target = str(tmp_path / "for_target")
  eagle3jax.save_drafter(H.copy_drafter(target), for_target)  # no record
  probed = eagle3jax.load_drafter(for_target, target=target)  # probe agrees
  refused = (r"no capture record and was not initialised or loaded for this target; probed "
             r"on it now, it predicts the target's next token 0\.\d\d of the time")
  with pytest.raises(ValueError, match=refused):
    eagle3jax.save_drafter(probed, str(tmp_path / "a"), target=other)
  eagle3jax.save_drafter(probed, str(tmp_path / "b"), target=target)  # the checked pairing
  assert contract.read_record(str(tmp_path / "b")).capture == TRAINED.layer_ids
  for_other = str(tmp_path / "for_other")
  eagle3jax.save_drafter(H.copy_drafter(other), for_other)
  with pytest.warns(contract.CaptureWarning):
    warned = eagle3jax.load_drafter(for_other, target=target)
  with pytest.raises(ValueError, match=refused):
    eagle3jax.save_drafter(warned, str(tmp_path / "c"), target=target)
  with pytest.raises(ValueError, match=refused):  # a copy starts unchecked: probed, refused
    eagle3jax.save_drafter(nnx.clone(warned), str(tmp_path / "d"), target=target)
  assert not any(os.path.exists(tmp_path / n) for n in "acd")
  # A copy of a drafter that does agree is probed at the save and gets its record.
  eagle3jax.save_drafter(nnx.clone(probed), str(tmp_path / "e"), target=target)
  assert eagle3jax.load_drafter(str(tmp_path / "e"), target=target).capture_record


def test_the_pairing_a_drafter_was_created_for_outlives_serving_it_elsewhere(target, tmp_path):
  """Of the last 4 targets remembered per drafter, the ones served only go first: a random
  drafter initialised for its target (which no probe would vouch for) still saves with a
  record for it after being served with 4 other target objects."""
  mine = H.target()
  dr = H.random_drafter(mine)
  for t in [H.target() for _ in range(4)] + [mine]:
    eagle3jax.generate(t, dr, [[5, 6, 7]], max_new_tokens=4, num_steps=3, eos_ids=[])
  eagle3jax.save_drafter(dr, str(tmp_path / "d"), target=mine)
  assert contract.read_record(str(tmp_path / "d")).capture == dr.config.capture.layer_ids


def test_copies_of_a_recordless_drafter_keep_its_capture(target, tmp_path):
  """The capture a drafter without a record was loaded with is an attribute, so a copy
  (nnx.clone, split/merge) with its capture changed is refused like the original."""
  from flax import nnx
  path = str(tmp_path / "norecord")
  eagle3jax.save_drafter(H.copy_drafter(target), path)
  loaded = eagle3jax.load_drafter(path, target=target)
  changed = "no capture record, and its capture was changed to \\[-1, 3, 5\\]"
  for copy in (nnx.clone(loaded), nnx.merge(*nnx.split(loaded))):
    copy.config = dataclasses.replace(copy.config, capture=eagle3jax.CaptureSpec((-1, 3, 5)))
    with pytest.raises(ValueError, match=changed):
      eagle3jax.generate(target, copy, [[5, 6, 7]], max_new_tokens=4, num_steps=3, eos_ids=[])
    with pytest.raises(ValueError, match=changed):
      eagle3jax.save_drafter(copy, str(tmp_path / "wrong"), target=target)
  assert not os.path.exists(tmp_path / "wrong")


def test_save_stores_in_the_dtype_asked_and_digests_what_it_stored(target, tmp_path):
  import ml_dtypes
  path = str(tmp_path / "bf16")
  eagle3jax.save_drafter(H.copy_drafter(target), path, target=target, dtype=ml_dtypes.bfloat16)
  st = SafetensorsFile(os.path.join(path, "model.safetensors"))
  kinds = {n: np.asarray(st.get(n)).dtype for n in st.names}
  assert kinds.pop("d2t") == np.int64 and kinds.pop("t2d") == np.bool_
  assert set(kinds.values()) == {np.dtype(ml_dtypes.bfloat16)}
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  loaded = eagle3jax.load_drafter(path, target=target)  # the digest is of the bf16 bytes
  assert loaded.capture_record.weights and loaded.dtype == target.dtype
  with pytest.raises(ValueError, match="dtype"):
    eagle3jax.save_drafter(loaded, str(tmp_path / "x"), dtype=np.int8)


def test_a_record_beside_other_weights_is_refused(saved, target, tmp_path):
  """The record holds a digest of the weights it was written with: a folder whose safetensors
  another tool wrote over keeps a record that vouches for weights it never saw."""
  record = contract.read_record(saved)
  assert re.fullmatch(r"[0-9a-f]{64}", record.weights)
  other = eagle3jax.init_target(H.CFG, seed=7, std=0.1)
  elsewhere = str(tmp_path / "elsewhere")
  eagle3jax.save_drafter(H.copy_drafter(other), elsewhere)
  path = _copy(saved, tmp_path)
  shutil.copy(os.path.join(elsewhere, "model.safetensors"), path)
  with pytest.raises(ValueError, match=r"its capture record \(eagle3jax_record.json\) was "
                                       r"written with other weights .*Delete "
                                       r"eagle3jax_record.json"):
    eagle3jax.load_drafter(path, target=target)
  # One weight changed in place is enough; the shared embedding is not part of the digest.
  path = _copy(saved, tmp_path / "x")
  _rewrite_tensor(path, "norm.weight", lambda w: w * 1.5)
  with pytest.raises(ValueError, match="written with other weights"):
    eagle3jax.load_drafter(path, target=target)
  path = _copy(saved, tmp_path / "y")
  _rewrite_tensor(path, "embed_tokens.weight", lambda w: w)  # rewritten, same values
  eagle3jax.load_drafter(path, target=target)
  # A drafter's own embedding is one of its weights: it is in the digest.
  own = str(tmp_path / "own")
  eagle3jax.save_drafter(H.copy_drafter(target), own, target=target)
  _rewrite_tensor(own, "embed_tokens.weight", lambda w: w + 0.5)
  with pytest.raises(ValueError, match=r"record was written with the target's token "
                                       r"embedding \(shared\), but the file's "
                                       r"embed_tokens.weight is not this target's table"):
    eagle3jax.load_drafter(own, target=target)  # the shared table, edited
  os.remove(os.path.join(own, contract.RECORD_FILE))
  owned = eagle3jax.load_drafter(own, target=target)
  assert owned.own_embedding
  eagle3jax.save_drafter(owned, own, target=target)  # probed at the save: it agrees
  eagle3jax.load_drafter(own, target=target)
  _rewrite_tensor(own, "embed_tokens.weight", lambda w: w * 0.5)
  with pytest.raises(ValueError, match="written with other weights"):
    eagle3jax.load_drafter(own, target=target)
  # A record of an older version, without the digest, still loads (and says so in the log).
  path = _copy(saved, tmp_path / "z")
  with open(os.path.join(path, contract.RECORD_FILE)) as f:
    old = json.load(f)
  del old["weights_digest"]
  with open(os.path.join(path, contract.RECORD_FILE), "w") as f:
    json.dump(old, f)
  assert not contract.read_record(path).weights
  eagle3jax.load_drafter(path, target=target)


# --- the probe (drafters without a record) ------------------------------------------------

def test_probe_resolves_auto_and_refuses_a_list_far_below_another(saved, target, tmp_path):
  ambiguous = _copy(saved, tmp_path, ids=[0, 4, 7], convention=None, record=False)
  dr = eagle3jax.load_drafter(ambiguous, target=target, aux_layer_convention="auto")
  assert dr.config.capture == TRAINED and "(probed)" in dr.capture_explanation
  with pytest.raises(ValueError, match=r"configured target layers \[0, 4, 7\] \('output' "
                                       r"reading\) give top-1 agreement 0\.\d\d.*"
                                       r"\[-1, 3, 6\] \('input'\) give 0\.\d\d"):
    eagle3jax.load_drafter(ambiguous, target=target, aux_layer_convention="output")
  right = eagle3jax.load_drafter(ambiguous, target=target, aux_layer_convention="input")
  assert right.config.capture == TRAINED and "probed top-1 agreement" in \
      right.capture_explanation
  # "auto" without the probe used to load the 'output' reading silently.
  with pytest.raises(ValueError, match=r"aux_layer_convention='auto' measures which reading "
                                       r".*verify_capture=False skips that measurement"):
    eagle3jax.load_drafter(ambiguous, target=target, aux_layer_convention="auto",
                           verify_capture=False)


# --- the live monitor ---------------------------------------------------------------------

def test_monitor_reports_recorded_and_warns_once_when_far_below(saved, target, monkeypatch):
  dr = eagle3jax.load_drafter(saved, target=target)
  # As if this drafter had reached 9.0 on held-out data: live acceptance is far below. And as
  # if it had been trained on 16 positions: decoding to position 34 warns naming the field.
  dr.capture_record = dr.capture_record.with_acceptance({"3,1,4": 9.0})
  dr.config = dataclasses.replace(dr.config, max_position_embeddings=16)
  monkeypatch.setattr(monitor, "MIN_ROUNDS", 4)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    res = eagle3jax.generate(target, dr, [[5, 6, 7, 8, 9, 10, 3]], max_new_tokens=24,
                             num_steps=3, topk=1, eos_ids=[])
  assert res.stats["accept_length_recorded"] == 9.0 and res.stats["rounds"] >= 4
  far = [w for w in caught if issubclass(w.category, monitor.AcceptanceWarning)]
  assert len(far) == 1 and "far below the 9.00" in str(far[0].message)
  assert sum("max_position_embeddings=16" in str(w.message) for w in caught) == 1
  monkeypatch.setattr(monitor, "MIN_ROUNDS", 32)
  dr.capture_record = dr.capture_record.with_acceptance({"3,1,4": 3.5})
  # The same check on stats alone: far below over enough rounds warns exactly once.
  stats = {"accept_length_mean": 1.2, "rounds": 40}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    monitor.compare(stats, dr, 3, 1, 4, greedy=True)
    monitor.compare({"accept_length_mean": 3.4, "rounds": 40}, dr, 3, 1, 4, greedy=True)
    monitor.compare({"accept_length_mean": 1.2, "rounds": 5}, dr, 3, 1, 4, greedy=True)
  assert len(caught) == 1 and "far below the 3.50" in str(caught[0].message)
  assert stats["accept_length_recorded"] == 3.5
  # Measuring the acceptance (what writes the record) does not warn about the old record,
  # and warnings the caller had on stay on after it.
  dr.capture_record = dr.capture_record.with_acceptance({"3,1,4": 9.0})
  monkeypatch.setattr(monitor, "MIN_ROUNDS", 4)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tau = monitor.measure_acceptance(target, dr, [[5, 6, 7, 8, 9, 10, 3]], ((3, 1, 4),),
                                     max_new_tokens=24, eos_ids=[])
    monitor.compare({"accept_length_mean": 1.2, "rounds": 40}, dr, 3, 1, 4, greedy=True)
  assert tau["3,1,4"] - 1 < monitor.FAR_BELOW * (9.0 - 1)  # so generate alone would warn
  far = [w for w in caught if issubclass(w.category, monitor.AcceptanceWarning)]
  assert len(far) == 1 and "length 1.20 over 40 rounds" in str(far[0].message)


# --- checkpoint hygiene -------------------------------------------------------------------

def _hf(**extra):
  base = {"hidden_size": 64, "intermediate_size": 88, "num_attention_heads": 8,
          "num_key_value_heads": 2, "vocab_size": 131}
  base.update(extra)
  return base


@pytest.mark.parametrize("extra,match", [
    ({"some_new_field": 1}, r"fields eagle3jax does not implement: \['some_new_field'\]"),
    ({"norm_before_residual": True}, "norm_before_residual=True"),
    ({"num_hidden_layers": 2, "draft_vocab_size": 131},
     r"num_hidden_layers=2 \(an EAGLE-3 drafter here is one decoder layer"),
    # A target's folder passed as the drafter: said as such (it was "num_hidden_layers=12 ...
    # not implement").
    ({"num_hidden_layers": 12}, r"looks like a target model's \(num_hidden_layers=12 and none "
                                r"of \['draft_vocab_size', 'eagle_config', 'target_hidden_size'\]"),
    ({"sliding_window": 128, "use_sliding_window": True}, "sliding_window"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"eagle_config": {"unknown_key": 1}}, r"eagle_config\.unknown_key"),
])
def test_drafter_config_refuses_what_it_does_not_implement(extra, match):
  with pytest.raises(ValueError, match=match):
    config_from_hf(_hf(**extra), TRAINED)


def test_published_drafter_configs_parse():
  root = os.path.join(os.path.dirname(__file__), "..", "configs")
  for name in sorted(os.listdir(root)):
    if name.endswith("-eagle3.json"):
      with open(os.path.join(root, name)) as f:
        config_from_hf(json.load(f), eagle3jax.CaptureSpec((1, 2, 3)))


@pytest.mark.parametrize("name,fn,match", [
    ("d2t", lambda d: d + 1000, "outside"),
    ("d2t", lambda d: (np.arange(len(d))[::-1] + d[::-1]) - np.arange(len(d)), "increasingly"),
    ("t2d", lambda t: ~t, "does not agree with d2t"),
    ("midlayer.mlp.up_proj.weight", lambda w: np.where(np.arange(w.size).reshape(w.shape) == 5,
                                                       np.nan, w).astype(w.dtype),
     r"'midlayer.mlp.up_proj.weight' holds 1 NaN"),
    ("fc.weight", lambda w: np.full_like(w, np.inf), r"'fc.weight' holds 0 NaN and \d+ Inf"),
])
def test_bad_drafter_tensors_are_refused_by_name(saved, target, tmp_path, name, fn, match):
  path = _copy(saved, tmp_path)
  _rewrite_tensor(path, name, fn)
  with pytest.raises(ValueError, match=match):
    eagle3jax.load_drafter(path, target=target)


def test_target_nan_weight_and_truncated_file_are_named(target, tmp_path):
  from eagle3jax.hf_export import save_target
  path = str(tmp_path / "t")
  save_target(target, path)
  _rewrite_tensor(path, "model.layers.2.mlp.up_proj.weight",
                  lambda w: np.where(np.arange(w.size).reshape(w.shape) == 0, np.inf,
                                     w).astype(w.dtype))
  with pytest.raises(ValueError, match=r"'model.layers.2.mlp.up_proj.weight' holds 0 NaN "
                                       r"and 1 Inf"):
    eagle3jax.load_target(path)
  file = os.path.join(path, "model.safetensors")
  with open(file, "r+b") as f:
    f.truncate(os.path.getsize(file) - 100)
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor '[\w.]+' needs bytes .* "
                                       r"\(truncated"):
    eagle3jax.load_target(path)


def test_drafter_on_another_mesh_gets_a_clear_message(saved, target):
  other = eagle3jax.make_mesh(2, 4)
  with pytest.raises(ValueError, match="not the target's mesh"):
    eagle3jax.load_drafter(saved, target=target, mesh=other)
  dr = eagle3jax.load_drafter(saved, target=target)
  moved = eagle3jax.init_target(H.CFG, mesh=other, seed=0, std=0.1)
  with pytest.raises(ValueError, match="not the target's mesh"):
    eagle3jax.generate(moved, dr, [[3, 4]], max_new_tokens=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=float("nan")), "temperature=nan must be a finite number"),
    (dict(prompts=[[3.7, 4.2]]), "must hold integer token ids"),
    (dict(eos_ids=[131]), r"eos_ids=\[131\] must be token ids in \[0, vocab_size=131\)"),
    # Values that used to be coerced silently, or to fail deep inside JAX.
    (dict(top_k=2.5, temperature=1.0), r"top_k=2.5 must be an integer"),
    (dict(eos_ids=[2.5]), r"eos_ids\[0\]=2.5 must be an integer"),
    (dict(eos_ids="51"), r"eos_ids='51' must be a list of token ids"),
    (dict(eos_ids=2), r"eos_ids=2 must be a list of token ids"),
    (dict(max_new_tokens=True), r"max_new_tokens=True must be an integer"),
    (dict(max_new_tokens=10**11), r"max_new_tokens=100000000000 leaves no room for a prompt"),
    (dict(num_steps=2.0), r"num_steps=2.0 must be an integer"),
    (dict(topk=2, num_steps=2, num_draft_tokens=4.0), r"num_draft_tokens=4.0 must be an integer"),
    (dict(seed=2**32), r"seed=4294967296 must be in \[-2\*\*31, 2\*\*32\)"),
    (dict(seed=None), r"seed=None must be an integer"),
    (dict(temperature=None), r"temperature=None must be a number"),
    (dict(temperature="0.7"), r"temperature='0.7' must be a number"),
    (dict(top_p=None), r"top_p=None must be a number"),
    (dict(on_tokens=5), r"on_tokens must be a function"),
    (dict(capture=3), r"capture=3 must be a CaptureSpec or a list of layer ids"),
    (dict(attention_impl="pallas"), r"attention_impl='pallas' compiles the Pallas kernel for "
                                    r"GPUs; this target is on cpu"),
    (dict(prompts=[3, 4]), r"prompts is a flat list of 2 token ids; pass a list of prompts"),
    (dict(prompts=np.array([3, 4])), r"prompts given as an array must be \[B, T\]"),
    (dict(prompts=[[[3, 4]]]), r"prompts\[0\] must be a flat list of token ids"),
    (dict(capture=[-1, 3, 99]), r"ids \[99\] are out of range for a target with 8 layers"),
])
def test_generate_refuses_bad_values(saved, target, kwargs, match):
  dr = eagle3jax.load_drafter(saved, target=target, verify_capture=False)
  args = dict(prompts=[[3, 4]], max_new_tokens=2)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    eagle3jax.generate(target, dr, args.pop("prompts"), **args)


def test_generate_names_swapped_or_wrong_models(saved, target):
  dr = eagle3jax.load_drafter(saved, target=target, verify_capture=False)
  for args, match in [((dr, target), "got the drafter first: pass the target model first"),
                      ((dr, None), "target must be a target model .* got an EAGLE-3 drafter"),
                      (("models/default", None), "target must be a target model .* got a str"),
                      ((target, target), "drafter must be an EAGLE-3 drafter .* got a target "
                                         "model")]:
    with pytest.raises(ValueError, match=match):
      eagle3jax.generate(*args, [[3, 4]], max_new_tokens=2)


def test_draft_vocab_size_zero_is_refused(saved, target, tmp_path):
  # It used to become the full vocabulary silently (``draft_vocab_size or vocab_size``), in
  # code and in a config.json alike.
  with pytest.raises(ValueError, match="draft_vocab_size=0 must be a positive integer"):
    eagle3jax.DrafterConfig.for_target(target.config, TRAINED, draft_vocab_size=0)
  assert eagle3jax.DrafterConfig.for_target(target.config, TRAINED).draft_vocab_size == 131
  path = _copy(saved, tmp_path)
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    cfg = json.load(f)
  cfg["draft_vocab_size"] = 0
  with open(cfg_path, "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError, match="draft_vocab_size=0 must be a positive integer"):
    eagle3jax.load_drafter(path, target=target)


def test_generate_refuses_a_prng_key_as_seed(saved, target):
  import jax
  dr = eagle3jax.load_drafter(saved, target=target, verify_capture=False)
  with pytest.raises(ValueError, match="seed must be an integer, not a PRNG key"):
    eagle3jax.generate(target, dr, [[3, 4]], max_new_tokens=2, temperature=1.0,
                       seed=jax.random.key(0))


def test_generate_refuses_a_drafter_of_another_vocabulary(target):
  # generate itself checks the pair (not only load_drafter): a drafter built for another
  # vocabulary would run, exactly but uselessly slowly.
  other = eagle3jax.init_target(dataclasses.replace(H.CFG, vocab_size=97), seed=3)
  with pytest.raises(ValueError, match="drafter vocab_size=131 differs from the target's "
                                       "vocab_size=97"):
    eagle3jax.generate(other, H.random_drafter(target), [[3, 4]], max_new_tokens=2)


def test_generate_takes_arrays_and_jax_scalars(saved, target):
  import jax.numpy as jnp
  dr = eagle3jax.load_drafter(saved, target=target, verify_capture=False)
  ref = eagle3jax.generate(target, dr, [[3, 4, 5]], max_new_tokens=4).tokens
  for prompts in (np.array([[3, 4, 5]]), jnp.array([[3, 4, 5]]), [jnp.array([3, 4, 5])]):
    assert eagle3jax.generate(target, dr, prompts, max_new_tokens=4).tokens == ref
  assert eagle3jax.generate(target, dr, [[3, 4, 5]], max_new_tokens=jnp.int32(4),
                            temperature=jnp.float32(0.0), seed=np.int64(1)).tokens == ref
  # EOS ids as a set or an array, negative seeds (JAX's keys take them): as before.
  for eos in ({2}, np.array([2]), jnp.array([2])):
    eagle3jax.generate(target, dr, [[3, 4, 5]], max_new_tokens=4, eos_ids=eos)
  sampled = dict(max_new_tokens=4, temperature=1.0)
  assert (eagle3jax.generate(target, dr, [[3, 4, 5]], seed=np.int64(1), **sampled).tokens
          == eagle3jax.generate(target, dr, [[3, 4, 5]], seed=1, **sampled).tokens)
  assert (eagle3jax.generate(target, dr, [[3, 4, 5]], seed=-1, **sampled).tokens
          == eagle3jax.generate(target, dr, [[3, 4, 5]], seed=2**32 - 1, **sampled).tokens)


def test_include_embedding_false_leaves_it_out(target, tmp_path):
  dr = H.random_drafter(target)
  path = str(tmp_path / "noemb")
  eagle3jax.save_drafter(dr, path, include_embedding=False)
  assert "embed_tokens.weight" not in SafetensorsFile(
      os.path.join(path, "model.safetensors")).names
  assert not os.path.exists(os.path.join(path, contract.RECORD_FILE))  # no target given
  loaded = eagle3jax.load_drafter(path, target=target, verify_capture=False)
  assert loaded.embed_tokens is target.embed_tokens


def test_shipped_pair_passes_on_a_weight_only_int4_target():
  # Every layer matrix of the shipped target rounded to symmetric INT4 in groups of 32 (as a
  # weight-only quantised checkpoint computes): within the documented tolerance.
  import jax
  from flax import nnx
  from eagle3jax.decode_cli import DEFAULT_DRAFTER, DEFAULT_TARGET
  tgt = eagle3jax.load_target(DEFAULT_TARGET, dtype=jnp.float32)
  for path, var in nnx.to_flat_state(nnx.state(tgt.layers, nnx.Param)):
    if "norm" in ".".join(map(str, path)):
      continue
    w = np.asarray(jax.device_get(var.get_value()), np.float32)
    groups = w.reshape(-1, 32)
    scale = np.abs(groups).max(-1, keepdims=True) / 7 + 1e-12
    q = (np.clip(np.round(groups / scale), -8, 7) * scale).reshape(w.shape)
    var.set_value(jax.device_put(jnp.asarray(q), var.get_value().sharding))
  dr = eagle3jax.load_drafter(DEFAULT_DRAFTER, target=tgt)
  assert "capture record verified" in dr.capture_explanation


def test_record_from_an_unquantized_target_verifies_on_its_int4_checkpoint(tmp_path):
  # The same tiny DeepSeek as a float32 checkpoint and as a Kimi-K2.5 INT4 (compressed-tensors)
  # one, held quantized: its captures move by 0.06-0.10, past the fast path's 0.05, and the
  # every-layer search still finds each capture at its own layer (neighbours differ by > 0.5).
  from tests import deepseek_models as dm
  dm.make_checkpoint(str(tmp_path / "f32"))
  dm.to_kimi_k25_int4_checkpoint(str(tmp_path / "f32"), str(tmp_path / "int4"))
  f32 = eagle3jax.load_target(str(tmp_path / "f32"), dtype=jnp.float32)
  int4 = eagle3jax.load_target(str(tmp_path / "int4"), dtype=jnp.float32)
  cfg = f32.config
  dcfg = eagle3jax.DrafterConfig(
      hidden_size=cfg.hidden_size, intermediate_size=88, num_attention_heads=8,
      num_key_value_heads=2, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size,
      capture=eagle3jax.CaptureSpec((0, 1, 2)), rms_norm_eps=cfg.rms_norm_eps,
      max_position_embeddings=cfg.max_position_embeddings)
  path = str(tmp_path / "drafter")
  eagle3jax.save_drafter(eagle3jax.init_drafter(dcfg, target=f32), path, target=f32)
  dr = eagle3jax.load_drafter(path, target=int4)
  assert "capture record verified on every layer" in dr.capture_explanation
