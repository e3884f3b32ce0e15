"""Loading and saving EAGLE-3 drafters in the public ``LlamaForCausalLMEagle3`` layout.

How the capture ids of a config are read, and how ``load_drafter`` proves that the drafter sees
the features it was trained on (the capture record, the probe), is
``eagle3jax.capture_contract``. This module refuses what the one-layer drafter does not
implement (unknown or unsupported config fields, NaN/Inf weights, d2t/t2d that do not map the
draft vocabulary increasingly into the target's), shares the target's embedding when the file
carries the same table, and writes drafters that other engines load as trained (the embedding
included by default, the capture ids with their convention).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh

from eagle3jax import capture_contract as contract
from eagle3jax import checks, model_kinds, vocab_parallel
from eagle3jax.capture import EMBEDDING, CaptureSpec
from eagle3jax.capture_contract import IDS_KEY, check_pair, resolve_capture  # noqa: F401
from eagle3jax.config import DRAFTER_CONFIG_FIELDS
from eagle3jax.distributed import barrier, is_main_process, to_host
from eagle3jax.drafter import DrafterConfig, Eagle3Drafter, drafter_kv_repeat
from eagle3jax.hf_target import read_config
from eagle3jax.params import materialize, random_fill
from eagle3jax.rope import RopeConfig
from eagle3jax.safetensors_io import SafetensorsDir, check_finite
from eagle3jax.sharding import TENSOR
from eagle3jax.semantics import standard_numpy

log = logging.getLogger("eagle3jax")

# Drafter config fields that do not change the drafter's maths (or are checked below).
_DRAFTER_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "tie_word_embeddings", "attention_dropout", "max_window_layers", "pretraining_tp",
    "hidden_act", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
    "draft_vocab_size", "target_hidden_size", "rope_theta", "rope_scaling", "rope_parameters",
    "eagle_config", IDS_KEY, "aux_layer_convention", "num_hidden_layers", "attention_bias",
    "mlp_bias", "norm_before_residual", "sliding_window", "use_sliding_window", "layer_types",
})
_EAGLE_FIELDS = frozenset({IDS_KEY, "use_aux_hidden_state", "aux_layer_convention"})


def check_drafter_fields(hf: dict) -> None:
  """Refuses drafter config fields eagle3jax does not implement, naming them (as the target
  parser does): unknown fields, and known ones set to what this one-layer drafter does not
  compute."""
  layers = hf.get("num_hidden_layers", 1)
  if not DRAFTER_CONFIG_FIELDS & set(hf) and isinstance(layers, int) and layers > 1:
    raise ValueError(f"this config.json looks like a target model's (num_hidden_layers="
                     f"{layers} and none of {sorted(DRAFTER_CONFIG_FIELDS)}), not an EAGLE-3 "
                     "drafter's: pass it as the target (--target / load_target) and the "
                     "drafter's folder as the drafter")
  unknown = sorted(k for k in hf if k not in _DRAFTER_FIELDS and not k.startswith("_"))
  unknown += sorted(f"eagle_config.{k}" for k in (hf.get("eagle_config") or {})
                    if k not in _EAGLE_FIELDS)
  if unknown:
    raise ValueError(f"drafter config.json has fields eagle3jax does not implement: {unknown}. "
                     "Remove them if they are harmless, or use a supported drafter.")
  bad = {}
  if hf.get("num_hidden_layers", 1) != 1:
    bad["num_hidden_layers"] = "an EAGLE-3 drafter here is one decoder layer"
  for key in ("norm_before_residual", "attention_bias", "mlp_bias", "use_sliding_window"):
    if hf.get(key):
      bad[key] = "not implemented (must be false or absent)"
  if hf.get("sliding_window") and hf.get("use_sliding_window", True):
    bad["sliding_window"] = "sliding-window attention is not implemented"
  if any(t != "full_attention" for t in hf.get("layer_types") or []):
    bad["layer_types"] = "only 'full_attention' layers are implemented"
  if (hf.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
    bad["eagle_config.use_aux_hidden_state"] = "EAGLE-3 drafters use the aux hidden states"
  if (hf.get("pretraining_tp") or 1) != 1:
    bad["pretraining_tp"] = "must be 1"
  if bad:
    raise ValueError("drafter config.json sets fields that change the drafter's maths in ways "
                     "eagle3jax does not implement: " + "; ".join(
                         f"{k}={hf.get(k, (hf.get('eagle_config') or {}).get(k.split('.')[-1]))!r}"
                         f" ({why})" for k, why in bad.items()))


def config_from_hf(hf: dict, capture: CaptureSpec) -> DrafterConfig:
  check_drafter_fields(hf)
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"drafter config field hidden_act={act!r} is not supported (only 'silu')")
  missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                         "vocab_size") if k not in hf]
  if missing:
    raise ValueError(f"drafter config.json is missing required fields {missing}")
  rope_hf = {k: hf[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in hf}
  return DrafterConfig(
      hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
      num_attention_heads=hf["num_attention_heads"],
      num_key_value_heads=(hf["num_attention_heads"] if hf.get("num_key_value_heads") is None
                           else hf["num_key_value_heads"]),
      head_dim=hf.get("head_dim"),
      rms_norm_eps=checks.hf_number(hf, "rms_norm_eps", 1e-6, where="drafter config field"),
      rope=RopeConfig.from_hf(rope_hf, default_theta=10000.0),
      max_position_embeddings=checks.hf_number(hf, "max_position_embeddings", 2048, int,
                                               where="drafter config field"),
      vocab_size=hf["vocab_size"],
      draft_vocab_size=(hf["vocab_size"] if hf.get("draft_vocab_size") is None
                        else hf["draft_vocab_size"]),
      target_hidden_size=hf.get("target_hidden_size"), capture=capture)


def _hf_name_and_transform(name: str, cfg: DrafterConfig):
  d, n, h, k = (cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim,
                cfg.num_key_value_heads)
  table = {
      "embed_tokens": ("embed_tokens.weight", lambda w: w),
      "fc": ("fc.weight", lambda w: w.T),
      "hidden_norm.weight": ("midlayer.hidden_norm.weight", lambda w: w),
      "input_layernorm.weight": ("midlayer.input_layernorm.weight", lambda w: w),
      "post_attention_layernorm.weight": ("midlayer.post_attention_layernorm.weight",
                                          lambda w: w),
      "self_attn.q_proj": ("midlayer.self_attn.q_proj.weight",
                           lambda w: w.T.reshape(2 * d, n, h)),
      "self_attn.k_proj": ("midlayer.self_attn.k_proj.weight",
                           lambda w: w.T.reshape(2 * d, k, h)),
      "self_attn.v_proj": ("midlayer.self_attn.v_proj.weight",
                           lambda w: w.T.reshape(2 * d, k, h)),
      "self_attn.o_proj": ("midlayer.self_attn.o_proj.weight",
                           lambda w: w.T.reshape(n, h, d)),
      "mlp.gate_proj": ("midlayer.mlp.gate_proj.weight", lambda w: w.T),
      "mlp.up_proj": ("midlayer.mlp.up_proj.weight", lambda w: w.T),
      "mlp.down_proj": ("midlayer.mlp.down_proj.weight", lambda w: w.T),
      "norm.weight": ("norm.weight", lambda w: w),
      "lm_head": ("lm_head.weight", lambda w: w.T),
      "d2t": ("d2t", lambda w: w),
      "t2d": ("t2d", lambda w: w),
  }
  return table[name]


EMBED_SAMPLE_ROWS = 64


def _attach(drafter: Eagle3Drafter, target, mesh: Mesh) -> Eagle3Drafter:
  cfg = drafter.config
  if not drafter.own_embedding:
    table = target.embed_tokens[...]
    if table.shape != (cfg.vocab_size, cfg.hidden_size):
      raise ValueError(
          f"the drafter has no embed_tokens.weight and the target's embedding has shape "
          f"{tuple(table.shape)}, but the drafter needs [vocab_size={cfg.vocab_size}, "
          f"hidden_size={cfg.hidden_size}]; use a checkpoint that carries embed_tokens.weight")
    drafter.embed_tokens = target.embed_tokens  # shared, not copied
  drafter.mesh = mesh
  return drafter


def _same_embedding(file_table: np.ndarray, target) -> bool:
  """Whether a drafter file's ``embed_tokens.weight`` is the target's table (seeded rows
  compared at bf16 precision), so the target's array can be shared instead of copied."""
  table = target.embed_tokens[...]
  if tuple(file_table.shape) != tuple(table.shape):
    return False
  rows = np.random.default_rng(0).choice(table.shape[0], min(EMBED_SAMPLE_ROWS, table.shape[0]),
                                         replace=False)
  with jax.set_mesh(target.mesh):
    ours = table.at[jnp.asarray(np.sort(rows))].get(out_sharding=jax.sharding.PartitionSpec())
  ours = np.asarray(jax.device_get(ours), np.float32)
  theirs = np.asarray(file_table[np.sort(rows)], np.float32)
  return bool(np.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * np.abs(ours).max()))


def check_vocab_maps(d2t: np.ndarray, t2d: np.ndarray | None, vocab_size: int,
                     where: str) -> None:
  """d2t maps the draft vocabulary strictly increasingly into ``[0, vocab_size)``; t2d (when
  given) marks exactly those target ids."""
  d2t = np.asarray(d2t).astype(np.int64)
  ids = np.arange(len(d2t)) + d2t
  if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(f"{where}: d2t maps draft ids to target ids outside [0, {vocab_size}) "
                     f"(min {ids.min()}, max {ids.max()}); d2t[i] must be target_id(i) - i")
  if np.any(np.diff(ids) <= 0):
    i = int(np.argmax(np.diff(ids) <= 0))
    raise ValueError(f"{where}: d2t does not map the draft vocabulary increasingly into the "
                     f"target vocabulary (draft ids {i}, {i + 1} -> target ids {ids[i]}, "
                     f"{ids[i + 1]}); the draft vocabulary is sorted by target id, and "
                     "d2t[i] = target_id(i) - i")
  if t2d is not None:
    t2d = np.asarray(t2d).astype(bool)
    if len(t2d) != vocab_size or t2d.sum() != len(ids) or not t2d[ids].all():
      raise ValueError(f"{where}: t2d (marks {int(t2d.sum())} of {len(t2d)} target ids) does "
                       f"not agree with d2t ({len(ids)} draft ids); t2d must be True exactly "
                       "at the target ids i + d2t[i]")


@standard_numpy
def load_drafter(path: str, *, target, mesh: Mesh | None = None,
                 aux_layer_convention: str | None = None, dtype=None,
                 verify_capture: bool = True) -> Eagle3Drafter:
  """Loads an EAGLE-3 drafter checkpoint (public ``LlamaForCausalLMEagle3`` layout).

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (and, when written by
      eagle3jax, ``eagle3jax_record.json``: see ``eagle3jax.capture_contract``).
    target: the target model it drafts for (its embedding is shared).
    mesh: must be the target's mesh (the default).
    aux_layer_convention: ``"input"``, ``"output"`` or ``"auto"`` (measure both); required
      only when the config gives capture ids without a recorded convention.
    dtype: parameter dtype (default: the target's).
    verify_capture: with a capture record, recompute the recorded target features and refuse
      a mismatch; without one, probe the drafter's agreement with the target under each
      reading of its ids and refuse a configured list that scores far below another.
      ``False`` skips both (for users who know better).
  """
  model_kinds.require_target("load_drafter's target", target)
  if dtype is not None:
    checks.float_dtype("dtype", dtype)
  contract.check_mesh(target, mesh)
  mesh = target.mesh
  hf = read_config(path)
  capture, explanation, readings = resolve_capture(hf, target.num_layers, aux_layer_convention)
  ids, recorded = contract.config_ids(hf)
  if aux_layer_convention == "auto" and not verify_capture and ids is not None \
      and recorded is None and sum(c in readings for c in contract.CONVENTIONS) > 1:
    raise ValueError(
        f"aux_layer_convention='auto' measures which reading of {IDS_KEY}={ids} the drafter "
        "was trained with, and verify_capture=False skips that measurement: name the "
        "convention ('input' or 'output'; scripts: --aux-layer-convention) or let the check "
        "run")
  cfg = config_from_hf(hf, capture)
  check_pair(target, cfg)
  record = contract.read_record(path)
  tensors = SafetensorsDir(path)
  fc_in = tensors.shape("fc.weight")[1] if "fc.weight" in tensors else None
  if fc_in is not None and fc_in != capture.width(cfg.feature_size):
    raise ValueError(
        f"drafter fc.weight takes {fc_in} input features, but the capture spec "
        f"{capture.as_list()} gives {len(capture.layer_ids)} x {cfg.feature_size} = "
        f"{capture.width(cfg.feature_size)}: the capture list does not match the drafter")
  own = "embed_tokens.weight" in tensors and not _same_embedding(
      tensors.get("embed_tokens.weight"), target)
  used = {"embed_tokens.weight"} if "embed_tokens.weight" in tensors else set()
  where = f"drafter checkpoint {path!r}"
  digests: dict[str, str] = {}  # the record's weights digest, taken as the weights are read

  def fill(name, shape, init):
    hf_name, fn = _hf_name_and_transform(name, cfg)
    if hf_name not in tensors:
      if name == "d2t" and cfg.draft_vocab_size == cfg.vocab_size:
        return np.zeros(shape, np.int32)  # full vocabulary: draft id == target id
      if name == "t2d" and cfg.draft_vocab_size == cfg.vocab_size:
        return np.ones(shape, bool)
      raise ValueError(f"{where} is missing weight {hf_name!r}" + {
          "d2t": " (without d2t, draft ids cannot be mapped to target ids)",
          "t2d": " (without t2d, the target ids of the draft vocabulary are not marked)",
      }.get(name, ""))
    used.add(hf_name)
    w = tensors.get(hf_name)
    if record is not None:
      digests[hf_name] = contract.tensor_digest(w)
    try:
      out = fn(np.asarray(w))
    except ValueError:
      out = None
    if out is None or tuple(out.shape) != tuple(shape):
      raise ValueError(f"drafter weight {hf_name!r} has shape {tuple(w.shape)}, which does not "
                       f"fit the config (expected {shape} after the layout change)")
    check_finite(out, hf_name, where)
    return out

  if "d2t" in tensors:
    check_vocab_maps(tensors.get("d2t"), tensors.get("t2d") if "t2d" in tensors else None,
                     cfg.vocab_size, where)
  dtype = dtype or target.dtype
  kv_repeat = drafter_kv_repeat(cfg, mesh.shape[TENSOR])
  drafter = materialize(lambda: Eagle3Drafter(cfg, kv_repeat=kv_repeat, own_embedding=own,
                                              dtype=dtype), mesh, fill, kv_repeat)
  extra = sorted(set(tensors.names) - used)
  if extra:
    raise ValueError(f"{where} has unexpected weights {extra[:8]}")
  if record is not None:
    if record.weights:
      emb = contract.EMBEDDING_WEIGHT
      if record.weights_embedding and emb in tensors and emb not in digests:
        digests[emb] = contract.tensor_digest(tensors.get(emb))
      contract.check_weights(
          record, contract.weights_digest(digests, own_embedding=record.weights_embedding),
          where)
    else:
      log.warning("%s: its capture record predates weights digests, so nothing ties it to "
                  "these weights; save the drafter again (save_drafter) to record them", where)
  drafter = _attach(drafter, target, mesh)
  drafter.capture_record = record
  vouched = False
  if verify_capture:
    explanation, vouched = _verify(drafter, target, record, capture, readings,
                                   aux_layer_convention, hf, explanation, where)
  else:
    explanation += "; capture NOT verified (verify_capture=False)"
    log.warning("%s: capture %s NOT verified (verify_capture=False): if it is not what the "
                "drafter was trained on, acceptance collapses without any other sign", where,
                drafter.config.capture.as_list())
  if (record is not None and record.weights and not record.weights_embedding and own
      and verify_capture):
    # The record verified this target, and was written with its table as the embedding.
    raise ValueError(
        f"{where}: its capture record was written with the target's token embedding "
        f"(shared), but the file's {contract.EMBEDDING_WEIGHT} is not this target's table: it "
        f"was changed after the record was written. Put the target's table back, or delete "
        f"{contract.RECORD_FILE} to load the drafter with the probe instead")
  # Attributes, so nnx copies (clone, split/merge) keep them.
  drafter.capture_check_skipped = not verify_capture
  drafter.capture_loaded_ids = drafter.config.capture.layer_ids
  contract.mark_checked(drafter, target, vouched=vouched)
  log.info("drafter %s: %s", path, explanation)
  drafter.capture_explanation = explanation
  return drafter


def _verify(drafter, target, record, capture, readings, convention, hf, explanation,
            where) -> tuple[str, bool]:
  """The load-time capture check (record, else probe); may settle an ``"auto"`` reading.
  Returns the explanation and whether the check vouches for the pairing (a verified record,
  or the reading taken scoring at least ``PROBE_FLOOR`` in the probe: below it the drafter was
  probably trained for another target)."""
  ids, recorded = contract.config_ids(hf)
  ambiguous = ids is not None and recorded is None and convention == "auto"
  if record is not None:
    if ambiguous:  # the record settles which reading was trained
      verdict_errors = []
      for conv in contract.CONVENTIONS:
        if conv in readings:
          try:
            note = contract.verify_record(record, target, readings[conv], where=where)
            drafter.config = dataclasses.replace(drafter.config, capture=readings[conv])
            return (f"{IDS_KEY}={ids} read as {conv!r} (settled by the capture record); "
                    f"{note}", True)
          except ValueError as e:
            verdict_errors.append(e)
      raise verdict_errors[-1]
    return explanation + "; " + contract.verify_record(record, target, capture,
                                                       where=where), True
  if ids is None or len(readings) < 2:
    # One reading, nothing to compare it with; the probe still tells a drafter trained for
    # another target (it agrees with this one almost never) and warns.
    only = {"configured": capture}
    scores = contract.probe_capture(target, drafter, only)
    return (explanation + "; " + contract.judge_probe(scores, only, "configured", where=where),
            scores["configured"] >= contract.PROBE_FLOOR)
  scores = contract.probe_capture(target, drafter, readings)
  if ambiguous:
    conv = max((c for c in contract.CONVENTIONS if c in scores), key=scores.get)
    drafter.config = dataclasses.replace(drafter.config, capture=readings[conv])
    chosen = conv
    explanation = (f"{IDS_KEY}={ids} read as {conv!r} (probed): captures the outputs of "
                   f"target layers {readings[conv].as_list()}")
  else:
    chosen = recorded or convention
  return (explanation + "; " + contract.judge_probe(scores, readings, chosen, where=where),
          scores.get(chosen, 0.0) >= contract.PROBE_FLOOR)


# How ``init_drafter`` starts the draft head: seeded random, or the target's (``_target_head``).
HEAD_INITS = ("random", "target")


def check_init_config(target, cfg: DrafterConfig) -> None:
  """What ``init_drafter`` needs of ``cfg`` beyond fitting the target (``check_pair``): the
  width of the target's token embedding, which an initialised drafter shares."""
  check_pair(target, cfg)
  if cfg.hidden_size != target.config.hidden_size:
    raise ValueError(
        f"drafter hidden_size={cfg.hidden_size} differs from the target's hidden_size="
        f"{target.config.hidden_size}: an initialised drafter shares the target's token "
        f"embedding [vocab_size, hidden_size], so it has the target's width (leave hidden_size "
        f"out of the overrides)")


@standard_numpy
def init_drafter(cfg: DrafterConfig, *, target, mesh: Mesh | None = None, dtype=None,
                 seed: int = 0, std: float = 0.02, d2t=None,
                 head_init: str = "random") -> Eagle3Drafter:
  """A randomly initialised drafter for ``target`` (optionally with a draft-vocab ``d2t``).

  ``head_init="target"`` starts ``lm_head`` from the target's output embedding, restricted to
  the draft vocabulary (row ``i`` of the draft vocabulary is target token ``i + d2t[i]``), and
  the drafter's final norm from the target's: the drafter then starts out reading its last
  hidden state the way the target reads its own (EAGLE-1 kept the target's head frozen; here it
  is only the starting point). ``"random"``: N(0, std) like every other weight.
  """
  model_kinds.require_config(
      "init_drafter", cfg, DrafterConfig,
      "build one for the target with DrafterConfig.for_target(target.config, capture)")
  model_kinds.require_target("init_drafter's target", target)
  if dtype is not None:
    checks.float_dtype("dtype", dtype)
  contract.check_mesh(target, mesh)
  mesh = target.mesh
  if head_init not in HEAD_INITS:
    raise ValueError(f"head_init={head_init!r}; choose one of {HEAD_INITS}")
  if d2t is not None:
    check_vocab_maps(d2t, None, target.config.vocab_size, "init_drafter")
    if len(d2t) != cfg.draft_vocab_size:
      raise ValueError(f"init_drafter: d2t has {len(d2t)} entries but the config's "
                       f"draft_vocab_size={cfg.draft_vocab_size}; they must match "
                       f"(DrafterConfig.for_target(..., draft_vocab_size={len(d2t)}))")
  check_init_config(target, cfg)
  base = random_fill(seed, std)
  # Target token of each draft-vocabulary row (the identity without a d2t).
  target_ids = (np.arange(cfg.draft_vocab_size) if d2t is None
                else np.arange(len(d2t)) + np.asarray(d2t, np.int64))
  head = _target_head(target, cfg, target_ids) if head_init == "target" else {}

  def fill(name, shape, init):
    if name in head:
      return head[name]
    if name == "d2t":
      return np.zeros(shape, np.int32) if d2t is None else np.asarray(d2t, np.int32)
    if name == "t2d":
      if d2t is None:
        return np.ones(shape, bool)
      mask = np.zeros(shape, bool)
      mask[target_ids] = True
      return mask
    return base(name, shape, init)

  dtype = dtype or target.dtype
  kv_repeat = drafter_kv_repeat(cfg, mesh.shape[TENSOR])
  drafter = materialize(lambda: Eagle3Drafter(cfg, kv_repeat=kv_repeat, dtype=dtype), mesh,
                        fill, kv_repeat)
  drafter.capture_explanation = "initialised in eagle3jax"
  drafter.capture_record = None
  drafter.capture_check_skipped = False
  drafter.capture_loaded_ids = cfg.capture.layer_ids
  drafter = _attach(drafter, target, mesh)
  contract.mark_checked(drafter, target, vouched=True)
  return drafter


def _target_head(target, cfg: DrafterConfig, ids: np.ndarray) -> dict[str, np.ndarray]:
  """The target's output embedding rows ``ids`` (``[D, N]``) and its final norm."""
  if target.config.hidden_size != cfg.hidden_size:
    raise ValueError(f"head_init='target' needs the drafter's hidden_size={cfg.hidden_size} to "
                     f"equal the target's {target.config.hidden_size}")
  # The rows are taken on the devices (vocab-parallel where the table is sharded), so only
  # the [D, N] head reaches the host, not the whole [V, D] table (4.7 GB for Kimi-K2.5).
  table = (target.embed_tokens[...] if target.config.tie_word_embeddings
           else target.lm_head[...])
  with jax.set_mesh(target.mesh):
    head = _head_columns(table, jnp.asarray(ids, jnp.int32),
                         tied=target.config.tie_word_embeddings)
  return {"lm_head": np.ascontiguousarray(_host(head), np.float32),
          "norm.weight": _host(target.norm.weight[...]).astype(np.float32)}


@functools.partial(jax.jit, static_argnames=("tied",))
def _head_columns(table: jax.Array, ids: jax.Array, *, tied: bool) -> jax.Array:
  """``[D, N]``: columns ``ids`` of the output embedding. The tied ``[V, D]`` table is
  transposed inside this program, where XLA fuses the transpose into the gather (on a CPU mesh
  the compiled temporaries are a tenth of one shard), not beside it as an eager copy."""
  return vocab_parallel.take_columns(table.T if tied else table, ids)


def _host(x) -> np.ndarray:
  return to_host(x)


@standard_numpy
def save_drafter(drafter: Eagle3Drafter, path: str, *, include_embedding: bool = True,
                 target=None, calibration_ids=None, acceptance: dict | None = None,
                 dtype=None) -> None:
  """Writes ``config.json`` and ``model.safetensors`` in the public EAGLE-3 layout, and the
  capture record ``eagle3jax_record.json``.

  The capture ids are recorded in the project convention with ``aux_layer_convention:
  "output"``, so ``load_drafter(path, target=...)`` needs no convention argument. In a
  multi-process run every process calls it (parameters are gathered and the record is taken
  collectively) and process 0 writes the files.

  Args:
    drafter: the drafter to write.
    path: output directory.
    include_embedding: write the (target's) token embedding as ``embed_tokens.weight``. The
      official EAGLE-3 loader silently keeps a random embedding when the file has none and
      the config names ``target_hidden_size`` (written only for features of another width
      than the drafter's); ``False`` leaves it out for engines that share the target's.

  A drafter that the official EAGLE-3 code or SGLang would refuse or misread (another number
  of captures, heads that do not split ``hidden_size``, a capture those engines read otherwise;
  ``portability_problems``) is written all the same, with a ``PortabilityWarning``.
    target: the target it drafts for; with it a fresh capture record is taken
      (``eagle3jax.capture_contract``), after the drafter's loaded record, if any, is checked
      against it (a record is never replaced by one that vouches for another target or
      capture), and a drafter without a record loaded with ``verify_capture=False`` is
      refused (nothing checked the capture such a record would vouch for). Without it the
      loaded record, if any, is written again (its ``acceptance`` merged); a record whose
      capture is not the config's is refused.
    calibration_ids: token ids the record's features are taken at (default: seeded ids of the
      draft vocabulary; ``train_drafter`` passes training tokens).
    acceptance: held-out greedy acceptance length per tree shape ``{"steps,topk,tokens": x}``.
    dtype: the float dtype the weights are stored in (``torch_dtype`` in ``config.json``;
      ``d2t`` and ``t2d`` keep theirs). Default: the drafter's. The record's weights digest is
      taken of the weights as stored.
  """
  model_kinds.require_drafter("save_drafter's drafter", drafter)
  if dtype is not None:
    checks.float_dtype("dtype", dtype)
  if target is not None:
    model_kinds.require_target("save_drafter's target", target)
  for k, v in (acceptance or {}).items():  # on every process, before anything is written
    contract.check_acceptance(k, v)
  check_drafter_folder(path, "save_drafter's path")
  cfg = drafter.config
  warn_portability(cfg, target.num_layers if target is not None else None, "this drafter",
                   own_embedding=drafter.own_embedding)
  record = getattr(drafter, "capture_record", None)
  if target is None and record is not None and record.capture != cfg.capture.layer_ids:
    raise ValueError(
        f"the drafter's capture record says it was trained on target layers "
        f"{list(record.capture)}, but its config captures {cfg.capture.as_list()}: saving it "
        f"would drop the record, and with it the proof. Pass target= to check the record "
        f"against that capture and take a fresh one, or set drafter.capture_record = None if "
        f"the drafter was retrained for {cfg.capture.as_list()}")
  if target is not None:  # checked before anything is gathered or written
    where = "the drafter being saved"
    if record is None and getattr(drafter, "capture_check_skipped", False):
      raise ValueError(
          "this drafter has no capture record and was loaded with verify_capture=False: a "
          "record written now would vouch for a capture nobody checked (and a wrong one "
          "would then pass every later load). Load it with the check on (the probe), or save "
          "it without target= (no record)")
    if record is not None:  # a fresh record must not vouch for what the old one refuses
      contract.verify_record(record, target, cfg.capture, where=where, hint=(
          "if the drafter was retrained for this target and capture, set "
          "drafter.capture_record = None: the save then probes it on this target"))
    else:
      contract.check_capture_unchanged(drafter, where)
      if not contract.vouched_for(drafter, target):
        # Not initialised for this target, nor loaded for it with its probe agreeing (a copy
        # starts unchecked): probe it now, as a load would, before a record vouches for it.
        scores = contract.probe_capture(target, drafter, {"configured": cfg.capture})
        if scores["configured"] < contract.PROBE_FLOOR:
          raise ValueError(
              f"this drafter has no capture record and was not initialised or loaded for this "
              f"target; probed on it now, it predicts the target's next token "
              f"{scores['configured']:.2f} of the time with capture "
              f"{cfg.capture.as_list()} (a drafter trained on this target scores about 0.7). "
              f"A record written now would vouch for a pairing it does not have, and every "
              f"later load would pass it: save it for the target it was trained for, or "
              f"without target= (no record)")
        contract.mark_checked(drafter, target, vouched=True)
  d, n, h, k = (cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim,
                cfg.num_key_value_heads)
  r = drafter.kv_repeat
  attn = drafter.self_attn

  def kv(w):  # undo KV-head replication: [2D, K*r, H] -> HF [K*H, 2D]
    w = _host(w)[:, ::r, :]
    return w.reshape(2 * d, k * h).T

  tensors = {
      "fc.weight": _host(drafter.fc[...]).T,
      "midlayer.hidden_norm.weight": _host(drafter.hidden_norm.weight[...]),
      "midlayer.input_layernorm.weight": _host(drafter.input_layernorm.weight[...]),
      "midlayer.post_attention_layernorm.weight":
          _host(drafter.post_attention_layernorm.weight[...]),
      "midlayer.self_attn.q_proj.weight": _host(attn.q_proj[...]).reshape(2 * d, n * h).T,
      "midlayer.self_attn.k_proj.weight": kv(attn.k_proj[...]),
      "midlayer.self_attn.v_proj.weight": kv(attn.v_proj[...]),
      "midlayer.self_attn.o_proj.weight": _host(attn.o_proj[...]).reshape(n * h, d).T,
      "midlayer.mlp.gate_proj.weight": _host(drafter.mlp.gate_proj[...]).T,
      "midlayer.mlp.up_proj.weight": _host(drafter.mlp.up_proj[...]).T,
      "midlayer.mlp.down_proj.weight": _host(drafter.mlp.down_proj[...]).T,
      "norm.weight": _host(drafter.norm.weight[...]),
      "lm_head.weight": _host(drafter.lm_head[...]).T,
      "d2t": _host(drafter.d2t[...]).astype(np.int64),
      "t2d": _host(drafter.t2d[...]).astype(bool),
  }
  if include_embedding or drafter.own_embedding:
    tensors["embed_tokens.weight"] = _host(drafter.embed_tokens[...])
  store = np.dtype(dtype if dtype is not None else drafter.dtype)  # a dtype object is falsy
  tensors = {key: np.ascontiguousarray(v if key in ("d2t", "t2d") else v.astype(store))
             for key, v in tensors.items()}
  if target is not None:  # on every process: the record runs the target
    ids = (contract.default_calibration_ids(target, drafter) if calibration_ids is None
           else calibration_ids)
    old = dict(record.acceptance) if record is not None else {}
    record = contract.make_record(target, cfg.capture, ids, acceptance=old)
  if is_main_process():
    _write(path, tensors, _hf_config(drafter, store), record, acceptance,
           own_embedding=drafter.own_embedding)
  barrier("eagle3jax.save_drafter")


def check_drafter_folder(path: str, what: str) -> None:
  """Refuses a folder a drafter cannot be written to: a file, or a folder holding a model other
  than an EAGLE-3 drafter (the target's own, say), whose ``config.json`` and weights the
  export would overwrite. A drafter's folder may be written over (a re-export)."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{what} {path!r} is a file; a drafter is saved to a folder")
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config):
    return
  try:
    with open(config, encoding="utf-8") as f:
      cfg = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{what} {path!r} holds {config}, which cannot be read as JSON ({e}): an "
                     "interrupted export, or another tool's file. Remove it, or give another "
                     "folder") from None
  if not (isinstance(cfg, dict) and DRAFTER_CONFIG_FIELDS & set(cfg)):
    raise ValueError(f"{what} {path!r} holds {config}, which is not an EAGLE-3 drafter's (a "
                     "target's, perhaps): saving there would overwrite that model. Give another "
                     "folder")


def _hf_config(drafter: Eagle3Drafter, dtype) -> dict:
  """The public ``config.json`` of a drafter stored in ``dtype`` (capture ids in the project
  convention).

  ``target_hidden_size`` is written only when the features are not the drafter's own width:
  the official EAGLE-3 loader copies the target's embedding into a drafter file without one
  only when that field is absent (with it, it keeps a random one, silently). ``rope_scaling``
  names its type under both keys: transformers reads ``rope_type``, the official code
  ``type``."""
  cfg = drafter.config
  d, n, h, k = (cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim,
                cfg.num_key_value_heads)
  scaling = cfg.rope.to_hf()
  out = {
      "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
      "hidden_act": "silu", "hidden_size": d, "intermediate_size": cfg.intermediate_size,
      "num_attention_heads": n, "num_key_value_heads": k, "head_dim": h,
      "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
      "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
      "draft_vocab_size": cfg.draft_vocab_size,
      "tie_word_embeddings": False, "torch_dtype": str(np.dtype(dtype)),
      "rope_theta": cfg.rope.theta,
      "rope_scaling": None if scaling is None else {"type": scaling["rope_type"], **scaling},
      "eagle_config": {IDS_KEY: cfg.capture.as_list(), "use_aux_hidden_state": True,
                       "aux_layer_convention": "output"},
  }
  if cfg.feature_size != d:
    out["target_hidden_size"] = cfg.feature_size
  return out


class PortabilityWarning(UserWarning):
  """A drafter that this project serves as trained, but the official EAGLE-3 code or SGLang
  would refuse or misread (``portability_problems``)."""


OFFICIAL_ROPE_TYPES = ("default", "linear", "dynamic")  # the official EAGLE-3 code's


def portability_problems(cfg: DrafterConfig, num_target_layers: int | None = None, *,
                         own_embedding: bool = False) -> list[str]:
  """What keeps the official EAGLE-3 code or SGLang from serving a drafter of ``cfg`` as it
  was trained (``[]``: both serve it as this project does). ``num_target_layers``: the
  target's layer count, to compare the capture with the layers the official code reads;
  ``own_embedding``: the drafter carries a token embedding other than the target's."""
  out = []
  if own_embedding and cfg.feature_size == cfg.hidden_size:
    out.append("it carries its own token embedding, which SGLang replaces with the target's "
               "(it shares the target's wherever the widths match)")
  ids = cfg.capture.as_list()
  if len(ids) != 3:
    out.append(f"it reads {len(ids)} captured layers, but the official EAGLE-3 code and SGLang "
               "build fc for exactly 3 (its fc.weight would not load)")
  n, h = cfg.num_attention_heads, cfg.resolved_head_dim
  if n * h != cfg.hidden_size:
    out.append(f"num_attention_heads={n} x head_dim={h} is not hidden_size={cfg.hidden_size}, "
               f"but the official EAGLE-3 code derives head_dim = hidden_size // "
               f"num_attention_heads = {cfg.hidden_size // n} (its q/k/v would not load)")
  if EMBEDDING in ids:
    out.append("it captures the embedding output (id -1), for which SGLang's capture list has "
               "no id")
  elif ids and ids[0] != 1:
    out.append(f"its capture {ids} does not start at layer 1: SGLang reads such ids as the "
               f"inputs of those layers since its PR #25454 (2026; outputs before it), one "
               f"layer off ({[i - 1 for i in ids]} here)")
  if num_target_layers is not None and num_target_layers >= 7:
    official = list(CaptureSpec.eagle3_default(num_target_layers).layer_ids)
    if ids != official:
      out.append(f"the official EAGLE-3 code ignores the configured capture and always reads "
                 f"layers {official} of a {num_target_layers}-layer target, not {ids}")
  if cfg.rope.rope_type not in OFFICIAL_ROPE_TYPES:
    out.append(f"its rope_scaling type {cfg.rope.rope_type!r} is not one the official EAGLE-3 "
               f"code builds ({', '.join(OFFICIAL_ROPE_TYPES[1:])})")
  return out


def warn_portability(cfg: DrafterConfig, num_target_layers: int | None, what: str, *,
                     own_embedding: bool = False) -> None:
  """A ``PortabilityWarning`` naming ``portability_problems`` of ``what``, if any."""
  problems = portability_problems(cfg, num_target_layers, own_embedding=own_embedding)
  if problems:
    warnings.warn(f"{what} serves here as trained, but not in the official EAGLE-3 code or "
                  f"SGLang: {'; '.join(problems)}", PortabilityWarning,
                  stacklevel=checks.outside_stacklevel())


def _write(path: str, tensors: dict, hf: dict, record, acceptance: dict | None, *,
           own_embedding: bool) -> None:
  """Writes the drafter's files (process 0 only) and its record when it fits the capture,
  with the digest of the weights written beside it."""
  os.makedirs(path, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  if record is not None and record.capture == tuple(hf["eagle_config"][IDS_KEY]):
    digest = contract.weights_digest({name: contract.tensor_digest(t)
                                      for name, t in tensors.items()},
                                     own_embedding=own_embedding)
    contract.write_record(path, dataclasses.replace(
        record.with_acceptance(acceptance or {}), weights=digest,
        weights_embedding=own_embedding))
  elif os.path.exists(os.path.join(path, contract.RECORD_FILE)):
    os.remove(os.path.join(path, contract.RECORD_FILE))  # a stale record would mislead


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _draft_logits(graphdef, state, tokens, aux):
  drafter = nnx.merge(graphdef, state)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  a, _ = drafter(tokens, drafter.project(aux), positions)
  return drafter.logits(a)


@standard_numpy
def draft_logits(drafter: Eagle3Drafter, input_ids, aux_hidden) -> jax.Array:
  """Runs the drafter over a full sequence: ``[B, T, draft_vocab]`` float32 logits.

  Position ``s`` pairs the embedding of ``input_ids[:, s]`` with ``aux_hidden[:, s]`` (so pass
  the tokens shifted by one relative to the features, as in training), causal attention,
  positions ``0..T-1``.
  """
  from eagle3jax.api import check_tokens  # pylint: disable=import-outside-toplevel
  model_kinds.require_drafter("draft_logits' drafter", drafter)
  cfg = drafter.config
  tokens = check_tokens(input_ids, cfg.vocab_size)
  aux = jnp.asarray(aux_hidden)
  width = cfg.capture.width(cfg.feature_size)
  if aux.shape != tokens.shape + (width,):
    raise ValueError(f"aux_hidden has shape {tuple(aux.shape)}; expected "
                     f"{tokens.shape + (width,)} ([B, T, len(capture) * target_hidden_size] "
                     f"for capture {cfg.capture.as_list()})")
  graphdef, state = nnx.split(drafter)
  with jax.set_mesh(drafter.mesh):
    return _draft_logits(graphdef, state, jnp.asarray(tokens), aux)
