"""plan.py: the serving programs compiled from a config with abstract weights, sized per device.

The reported bytes are checked against arithmetic from the config (not against the code that
computes them), and the per-round cost fitted from shallow variants against a direct compile.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from eagle3jax import plan as plan_lib

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

D, F, H, K, HD, V, L = 64, 128, 8, 8, 8, 512, 3
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
    "intermediate_size": F, "num_attention_heads": H, "num_key_value_heads": K,
    "num_hidden_layers": L, "vocab_size": V, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
DRAFTER = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
    "intermediate_size": F, "num_attention_heads": H, "num_key_value_heads": K,
    "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                     "aux_layer_convention": "output"},
}


def _llama_weight_bytes(tensor: int) -> int:
  """Per-device bf16 bytes: everything but the norms is split over the tensor axis."""
  per_layer = D * H * HD + 2 * D * K * HD + H * HD * D + 3 * D * F
  sharded = L * per_layer + 2 * V * D
  norms = L * 2 * D + D
  return 2 * (sharded // tensor + norms)


def test_llama_bytes_match_the_config_arithmetic():
  r = plan_lib.plan(LLAMA, data=1, tensor=8, batch=2, context=256, prompt_len=32,
                    with_cost=False, log=lambda m: None)
  pd = r["per_device"]
  assert pd["weights"] == _llama_weight_bytes(8)
  # K/V, bf16, kv heads over the tensor axis: L * B * slots * (K/8) * HD * 2 (k and v) * 2.
  assert r["cache_slots"] >= 256
  assert pd["kv_cache"] == L * 2 * r["cache_slots"] * (K // 8) * HD * 2 * 2
  assert r["kv_bytes_per_token"] == pytest.approx(L * (K // 8) * HD * 2 * 2)
  assert pd["temp"] > 0
  assert pd["total"] == pd["weights"] + pd["drafter_weights"] + pd["kv_cache"] + \
      pd["decode_state"] + pd["temp"]
  assert r["fits"] and r["hbm_bytes"] == int(141 * 2**30)
  assert r["max_batch"] > 2 and r["max_context"] > 256
  # Memory would hold far more than the model's 4096 positions: the context reported is the
  # model's limit (it used to be the memory bound alone, past what the model can serve).
  assert r["max_context_memory"] > 4096 and r["max_context"] == 4096
  assert r["max_position_embeddings"] == 4096
  assert "memory would hold" in plan_lib.markdown(r)
  # The suite's persistent compilation cache (conftest) is named beside the compile time,
  # which may then be a read from it; without one the time stands alone.
  cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
  assert r["compile_cache"] == cache
  assert f"persistent compilation cache {cache}: may be a read" in plan_lib.markdown(r)
  assert "persistent" not in plan_lib.markdown({**r, "compile_cache": None})
  # A memory that only just misses the total does not fit, and then holds no larger batch.
  small = plan_lib.plan(LLAMA, data=1, tensor=8, batch=2, context=256, prompt_len=32,
                        hbm_gib=(pd["total"] - 1) / 2**30, with_cost=False, log=lambda m: None)
  assert not small["fits"] and small["max_batch"] < 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=0), "batch=0 must be a positive integer"),
    (dict(context=-5), "context=-5 must be a positive integer"),
    (dict(prompt_len=0), "prompt_len=0 must be a positive integer"),
    (dict(context=64, prompt_len=128), "prompt_len=128 exceeds context=64"),
    (dict(hbm_gib=-1.0), "hbm_gib=-1.0 must be a positive number"),
    (dict(context=8192), "context=8192 exceeds the target's max_position_embeddings=4096"),
])
def test_plan_refuses_what_it_cannot_size(kwargs, message):
  args = dict(data=1, tensor=8, batch=1, context=256, prompt_len=32, with_cost=False,
              log=lambda m: None)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    plan_lib.plan(LLAMA, **args)


def test_plan_sizes_the_rows_generate_runs():
  """generate pads a batch to its bucket (3 prompts run as 4 rows): the plan compiles those
  rows, and its largest batch is one whose bucket fits (3 rows of memory hold a batch of 2)."""
  assert [plan_lib.largest_batch(n) for n in (0, 1, 2, 3, 7, 8, 15, 16, 23)] == [
      0, 1, 2, 2, 4, 8, 8, 16, 16]
  assert [plan_lib.largest_batch(n, 2) for n in (1, 2, 3, 5)] == [0, 2, 2, 4]
  r = plan_lib.plan(LLAMA, data=2, tensor=4, batch=3, context=128, prompt_len=16,
                    with_cost=False, log=lambda m: None)
  assert r["batch"] == 3 and r["rows"] == 4  # a batch that data=2 does not divide runs padded
  one = plan_lib.plan(LLAMA, data=2, tensor=4, batch=4, context=128, prompt_len=16,
                      with_cost=False, log=lambda m: None)
  assert r["per_device"] == one["per_device"]
  assert "3 x 128 (runs as 4 rows" in plan_lib.markdown(r)
  assert plan_lib.largest_batch(r["max_rows"], 2) == r["max_batch"] <= r["max_rows"]


def test_plan_default_prompt_fits_a_short_context():
  # --context below the 2048-token default prefill: the prefill shrinks to the context (it is
  # only an explicit --prompt-len longer than the context that is refused).
  r = plan_lib.plan(LLAMA, data=1, tensor=8, batch=1, context=np.int64(256), with_cost=False,
                    log=lambda m: None)
  assert r["prompt_len"] == 256 and r["context"] == 256


def test_drafter_and_deepseek_latent_cache_bytes():
  from tests import deepseek_models  # pylint: disable=import-outside-toplevel
  hf = deepseek_models.to_published_style(deepseek_models.hf_config(layers=3).to_dict())
  hf["architectures"] = ["DeepseekV3ForCausalLM"]
  r = plan_lib.plan(hf, data=2, tensor=4, batch=2, context=64, prompt_len=16,
                    with_cost=False, log=lambda m: None)  # the tiny model's 64 positions
  # The MLA latent cache: kv_lora_rank + qk_rope_head_dim per token and layer, replicated over
  # the tensor axis, batch over data.
  per_token = hf["num_hidden_layers"] * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * 2
  assert r["per_device"]["kv_cache"] == (2 // 2) * r["cache_slots"] * per_token
  # Per token and device, whatever the data axis (it was multiplied by data: twice the
  # whole model's cache here, under an "all devices" label).
  assert r["kv_bytes_per_token"] == per_token
  assert f"| KV bytes per token / device | {per_token} |" in plan_lib.markdown(r)
  # The table says which tree its figures are for (it said none).
  assert "| draft tree (steps, topk, draft tokens) | none: autoregressive |" in (
      plan_lib.markdown(r))
  rd = plan_lib.plan(LLAMA, DRAFTER, data=1, tensor=8, batch=1, context=128, prompt_len=16,
                     with_cost=False, log=lambda m: None)
  # Drafter: one layer (attention input 2D) and the draft head split over the tensor axis; fc
  # (3D -> D) and four norms replicated; d2t (int32) and t2d (bool); the embedding is shared.
  split = 2 * D * H * HD + 2 * 2 * D * K * HD + H * HD * D + 3 * D * F + D * 128
  replicated = 3 * D * D + 4 * D
  assert rd["per_device"]["drafter_weights"] == 2 * (split // 8 + replicated) + 128 * 4 + V
  assert rd["capture"] == [0, 1, 2] and rd["tree"] == [7, 1, 8]
  assert "| draft tree (steps, topk, draft tokens) | (7, 1, 8) |" in plan_lib.markdown(rd)


def test_round_cost_counts_every_layer_once():
  """The round's cost at depth L: at least the matmuls over every layer's weights for the
  verified tokens and one read of the weights and caches, and linear in L (equal increments
  from 8 to 11 and from 11 to 14 layers: neither a loop body counted once nor a cost quadratic
  in depth)."""
  flops, nbytes = [], []
  for n in (8, 11, 14):
    hf = dict(LLAMA, num_hidden_layers=n)
    dr = dict(DRAFTER, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, n - 1],
                                     "aux_layer_convention": "output"})
    r = plan_lib.plan(hf, dr, data=1, tensor=8, batch=1, context=512, prompt_len=16, steps=3,
                      topk=1, draft_tokens=4, log=lambda m: None)
    pd = r["per_device"]
    layer_weights = (D * H * HD + 2 * D * K * HD + H * HD * D + 3 * D * F) // 8
    assert r["flops_per_round"] >= n * 2 * 4 * layer_weights
    assert r["bytes_per_round"] >= pd["weights"] + pd["kv_cache"]
    assert r["roofline_round_s"] == pytest.approx(max(r["flops_per_round"] / 989e12,
                                                      r["bytes_per_round"] / 4.8e12))
    flops.append(r["flops_per_round"])
    nbytes.append(r["bytes_per_round"])
  assert flops[2] - flops[1] == pytest.approx(flops[1] - flops[0], rel=0.02)
  assert nbytes[2] - nbytes[1] == pytest.approx(nbytes[1] - nbytes[0], rel=0.02)
  assert flops[1] - flops[0] >= 3 * 2 * 4 * layer_weights


def test_script_json_and_errors(tmp_path):
  cfg = tmp_path / "config.json"
  cfg.write_text(json.dumps(LLAMA))
  out = subprocess.run([sys.executable, "scripts/plan.py", "--config", str(cfg), "--mesh", "1,4",
                        "--batch", "1", "--context", "128", "--prompt-len", "16", "--no-cost",
                        "--json"], capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr
  r = json.loads(out.stdout)
  for key in ("fits", "per_device", "hbm_bytes", "max_batch", "max_context", "compile_s"):
    assert key in r
  assert r["per_device"]["weights"] == _llama_weight_bytes(4)
  bad = subprocess.run([sys.executable, "scripts/plan.py", "--config", str(cfg), "--mesh", "x"],
                       capture_output=True, text=True, timeout=60, check=False)
  assert bad.returncode == 2 and "--mesh" in bad.stderr
  # Files that are not a JSON object are named with their flag (a list gave an
  # AttributeError traceback, bad JSON a message that named no file).
  (tmp_path / "list.json").write_text("[1, 2]")
  (tmp_path / "bad.json").write_text("{bad")
  for argv, message in (
      (["--config", str(cfg), "--drafter-config", str(tmp_path / "list.json")],
       f"--drafter-config {str(tmp_path / 'list.json')!r} must hold a JSON object"),
      (["--config", str(tmp_path / "bad.json")],
       f"--config {str(tmp_path / 'bad.json')!r} is not JSON"),
      # Accepted and ignored before: without a drafter the plan is autoregressive.
      (["--config", str(cfg), "--steps", "3", "--draft-tokens", "5"],
       "--steps, --draft-tokens shape the draft tree, but without --drafter-config")):
    bad = subprocess.run([sys.executable, "scripts/plan.py", *argv, "--mesh", "1,1",
                          "--no-cost"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def _published(name):
  with open(f"configs/{name}.json") as f:
    return json.load(f)


def test_published_seed_models_fit_one_node_only_as_stored():
  """The real configs on (1, 8) H200s at batch 1 x 32k: Kimi-K2.5 fits with its INT4 experts
  held as stored and does not fit dequantized to bf16; DeepSeek-V3 fits with FP8 kept."""
  quiet = lambda m: None  # noqa: E731
  kimi = plan_lib.plan(_published("kimi-k2.5"), _published("kimi-k2.5-eagle3"), data=1,
                       tensor=8, batch=1, context=32768, with_cost=False, log=quiet)
  assert kimi["fits"], kimi["per_device"]
  assert kimi["capture"] == [2, 30, 58] and kimi["tree"] == [7, 1, 8]
  # INT4 experts: 0.5 byte per weight plus a bf16 scale per 32: far below bf16's 2 bytes.
  assert 60 * 2**30 < kimi["per_device"]["weights"] < 80 * 2**30
  deq = plan_lib.plan(_published("kimi-k2.5"), data=1, tensor=8, batch=1, context=32768,
                      quantization="dequantize", with_cost=False, log=quiet)
  assert not deq["fits"] and deq["per_device"]["weights"] > 200 * 2**30
  ds = plan_lib.plan(_published("deepseek-v3"), data=1, tensor=8, batch=1, context=32768,
                     with_cost=False, log=quiet)
  assert ds["fits"], ds["per_device"]
