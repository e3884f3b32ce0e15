"""Mixture of experts (eagle3jax.moe): routing, the grouped paths against the dense reference,
expert parallelism against one device, and cost that scales with top-k rather than E."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eagle3jax
from eagle3jax import moe
from eagle3jax.sharding import BATCH, EMBED, EXPERT, SEQ, activation_spec, param_sharding

D, F = 16, 12


def _experts(rng, e, dtype=jnp.float32):
  def w(shape, fan_in):
    return jnp.asarray(rng.normal(size=shape) / np.sqrt(fan_in), dtype)
  return moe.Experts(w((e, D, F), D), w((e, D, F), D), w((e, F, D), F))


def _router(rng, e, skew=0.0):
  """Router ``gate [D, E]`` and correction bias ``[E]``; ``skew`` > 0 favours low expert ids
  (ragged loads, many experts receiving no token)."""
  gate = jnp.asarray(rng.normal(size=(D, e)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(e,)) * 0.1 - skew * np.arange(e) / e, jnp.float32)
  return gate, bias


def _dense_combine(ids, weights, e):
  return jnp.zeros(ids.shape[:-1] + (e,), jnp.float32).at[
      jnp.arange(ids.shape[0])[:, None], ids].add(weights)


def _reference(x, ids, weights, experts):
  combine = _dense_combine(ids, weights, experts.gate.shape[0])
  return moe.moe_reference(x[None], combine[None], experts)[0]


def test_route_equals_dense_combine_weights():
  rng = np.random.default_rng(0)
  rc = moe.RoutingConfig(num_experts=16, top_k=3, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5)
  gate, bias = _router(rng, 16)
  x = jnp.asarray(rng.normal(size=(37, D)), jnp.float32)
  ids, weights = moe.route(x, gate, bias, rc)
  assert ids.shape == weights.shape == (37, 3) and ids.dtype == jnp.int32
  np.testing.assert_allclose(np.asarray(_dense_combine(ids, weights, 16)),
                             np.asarray(moe.combine_weights(x, gate, bias, rc)), atol=1e-6)
  np.testing.assert_allclose(np.asarray(weights.sum(-1)), 2.5, rtol=1e-6)
  groups = np.asarray(ids) // 4  # group-limited: at most topk_group groups per token
  assert max(len(set(row)) for row in groups) == 2
  assert (np.sort(np.asarray(ids), -1)[:, 1:] != np.sort(np.asarray(ids), -1)[:, :-1]).all()


@pytest.mark.parametrize("impl,n,e,k,case", [
    ("gather", 1, 16, 4, "random"), ("gather", 8, 64, 2, "random"),
    ("gather", 40, 32, 4, "one_expert_hot"), ("tiles", 8, 16, 4, "random"),
    ("tiles", 200, 64, 3, "ragged"), ("tiles", 40, 32, 4, "one_expert_hot"),
    ("tiles", 64, 8, 8, "all_experts"), ("ragged", 200, 64, 3, "ragged"),
    ("ragged", 40, 32, 4, "one_expert_hot")])
def test_grouped_paths_equal_reference(impl, n, e, k, case):
  rng = np.random.default_rng(n * e + k)
  experts = _experts(rng, e)
  x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
  if case == "random":
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
  elif case == "ragged":  # loads from ~n down to 0: most experts receive no token
    p = np.exp(-np.arange(e) / 3.0)
    ids = np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(n)])
  elif case == "one_expert_hot":  # every token on expert 5, the rest spread thin
    ids = np.stack([np.r_[5, rng.choice(np.r_[0:5, 6:e], k - 1, replace=False)]
                    for _ in range(n)])
  else:
    ids = np.stack([rng.permutation(e) for _ in range(n)])
  weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)), jnp.float32)
  ids = jnp.asarray(ids, jnp.int32)
  got = jax.jit(functools.partial(moe.grouped, impl=impl))(x, ids, weights, experts)
  want = _reference(x, ids, weights, experts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
  assert float(jnp.abs(want).max()) > 0.1


@pytest.mark.parametrize("impl", ["gather", "tiles", "ragged"])
def test_ids_of_other_devices_contribute_nothing(impl):
  """Expert parallelism hands each device global ids minus its offset: ids outside [0, E)."""
  rng = np.random.default_rng(3)
  experts = _experts(rng, 8)
  x = jnp.asarray(rng.normal(size=(30, D)), jnp.float32)
  ids = jnp.asarray(rng.integers(-8, 16, size=(30, 4)), jnp.int32)
  weights = jnp.asarray(rng.uniform(size=(30, 4)), jnp.float32)
  got = moe.grouped(x, ids, weights, experts, impl)
  ok = (ids >= 0) & (ids < 8)
  want = _reference(x, jnp.where(ok, ids, 0), jnp.where(ok, weights, 0.0), experts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_tiles_bound_and_auto_choice():
  for p, e in [(32, 16), (1024, 256), (1024, 16), (7, 64), (4096, 384)]:
    tile = moe.tile_size(p, e)
    rows = moe.num_tiles(p, e, tile) * tile
    # worst case over routings: every expert's group padded by tile - 1
    assert p + min(e, p) * (tile - 1) - tile < rows < 2 * p
  assert moe.choose_impl(8, 4, 256) == moe.choose_impl(256, 4, 16) == "tiles"  # on CPU
  assert moe.tile_size(32, 256) == 1 and moe.num_tiles(32, 256, 1) == 32  # one pair per tile
  with pytest.raises(ValueError, match="unknown MoE impl 'dense'"):
    moe.choose_impl(8, 4, 16, "dense")
  with pytest.raises(ValueError, match="top_k=9"):
    moe.RoutingConfig(num_experts=16, top_k=9, n_group=4, topk_group=2)
  with pytest.raises(ValueError, match="groups of 1 experts"):
    moe.RoutingConfig(num_experts=8, top_k=2, n_group=8, topk_group=2)
  with pytest.raises(ValueError, match="not a grouped path"):
    moe.grouped(jnp.zeros((2, D)), jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1)),
                _experts(np.random.default_rng(0), 4), "reference")


def test_routed_experts_auto_equals_reference(n=64):
  rng = np.random.default_rng(n)
  rc = moe.RoutingConfig(num_experts=32, top_k=4, n_group=4, topk_group=2,
                         routed_scaling_factor=1.5)
  experts = _experts(rng, 32)
  gate, bias = _router(rng, 32, skew=2.0)
  x = jnp.asarray(rng.normal(size=(2, n // 2, D)), jnp.float32)
  want = moe.routed_experts(x, gate, bias, experts, rc, "reference")
  got = jax.jit(functools.partial(moe.routed_experts, rc=rc))(x, gate, bias, experts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


# --- expert parallelism ---

@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
def test_expert_parallel_equals_one_device(mesh_shape):
  rng = np.random.default_rng(11)
  e = 32
  rc = moe.RoutingConfig(num_experts=e, top_k=4, n_group=4, topk_group=2,
                         routed_scaling_factor=2.0)
  experts = _experts(rng, e)
  gate, bias = _router(rng, e, skew=1.0)
  mesh = eagle3jax.make_mesh(*mesh_shape)
  with jax.set_mesh(mesh):
    ex = moe.Experts(*(jax.device_put(w, param_sharding(mesh, axes, w.shape)) for w, axes in
                       zip(experts, [(EXPERT, EMBED, None)] * 2 + [(EXPERT, None, EMBED)])))
  per_device = e // mesh_shape[1]
  for w in ex:  # each device holds its E / n experts, and only those
    assert w.sharding.spec[0] == "tensor"
    assert {s.data.shape[0] for s in w.addressable_shards} == {per_device}
  rep = NamedSharding(mesh, P())
  runs = ([(8, "gather"), (128, "tiles"), (128, "ragged")] if mesh_shape == (1, 8) else
          [(8, "auto"), (128, "auto")])  # auto is tiles on CPU
  for tokens, impl in runs:
    x = jnp.asarray(rng.normal(size=(2, tokens // 2, D)), jnp.float32)
    want = moe.routed_experts(x, gate, bias, experts, rc, "reference")
    xs = jax.device_put(x, NamedSharding(mesh, activation_spec((BATCH, SEQ, EMBED), x.shape,
                                                               mesh)))
    fn = jax.jit(functools.partial(moe.routed_experts, rc=rc, impl=impl))
    with jax.set_mesh(mesh):
      args = (xs, jax.device_put(gate, rep), jax.device_put(bias, rep), ex)
      compiled = fn.lower(*args).compile()
      got = compiled(*args)
    assert got.sharding.spec == xs.sharding.spec
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0,
                               err_msg=f"{tokens} tokens, {impl}")
    # tokens stay put and expert weights never move: one all-reduce of the results
    hlo = compiled.as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo, impl
    assert "all-reduce" in hlo


# --- quantized experts (eagle3jax.quant) ---

def _quantized_experts(rng, e, kind):
  """Random INT4 / FP8 experts as ``quant.QuantizedArrays`` (gate/up ``[E, D, F]``, down
  ``[E, F, D]``), stored as the loader holds them."""
  from eagle3jax import quant  # pylint: disable=import-outside-toplevel
  scheme = quant.QuantScheme(kind, group_size=4, block_out=4)

  def w(shape):
    vshape, sshape = scheme.layout(shape, 1)
    kinds = quant._INITS  # pylint: disable=protected-access
    values = quant.random_part(kinds[(kind, "values")], vshape, rng, 0.2)
    scale = quant.random_part(kinds[(kind, "scale")], sshape, rng, 0.2)
    return quant.QuantizedArrays(jnp.asarray(values), jnp.asarray(scale), scheme, 1,
                                 jnp.dtype(jnp.float32))
  return moe.Experts(w((e, D, F)), w((e, D, F)), w((e, F, D)))


@pytest.mark.parametrize("kind", ["int4_group", "fp8_block"])
def test_quantized_experts_equal_their_dequantized_reference(kind):
  """Grouped paths read INT4 / FP8 experts as stored (only chosen experts dequantized) and
  equal the dense reference on the dequantized stack; also expert-parallel on (1, 8)."""
  from eagle3jax import quant  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(5)
  e, n, k = 32, 24, 4
  qex = _quantized_experts(rng, e, kind)
  dense = moe.Experts(*(quant.dequantize(w) for w in qex))
  assert dense.gate.shape == (e, D, F) and dense.down.shape == (e, F, D)
  x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)), jnp.float32)
  want = _reference(x, ids, weights, dense)
  for impl in ("gather", "tiles", "ragged"):
    got = jax.jit(functools.partial(moe.grouped, impl=impl))(x, ids, weights, qex)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0,
                               err_msg=impl)
  rc = moe.RoutingConfig(num_experts=e, top_k=k, n_group=4, topk_group=2,
                         routed_scaling_factor=2.0)
  gate, bias = _router(rng, e)
  xb = x.reshape(2, n // 2, D)
  want = moe.routed_experts(xb, gate, bias, dense, rc, "reference")
  mesh = eagle3jax.make_mesh(1, 8)
  rep = NamedSharding(mesh, P())
  with jax.set_mesh(mesh):
    ex = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("tensor"))), qex)
    for impl in ("gather", "tiles"):
      got = jax.jit(functools.partial(moe.routed_experts, rc=rc, impl=impl))(
          jax.device_put(xb, rep), jax.device_put(gate, rep), jax.device_put(bias, rep), ex)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0,
                                 err_msg=f"{impl} on (1, 8)")


def test_accelerator_auto_never_dequantizes_the_whole_stack(monkeypatch):
  """On a GPU, ``auto`` took ``ragged`` for calls over one pair per local expert, and
  ``ragged_dot`` needs every local expert dequantized (Kimi-K2.5 on tensor=8: 48 experts, a
  16-token verify round). The plan compiled ``gather`` for that call: GPU and plan now share
  one rule, and quantized stacks take ``tiles`` where plain ones take ``ragged``."""
  seen = []
  real_choose = moe.choose_impl
  monkeypatch.setattr(moe, "choose_impl", lambda *a, **kw: seen.append(kw) or real_choose(*a, **kw))
  rng = np.random.default_rng(0)
  qex = _quantized_experts(rng, 8, "int4_group")
  x = jnp.ones((4, D), jnp.float32)
  ids = jnp.zeros((4, 2), jnp.int32)
  moe.grouped(x, ids, jnp.ones((4, 2)), qex)
  assert seen[-1]["quantized"] is True
  from eagle3jax import quant  # pylint: disable=import-outside-toplevel
  moe.grouped(x, ids, jnp.ones((4, 2)), moe.Experts(*(quant.dequantize(w) for w in qex)))
  assert seen[-1]["quantized"] is False
  monkeypatch.undo()

  def both(*args, **kw):  # the choice on a GPU and the plan's on fake CPU devices
    with monkeypatch.context() as m:
      m.setattr(jax, "default_backend", lambda: "gpu")
      gpu = moe.choose_impl(*args, **kw)
    with moe.as_accelerator():
      plan = moe.choose_impl(*args, **kw)
    return gpu, plan
  assert both(16, 8, 48, quantized=True) == ("gather", "gather")  # verify round, 128 pairs
  assert both(1, 8, 48, quantized=True) == ("gather", "gather")   # decode step
  assert both(64, 8, 48, quantized=True) == ("tiles", "tiles")    # 512 pairs: prefill
  assert both(64, 8, 48, quantized=False) == ("ragged", "tiles")  # plain: a grouped matmul
  assert moe.choose_impl(64, 8, 48, quantized=True) == "tiles"    # on CPU


# --- cost scales with top-k, not with E ---

def _flops(fn, *args):
  with moe.unrolled_tiles():  # the tiles loop counted once per tile
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("n,k,impl,experts", [(8, 4, "gather", (16, 256)),
                                                (32, 2, "tiles", (4, 32))])
def test_grouped_flops_do_not_scale_with_experts(n, k, impl, experts):
  """Compiled flops at a fixed top-k: flat in E for the grouped paths (the tiles loop is
  unrolled so that cost_analysis counts every tile), proportional to E for the reference."""
  rng = np.random.default_rng(0)
  d, f = 64, 64
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, experts[0], size=(n, k)), jnp.int32)
  weights = jnp.ones((n, k), jnp.float32)
  grouped, dense = {}, {}
  for e in experts:
    ex = moe.Experts(*(jax.ShapeDtypeStruct(s, jnp.float32)
                       for s in [(e, d, f), (e, d, f), (e, f, d)]))
    grouped[e] = _flops(functools.partial(moe.grouped, impl=impl), x, ids, weights, ex)
    dense[e] = _flops(lambda x, c, ex: moe.moe_reference(x[None], c[None], ex),
                      x, jnp.zeros((n, e), jnp.float32), ex)
  small, big = experts
  print(f"{impl} n={n}: grouped flops {grouped}, dense {dense}")
  assert grouped[big] <= 1.25 * grouped[small]
  assert dense[big] >= 0.75 * big / small * dense[small]  # the oracle scales (the measure can fail)


# --- inside the DeepSeek model (layers scanned) ---

def test_deepseek_layer_paths_agree():
  """The MoE layer inside the layer scan equals the dense reference (3 tokens: one pair per
  tile; 24 tokens: tiles of 5)."""
  from eagle3jax.deepseek_config import DeepseekConfig
  model = eagle3jax.init_deepseek(DeepseekConfig.tiny(num_hidden_layers=2, n_routed_experts=16,
                                                      n_group=4, topk_group=2,
                                                      num_experts_per_tok=3), seed=2, std=0.1)
  ids = np.random.default_rng(0).integers(0, 131, (1, 24))
  outs = {}
  for impl in ("reference", "auto"):
    model.moe_layers.mlp.impl = impl
    outs[impl] = [np.asarray(eagle3jax.forward(model, ids[:, :t]).logits) for t in (3, 24)]
  for got, want in zip(outs["auto"], outs["reference"]):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  assert moe.tile_size(3 * 3, 16) == 1 and moe.tile_size(24 * 3, 16) == 5
