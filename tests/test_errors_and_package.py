"""Package layout and every bad-input path of the foundation, with its message."""

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
