"""Turning logits into next-token distributions (temperature, top-k, top-p) and drawing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3jax import vocab_parallel as vp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings.

  Attributes:
    greedy: argmax decoding (``temperature == 0``).
    top_k: keep the k most likely tokens (0: all).
  Temperature and top-p are passed as arrays so that changing them does not recompile.
  """
  greedy: bool = True
  top_k: int = 0


def probabilities(logits: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: int) -> jax.Array:
  """Float32 probabilities ``[..., V]`` after temperature, top-k and top-p (nucleus).

  Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (always at
  least the most likely token), as ``transformers`` does. ``logits`` may be sharded over the
  vocabulary; the result keeps that layout (see ``eagle3jax.vocab_parallel``).
  """
  logits = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  if top_k > 0:
    kth = vp.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(vp.nucleus_mask(probs, top_p), probs, 0.0)
  return probs / jnp.sum(probs, axis=-1, keepdims=True)


def sample(keys: jax.Array, probs: jax.Array) -> jax.Array:
  """One draw per row from ``probs [B, V]`` (float32, rows sum to 1) with typed ``keys [B]``:
  the Gumbel-max trick, noise drawn in ``probs``' layout (as ``jax.random.categorical``)."""
  return jnp.argmax(jnp.log(probs) + vp.gumbel_rows(keys, probs), axis=-1).astype(jnp.int32)
