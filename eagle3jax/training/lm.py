"""Pre-training a small Llama-family target with next-token cross-entropy (optax AdamW).

Used to build the shipped demo target; the forward is the same ``LlamaForCausalLM`` that
serves, so what is trained is what is decoded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from eagle3jax import checks
from eagle3jax.sharding import BATCH, SEQ, shard
from eagle3jax.semantics import standard_numpy


@dataclasses.dataclass(frozen=True)
class LMTrainConfig:
  """Attributes:
    learning_rate: AdamW peak learning rate.
    warmup_steps: linear warmup steps.
    total_steps: optimiser steps (cosine decay to 10% over them).
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    weight_decay: AdamW weight decay.
    grad_clip: global-norm clip.
    seed: data order.
    max_seconds: stop early after this much wall time (0: no limit).
  """
  learning_rate: float = 3e-3
  warmup_steps: int = 50
  total_steps: int = 1000
  batch_size: int = 16
  seq_len: int = 256
  weight_decay: float = 0.05
  grad_clip: float = 1.0
  seed: int = 0
  max_seconds: float = 0.0

  def __post_init__(self):
    """Refuses values that would train on nothing, diverge to NaN or fail inside optax."""
    checks.int_fields(self, ("total_steps", "batch_size", "seq_len"), 1, "LMTrainConfig")
    checks.int_fields(self, ("warmup_steps", "seed"), 0, "LMTrainConfig")
    if self.warmup_steps >= self.total_steps:
      raise ValueError(f"LMTrainConfig warmup_steps={self.warmup_steps} must be below "
                       f"total_steps={self.total_steps}")
    for name, low, strict in (("learning_rate", 0, True), ("grad_clip", 0, True),
                              ("weight_decay", 0, False), ("max_seconds", 0, False)):
      value = getattr(self, name)
      if not checks.is_real(value) or not math.isfinite(value) or value < low or (
          strict and value == low):
        raise ValueError(f"LMTrainConfig {name}={value!r} must be a finite number "
                         f"{'>' if strict else '>='} {low}")


def batches(tokens: np.ndarray, cfg: LMTrainConfig) -> Iterator[np.ndarray]:
  """Random windows ``[batch, seq_len + 1]`` of a token stream, seeded.

  Starts are drawn from ``[0, len - seq_len - 1)``, so the window that ends on the stream's
  last token is never drawn (one of 2.7 million in the demo's stream; the bound is kept so that
  a seed gives the windows it gave when the shipped target was trained). A stream of exactly
  ``seq_len + 1`` tokens is that one window."""
  rng = np.random.default_rng(cfg.seed)
  n = len(tokens) - cfg.seq_len - 1
  if n < 0:
    raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than seq_len + 1 = "
                     f"{cfg.seq_len + 1}")
  while True:
    starts = rng.integers(0, max(n, 1), cfg.batch_size)
    yield np.stack([tokens[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "tx"), donate_argnums=(1, 2))
def _step(graphdef, params, opt_state, rest, batch, tx):
  def loss_fn(p):
    model = nnx.merge(graphdef, p, rest)
    logits, _, _ = model(batch[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)         # [B, T, V], vocab-parallel
    # The label's log-probability as a masked sum: each vocabulary shard adds its own part.
    hit = jnp.arange(logp.shape[-1])[None, None, :] == batch[:, 1:, None]
    nll = -jnp.sum(jnp.where(hit, logp, 0.0), axis=-1)
    return jnp.mean(nll)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@standard_numpy
def train_lm(model, tokens: np.ndarray, cfg: LMTrainConfig,
             log: Callable[[int, float, float], None] | None = None) -> list[float]:
  """Trains ``model`` in place on the token stream; returns the loss per step."""
  sched = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                             cfg.total_steps, cfg.learning_rate * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                   optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt_state = tx.init(params)
  losses = []
  t0 = time.perf_counter()
  with jax.set_mesh(model.mesh):
    for step, batch in zip(range(cfg.total_steps), batches(tokens, cfg)):
      batch = shard(jnp.asarray(batch), (BATCH, SEQ))
      params, opt_state, loss = _step(graphdef, params, opt_state, rest, batch, tx)
      losses.append(float(loss))
      if log is not None:
        log(step, losses[-1], time.perf_counter() - t0)
      if cfg.max_seconds and time.perf_counter() - t0 > cfg.max_seconds:
        break
  nnx.update(model, params)
  return losses
