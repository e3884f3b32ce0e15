"""The draft vocabulary: the N most frequent response tokens, and the maps to and from it.

EAGLE-3 drafters predict over a reduced vocabulary (e.g. 32000 of Llama 3's 128256 tokens).
Draft id ``i`` stands for target id ``i + d2t[i]``; ``t2d`` is a boolean mask over the target
vocabulary marking the ids that have a draft id. Draft ids are assigned in ascending target-id
order, so ``d2t`` is non-decreasing and the map is invertible by a search.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class DraftVocab:
  """A draft vocabulary.

  Attributes:
    d2t: ``[N]`` int32 offsets: draft id ``i`` is target id ``i + d2t[i]``.
    t2d: ``[V]`` bool: target ids that have a draft id.
    coverage: fraction of the counted (response) tokens whose id is in the draft vocabulary.
  """
  d2t: np.ndarray
  t2d: np.ndarray
  coverage: float

  @property
  def size(self) -> int:
    return int(self.d2t.shape[0])

  @property
  def target_ids(self) -> np.ndarray:
    """``[N]`` target id of each draft id (ascending)."""
    return np.arange(self.size, dtype=np.int64) + self.d2t

  def to_target(self, draft_ids) -> np.ndarray:
    """Target ids of draft ids (any shape)."""
    draft_ids = np.asarray(draft_ids)
    return draft_ids + self.d2t[draft_ids]

  def to_draft(self, target_ids) -> np.ndarray:
    """Draft ids of target ids (any shape); -1 where a target id has no draft id."""
    target_ids = np.asarray(target_ids)
    ids = self.target_ids
    pos = np.clip(np.searchsorted(ids, target_ids), 0, self.size - 1)
    return np.where(ids[pos] == target_ids, pos, -1)


def build_draft_vocab(sequences: Iterable[Sequence[int]], vocab_size: int,
                      draft_vocab_size: int) -> DraftVocab:
  """The ``draft_vocab_size`` most frequent ids of ``sequences``, sorted by id.

  Ties in frequency go to the smaller id. When fewer distinct ids occur than
  ``draft_vocab_size``, the remaining slots are filled with the smallest unused ids (they are
  never predicted by the data, but keep the drafter's head the configured size).

  Args:
    sequences: token-id lists to count (the target's responses, not the prompts).
    vocab_size: V of the target.
    draft_vocab_size: N, at most V.
  """
  if not 1 <= draft_vocab_size <= vocab_size:
    raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, vocab_size="
                     f"{vocab_size}]")
  counts = np.zeros(vocab_size, np.int64)
  for seq in sequences:
    seq = np.asarray(seq, np.int64).reshape(-1)
    if seq.size and (seq.min() < 0 or seq.max() >= vocab_size):
      raise ValueError(f"token ids outside [0, {vocab_size}) while counting the draft vocab")
    counts += np.bincount(seq, minlength=vocab_size)
  # Stable sort on -count keeps ascending ids among equal counts.
  chosen = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
  total = counts.sum()
  coverage = float(counts[chosen].sum() / total) if total else 0.0
  d2t = (chosen - np.arange(draft_vocab_size)).astype(np.int32)
  t2d = np.zeros(vocab_size, bool)
  t2d[chosen] = True
  return DraftVocab(d2t=d2t, t2d=t2d, coverage=coverage)
