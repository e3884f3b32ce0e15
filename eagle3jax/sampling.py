"""Turning logits into next-token distributions (temperature, top-k, top-p) and drawing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
  least the most likely token), as ``transformers`` does.
  """
  logits = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  if top_k > 0:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  probs = jax.nn.softmax(logits, axis=-1)
  sorted_probs = -jnp.sort(-probs, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  # The least likely kept token's probability: everything at least as likely is kept.
  threshold = jnp.min(jnp.where(mass_before < top_p, sorted_probs, jnp.inf), axis=-1,
                      keepdims=True)
  # top_p = 1 keeps everything (float32 cumulative sums can reach 1 before the tail).
  probs = jnp.where((probs >= threshold) | (top_p >= 1.0), probs, 0.0)
  return probs / jnp.sum(probs, axis=-1, keepdims=True)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """One draw from ``probs [V]`` (float32, sums to 1)."""
  return jax.random.categorical(key, jnp.log(probs)).astype(jnp.int32)
