"""How sure an acceptance length measured on a few prompts is: bootstrap intervals over prompts.

A held-out acceptance length is pooled over prompts: the tokens the rounds accepted (accepted
drafts + 1 per round) over the rounds, summed over every prompt. The prompts are the
independent units; the rounds of one prompt are not (an easy prompt has many long rounds), so
the interval resamples prompts with replacement and takes the percentiles of the pooled ratio
(percentile bootstrap). Two drafters measured on the same prompts are compared in pairs: each
resample draws the same prompts for both, so what a prompt does to both (its difficulty) cancels
in the difference, which is why a paired difference can be sure where the two intervals
overlap.

Prompts cut from the same document are not independent either: pass each prompt's source as
``groups`` and a resample draws sources, with all their prompts (a cluster bootstrap; the
pooled ratio over the drawn sources' sums). Without ``groups`` every prompt is its own source.

A prompt with no round (it ended at its first token) carries no acceptance and is left out.
Greedy acceptance is deterministic, so the interval is about which prompts were drawn, not
about run-to-run noise; it says nothing of another training run of the same recipe. With few
sources (under about 10-20) a percentile bootstrap is too narrow: it sees only the spread of
the sources it has, and covers less than its level.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eagle3jax import checks

DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 10_000


@dataclasses.dataclass(frozen=True)
class PromptAcceptance:
  """Rounds and accepted tokens per prompt, in prompt order (``generate``'s
  ``rounds_per_row`` and ``accepted_per_row``, concatenated over calls).

  Attributes:
    rounds: ``[P]`` rounds each prompt ran.
    accepted: ``[P]`` tokens its rounds accepted (accepted drafts + 1 per round).
  """
  rounds: tuple[int, ...]
  accepted: tuple[int, ...]

  def __post_init__(self):
    rounds = tuple(_count(x, "rounds") for x in self.rounds)
    accepted = tuple(_count(x, "accepted") for x in self.accepted)
    if len(rounds) != len(accepted):
      raise ValueError(f"PromptAcceptance: {len(rounds)} rounds for {len(accepted)} accepted "
                       "counts; pass one of each per prompt")
    bad = [i for i, (r, a) in enumerate(zip(rounds, accepted)) if a < r or (a and not r)]
    if bad:
      i = bad[0]
      raise ValueError(f"PromptAcceptance: prompt {i} accepted {accepted[i]} tokens in "
                       f"{rounds[i]} rounds, but every round accepts at least one token and "
                       "only rounds accept tokens")
    object.__setattr__(self, "rounds", rounds)
    object.__setattr__(self, "accepted", accepted)

  @property
  def length(self) -> float | None:
    """The pooled acceptance length; None when no prompt ran a round."""
    total = sum(self.rounds)
    return sum(self.accepted) / total if total else None

  def __add__(self, other: PromptAcceptance) -> PromptAcceptance:
    """The prompts of both, in order (for measurements made in several calls)."""
    if not isinstance(other, PromptAcceptance):
      return NotImplemented
    return PromptAcceptance(self.rounds + other.rounds, self.accepted + other.accepted)

  def to_dict(self) -> dict:
    return {"rounds": list(self.rounds), "accepted": list(self.accepted)}


def _count(x, name: str) -> int:
  if not checks.is_integer(x) or x < 0:
    raise ValueError(f"PromptAcceptance.{name}: {x!r} is not a count (an integer >= 0)")
  return int(x)


def _check(level: float, resamples: int) -> int:
  if not checks.is_real(level) or not 0 < level < 1:
    raise ValueError(f"level={level!r}: a confidence level is between 0 and 1, e.g. 0.95")
  if not checks.is_integer(resamples) or resamples < 100:
    raise ValueError(f"resamples={resamples!r}: at least 100 resamples (default "
                     f"{DEFAULT_RESAMPLES})")
  return int(resamples)


_CHUNK = 1000  # resamples drawn at a time: memory stays [_CHUNK, units] whatever the count


def _resampled_lengths(units: list[tuple[np.ndarray, np.ndarray]], resamples: int, seed: int
                       ) -> list[np.ndarray]:
  """Pooled length of each resample ``[resamples]`` for each ``(rounds, accepted)`` pair of
  arrays over the same units, every pair resampled with the same draws."""
  rng = np.random.default_rng(seed)
  n = len(units[0][0])
  out = [[] for _ in units]
  for start in range(0, resamples, _CHUNK):
    picks = rng.integers(0, n, size=(min(_CHUNK, resamples - start), n))
    for lengths, (rounds, accepted) in zip(out, units):
      lengths.append(accepted[picks].sum(axis=1) / rounds[picks].sum(axis=1))
  return [np.concatenate(x) for x in out]


def sources_with_rounds(*measured: PromptAcceptance, groups=None) -> int:
  """How many sources (prompts without ``groups``) have a prompt where every measurement ran a
  round: ``interval`` and ``paired_difference`` need 2 or more."""
  units = range(len(measured[0].rounds)) if groups is None else groups
  return len({u for i, u in enumerate(units) if all(m.rounds[i] for m in measured)})


def _with_rounds(*measured: PromptAcceptance, groups=None
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
  """The prompts where every measurement ran a round, as arrays of sums per group (per prompt
  without ``groups``); at least two groups of them."""
  n = len(measured[0].rounds)
  if any(len(m.rounds) != n for m in measured):
    raise ValueError("a paired comparison needs the same prompts for both measurements "
                     f"(got {[len(m.rounds) for m in measured]} prompts)")
  unit = "prompts" if groups is None else "sources"
  if groups is None:
    groups = range(n)
  elif len(groups) != n:
    raise ValueError(f"groups: {len(groups)} sources for {n} prompts; pass one per prompt")
  keep = [i for i in range(n) if all(m.rounds[i] for m in measured)]
  ids = {}
  index = np.asarray([ids.setdefault(groups[i], len(ids)) for i in keep], np.int64)
  if len(ids) < 2:
    raise ValueError(f"an interval needs at least 2 {unit} that ran a round (got {len(ids)}; "
                     f"{len(keep)} of {n} prompts ran one): measure on more prompts")
  return [(np.bincount(index, np.asarray(m.rounds, np.float64)[keep], len(ids)),
           np.bincount(index, np.asarray(m.accepted, np.float64)[keep], len(ids)))
          for m in measured]


def interval(measured: PromptAcceptance, *, groups=None, level: float = DEFAULT_LEVEL,
             resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> tuple[float, float]:
  """``(low, high)``: the percentile-bootstrap interval of ``measured.length`` at ``level``,
  resampling prompts, or with ``groups`` (one hashable per prompt: its source) the sources
  (``seed`` fixes the resamples, so the same input gives the same interval)."""
  resamples = _check(level, resamples)
  (lengths,) = _resampled_lengths(_with_rounds(measured, groups=groups), resamples, seed)
  low, high = np.quantile(lengths, [(1 - level) / 2, (1 + level) / 2])
  return float(low), float(high)


def paired_difference(measured: PromptAcceptance, baseline: PromptAcceptance, *, groups=None,
                      level: float = DEFAULT_LEVEL, resamples: int = DEFAULT_RESAMPLES,
                      seed: int = 0) -> tuple[float, float, float]:
  """``(difference, low, high)``: ``measured.length - baseline.length`` on the same prompts, in
  the same order (over the prompts where both ran a round), and its percentile-bootstrap
  interval at ``level``, each resample drawing the same prompts (or, with ``groups``, sources)
  for both. An interval that excludes 0 says the prompts drawn cannot explain the
  difference."""
  resamples = _check(level, resamples)
  units = _with_rounds(measured, baseline, groups=groups)
  (r1, a1), (r0, a0) = units
  lengths, base = _resampled_lengths(units, resamples, seed)
  diffs = lengths - base
  low, high = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
  return float(a1.sum() / r1.sum() - a0.sum() / r0.sum()), float(low), float(high)
