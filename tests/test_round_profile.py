"""The per-phase breakdown of a round (``eagle3jax.round_profile``)."""

import math

import eagle3jax
from eagle3jax import round_profile
from eagle3jax.tree import TreeShape
from tests import engine_helpers as h


def test_breakdown_has_every_phase_and_leaves_decoding_exact():
  tgt = h.target()
  dr = h.copy_drafter(tgt)
  prompts = h.PROMPTS[:2]
  kw = dict(max_new_tokens=12, eos_ids=[])
  before = eagle3jax.generate(tgt, dr, prompts, num_steps=3, **kw).tokens
  out = round_profile.profile_round(tgt, dr, prompts, TreeShape(3, 1, 4), max_new_tokens=12,
                                    repeats=3)
  for name in round_profile.PHASES + ("round", "ar_step"):
    assert math.isfinite(out[f"{name}_ms"]) and out[f"{name}_ms"] > 0, (name, out)
  for name in round_profile.PHASES + ("round",):
    assert math.isclose(out[f"{name}_ar"], out[f"{name}_ms"] / out["ar_step_ms"])
  assert math.isclose(out["other_ms"], out["round_ms"] - sum(
      out[f"{p}_ms"] for p in round_profile.PHASES))
  # Profiling donates copies, never the caller's models or the engine's compiled state.
  assert eagle3jax.generate(tgt, dr, prompts, num_steps=3, **kw).tokens == before
  assert eagle3jax.generate(tgt, None, prompts, **kw).tokens == eagle3jax.generate(
      tgt, dr, prompts, num_steps=3, **kw).tokens
