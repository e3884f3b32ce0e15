"""Live acceptance against the acceptance the drafter reached on held-out data at training time.

The capture record (``eagle3jax.capture_contract``) keeps the held-out greedy acceptance length
per tree shape. ``compare`` adds it to ``generate``'s stats next to the live value and warns
(``warnings.warn``, once per ``generate`` call) when the live value stays far below it over
enough rounds: a drafter fed other features than its training data (the seed's bug) still
decodes correctly, only slower, and this is the one symptom a user sees.
"""

from __future__ import annotations

import warnings

from eagle3jax import checks
from eagle3jax.semantics import standard_numpy

# Warn when, over at least MIN_ROUNDS greedy rounds, the live accepted drafts per round
# (acceptance length - 1) fall below FAR_BELOW times the recorded ones.
MIN_ROUNDS = 32
FAR_BELOW = 0.5


class AcceptanceWarning(UserWarning):
  """Live acceptance far below what the drafter reached on held-out data."""


def recorded_acceptance(drafter, num_steps: int, topk: int, num_draft_tokens: int
                        ) -> float | None:
  record = getattr(drafter, "capture_record", None)
  if record is None:
    return None
  return record.acceptance_for(num_steps, topk, num_draft_tokens)


def compare(stats: dict, drafter, num_steps: int, topk: int, num_draft_tokens: int,
            greedy: bool) -> None:
  """Adds ``accept_length_recorded`` (None when unknown) to ``stats``; warns when far below."""
  recorded = None if drafter is None else recorded_acceptance(drafter, num_steps, topk,
                                                              num_draft_tokens)
  stats["accept_length_recorded"] = recorded
  live = stats.get("accept_length_mean")
  if recorded is None or not greedy or stats.get("rounds", 0) < MIN_ROUNDS or live is None:
    return
  if live - 1 < FAR_BELOW * (recorded - 1):
    warnings.warn(
        f"acceptance length {live:.2f} over {stats['rounds']} rounds is far below the "
        f"{recorded:.2f} this drafter reached on held-out data at tree shape "
        f"({num_steps}, {topk}, {num_draft_tokens}). Output is still correct, but the drafter "
        f"is probably fed other target features than it was trained on (capture ids, "
        f"convention, target) or the prompts are far from its training data; see README, "
        f"'Capture contract'", AcceptanceWarning, stacklevel=checks.outside_stacklevel())


DEFAULT_SHAPES = ((3, 1, 4), (5, 1, 6), (7, 1, 8))


@standard_numpy
def measure_acceptance_per_prompt(target, drafter, prompts, shapes=DEFAULT_SHAPES, *,
                                  max_new_tokens: int = 128, batch_size: int = 8,
                                  eos_ids=None) -> dict:
  """Greedy rounds and accepted tokens of each prompt per tree shape on ``prompts``:
  ``{"steps,topk,tokens": acceptance_stats.PromptAcceptance}``, every shape (a prompt that
  ended at its first token ran no round). ``measure_acceptance`` pools them;
  ``acceptance_stats`` gives their intervals. The live monitor is silenced, as there."""
  from eagle3jax.acceptance_stats import PromptAcceptance  # pylint: disable=import-outside-toplevel
  from eagle3jax.capture_contract import tree_key  # pylint: disable=import-outside-toplevel
  from eagle3jax.generate import generate  # pylint: disable=import-outside-toplevel
  from eagle3jax.tree import checked_shape  # pylint: disable=import-outside-toplevel
  shapes = [checked_shape(s, f"shapes[{i}]") for i, s in enumerate(shapes)]
  batch_size = checks.integer("batch_size", batch_size, 1)
  out = {}
  for steps, topk, tokens in ((s.num_steps, s.topk, s.num_draft_tokens) for s in shapes):
    measured = PromptAcceptance((), ())
    for i in range(0, len(prompts), batch_size):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", AcceptanceWarning)
        r = generate(target, drafter, prompts[i:i + batch_size],
                     max_new_tokens=max_new_tokens, num_steps=steps, topk=topk,
                     num_draft_tokens=tokens, eos_ids=eos_ids)
      measured += PromptAcceptance(tuple(r.stats["rounds_per_row"]),
                                   tuple(r.stats["accepted_per_row"]))
    out[tree_key(steps, topk, tokens)] = measured
  return out


@standard_numpy
def measure_acceptance(target, drafter, prompts, shapes=DEFAULT_SHAPES, *,
                       max_new_tokens: int = 128, batch_size: int = 8,
                       eos_ids=None) -> dict[str, float]:
  """Greedy acceptance length per tree shape on ``prompts`` (held-out data): what the capture
  record keeps for ``compare``. Keys ``"steps,topk,tokens"`` (a shape where every prompt
  ended at its first token, so no round ran, has none). This is the measurement, not a
  live decode: ``compare``'s warning is silenced here (one hard prompt at batch 1 falls below
  half of the mean of a record this call is about to replace)."""
  per_prompt = measure_acceptance_per_prompt(target, drafter, prompts, shapes,
                                             max_new_tokens=max_new_tokens,
                                             batch_size=batch_size, eos_ids=eos_ids)
  return {k: round(m.length, 4) for k, m in per_prompt.items() if m.length is not None}
