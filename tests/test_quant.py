"""Quantized targets: FP8 blocks and compressed-tensors INT4 held as stored on the devices.

Layouts against compressed-tensors' own packer and a numpy block reference; the published
configs' quantization (and refusals); tiny DeepSeek-V3 checkpoints in FP8 and in Kimi-K2.5's
published INT4 layout loaded with ``quantization="keep"`` against ``"dequantize"`` (one device
and 8) and against transformers; resident bytes; lossless speculative decoding; and that the
compiled forward never holds a dequantized whole layer stack.
"""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import (pack_to_int32,
                                                                   unpack_from_int32)
from flax import nnx

import eagle3jax
from eagle3jax import api, quant, quant_io
from eagle3jax.capture import CaptureSpec
from eagle3jax.deepseek import DeepseekForCausalLM
from eagle3jax.deepseek_config import DeepseekConfig
from eagle3jax.hf_target import check_hf_config, read_config, target_factory
from eagle3jax.params import materialize, random_fill
from eagle3jax.quant_config import QuantizationConfig, linear_schemes
from eagle3jax.sharding import param_spec
from eagle3jax.weights import Linear, deepseek_table
from tests import deepseek_models as dm
from tests import engine_helpers
from tests import hf_models

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
CAPTURE = (-1, 0, 2, 3)


def _config(name):
  with open(os.path.join(CONFIGS, name)) as f:
    return json.load(f)


def _device_dequant(values, scale, scheme, n_out):
  return np.asarray(quant._dequantize_arrays(jnp.asarray(values), jnp.asarray(scale), scheme,
                                             n_out, jnp.float32))


# --- layouts ---

@pytest.mark.parametrize("out,inn,group", [(6, 64, 32), (5, 48, 32), (3, 40, 16)])
def test_int4_layout_matches_compressed_tensors(out, inn, group):
  """Partial groups and rows whose length is not a multiple of 32 (pack_to_int32 pads)."""
  rng = np.random.default_rng(0)
  q = rng.integers(-8, 8, (out, inn)).astype(np.int8)
  packed = pack_to_int32(torch.from_numpy(q), 4)
  np.testing.assert_array_equal(quant_io.unpack_int4(packed.numpy(), inn), q)
  np.testing.assert_array_equal(
      unpack_from_int32(packed, 4, torch.Size([out, inn])).numpy(), q)
  scale = torch.from_numpy(rng.uniform(0.5, 2, (out, -(-inn // group))).astype(np.float32))
  scale = scale.to(torch.bfloat16)
  scheme = quant.QuantScheme("int4_group", group)
  want = q.astype(np.float32) * scale.float().numpy().repeat(group, 1)[:, :inn]
  np.testing.assert_array_equal(
      quant_io.dequantize_int4(packed.numpy(), scale.view(torch.int16).numpy().view(
          ml_dtypes.bfloat16), [out, inn], group), want)
  # In our layout: [in, out], two values per byte along in; and with in split into heads.
  bf16 = scale.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  for in_dims in [(inn,), (2, inn // 2)]:
    lin = Linear(in_dims, (out,))
    values, sc = quant_io.int4_to_device(packed.numpy(), bf16, np.array([out, inn]), scheme,
                                         lin)
    assert values.dtype == np.uint8 and values.shape == (*in_dims[:-1], in_dims[-1] // 2, out)
    got = _device_dequant(values, sc, scheme, 1)
    np.testing.assert_array_equal(got, want.T.reshape(*in_dims, out))
  # And through the parameter container (w[...]).
  w = nnx.eval_shape(lambda: quant.QuantizedParam((inn, out), (None, None), scheme, n_out=1,
                                                  dtype=jnp.float32))
  vals, sc = quant_io.int4_to_device(packed.numpy(), bf16, np.array([out, inn]), scheme,
                                     Linear((inn,), (out,)))
  w.values.set_value(jnp.asarray(vals))
  w.scale.set_value(jnp.asarray(sc))
  assert w.shape == (inn, out)
  np.testing.assert_array_equal(np.asarray(w[...]), want.T)


def _numpy_block_reference(q, s, block):
  """Dequantization written out block by block."""
  out = np.zeros(q.shape, np.float32)
  bo, bi = block
  for r in range(s.shape[0]):
    for c in range(s.shape[1]):
      out[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (
          q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].astype(np.float32) * s[r, c])
  return out


def test_e4m3_bytes_decode_exactly():
  """Every one of the 256 e4m3fn byte values decodes to ml_dtypes' float (NaN for NaN)."""
  b = np.arange(256, dtype=np.uint8)
  want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(quant._e4m3_bits_to_f32(jnp.asarray(b)))  # pylint: disable=protected-access
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("in_dims,out_dims,block", [
    ((200,), (300,), (128, 128)),       # partial blocks both ways
    ((4, 10), (3, 20), (16, 8)),        # o_proj-like: blocks straddle heads, in and out
    ((96,), (2, 48), (128, 32))])
def test_fp8_layout_matches_block_reference(in_dims, out_dims, block):
  rng = np.random.default_rng(1)
  n_in, n_out = math.prod(in_dims), math.prod(out_dims)
  w = rng.normal(size=(n_out, n_in)).astype(np.float32)
  q, s = dm.quantize_blockwise(w, block)
  q8 = q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
  want = _numpy_block_reference(q8, s.numpy(), block)
  np.testing.assert_array_equal(quant_io.dequantize_fp8(q8, s.numpy(), block), want)
  scheme = quant.QuantScheme("fp8_block", block[1], block[0])
  lin = Linear(in_dims, out_dims)
  values, scale = quant_io.fp8_to_device(q8, s.numpy(), scheme, lin)
  assert values.dtype == np.uint8 and values.shape == in_dims + out_dims  # the e4m3 bytes
  np.testing.assert_array_equal(_device_dequant(values, scale, scheme, len(out_dims)),
                                lin.to_ours(want))
  with pytest.raises(ValueError, match="scale_inv has shape"):
    quant_io.fp8_to_device(q8, np.ones((1, 1), np.float32), scheme, lin)


class _Experts(nnx.Module):
  def __init__(self):
    scheme = quant.QuantScheme("int4_group", 16)
    self.q = quant.linear_param((8, 32, 6), ("expert", "embed", None), jnp.float32, n_out=1,
                                scheme=scheme)
    self.p = quant.linear_param((8, 32, 6), ("expert", "embed", None), jnp.float32, n_out=1)


def test_take_gathers_rows_before_dequantizing():
  """Eagerly on one device and jitted with experts sharded over tensor=8 (2-D ids)."""
  ids = np.array([[3, 0], [3, 7]])
  for mesh in (eagle3jax.make_mesh(1, 1), eagle3jax.make_mesh(1, 8)):
    m = materialize(_Experts, mesh, random_fill(0, 0.1))
    assert isinstance(m.q, quant.QuantizedParam) and m.q.shape == (8, 32, 6)
    graphdef, state = nnx.split(m)

    @jax.jit
    def gather(state, ids):
      mod = nnx.merge(graphdef, state)  # pylint: disable=cell-var-from-loop
      return quant.take(mod.q, ids), quant.take(mod.p, ids), quant.dequantize(mod.p)

    with jax.set_mesh(mesh):
      q, p, full = gather(state, jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(m.q[...])[ids])
    np.testing.assert_array_equal(np.asarray(p), np.asarray(full)[ids])
  assert quant.dequantize(m.p, jnp.bfloat16).dtype == jnp.bfloat16


# --- configs ---

def test_published_configs_parse_with_their_quantization():
  names = {}
  for name, kind, layers in [("deepseek-v3.json", "fp8_block", 61),
                             ("kimi-k2-instruct.json", "fp8_block", 61),
                             ("kimi-k2.5.json", "int4_group", 61)]:
    hf = _config(name)
    cfg = DeepseekConfig.from_hf(hf)
    assert cfg.num_hidden_layers == layers and cfg.n_routed_experts == (
        256 if name.startswith("deepseek") else 384)
    q = QuantizationConfig.from_hf(hf)
    assert q.scheme.kind == kind
    names[name] = linear_schemes(q, deepseek_table(cfg), cfg.num_hidden_layers)
  k25 = QuantizationConfig.from_hf(_config("kimi-k2.5.json"))
  assert k25.scheme == quant.QuantScheme("int4_group", 32)
  # Kimi-K2.5: only the routed experts; attention, shared experts, dense MLPs, lm_head bf16.
  assert set(names["kimi-k2.5.json"]) == {f"layers.{i}.mlp.{p}_proj" for i in range(1, 61)
                                         for p in ("gate", "up", "down")}
  for module in ["language_model.model.layers.5.mlp.experts.17.down_proj",
                 "model.layers.5.mlp.experts.17.down_proj"]:
    assert k25.scheme_for(module) is not None
  for module in ["language_model.lm_head", "lm_head", "model.layers.0.mlp.gate_proj",
                 "language_model.model.layers.3.self_attn.kv_b_proj",
                 "model.layers.3.mlp.shared_experts.up_proj", "model.layers.3.mlp.gate"]:
    assert k25.scheme_for(module) is None, module
  # DeepSeek-V3 FP8: every projection (kv_a_proj_with_mqa included), not lm_head/router.
  v3 = names["deepseek-v3.json"]
  assert v3["layers.0.self_attn.kv_a_proj_with_mqa"].kind == "fp8_block"
  assert v3["layers.0.mlp.down_proj"] == quant.QuantScheme("fp8_block", 128, 128)
  assert v3["layers.9.mlp.shared_experts.gate_proj"].kind == "fp8_block"
  assert "lm_head" not in v3 and "layers.9.mlp.gate" not in v3
  assert len(v3) == 5 * 61 + 3 * 3 + 58 * 6


def test_native_deepseek_config_is_refused_as_not_hugging_face():
  native = _config("deepseek-v3-native-config_671B.json")
  with pytest.raises(ValueError, match="is not a Hugging Face config.*deepseek_v3"):
    check_hf_config(native)
  with pytest.raises(ValueError, match="is not a Hugging Face config"):
    target_factory(native, eagle3jax.make_mesh(1, 1), jnp.bfloat16)


def _ct(**changes):
  q = json.loads(json.dumps(dm.KIMI_K25_QUANT))
  for path, value in changes.items():
    node = q
    keys = path.split("__")
    for k in keys[:-1]:
      node = node[k]
    node[keys[-1]] = value
  return {"quantization_config": q}


@pytest.mark.parametrize("hf,field", [
    (_ct(format="float-quantized"), "format='float-quantized'"),
    (_ct(quantization_status="frozen"), "quantization_status='frozen'"),
    (_ct(config_groups__group_0__weights__num_bits=8), "weights.num_bits=8"),
    (_ct(config_groups__group_0__weights__strategy="channel"), "weights.strategy='channel'"),
    (_ct(config_groups__group_0__weights__symmetric=False), "weights.symmetric=False"),
    (_ct(config_groups__group_0__weights__type="float"), "weights.type='float'"),
    (_ct(config_groups__group_0__weights__actorder="group"), "weights.actorder='group'"),
    (_ct(config_groups__group_0__input_activations={"num_bits": 8}), "input_activations"),
    (_ct(config_groups__group_0__targets=["Embedding"]), "targets"),
    (_ct(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2",
                              "weight_block_size": [128, 128]}}, "fmt='e5m2'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": None}},
     "weight_block_size=None"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                              "weight_block_size": [128, 128]}}, "activation_scheme='static'"),
])
def test_unsupported_quantization_is_refused_naming_the_field(hf, field):
  with pytest.raises(ValueError, match=r"quantization_config\..*" + re.escape(field)):
    QuantizationConfig.from_hf(hf)


def test_no_quantization_config_is_none_and_ignore_matches_both_names():
  assert QuantizationConfig.from_hf({"model_type": "deepseek_v3"}) is None
  q = QuantizationConfig.from_hf(_ct(ignore=["model.layers.1.mlp.experts.0.up_proj",
                                             "re:language_model\\.model\\.layers\\.2\\..*"]))
  assert q.scheme_for("language_model.model.layers.1.mlp.experts.0.up_proj") is None
  assert q.scheme_for("model.layers.2.mlp.experts.3.up_proj") is None
  assert q.scheme_for("model.layers.1.mlp.experts.1.up_proj") is not None
  cfg = DeepseekConfig.tiny()
  with pytest.raises(ValueError, match="experts must agree"):
    linear_schemes(q, deepseek_table(cfg), cfg.num_hidden_layers)


# --- checkpoints: keep == dequantize == transformers ---

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("quant")
  dm.make_checkpoint(str(root / "f32"))
  dm.to_fp8_checkpoint(str(root / "f32"), str(root / "fp8"), block=(16, 16))
  dm.dequantized_copy(str(root / "fp8"), str(root / "fp8_deq"))
  dm.to_kimi_k25_int4_checkpoint(str(root / "f32"), str(root / "int4"))
  dm.int4_dequantized_copy(str(root / "int4"), str(root / "int4_deq"))
  return root


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_keep_equals_dequantize_and_transformers(checkpoints, fmt, caplog):
  ids = np.random.default_rng(1).integers(0, dm.VOCAB, (2, 23))
  path = str(checkpoints / fmt)
  with caplog.at_level("INFO", logger="eagle3jax"):
    keep = eagle3jax.load_target(path, dtype=jnp.float32)
  kept = type(keep.moe_layers.mlp.gate_proj)
  assert kept is quant.QuantizedParam
  if fmt == "int4":
    assert "vision_tower.*" in caplog.text and "mm_projector.*" in caplog.text
    assert keep.moe_layers.mlp.gate_proj.values[...].dtype == jnp.uint8
    assert not isinstance(keep.moe_layers.self_attn.kv_b_proj, quant.QuantizedParam)
    assert not isinstance(keep.moe_layers.mlp.shared_experts.up_proj, quant.QuantizedParam)
  else:
    assert keep.moe_layers.self_attn.kv_b_proj.values[...].dtype == jnp.uint8  # e4m3 bytes
    assert isinstance(keep.dense_layers.mlp.up_proj, quant.QuantizedParam)
  assert not isinstance(keep.lm_head, quant.QuantizedParam)
  deq = eagle3jax.load_target(path, dtype=jnp.float32, quantization="dequantize")
  assert not isinstance(deq.moe_layers.mlp.gate_proj, quant.QuantizedParam)
  assert quant.dequantized_nbytes(keep, jnp.float32) == quant.nbytes(deq)
  assert quant.nbytes(keep) < quant.nbytes(deq)
  a = eagle3jax.forward(keep, ids, capture=CAPTURE)
  b = eagle3jax.forward(deq, ids, capture=CAPTURE)
  np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(a.aux_hidden), np.asarray(b.aux_hidden), atol=1e-5,
                             rtol=0)
  torch_model = transformers.DeepseekV3ForCausalLM.from_pretrained(
      str(checkpoints / f"{fmt}_deq"), dtype=torch.float32).eval()
  ref_logits, ref_layers = hf_models.hf_outputs(torch_model, ids)
  err = float(np.abs(np.asarray(a.logits) - ref_logits).max())
  print(f"{fmt} keep vs transformers on the dequantized weights: max logits error {err:.2e}")
  assert err < 1e-4
  d = keep.config.hidden_size
  for j, layer in enumerate(CAPTURE):
    np.testing.assert_allclose(np.asarray(a.aux_hidden)[..., j * d:(j + 1) * d],
                               ref_layers[layer], atol=1e-4, rtol=0)
  # On 8 devices: values and scales shard like the weight; same outputs.
  mesh = eagle3jax.make_mesh(1, 8)
  keep8 = eagle3jax.load_target(path, dtype=jnp.float32, mesh=mesh)
  w = keep8.moe_layers.mlp.down_proj
  assert w.values[...].sharding.spec == w.scale[...].sharding.spec == param_spec(
      ("layers", "expert", None, "embed"), (3, 8, 24, 48), mesh)
  assert w.values[...].sharding.spec[1] == "tensor"
  c = eagle3jax.forward(keep8, ids, capture=CAPTURE)
  np.testing.assert_allclose(np.asarray(c.logits), np.asarray(b.logits), atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(c.aux_hidden), np.asarray(b.aux_hidden), atol=1e-5,
                             rtol=0)


def test_quantized_weight_stored_plain_is_refused(checkpoints, tmp_path):
  """A config that quantizes what the checkpoint stores unquantized names the weight."""
  cfg = read_config(str(checkpoints / "int4"))
  cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*self_attn.*"]
  os.symlink(checkpoints / "int4" / "model.safetensors", tmp_path / "model.safetensors")
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight' is stored "
                                       "unquantized.*dequantize"):
    eagle3jax.load_target(str(tmp_path), dtype=jnp.float32)


def _edited_copy(src, dst, edit, config_edit=None):
  """``src``'s checkpoint in ``dst`` with ``edit(tensors)`` applied (numpy, as stored)."""
  from eagle3jax.safetensors_io import SafetensorsFile
  os.makedirs(dst)
  st = SafetensorsFile(os.path.join(src, "model.safetensors"))
  tensors = {n: np.array(st.get(n)) for n in st.names}
  edit(tensors)
  import safetensors.numpy
  safetensors.numpy.save_file(tensors, os.path.join(dst, "model.safetensors"))
  cfg = read_config(str(src))
  if config_edit:
    config_edit(cfg)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  return str(dst)


def test_dequantize_path_checks_int4_layouts_as_keep_does(checkpoints, tmp_path):
  """``quantization="dequantize"`` sliced packed values and scales to the weight's shape, so a
  scale of other groups (0.12 off) or packed bytes of another dtype (0.57 off) loaded."""
  name = "language_model.model.layers.1.mlp.experts.0.up_proj.weight"

  def regroup(t):  # scales in groups of 16 where the config says 32
    t[name + "_scale"] = np.repeat(t[name + "_scale"], 2, axis=1)

  def as_bytes(t):  # the same bits as uint8 [out, in / 2]
    t[name + "_packed"] = np.ascontiguousarray(t[name + "_packed"]).view(np.uint8)
  for edit, message in ((regroup, r"_scale has shape \(\d+, \d+\), expected \(\d+, \d+\) "
                                  r"\(groups of 32"),
                        (as_bytes, r"_packed is uint8 .*expected int32")):
    path = _edited_copy(checkpoints / "int4", tmp_path / edit.__name__, edit)
    for mode in ("keep", "dequantize"):
      with pytest.raises(ValueError, match=re.escape(name) + message):
        eagle3jax.load_target(path, dtype=jnp.float32, quantization=mode)


@pytest.mark.parametrize("dtype", [np.int8, np.bool_, ml_dtypes.float8_e5m2, np.int64])
def test_non_float_weights_are_refused(checkpoints, tmp_path, dtype):
  """Integer, boolean and float8 e5m2 tensors were cast to float silently."""
  name = "model.layers.1.mlp.gate.e_score_correction_bias"
  path = _edited_copy(checkpoints / "f32", tmp_path / "c",
                      lambda t: t.__setitem__(name, t[name].astype(dtype)))
  with pytest.raises(ValueError, match=rf"tensor '{re.escape(name)}' is {np.dtype(dtype)}: a "
                                       "weight held as stored must be one of"):
    eagle3jax.load_target(path, dtype=jnp.float32)


def test_index_naming_the_wrong_shard_is_named(checkpoints, tmp_path):
  src = checkpoints / "f32"
  os.makedirs(tmp_path / "c")
  for f in ("model.safetensors", "config.json"):
    os.symlink(src / f, tmp_path / "c" / f)
  from eagle3jax.safetensors_io import SafetensorsFile
  names = SafetensorsFile(str(src / "model.safetensors")).names
  weight_map = {n: "model.safetensors" for n in names}
  weight_map["model.layers.9.mlp.up_proj.weight"] = "model.safetensors"
  with open(tmp_path / "c" / "model.safetensors.index.json", "w") as f:
    json.dump({"weight_map": weight_map}, f)
  with pytest.raises(ValueError, match=r"maps weight 'model.layers.9.mlp.up_proj.weight' to "
                                       r"model.safetensors, but that file does not hold it"):
    eagle3jax.load_target(str(tmp_path / "c"), dtype=jnp.float32)


def test_everything_int4_on_a_2x4_mesh_equals_one_device():
  """No ignore list: attention (groups straddling 10-wide heads), dense MLP, shared experts and
  the vocab-sharded lm_head are INT4 too; data=2 x tensor=4 equals one device."""
  qc = QuantizationConfig.from_hf(_ct(ignore=[]))
  cfg = DeepseekConfig.tiny(num_hidden_layers=2, vocab_size=128)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
  outs = []
  for mesh in (eagle3jax.make_mesh(1, 1), eagle3jax.make_mesh(2, 4)):
    m = eagle3jax.init_deepseek(cfg, mesh=mesh, seed=1, std=0.1, quantization=qc)
    assert isinstance(m.lm_head, quant.QuantizedParam)
    assert isinstance(m.dense_layers.self_attn.o_proj, quant.QuantizedParam)
    outs.append(eagle3jax.forward(m, ids, capture=(-1, 1)))
  assert tuple(m.lm_head.values[...].sharding.spec) == (None, "tensor")
  np.testing.assert_allclose(np.asarray(outs[1].logits), np.asarray(outs[0].logits), atol=1e-5,
                             rtol=0)
  np.testing.assert_allclose(np.asarray(outs[1].aux_hidden), np.asarray(outs[0].aux_hidden),
                             atol=1e-5, rtol=0)


# --- resident bytes ---

@pytest.mark.parametrize("config,limit", [("kimi-k2.5.json", 0.40), ("deepseek-v3.json", 0.60)])
def test_resident_bytes(config, limit):
  """Experts dominate (as in the published models); dims are multiples of the groups."""
  cfg = DeepseekConfig.tiny(hidden_size=128, moe_intermediate_size=128, intermediate_size=128,
                            n_routed_experts=64, n_group=4, vocab_size=64, q_lora_rank=32,
                            kv_lora_rank=32, num_attention_heads=2, qk_nope_head_dim=16,
                            v_head_dim=16, num_hidden_layers=3)
  q = QuantizationConfig.from_hf(_config(config))
  schemes = linear_schemes(q, deepseek_table(cfg), cfg.num_hidden_layers)
  # Abstract models: exactly the arrays materialize places (checked on loaded models above).
  kept = nnx.eval_shape(lambda: DeepseekForCausalLM(cfg, dtype=jnp.bfloat16, schemes=schemes))
  plain = nnx.eval_shape(lambda: DeepseekForCausalLM(cfg, dtype=jnp.bfloat16))
  ratio = quant.nbytes(kept) / quant.nbytes(plain)
  assert quant.dequantized_nbytes(kept, jnp.bfloat16) == quant.nbytes(plain)
  print(f"{config}: resident bytes kept / dequantized bf16 = {ratio:.3f}")
  assert ratio <= limit


def test_plan_sizes_quantized_weights_as_stored():
  """plan.py's per-device weight bytes: INT4 experts as packed values plus bf16 scales."""
  from eagle3jax import plan as plan_lib  # pylint: disable=import-outside-toplevel
  text = dm.to_published_style(dm.hf_config(layers=3).to_dict())
  hf = {"model_type": "kimi_k25", "text_config": text, "quantization_config": dm.KIMI_K25_QUANT}
  mesh = eagle3jax.make_mesh(1, 8)
  size = {}
  for mode in ("keep", "dequantize"):
    _, params, _, _, _ = plan_lib.build(hf, None, mesh, dtype=jnp.bfloat16, quantization=mode)
    size[mode] = plan_lib._per_device_bytes(params)  # pylint: disable=protected-access
  d, f, e, moe_layers = text["hidden_size"], text["moe_intermediate_size"], 8, 2
  # Per expert: gate/up [D, F] grouped along D (g = gcd(32, 48) = 16), down [F, D] along F
  # (g = gcd(32, 24) = 8); values half a byte each, one bf16 scale per group and out element.
  kept = 2 * (d * f // 2 + d // 16 * f * 2) + (f * d // 2 + f // 8 * d * 2)
  saved = moe_layers * (e // 8) * (3 * d * f * 2 - kept)
  assert size["dequantize"] - size["keep"] == saved


# --- decoding and the compiled program ---

@pytest.fixture(scope="module")
def int4_target():
  cfg = DeepseekConfig.tiny(num_hidden_layers=3, hidden_size=64, moe_intermediate_size=32)
  q = QuantizationConfig.from_hf(_config("kimi-k2.5.json"))
  return eagle3jax.init_deepseek(cfg, seed=0, std=0.1, quantization=q)


def test_greedy_speculative_on_quantized_target_is_lossless(int4_target):
  dr = engine_helpers.full_vocab_copy_drafter(int4_target, CaptureSpec((-1, 0, 2)))
  prompts = [[5, 6, 7, 8, 9, 10, 3], [1, 3, 4]]
  base = eagle3jax.generate(int4_target, None, prompts, max_new_tokens=12).tokens
  res = eagle3jax.generate(int4_target, dr, prompts, max_new_tokens=12, num_steps=3, topk=1,
                           num_draft_tokens=4)
  assert res.tokens == base
  assert res.stats["accept_length_mean"] > 1.0


def test_compiled_forward_never_dequantizes_a_whole_stack(int4_target):
  """The routed experts are read as stored (packed INT4 stacks in the program) and only the
  chosen experts are dequantized: neither the stacked [L, E, ...] experts nor one layer's
  [E, ...] appear dequantized, while one expert's matrix does."""
  graphdef, state = nnx.split(int4_target)
  tokens = jnp.zeros((1, 8), jnp.int32)
  with jax.set_mesh(int4_target.mesh):
    hlo = api._forward.lower(graphdef, state, tokens, None).compile().as_text()
  dims = lambda s: "[" + ",".join(map(str, s)) + "]"  # pylint: disable=unnecessary-lambda-assignment
  stacked = [sub for _, sub in nnx.iter_graph(int4_target)
             if isinstance(sub, quant.QuantizedParam)]
  assert len(stacked) == 3 and all(w.shape[0] == 2 for w in stacked)  # the MoE stack's experts
  for w in stacked:
    shape = w.shape
    assert f"u8{dims(w.values.get_value().shape)}" in hlo  # held as stored
    assert f"f32{dims(shape[2:])}" in hlo  # one expert's matrix, dequantized
    for dt in ("f32", "bf16"):
      assert f"{dt}{dims(shape)}" not in hlo
      assert f"{dt}{dims(shape[1:])}" not in hlo


def test_replication_warning_counts_an_int4_weight_with_its_scales():
  """A vocabulary the tensor axis does not divide leaves the INT4 lm_head whole on every
  device: the warning counts it once, by its stored bytes (packed values and the scales, which
  are left whole too), beside the embedding."""
  import re
  qc = QuantizationConfig.from_hf(_ct(ignore=[]))
  cfg = DeepseekConfig.tiny(num_hidden_layers=2, vocab_size=131)
  with pytest.warns(UserWarning, match=r"does not divide vocab \(131\) over tensor=2: 2 "
                                       r"weights") as record:
    m = eagle3jax.init_deepseek(cfg, mesh=eagle3jax.make_mesh(1, 2), seed=0, std=0.1,
                                quantization=qc)
  (message,) = [str(w.message) for w in record if "does not divide" in str(w.message)]
  mib = float(re.search(r"weights \(([0-9.e+-]+) MiB\)", message).group(1))
  assert isinstance(m.lm_head, quant.QuantizedParam)
  stored = (m.lm_head.values[...].nbytes + m.lm_head.scale[...].nbytes
            + m.embed_tokens[...].nbytes)
  assert m.lm_head.scale[...].nbytes > 2e-3 * stored  # the scales are not lost in rounding
  assert mib == pytest.approx(stored / 2**20, rel=1e-3)
