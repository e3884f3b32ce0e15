import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from eagle3jax import attention, kernels  # noqa: E402
from eagle3jax.kernels import (  # noqa: E402
    MAX_TREE_TOKENS, tree_attention, tree_attention_reference, tree_attention_sharded,
    validate_inputs)
from tests import engine_helpers as h  # noqa: E402

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def random_tree_mask(rng, batch: int, p: int) -> np.ndarray:
  """``[B, P, P]`` ancestor-closed masks (ancestors and self) of random trees, node 0 the root."""
  return np.stack([h.ancestor_mask([-1] + [int(rng.integers(0, i)) for i in range(1, p)])
                   for _ in range(batch)])


def make_inputs(seed, b, p, s, n, k, h, dtype, *, fill=np.nan, lengths=None):
  """Random q ``[B, P, N, H]`` and k/v caches ``[B, K, S, H]`` with ragged ``lengths`` (0, S - P
  and random) and ``fill`` past lengths + P."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, p, n, h), np.float32)
  kc = rng.standard_normal((b, s, k, h), np.float32)
  vc = rng.standard_normal((b, s, k, h), np.float32)
  if lengths is None:
    choices = [0, s - p, int(rng.integers(1, s - p))]
    lengths = [choices[(row + seed) % 3] for row in range(b)]
  lengths = np.asarray(lengths, np.int32)
  for row in range(b):
    kc[row, lengths[row] + p:] = fill
    vc[row, lengths[row] + p:] = -fill
  kc, vc = np.swapaxes(kc, 1, 2), np.swapaxes(vc, 1, 2)  # the cache's [B, K, S, H]
  return (jnp.asarray(q, dtype), jnp.asarray(kc, dtype), jnp.asarray(vc, dtype),
          jnp.asarray(lengths), jnp.asarray(random_tree_mask(rng, b, p)))


def assert_close(out, ref, dtype):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


# (B, P, S, N, K, H, dtype, block_s, num_splits, fill); S is never a multiple of block_s except
# in the last case, which instead splits the query rows over several blocks (block_m=16).
SWEEP = [
    (1, 1, 40, 4, 4, 16, jnp.float32, 16, None, np.nan),
    (3, 5, 70, 8, 2, 64, jnp.bfloat16, 16, None, np.nan),
    (3, 8, 130, 6, 3, 16, jnp.float32, 64, None, np.inf),
    (1, 8, 50, 8, 2, 64, jnp.float32, 32, 1, np.nan),
    (3, 1, 45, 6, 3, 64, jnp.bfloat16, 16, 2, np.inf),
    (3, 5, 100, 4, 4, 16, jnp.bfloat16, 32, 3, np.nan),
    (1, 5, 33, 6, 3, 64, jnp.float32, 16, 2, np.nan),
    (3, 8, 64, 8, 2, 16, jnp.bfloat16, 16, None, np.nan),
]


class _TreeAttentionCases:
  """Kernel-vs-reference cases, run as a GPU class and as an interpret-mode class."""

  INTERPRET = False

  def attend(self, *args, **kwargs):
    return tree_attention(*args, interpret=self.INTERPRET, **kwargs)

  @pytest.mark.parametrize("case", range(len(SWEEP)))
  def test_matches_reference(self, case):
    b, p, s, n, k, h, dtype, block_s, num_splits, fill = SWEEP[case]
    args = make_inputs(case, b, p, s, n, k, h, dtype, fill=fill)
    block_m = 16 if case == len(SWEEP) - 1 else 64
    out = self.attend(*args, block_s=block_s, block_m=block_m, num_splits=num_splits)
    assert out.shape == (b, p, n, h) and out.dtype == dtype
    assert_close(out, tree_attention_reference(*args), dtype)

  def test_decode(self):
    # P = 1, tree_mask [[True]]: plain decode attention, checked against numpy directly.
    b, s, n, k, h = 3, 37, 4, 2, 16
    q, kc, vc, lengths, _ = make_inputs(11, b, 1, s, n, k, h, jnp.float32, lengths=[0, 36, 17])
    mask = jnp.ones((b, 1, 1), bool)
    out = self.attend(q, kc, vc, lengths, mask, block_s=16)
    expected = np.zeros((b, 1, n, h), np.float32)
    for row in range(b):
      live = int(lengths[row]) + 1
      for head in range(n):
        kh = head // (n // k)
        scores = np.asarray(kc[row, kh, :live]) @ np.asarray(q[row, 0, head]) / np.sqrt(h)
        w = np.exp(scores - scores.max())
        expected[row, 0, head] = (w / w.sum()) @ np.asarray(vc[row, kh, :live])
    assert_close(out, expected, jnp.float32)

  def test_padded_head_dim_and_tiny_cache(self):
    # H = 24 is padded to 32 and S = 10 to 16 inside the wrapper.
    args = make_inputs(5, 2, 3, 10, 4, 2, 24, jnp.float32, lengths=[7, 2])
    assert_close(self.attend(*args), tree_attention_reference(*args), jnp.float32)

  def test_query_without_tree_keys(self):
    # Row 0 has no prefix and query 1 sees no key at all: zeros, not NaN. Row 1 sees its prefix.
    q, kc, vc, lengths, _ = make_inputs(3, 2, 2, 20, 2, 2, 16, jnp.float32, lengths=[0, 9])
    mask = jnp.asarray([[[True, False], [False, False]]] * 2)
    out = self.attend(q, kc, vc, lengths, mask, block_s=16)
    assert_close(out, tree_attention_reference(q, kc, vc, lengths, mask), jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[0, 1]), 0.0)

  def test_verify_shape_default_blocks(self):
    # Verify-shaped on GPU; shorter cache in interpret mode (it runs the kernel in Python).
    s = 260 if self.INTERPRET else 2000
    args = make_inputs(7, 2, 16, s, 32, 8, 128, jnp.bfloat16, lengths=[s - 16, s // 3])
    assert_close(self.attend(*args), tree_attention_reference(*args), jnp.bfloat16)

  # --- On a mesh of 8 devices ---

  def mesh(self, data, tensor):
    if jax.device_count() < 8:
      pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.make_mesh((data, tensor), ("data", "tensor"),
                         axis_types=(AxisType.Explicit, AxisType.Explicit))

  def test_sharded_heads(self):
    mesh = self.mesh(1, 8)
    args = make_inputs(21, 2, 3, 40, 16, 8, 16, jnp.float32)
    out = tree_attention_sharded(*args, mesh=mesh, interpret=self.INTERPRET)
    assert out.sharding.spec == P("data", None, "tensor", None)
    assert_close(out, tree_attention_reference(*args), jnp.float32)

  def test_sharded_in_jit_kv_heads_not_divisible(self):
    # K = 3 does not divide tensor = 4: heads are replicated, the batch stays sharded.
    mesh = self.mesh(2, 4)
    args = make_inputs(22, 2, 3, 40, 6, 3, 16, jnp.float32)
    specs = [P("data", None, None, None)] * 3 + [P("data"), P("data", None, None)]
    with jax.set_mesh(mesh):
      sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
      fn = jax.jit(lambda *a: tree_attention_sharded(
          *a, mesh=jax.sharding.get_abstract_mesh(), interpret=self.INTERPRET))
      out = fn(*sharded)
    assert jax.typeof(out).sharding.spec == P("data", None, None, None)
    assert_close(out, tree_attention_reference(*args), jnp.float32)

  @pytest.mark.parametrize("impl", ["pallas", "reference"])
  def test_sharded_batch_not_divisible(self, impl):
    # B = 3 does not divide data = 2: the batch is replicated, heads are sharded.
    mesh = self.mesh(2, 4)
    args = make_inputs(23, 3, 2, 36, 8, 4, 16, jnp.bfloat16)
    out = tree_attention_sharded(*args, mesh=mesh, impl=impl, interpret=self.INTERPRET)
    assert out.sharding.spec == P(None, None, "tensor", None)
    assert_close(out, tree_attention_reference(*args), jnp.bfloat16)


if jax.default_backend() == "gpu":
  # Defined only where a GPU is present (scripts/gpu_check.sh runs it): on CPU the interpret
  # class below runs the same cases, and CI shows no skipped tests.
  class TestTreeAttentionGPU(_TreeAttentionCases):
    INTERPRET = False


class TestTreeAttentionInterpret(_TreeAttentionCases):
  INTERPRET = True


# --------------------------------------------------------------------------------------------
# The reference on a case worked by hand
# --------------------------------------------------------------------------------------------


def test_reference_hand_worked():
  # B=1, P=2, S=4, N=K=1, H=2, sm_scale=1, lengths=[1]: slot 0 is the prefix, slots 1 and 2 are
  # tree nodes 0 and 1 (node 1 a child of node 0), slot 3 is unwritten (NaN).
  #   keys:   k0=[1,0]  k1=[0,1]  k2=[1,1]  k3=NaN
  #   values: v0=[1,0]  v1=[0,1]  v2=[5,5]  v3=NaN
  # Query 0 = [0,0] sees k0, k1: scores 0, 0 -> weights 1/2, 1/2 -> out = [0.5, 0.5].
  # Query 1 = [ln2, 0] sees k0, k1, k2: scores ln2, 0, ln2 -> exp: 2, 1, 2 (sum 5)
  #   -> out = (2*[1,0] + 1*[0,1] + 2*[5,5]) / 5 = [12/5, 11/5] = [2.4, 2.2].
  q = jnp.asarray([[[[0.0, 0.0]], [[np.log(2.0), 0.0]]]], jnp.float32)     # [1, 2, 1, 2]
  k = jnp.asarray([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [np.nan, np.nan]]]])  # [1, 1, 4, 2]
  v = jnp.asarray([[[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [np.nan, np.nan]]]])
  mask = jnp.asarray([[[True, False], [True, True]]])
  out = tree_attention_reference(q, k, v, jnp.asarray([1], jnp.int32), mask, sm_scale=1.0)
  np.testing.assert_allclose(np.asarray(out)[0, :, 0], [[0.5, 0.5], [2.4, 2.2]], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _spec(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _good():
  return dict(q=_spec((2, 3, 4, 16)), k=_spec((2, 2, 10, 16)), v=_spec((2, 2, 10, 16)),
              lengths=_spec((2,), jnp.int32), tree_mask=_spec((2, 3, 3), jnp.bool_))


BAD_INPUTS = [
    ("q", _spec((2, 3, 64)), r"q must have rank 4 \[B, P, N, H\], got shape \(2, 3, 64\)"),
    ("k", _spec((2, 10, 32)), r"k must have rank 4 \[B, K, S, H\]"),
    ("q", _spec((2, 3, 4, 16), jnp.int32), "q must have a floating dtype, got int32"),
    ("v", _spec((2, 2, 10, 16), jnp.bfloat16), "q, k and v must share one dtype.*v bfloat16"),
    ("v", _spec((2, 2, 12, 16)), r"v must have the shape of k \(2, 2, 10, 16\) \[B, K, S, H\]"),
    ("k", _spec((3, 2, 10, 16)), "k has batch 3"),
    ("k", _spec((2, 2, 10, 8)), "k has head dim 8"),
    ("k", _spec((2, 3, 10, 16)), "q heads N=4 must be a multiple of k heads K=3"),
    ("q", _spec((2, 3, 5, 16)), "q heads N=5 must be a multiple of k heads K=2"),
    ("lengths", _spec((2, 1), jnp.int32), r"lengths must have shape \[B\] = \(2,\)"),
    ("lengths", _spec((2,), jnp.float32), "lengths must have an integer dtype, got float32"),
    ("tree_mask", _spec((2, 3, 4), jnp.bool_), r"tree_mask must have shape \[B, P, P\]"),
    ("tree_mask", _spec((2, 3, 3), jnp.int32), "tree_mask must have dtype bool, got int32"),
]


@pytest.mark.parametrize("name, value, message", BAD_INPUTS)
def test_validation_names_the_argument(name, value, message):
  inputs = _good()
  inputs[name] = value
  if name in ("k",) and len(value.shape) == 4:
    inputs["v"] = value
  with pytest.raises(ValueError, match=message):
    validate_inputs(**inputs)


@pytest.mark.parametrize("shape, message", [
    ((0, 3, 4, 16), "B=0"), ((2, 0, 4, 16), "P=0"), ((2, 3, 0, 16), "N=0"),
    ((2, 3, 4, 0), "H=0")])
def test_validation_refuses_empty_dimensions(shape, message):
  """Empty batches or trees divided by zero in the kernel's split count (the reference
  returned an empty array), and H=0 in the default scale of both."""
  inputs = _good()
  inputs["q"] = _spec(shape)
  b, _, _, h = shape
  inputs["k"] = inputs["v"] = _spec((b, 2 if shape[2] else 1, 10, h))
  inputs["lengths"] = _spec((b,), jnp.int32)
  inputs["tree_mask"] = _spec((b, shape[1], shape[1]), jnp.bool_)
  for fn in (tree_attention, tree_attention_reference):
    with pytest.raises(ValueError, match=f"need non-empty dimensions; got {message}"):
      jax.eval_shape(lambda: fn(**inputs))


def test_validation_cache_smaller_than_tree():
  inputs = _good()
  inputs["k"] = inputs["v"] = _spec((2, 2, 1, 16))
  with pytest.raises(ValueError, match="k has 1 cache slots"):
    validate_inputs(**inputs)


def test_every_entry_point_validates():
  inputs = _good()
  inputs["tree_mask"] = _spec((2, 3, 3), jnp.float32)
  for fn in (tree_attention, tree_attention_reference):
    with pytest.raises(ValueError, match="tree_mask must have dtype bool"):
      jax.eval_shape(lambda: fn(**inputs))
  with pytest.raises(ValueError, match="tree_mask must have dtype bool"):
    tree_attention_sharded(**inputs, mesh=None)
  with pytest.raises(ValueError, match="block_s must be a power of two >= 16, got 24"):
    jax.eval_shape(lambda: tree_attention(**_good(), block_s=24))


def test_kernel_refuses_trees_past_one_tile():
  """The kernel holds the tree's keys and mask as single tiles: a P past MAX_TREE_TOKENS (a
  prefill's prompt bucket: megabytes a tile on a GPU) is refused by name, before any tracing of
  the kernel; the reference takes any P."""
  p = MAX_TREE_TOKENS + 1
  big = dict(q=_spec((1, p, 4, 16)), k=_spec((1, 2, 2 * p, 16)), v=_spec((1, 2, 2 * p, 16)),
             lengths=_spec((1,), jnp.int32), tree_mask=_spec((1, p, p), jnp.bool_))
  message = f"P={p} tree tokens; the kernel takes at most {MAX_TREE_TOKENS}"
  with pytest.raises(ValueError, match=message):
    jax.eval_shape(lambda: tree_attention(**big, interpret=True))
  with pytest.raises(ValueError, match=message):
    tree_attention_sharded(**big, mesh=None, interpret=True)
  assert jax.eval_shape(lambda: tree_attention_reference(**big)).shape == (1, p, 4, 16)


def _causal_inputs(t, s=96):
  q, kc, vc, _, _ = make_inputs(31, 2, t, s, 4, 2, 16, jnp.float32, lengths=[0, s - t])
  return q, kc, vc, jnp.asarray([0, s - t], jnp.int32), jnp.tril(jnp.ones((2, t, t), bool))


def test_attend_sends_prefill_sized_calls_to_xla(monkeypatch):
  """``attend(impl="pallas...")`` runs the kernel for up to MAX_TREE_TOKENS new tokens and the
  XLA path past them (prefill), with the same result either way."""
  calls = []
  real = kernels.tree_attention_sharded

  def counted(*args, **kwargs):
    calls.append(args[0].shape[1])
    return real(*args, **kwargs)
  monkeypatch.setattr(kernels, "tree_attention_sharded", counted)
  for t, kernel_calls in ((MAX_TREE_TOKENS, [MAX_TREE_TOKENS]), (MAX_TREE_TOKENS + 1, [])):
    calls.clear()
    args = _causal_inputs(t)
    out = attention.attend(*args, scale=0.25, impl="pallas_interpret")
    assert calls == kernel_calls, t
    assert_close(out, attention.attend(*args, scale=0.25, impl="xla"), jnp.float32)
    assert_close(out, tree_attention_reference(*args, sm_scale=0.25), jnp.float32)


def test_xla_path_gives_zeros_to_a_query_without_keys():
  """One semantics for both paths: a query that sees no key gets zeros from the XLA path too
  (its softmax over all-masked scores averaged every live value row)."""
  q, kc, vc, lengths, _ = make_inputs(3, 2, 2, 20, 2, 2, 16, jnp.float32, lengths=[0, 9])
  mask = jnp.asarray([[[True, False], [False, False]]] * 2)
  out = attention.attend(q, kc, vc, lengths, mask, scale=0.25, impl="xla")
  np.testing.assert_array_equal(np.asarray(out[0, 1]), 0.0)
  assert_close(out, tree_attention(q, kc, vc, lengths, mask, sm_scale=0.25, interpret=True),
               jnp.float32)


def test_validation_accepts_tracers():
  out = jax.eval_shape(lambda *a: tree_attention(*a, interpret=True), *_good().values())
  assert out.shape == (2, 3, 4, 16) and out.dtype == jnp.float32


@pytest.mark.parametrize("b, t", [(1, 1), (2, 1), (3, 4), (8, 8), (2, 80)])
def test_xla_path_in_bfloat16_over_batches(b, t):
  """The XLA path in bfloat16 for a batch of rows: its value dot once came out as v contracted
  over its slots on the left, which XLA:CPU's dot refuses in bfloat16 (an UNIMPLEMENTED error
  from any batch of more than one row)."""
  q, kc, vc, lengths, mask = make_inputs(40 + t, b, t, 96, 4, 2, 16, jnp.bfloat16)
  out = attention.attend(q, kc, vc, lengths, mask, scale=0.25, impl="xla")
  assert out.shape == (b, t, 4, 16) and out.dtype == jnp.bfloat16
  assert_close(out, tree_attention_reference(q, kc, vc, lengths, mask, sm_scale=0.25),
               jnp.bfloat16)
