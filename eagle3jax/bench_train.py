"""Drafter training step: the TTT loss written plainly against ``ttt_loss``, side by side.

``train_step_times`` builds the demo's training setting on the shipped target (8 sequences of
48 prompt + 96 regenerated response tokens, the draft vocabulary counted on them, 7 unrolled
steps: ``DemoConfig``) and compiles two complete optimiser steps that differ only in the loss:
``ttt.reference_ttt_loss`` (every step over every position, log-softmax, autodiff) and
``ttt.ttt_loss`` (prompt positions that take no loss run only step 0; the unrolled steps
attend without the masked scores, ``ttt.ttt_step_layer``; the head and its cross-entropy have
written-out backwards): ``trainer.optimizer_step`` with ``reference`` on and off. A third,
``ttt_loss`` with ``masked_attention`` (its steps attending over every concatenated key with
the mask, as before ``ttt_step_layer``), gives that change's ratio. From the same initial
drafter, each run times them alternately, ``repeats`` times
each, on the same batch, and keeps the medians and their ratio; the
target's feature forward, which every training step without a feature cache also pays, is
timed beside them. So are the two steps a ``Trainer`` takes with ``ttt_loss``: computing the
batch's features first (``cache_features=False``) or taking them from a
``training.FeatureCache`` (``cache_features=True``, the demo's setting).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3jax.bench import machine, spread


def train_step_times(target_dir: str, *, runs: int = 3, repeats: int = 5,
                     batch: int | None = None, response_len: int | None = None,
                     log=print) -> dict:
  """Milliseconds of one training step with each loss, their ratio, the feature forward, and
  a trainer's ``ttt_loss`` step computing its features (``computed``) or taking them from a
  ``FeatureCache`` (``cached``) with their ratio (``cache_ratio``); medians and ranges over
  ``runs``, each run's figure the median of ``repeats``.
  ``batch`` (at most 8, the held-out prompts) and ``response_len`` default to the demo's."""
  import eagle3jax  # pylint: disable=import-outside-toplevel
  from eagle3jax import demo  # pylint: disable=import-outside-toplevel
  from eagle3jax.capture import CaptureSpec  # pylint: disable=import-outside-toplevel
  from eagle3jax.stack import default_layer_loop  # pylint: disable=import-outside-toplevel
  from eagle3jax.text import TextCodec  # pylint: disable=import-outside-toplevel
  from eagle3jax.training import (TRAINABLE,  # pylint: disable=import-outside-toplevel
                                  FeatureCache, build_draft_vocab, build_training_data,
                                  loss_start, target_features)
  from eagle3jax.training.trainer import (make_optimizer,  # pylint: disable=import-outside-toplevel
                                          optimizer_step, step_config)

  cfg_demo = demo.DemoConfig()
  batch = batch or cfg_demo.draft_batch
  response_len = response_len or cfg_demo.response_len
  target = eagle3jax.load_target(target_dir, dtype=jnp.float32, layer_loop=default_layer_loop())
  out_dir = os.path.dirname(os.path.abspath(target_dir))
  prompts = demo.heldout_prompts(out_dir, TextCodec(target_dir).tokenizer, hint=(
      "--target must be the target/ folder of such a folder, e.g. models/default/target"))
  if not 1 <= batch <= len(prompts):
    raise ValueError(f"batch={batch} must be in [1, {len(prompts)}] (the held-out prompts)")
  seq_len = cfg_demo.prompt_len + response_len
  data = build_training_data(target, prompts[:batch], seq_len=seq_len,
                             max_new_tokens=response_len, batch_size=batch)
  vocab = build_draft_vocab(data.responses(), target.config.vocab_size,
                            cfg_demo.draft_vocab_size)
  capture = CaptureSpec.eagle3_default(target.num_layers)
  dcfg = eagle3jax.DrafterConfig.for_target(target.config, capture, draft_vocab_size=vocab.size,
                                            **(demo.drafter_overrides(cfg_demo) or {}))
  drafter = eagle3jax.init_drafter(dcfg, target=target, seed=0, d2t=vocab.d2t)
  # The demo's own recipe (labels, step decay, learning rate), on this batch and length.
  cfg = dataclasses.replace(demo.drafter_train_config(cfg_demo), batch_size=batch,
                            seq_len=seq_len, max_new_tokens=response_len)
  start = loss_start(data.loss_mask, cfg.ttt_steps)
  graphdef, params, rest = nnx.split(drafter, TRAINABLE, ...)
  draft_ids = np.arange(vocab.size) + np.asarray(drafter.d2t[...])
  with jax.set_mesh(target.mesh):
    tokens, mask = jnp.asarray(data.tokens), jnp.asarray(data.loss_mask)

    def features():
      return jax.block_until_ready(target_features(target, data.tokens, capture, draft_ids))

    feats = features()
    cache, rows = FeatureCache(target, data, capture, draft_ids, batch), np.arange(batch)
    # Each kind trains its own copy (the optimiser state is donated), from the same start:
    # the two losses on fixed features, and ttt_loss as a Trainer steps, computing its
    # features or taking them from the cache.
    kinds = ("plain", "masked", "ttt_loss", "computed", "cached")
    state = {kind: (params, make_optimizer(cfg).init(params)) for kind in kinds}
    static = step_config(cfg)

    def step(kind):
      p, o = state[kind]
      f = {"computed": lambda: target_features(target, data.tokens, capture, draft_ids),
           "cached": lambda: cache.take(rows)}.get(kind, lambda: feats)()
      p, o, loss, _ = optimizer_step(graphdef, static, p, rest, o, f, tokens,
                                     mask, start, reference=kind == "plain",
                                     masked_attention=kind == "masked")
      state[kind] = (p, o)
      return loss

    steps = {kind: functools.partial(step, kind) for kind in state}
    losses = {k: float(jax.block_until_ready(fn())) for k, fn in steps.items()}

    def timed(fn):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      return 1e3 * (time.perf_counter() - t0)

    per_run = {k: [] for k in kinds + ("ratio", "attention_ratio", "features",
                                       "cache_ratio")}
    for run in range(runs):
      got = {k: [] for k in kinds + ("features",)}
      for _ in range(repeats):
        for kind, fn in steps.items():
          got[kind].append(timed(fn))
        got["features"].append(timed(features))
      med = {k: statistics.median(v) for k, v in got.items()}
      for k, v in med.items():
        per_run[k].append(v)
      per_run["ratio"].append(med["plain"] / med["ttt_loss"])
      per_run["attention_ratio"].append(med["masked"] / med["ttt_loss"])
      per_run["cache_ratio"].append(med["computed"] / med["cached"])
      log(f"run {run + 1}/{runs}: plain {med['plain']:.0f} ms, ttt_loss {med['ttt_loss']:.0f} "
          f"ms ({med['plain'] / med['ttt_loss']:.2f}x; with the masked attention "
          f"{med['masked']:.0f} ms, {med['masked'] / med['ttt_loss']:.2f}x), features "
          f"{med['features']:.0f} ms; "
          f"trainer step {med['computed']:.0f} ms computing its features, "
          f"{med['cached']:.0f} ms from the cache ({med['computed'] / med['cached']:.2f}x)")
  return {"machine": machine(), "batch": cfg.batch_size, "seq_len": seq_len,
          "ttt_steps": cfg.ttt_steps, "loss_start": start, "draft_vocab": vocab.size,
          "drafter_heads": dcfg.num_attention_heads, "head_dim": dcfg.head_dim,
          "loss": losses, **{k: spread(v) for k, v in per_run.items()}}


def markdown(result: dict) -> str:
  """The README's table of ``train_step_times``."""
  def cell(s, unit=" ms", digits=0):
    return (f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f}"
            f"{unit})")
  m = result["machine"]
  return "\n".join([
      f"{m['cores']}-core {m['cpu']}, {m['date']}; medians (ranges) of "
      f"{len(result['ratio']['runs'])} runs; batch {result['batch']} x {result['seq_len']} "
      f"tokens, {result['ttt_steps']} TTT steps, draft vocabulary {result['draft_vocab']}, "
      f"loss from position {result['loss_start']}.",
      "",
      "| step, plain formula | step, `ttt_loss` | speedup | target features (every step) |",
      "|---|---|---|---|",
      f"| {cell(result['plain'])} | {cell(result['ttt_loss'])} | "
      f"{cell(result['ratio'], 'x', 2)} | {cell(result['features'])} |",
      "",
      "| step, `ttt_loss` with the masked attention | step, `ttt_loss` | speedup |",
      "|---|---|---|",
      f"| {cell(result['masked'])} | {cell(result['ttt_loss'])} | "
      f"{cell(result['attention_ratio'], 'x', 2)} |",
      "",
      f"Trainer step with `ttt_loss` ({result.get('drafter_heads', '?')} heads of "
      f"{result.get('head_dim', '?')}):",
      "",
      "| computing its features | from the feature cache | speedup |",
      "|---|---|---|",
      f"| {cell(result['computed'])} | {cell(result['cached'])} | "
      f"{cell(result['cache_ratio'], 'x', 2)} |",
  ])
