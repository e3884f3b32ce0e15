"""Intervals of acceptance lengths over prompts (``eagle3jax.acceptance_stats``) and the
per-prompt counts they resample (``generate``'s per-row stats,
``monitor.measure_acceptance_per_prompt``)."""

import numpy as np
import pytest

from eagle3jax import monitor
from eagle3jax.acceptance_stats import (PromptAcceptance, interval, paired_difference,
                                        sources_with_rounds)
from tests import engine_helpers as h


def _population(n, seed):
  """Prompts of unequal difficulty: per-prompt acceptance from 1.5 to 7.5, 15 to 40 rounds."""
  rng = np.random.default_rng(seed)
  rounds = rng.integers(15, 41, n)
  per_round = rng.uniform(1.5, 7.5, n)
  accepted = np.maximum(rounds, np.rint(rounds * per_round).astype(int))
  return rounds, accepted


def test_prompt_acceptance_pools_and_refuses_what_is_not_a_count():
  m = PromptAcceptance((2, 3), (10, 6))
  assert m.length == 16 / 5
  assert (m + PromptAcceptance((5,), (5,))).length == 21 / 10
  assert PromptAcceptance((0, 0), (0, 0)).length is None
  assert m.to_dict() == {"rounds": [2, 3], "accepted": [10, 6]}
  assert PromptAcceptance(np.array([2]), np.array([3])).rounds == (2,)  # numpy counts
  for rounds, accepted, match in (((1, 2), (3,), "2 rounds for 1 accepted"),
                                  ((4,), (3,), "prompt 0 accepted 3 tokens in 4 rounds"),
                                  ((-1,), (3,), "-1 is not a count"),
                                  ((1.0,), (3,), "1.0 is not a count"),
                                  ((True,), (3,), "True is not a count")):
    with pytest.raises(ValueError, match=match):
      PromptAcceptance(rounds, accepted)
  with pytest.raises(ValueError, match="prompt 1 accepted 5 tokens in 0 rounds"):
    PromptAcceptance((1, 0), (1, 5))
  with pytest.raises(TypeError):
    m + (1, 2)  # pylint: disable=pointless-statement


def test_interval_resamples_prompts_and_covers_the_population_length():
  """Drawing 32 prompts from a population of 4000, the 90% interval holds the population's
  pooled length in about 90% of the draws. Resampling rounds instead of prompts (far too
  narrow), or the tokens and rounds of different prompts (too wide), would not."""
  rounds, accepted = _population(4000, 0)
  truth = accepted.sum() / rounds.sum()
  rng = np.random.default_rng(1)
  trials, covered, widths = 300, 0, []
  for t in range(trials):
    pick = rng.integers(0, 4000, 32)
    low, high = interval(PromptAcceptance(tuple(rounds[pick]), tuple(accepted[pick])),
                         level=0.9, resamples=1000, seed=t)
    covered += low <= truth <= high
    widths.append(high - low)
  # Measured: 0.88 and a median width of 1.02. Rounds as the units: 0.23 and 0.19; the tokens
  # and rounds of independent draws of prompts: 0.96 and 1.43.
  assert 0.83 <= covered / trials <= 0.95, covered / trials
  assert 0.8 < np.median(widths) < 1.25, np.median(widths)


def test_interval_is_reproducible_and_exact_at_its_edges():
  m = PromptAcceptance((20, 30, 25, 18, 26, 18, 37, 27), (90, 100, 160, 120, 127, 129, 134, 128))
  assert interval(m) == interval(m) and interval(m, seed=1) != interval(m)
  low, high = interval(m)
  assert low < m.length < high
  assert min(a / r for r, a in zip(m.rounds, m.accepted)) <= low
  assert high <= max(a / r for r, a in zip(m.rounds, m.accepted))
  assert interval(PromptAcceptance((10, 20), (50, 100))) == (5.0, 5.0)  # every prompt alike
  # Prompts without a round carry no acceptance and are left out.
  assert interval(PromptAcceptance((20, 0, 30), (90, 0, 100)), seed=3) == interval(
      PromptAcceptance((20, 30), (90, 100)), seed=3)
  for bad, match in (({"level": 1.0}, "level=1.0: a confidence level is between 0 and 1"),
                     ({"level": 0}, "level=0"), ({"resamples": 10}, "resamples=10: at least 100")):
    with pytest.raises(ValueError, match=match):
      interval(m, **bad)
  with pytest.raises(ValueError, match=r"at least 2 prompts that ran a round \(got 1; 1 of 2 "):
    interval(PromptAcceptance((20, 0), (90, 0)))


def test_prompts_of_one_source_are_resampled_together():
  """Each prompt cut eight times from its file: resampling the copies as if independent
  narrows the interval about sqrt(8)-fold, resampling the files gives the original's."""
  rounds, accepted = _population(16, 2)
  one = PromptAcceptance(tuple(rounds), tuple(accepted))
  copies = PromptAcceptance(tuple(np.repeat(rounds, 8)), tuple(np.repeat(accepted, 8)))
  files = [f"file{i}.py" for i in np.repeat(np.arange(16), 8)]
  assert interval(copies, groups=files) == interval(one)
  assert interval(one, groups=list(range(16))) == interval(one)
  low, high = interval(copies)
  assert (high - low) * 2 < np.subtract(*interval(one)[::-1])
  better = PromptAcceptance(copies.rounds, tuple(a + 2 for a in copies.accepted))
  better_one = PromptAcceptance(one.rounds, tuple(a + 2 for a in one.accepted))
  assert paired_difference(better, copies, groups=files) == paired_difference(better_one, one)
  low, high = paired_difference(better, copies)[1:]
  assert (high - low) * 2 < np.subtract(*paired_difference(better_one, one)[:0:-1])
  # A prompt without a round, in either measurement, leaves the pair; its file stays if
  # another of its prompts ran one.
  rounds = list(copies.rounds)
  rounds[0] = 0
  accepted = list(copies.accepted)
  accepted[0] = 0
  gap = PromptAcceptance(tuple(rounds), tuple(accepted))
  kept = PromptAcceptance(copies.rounds[1:], copies.accepted[1:])
  kept_better = PromptAcceptance(better.rounds[1:], better.accepted[1:])
  assert paired_difference(better, gap, groups=files) == paired_difference(
      kept_better, kept, groups=files[1:])
  assert sources_with_rounds(gap, better, groups=files) == 16
  assert sources_with_rounds(gap, better) == 127
  assert sources_with_rounds(PromptAcceptance(gap.rounds[:8], gap.accepted[:8]),
                             groups=files[:8]) == 1
  with pytest.raises(ValueError, match=r"groups: 3 sources for 128 prompts"):
    interval(copies, groups=files[:3])
  with pytest.raises(ValueError, match=r"at least 2 sources that ran a round \(got 1; 8 of 8"):
    interval(PromptAcceptance(copies.rounds[:8], copies.accepted[:8]), groups=files[:8])


def test_paired_difference_cancels_what_the_prompts_share():
  """Drafter b accepts 0.2 more than a on every prompt, on prompts of very unequal difficulty:
  the two intervals overlap, but the paired difference's excludes 0. Drawing different prompts
  for the two (unpaired) would not."""
  rounds, accepted = _population(24, 5)
  a = PromptAcceptance(tuple(rounds), tuple(accepted))
  b = PromptAcceptance(tuple(rounds), tuple(accepted + np.rint(0.2 * rounds).astype(int)))
  (a_low, a_high), (b_low, b_high) = interval(a), interval(b)
  assert a_low < b_low < a_high < b_high  # b's is higher, and they overlap
  diff, low, high = paired_difference(b, a)
  assert diff == pytest.approx(b.length - a.length) and 0 < low <= diff <= high
  assert paired_difference(a, a) == (0.0, 0.0, 0.0)
  assert paired_difference(a, b)[0] == pytest.approx(-diff)
  with pytest.raises(ValueError, match=r"the same prompts for both measurements \(got \[24, 2\]"):
    paired_difference(a, PromptAcceptance((1, 1), (2, 2)))


def test_per_prompt_counts_are_generates_and_pool_to_measure_acceptance():
  tgt = h.target()
  good = h.copy_drafter(tgt)
  prompts = h.PROMPTS[:3]
  import eagle3jax  # pylint: disable=import-outside-toplevel
  r = eagle3jax.generate(tgt, good, prompts, max_new_tokens=12, num_steps=3, eos_ids=[])
  assert len(r.stats["rounds_per_row"]) == len(prompts) == len(r.stats["accepted_per_row"])
  assert sum(r.stats["rounds_per_row"]) == r.stats["rounds"]
  assert sum(r.stats["accepted_per_row"]) == r.stats["accepted"]
  assert min(r.stats["rounds_per_row"]) >= 1
  shapes = ((3, 1, 4), (2, 2, 4))
  per_prompt = monitor.measure_acceptance_per_prompt(tgt, good, prompts, shapes,
                                                     max_new_tokens=12, batch_size=2,
                                                     eos_ids=[])
  assert list(per_prompt) == ["3,1,4", "2,2,4"]
  assert per_prompt["3,1,4"].rounds == tuple(r.stats["rounds_per_row"])  # across 2 calls
  assert per_prompt["3,1,4"].accepted == tuple(r.stats["accepted_per_row"])
  assert monitor.measure_acceptance(tgt, good, prompts, shapes, max_new_tokens=12,
                                    batch_size=2, eos_ids=[]) == {
                                        k: round(m.length, 4) for k, m in per_prompt.items()}


@pytest.mark.parametrize("name", ["8prompts", "64prompts", "512prompts", "two_runs_8prompts",
                                  "two_runs_512prompts"])
def test_the_documented_intervals_follow_from_their_counts(name):
  """docs/drafter_intervals_*.json (the README's figures): every length, interval and paired
  difference is what DrafterComparison.summary computes from the file's own per-prompt counts
  and sources, and the prompts are those the file names (count, files)."""
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  from eagle3jax.demo import DrafterComparison  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(__file__).parent.parent / "docs" / f"drafter_intervals_{name}.json"
  doc = json.loads(path.read_text())
  measured = {d: {k: PromptAcceptance(**m) for k, m in shapes.items()}
              for d, shapes in doc["per_prompt"].items()}
  summary = DrafterComparison(measured, tuple(doc["sources"])).summary(doc["level"])
  assert all(len(m.rounds) == doc["prompts"] for s in measured.values() for m in s.values())
  for key in ("files", "acceptance", "interval", "difference"):
    assert summary[key] == doc[key], key
  if "after_the_64" in doc:  # the prompts no choice was made on
    later = {d: {k: PromptAcceptance(m.rounds[64:], m.accepted[64:]) for k, m in s.items()}
             for d, s in measured.items()}
    summary = DrafterComparison(later, tuple(doc["sources"][64:])).summary(doc["level"])
    for key in ("files", "acceptance", "interval", "difference"):
      assert summary[key] == doc["after_the_64"][key], key


def test_a_comparison_summary_has_intervals_only_where_two_files_ran_rounds():
  from eagle3jax.demo import DrafterComparison  # pylint: disable=import-outside-toplevel
  rounds, accepted = _population(6, 4)
  a = PromptAcceptance(tuple(rounds), tuple(accepted))
  b = PromptAcceptance(tuple(rounds), tuple(accepted + 3))
  none = PromptAcceptance((0,) * 6, (0,) * 6)  # a shape where every prompt ended at once
  both = {"x": {"7,1,8": a, "5,4,8": none}, "y": {"7,1,8": b, "5,4,8": none}}
  s = DrafterComparison(both, (0, 0, 1, 1, 2, 2)).summary()
  assert s["level"] == 0.95 and s["files"] == 3
  assert s["acceptance"] == {"x": {"7,1,8": round(a.length, 4)}, "y": {"7,1,8": round(b.length, 4)}}
  assert s["interval"]["x"] == {
      "7,1,8": [round(v, 4) for v in interval(a, groups=(0, 0, 1, 1, 2, 2))]}
  diff = s["difference"]["y"]["7,1,8"]
  assert diff["against"] == "x" and diff["low"] > 0 and list(s["difference"]["y"]) == ["7,1,8"]
  one_file = DrafterComparison(both, (5,) * 6).summary(0.9)
  assert one_file["level"] == 0.9 and one_file["files"] == 1
  assert "interval" not in one_file and "difference" not in one_file
  assert one_file["acceptance"] == s["acceptance"]
