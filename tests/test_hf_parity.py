"""Logits and every capture match `transformers` on tiny random checkpoints (float32)."""

import jax.numpy as jnp
import numpy as np
import pytest

import eagle3jax
from tests import hf_models

CASES = [
    ("llama", False, "hf5"), ("llama", False, "published"), ("llama", True, "hf5"),
    ("llama", True, "published"), ("qwen2", False, "hf5"), ("qwen2", True, "published"),
    ("qwen3", False, "hf5"), ("qwen3", False, "published"),
]


@pytest.mark.parametrize("kind,tied,style", CASES)
def test_logits_and_captures_match_transformers(tmp_path, kind, tied, style):
  layers = 6
  torch_model = hf_models.make_checkpoint(str(tmp_path), kind, tied=tied, layers=layers,
                                          style=style)
  # Positions past original_max_position_embeddings (16) exercise the llama3 smoothing.
  ids = np.random.default_rng(1).integers(0, 97, (2, 29))
  ref_logits, ref_layers = hf_models.hf_outputs(torch_model, ids)

  target = eagle3jax.load_target(str(tmp_path), dtype=jnp.float32)
  capture_ids = (-1, 0, layers // 2, layers - 1)
  out = eagle3jax.forward(target, ids, capture=capture_ids)

  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)
  d = target.config.hidden_size
  aux = np.asarray(out.aux_hidden)
  assert aux.shape == (2, 29, len(capture_ids) * d)
  for j, layer in enumerate(capture_ids):
    np.testing.assert_allclose(aux[..., j * d:(j + 1) * d], ref_layers[layer], atol=1e-4,
                               rtol=0, err_msg=f"capture {layer}")


def test_config_styles_agree(tmp_path):
  hf_models.make_checkpoint(str(tmp_path / "a"), "llama", style="hf5")
  hf_models.make_checkpoint(str(tmp_path / "b"), "llama", style="published")
  a = eagle3jax.load_target(str(tmp_path / "a"), dtype=jnp.float32).config
  b = eagle3jax.load_target(str(tmp_path / "b"), dtype=jnp.float32).config
  assert a == b
  assert a.rope.rope_type == "llama3" and a.rope.factor == 8.0 and a.rope.theta == 5000.0


def test_sharded_checkpoint_index(tmp_path):
  """A checkpoint split over several files with model.safetensors.index.json loads."""
  torch_model = hf_models.make_checkpoint(str(tmp_path / "one"), "qwen2")
  torch_model.save_pretrained(str(tmp_path / "many"), max_shard_size="20KB")
  import os
  assert os.path.exists(tmp_path / "many" / "model.safetensors.index.json")
  ids = np.arange(12)[None] % 97
  a = eagle3jax.forward(eagle3jax.load_target(str(tmp_path / "one"), dtype=jnp.float32), ids)
  b = eagle3jax.forward(eagle3jax.load_target(str(tmp_path / "many"), dtype=jnp.float32), ids)
  np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))


def test_qwen3_without_head_dim_uses_transformers_default(tmp_path):
  """Qwen3Config's head_dim defaults to 128; a config.json without it was read as
  hidden_size // num_attention_heads and refused with a k_norm shape error."""
  import json
  import torch
  import transformers
  torch.manual_seed(0)
  cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=80,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, max_position_embeddings=256)
  assert cfg.head_dim == 128
  model = transformers.Qwen3ForCausalLM(cfg).eval()
  model.save_pretrained(str(tmp_path), safe_serialization=True)
  with open(tmp_path / "config.json") as f:
    hf = json.load(f)
  hf.pop("head_dim")
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf, f)
  ids = np.arange(11)[None] % 97
  with torch.no_grad():
    ref = model(torch.as_tensor(ids)).logits.numpy()
  target = eagle3jax.load_target(str(tmp_path), dtype=jnp.float32)
  assert target.config.resolved_head_dim == 128
  np.testing.assert_allclose(np.asarray(eagle3jax.forward(target, ids).logits), ref,
                             atol=1e-4, rtol=0)
