"""Prefill then extend (chunks, tree masks) equals the full-sequence forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import eagle3jax
from eagle3jax.capture import CaptureSpec
from tests import engine_helpers as h

CFG = eagle3jax.LlamaConfig.tiny(num_hidden_layers=4, qkv_bias=True, qk_norm=True)
CAPTURE = CaptureSpec((-1, 1, 3))


@functools.partial(jax.jit, static_argnames=("graphdef", "capture"))
def _extend(graphdef, state, tokens, positions, cache, tree_mask, capture):
  model = nnx.merge(graphdef, state)
  return model(tokens, positions, cache, tree_mask, capture)


def _run(model, tokens, positions, cache, tree_mask):
  graphdef, state = nnx.split(model)
  with jax.set_mesh(model.mesh):
    return _extend(graphdef, state, tokens, positions, cache, tree_mask, CAPTURE)


@pytest.fixture(scope="module")
def model():
  return eagle3jax.init_target(CFG, seed=3, std=0.1)


def test_chunked_extend_with_ragged_rows_matches_full(model):
  rng = np.random.default_rng(0)
  b, total, max_len = 3, 17, 40
  ids = rng.integers(0, CFG.vocab_size, (b, total))
  full = eagle3jax.forward(model, ids, capture=CAPTURE)
  with jax.set_mesh(model.mesh):
    cache = model.allocate_cache(b, max_len, fill=np.nan)  # never rely on zeroed memory
  # Rows advance by different amounts per chunk (ragged lengths); pad with junk tokens.
  pos = np.zeros(b, int)
  logits = [[] for _ in range(b)]
  aux = [[] for _ in range(b)]
  steps = [(5, 3, 7), (6, 1, 4), (6, 13, 6)]
  for chunk in steps:
    t = max(chunk)
    toks = np.full((b, t), 5)
    positions = np.zeros((b, t), int)
    for r in range(b):
      toks[r, :chunk[r]] = ids[r, pos[r]:pos[r] + chunk[r]]
      positions[r] = pos[r] + np.arange(t)
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    lg, ax, cache = _run(model, jnp.asarray(toks), jnp.asarray(positions), cache,
                         jnp.asarray(causal))
    for r in range(b):
      logits[r].append(np.asarray(lg[r, :chunk[r]]))
      aux[r].append(np.asarray(ax[r, :chunk[r]]))
    pos += np.array(chunk)
    cache = cache.with_lengths(jnp.asarray(pos, jnp.int32))
  for r in range(b):
    np.testing.assert_allclose(np.concatenate(logits[r]), np.asarray(full.logits[r]),
                               atol=2e-5)
    np.testing.assert_allclose(np.concatenate(aux[r]), np.asarray(full.aux_hidden[r]),
                               atol=2e-5)


def test_tree_extend_matches_full_forward_of_each_branch(model):
  """A tree over a prefix: each node's output equals the full forward of its branch."""
  rng = np.random.default_rng(1)
  prefix = rng.integers(0, CFG.vocab_size, 9)
  # Tree: 0 root; 1,2 children of 0; 3 child of 1; 4 child of 2; 5 child of 3.
  parent = [-1, 0, 0, 1, 2, 3]
  depth = [0, 1, 1, 2, 2, 3]
  tokens = rng.integers(0, CFG.vocab_size, 6)
  p = len(parent)
  mask = h.ancestor_mask(parent)
  with jax.set_mesh(model.mesh):
    cache = model.allocate_cache(1, 24, fill=np.nan)
  t = len(prefix)
  _, _, cache = _run(model, jnp.asarray(prefix[None]), jnp.arange(t)[None], cache,
                     jnp.tril(jnp.ones((1, t, t), bool)))
  cache = cache.with_lengths(jnp.array([t], jnp.int32))
  lg, ax, _ = _run(model, jnp.asarray(tokens[None]), jnp.asarray(t + np.array(depth))[None],
                   cache, jnp.asarray(mask[None]))
  for i in range(p):
    seq = np.concatenate([prefix, h.branch(parent, tokens, i)])[None]
    full = eagle3jax.forward(model, seq, capture=CAPTURE)
    np.testing.assert_allclose(np.asarray(lg[0, i]), np.asarray(full.logits[0, -1]), atol=2e-5)
    np.testing.assert_allclose(np.asarray(ax[0, i]), np.asarray(full.aux_hidden[0, -1]),
                               atol=2e-5)


def test_decode_loop_touches_the_stacked_cache_once_not_twice():
  """Each layer writes only its new tokens into the stacked ``[L, B, K, S, H]`` cache
  (``kv_cache.LayerKV``). Copying the layer's slab out and setting it back whole, as before,
  made XLA move the whole stacked cache again per layer: its cost analysis counted twice the
  cache's bytes for one autoregressive step (20x slower steps at batch 128 on XLA:CPU)."""
  from eagle3jax import engine as eng
  from eagle3jax.generate import start
  from eagle3jax.sampling import SamplingParams
  tgt = eagle3jax.init_target(eagle3jax.LlamaConfig.tiny(num_hidden_layers=8), seed=0)
  spec = eng.EngineSpec(tree=None, sampling=SamplingParams(greedy=True, top_k=0), capture=None)
  with jax.set_mesh(tgt.mesh):
    graphdef, params, st, dyn, _, _ = start(tgt, None, [[1, 2, 3]], spec, max_new_tokens=1000,
                                            eos=eng.eos_array())
    compiled = eng._decode_jit.lower(graphdef, params, st, dyn, jnp.int32(3),
                                     spec=spec).compile()
  accessed = compiled.cost_analysis()["bytes accessed"]
  cache = st.target_cache.nbytes
  assert accessed < 1.5 * cache, (accessed, cache)


def _all_gathers(fn, *args) -> list[str]:
  text = jax.jit(fn).lower(*args).compile().as_text()
  return [line.strip()[:160] for line in text.splitlines()
          if "all-gather(" in line or "all-gather-start(" in line]


def test_row_sharded_cache_updates_stay_on_their_devices():
  """Cache writes and the commit on rows sharded over ``data`` (mesh 2 x 4) run shard by shard
  (``kv_cache.update_rows``): no all-gather of new rows or indices, same values as one
  device. The check can fail: the plain scatter it replaces all-gathers them."""
  from jax.sharding import PartitionSpec as P
  from eagle3jax import engine as eng
  from eagle3jax.kv_cache import KVCache, LayerKV
  rng = np.random.default_rng(5)
  l, b, s, k, h, t = 3, 4, 16, 4, 8, 5
  buf = rng.normal(size=(l, b, k, s, h)).astype(np.float32)                # [L, B, K, S, H]
  new = rng.normal(size=(b, t, k, h)).astype(np.float32)
  start = np.array([0, 3, 7, 11], np.int32)
  path = np.array([[0, 2, 3, 0, 0], [0, 1, 0, 0, 0], [0, 4, 2, 1, 0], [0, 3, 4, 2, 1]],
                  np.int32)
  new_m = start + np.array([3, 2, 4, 5], np.int32)

  def write(buf, new, start):
    return LayerKV(buf, 1).write(new, start).stacked

  def commit(kbuf, vbuf, start, path, new_m):
    c = eng._commit_cache(KVCache(kbuf, vbuf, start), path, new_m)
    return c.k, c.v

  def plain(buf, new, start):
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    slots = start[:, None] + jnp.arange(t)[None, :]
    return buf.at[1, rows, :, slots].set(new, mode="drop", unique_indices=True,
                                         out_sharding=jax.typeof(buf).sharding)

  want_write = jax.jit(write)(buf, new, start)
  # The write itself, against numpy: row r's token j lands at slot start[r] + j of layer 1, in
  # every head; nothing else moves.
  expect = buf.copy()
  for r in range(b):
    for j in range(t):
      if start[r] + j < s:
        expect[1, r, :, start[r] + j] = new[r, j]
  np.testing.assert_array_equal(np.asarray(want_write), expect)
  want_commit = jax.jit(commit)(buf, buf * 2, start, path, new_m)
  mesh = eagle3jax.make_mesh(2, 4)
  with jax.set_mesh(mesh):
    put = lambda x, *spec: jax.device_put(x, jax.NamedSharding(mesh, P(*spec)))  # noqa: E731
    dbuf = put(buf, None, "data", "tensor", None, None)
    dnew = put(new, "data", None, "tensor", None)
    dstart, dpath, dm = put(start, "data"), put(path, "data", None), put(new_m, "data")
    assert _all_gathers(plain, dbuf, dnew, dstart)
    assert _all_gathers(write, dbuf, dnew, dstart) == []
    assert _all_gathers(commit, dbuf, dbuf * 2, dstart, dpath, dm) == []
    got_write = jax.jit(write)(dbuf, dnew, dstart)
    got_commit = jax.jit(commit)(dbuf, dbuf * 2, dstart, dpath, dm)
  assert got_write.sharding.spec == P(None, "data", "tensor", None, None)
  np.testing.assert_array_equal(np.asarray(got_write), np.asarray(want_write))
  for got, want in zip(got_commit, want_commit):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("tree", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_decode_round_on_a_data_sharded_mesh_gathers_nothing(tree):
  """The compiled speculative decode loop (greedy; a chain, and a tree, whose commit moves K/V)
  on mesh 2 x 4, batch 4: every row's cache traffic stays on its device (before
  ``update_rows``: 30 all-gathers of new K/V rows, scatter indices and commit moves)."""
  from eagle3jax import engine as eng, sampling
  from eagle3jax.tree import TreeShape
  mesh = eagle3jax.make_mesh(2, 4)
  tgt = h.target(mesh)
  spec = eng.EngineSpec(tree=TreeShape(*tree), capture=h.CAPTURE,
                        sampling=sampling.SamplingParams(greedy=True, top_k=0))
  text = h.decode_program_text(mesh, tgt, h.random_drafter(tgt), spec, batch=4)
  assert "all-gather(" not in text and "all-gather-start(" not in text
