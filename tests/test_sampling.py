"""Sampling losslessness: speculative sampling draws the same distribution as the target.

On a 7-token vocabulary (and an 8-token one split over tensor = 8), the joint distribution of
the first three generated tokens of many independent rows (one PRNG key per row) under
speculative sampling is compared with plain autoregressive sampling by a chi-square test of
homogeneity (fixed seeds; significance 0.001, cells with expected count < 5 pooled). The same
test also shows it has power: a different temperature is rejected.
"""

import math

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eagle3jax
from tests import engine_helpers as h

ROWS = 2400
CFG = eagle3jax.LlamaConfig.tiny(vocab_size=7, num_hidden_layers=8, eos_token_ids=())


def chi2_homogeneity(a: np.ndarray, b: np.ndarray, vocab: int):
  """Chi-square statistic and critical value (p = 0.001) for two samples of sequences."""
  ka = np.bincount(a @ vocab ** np.arange(a.shape[1]), minlength=vocab ** a.shape[1])
  kb = np.bincount(b @ vocab ** np.arange(b.shape[1]), minlength=vocab ** b.shape[1])
  na, nb = ka.sum(), kb.sum()
  total = ka + kb
  order = np.argsort(total)
  cells, cur_a, cur_b = [], 0, 0
  for i in order:  # pool the rarest cells until each pooled cell expects >= 5 per sample
    cur_a, cur_b = cur_a + ka[i], cur_b + kb[i]
    if min((cur_a + cur_b) * na, (cur_a + cur_b) * nb) / (na + nb) >= 5:
      cells.append((cur_a, cur_b))
      cur_a = cur_b = 0
  if cur_a + cur_b:
    cells[-1] = (cells[-1][0] + cur_a, cells[-1][1] + cur_b)
  stat = 0.0
  for ca, cb in cells:
    t = ca + cb
    ea, eb = t * na / (na + nb), t * nb / (na + nb)
    stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
  dof = len(cells) - 1
  z = 3.0902  # one-sided normal quantile for p = 0.001 (Wilson-Hilferty approximation)
  critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
  return stat, critical


@pytest.fixture(scope="module")
def pair():
  tgt = eagle3jax.init_target(CFG, seed=5, std=0.35)
  return tgt, h.copy_drafter(tgt)


def _first3(tgt, drafter, temperature, top_p, seed, **kw):
  out = eagle3jax.generate(tgt, drafter, [[1, 2, 3]] * ROWS, max_new_tokens=3,
                           temperature=temperature, top_p=top_p, seed=seed, eos_ids=[], **kw)
  return np.array(out.tokens), out.stats


@pytest.mark.parametrize("temperature,top_p,tree", [(1.0, 1.0, (3, 1, 4)),
                                                    (0.8, 0.85, (3, 2, 5))])
def test_speculative_sampling_matches_autoregressive(pair, temperature, top_p, tree):
  tgt, dr = pair
  steps, topk, tokens = tree
  ar, _ = _first3(tgt, None, temperature, top_p, seed=11)
  spec, stats = _first3(tgt, dr, temperature, top_p, seed=23, num_steps=steps, topk=topk,
                        num_draft_tokens=tokens)
  assert stats["accept_length_mean"] > 1.05  # drafts were accepted, so acceptance ran
  stat, critical = chi2_homogeneity(ar, spec, 7)
  assert stat < critical, f"chi2={stat:.1f} >= {critical:.1f}"
  if temperature == 1.0:  # power: another temperature is told apart
    other, _ = _first3(tgt, None, 0.6, top_p, seed=11)
    stat2, critical2 = chi2_homogeneity(other, spec, 7)
    assert stat2 > critical2, f"chi2={stat2:.1f} <= {critical2:.1f}"


def test_speculative_sampling_on_tensor8_matches_single_device():
  """Vocabulary-parallel sampling: V = 8 over tensor = 8 (one column per device), with top-k
  and top-p; speculative sampling on the mesh draws what autoregressive sampling draws on one
  device."""
  cfg = eagle3jax.LlamaConfig.tiny(vocab_size=8, num_hidden_layers=8, eos_token_ids=())
  one = eagle3jax.init_target(cfg, seed=5, std=0.35)
  sharded = eagle3jax.init_target(cfg, mesh=eagle3jax.make_mesh(1, 8), seed=5, std=0.35)
  assert sharded.lm_head[...].sharding.spec == P(None, "tensor")
  ar, _ = _first3(one, None, 0.8, 0.9, seed=11, top_k=5)
  spec, stats = _first3(sharded, h.copy_drafter(sharded), 0.8, 0.9, seed=23, num_steps=3,
                        topk=2, num_draft_tokens=5, top_k=5)
  assert stats["accept_length_mean"] > 1.05
  stat, critical = chi2_homogeneity(ar, spec, 8)
  assert stat < critical, f"chi2={stat:.1f} >= {critical:.1f}"
  other, _ = _first3(one, None, 0.8, 0.6, seed=11, top_k=5)  # power: another top-p differs
  stat2, critical2 = chi2_homogeneity(other, spec, 8)
  assert stat2 > critical2, f"chi2={stat2:.1f} <= {critical2:.1f}"


def test_sampling_with_the_rbg_prng_on_a_data_axis():
  """Rows sharded over data (a batch of one runs as two rows on data=2): with the rbg PRNG
  the rejection sampler's per-row uniforms failed to compile (its batching rule slices the
  sharded keys); they are laid out explicitly, as the bonus draw's noise is."""
  import jax  # pylint: disable=import-outside-toplevel
  with jax.default_prng_impl("rbg"):
    tgt = h.target(eagle3jax.make_mesh(2, 1))
    dr = h.copy_drafter(tgt)
    kw = dict(max_new_tokens=12, temperature=0.8, top_p=0.9, eos_ids=[], seed=1)
    spec = eagle3jax.generate(tgt, dr, h.PROMPTS[:1], num_steps=3, topk=2, num_draft_tokens=5,
                              **kw)
    assert len(spec.tokens[0]) == 12
    again = eagle3jax.generate(tgt, dr, h.PROMPTS[:1], num_steps=3, topk=2, num_draft_tokens=5,
                               **kw)
    assert again.tokens == spec.tokens  # a seed draws the same tokens
