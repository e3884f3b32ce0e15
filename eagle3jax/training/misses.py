"""Where a drafter misses: its teacher-forced accuracy against how sure the target was.

A greedy chain accepts draft j only if the drafter's top token equals the target's, so its
acceptance length is set by the per-step accuracy (about ``1 + p + ... + p**K`` for per-step
accuracy p). ``miss_breakdown`` measures, on sequences the target wrote itself (held out):

* the accuracy of every unrolled TTT step (``ttt_loss``'s metric: teacher forced, each step
  counted at every response position);
* step 0's accuracy split by the target's logit gap at the token it predicts (top-1 logit
  minus top-2 logit over the full vocabulary, in nats): a miss where the gap is 0.05 is the
  drafter ranking a near-tie the other way, which only an exact copy of the target's last
  layers would get right, while a miss at a gap of 2 is a drafter that did not learn;
* step 0's accuracy split by the position in the response (0 = its first token): the text
  right after a prompt written by someone else is harder to predict than the target's own.

Step 0 at position t reads the target's features up to t and token ``x_{t+1}`` and predicts
``x_{t+2}``, the target's argmax at ``t + 1``; counted where ``x_{t+2}`` is a response token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3jax import capture_contract as contract
from eagle3jax import vocab_parallel as vp
from eagle3jax.api import check_tokens
from eagle3jax.capture import CaptureSpec
from eagle3jax.training.data import features_and_logits
from eagle3jax.training.ttt import ttt_loss
from eagle3jax.semantics import standard_numpy

GAP_EDGES = (0.1, 0.3, 0.6, 1.0, 2.0)
POSITION_EDGES = (16, 32, 64)


@dataclasses.dataclass(frozen=True)
class Bin:
  """Step-0 positions with a value in ``[low, high)``.

  Attributes:
    low, high: the bin's edges (``high`` is ``inf`` for the last).
    fraction: share of all counted positions in the bin.
    accuracy: step-0 accuracy in the bin (``nan`` when empty).
    miss_share: share of all step-0 misses that fall in the bin.
  """
  low: float
  high: float
  fraction: float
  accuracy: float
  miss_share: float


@dataclasses.dataclass(frozen=True)
class MissBreakdown:
  """``miss_breakdown``'s result.

  Attributes:
    step_accuracy: teacher-forced accuracy of TTT steps ``0 .. K-1``.
    positions: step-0 positions counted.
    accuracy: step-0 accuracy over them.
    by_gap: ``Bin``s of the target's top-1 minus top-2 logit (nats) at the predicted token.
    by_position: ``Bin``s of the predicted token's index in its response.
  """
  step_accuracy: tuple[float, ...]
  positions: int
  accuracy: float
  by_gap: tuple[Bin, ...]
  by_position: tuple[Bin, ...]

  def to_dict(self) -> dict:
    """Plain JSON values: the last bin's infinite edge and an empty bin's accuracy are None."""
    def clean(x):
      if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
      if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
      return None if isinstance(x, float) and not np.isfinite(x) else x
    return clean(dataclasses.asdict(self))


def _bins(values: np.ndarray, hits: np.ndarray, edges: Sequence[float]) -> tuple[Bin, ...]:
  bounds = [0.0, *edges, float("inf")]
  misses = max(int(np.sum(~hits)), 1)
  out = []
  for low, high in zip(bounds[:-1], bounds[1:]):
    sel = (values >= low) & (values < high)
    n = int(np.sum(sel))
    out.append(Bin(low, high, n / max(len(values), 1),
                   float(np.mean(hits[sel])) if n else float("nan"),
                   int(np.sum(sel & ~hits)) / misses))
  return tuple(out)


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "capture", "steps"))
def _batch(tgraph, tstate, dgraph, dstate, tokens, loss_mask, draft_ids, capture, steps):
  """Per batch: ``(step acc [K], step count [K], step-0 hit [B, T], gap [B, T])``; position
  t of hit and gap is the token ``t`` (the one step 0 at ``t - 2`` predicts)."""
  target = nnx.merge(tgraph, tstate)
  drafter = nnx.merge(dgraph, dstate)
  feats, logits = features_and_logits(target, tokens, draft_ids, capture)
  _, metrics = ttt_loss(drafter, feats, tokens, loss_mask, steps=steps, label_temperature=0.0,
                        with_hits=True)
  t = tokens.shape[1]
  top2, _ = vp.top_k(logits.astype(jnp.float32), 2)                      # [B, T, 2]
  gap = top2[..., 0] - top2[..., 1]                                       # ties: 0
  return (metrics["acc"], metrics["count"], metrics["hit0"],
          jnp.pad(gap[:, :t - 1], ((0, 0), (1, 0))))


@standard_numpy
def miss_breakdown(target, drafter, tokens, loss_mask, *, steps: int = 7,
                   gap_edges: Sequence[float] = GAP_EDGES,
                   position_edges: Sequence[float] = POSITION_EDGES,
                   batch_size: int = 16) -> MissBreakdown:
  """Where ``drafter`` misses ``target``'s greedy token on ``tokens [M, T]`` (prompt +
  the target's own greedy response, ``loss_mask [M, T]`` True on the response; ``pack`` of
  ``regenerate``'s output), ``batch_size`` rows per compiled call.

  Bins are ``[0, e_0), [e_0, e_1), ..., [e_last, inf)`` of ``gap_edges`` (nats) and
  ``position_edges`` (index in the response).
  """
  contract.check_served(target, drafter, where="the drafter passed to miss_breakdown")
  tokens = check_tokens(tokens, target.config.vocab_size, "tokens")
  loss_mask = np.asarray(loss_mask)
  if loss_mask.shape != tokens.shape or loss_mask.dtype != bool:
    raise ValueError(f"miss_breakdown: loss_mask must be a bool array of the tokens' shape "
                     f"{tokens.shape}; got {loss_mask.shape} {loss_mask.dtype}")
  if tokens.shape[1] < 3 or not loss_mask[:, 2:].any():
    raise ValueError("miss_breakdown: no response token at position 2 or later; pass prompt + "
                     "response sequences (training.pack) with the response in loss_mask")
  if steps < 1 or batch_size < 1:
    raise ValueError(f"miss_breakdown: steps={steps} and batch_size={batch_size} must be >= 1")
  for name, edges in (("gap_edges", gap_edges), ("position_edges", position_edges)):
    e = np.asarray(edges, float)
    if e.ndim != 1 or (e.size and (e[0] <= 0 or np.any(np.diff(e) <= 0))):
      raise ValueError(f"miss_breakdown: {name}={tuple(edges)} must be positive and increasing")
  capture: CaptureSpec = drafter.config.capture
  capture.validate(target.num_layers)
  draft_ids = np.arange(drafter.config.draft_vocab_size) + np.asarray(drafter.d2t[...])
  tgraph, tstate = nnx.split(target)
  dgraph, dstate = nnx.split(drafter)
  m = tokens.shape[0]
  rows = -(-m // batch_size) * batch_size            # whole batches: one compilation
  tok = np.concatenate([tokens, np.repeat(tokens[:1], rows - m, axis=0)])
  mask = np.concatenate([loss_mask, np.zeros((rows - m, tokens.shape[1]), bool)])
  acc_sum = np.zeros(steps)
  counts = np.zeros(steps)
  hits, gaps = [], []
  with jax.set_mesh(target.mesh):
    for i in range(0, rows, batch_size):
      acc, count, hit, gap = jax.device_get(_batch(
          tgraph, tstate, dgraph, dstate, jnp.asarray(tok[i:i + batch_size]),
          jnp.asarray(mask[i:i + batch_size]), jnp.asarray(draft_ids, jnp.int32), capture,
          steps))
      acc_sum += np.asarray(acc) * np.asarray(count)
      counts += np.asarray(count)
      hits.append(np.asarray(hit))
      gaps.append(np.asarray(gap))
  hit = np.concatenate(hits)
  gap = np.concatenate(gaps)
  valid = mask.copy()
  valid[:, :2] = False
  first = np.argmax(mask, axis=1)                  # each row's first response token
  index = np.arange(tokens.shape[1])[None, :] - first[:, None]
  h = hit[valid]
  return MissBreakdown(
      step_accuracy=tuple(float(a) for a in acc_sum / np.maximum(counts, 1)),
      positions=int(valid.sum()), accuracy=float(np.mean(h)),
      by_gap=_bins(gap[valid], h, gap_edges),
      by_position=_bins(index[valid].astype(float), h, position_edges))
