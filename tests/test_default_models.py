"""The shipped demo models (models/default): size, both loaders, lossless decoding."""

import json
import os

import jax.numpy as jnp
import numpy as np
import torch
import transformers

import eagle3jax
from eagle3jax.decode_cli import DEFAULT_DRAFTER, DEFAULT_TARGET
from eagle3jax.text import TextCodec

ROOT = os.path.dirname(DEFAULT_TARGET)


def test_shipped_folder_is_complete_and_small():
  total = 0
  for d, _, files in os.walk(ROOT):
    total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
  assert total <= 30 * 2**20, f"{total / 2**20:.1f} MiB"
  with open(os.path.join(ROOT, "manifest.json")) as f:
    manifest = json.load(f)
  assert manifest["train"] and manifest["heldout"]
  assert not set(manifest["train"]) & set(manifest["heldout"])
  for name in ("config.json", "model.safetensors", "tokenizer.json"):
    assert os.path.exists(os.path.join(DEFAULT_TARGET, name))
  with open(os.path.join(DEFAULT_DRAFTER, "config.json")) as f:
    cfg = json.load(f)
  assert cfg["eagle_config"]["aux_layer_convention"] == "output"


def test_target_loads_in_transformers_with_the_same_logits():
  target = eagle3jax.load_target(DEFAULT_TARGET, dtype=jnp.float32)
  ids = np.asarray([TextCodec(DEFAULT_TARGET).encode_prompt("import os\nimport sys\n")])
  ours = np.asarray(eagle3jax.forward(target, ids).logits)
  hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET,
                                                         dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf(torch.as_tensor(ids)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=2e-3)


def test_shipped_pair_decodes_losslessly():
  target = eagle3jax.load_target(DEFAULT_TARGET, dtype=jnp.float32)
  drafter = eagle3jax.load_drafter(DEFAULT_DRAFTER, target=target)
  codec = TextCodec(DEFAULT_TARGET)
  prompts = [codec.encode_prompt("def fibonacci(n):"),
             codec.encode_prompt("class Stack:\n    def __init__(self):")]
  base = eagle3jax.generate(target, None, prompts, max_new_tokens=24, eos_ids=[])
  spec = eagle3jax.generate(target, drafter, prompts, max_new_tokens=24, eos_ids=[],
                            num_steps=5, topk=1)
  assert spec.tokens == base.tokens
  assert spec.stats["accept_length_mean"] > 1.5  # the trained drafter is right often
