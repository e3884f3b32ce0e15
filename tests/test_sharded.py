"""Shapes on meshes, sharded equals unsharded, KV-head replication, the seed's layout bug."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eagle3jax
from eagle3jax import sharding
from eagle3jax.capture import CaptureSpec
from eagle3jax.llama import kv_head_replication

# Distinct primes where a dimension is not sharded (B, T, V, L, H/2), multiples of 8 where
# the tensor axis must divide (N, F).
CFG = eagle3jax.LlamaConfig.tiny(vocab_size=127, hidden_size=56, intermediate_size=104,
                                 num_hidden_layers=7, num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=14)
CAPTURE = CaptureSpec((-1, 0, 3, 6))
MESHES = [(1, 1), (1, 8), (2, 4)]


@pytest.fixture(scope="module")
def reference():
  ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 11))
  model = eagle3jax.init_target(CFG, seed=7, std=0.1)
  return ids, eagle3jax.forward(model, ids, capture=CAPTURE)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_shapes_and_sharded_equals_unsharded(reference, mesh_shape):
  ids, ref = reference
  mesh = eagle3jax.make_mesh(*mesh_shape)
  model = eagle3jax.init_target(CFG, mesh=mesh, seed=7, std=0.1)
  out = eagle3jax.forward(model, ids, capture=CAPTURE)
  assert out.logits.shape == (2, 11, 127)
  assert out.aux_hidden.shape == (2, 11, 4 * 56)
  assert out.aux_hidden.sharding.spec == P("data", None, None)
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.aux_hidden), np.asarray(ref.aux_hidden), atol=1e-5)


def test_weights_are_sharded_per_rules():
  mesh = eagle3jax.make_mesh(1, 8)
  model = eagle3jax.init_target(CFG, mesh=mesh)
  # Layers are stacked [L, ...] (unsharded L) and scanned over.
  attn = model.layers.self_attn
  assert attn.q_proj[...].sharding.spec == P(None, None, "tensor", None)
  # 2 KV heads on 8 ranks: replicated 4x so each rank owns one whole KV head.
  assert model.kv_repeat == 4
  assert attn.k_proj[...].shape == (CFG.num_hidden_layers, 56, 8, 14)
  assert attn.k_proj[...].sharding.spec == P(None, None, "tensor", None)
  assert attn.o_proj[...].sharding.spec == P(None, "tensor", None, None)
  assert model.layers.mlp.down_proj[...].sharding.spec == P(None, "tensor", None)
  # vocab 127 is not divisible by 8: the embedding is replicated rather than failing.
  assert model.embed_tokens[...].sharding.spec == P(None, None)
  shard_shape = attn.q_proj[...].addressable_shards[0].data.shape
  assert shard_shape == (CFG.num_hidden_layers, 56, 1, 14)


def test_kv_head_replication_rule():
  assert kv_head_replication(8, 2, 8) == 4
  assert kv_head_replication(8, 8, 8) == 1
  assert kv_head_replication(32, 8, 4) == 1
  assert kv_head_replication(12, 3, 4) == 4     # lcm(3, 4) = 12 heads
  assert kv_head_replication(6, 2, 4) == 1      # 4 does not divide 6 heads: nothing sharded


def test_vocab_parallel_embedding_and_head():
  cfg = eagle3jax.LlamaConfig.tiny(vocab_size=136, num_hidden_layers=2)
  mesh = eagle3jax.make_mesh(1, 8)
  model = eagle3jax.init_target(cfg, mesh=mesh, seed=1, std=0.1)
  assert model.embed_tokens[...].sharding.spec == P("tensor", None)
  assert model.lm_head[...].sharding.spec == P(None, "tensor")
  ids = np.arange(30).reshape(2, 15) * 4
  ref = eagle3jax.forward(eagle3jax.init_target(cfg, seed=1, std=0.1), ids, capture=[-1, 1])
  out = eagle3jax.forward(model, ids, capture=[-1, 1])
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.aux_hidden), np.asarray(ref.aux_hidden), atol=1e-5)


def test_seed_layout_bug_is_a_trace_time_error():
  """The deployment's bug: a full-width embedding capture next to per-rank layer shards.

  Laid out differently, the concatenation is refused while tracing; through the capture
  function every capture has one layout and the concatenation is accepted and correct.
  """
  mesh = eagle3jax.make_mesh(1, 8)
  x = np.random.default_rng(0).normal(size=(1, 5, 64)).astype(np.float32)
  emb_np, layer_np = x, x * 2

  def buggy(emb, layer):
    emb = jax.reshard(emb, P(None, None, None))           # full width on every rank
    layer = jax.reshard(layer, P(None, None, "tensor"))   # per-rank shard of the width
    return jnp.concatenate([emb, layer], axis=-1)

  spec = CaptureSpec((-1, 2))

  def fixed(emb, layer):
    emb = jax.reshard(emb, P(None, None, None))
    layer = jax.reshard(layer, P(None, None, "tensor"))
    return spec.concat({-1: spec.annotate(emb), 2: spec.annotate(layer)})

  with jax.set_mesh(mesh):
    with pytest.raises(jax.sharding.ShardingTypeError if hasattr(jax.sharding,
                       "ShardingTypeError") else Exception, match="same sharding"):
      jax.jit(buggy).lower(emb_np, layer_np)
    out = jax.jit(fixed)(emb_np, layer_np)
  np.testing.assert_array_equal(np.asarray(out), np.concatenate([emb_np, layer_np], -1))
  assert out.sharding.spec == P(None, None, None) or out.sharding.spec == P("data", None, None)


def test_make_mesh_errors():
  # The run already forces 8 CPU devices: the hint is a smaller mesh, not that flag again.
  with pytest.raises(ValueError, match=r"needs 16 devices but only 8 are available \(cpu\): "
                                       r"choose a mesh of at most that many devices"):
    sharding.make_mesh(2, 8)
  with pytest.raises(ValueError, match="tensor=0 must be a positive integer"):
    sharding.make_mesh(1, 0)
  mesh = sharding.make_mesh(2, 4)
  assert mesh.axis_names == ("data", "tensor")
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  assert sharding.make_mesh(np.int64(2), np.int32(4)).shape == mesh.shape
  d0 = jax.devices()[0]
  with pytest.raises(ValueError, match=rf"lists \['{d0}'\] more than once: a mesh needs "
                                       "distinct devices"):
    sharding.make_mesh(1, 2, devices=[d0, d0])


def test_models_refuse_meshes_make_mesh_would_not_build():
  # A hand-built mesh with Auto axes would take away the trace-time layout check the
  # captures rely on; it is refused where the model is placed, not at its first annotation.
  auto = jax.make_mesh((2, 4), ("data", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with pytest.raises(ValueError, match=r"mesh axes \['data', 'tensor'\] are not Explicit"):
    eagle3jax.init_target(CFG, mesh=auto)
  renamed = jax.make_mesh((2, 4), ("batch", "model"),
                          axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with pytest.raises(ValueError, match=r"mesh axes \('batch', 'model'\) must be \('data', "):
    eagle3jax.init_target(CFG, mesh=renamed)
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
    eagle3jax.init_target(CFG, mesh="1,8")


def test_model_placed_inside_another_mesh_context():
  # A caller's jax.set_mesh(other) must not leak into placing a model on its own mesh.
  ids = np.array([[3, 4, 5, 6]])
  ref = eagle3jax.forward(eagle3jax.init_target(CFG, seed=7, std=0.1), ids).logits
  with jax.set_mesh(sharding.make_mesh(2, 4)):
    model = eagle3jax.init_target(CFG, mesh=sharding.make_mesh(1, 8), seed=7, std=0.1)
  np.testing.assert_allclose(np.asarray(eagle3jax.forward(model, ids).logits), np.asarray(ref),
                             rtol=2e-5, atol=2e-5)


def test_shard_helper_rejects_rank_mismatch_and_unknown_axes():
  with pytest.raises(ValueError, match="2 logical axes"):
    sharding.shard(jnp.zeros((2, 3, 4)), (sharding.BATCH, sharding.SEQ))
  with pytest.raises(ValueError, match="unknown logical axis 'tensr'"):
    sharding.activation_spec(("tensr",))


def test_a_mesh_that_leaves_weights_whole_says_so():
  """A tensor size that does not divide the heads (Qwen2.5-7B: 28 heads on tensor=8) or the
  vocabulary replicates those weights on every device: tensor parallelism asked for and not
  had, met only as memory. init_target warns, naming each dimension; a dividing mesh is
  quiet."""
  import warnings
  cfg = eagle3jax.LlamaConfig.tiny(num_hidden_layers=2, vocab_size=128)
  with pytest.warns(UserWarning, match=r"this mesh does not divide .*heads \(8\) over tensor=3.*"
                                       r"weights \(.* MiB\) are replicated on every device"):
    eagle3jax.init_target(cfg, mesh=eagle3jax.make_mesh(1, 3))
  odd_vocab = eagle3jax.LlamaConfig.tiny(num_hidden_layers=2, vocab_size=131)
  with pytest.warns(UserWarning, match=r"does not divide vocab \(131\) over tensor=8: 2 "
                                       r"weights"):
    eagle3jax.init_target(odd_vocab, mesh=eagle3jax.make_mesh(1, 8))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for shape in ((1, 8), (2, 4), (8, 1)):
      eagle3jax.init_target(cfg, mesh=eagle3jax.make_mesh(*shape))
    # FP8 block scales hold block counts (256 / 128 = 2 rows of blocks), not model dimensions:
    # their layout on tensor=4 is no replicated weight (the weights themselves are split).
    from eagle3jax.quant_config import QuantizationConfig
    fp8 = QuantizationConfig.from_hf({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}})
    wide = eagle3jax.DeepseekConfig.tiny(vocab_size=128, hidden_size=256, intermediate_size=256,
                                         moe_intermediate_size=256)
    eagle3jax.init_deepseek(wide, mesh=eagle3jax.make_mesh(1, 4), quantization=fp8)


def test_a_parameter_without_logical_axes_is_named():
  """The mesh check reads every parameter's axes first; a parameter without them is still
  named, not met as a KeyError."""
  from flax import nnx
  from eagle3jax.params import materialize, random_fill

  class Bare(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.zeros((4, 4)))
  with pytest.raises(ValueError, match="parameter w has no logical axes"):
    materialize(Bare, eagle3jax.make_mesh(1, 1), random_fill())
