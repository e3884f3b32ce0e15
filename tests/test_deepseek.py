"""DeepSeek-V3 / Kimi-K2 targets: transformers parity, FP8, sharding, caches, lossless decoding,
the seed scenario (a 61-layer Kimi-K2-shaped target with captures [2, 30, 58])."""

import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

import eagle3jax
from eagle3jax.capture import CaptureSpec
from eagle3jax.stack import layer_at
from eagle3jax.deepseek_config import DeepseekConfig
from eagle3jax.hf_deepseek import dequantize_fp8
from eagle3jax.rope import RopeConfig
from tests import deepseek_models as dm
from tests import engine_helpers
from tests import hf_models

CFG = DeepseekConfig.tiny()
CAPTURE = CaptureSpec((-1, 0, 2, 3))


def _check_parity(target, torch_model, ids, capture_ids, atol=1e-4):
  ref_logits, ref_layers = hf_models.hf_outputs(torch_model, ids)
  out = eagle3jax.forward(target, ids, capture=capture_ids)
  err = float(np.abs(np.asarray(out.logits) - ref_logits).max())
  assert err < atol, f"logits differ by {err}"
  d = target.config.hidden_size
  aux = np.asarray(out.aux_hidden)
  for j, layer in enumerate(capture_ids):
    np.testing.assert_allclose(aux[..., j * d:(j + 1) * d], ref_layers[layer], atol=atol,
                               rtol=0, err_msg=f"capture {layer}")
  return err


# --- parity with transformers ---

@pytest.mark.parametrize("style,model_type,q_lora_rank", [
    ("hf5", "deepseek_v3", 40), ("published", "deepseek_v3", 40), ("hf5", "kimi_k2", 40),
    ("published", "kimi_k2", None)])
def test_logits_and_captures_match_transformers(tmp_path, style, model_type, q_lora_rank):
  torch_model = dm.make_checkpoint(str(tmp_path), style=style, model_type=model_type,
                                   q_lora_rank=q_lora_rank)
  # 29 positions: past original_max_position_embeddings (16), so YaRN's blend matters.
  ids = np.random.default_rng(1).integers(0, dm.VOCAB, (2, 29))
  target = eagle3jax.load_target(str(tmp_path), dtype=jnp.float32)
  assert isinstance(target, eagle3jax.DeepseekForCausalLM)
  assert target.config.model_type == model_type
  assert target.config.rope.rope_type == "yarn" and target.config.rope.factor == 4.0
  err = _check_parity(target, torch_model, ids, (-1, 0, 1, 3))
  print(f"parity {style}/{model_type}/q_lora={q_lora_rank}: max logits error {err:.2e}")


def test_yarn_attention_factor_matches_transformers(tmp_path):
  torch_model = dm.make_checkpoint(str(tmp_path), yarn=dm.YARN_NO_MSCALE)
  target = eagle3jax.load_target(str(tmp_path), dtype=jnp.float32)
  assert target.config.rope.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
  assert target.config.softmax_scale == pytest.approx(20 ** -0.5)
  ids = np.random.default_rng(3).integers(0, dm.VOCAB, (1, 27))
  _check_parity(target, torch_model, ids, (-1, 3))


def test_correction_bias_changes_routing(tmp_path):
  """The parity checkpoint's bias is large enough that selection differs without it."""
  dm.make_checkpoint(str(tmp_path))
  target = eagle3jax.load_target(str(tmp_path), dtype=jnp.float32)
  moe = layer_at(target.moe_layers, 0).mlp  # global layer 1
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 48)), jnp.float32)
  with_bias = np.asarray(moe.routing(x)) > 0
  moe.e_score_correction_bias[...] = jnp.zeros_like(moe.e_score_correction_bias[...])
  without = np.asarray(moe.routing(x)) > 0
  assert with_bias.sum(-1).max() == 2 and (with_bias != without).any()


def test_config_styles_and_text_config_nesting_agree(tmp_path):
  dm.make_checkpoint(str(tmp_path / "a"), style="hf5", model_type="kimi_k2")
  dm.make_checkpoint(str(tmp_path / "b"), style="published", model_type="kimi_k2")
  with open(tmp_path / "a" / "config.json") as f:
    a = DeepseekConfig.from_hf(json.load(f))
  with open(tmp_path / "b" / "config.json") as f:
    hf_b = json.load(f)
  assert DeepseekConfig.from_hf(hf_b) == a
  nested = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": hf_b}
  assert DeepseekConfig.from_hf(nested) == a
  assert a.rope.mscale == a.rope.mscale_all_dim == 0.707 and a.rope.attention_factor == 1.0
  assert a.softmax_scale == pytest.approx(20 ** -0.5 * (0.1 * 0.707 * np.log(4.0) + 1) ** 2)


def test_kimi_k25_checkpoint_with_text_config_loads(tmp_path):
  """Language model under ``language_model.``, other towers ignored."""
  torch_model = dm.make_checkpoint(str(tmp_path / "k2"), model_type="kimi_k2")
  tensors = safetensors.torch.load_file(str(tmp_path / "k2" / "model.safetensors"))
  wrapped = {"language_model." + k: v for k, v in tensors.items()}
  wrapped["vision_tower.patch_embed.weight"] = tensors["model.norm.weight"].clone()
  os.makedirs(tmp_path / "k25")
  safetensors.torch.save_file(wrapped, str(tmp_path / "k25" / "model.safetensors"))
  with open(tmp_path / "k2" / "config.json") as f:
    text = json.load(f)
  with open(tmp_path / "k25" / "config.json", "w") as f:
    json.dump({"model_type": "kimi_k25", "text_config": text}, f)
  target = eagle3jax.load_target(str(tmp_path / "k25"), dtype=jnp.float32)
  ids = np.random.default_rng(2).integers(0, dm.VOCAB, (1, 20))
  _check_parity(target, torch_model, ids, (-1, 2))


# --- FP8 ---

def test_dequantize_fp8_partial_blocks():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(300, 200)).astype(np.float32) * np.linspace(0.1, 3, 200)
  q, s = dm.quantize_blockwise(w, (128, 128))
  assert tuple(s.shape) == (3, 2)
  q8 = q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
  back = dequantize_fp8(q8, s.numpy(), (128, 128))
  # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); near zero, half a subnormal step.
  scale = np.repeat(np.repeat(s.numpy(), 128, 0), 128, 1)[:300, :200]
  assert (np.abs(back - w) <= 2.0 ** -4 * np.abs(w) + scale * 2.0 ** -10 + 1e-12).all()
  assert np.abs(back - w).max() > 0  # it was rounded
  with pytest.raises(ValueError, match="scale_inv has shape"):
    dequantize_fp8(np.zeros((300, 200), np.float32), np.ones((2, 2), np.float32), (128, 128))


def test_fp8_checkpoint_dequantises_on_load(tmp_path):
  torch_model = dm.make_checkpoint(str(tmp_path / "f32"))
  dm.to_fp8_checkpoint(str(tmp_path / "f32"), str(tmp_path / "fp8"))
  fp8 = eagle3jax.load_target(str(tmp_path / "fp8"), dtype=jnp.float32,
                              quantization="dequantize")  # keep: tests/test_quant.py
  ref = eagle3jax.load_target(str(tmp_path / "f32"), dtype=jnp.float32)
  # One weight, exactly as the block formula says.
  tensors = safetensors.torch.load_file(str(tmp_path / "fp8" / "model.safetensors"))
  q = tensors["model.layers.1.self_attn.kv_b_proj.weight"].float().numpy()
  s = tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].numpy()
  want = (q * s[0, 0]).T.reshape(32, 4, 22)
  np.testing.assert_allclose(np.asarray(fp8.moe_layers.self_attn.kv_b_proj[...][0]), want,
                             rtol=1e-6)
  w_ref = np.asarray(ref.moe_layers.mlp.gate_proj[...][0])
  w_fp8 = np.asarray(fp8.moe_layers.mlp.gate_proj[...][0])
  assert np.abs(w_fp8 - w_ref).max() <= 2.0 ** -4 * np.abs(w_ref).max()
  # The FP8 model is exactly the dequantised model (torch, from a float32 copy) ...
  ids = np.random.default_rng(1).integers(0, dm.VOCAB, (2, 24))
  dm.dequantized_copy(str(tmp_path / "fp8"), str(tmp_path / "deq"))
  deq_torch = transformers.DeepseekV3ForCausalLM.from_pretrained(
      str(tmp_path / "deq"), dtype=torch.float32).eval()
  err = _check_parity(fp8, deq_torch, ids, (-1, 1, 3))
  # ... and differs from the original float32 model by fp8 rounding (which can flip a
  # routing decision, so only the typical logit is compared).
  a = np.asarray(eagle3jax.forward(fp8, ids).logits)
  b, _ = hf_models.hf_outputs(torch_model, ids)
  rel = np.median(np.abs(a - b)) / np.median(np.abs(b))
  print(f"fp8: logits vs dequantised torch max error {err:.2e}; vs the float32 original "
        f"median relative error {rel:.3f}")
  assert rel < 0.25
  # bf16 requested: still dequantised (not reinterpreted).
  bf = eagle3jax.load_target(str(tmp_path / "fp8"), dtype=jnp.bfloat16,
                             quantization="dequantize")
  assert bf.moe_layers.self_attn.kv_b_proj[...].dtype == jnp.bfloat16
  assert bf.moe_layers.mlp.gate[...].dtype == jnp.float32  # the router stays float32


# --- sharding ---

@pytest.fixture(scope="module")
def reference():
  ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 21))
  model = eagle3jax.init_deepseek(CFG, seed=7, std=0.1)
  return ids, eagle3jax.forward(model, ids, capture=CAPTURE)


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
def test_sharded_equals_unsharded(reference, mesh_shape):
  ids, ref = reference
  model = eagle3jax.init_deepseek(CFG, mesh=eagle3jax.make_mesh(*mesh_shape), seed=7, std=0.1)
  attn = model.moe_layers.self_attn  # stacked [L, ...]: the layer axis is never sharded
  assert attn.q_b_proj[...].sharding.spec == P(None, None, "tensor", None)
  assert attn.kv_b_proj[...].sharding.spec == P(None, None, "tensor", None)
  assert attn.o_proj[...].sharding.spec == P(None, "tensor", None, None)
  for name in ("q_a_proj", "kv_a_proj_with_mqa"):
    assert getattr(attn, name)[...].sharding.spec == P(None, None, None)
  assert attn.kv_a_layernorm.weight[...].sharding.spec == P(None, None)
  assert model.moe_layers.mlp.gate_proj[...].sharding.spec == P(None, "tensor", None, None)
  out = eagle3jax.forward(model, ids, capture=CAPTURE)
  assert out.aux_hidden.sharding.spec == P("data", None, None)
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.aux_hidden), np.asarray(ref.aux_hidden), atol=1e-5)


def test_expert_parameters_split_over_devices():
  cfg = DeepseekConfig.tiny(n_routed_experts=16, n_group=4, topk_group=2)
  model = eagle3jax.init_deepseek(cfg, mesh=eagle3jax.make_mesh(1, 8))
  per_device, total = {}, 0
  for layer in [model.moe_layers]:
    for name in ("gate_proj", "up_proj", "down_proj"):
      arr = getattr(layer.mlp, name)[...]
      total += arr.nbytes
      for s in arr.addressable_shards:
        per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
  stats = jax.devices()[0].memory_stats()
  print(f"expert parameters: total {total} bytes; per device "
        f"{sorted(per_device.values())} (total/8 = {total // 8}); memory_stats: "
        f"{'unavailable' if stats is None else stats.get('bytes_in_use')}")
  assert len(per_device) == 8
  assert all(v == total // 8 for v in per_device.values())


# --- caches ---

@functools.partial(jax.jit, static_argnames=("graphdef", "capture"))
def _extend(graphdef, state, tokens, positions, cache, tree_mask, capture):
  model = nnx.merge(graphdef, state)
  return model(tokens, positions, cache, tree_mask, capture)


def _run(model, tokens, positions, cache, tree_mask, capture):
  graphdef, state = nnx.split(model)
  with jax.set_mesh(model.mesh):
    return _extend(graphdef, state, tokens, positions, cache, tree_mask, capture)


def test_tree_extend_matches_full_forward_of_each_branch():
  model = eagle3jax.init_deepseek(CFG, seed=3, std=0.1)
  capture = CaptureSpec((-1, 1, 3))
  rng = np.random.default_rng(1)
  prefix = rng.integers(0, CFG.vocab_size, 18)  # positions past 16: YaRN in play
  parent = [-1, 0, 0, 1, 2, 3]
  depth = [0, 1, 1, 2, 2, 3]
  tokens = rng.integers(0, CFG.vocab_size, 6)
  p = len(parent)
  mask = engine_helpers.ancestor_mask(parent)
  with jax.set_mesh(model.mesh):
    cache = model.allocate_cache(1, 32, fill=np.nan)  # never rely on zeroed memory
  assert cache.k.shape == (CFG.num_hidden_layers, 1, 1, 32, CFG.kv_lora_rank)
  assert cache.v.shape == (CFG.num_hidden_layers, 1, 1, 32, CFG.qk_rope_head_dim)
  t = len(prefix)
  _, _, cache = _run(model, jnp.asarray(prefix[None]), jnp.arange(t)[None], cache,
                     jnp.tril(jnp.ones((1, t, t), bool)), capture)
  cache = cache.with_lengths(jnp.array([t], jnp.int32))
  lg, ax, _ = _run(model, jnp.asarray(tokens[None]), jnp.asarray(t + np.array(depth))[None],
                   cache, jnp.asarray(mask[None]), capture)
  # Full forwards of every branch, padded to one length (causal: padding cannot leak back).
  seqs = np.zeros((p, t + 4), np.int64)
  ends = []
  for i in range(p):
    seq = np.concatenate([prefix, engine_helpers.branch(parent, tokens, i)])
    seqs[i, :len(seq)] = seq
    ends.append(len(seq) - 1)
  full = eagle3jax.forward(model, seqs, capture=capture)
  for i in range(p):
    np.testing.assert_allclose(np.asarray(lg[0, i]), np.asarray(full.logits[i, ends[i]]),
                               atol=2e-5)
    np.testing.assert_allclose(np.asarray(ax[0, i]), np.asarray(full.aux_hidden[i, ends[i]]),
                               atol=2e-5)


# --- lossless speculative decoding ---

def _drafter_cfg(cfg: DeepseekConfig, capture: CaptureSpec) -> eagle3jax.DrafterConfig:
  """A Llama-architecture EAGLE-3 drafter for a DeepSeek target (as Kimi-K2's drafters)."""
  return eagle3jax.DrafterConfig(
      hidden_size=cfg.hidden_size, intermediate_size=88, num_attention_heads=8,
      num_key_value_heads=2, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size,
      capture=capture, rms_norm_eps=cfg.rms_norm_eps, rope=RopeConfig(theta=10000.0),
      max_position_embeddings=cfg.max_position_embeddings)


def _copy_drafter(tgt, capture):
  """Proposes the token two back (see tests/engine_helpers.copy_drafter): some drafts are
  accepted and some rejected, so every acceptance path runs."""
  dr = eagle3jax.init_drafter(_drafter_cfg(tgt.config, capture), target=tgt, seed=1, std=0.1)
  return engine_helpers.make_copy_drafter(dr, tgt)


PROMPTS = [[5, 6, 7, 8, 9, 10, 3], [1, 3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def decode_target():
  return eagle3jax.init_deepseek(DeepseekConfig.tiny(num_hidden_layers=3), seed=0, std=0.1)


@pytest.fixture(scope="module")
def baseline(decode_target):
  return eagle3jax.generate(decode_target, None, PROMPTS, max_new_tokens=14).tokens


@pytest.mark.parametrize("steps,topk,draft", [(3, 1, 4), (4, 3, 8)])
def test_greedy_speculative_is_lossless(decode_target, baseline, steps, topk, draft):
  dr = _copy_drafter(decode_target, CaptureSpec((-1, 0, 2)))
  res = eagle3jax.generate(decode_target, dr, PROMPTS, max_new_tokens=14, num_steps=steps,
                           topk=topk, num_draft_tokens=draft)
  assert res.tokens == baseline
  assert res.stats["accept_length_mean"] > 1.0  # drafts were accepted along the way


# --- the seed scenario: a 61-layer Kimi-K2-shaped target, captures [2, 30, 58] ---

SEED_CFG = DeepseekConfig.tiny(
    num_hidden_layers=61, hidden_size=64, intermediate_size=40, moe_intermediate_size=8,
    num_attention_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
    topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, model_type="kimi_k2",
    rope=RopeConfig(theta=50000.0, rope_type="yarn", factor=32.0,
                    original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0))
SEED_IDS = (2, 30, 58)


@pytest.fixture(scope="module")
def seed_target():
  return eagle3jax.init_deepseek(SEED_CFG, seed=5, std=0.1)


def _greedy_by_full_forward(target, prompt, new_tokens, width):
  """Greedy decoding by full forwards over one padded width (a single compilation)."""
  seq = list(prompt)
  for _ in range(new_tokens):
    ids = np.zeros((1, width), np.int64)
    ids[0, :len(seq)] = seq
    logits = eagle3jax.forward(target, ids, capture=SEED_IDS).logits
    seq.append(int(np.argmax(np.asarray(logits[0, len(seq) - 1]))))
  return seq[len(prompt):]


def test_seed_scenario_on_eight_devices(seed_target):
  """Kept to few compilations of the 61-layer model: the speculative run (prefill + decode)
  and one forward shape per mesh; the greedy reference reuses the 8-device forward."""
  mesh = eagle3jax.make_mesh(1, 8)
  target = eagle3jax.init_deepseek(SEED_CFG, mesh=mesh, seed=5, std=0.1)
  drafter = _copy_drafter(target, CaptureSpec(SEED_IDS))
  prompt = [5, 6, 7, 8, 9, 10, 3, 4]
  with pytest.raises(ValueError, match=r"\[-1, 2, 30\].*\[2, 30, 58\]"):
    eagle3jax.generate(target, drafter, [prompt], max_new_tokens=4, capture=[-1, 2, 30])
  spec = eagle3jax.generate(target, drafter, [prompt], max_new_tokens=5, num_steps=2, topk=1,
                            capture=list(SEED_IDS)).tokens
  assert spec == [_greedy_by_full_forward(target, prompt, 5, 24)]
  ids = np.asarray([prompt * 3])
  one = eagle3jax.forward(seed_target, ids, capture=SEED_IDS)
  eight = eagle3jax.forward(target, ids, capture=SEED_IDS)
  assert eight.aux_hidden.shape == (1, 24, 3 * 64)
  # 58 layers deep the captures reach |x| ~ 5: float32 reduction order differs by ~3e-6
  # relative between the meshes.
  np.testing.assert_allclose(np.asarray(eight.aux_hidden), np.asarray(one.aux_hidden),
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(eight.logits), np.asarray(one.logits), atol=1e-5,
                             rtol=1e-5)


def test_kimi_drafter_without_convention(tmp_path, seed_target, caplog):
  drafter = eagle3jax.init_drafter(_drafter_cfg(SEED_CFG, CaptureSpec(SEED_IDS)),
                                   target=seed_target)
  eagle3jax.save_drafter(drafter, str(tmp_path))
  with open(tmp_path / "config.json") as f:
    hf = json.load(f)
  del hf["eagle_config"]["aux_layer_convention"]
  assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf, f)
  with pytest.raises(ValueError, match="aux_layer_convention"):
    eagle3jax.load_drafter(str(tmp_path), target=seed_target)
  with caplog.at_level(logging.INFO, logger="eagle3jax"):
    # verify_capture=False: this test is about reading the ids (a probe would run the
    # 61-layer target through generate).
    loaded = eagle3jax.load_drafter(str(tmp_path), target=seed_target,
                                    aux_layer_convention="input", verify_capture=False)
  assert loaded.config.capture.layer_ids == (1, 29, 57)
  assert "[1, 29, 57]" in caplog.text


# --- bad input ---

def _hf(**changes):
  hf = dm.hf_config().to_dict()
  hf.update(changes)
  return hf


@pytest.mark.parametrize("changes,field", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=3), "topk_group"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(model_type="deepseek_v2"), "model_type"),
    (dict(use_mla_v9=True), "use_mla_v9"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type"),
    (dict(rope_parameters={**dm.YARN, "rope_theta": 1e4, "warp": 1}), "warp"),
])
def test_unsupported_config_values_are_refused(changes, field):
  with pytest.raises(ValueError, match=field):
    DeepseekConfig.from_hf(_hf(**changes))


def test_routing_fields_without_one_default_must_be_stated():
  """Left out, norm_topk_prob, routed_scaling_factor and n_group/topk_group read as DeepSeek's
  own code's defaults, while transformers reads others (0.8 off its logits)."""
  for field in ("norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group"):
    hf = _hf()
    hf.pop(field)
    with pytest.raises(ValueError, match=rf"leaves out the routing fields \['{field}'\], whose "
                                         r"defaults differ between DeepSeek's own code and "
                                         r"transformers \(" + field):
      DeepseekConfig.from_hf(hf)
  assert DeepseekConfig.from_hf(_hf(n_group=None, topk_group=None)).n_group == 1
  with pytest.raises(ValueError, match=r"routed_scaling_factor=None must be a number$"):
    DeepseekConfig.from_hf(_hf(routed_scaling_factor=None))  # no "(or absent": it may not be
  with pytest.raises(ValueError, match="norm_topk_prob=None must be true or false"):
    DeepseekConfig.from_hf(_hf(norm_topk_prob=None))


def test_yarn_nulls_and_whole_floats_in_the_published_config():
  """Nulls in a YaRN rope_scaling gave TypeErrors from int(None) or None / int; integers
  written as whole floats (8192.0) load as before."""
  with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                         "deepseek-v3.json")) as f:
    base = json.load(f)
  ref = DeepseekConfig.from_hf(base)

  def edited(**rope):
    hf = json.loads(json.dumps(base))
    for k, v in rope.items():
      if v is ...:
        hf["rope_scaling"].pop(k)
      else:
        hf["rope_scaling"][k] = v
    return hf
  # Null is absent: the original length defaults to max_position_embeddings, as transformers.
  assert DeepseekConfig.from_hf(edited(original_max_position_embeddings=None)) \
      .rope.original_max_position_embeddings == base["max_position_embeddings"]
  assert DeepseekConfig.from_hf(edited(mscale=None)).rope.mscale == 0.0
  assert DeepseekConfig.from_hf(edited(original_max_position_embeddings=4096.0)) == ref
  assert DeepseekConfig.from_hf({**base, "n_group": 8.0}) == ref
  no_top = edited(factor=...)
  no_top["max_position_embeddings"] = None
  with pytest.raises(ValueError, match="config field max_position_embeddings=None must be an "
                                       "integer"):
    DeepseekConfig.from_hf(no_top)
  no_top.pop("max_position_embeddings")
  with pytest.raises(ValueError, match=r"rope_scaling.factor is missing for rope type 'yarn'"):
    DeepseekConfig.from_hf(no_top)
  with pytest.raises(ValueError, match=r"config field rope_scaling.beta_fast='32' must be a "
                                       r"number$"):
    DeepseekConfig.from_hf(edited(beta_fast="32"))


def test_bfloat16_batches_run_on_cpu():
  """A bfloat16 DeepSeek model (load_target's default dtype) crashed on CPU at batch 2 and
  more: XLA:CPU has no bf16 x bf16 = f32 dot for the absorbed attention's value product."""
  cfg = DeepseekConfig.tiny()
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
  ref = np.asarray(eagle3jax.forward(eagle3jax.init_deepseek(cfg, seed=3, std=0.1), ids).logits)
  bf16 = eagle3jax.init_deepseek(cfg, dtype=jnp.bfloat16, seed=3, std=0.1)
  got = np.asarray(eagle3jax.forward(bf16, ids).logits, np.float32)
  assert np.max(np.abs(got - ref)) < 0.05 * np.max(np.abs(ref))  # bfloat16 noise
  out = eagle3jax.generate(bf16, None, [[5, 6, 7], [8, 9]], max_new_tokens=4, eos_ids=[])
  assert [len(t) for t in out.tokens] == [4, 4]


def test_init_functions_name_the_config_they_take():
  with pytest.raises(ValueError, match="init_deepseek takes a DeepseekConfig, got LlamaConfig: "
                                       "use init_target"):
    eagle3jax.init_deepseek(eagle3jax.LlamaConfig.tiny())
  with pytest.raises(ValueError, match="init_target takes a LlamaConfig, got DeepseekConfig: "
                                       "use eagle3jax.init_deepseek"):
    eagle3jax.init_target(DeepseekConfig.tiny())


def test_unsupported_quantization_is_refused(tmp_path):
  dm.make_checkpoint(str(tmp_path))
  with open(tmp_path / "config.json") as f:
    hf = json.load(f)
  hf["quantization_config"] = {"quant_method": "bitsandbytes"}
  with open(tmp_path / "config.json", "w") as f:
    json.dump(hf, f)
  with pytest.raises(ValueError, match="quantization_config.quant_method"):
    eagle3jax.load_target(str(tmp_path), dtype=jnp.float32)


def test_llama_targets_still_refuse_yarn():
  hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    eagle3jax.LlamaConfig.from_hf(hf)
