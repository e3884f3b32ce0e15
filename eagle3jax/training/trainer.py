"""Training an EAGLE-3 drafter: configuration, the jitted train step, checkpoints, the loop.

Only the drafter's own parameters train. Its token embedding is the target's ``embed_tokens``
variable (shared, reference section 5: frozen), so the parameters are split with the filter
``TRAINABLE`` (every ``nnx.Param`` whose path does not contain ``embed_tokens``); the embedding
and the ``d2t``/``t2d`` buffers travel into the step as a separate, non-differentiated state.

Data parallelism is the batch layout: each batch is placed with its batch axis over the mesh's
``data`` axis and the parameters are replicated over it, so under ``jax.set_mesh`` XLA reduces
the gradients across ``data``.

Checkpoints (orbax ``CheckpointManager``, synchronous, atomic: a step directory appears only
once completely written) hold the trainable parameters, the optimiser state, the step and the
data position, so a killed run restarted with the same directory continues the same sequence
of batches and losses.

In a multi-process run (``eagle3jax.distributed``) every process runs the same loop on the
same data; checkpoints are saved and restored collectively (orbax writes each process's
shards, process 0 the metadata) into a directory every process sees, and only process 0
writes the regenerated data, the exported drafter and the progress output.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
import warnings
import zlib
from typing import Sequence

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding

from eagle3jax import capture_contract as contract
from eagle3jax import distributed
from eagle3jax import checks, model_kinds, monitor
from eagle3jax.capture import CaptureSpec, as_capture_spec
from eagle3jax.checks import is_integer, is_real
from eagle3jax.capture_contract import tree_key
from eagle3jax.drafter import DrafterConfig
from eagle3jax.drafter_io import (HEAD_INITS, PortabilityWarning, check_drafter_folder,
                                  check_init_config, init_drafter, save_drafter,
                                  warn_portability)
from eagle3jax.generate import check_prompts
from eagle3jax.sharding import BATCH, SEQ, activation_spec
from eagle3jax.tree import checked_shape
from eagle3jax.training.data import (DataPosition, FeatureCache, TargetFeatures, TrainingData,
                                     batch_indices, build_training_data,
                                     check_feature_cache, data_source, target_features)
from eagle3jax.training.ttt import loss_start, reference_ttt_loss, ttt_loss
from eagle3jax.training.vocab import DraftVocab, build_draft_vocab
from eagle3jax.semantics import standard_numpy

log = logging.getLogger("eagle3jax")

TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embed_tokens")))
DEFAULT_DRAFT_VOCAB = 32000


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Hyperparameters of drafter training (defaults follow EAGLE-3 / SpecForge).

  Attributes:
    learning_rate: peak learning rate of AdamW.
    warmup_steps: linear warmup from 0 to the peak.
    total_steps: optimiser steps of the whole run (the cosine decay spans them).
    final_lr_fraction: the cosine decay ends at ``learning_rate * final_lr_fraction``.
    b1: AdamW beta1.
    b2: AdamW beta2.
    weight_decay: AdamW decoupled weight decay (matrices only, not norm scales).
    grad_clip: global-norm gradient clipping threshold.
    batch_size: sequences per step (global, split over the mesh's ``data`` axis).
    seq_len: T: sequences (prompt + response) are cut and padded to this length.
    ttt_steps: K, unrolled draft steps of the training-time test.
    step_decay: TTT step j is weighted ``step_decay**j``.
    label_temperature: the loss's labels are the target's draft-vocabulary distribution at
      this temperature (``ttt.label_distribution``): 1 is EAGLE-3's soft labels (drafters
      served with sampling); 0 is one-hot on the target's top token (drafters served greedily).
    align_topk: token alignment (``ttt.ttt_loss``): k > 0 drops unrolled step j's loss where
      an earlier step did not rank the target's token in its top k (states a chain, k = 1,
      or a tree of top-k branches never reaches); 0 (EAGLE-3): every position counts.
    checkpoint_every: save a checkpoint every this many steps (and at the last step).
    keep_checkpoints: how many recent checkpoints to keep.
    seed: data order and drafter initialisation.
    draft_vocab_size: N (None: ``min(32000, target vocab)``).
    max_new_tokens: response length when the target regenerates the data.
    temperature: sampling temperature of that regeneration (0: greedy).
    gen_batch_size: prompts per ``generate`` call during regeneration.
    head_init: the drafter's ``lm_head`` and final norm at step 0: ``"random"`` or
      ``"target"`` (the target's output embedding rows of the draft vocabulary and its final
      norm; ``init_drafter``).
    cache_features: compute the target's features of every training sequence once, before
      the first step, and keep them in host memory (``training.data.FeatureCache``), instead
      of running the target on every batch of every epoch. The same training to float32
      rounding, for ``feature_cache_bytes`` of memory (5.9 GiB for the demo's 6144 x 144
      tokens, 768 capture values and 1024 draft logits); one process only.
  """
  learning_rate: float = 1e-4
  warmup_steps: int = 100
  total_steps: int = 1000
  final_lr_fraction: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.0
  grad_clip: float = 0.5
  batch_size: int = 8
  seq_len: int = 2048
  ttt_steps: int = 7
  step_decay: float = 0.8
  label_temperature: float = 1.0
  align_topk: int = 0
  checkpoint_every: int = 500
  keep_checkpoints: int = 2
  seed: int = 0
  draft_vocab_size: int | None = None
  max_new_tokens: int = 512
  temperature: float = 0.0
  gen_batch_size: int = 32
  head_init: str = "random"
  cache_features: bool = False

  def __post_init__(self):
    if not isinstance(self.cache_features, (bool, np.bool_)):
      raise ValueError(f"TrainConfig.cache_features={self.cache_features!r} must be True or "
                       "False (in a --config JSON file: true or false, not a string)")
    object.__setattr__(self, "cache_features", bool(self.cache_features))
    if not is_integer(self.align_topk) or self.align_topk < 0:
      raise ValueError(f"TrainConfig.align_topk={self.align_topk!r} must be an integer >= 0 "
                       "(0: EAGLE-3's loss at every position; 1: a greedy chain's)")
    positive = ("warmup_steps", "total_steps", "batch_size", "seq_len", "ttt_steps",
                "checkpoint_every", "keep_checkpoints", "max_new_tokens", "gen_batch_size")
    for name in positive:
      value = getattr(self, name)
      low = 0 if name == "warmup_steps" else 1
      if not is_integer(value) or value < low:
        raise ValueError(f"TrainConfig.{name}={value!r} must be an integer >= {low}")
      object.__setattr__(self, name, int(value))  # NumPy integers as ints (JSON checkpoints)
    reals = ("learning_rate", "final_lr_fraction", "b1", "b2", "weight_decay", "grad_clip",
             "step_decay", "label_temperature", "temperature")
    for name in reals:
      value = getattr(self, name)
      if not is_real(value) or not math.isfinite(value):
        raise ValueError(f"TrainConfig.{name}={value!r} must be a finite number")
      object.__setattr__(self, name, float(value))
    if not is_integer(self.seed) or not 0 <= self.seed < 2**31:
      raise ValueError(f"TrainConfig.seed={self.seed!r} must be an integer in [0, 2**31)")
    object.__setattr__(self, "seed", int(self.seed))
    object.__setattr__(self, "align_topk", int(self.align_topk))
    if self.warmup_steps >= self.total_steps:
      raise ValueError(f"TrainConfig.warmup_steps={self.warmup_steps} must be below "
                       f"total_steps={self.total_steps}")
    if self.seq_len < 3:
      raise ValueError(f"TrainConfig.seq_len={self.seq_len} must be >= 3")
    if not self.learning_rate > 0:
      raise ValueError(f"TrainConfig.learning_rate={self.learning_rate!r} must be positive")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r} must be in [0, 1)")
    for name in ("final_lr_fraction", "step_decay"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r} must be in [0, 1]")
    if self.head_init not in HEAD_INITS:
      raise ValueError(f"TrainConfig.head_init={self.head_init!r}; choose one of {HEAD_INITS}")
    if not 0 <= self.label_temperature < float("inf"):
      raise ValueError(f"TrainConfig.label_temperature={self.label_temperature!r} must be a "
                       "finite number >= 0 (1: soft labels, 0: the target's top token)")
    if self.weight_decay < 0 or self.grad_clip <= 0 or self.temperature < 0:
      raise ValueError(f"TrainConfig: weight_decay={self.weight_decay} and temperature="
                       f"{self.temperature} must be >= 0, grad_clip={self.grad_clip} > 0")
    if self.draft_vocab_size is not None:
      if not is_integer(self.draft_vocab_size) or self.draft_vocab_size < 1:
        raise ValueError(f"TrainConfig.draft_vocab_size={self.draft_vocab_size!r} must be a "
                         "positive integer or None")
      object.__setattr__(self, "draft_vocab_size", int(self.draft_vocab_size))

  @classmethod
  def from_dict(cls, values: dict) -> "TrainConfig":
    """Builds a config from a dict, refusing unknown field names."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"unknown TrainConfig fields {unknown}; known: {sorted(known)}")
    return cls(**values)

  def resolved_draft_vocab_size(self, vocab_size: int) -> int:
    n = self.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vocab_size)
    if n > vocab_size:
      raise ValueError(f"TrainConfig.draft_vocab_size={n} exceeds the target vocab_size="
                       f"{vocab_size}")
    return n


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """Linear warmup to ``learning_rate``, then cosine decay to ``final_lr_fraction`` of it."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.total_steps, end_value=cfg.learning_rate * cfg.final_lr_fraction)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """``clip_by_global_norm(grad_clip)`` then AdamW (decay on matrices only). Its ``init`` and
  ``update`` run with JAX's default numpy semantics, as the library's functions do."""
  tx = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                  weight_decay=cfg.weight_decay,
                  mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
  return optax.GradientTransformation(standard_numpy(tx.init), standard_numpy(tx.update))


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "start", "reference",
                                             "masked_attention"),
                   donate_argnames=("opt_state",))
def optimizer_step(graphdef, cfg: TrainConfig, params, rest, opt_state, features, tokens,
                   loss_mask, start: int = 0, reference: bool = False,
                   masked_attention: bool = False):
  """One AdamW step of the TTT loss; returns ``(params, opt_state, loss, metrics)``.

  ``opt_state`` is donated. ``reference=True`` takes the loss as ``ttt.reference_ttt_loss``
  writes it (the training benchmark's baseline; its metrics hold only ``acc``);
  ``masked_attention=True`` runs ``ttt_loss`` with the masked attention of before
  ``ttt.ttt_step_layer`` (the benchmark's other baseline).
  """
  def loss_fn(p):
    drafter = nnx.merge(graphdef, p, rest)
    if reference:
      loss, acc = reference_ttt_loss(drafter, features, tokens, loss_mask,
                                     steps=cfg.ttt_steps, decay=cfg.step_decay,
                                     label_temperature=cfg.label_temperature,
                                     align_topk=cfg.align_topk)
      return loss, {"acc": acc}
    return ttt_loss(drafter, features, tokens, loss_mask, steps=cfg.ttt_steps,
                    decay=cfg.step_decay, start=start, label_temperature=cfg.label_temperature,
                    align_topk=cfg.align_topk, masked_attention=masked_attention)

  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, opt_state = make_optimizer(cfg).update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics["grad_norm"] = optax.tree.norm(grads)
  return params, opt_state, loss, metrics


# Fields that do not enter the compiled step: normalised away so that runs differing only in
# them (checkpointing, data generation, seed) share one compilation.
_NOT_IN_STEP = dict(checkpoint_every=1, keep_checkpoints=1, seed=0, draft_vocab_size=None,
                    max_new_tokens=1, temperature=0.0, gen_batch_size=1, batch_size=1,
                    seq_len=3, head_init="random", cache_features=False)


# Fields that change how a step gets its inputs, not what it trains: no warning on resuming.
_SAME_TRAINING = ("cache_features",)


def step_config(cfg: TrainConfig) -> TrainConfig:
  """``cfg`` with the fields the train step does not read set to fixed values."""
  return dataclasses.replace(cfg, **_NOT_IN_STEP)


def _fingerprint(data: TrainingData) -> int:
  return zlib.crc32(np.ascontiguousarray(data.tokens).tobytes()
                    + np.ascontiguousarray(data.loss_mask).tobytes())


def _drafter_shape(cfg: DrafterConfig) -> dict:
  """The drafter config as JSON values (what its checkpoints' parameters were trained as)."""
  return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def _identity(target, drafter) -> dict:
  """What a training checkpoint is tied to: capture, target, draft vocabulary, drafter config."""
  d2t = distributed.to_host(drafter.d2t[...])
  return {"capture": drafter.config.capture.as_list(),
          "target": contract.target_fingerprint(target),
          "draft_vocab": {"size": int(d2t.shape[0]),
                          "crc": zlib.crc32(np.ascontiguousarray(d2t, np.int64).tobytes())},
          "drafter_config": _drafter_shape(drafter.config)}


def _check_identity(meta: dict, ours: dict, where: str) -> None:
  """Refuses to resume a checkpoint written for another capture, target or draft vocabulary."""
  if "capture" in meta and meta["capture"] != ours["capture"]:
    raise ValueError(f"{where} was trained on capture layers {meta['capture']}, but this run "
                     f"captures {ours['capture']}; resuming would train (or export) its "
                     "weights under the wrong layers. Use the checkpoint's capture or a fresh "
                     "checkpoint directory")
  if "target" in meta and not contract.same_fingerprint(meta["target"], ours["target"]):
    theirs, mine = meta["target"], ours["target"]
    raise ValueError(f"{where} was trained on another target (fingerprint: "
                     f"{theirs['num_layers']} layers, hidden {theirs['hidden_size']}, vocab "
                     f"{theirs['vocab_size']}, final norm {theirs['final_norm'][:3]}...) than "
                     f"this one ({mine['num_layers']} layers, hidden {mine['hidden_size']}, "
                     f"vocab {mine['vocab_size']}, final norm {mine['final_norm'][:3]}...); use "
                     "a fresh checkpoint directory")
  if "draft_vocab" in meta and meta["draft_vocab"] != ours["draft_vocab"]:
    raise ValueError(f"{where} was trained with another draft vocabulary "
                     f"({meta['draft_vocab']}) than this run's ({ours['draft_vocab']}); use "
                     "the same draft_vocab_size and data, or a fresh checkpoint directory")
  if "drafter_config" in meta and meta["drafter_config"] != ours["drafter_config"]:
    theirs, mine = meta["drafter_config"], ours["drafter_config"]
    fields = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    raise ValueError(f"{where} was trained as another drafter: config fields "
                     + ", ".join(f"{k}={theirs.get(k)!r} there, {mine.get(k)!r} here"
                                 for k in fields)
                     + "; resuming would train (or export) its weights under another config. "
                     "Use the checkpoint's drafter settings (drafter_overrides) or a fresh "
                     "checkpoint directory")


def _first_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


class _FailedReadLogFilter(logging.Filter):
  """Drops asyncio's "Future/Task exception was never retrieved" records naming given
  folders."""

  def __init__(self):
    super().__init__()
    self.folders: set[str] = set()

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith(("Future exception was never retrieved",
                                    "Task exception was never retrieved"))
                and any(folder in message for folder in self.folders))


_FAILED_READS = _FailedReadLogFilter()


def _quiet_failed_reads(folder: str) -> None:
  """Silences what an orbax read of ``folder`` that fails leaves behind.

  When one array of a checkpoint cannot be read, orbax raises and closes its asyncio loop
  while TensorStore's other reads are still in flight. Each of them then calls back into the
  closed loop (Python prints a "RuntimeError: Event loop is closed" traceback per array, as an
  unraisable exception, some before the error is even raised) and leaves failed futures and
  tasks that asyncio logs when they are collected ("Future exception was never retrieved",
  "Task exception ...", naming the folder). The trainer raises its own error naming the step
  and what to do, so both are noise. Installed before a restore and released when its reads
  succeed (``_release_failed_reads``); after a failed read it stays, since the reports come
  later. It drops exactly those reports; every other unraisable exception and log record
  goes on as before."""
  _FAILED_READS.folders.add(os.path.join(folder, ""))  # ckpt/2/, not ckpt/20/
  asyncio_log = logging.getLogger("asyncio")
  if _FAILED_READS not in asyncio_log.filters:
    asyncio_log.addFilter(_FAILED_READS)
  previous = sys.unraisablehook
  if getattr(previous, "_eagle3jax_closed_loop_filter", False):
    return

  def hook(unraisable):
    if (unraisable.exc_type is RuntimeError and unraisable.object is None
        and str(unraisable.exc_value) == "Event loop is closed"):
      return
    previous(unraisable)

  hook._eagle3jax_closed_loop_filter = True
  hook.previous = previous
  sys.unraisablehook = hook


def _release_failed_reads(folder: str) -> None:
  """Undoes ``_quiet_failed_reads(folder)`` once its reads succeeded: the folder leaves the
  log filter, and with no folder left the filter and the hook go (the hook only if no one
  replaced it since)."""
  _FAILED_READS.folders.discard(os.path.join(folder, ""))
  if _FAILED_READS.folders:
    return
  logging.getLogger("asyncio").removeFilter(_FAILED_READS)
  if getattr(sys.unraisablehook, "_eagle3jax_closed_loop_filter", False):
    sys.unraisablehook = sys.unraisablehook.previous


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


class Trainer:
  """Trains ``drafter`` on ``data`` with the TTT loss; resumes from ``checkpoint_dir``.

  The drafter's trainable parameters live in ``trainer.params`` while training; the
  ``drafter`` property writes them back into the module and returns it.
  """

  @standard_numpy
  def __init__(self, target, drafter, data: TrainingData, config: TrainConfig, *,
               checkpoint_dir: str | None = None):
    # The pair is checked as generate checks it: a drafter that does not fit this target, or
    # shares another target's embedding, would train on features it is never served with.
    model_kinds.require_target("Trainer's target", target)
    model_kinds.require_drafter("Trainer's drafter", drafter)
    for name, value, kind in (("data", data, TrainingData), ("config", config, TrainConfig)):
      if not isinstance(value, kind):
        raise ValueError(f"Trainer's {name} must be a {kind.__name__}, got "
                         f"{type(value).__name__}")
    contract.check_pair(target, drafter.config)
    contract.check_mesh(target, drafter.mesh)
    contract.check_served(target, drafter, where="the drafter passed to Trainer")
    if data.seq_len != config.seq_len:
      raise ValueError(f"training data has seq_len={data.seq_len} but TrainConfig.seq_len="
                       f"{config.seq_len}")
    self.target = target
    self.config = config
    self.data = data
    self._capture: CaptureSpec = drafter.config.capture
    self.mesh = target.mesh
    self._identity = _identity(target, drafter)
    self._drafter = drafter
    # Target ids of the draft vocabulary: the columns of the target's logits the loss reads.
    self._draft_ids = (np.arange(drafter.config.draft_vocab_size)
                       + np.asarray(drafter.d2t[...]))
    self._graphdef, self.params, self._rest = nnx.split(drafter, TRAINABLE, ...)
    with jax.set_mesh(self.mesh):
      self.opt_state = make_optimizer(config).init(self.params)
    # Prompt positions that no TTT step takes a loss at run only the drafter's step 0.
    self._start = loss_start(data.loss_mask, config.ttt_steps)
    self.step = 0
    self.position = DataPosition()
    self._cache: FeatureCache | None = None  # built at the first step (cache_features)
    self.history: list[dict] = []
    self._manager = None
    if checkpoint_dir is not None:
      self._manager = ocp.CheckpointManager(
          os.path.abspath(checkpoint_dir),
          options=ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints,
                                               enable_async_checkpointing=False))
      latest = self._manager.latest_step()
      distributed.same_on_all(-1 if latest is None else latest,
                              f"the latest checkpoint in {checkpoint_dir}")
      if latest is not None and latest > config.total_steps:
        self._manager.close()
        raise ValueError(
            f"{checkpoint_dir} holds a checkpoint of step {latest}, past this run's "
            f"total_steps={config.total_steps}: resuming would export a drafter trained "
            f"{latest} steps. Set total_steps to at least {latest}, delete the later step "
            "folders, or use a fresh checkpoint directory")
      if latest is not None:
        try:
          self.restore(latest)
        except BaseException:
          self._manager.close()  # no half-open manager left to the garbage collector
          raise

  @property
  def capture(self) -> CaptureSpec:
    """The target layers this trainer's features come from (fixed at construction: the
    drafter's ``fc`` and its checkpoints are tied to them)."""
    return self._capture

  # --- features and batches ---
  @standard_numpy
  def features(self, tokens) -> TargetFeatures:
    """What the step trains on for ``tokens [B, T]``: captures, the target's logits at the
    draft vocabulary and its argmax (reduced inside the target's jitted forward)."""
    return target_features(self.target, tokens, self.capture, self._draft_ids)

  def _place(self, x: np.ndarray) -> jax.Array:
    spec = activation_spec((BATCH, SEQ), x.shape, self.mesh)
    return jax.device_put(x, NamedSharding(self.mesh, spec))

  # --- training ---
  @standard_numpy
  def train_step(self) -> dict:
    """One optimiser step on the next batch; returns host metrics of that step."""
    cfg = self.config
    if self.opt_state is None:
      raise RuntimeError("this trainer stopped at a non-finite loss and has no optimiser state "
                         "left; build a new Trainer (it resumes from its checkpoint directory)")
    idx, position = batch_indices(self.data.num_sequences, self.position, cfg.batch_size,
                                  cfg.seed)
    tokens, mask = self.data.tokens[idx], self.data.loss_mask[idx]
    if cfg.cache_features:
      if self._cache is None:
        t0 = time.perf_counter()
        self._cache = FeatureCache(self.target, self.data, self.capture, self._draft_ids,
                                   cfg.batch_size)
        log.info("cached the target's features of %d sequences: %.2f GiB in %.0f s",
                 self.data.num_sequences, self._cache.nbytes / 2**30, time.perf_counter() - t0)
      features = self._cache.take(idx)
    else:
      features = self.features(tokens)
    with jax.set_mesh(self.mesh):
      params, opt_state, loss, metrics = optimizer_step(
          self._graphdef, step_config(cfg), self.params, self._rest, self.opt_state, features,
          self._place(tokens), self._place(mask), start=self._start)
    grad_norm = float(metrics["grad_norm"])
    if not (np.isfinite(float(loss)) and np.isfinite(grad_norm)):
      # Stop before the update lands: every later step, checkpoint and the export would be NaN.
      # The step consumed (donated) the optimiser state: roll back to the last checkpoint, or
      # leave a trainer that refuses to go on.
      failed = self.step + 1
      last = self._manager.latest_step() if self._manager is not None else None
      if last is not None:
        self.restore(last)
        where = f"this trainer was rolled back to its checkpoint of step {last}"
      else:
        self.opt_state = None
        where = "there is no checkpoint to resume from: build a new trainer"
      raise FloatingPointError(
          f"drafter training step {failed}: loss {float(loss)}, gradient norm {grad_norm}; the "
          f"update was not applied and {where}. Lower learning_rate or grad_clip, or check the "
          "data")
    self.params, self.opt_state = params, opt_state
    self.step += 1
    self.position = position
    record = {"step": self.step, "loss": float(loss),
              "loss_per_step": np.asarray(metrics["loss"]).tolist(),
              "acc": np.asarray(metrics["acc"]).tolist(),
              "grad_norm": grad_norm,
              "lr": float(learning_rate_schedule(cfg)(self.step - 1))}
    self.history.append(record)
    if self._manager is not None and (self.step % cfg.checkpoint_every == 0
                                      or self.step == cfg.total_steps):
      self.save()
    return record

  @standard_numpy
  def train(self, num_steps: int | None = None, *, progress: bool = True) -> list[dict]:
    """Runs ``num_steps`` steps (default: up to ``total_steps``); returns their records."""
    end = self.config.total_steps if num_steps is None else min(
        self.step + num_steps, self.config.total_steps)
    records = []
    bar = _progress_bar(total=self.config.total_steps, initial=self.step,
                        disable=not progress)
    try:
      while self.step < end:
        rec = self.train_step()
        records.append(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}",
                        acc="/".join(f"{a:.2f}" for a in rec["acc"]))
    finally:
      bar.close()
    return records

  # --- checkpoints ---
  def save(self) -> None:
    """Writes a checkpoint for the current step (atomic; a no-op without a directory)."""
    if self._manager is None or self._manager.latest_step() == self.step:
      return
    meta = {"step": self.step, "epoch": self.position.epoch, "cursor": self.position.cursor,
            "data_crc": _fingerprint(self.data), "config": dataclasses.asdict(self.config),
            **self._identity}
    tree = {"params": self.params, "opt_state": self.opt_state}
    self._manager.save(self.step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore(self, step: int) -> None:
    """Loads the checkpoint of ``step``: parameters, optimiser state, data position.

    Its metadata is read and checked first (capture, target, draft vocabulary, drafter config,
    data), so a checkpoint of another run is refused by what differs; a step that cannot be
    read (a damaged or partial write) is refused naming its folder."""
    where = f"the checkpoint of step {step} in {self._manager.directory}"
    folder = os.path.join(str(self._manager.directory), str(step))
    unreadable = (f"; delete {folder} to resume from the checkpoint before it, or use a fresh "
                  "checkpoint directory")
    _quiet_failed_reads(folder)
    read_failed = False  # a failed orbax read leaves reports behind: its filters stay
    try:
      try:
        meta = self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta
      except Exception as e:  # orbax and its storage raise many kinds; all mean "unreadable"
        read_failed = True
        raise ValueError(f"{where} has no readable metadata ({_first_line(e)})"
                         + unreadable) from None
      if not isinstance(meta, dict) or not {"step", "epoch", "cursor"} <= set(meta):
        raise ValueError(f"{where} has incomplete metadata" + unreadable)
      _check_identity(meta, self._identity, where)
      if meta.get("data_crc") != _fingerprint(self.data):
        raise ValueError(f"{where} was "
                         "written for other training data (its data position would be "
                         "meaningless); use the same data or a fresh checkpoint directory")
      tree = {"params": self.params, "opt_state": self.opt_state}
      try:
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(tree))))
      except Exception as e:  # pylint: disable=broad-except
        read_failed = True
        shapes = "shape" in str(e)
        raise ValueError(
            f"{where} cannot be restored into this drafter ({_first_line(e)})"
            + ("; its parameters have other shapes: it was written for another drafter shape "
               "or a mesh that replicates the KV heads differently. Use the checkpoint's "
               "settings or a fresh checkpoint directory" if shapes else unreadable)) from None
    finally:
      if not read_failed:
        _release_failed_reads(folder)
    saved = meta.get("config", {})
    changed = sorted(k for k, v in dataclasses.asdict(self.config).items()
                     if k in saved and saved[k] != v and k not in _SAME_TRAINING)
    if changed:
      log.warning("resuming step %d with changed TrainConfig fields %s", step, changed)
    self.params = out.state["params"]
    self.opt_state = out.state["opt_state"]
    self.step = int(meta["step"])
    self.position = DataPosition(int(meta["epoch"]), int(meta["cursor"]))
    log.info("resumed drafter training at step %d (epoch %d, cursor %d)", self.step,
             self.position.epoch, self.position.cursor)

  def close(self) -> None:
    if self._manager is not None:
      self._manager.close()

  @property
  def drafter(self):
    """The drafter module with the current trained parameters written into it."""
    nnx.update(self._drafter, self.params)
    return self._drafter


def _progress_bar(**kwargs):
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(unit="step", dynamic_ncols=True, **kwargs)


@dataclasses.dataclass
class TrainResult:
  """What ``train_drafter`` returns: the trained drafter, the step records, the vocab, and the
  learning curve (``{"step", "accept_length", "seconds", "rounds", "accepted"}`` per held-out
  measurement, the last two per prompt, with ``"interval"``, the 95% bootstrap interval of
  ``accept_length`` (``acceptance_stats``), where the prompts came from 2 sources or more;
  empty without ``heldout_every``)."""
  drafter: object
  history: list[dict]
  vocab: DraftVocab
  curve: list[dict] = dataclasses.field(default_factory=list)


# New tokens per held-out prompt when the acceptance is measured (the curve and the record).
HELDOUT_NEW_TOKENS = 128


def _curve_point(step: int, measured, sources, seconds: float) -> dict:
  """One point of the learning curve: the pooled length (as ``measure_acceptance`` rounds it),
  its interval where 2 sources or more ran a round, and the per-prompt counts."""
  from eagle3jax import acceptance_stats  # pylint: disable=import-outside-toplevel
  point = {"step": step, "accept_length": round(measured.length, 4), "seconds": seconds}
  if acceptance_stats.sources_with_rounds(measured, groups=sources) >= 2:
    point["interval"] = [round(x, 4) for x in acceptance_stats.interval(measured,
                                                                         groups=sources)]
  return {**point, **measured.to_dict()}


@standard_numpy
def train_drafter(target, prompts: Sequence[Sequence[int]], out_dir: str,
                  config: TrainConfig = TrainConfig(), *,
                  capture: CaptureSpec | Sequence[int] | None = None,
                  checkpoint_dir: str | None = None, progress: bool = True,
                  drafter_overrides: dict | None = None,
                  heldout_prompts: Sequence[Sequence[int]] | None = None,
                  heldout_every: int = 0,
                  heldout_shape: tuple[int, int, int] = (7, 1, 8),
                  heldout_sources: Sequence | None = None) -> TrainResult:
  """Trains an EAGLE-3 drafter for ``target`` and exports it to ``out_dir``.

  Steps: the target regenerates responses to ``prompts`` (saved with the checkpoints so a
  resumed run trains on the same data); the draft vocabulary is the ``draft_vocab_size`` most
  frequent response tokens; a drafter shaped like one target layer is trained with the TTT
  loss, checkpointing to ``checkpoint_dir/steps`` (default ``out_dir/train_state``; the
  regenerated data is kept beside them in ``data.npz``) and resuming from them; the result
  is written with ``eagle3jax.save_drafter`` (which records the capture).

  Args:
    target: a target from ``load_target``/``init_target``.
    prompts: token-id lists.
    out_dir: where the drafter (``config.json``, ``model.safetensors``) is written.
    config: hyperparameters.
    capture: target layers to capture (default ``CaptureSpec.eagle3_default(L)``).
    checkpoint_dir: training state directory.
    progress: show a progress bar and print the vocabulary coverage.
    drafter_overrides: ``DrafterConfig`` fields to override (e.g. a smaller MLP).
    heldout_prompts: prompts the trained drafter's greedy acceptance is measured on (at
      ``monitor.DEFAULT_SHAPES``) and recorded for the live monitor (``eagle3jax.monitor``).
    heldout_every: also measure the held-out acceptance length at ``heldout_shape`` (steps,
      topk, draft tokens) every this many steps and at the end: the learning curve
      (``TrainResult.curve``). 0: only at the end, for the record.
    heldout_sources: the source (any hashable: a file, a document id) of each held-out prompt;
      the curve's intervals resample sources, since prompts of one source are not
      independent. Default: every prompt its own source.

  The export carries the capture record (``eagle3jax.capture_contract``): features at the
  first training tokens, so ``load_drafter`` can prove it is served what it was trained on.
  """
  model_kinds.require_target("train_drafter's target", target)
  prompts = check_prompts(prompts, target.config.vocab_size)
  # Everything below is checked now, not after the regeneration (minutes) or the training.
  heldout_every = checks.integer("heldout_every", heldout_every, 0)
  if heldout_every and not heldout_prompts:
    raise ValueError(f"heldout_every={heldout_every} needs heldout_prompts")
  if heldout_sources is not None and len(heldout_sources) != len(heldout_prompts or ()):
    raise ValueError(f"heldout_sources: {len(heldout_sources)} sources for "
                     f"{len(heldout_prompts or ())} held-out prompts; pass one per prompt")
  limit = target.config.max_position_embeddings
  if heldout_prompts:
    heldout_prompts = check_prompts(heldout_prompts, target.config.vocab_size,
                                    what="heldout_prompts")
    shape = checked_shape(heldout_shape, "heldout_shape")
    longest = max(len(p) for p in heldout_prompts)
    if longest + HELDOUT_NEW_TOKENS > limit:  # what generate would refuse after the training
      raise ValueError(f"heldout_prompts: the longest has {longest} tokens, and measuring "
                       f"acceptance generates {HELDOUT_NEW_TOKENS} after it, past the target's "
                       f"max_position_embeddings={limit}; shorten the held-out prompts")
  if config.seq_len > limit:
    raise ValueError(f"TrainConfig.seq_len={config.seq_len} exceeds the target's "
                     f"max_position_embeddings={limit}; train on sequences of at most {limit}")
  if min(len(p) for p in prompts) >= config.seq_len:
    raise ValueError(f"every prompt has at least seq_len={config.seq_len} tokens, so no "
                     "response token would fit in a training sequence: raise seq_len or "
                     "shorten the prompts")
  capture = as_capture_spec(capture) or CaptureSpec.eagle3_default(target.num_layers)
  capture.validate(target.num_layers)
  draft_vocab_size = config.resolved_draft_vocab_size(target.config.vocab_size)
  if heldout_prompts and shape.topk > draft_vocab_size:
    raise ValueError(f"heldout_shape={tuple(heldout_shape)}: topk={shape.topk} exceeds the "
                     f"draft vocabulary of {draft_vocab_size} tokens")
  planned = DrafterConfig.for_target(target.config, capture, draft_vocab_size=draft_vocab_size,
                                    **(drafter_overrides or {}))
  check_init_config(target, planned)  # refuses bad overrides up front
  warn_portability(planned, target.num_layers, "the drafter this trains")  # before, not after
  too_long = next((i for i, p in enumerate(prompts)
                   if len(p) + config.max_new_tokens > limit), None)
  if too_long is not None:  # what generate would refuse in the middle of the regeneration
    raise ValueError(
        f"prompts[{too_long}] has {len(prompts[too_long])} tokens, and the regeneration "
        f"generates max_new_tokens={config.max_new_tokens} after it, past the target's "
        f"max_position_embeddings={limit}; shorten it (a training sequence keeps only its first "
        f"seq_len={config.seq_len} tokens) or lower max_new_tokens")
  if config.cache_features:  # what the first step would refuse, after the regeneration
    check_feature_cache(len(prompts), config.seq_len, capture.width(target.config.hidden_size),
                        draft_vocab_size)
  check_drafter_folder(out_dir, "out_dir")
  checkpoint_dir = checkpoint_dir or os.path.join(out_dir, "train_state")
  progress = progress and distributed.is_main_process()
  os.makedirs(checkpoint_dir, exist_ok=True)
  data_path = os.path.join(checkpoint_dir, "data.npz")
  have_data = os.path.exists(data_path)
  distributed.same_on_all(have_data, f"whether {data_path} exists")
  source = data_source(prompts, max_new_tokens=config.max_new_tokens,
                       temperature=config.temperature, seed=config.seed,
                       batch_size=config.gen_batch_size)
  if have_data:
    data = TrainingData.load(data_path)
    if data.seq_len != config.seq_len:
      raise ValueError(f"{data_path} holds sequences of length {data.seq_len}, but "
                       f"seq_len={config.seq_len}; use a fresh checkpoint directory")
    if data.target and not contract.same_fingerprint(json.loads(data.target),
                                                     contract.target_fingerprint(target)):
      raise ValueError(f"{data_path} was regenerated by another target than this one; use a "
                       f"fresh checkpoint directory (--out), or delete {checkpoint_dir} to start "
                       "over (its checkpoints belong to that data)")
    if not data.source:
      log.warning("%s does not record the prompts it was regenerated from (written by an "
                  "older eagle3jax): training on it as it is", data_path)
    elif data.source != source:
      raise ValueError(
          f"{data_path} was regenerated from other prompts or regeneration settings "
          f"(max_new_tokens, temperature, or the seed when sampling) than this run's; resuming "
          f"would silently train on the old data. Use a fresh checkpoint directory (--out), or "
          f"delete {checkpoint_dir} to start over (its checkpoints belong to that data)")
  else:
    data = build_training_data(target, prompts, seq_len=config.seq_len,
                               max_new_tokens=config.max_new_tokens,
                               temperature=config.temperature, seed=config.seed,
                               batch_size=config.gen_batch_size)
    data = dataclasses.replace(data, source=source,
                               target=json.dumps(contract.target_fingerprint(target)))
    if distributed.is_main_process():
      data.save(data_path)
    distributed.barrier("eagle3jax.train_drafter.data")
  vocab_size = target.config.vocab_size
  vocab = build_draft_vocab(data.responses(), vocab_size, draft_vocab_size)
  if progress:
    print(f"draft vocab: {vocab.size} of {vocab_size} tokens, coverage of response tokens "
          f"{vocab.coverage:.4f}")
  dcfg = DrafterConfig.for_target(target.config, capture, draft_vocab_size=vocab.size,
                                  **(drafter_overrides or {}))
  drafter = init_drafter(dcfg, target=target, seed=config.seed, d2t=vocab.d2t,
                         head_init=config.head_init)
  trainer = Trainer(target, drafter, data, config,
                    checkpoint_dir=os.path.join(checkpoint_dir, "steps"))
  curve, t0 = [], time.perf_counter()
  try:
    while True:
      trainer.train(heldout_every or None, progress=progress)
      if heldout_every:
        steps, topk, tokens = shape.num_steps, shape.topk, shape.num_draft_tokens
        measured = monitor.measure_acceptance_per_prompt(
            target, trainer.drafter, heldout_prompts, ((steps, topk, tokens),), eos_ids=[],
            max_new_tokens=HELDOUT_NEW_TOKENS)[tree_key(steps, topk, tokens)]
        curve.append(_curve_point(trainer.step, measured, heldout_sources,
                                  round(time.perf_counter() - t0, 1)))
        log.info("held-out acceptance at step %d: %s (interval %s)", trainer.step,
                 curve[-1]["accept_length"], curve[-1].get("interval"))
      if trainer.step >= config.total_steps:
        break
    trainer.save()
  finally:
    trainer.close()
  drafter = trainer.drafter
  # Without EOS, as the curve measures: every prompt runs HELDOUT_NEW_TOKENS, so the record
  # and the curve's last point are one measurement.
  acceptance = (monitor.measure_acceptance(target, drafter, heldout_prompts, eos_ids=[],
                                           max_new_tokens=HELDOUT_NEW_TOKENS)
                if heldout_prompts else {})
  calibration = np.concatenate([t[:n] for t, n in zip(data.tokens, data.lengths)])
  with warnings.catch_warnings():  # said before the training
    warnings.simplefilter("ignore", PortabilityWarning)
    save_drafter(drafter, out_dir, target=target,
                 calibration_ids=calibration[:contract.CALIBRATION_TOKENS],
                 acceptance=acceptance)
  return TrainResult(drafter, trainer.history, vocab, curve)
