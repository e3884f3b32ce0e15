"""Which hidden states flow from the target to the drafter, and in which layout.

Convention (used everywhere in eagle3jax, recorded in drafter configs):

* id ``i >= 0`` is the residual stream *after* decoder layer ``i`` (0-based): both residual
  adds done, before the final norm. It equals ``transformers``' ``hidden_states[i + 1]``
  except for the last layer, where ``transformers`` applies the final norm.
* id ``-1`` is the embedding output (``hidden_states[0]``).

Captures are concatenated low to high along the last axis into ``[B, T, len(ids) * D]``.
Every captured tensor, the embedding one included, goes through ``CaptureSpec.annotate`` so that
all of them share one layout on the mesh; under an Explicit mesh a capture with another layout
cannot be concatenated (``ShardingTypeError`` at trace time).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle3jax.checks import is_integer
from eagle3jax.sharding import BATCH, EMBED, SEQ, shard

EMBEDDING = -1


@dataclasses.dataclass(frozen=True)
class CaptureSpec:
  """The hidden states to capture from a target.

  Attributes:
    layer_ids: ascending, unique ids in the convention of this module (``-1`` = embedding
      output, ``i`` = output of decoder layer ``i``).
    layout: logical axes of each captured ``[B, T, D]`` tensor; mapped to a PartitionSpec by
      the activation rules of ``eagle3jax.sharding`` (default: batch over ``data``, features
      replicated, i.e. ``P('data', None, None)``: full width on every tensor rank).
  """
  layer_ids: tuple[int, ...]
  layout: tuple[str | None, ...] = (BATCH, SEQ, EMBED)

  def __post_init__(self):
    bad = [i for i in self.layer_ids if not is_integer(i)]
    if bad:
      raise ValueError(f"CaptureSpec.layer_ids={list(self.layer_ids)} must be integer layer ids; "
                       f"got {bad}")
    ids = tuple(int(i) for i in self.layer_ids)
    object.__setattr__(self, "layer_ids", ids)
    object.__setattr__(self, "layout", tuple(self.layout))
    if not ids:
      raise ValueError("CaptureSpec.layer_ids is empty; give at least one layer id")
    if len(set(ids)) != len(ids):
      raise ValueError(f"CaptureSpec.layer_ids={list(ids)} has duplicates")
    if list(ids) != sorted(ids):
      raise ValueError(f"CaptureSpec.layer_ids={list(ids)} must be ascending (low, mid, high)")
    if ids[0] < EMBEDDING:
      raise ValueError(f"CaptureSpec.layer_ids={list(ids)}: ids must be >= -1 "
                       "(-1 is the embedding output)")
    if len(self.layout) != 3:
      raise ValueError(f"CaptureSpec.layout={self.layout} must name 3 logical axes [B, T, D]")

  @classmethod
  def eagle3_default(cls, num_layers: int) -> "CaptureSpec":
    """The official EAGLE-3 choice: inputs of layers (2, L//2, L-3) = outputs of
    (1, L//2 - 1, L - 4)."""
    if num_layers < 7:
      raise ValueError(f"eagle3_default needs at least 7 layers for three distinct captures "
                       f"(1, L//2 - 1, L - 4); got num_layers={num_layers}")
    return cls((1, num_layers // 2 - 1, num_layers - 4))

  def validate(self, num_layers: int) -> None:
    """Raises ValueError if an id is outside ``[-1, num_layers)``."""
    bad = [i for i in self.layer_ids if not -1 <= i < num_layers]
    if bad:
      raise ValueError(f"CaptureSpec.layer_ids={list(self.layer_ids)}: ids {bad} are out of "
                       f"range for a target with {num_layers} layers (valid: -1 .. "
                       f"{num_layers - 1})")

  def annotate(self, x: jax.Array) -> jax.Array:
    """Lays out one captured ``[B, T, D]`` tensor; every capture goes through here."""
    return shard(x, self.layout)

  def concat(self, captures: dict[int, jax.Array]) -> jax.Array:
    """Concatenates annotated captures low to high: ``[B, T, len(ids) * D]``."""
    return jnp.concatenate([captures[i] for i in self.layer_ids], axis=-1)

  def width(self, hidden_size: int) -> int:
    return len(self.layer_ids) * hidden_size

  def as_list(self) -> list[int]:
    return list(self.layer_ids)


def as_capture_spec(capture: "CaptureSpec | Sequence[int] | None") -> CaptureSpec | None:
  """Accepts a CaptureSpec, a list of ids or None."""
  if capture is None or isinstance(capture, CaptureSpec):
    return capture
  if isinstance(capture, (np.ndarray, jax.Array)):
    capture = np.asarray(capture).reshape(-1).tolist()
  if isinstance(capture, (str, bytes)) or not isinstance(capture, Sequence):
    raise ValueError(f"capture={capture!r} must be a CaptureSpec or a list of layer ids "
                     "(e.g. [1, 5, 8])")
  return CaptureSpec(tuple(capture))
