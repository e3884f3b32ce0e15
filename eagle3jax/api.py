"""Full-sequence forward with optional hidden-state captures."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3jax import model_kinds
from eagle3jax.capture import CaptureSpec, as_capture_spec
from eagle3jax.semantics import standard_numpy


@dataclasses.dataclass(frozen=True)
class ForwardOutput:
  """``logits [B, T, V]`` (float32) and ``aux_hidden [B, T, k*D]`` (or None)."""
  logits: jax.Array
  aux_hidden: jax.Array | None


@functools.partial(jax.jit, static_argnames=("graphdef", "capture"))
def _forward(graphdef, state, tokens, capture):
  model = nnx.merge(graphdef, state)
  logits, aux, _ = model(tokens, capture=capture)
  return logits, aux


def check_tokens(tokens, vocab_size: int, what: str = "input_ids") -> np.ndarray:
  """Validates a ``[B, T]`` batch of token ids on the host; returns it as int32 numpy."""
  if isinstance(tokens, jax.core.Tracer):
    raise TypeError(f"{what} must be concrete: this entry point runs on the host (it checks the "
                    "ids, then runs its own jitted program); call it outside jax.jit")
  try:
    arr = np.asarray(tokens)
  except ValueError:
    raise ValueError(f"{what} must be a [B, T] batch of equally long token-id rows; its rows "
                     "differ in length (pad them, or run them separately)") from None
  if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
    raise ValueError(f"{what} must have shape [B, T] with B, T >= 1; got {arr.shape}")
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{what} must hold integer token ids; got dtype {arr.dtype}")
  if arr.min() < 0 or arr.max() >= vocab_size:
    raise ValueError(f"{what} has ids outside [0, {vocab_size}): min {arr.min()}, "
                     f"max {arr.max()}")
  return arr.astype(np.int32)


@standard_numpy
def forward(target, input_ids, *, capture: CaptureSpec | Sequence[int] | None = None
            ) -> ForwardOutput:
  """Runs ``target`` over full sequences ``input_ids [B, T]`` (causal, positions 0..T-1).

  Returns logits ``[B, T, V]`` and, with ``capture``, the concatenated captures
  ``[B, T, len(ids) * D]`` (see ``eagle3jax.CaptureSpec`` for the convention). Runs on the
  host (it checks the ids, then calls its own jitted program): call it outside ``jax.jit``.
  """
  model_kinds.require_target("forward's target", target)
  capture = as_capture_spec(capture)
  if capture is not None:
    capture.validate(target.num_layers)
  tokens = check_tokens(input_ids, target.config.vocab_size)
  limit = target.config.max_position_embeddings
  if tokens.shape[1] > limit:
    raise ValueError(f"input_ids has {tokens.shape[1]} positions, more than the target's "
                     f"max_position_embeddings={limit}; shorten the sequences")
  graphdef, state = nnx.split(target)
  with jax.set_mesh(target.mesh):
    logits, aux = _forward(graphdef, state, jnp.asarray(tokens), capture)
  return ForwardOutput(logits, aux)
