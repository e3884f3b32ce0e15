"""Hand-worked trees: selection, masks, positions, paths; acceptance; KV commit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3jax import acceptance, engine, tree as tree_lib
from eagle3jax.kv_cache import KVCache


def _select_example():
  """topk=2, num_steps=2, 5 verified tokens (root + 4).

  Pool (level order): level 1: a (idx 0, logp -0.1), b (idx 1, -0.5);
  level 2 children: of a: c (2, -0.3), d (3, -1.0); of b: e (4, -0.6), f (5, -2.0).
  Best 4 by score: a -0.1, c -0.3, b -0.5, e -0.6 -> sorted by pool index: a, b, c, e.
  Nodes: 0 root(99), 1 a(10), 2 b(11), 3 c(12), 4 e(14); parents 0,0,0,1,2; depth 0,1,1,2,2.
  """
  score = jnp.array([[-0.1, -0.5, -0.3, -1.0, -0.6, -2.0]])
  parent = jnp.array([[-1, -1, 0, 0, 1, 1]])
  token = jnp.array([[10, 11, 12, 13, 14, 15]])
  return tree_lib.select(score, parent, token, jnp.array([99]), tree_lib.TreeShape(2, 2, 5))


def test_select_mask_positions_paths():
  tokens, parent, depth, mask = _select_example()
  np.testing.assert_array_equal(tokens[0], [99, 10, 11, 12, 14])
  np.testing.assert_array_equal(parent[0], [0, 0, 0, 1, 2])
  np.testing.assert_array_equal(depth[0], [0, 1, 1, 2, 2])
  expected = np.array([[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 0, 1, 0, 0],
                       [1, 1, 0, 1, 0],
                       [1, 0, 1, 0, 1]], bool)
  np.testing.assert_array_equal(mask[0], expected)
  # positions = committed length + depth
  np.testing.assert_array_equal(7 + depth[0], [7, 8, 8, 9, 9])
  # root-to-leaf path of node 4 (e): 0 -> 2 -> 4
  np.testing.assert_array_equal(tree_lib.path_of(mask[:, 4], depth, 3)[0], [0, 2, 4])


def test_chain_is_a_chain():
  shape = tree_lib.TreeShape(3, 1, 4)
  score = jnp.array([[-0.1, -0.2, -0.3]])
  tokens, parent, depth, mask = tree_lib.select(score, jnp.array([[-1, 0, 1]]),
                                                jnp.array([[5, 6, 7]]), jnp.array([4]), shape)
  np.testing.assert_array_equal(tokens[0], [4, 5, 6, 7])
  np.testing.assert_array_equal(parent[0], [0, 0, 1, 2])
  np.testing.assert_array_equal(mask[0], np.tril(np.ones((4, 4), bool)))


def test_tree_shape_errors():
  with pytest.raises(ValueError, match="num_draft_tokens=9 must be between 2 and 7"):
    tree_lib.TreeShape(2, 2, 9)
  with pytest.raises(ValueError, match="topk=0"):
    tree_lib.TreeShape(2, 0, 2)
  # Before these limits, 2000 levels compiled for minutes and 10**8 ended in an int32
  # overflow deep inside the cache update.
  with pytest.raises(ValueError, match="num_steps=2000: at most 64 drafted levels"):
    tree_lib.TreeShape(2000, 1, 2001)
  with pytest.raises(ValueError, match=r"a candidate pool of 3750500 tokens .* more than 65536"):
    tree_lib.TreeShape(16, 500, 8)
  tree_lib.TreeShape(64, 1, 65)  # the limits themselves are allowed


def _logits_with_argmax(argmax, vocab=20):
  return jax.nn.one_hot(jnp.asarray(argmax), vocab) * 5.0


@pytest.mark.parametrize("target_argmax,best,accepted,bonus", [
    # Target argmax per node [root, a, b, c, e]. All rejected: root's argmax 7 is no child.
    ([7, 0, 0, 0, 0], 0, 0, 7),
    # Partial: root -> b (11) accepted; b's argmax 3 is not e (14): bonus 3.
    ([11, 0, 3, 0, 0], 2, 1, 3),
    # All accepted along a -> c: root argmax 10 (a), a's argmax 12 (c); bonus c's argmax 19.
    ([10, 12, 0, 19, 0], 3, 2, 19),
])
def test_greedy_acceptance(target_argmax, best, accepted, bonus):
  tokens, parent, depth, mask = _select_example()
  logits = _logits_with_argmax([target_argmax])
  b, a, bo = acceptance.greedy(logits, tokens, parent, depth, mask)
  assert (int(b[0]), int(a[0]), int(bo[0])) == (best, accepted, bonus)


def test_rejection_sampling_edge_cases():
  tokens, parent, depth, mask = _select_example()
  v = 20
  probs = np.full((1, 5, v), 0.0, np.float32)
  # Root puts all mass on b (11): a is rejected, b accepted; b puts all mass on e (14):
  # accepted; e's distribution is a point mass on 4 -> bonus 4.
  probs[0, 0, 11] = 1.0
  probs[0, 2, 14] = 1.0
  probs[0, 4, 4] = 1.0
  probs[0, 1, 0] = probs[0, 3, 0] = 1.0
  keys = jax.random.key_data(jax.random.split(jax.random.key(0), 1))
  keys = jax.vmap(jax.random.wrap_key_data)(keys)
  best, acc, bonus = acceptance.rejection_sample(jnp.asarray(probs), tokens, parent, depth,
                                                 keys, 2)
  assert (int(best[0]), int(acc[0]), int(bonus[0])) == (4, 2, 4)
  # Root has no mass on any child: everything rejected, bonus from the (unchanged) residual.
  probs2 = np.zeros((1, 5, v), np.float32)
  probs2[0, :, 3] = 1.0
  best, acc, bonus = acceptance.rejection_sample(jnp.asarray(probs2), tokens, parent, depth,
                                                 keys, 2)
  assert (int(best[0]), int(acc[0]), int(bonus[0])) == (0, 0, 3)


def test_kv_commit_moves_accepted_path_contiguously():
  # One layer, one row, committed length 3, tree of 5 nodes at slots 3..7.
  s = 10
  k = np.full((1, 2, s, 1), np.nan, np.float32)  # [B, K, S, H], two heads
  k[0, :, :3, 0] = [100, 101, 102]
  k[0, :, 3:8, 0] = [0, 1, 2, 3, 4]       # node i's key is i
  k[0, 1] += 1000                          # head 1's keys differ from head 0's
  cache = KVCache(jnp.asarray(k)[None], jnp.asarray(k * 2)[None], jnp.array([3]))
  path = jnp.array([[0, 2, 4]])            # root -> b -> e
  out = engine._commit_cache(cache, path, jnp.array([6]))
  for head, off in ((0, 0), (1, 1000)):
    np.testing.assert_array_equal(np.asarray(out.k[0])[0, head, :6, 0],
                                  np.array([100, 101, 102, 0, 2, 4]) + off)
    np.testing.assert_array_equal(np.asarray(out.v[0])[0, head, :6, 0],
                                  2 * (np.array([100, 101, 102, 0, 2, 4]) + off))
  assert int(out.lengths[0]) == 6
