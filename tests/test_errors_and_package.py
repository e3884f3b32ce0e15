"""Package layout and every bad-input path of the foundation, with its message."""

import dataclasses
import json
import os

import jax.numpy as jnp
import jax
import numpy as np
import pytest
import safetensors.numpy

import eagle3jax
from eagle3jax.capture import CaptureSpec
from tests import hf_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_subpackages_resolve_to_this_repository():
  import eagle3jax.kernels
  import eagle3jax.sharding
  assert os.path.dirname(eagle3jax.sharding.__file__) == os.path.join(REPO, "sharding")
  assert os.path.dirname(eagle3jax.kernels.__file__) == os.path.join(REPO, "kernels")
  assert os.path.dirname(eagle3jax.__file__) == os.path.join(REPO, "eagle3jax")


def test_repository_root_does_not_shadow_installed_packages():
  # The root's kernels/ and sharding/ folders would be found as the top-level packages
  # `kernels` (PyPI's, a transformers dependency) and `sharding` if the root came before the
  # installed packages on the path: in the tests (tests/conftest.py), in their subprocesses
  # and in the scripts (`python scripts/X.py` puts scripts/ first, not the root).
  import sys
  import sysconfig
  installed = {os.path.abspath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
  where = [os.path.abspath(p or os.curdir) for p in sys.path]
  first_installed = min(i for i, p in enumerate(where) if p in installed)
  assert all(i > first_installed for i, p in enumerate(where) if p == REPO), sys.path
  assert REPO not in [os.path.abspath(p) for p in
                      os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  for script in sorted(os.listdir(os.path.join(REPO, "scripts"))):
    with open(os.path.join(REPO, "scripts", script)) as f:
      assert "sys.path" not in f.read(), f"scripts/{script} edits sys.path"


# --- CaptureSpec ---

def test_capture_spec_default_and_validation():
  assert CaptureSpec.eagle3_default(32).layer_ids == (1, 15, 28)
  assert CaptureSpec.eagle3_default(61).layer_ids == (1, 29, 57)
  spec = CaptureSpec([2, 30, 58])
  assert spec.layer_ids == (2, 30, 58) and hash(spec) == hash(CaptureSpec((2, 30, 58)))
  with pytest.raises(ValueError, match="duplicates"):
    CaptureSpec((1, 1, 2))
  with pytest.raises(ValueError, match="ascending"):
    CaptureSpec((3, 1, 2))
  with pytest.raises(ValueError, match=">= -1"):
    CaptureSpec((-2, 1))
  with pytest.raises(ValueError, match="empty"):
    CaptureSpec(())
  with pytest.raises(ValueError, match=r"must be integer layer ids; got \[1.5\]"):
    CaptureSpec((1.5, 3))
  with pytest.raises(ValueError, match=r"ids \[7\] are out of range for a target with 7"):
    CaptureSpec((1, 7)).validate(7)


def test_forward_rejects_bad_ids_and_captures():
  model = eagle3jax.init_target(eagle3jax.LlamaConfig.tiny(num_hidden_layers=3))
  with pytest.raises(ValueError, match=r"input_ids has ids outside \[0, 131\)"):
    eagle3jax.forward(model, np.array([[1, 131]]))
  with pytest.raises(ValueError, match=r"shape \[B, T\]"):
    eagle3jax.forward(model, np.array([1, 2, 3]))
  with pytest.raises(ValueError, match="out of range"):
    eagle3jax.forward(model, np.array([[1, 2]]), capture=[0, 5])
  with pytest.raises(ValueError, match="capture=3 must be a CaptureSpec or a list"):
    eagle3jax.forward(model, np.array([[1, 2]]), capture=3)
  with pytest.raises(ValueError, match="its rows differ in length"):
    eagle3jax.forward(model, [[1, 2, 3], [1]])
  with pytest.raises(TypeError, match="runs on the host"):
    jax.jit(lambda x: eagle3jax.forward(model, x).logits)(np.array([[1, 2]]))


# --- config ---

def test_config_refuses_what_it_does_not_implement():
  base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2}
  eagle3jax.LlamaConfig.from_hf(base)
  with pytest.raises(ValueError, match="hidden_act='gelu'"):
    eagle3jax.LlamaConfig.from_hf({**base, "hidden_act": "gelu"})
  with pytest.raises(ValueError, match="rope_scaling.rope_type='dynamic'"):
    eagle3jax.LlamaConfig.from_hf({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
  with pytest.raises(ValueError, match="rope_parameters.rope_type='longrope'"):
    eagle3jax.LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "longrope"}})
  with pytest.raises(ValueError, match="sliding"):
    eagle3jax.LlamaConfig.from_hf({**base, "model_type": "qwen2", "use_sliding_window": True,
                                   "sliding_window": 4})
  with pytest.raises(ValueError, match="mlp_bias"):
    eagle3jax.LlamaConfig.from_hf({**base, "mlp_bias": True})
  with pytest.raises(ValueError, match=r"fields eagle3jax does not implement: \['quantization_config'\]"):
    eagle3jax.LlamaConfig.from_hf({**base, "quantization_config": {}})
  with pytest.raises(ValueError, match="model_type='gpt2'"):
    eagle3jax.LlamaConfig.from_hf({**base, "model_type": "gpt2"})
  with pytest.raises(ValueError, match=r"missing required fields \['intermediate_size'\]"):
    eagle3jax.LlamaConfig.from_hf({k: v for k, v in base.items() if k != "intermediate_size"})
  with pytest.raises(ValueError, match="num_key_value_heads=3 must divide"):
    eagle3jax.LlamaConfig.from_hf({**base, "num_key_value_heads": 3})
  # Values that used to load and decode NaN logits (argmax 0: an empty answer, exit code 0).
  for eps in (-1, 0, float("nan")):
    with pytest.raises(ValueError, match="rms_norm_eps=.* must be a small positive number"):
      eagle3jax.LlamaConfig.from_hf({**base, "rms_norm_eps": eps})
  with pytest.raises(ValueError, match="rope_theta=inf must be a finite positive number"):
    eagle3jax.LlamaConfig.from_hf({**base, "rope_theta": float("inf")})
  with pytest.raises(ValueError, match="rope_scaling='yes' must be a JSON object"):
    eagle3jax.LlamaConfig.from_hf({**base, "rope_scaling": "yes"})
  from eagle3jax.capture_contract import config_ids
  with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids='1,5,8' must be a "
                                       r"JSON list of integer layer ids"):
    config_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,5,8"}})
  with pytest.raises(ValueError, match="looks like an EAGLE-3 drafter's"):
    eagle3jax.LlamaConfig.from_hf({**base, "draft_vocab_size": 4, "target_hidden_size": 8})


def test_config_nulls_and_partial_rope_scaling_are_named():
  """Nulls gave raw TypeErrors from float()/int(); a llama3 or linear rope_scaling without its
  factors was filled with the dataclass's defaults (transformers refuses it); a zero
  num_key_value_heads read as multi-head attention."""
  base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2}
  for key in ("rms_norm_eps", "max_position_embeddings", "rope_theta"):
    with pytest.raises(ValueError, match=rf"config field {key}=None must be"):
      eagle3jax.LlamaConfig.from_hf({**base, key: None})
  with pytest.raises(ValueError, match=r"num_key_value_heads=0 must be a positive integer"):
    eagle3jax.LlamaConfig.from_hf({**base, "num_key_value_heads": 0})
  assert eagle3jax.LlamaConfig.from_hf({**base, "num_key_value_heads": None}) \
      .num_key_value_heads == 2  # null: multi-head attention, as transformers
  with pytest.raises(ValueError, match=r"rope_scaling is missing \['factor', 'low_freq_factor', "
                                       r"'high_freq_factor', 'original_max_position_embeddings'\]"
                                       r" for rope type 'llama3'"):
    eagle3jax.LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "llama3"}})
  with pytest.raises(ValueError, match=r"rope_scaling is missing \['factor'\] for rope type "
                                       r"'linear'"):
    eagle3jax.LlamaConfig.from_hf({**base, "rope_scaling": {"type": "linear"}})
  with pytest.raises(ValueError, match=r"rope_scaling.factor='2' must be a number"):
    eagle3jax.LlamaConfig.from_hf({**base, "rope_scaling": {"type": "linear", "factor": "2"}})
  # Qwen3Config's head_dim defaults to 128 in transformers, not hidden_size // heads.
  assert eagle3jax.LlamaConfig.from_hf({**base, "model_type": "qwen3"}).resolved_head_dim == 128
  assert eagle3jax.LlamaConfig.from_hf({**base, "model_type": "qwen2"}).resolved_head_dim == 4
  # The drafter's config.json reads the same way.
  from eagle3jax.drafter_io import config_from_hf
  drafter = {"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2,
             "vocab_size": 10, "draft_vocab_size": 4}
  spec = eagle3jax.CaptureSpec((0, 1, 2))
  config_from_hf(drafter, spec)
  for key in ("rms_norm_eps", "max_position_embeddings", "rope_theta"):
    with pytest.raises(ValueError, match=rf"{key}=None must be"):
      config_from_hf({**drafter, key: None}, spec)
  with pytest.raises(ValueError, match=r"num_key_value_heads=0 must be a positive integer"):
    config_from_hf({**drafter, "num_key_value_heads": 0}, spec)
  with pytest.raises(ValueError, match=r"missing \['factor'"):
    config_from_hf({**drafter, "rope_scaling": {"rope_type": "llama3"}}, spec)


def test_yarn_is_refused_where_the_llama_forward_would_ignore_its_attention_factor():
  """A LlamaConfig or DrafterConfig with YaRN rope built a model that skipped YaRN's attention
  factor (0.89 off transformers' logits), and save_target wrote a config load_target refuses."""
  yarn = eagle3jax.RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0,
                              original_max_position_embeddings=64)
  with pytest.raises(ValueError, match=r"rope.rope_type='yarn' is not supported by "
                                       r"Llama-family targets"):
    eagle3jax.LlamaConfig.tiny(rope=yarn)
  target_cfg = eagle3jax.LlamaConfig.tiny()
  with pytest.raises(ValueError, match=r"drafter config field rope.rope_type='yarn' is not "
                                       r"supported"):
    eagle3jax.DrafterConfig.for_target(target_cfg, eagle3jax.CaptureSpec((0, 2, 4)), rope=yarn)


# --- load_target ---

@pytest.fixture()
def checkpoint(tmp_path):
  hf_models.make_checkpoint(str(tmp_path), "llama", layers=2)
  return tmp_path


def _edit_weights(path, fn):
  f = os.path.join(path, "model.safetensors")
  from eagle3jax.safetensors_io import SafetensorsFile
  st = SafetensorsFile(f)
  tensors = {n: np.array(st.get(n)) for n in st.names}
  del st
  fn(tensors)
  safetensors.numpy.save_file(tensors, f)


@pytest.mark.parametrize("content, message", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n",
     "is a git-lfs pointer, not the weights"),
    (b"<!DOCTYPE html><html>Not found</html>", r"bytes give a \d+-byte header, but the file has 37 bytes"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "header is not a JSON object"),
])
def test_files_that_are_not_safetensors_are_named(checkpoint, content, message):
  (checkpoint / "model.safetensors").write_bytes(content)
  with pytest.raises(ValueError, match=message):
    eagle3jax.load_target(str(checkpoint))


@pytest.mark.parametrize("content, message", [
    ("[]", "has no 'weight_map' object"), ("{", "is not valid JSON"),
])
def test_bad_shard_index_is_named(checkpoint, content, message):
  (checkpoint / "model.safetensors.index.json").write_text(content)
  with pytest.raises(ValueError, match=f"model.safetensors.index.json {message}"):
    eagle3jax.load_target(str(checkpoint))


def test_missing_weight_is_named(checkpoint):
  _edit_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match="missing weight 'model.layers.1.mlp.up_proj.weight'"):
    eagle3jax.load_target(str(checkpoint))


def test_unexpected_weight_is_named(checkpoint):
  _edit_weights(checkpoint, lambda t: t.__setitem__("model.layers.0.extra.weight",
                                                    np.zeros(3, np.float32)))
  with pytest.raises(ValueError, match="unexpected weights.*model.layers.0.extra.weight"):
    eagle3jax.load_target(str(checkpoint))


def test_tied_checkpoint_with_a_different_head_is_refused(tmp_path):
  """A tied config beside a stored lm_head.weight that differs from the embedding: the head
  was dropped silently (24 off transformers 5's logits, which use the stored head)."""
  hf_models.make_checkpoint(str(tmp_path), "llama", tied=True, layers=2)
  _edit_weights(tmp_path, lambda t: t.__setitem__(
      "lm_head.weight", np.array(t["model.embed_tokens.weight"])))
  eagle3jax.load_target(str(tmp_path))  # an equal copy is harmless
  _edit_weights(tmp_path, lambda t: t.__setitem__(
      "lm_head.weight", t["model.embed_tokens.weight"] + np.float32(0.5)))
  with pytest.raises(ValueError, match=r"tie_word_embeddings=true, but its 'lm_head.weight' "
                                       r"differs from the token embedding \(max \|difference\| "
                                       r"0.5\): set tie_word_embeddings to false"):
    eagle3jax.load_target(str(tmp_path))


def test_save_target_refuses_what_its_layout_cannot_hold(tmp_path):
  """q/k norms on a model_type 'llama' config were written, then refused by load_target and
  ignored by transformers (1.42 off); a q/k/v bias without the o bias likewise."""
  from eagle3jax.hf_export import save_target
  for fields, have in (({"qk_norm": True}, "qk_norm=True"),
                       ({"qkv_bias": True}, "qkv_bias=True, o_bias=False"),
                       ({"model_type": "qwen2"}, "qkv_bias=False")):
    target = eagle3jax.init_target(eagle3jax.LlamaConfig.tiny(num_hidden_layers=1, **fields))
    with pytest.raises(ValueError, match=rf"save_target: a model_type='\w+' checkpoint has .*"
                                         rf"{have}"):
      save_target(target, str(tmp_path / "t"))
    assert not (tmp_path / "t").exists()
  # A linear rope is written with the keys transformers reads for it, and loads back.
  rope = eagle3jax.RopeConfig(theta=5000.0, rope_type="linear", factor=2.0)
  cfg = eagle3jax.LlamaConfig.tiny(num_hidden_layers=1, rope=rope)
  save_target(eagle3jax.init_target(cfg), str(tmp_path / "linear"))
  with open(tmp_path / "linear" / "config.json") as f:
    assert json.load(f)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
  assert eagle3jax.load_target(str(tmp_path / "linear")).config.rope == rope


def test_wrong_shape_is_named(checkpoint):
  _edit_weights(checkpoint, lambda t: t.__setitem__("model.norm.weight",
                                                    np.zeros(5, np.float32)))
  with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(5,\)"):
    eagle3jax.load_target(str(checkpoint))


def test_bad_config_and_paths(checkpoint, tmp_path_factory):
  with pytest.raises(ValueError, match="does not exist"):
    eagle3jax.load_target(str(checkpoint / "nope"))
  empty = tmp_path_factory.mktemp("empty")
  with pytest.raises(ValueError, match="has no config.json"):
    eagle3jax.load_target(str(empty))
  (empty / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 4,
      "hidden_size": 4, "intermediate_size": 4, "num_hidden_layers": 1,
      "num_attention_heads": 1}))
  with pytest.raises(ValueError, match="neither model.safetensors nor"):
    eagle3jax.load_target(str(empty))
  cfg = json.loads((checkpoint / "config.json").read_text())
  cfg["hidden_act"] = "relu"
  (checkpoint / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="hidden_act='relu'"):
    eagle3jax.load_target(str(checkpoint))


def test_bf16_default_dtype(checkpoint):
  model = eagle3jax.load_target(str(checkpoint))
  assert model.embed_tokens[...].dtype == jnp.bfloat16
  out = eagle3jax.forward(model, np.array([[1, 2, 3]]))
  assert out.logits.dtype == jnp.float32 and np.isfinite(np.asarray(out.logits)).all()


def test_layers_the_config_does_not_name_are_refused(checkpoint):
  """A config that names fewer layers than the checkpoint holds used to load the first ones
  and decode something else, silently; only DeepSeek's multi-token-prediction layers (as many
  as ``num_nextn_predict_layers``) may follow the last layer."""
  cfg = json.loads((checkpoint / "config.json").read_text())
  (checkpoint / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
  with pytest.raises(ValueError, match=r"has weights of layers \[1\] but its config.json says "
                                       r"num_hidden_layers=1.*fix num_hidden_layers"):
    eagle3jax.load_target(str(checkpoint))


def test_deepseek_skips_only_its_multi_token_prediction_layers(tmp_path):
  from tests import deepseek_models
  path = str(tmp_path)
  deepseek_models.make_checkpoint(path, layers=3)
  full = eagle3jax.load_target(path, dtype=jnp.float32)
  # The third layer stands in for an MTP layer (model.layers.{L}.*) of a 2-layer model.
  deepseek_models._rewrite_config(path, lambda c: c.update(num_hidden_layers=2,
                                                           num_nextn_predict_layers=1))
  two = eagle3jax.load_target(path, dtype=jnp.float32)
  assert two.num_layers == 2 and full.num_layers == 3
  deepseek_models._rewrite_config(path, lambda c: c.update(num_nextn_predict_layers=0))
  with pytest.raises(ValueError, match=r"layers \[2\] but its config.json says "
                                       r"num_hidden_layers=2 \(and num_nextn_predict_layers=0\)"):
    eagle3jax.load_target(path, dtype=jnp.float32)


def test_eos_ids_outside_the_vocabulary_are_refused_at_load(checkpoint):
  cfg = json.loads((checkpoint / "config.json").read_text())
  (checkpoint / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [2, 9000]}))
  with pytest.raises(ValueError, match=r"eos_token_id=\[2, 9000\]: \[9000\] are not token ids "
                                       r"in \[0, vocab_size="):
    eagle3jax.load_target(str(checkpoint))
  with pytest.raises(ValueError, match=r"eos_token_id=\[-1\]"):
    eagle3jax.LlamaConfig.tiny(eos_token_ids=(-1,))


def test_config_sizes_accept_numpy_integers_and_refuse_others():
  cfg = eagle3jax.LlamaConfig.tiny(hidden_size=np.int64(64), eos_token_ids=(np.int32(2),))
  assert type(cfg.hidden_size) is int and type(cfg.eos_token_ids[0]) is int
  with pytest.raises(ValueError, match=r"hidden_size=64.0 must be a positive integer"):
    eagle3jax.LlamaConfig.tiny(hidden_size=64.0)
  with pytest.raises(ValueError, match=r"num_hidden_layers=True must be a positive integer"):
    eagle3jax.LlamaConfig.tiny(num_hidden_layers=True)


def test_models_of_the_wrong_kind_and_bad_init_arguments_are_named(tmp_path):
  tcfg = eagle3jax.LlamaConfig.tiny(num_hidden_layers=3)
  target = eagle3jax.init_target(tcfg)
  dcfg = eagle3jax.DrafterConfig.for_target(tcfg, CaptureSpec((0, 1, 2)))
  drafter = eagle3jax.init_drafter(dcfg, target=target)
  got_drafter = r"must be a target model \(load_target / init_target\); got an EAGLE-3 drafter"
  got_target = r"must be an EAGLE-3 drafter \(load_drafter / init_drafter\); got a target model"
  with pytest.raises(ValueError, match="forward's target " + got_drafter):
    eagle3jax.forward(drafter, [[1, 2]])
  with pytest.raises(ValueError, match="save_drafter's drafter " + got_target):
    eagle3jax.save_drafter(target, str(tmp_path / "x"))
  with pytest.raises(ValueError, match="save_drafter's target " + got_drafter):
    eagle3jax.save_drafter(drafter, str(tmp_path / "x"), target=drafter)
  with pytest.raises(ValueError, match="draft_logits' drafter " + got_target):
    eagle3jax.draft_logits(target, [[1, 2]], np.zeros((1, 2, 3 * 64), np.float32))
  with pytest.raises(ValueError, match="init_drafter's target " + got_drafter):
    eagle3jax.init_drafter(dcfg, target=drafter)
  with pytest.raises(ValueError, match="load_drafter's target " + got_drafter):
    eagle3jax.load_drafter(str(tmp_path), target=drafter)
  with pytest.raises(ValueError, match="train_drafter's target " + got_drafter):
    eagle3jax.train_drafter(drafter, [[1, 2]], str(tmp_path / "t"))
  with pytest.raises(ValueError, match=r"must be a target model .*; got a str"):
    eagle3jax.generate("model", None, [[1, 2]], max_new_tokens=2)
  # Integer parameters passed every cast and failed inside the first jitted forward.
  for make in (lambda: eagle3jax.init_target(tcfg, dtype=jnp.int8),
               lambda: eagle3jax.init_drafter(dcfg, target=target, dtype=jnp.int32),
               lambda: eagle3jax.load_target(str(tmp_path), dtype="int32")):
    with pytest.raises(ValueError, match=r"dtype=.*int.* is not a parameter dtype: use one of"):
      make()
  with pytest.raises(ValueError, match=r"seed=-1 must be an integer >= 0"):
    eagle3jax.init_drafter(dcfg, target=target, seed=-1)
  with pytest.raises(ValueError, match=r"seed=0.5 must be an integer >= 0"):
    eagle3jax.init_target(tcfg, seed=0.5)
  with pytest.raises(ValueError, match=r"std=nan must be a finite number >= 0"):
    eagle3jax.init_drafter(dcfg, target=target, std=float("nan"))
  with pytest.raises(ValueError, match=r"input_ids has 513 positions, more than the target's "
                                       r"max_position_embeddings=512"):
    eagle3jax.forward(target, np.ones((1, 513), np.int32))
  # The target's config where the drafter's goes (an AttributeError inside), or none at all.
  for cfg, got in ((tcfg, "LlamaConfig"), (None, "NoneType")):
    with pytest.raises(ValueError, match=rf"init_drafter takes a DrafterConfig, got {got}: "
                                         r"build one for the target with DrafterConfig"):
      eagle3jax.init_drafter(cfg, target=target)
  wide = dataclasses.replace(dcfg, hidden_size=32, target_hidden_size=64)
  with pytest.raises(ValueError, match=r"drafter hidden_size=32 differs from the target's "
                                       r"hidden_size=64: an initialised drafter shares"):
    eagle3jax.init_drafter(wide, target=target)  # was "use a checkpoint that carries ..."
  with pytest.raises(ValueError, match=r"d2t has 4 entries but the config's draft_vocab_size="
                                       r"131; they must match"):
    eagle3jax.init_drafter(dcfg, target=target, d2t=np.zeros(4, np.int32))
  # The Trainer checks its models as generate does: kinds, then the pairing.
  from eagle3jax import training
  data = training.pack([[1, 2, 3]] * 2, [[4, 5, 6]] * 2, 8)
  tc = eagle3jax.TrainConfig(total_steps=1, warmup_steps=0, batch_size=2, seq_len=8)
  with pytest.raises(ValueError, match="Trainer's target " + got_drafter):
    training.Trainer(drafter, target, data, tc)
  with pytest.raises(ValueError, match="Trainer's config must be a TrainConfig, got dict"):
    training.Trainer(target, drafter, data, {"seq_len": 8})
  other = eagle3jax.init_target(tcfg, seed=1)
  with pytest.raises(ValueError, match="the drafter passed to Trainer shares the token "
                                       "embedding of another target"):
    training.Trainer(other, drafter, data, tc)
  # Called directly outside a mesh context, the models raised a ShardingTypeError from inside.
  ids = jnp.asarray([[1, 2, 3]])
  with pytest.raises(ValueError, match=r"the model was called outside a mesh context: call it "
                                       r"under jax.set_mesh\(model.mesh\)"):
    target(ids)
  with pytest.raises(ValueError, match=r"the drafter was called outside a mesh context"):
    drafter(ids, jnp.zeros((1, 3, 64)), jnp.arange(3)[None])
  with jax.set_mesh(target.mesh):  # a list of layer ids is a capture, as in forward
    _, aux, _ = target(ids, capture=[0, 2])
  np.testing.assert_allclose(np.asarray(aux), np.asarray(
      eagle3jax.forward(target, [[1, 2, 3]], capture=[0, 2]).aux_hidden), rtol=1e-6, atol=1e-6)
  # save_drafter onto a file (a FileExistsError from os.makedirs) or over the target's folder.
  from eagle3jax.hf_export import save_target
  (tmp_path / "afile").write_text("x")
  with pytest.raises(ValueError, match=r"save_drafter's path .*afile' is a file; a drafter is "
                                       r"saved to a folder"):
    eagle3jax.save_drafter(drafter, str(tmp_path / "afile"))
  save_target(target, str(tmp_path / "tgt"))
  before = (tmp_path / "tgt" / "model.safetensors").read_bytes()
  with pytest.raises(ValueError, match=r"holds .*config.json, which is not an EAGLE-3 "
                                       r"drafter's .*: saving there would overwrite that model"):
    eagle3jax.save_drafter(drafter, str(tmp_path / "tgt"), target=target)
  assert (tmp_path / "tgt" / "model.safetensors").read_bytes() == before
  eagle3jax.save_drafter(drafter, str(tmp_path / "d"))
  eagle3jax.save_drafter(drafter, str(tmp_path / "d"))  # a drafter's folder: a re-export
  with pytest.raises(ValueError, match=r"prompts given as an array has shape \(0, 3\): it "
                                       r"needs at least one prompt"):
    eagle3jax.generate(target, None, np.zeros((0, 3), np.int32), max_new_tokens=2)


def test_train_drafter_checks_its_prompts_before_writing_anything(tmp_path):
  target = eagle3jax.init_target(eagle3jax.LlamaConfig.tiny(num_hidden_layers=3))
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=r"prompts is a flat list of 3 token ids; pass a list of "
                                       r"prompts"):
    eagle3jax.train_drafter(target, [5, 6, 7], str(out))
  with pytest.raises(ValueError, match=r"prompts\[1\] has token ids outside \[0, 131\): "
                                       r"\[131\]"):
    eagle3jax.train_drafter(target, [[5, 6], [131]], str(out))
  # Refused after the regeneration (minutes for the demo) until it moved up front.
  with pytest.raises(ValueError, match=r"TrainConfig.draft_vocab_size=1000 exceeds the target "
                                       r"vocab_size=131"):
    eagle3jax.train_drafter(target, [[5, 6]], str(out),
                            eagle3jax.TrainConfig(draft_vocab_size=1000, seq_len=64),
                            capture=[0, 1, 2])
  with pytest.raises(ValueError, match=r"drafter config field intermediate_size=0"):
    eagle3jax.train_drafter(target, [[5, 6]], str(out), eagle3jax.TrainConfig(seq_len=64),
                            capture=[0, 1, 2], drafter_overrides={"intermediate_size": 0})
  # Another width was refused only after the regeneration, by init_drafter.
  for overrides, message in (({"hidden_size": 32}, r"drafter target_hidden_size=32 differs"),
                             ({"hidden_size": 32, "target_hidden_size": 64},
                              r"drafter hidden_size=32 differs from the target's")):
    with pytest.raises(ValueError, match=message):
      eagle3jax.train_drafter(target, [[5, 6]], str(out), eagle3jax.TrainConfig(seq_len=64),
                              capture=[0, 1, 2], drafter_overrides=overrides)
  assert not out.exists()
