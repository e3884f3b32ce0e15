"""The capture contract: a drafter is served with exactly the target features it was trained on.

One owner for every check between a drafter and its target:

* **Reading the drafter config** (``resolve_capture``): ``eagle_aux_hidden_state_layer_ids``
  with a recorded ``aux_layer_convention`` (``"output"``: id ``i`` is the output of layer
  ``i``, this project's convention; ``"input"``: the input of layer ``i`` = output of ``i-1``)
  is used as recorded; ids without a convention are ambiguous (engines disagree by one layer)
  and need ``aux_layer_convention=`` (``"auto"``: the probe below picks); no ids at all: the
  official EAGLE-3 default, inputs of layers (2, L//2, L-3).
* **Pairing** (``check_pair``, ``check_mesh``, ``check_serving_capture``): vocabularies,
  widths, layer range, one mesh, and the serving capture equal to the trained one.
* **The record** (``CaptureRecord``, file ``eagle3jax_record.json`` next to the drafter's
  weights, written by ``save_drafter``/``train_drafter``): calibration token ids, per trained
  capture a small random projection of the target's features at those tokens, a fingerprint of
  the target (projections of its embedding rows and final-norm scale), the held-out acceptance
  per tree shape and the capture ids. ``verify_record`` recomputes the features with one short
  forward capturing every layer and refuses a mismatch, naming the configured capture, the
  layers of this target the recorded features match (the embedding and all layers are
  searched), or that the drafter was not trained on this target.
* **The probe** (``probe_capture``), for drafters without a record: the drafter's top-1
  agreement with the target's greedy continuation under each candidate reading of its ids.

Tolerance of the record check: features are compared per calibration token after a fixed
Gaussian projection to ``PROJECTION_DIM`` dims; the error of a layer is the median over tokens
(position 0, the attention sink, excluded) of ``|p_live - p_rec| / |p_rec|``. The check first
runs one forward capturing only the configured layers and their neighbours and passes when
each configured layer is within ``FAST_TOL`` (0.05) of its record and no neighbour matches
markedly better (the rule below); otherwise one forward capturing every layer decides: a
capture matches a layer when its error is at most ``FEATURE_TOL`` (0.2) and within ``1.5x`` of
the best layer's, and a record whose captures, embedding or final norm match nothing is "not
trained on this target". Measured on the shipped pair (12 layers): a bf16 target on a 2x4
mesh against a record taken in fp32 on one device is off by 0.004-0.007, the target with every
layer matrix rounded to symmetric INT4 in groups of 32 (weight-only quantisation) by
0.029-0.031; adjacent layers differ by 0.07-0.13, layers further apart by more, another target
by ~1. A tiny DeepSeek's Kimi-K2.5 INT4 checkpoint (held quantized) is off its float32
checkpoint's record by 0.06-0.10, its neighbouring layers by more than 0.5.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import warnings
import weakref
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle3jax import checks
from eagle3jax.capture import EMBEDDING, CaptureSpec, as_capture_spec
from eagle3jax.distributed import to_host
from eagle3jax.sharding import BATCH, EMBED, SEQ, shard

CONVENTIONS = ("input", "output")
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
RECORD_FILE = "eagle3jax_record.json"
RECORD_VERSION = 1
CALIBRATION_TOKENS = 32
PROJECTION_DIM = 16
FEATURE_TOL = 0.2
FAST_TOL = 0.05
NEAR_BEST = 1.5
# The probe refuses a configured reading whose top-1 agreement is below both
# ``PROBE_RATIO * best`` and ``best - PROBE_MARGIN``.
PROBE_RATIO = 0.75
PROBE_MARGIN = 0.1
# Below this best top-1 agreement the probe warns (``CaptureWarning``): under every reading the
# drafter predicts almost none of the target's tokens, so it was trained for another target (or
# not at all). A trained drafter on its own target scores 0.7-0.8 here.
PROBE_FLOOR = 0.2
PROBE_PROMPTS = 4
PROBE_PROMPT_LEN = 16
PROBE_NEW_TOKENS = 48


# --- reading the drafter config ------------------------------------------------------------

def config_ids(hf: dict) -> tuple[list[int] | None, str | None]:
  """``(ids, recorded convention)`` of a drafter ``config.json`` (None where absent)."""
  eagle = hf.get("eagle_config") or {}
  for key in (IDS_KEY, "aux_layer_convention"):
    if key in eagle and key in hf and eagle[key] != hf[key]:
      raise ValueError(f"drafter config gives {key} twice, {eagle[key]!r} in eagle_config and "
                       f"{hf[key]!r} at the top level; keep the one it was trained with")
  ids = eagle.get(IDS_KEY, hf.get(IDS_KEY))
  recorded = eagle.get("aux_layer_convention", hf.get("aux_layer_convention"))
  if recorded is not None and recorded not in CONVENTIONS:
    raise ValueError(f"drafter config aux_layer_convention={recorded!r} is not 'input' or "
                     "'output'")
  if ids is not None and (not isinstance(ids, (list, tuple)) or any(
      isinstance(i, bool) or not isinstance(i, int) for i in ids)):
    raise ValueError(f"drafter config {IDS_KEY}={ids!r} must be a JSON list of integer layer "
                     "ids, e.g. [1, 5, 8]")
  return (None if ids is None else [int(i) for i in ids]), recorded


def physical(ids: Sequence[int], convention: str) -> CaptureSpec:
  """The spec (project convention) of ``ids`` read in ``convention``."""
  return CaptureSpec(tuple(i - 1 for i in ids) if convention == "input" else tuple(ids))


def resolve_capture(hf: dict, num_target_layers: int,
                    aux_layer_convention: str | None = None
                    ) -> tuple[CaptureSpec, str, dict[str, CaptureSpec]]:
  """Applies the config rules; returns ``(spec, explanation, readings)``.

  ``readings`` maps each plausible reading (``"input"``, ``"output"``, ``"eagle3_default"``)
  to its spec; with ``aux_layer_convention="auto"`` and ambiguous ids the returned spec is the
  ``"output"`` reading and the caller probes (``probe_capture``) to choose.
  """
  if aux_layer_convention is not None and aux_layer_convention not in CONVENTIONS + ("auto",):
    raise ValueError(f"aux_layer_convention={aux_layer_convention!r}; choose 'input', "
                     "'output' or 'auto'")
  ids, recorded = config_ids(hf)
  readings = {}
  if num_target_layers >= 7:
    readings["eagle3_default"] = CaptureSpec.eagle3_default(num_target_layers)
  if ids is None:
    spec = CaptureSpec.eagle3_default(num_target_layers)
    return spec, (f"no capture ids in the drafter config: using the official EAGLE-3 default "
                  f"(inputs of layers 2, L//2, L-3) = outputs of layers {spec.as_list()}"), \
        readings
  for conv in CONVENTIONS:
    try:
      spec = physical(ids, conv)
      spec.validate(num_target_layers)
      readings[conv] = spec
    except ValueError:
      pass
  if recorded is not None:
    if aux_layer_convention not in (None, "auto", recorded):
      raise ValueError(
          f"aux_layer_convention={aux_layer_convention!r} contradicts the drafter config, "
          f"which records {IDS_KEY}={ids} with aux_layer_convention={recorded!r}; drop the "
          "argument")
    convention = recorded
  elif aux_layer_convention is None:
    raise ValueError(
        f"the drafter config gives {IDS_KEY}={ids} without saying which convention they "
        f"use, and engines disagree by one layer: read as 'input of layer k' (vLLM) they are "
        f"the outputs of layers {[i - 1 for i in ids]}; read as 'output of layer k' "
        f"(SpecForge) they are the outputs of layers {ids}. Pass aux_layer_convention="
        f"'input', 'output' or 'auto' (measure both) to load_drafter (scripts/decode.py: "
        f"--aux-layer-convention) with the convention the drafter was trained with")
  else:
    convention = aux_layer_convention
    if convention == "auto":  # a valid reading for now; the record or the probe decides
      convention = "output" if "output" in readings else "input"
  spec = physical(ids, convention)
  spec.validate(num_target_layers)
  return spec, (f"{IDS_KEY}={ids} read as {convention!r} of layer k: captures the outputs of "
                f"target layers {spec.as_list()} (-1 = embedding)"), readings


# --- pairing ---------------------------------------------------------------------------------

def check_pair(target, drafter_cfg) -> None:
  """Raises ValueError when a drafter does not fit a target (vocab, widths, layers)."""
  tcfg = target.config
  if drafter_cfg.vocab_size != tcfg.vocab_size:
    raise ValueError(f"drafter vocab_size={drafter_cfg.vocab_size} differs from the target's "
                     f"vocab_size={tcfg.vocab_size}")
  if drafter_cfg.feature_size != tcfg.hidden_size:
    raise ValueError(f"drafter target_hidden_size={drafter_cfg.feature_size} differs from the "
                     f"target's hidden_size={tcfg.hidden_size}")
  drafter_cfg.capture.validate(tcfg.num_hidden_layers)


def check_mesh(target, mesh) -> None:
  """A drafter lives on its target's mesh (its embedding is the target's array)."""
  if mesh is not None and mesh != target.mesh:
    raise ValueError(
        f"the drafter's mesh {dict(mesh.shape)} (devices {mesh.devices.ravel().tolist()}) is "
        f"not the target's mesh {dict(target.mesh.shape)} (devices "
        f"{target.mesh.devices.ravel().tolist()}); a drafter shares the target's embedding and "
        f"runs in the target's programs, so load it with mesh=None (the target's mesh)")


def check_serving_capture(drafter, capture) -> CaptureSpec:
  """The capture at serving time: what the drafter was trained on, or a loud error."""
  trained = drafter.config.capture
  capture = as_capture_spec(capture)
  if capture is None:
    return trained
  if capture.layer_ids != trained.layer_ids:
    raise ValueError(
        f"capture layers {capture.as_list()} differ from the layers the drafter was trained on "
        f"{trained.as_list()} (project convention: id i = output of target layer i, -1 = "
        f"embedding). Serving a drafter with other hidden states than its training data "
        f"silently destroys acceptance; pass capture=None to use the drafter's "
        f"{trained.as_list()}")
  return capture


# Per drafter, the targets it was checked against: ``{drafter: [(weakref to the target, weakrefs
# to its embedding and final-norm arrays, capture ids, the record object, vouched)]}`` (the last
# ``CHECKED_PER_DRAFTER``), so ``check_served`` costs a dictionary lookup once a pair is known.
# The arrays' weakrefs die when the target's weights are replaced (``nnx.update``). ``vouched``:
# the pairing itself was established (the drafter was initialised for the target, its record
# verified on it, or its probe found it agreeing with the target), not only served.
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
CHECKED_PER_DRAFTER = 4


def _target_key(target) -> tuple:
  return (weakref.ref(target), weakref.ref(target.embed_tokens[...]),
          weakref.ref(target.norm.weight[...]))


def _same_target(key: tuple, target) -> bool:
  ref, emb, norm = key
  return (ref() is target and emb() is target.embed_tokens[...]
          and norm() is target.norm.weight[...])


def mark_checked(drafter, target, *, vouched: bool = False) -> None:
  """Records that ``drafter`` was checked for ``target`` with its current capture and record
  (or created for it). ``drafter.capture_check_skipped`` says whether the check was skipped;
  ``vouched`` whether the check established the pairing (see ``vouched_for``)."""
  capture = drafter.config.capture.layer_ids
  record = getattr(drafter, "capture_record", None)
  entries = []
  for e in _CHECKED.get(drafter, []):
    if e[0][0]() is None:
      continue
    if _same_target(e[0], target) and e[1] == capture and e[2] is record:
      vouched = vouched or e[3]  # serving a vouched pair again keeps it vouched
      continue
    entries.append(e)
  entries.append((_target_key(target), capture, record, vouched))
  while len(entries) > CHECKED_PER_DRAFTER:  # the oldest served-only entry goes first
    drop = next((i for i, e in enumerate(entries) if not e[3]), 0)
    del entries[drop]
  _CHECKED[drafter] = entries


def vouched_for(drafter, target) -> bool:
  """Whether this drafter object, with its current capture, was initialised for ``target``,
  loaded or served for it with its record verified, or found agreeing with it by the probe
  (at a load, or at a save with ``target=``). Being served with it
  (``check_served``) is not enough for a drafter without a record: that checks only the
  embedding and that the capture is the loaded one."""
  capture = drafter.config.capture.layer_ids
  return any(_same_target(key, target) and ids == capture and vouched
             for key, ids, _, vouched in _CHECKED.get(drafter, []))


def check_served(target, drafter, where: str = "the drafter passed to generate") -> None:
  """At serving time: the drafter drafts for this very target (same object, same weights),
  with the capture and record it was checked with.

  * A drafter sharing the embedding must hold this target's table.
  * A drafter with a capture record that was checked against another target, other weights,
    another capture or another record is checked again (``verify_record``) on this one, unless
    ``load_drafter(verify_capture=False)`` opted out.
  * A drafter without a record whose capture changed since it was loaded or initialised is
    refused: nothing can check the new capture.
  """
  entries = _CHECKED.get(drafter, [])
  capture = drafter.config.capture
  record = getattr(drafter, "capture_record", None)
  for key, ids, rec, _ in entries:
    if _same_target(key, target) and ids == capture.layer_ids and rec is record:
      return
  if not drafter.own_embedding and drafter.embed_tokens is not target.embed_tokens:
    ours, theirs = (_embedding_rows(m, target.mesh) for m in (drafter, target))
    if not np.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * np.abs(theirs).max()):
      raise ValueError(
          f"{where} shares the token embedding of another target (the one it was loaded or "
          f"initialised for), not this target's: it would embed tokens with a table this "
          f"target does not use. Load (load_drafter) or initialise (init_drafter) it with "
          f"target= this target")
  vouched = False
  if record is not None:
    if not getattr(drafter, "capture_check_skipped", False):
      verify_record(record, target, capture, where=where,
                    hint="load it for this target with load_drafter(path, target=...)")
      vouched = True
  else:
    check_capture_unchanged(drafter, where)
  mark_checked(drafter, target, vouched=vouched)


def check_capture_unchanged(drafter, where: str) -> None:
  """A drafter without a capture record keeps the capture it was loaded or initialised with
  (or any it was served with since): nothing could check another. The loaded capture is also
  kept as an attribute (``capture_loaded_ids``), so copies (``nnx.clone``, ``split``/``merge``)
  are held to it too."""
  known = {ids for _, ids, _, _ in _CHECKED.get(drafter, [])}
  loaded = getattr(drafter, "capture_loaded_ids", None)
  if loaded is not None:
    known.add(tuple(loaded))
  capture = drafter.config.capture
  if known and capture.layer_ids not in known:
    raise ValueError(
        f"{where} has no capture record, and its capture was changed to {capture.as_list()} "
        f"after it was loaded or initialised with {[list(i) for i in sorted(known)]}: nothing "
        f"can check the new one. Load it again with the capture in its config.json "
        f"(aux_layer_convention if the ids are ambiguous), or initialise it with that capture")


def _embedding_rows(model, mesh) -> np.ndarray:
  """``[8, D]`` float32: 8 evenly spaced rows of a target's or drafter's token embedding."""
  table = model.embed_tokens[...]
  rows = np.linspace(0, table.shape[0] - 1, 8).astype(np.int32)
  with jax.set_mesh(mesh):
    out = table.at[rows].get(out_sharding=jax.sharding.PartitionSpec())
  return to_host(out).astype(np.float32)


# --- features --------------------------------------------------------------------------------

def every_layer(target) -> CaptureSpec:
  return CaptureSpec(tuple(range(EMBEDDING, target.num_layers)))


def layer_features(target, tokens, layers: Sequence[int] | None = None
                   ) -> tuple[dict[int, np.ndarray], np.ndarray]:
  """One forward through the engine's capture path capturing ``layers`` (default: the
  embedding and every layer): ``({id: [B, T, D] float32}, logits [B, T, V] float32)``."""
  from eagle3jax.api import forward  # pylint: disable=import-outside-toplevel
  tokens = np.asarray(tokens)
  if tokens.ndim == 1:
    tokens = tokens[None]
  spec = every_layer(target) if layers is None else CaptureSpec(tuple(sorted(set(layers))))
  out = forward(target, tokens, capture=spec)
  aux = to_host(out.aux_hidden).astype(np.float32)
  d = target.hidden_size
  feats = {i: aux[..., j * d:(j + 1) * d] for j, i in enumerate(spec.layer_ids)}
  return feats, to_host(out.logits).astype(np.float32)


def projection(dim: int, seed: int) -> np.ndarray:
  """The fixed Gaussian projection ``[dim, PROJECTION_DIM]`` of a record (from its seed)."""
  rng = np.random.default_rng([seed, dim])
  return (rng.standard_normal((dim, PROJECTION_DIM)) / math.sqrt(dim)).astype(np.float32)


def token_errors(recorded: np.ndarray, live: np.ndarray) -> float:
  """Median over tokens (position 0 excluded) of ``|live - rec| / |rec|``; ``[T, k]`` each."""
  rec, liv = recorded[1:], live[1:]
  err = np.linalg.norm(liv - rec, axis=-1) / np.maximum(np.linalg.norm(rec, axis=-1), 1e-12)
  out = float(np.median(err))
  return out if math.isfinite(out) else math.inf  # NaN must fail every "<= tol", and max()


def _final_norm(target) -> np.ndarray:
  return to_host(target.norm.weight[...]).astype(np.float32)


def _head_columns(target, ids, seed: int) -> np.ndarray:
  """``[T, PROJECTION_DIM]`` float32: the LM head's columns of tokens ``ids`` (the weights that
  score them) projected like the features, through the target's own ``lm_logits`` (tied or
  not, quantized or not, on any mesh): the projection's rows are the hidden states."""
  proj = projection(target.hidden_size, seed)                          # [D, k]
  with jax.set_mesh(target.mesh):
    x = shard(jnp.asarray(proj.T[None], target.dtype), (BATCH, SEQ, EMBED))
    logits = target.lm_logits(x)[0]                                    # [k, V]
    cols = logits.at[:, np.asarray(ids, np.int32)].get(
        out_sharding=jax.sharding.PartitionSpec())
  return to_host(cols).astype(np.float32).T


def target_fingerprint(target, seed: int = 0) -> dict:
  """A small JSON-able identity of a target's weights: sizes, and projections of its final-norm
  scale and of 8 embedding rows (robust to dtype and mesh; compared by ``same_fingerprint``)."""
  proj = projection(target.hidden_size, seed)
  emb = _embedding_rows(target, target.mesh)
  return {"num_layers": target.num_layers, "hidden_size": target.hidden_size,
          "vocab_size": target.config.vocab_size,
          "final_norm": np.round(_final_norm(target) @ proj, 6).tolist(),
          "embedding": np.round(emb @ proj, 6).tolist()}


def same_fingerprint(a: dict, b: dict) -> bool:
  if any(a.get(k) != b.get(k) for k in ("num_layers", "hidden_size", "vocab_size")):
    return False
  for key in ("final_norm", "embedding"):
    x, y = np.asarray(a[key], np.float32), np.asarray(b[key], np.float32)
    if x.shape != y.shape or np.linalg.norm(x - y) > FEATURE_TOL * max(np.linalg.norm(x),
                                                                       1e-12):
      return False
  return True


# --- the record ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CaptureRecord:
  """What a drafter was trained on, as stored in ``eagle3jax_record.json``.

  Attributes:
    capture: trained capture ids (project convention).
    calibration_ids: ``[T]`` token ids the features were taken at.
    seed: seed of the projection.
    features: per trained capture, ``[T, PROJECTION_DIM]`` projected target features.
    embedding: ``[T, PROJECTION_DIM]`` projected embedding rows of the calibration ids.
    final_norm: ``[PROJECTION_DIM]`` projected final-norm scale of the target.
    acceptance: held-out greedy acceptance length per tree shape ``"steps,topk,tokens"``.
    target_layers: number of layers of the target.
    lm_head: ``[T, PROJECTION_DIM]`` projected LM-head columns of the calibration ids (the
      weights that score those tokens; the embedding's for a tied head). Empty in records
      written before it was recorded: their head is not checked.
    weights: digest (``weights_digest``) of the drafter weights the record was written with,
      so a record left beside weights another tool wrote over is refused. Empty in records
      written before it was recorded (and in records not yet written to a folder).
    weights_embedding: whether the digest covers the token embedding (the drafter owned it);
      otherwise the file's embedding, if any, was the target's table.
  """
  capture: tuple[int, ...]
  calibration_ids: tuple[int, ...]
  seed: int
  features: tuple
  embedding: tuple
  final_norm: tuple
  acceptance: tuple = ()
  target_layers: int = 0
  lm_head: tuple = ()
  weights: str = ""
  weights_embedding: bool = False

  def acceptance_for(self, steps: int, topk: int, tokens: int) -> float | None:
    return dict(self.acceptance).get(tree_key(steps, topk, tokens))

  def with_acceptance(self, acceptance: dict) -> "CaptureRecord":
    merged = dict(self.acceptance)
    merged.update({k: float(v) for k, v in acceptance.items()})
    return dataclasses.replace(self, acceptance=tuple(sorted(merged.items())))

  def to_json(self) -> dict:
    r = lambda a: np.round(np.asarray(a, np.float64), 6).tolist()  # noqa: E731
    return {"version": RECORD_VERSION, "capture": list(self.capture),
            "convention": "output", "target_layers": self.target_layers,
            "calibration_ids": list(self.calibration_ids), "projection_seed": self.seed,
            "projection_dim": PROJECTION_DIM,
            "features": {str(i): r(f) for i, f in zip(self.capture, self.features)},
            "target_fingerprint": {"embedding": r(self.embedding),
                                   "final_norm": r(self.final_norm),
                                   **({"lm_head": r(self.lm_head)} if self.lm_head else {})},
            "heldout_acceptance": dict(self.acceptance),
            **({"weights_digest": self.weights,
                "weights_digest_embedding": self.weights_embedding} if self.weights else {})}

  @classmethod
  def from_json(cls, d: dict, where: str) -> "CaptureRecord":
    try:
      if not isinstance(d, dict):
        raise ValueError("it is not a JSON object")
      if d.get("version") != RECORD_VERSION:
        raise ValueError(f"version {d.get('version')!r}, expected {RECORD_VERSION}")
      if d.get("convention", "output") != "output":
        raise ValueError(f"convention {d.get('convention')!r}; records use 'output'")
      if d.get("projection_dim", PROJECTION_DIM) != PROJECTION_DIM:
        raise ValueError(f"projection_dim {d.get('projection_dim')!r}, expected "
                         f"{PROJECTION_DIM}")
      capture = CaptureSpec(tuple(_json_int(i, "capture id") for i in d["capture"])).layer_ids
      ids = tuple(_json_int(t, "calibration id", 0) for t in d["calibration_ids"])
      if len(ids) < 4:
        raise ValueError(f"{len(ids)} calibration ids; a record has at least 4")
      seed = _json_int(d["projection_seed"], "projection_seed", 0)
      layers = _json_int(d.get("target_layers", 0), "target_layers", 0)
      if layers and capture[-1] >= layers:
        raise ValueError(f"capture {list(capture)} beyond its target_layers={layers}")
      fp = d["target_fingerprint"]
      feats = tuple(_json_array(d["features"][str(i)], (len(ids), PROJECTION_DIM),
                                f"features of capture {i}") for i in capture)
      emb = _json_array(fp["embedding"], (len(ids), PROJECTION_DIM), "embedding")
      norm = _json_array(fp["final_norm"], (PROJECTION_DIM,), "final_norm")
      head = (_json_array(fp["lm_head"], (len(ids), PROJECTION_DIM), "lm_head")
              if "lm_head" in fp else None)
      acceptance = d.get("heldout_acceptance", {})
      if not isinstance(acceptance, dict):
        raise ValueError("heldout_acceptance is not a JSON object")
      for k, v in acceptance.items():
        check_acceptance(k, v)
      acceptance = {k: float(v) for k, v in acceptance.items()}
      weights = d.get("weights_digest", "")
      if not (isinstance(weights, str) and re.fullmatch(r"([0-9a-f]{64})?", weights)):
        raise ValueError(f"weights_digest {weights!r} is not 64 hex digits")
      weights_embedding = d.get("weights_digest_embedding", False)
      if not isinstance(weights_embedding, bool):
        raise ValueError(f"weights_digest_embedding {weights_embedding!r} is not true or false")
      return cls(capture, ids, seed, tuple(tuple(map(tuple, f.tolist())) for f in feats),
                 tuple(map(tuple, emb.tolist())), tuple(norm.tolist()),
                 tuple(sorted(acceptance.items())), layers,
                 () if head is None else tuple(map(tuple, head.tolist())), weights,
                 weights_embedding)
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as e:
      why = f"missing field {e}" if isinstance(e, KeyError) else str(e)
      raise ValueError(f"{where} is not a valid eagle3jax capture record ({why}); delete it to "
                       "load the drafter with the probe instead") from None


# A shared token embedding is not in the digest: it is the target's table (checked against
# the target on load and when served), and engines that share it drop it from the file. A
# drafter's own embedding is one of its weights and is digested.
EMBEDDING_WEIGHT = "embed_tokens.weight"


def tensor_digest(array: np.ndarray) -> str:
  """Digest of one stored tensor: its dtype, shape and bytes."""
  array = np.ascontiguousarray(array)
  h = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
  h.update(array.view(np.uint8).reshape(-1) if array.size else b"")
  return h.hexdigest()


def weights_digest(tensor_digests: dict[str, str], *, own_embedding: bool) -> str:
  """Digest of a drafter file's weights from ``{name: tensor_digest}``, the token embedding
  included only when the drafter owns it: what ``CaptureRecord.weights`` holds."""
  h = hashlib.sha256()
  names = set(tensor_digests) - (set() if own_embedding else {EMBEDDING_WEIGHT})
  for name in sorted(names):
    h.update(f"{name}={tensor_digests[name]};".encode())
  return h.hexdigest()


def check_weights(record: CaptureRecord, digest: str, where: str) -> None:
  """Refuses a record written with other weights than the ones it sits beside."""
  if record.weights and record.weights != digest:
    raise ValueError(
        f"{where}: its capture record ({RECORD_FILE}) was written with other weights than "
        f"the folder's safetensors now hold (weights digest {record.weights[:12]}... recorded, "
        f"{digest[:12]}... found): the drafter was re-exported over it by another tool or "
        f"copied in by hand, and the record would vouch for weights it never saw. Delete "
        f"{RECORD_FILE} to load the drafter with the probe instead (then save_drafter(..., "
        f"target=...) takes a record of these weights if the probe agrees)")


def check_acceptance(key, value) -> None:
  """Raises ``ValueError`` unless ``{key: value}`` is a held-out acceptance entry: a tree shape
  ``"steps,topk,tokens"`` and an acceptance length from 1 to ``steps + 1`` (a round emits at
  most every drafted token and the bonus). An impossible value would make the live monitor warn
  on every correct pair."""
  m = re.fullmatch(r"(\d+),(\d+),(\d+)", key) if isinstance(key, str) else None
  steps = int(m.group(1)) if m else 0
  if (m is None or steps < 1 or int(m.group(2)) < 1 or int(m.group(3)) < 2
      or isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number))
      or not 1 <= value <= steps + 1):
    raise ValueError(f"heldout_acceptance {{{key!r}: {value!r}}}: keys are 'steps,topk,tokens' "
                     "(steps and topk >= 1, tokens >= 2) and values acceptance lengths from 1 "
                     "to steps + 1")


def _json_int(x, what: str, low: int | None = None) -> int:
  if isinstance(x, bool) or not isinstance(x, int):
    raise ValueError(f"{what} {x!r} is not an integer")
  if low is not None and x < low:
    raise ValueError(f"{what} {x} is below {low}")
  return x


def _json_array(x, shape: tuple, what: str) -> np.ndarray:
  a = np.asarray(x)
  if a.dtype.kind not in "iuf":
    raise ValueError(f"{what} holds {a.dtype.name} values, not numbers")
  if a.shape != shape:
    raise ValueError(f"{what} has shape {list(a.shape)}, expected {list(shape)} (calibration "
                     f"tokens x {PROJECTION_DIM})")
  if not np.isfinite(a).all():
    raise ValueError(f"{what} holds NaN or Inf")
  return a.astype(np.float32)


def tree_key(steps: int, topk: int, tokens: int) -> str:
  return f"{steps},{topk},{tokens}"


def default_calibration_ids(target, drafter=None, seed: int = 0) -> np.ndarray:
  """Seeded ids, drawn from the drafter's draft vocabulary (mapped to target ids) if given."""
  rng = np.random.default_rng([seed, 17])
  if drafter is not None:
    d2t = to_host(drafter.d2t[...])
    pool = np.arange(len(d2t)) + d2t
  else:
    pool = np.arange(target.config.vocab_size)
  return rng.choice(pool, CALIBRATION_TOKENS, replace=len(pool) < CALIBRATION_TOKENS)


def make_record(target, capture: CaptureSpec, calibration_ids, *, seed: int = 0,
                acceptance: dict | None = None) -> CaptureRecord:
  """Records the features of ``target`` at ``calibration_ids`` for ``capture``."""
  ids = np.asarray(calibration_ids, np.int64).reshape(-1)[:CALIBRATION_TOKENS]
  if len(ids) < 4:
    raise ValueError(f"calibration ids need at least 4 tokens; got {len(ids)}")
  feats, _ = layer_features(target, ids.astype(np.int32), (EMBEDDING,) + capture.layer_ids)
  proj = projection(target.hidden_size, seed)
  captured = tuple(feats[i][0] @ proj for i in capture.layer_ids)
  record = CaptureRecord(capture.layer_ids, tuple(int(t) for t in ids), seed,
                         tuple(tuple(map(tuple, c.tolist())) for c in captured),
                         tuple(map(tuple, (feats[EMBEDDING][0] @ proj).tolist())),
                         tuple((_final_norm(target) @ proj).tolist()), (),
                         target.num_layers,
                         tuple(map(tuple, _head_columns(target, ids, seed).tolist())))
  return record.with_acceptance(acceptance or {})


def write_record(path: str, record: CaptureRecord) -> None:
  for k, v in record.acceptance:  # what read_record would refuse is not written
    check_acceptance(k, v)
  tmp = os.path.join(path, RECORD_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump(record.to_json(), f, indent=1)
  os.replace(tmp, os.path.join(path, RECORD_FILE))


def read_record(path: str) -> CaptureRecord | None:
  file = os.path.join(path, RECORD_FILE)
  if not os.path.exists(file):
    return None
  with open(file) as f:
    try:
      data = json.load(f)
    except (ValueError, RecursionError) as e:
      raise ValueError(f"{file} is not valid JSON ({type(e).__name__}: {e})") from None
  return CaptureRecord.from_json(data, file)


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What ``compare_record`` found: per recorded capture, the error against each searched
  layer (``errors[j][layer]``), and the target fingerprint's errors."""
  errors: tuple[dict[int, float], ...]
  embedding_error: float
  norm_error: float
  head_error: float = 0.0  # 0 for a record without the LM head

  def best(self) -> list[int]:
    return [min(e, key=e.get) for e in self.errors]

  def matches(self, j: int, layer: int) -> bool:
    e = self.errors[j]
    return layer in e and e[layer] <= FEATURE_TOL and e[layer] <= NEAR_BEST * min(
        e.values()) + 1e-3

  @property
  def same_target(self) -> bool:
    return (self.embedding_error <= FEATURE_TOL and self.norm_error <= FEATURE_TOL
            and self.head_error <= FEATURE_TOL
            and all(min(e.values()) <= FEATURE_TOL for e in self.errors))


def compare_record(record: CaptureRecord, target, layers: Sequence[int] | None = None
                   ) -> Verdict:
  """Recomputes the recorded features on ``target`` at ``layers`` (default: the embedding and
  every layer) with one forward."""
  ids = np.asarray(record.calibration_ids, np.int32)
  searched = list(range(EMBEDDING, target.num_layers)) if layers is None else sorted(
      set(layers) | {EMBEDDING})
  if ids.max() >= target.config.vocab_size:
    inf = {i: math.inf for i in searched}
    return Verdict(tuple(inf for _ in record.capture), math.inf, math.inf, math.inf)
  feats, _ = layer_features(target, ids, searched)
  broken = [i for i, f in feats.items() if not np.isfinite(f).all()]
  if broken:
    raise ValueError(f"the target's hidden states at layers {broken} (-1 = embedding) hold NaN "
                     f"or Inf on the capture record's calibration tokens: its weights are "
                     f"broken, so no drafter can be checked against (or served with) it")
  proj = projection(target.hidden_size, record.seed)
  live = {i: f[0] @ proj for i, f in feats.items()}             # [T, k] each
  errors = tuple({i: token_errors(np.asarray(rec, np.float32), p) for i, p in live.items()}
                 for rec in record.features)
  emb = token_errors(np.asarray(record.embedding, np.float32), live[EMBEDDING])
  rec_norm = np.asarray(record.final_norm, np.float32)
  norm = float(np.linalg.norm(_final_norm(target) @ proj - rec_norm)
               / max(np.linalg.norm(rec_norm), 1e-12))
  head = (token_errors(np.asarray(record.lm_head, np.float32),
                       _head_columns(target, ids, record.seed)) if record.lm_head else 0.0)
  return Verdict(errors, emb, norm if math.isfinite(norm) else math.inf, head)


LOAD_HINT = "verify_capture=False skips this check"


def verify_record(record: CaptureRecord, target, configured: CaptureSpec, *,
                  where: str = "the drafter", hint: str = LOAD_HINT) -> str:
  """Raises ValueError unless ``configured`` captures what the record was trained on.

  Fast path: one forward capturing only the configured layers, their neighbours and the
  embedding; when each configured layer is within ``FAST_TOL`` of its recorded features and
  is its neighbourhood's match (``Verdict.matches``) the check passes. Otherwise one forward
  capturing every layer finds which layers the recorded features are, for the message (and
  passes a configured capture that is the best match within ``FEATURE_TOL``, as a quantised
  target may need).
  """
  if record.target_layers and record.target_layers != target.num_layers:
    raise ValueError(
        f"{where} was not trained on this target: its record was taken on a target with "
        f"{record.target_layers} layers, this one has {target.num_layers}")
  top = max(record.calibration_ids)
  if top >= target.config.vocab_size:
    raise ValueError(
        f"{where} was not trained on this target: its record's calibration tokens go up to id "
        f"{top}, beyond this target's vocab_size={target.config.vocab_size} (a target with a "
        f"larger vocabulary took it). Use the target it was trained for, or retrain it on this "
        f"one ({hint})")
  same_len = len(configured.layer_ids) == len(record.capture)
  if same_len:
    # The configured layers and their neighbours: a neighbour that matches as well (a layer
    # whose update is small) sends the check to the every-layer search below.
    near = {n for c in configured.layer_ids for n in (c - 1, c, c + 1)
            if EMBEDDING <= n < target.num_layers}
    fast = compare_record(record, target, sorted(near))
    worst = max(e[c] for e, c in zip(fast.errors, configured.layer_ids))
    if (worst <= FAST_TOL and fast.embedding_error <= FEATURE_TOL
        and fast.norm_error <= FEATURE_TOL and fast.head_error <= FEATURE_TOL
        and all(fast.matches(j, c) for j, c in enumerate(configured.layer_ids))):
      return f"capture record verified (largest feature error {worst:.4f} <= {FAST_TOL})"
  verdict = compare_record(record, target)
  if not verdict.same_target:
    raise ValueError(
        f"{where} was not trained on this target: its record (features at calibration tokens "
        f"{list(record.calibration_ids[:6])}..., embedding, final norm and LM head) does not "
        f"match this target (closest relative errors of the captures "
        f"{[round(min(e.values()), 3) for e in verdict.errors]}, embedding "
        f"{verdict.embedding_error:.3f}, final norm {verdict.norm_error:.3f}, LM head "
        f"{verdict.head_error:.3f}; tolerance "
        f"{FEATURE_TOL}). Use the target it was trained for, or retrain it on this one "
        f"({hint})")
  best = verdict.best()
  if not same_len or not all(verdict.matches(j, c) for j, c in enumerate(configured.layer_ids)):
    raise ValueError(
        f"{where} is configured to capture target layers {configured.as_list()} (project "
        f"convention: output of layer i, -1 = embedding), but the features it was trained on "
        f"are those of layers {best} of this target (recorded capture "
        f"{list(record.capture)}; every layer and the embedding were searched). Serving other "
        f"hidden states than the training data silently destroys acceptance: fix "
        f"eagle_config.{IDS_KEY} to {best} with aux_layer_convention 'output' "
        f"({hint})")
  worst = max(verdict.errors[j][c] for j, c in enumerate(configured.layer_ids))
  return (f"capture record verified on every layer (largest feature error {worst:.4f} <= "
          f"{FEATURE_TOL}, the best match of each capture)")


# --- the probe -------------------------------------------------------------------------------

def probe_sequences(target, drafter, seed: int = 0) -> np.ndarray:
  """Calibration prompts (seeded draft-vocab ids) continued greedily by the target:
  ``[PROBE_PROMPTS, PROBE_PROMPT_LEN + PROBE_NEW_TOKENS]``."""
  from eagle3jax.generate import generate  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng([seed, 23])
  d2t = to_host(drafter.d2t[...])
  pool = np.arange(len(d2t)) + d2t
  prompts = rng.choice(pool, (PROBE_PROMPTS, PROBE_PROMPT_LEN)).tolist()
  out = generate(target, None, prompts, max_new_tokens=PROBE_NEW_TOKENS, eos_ids=[])
  n = PROBE_PROMPT_LEN + min(len(t) for t in out.tokens)
  return np.asarray([(p + t)[:n] for p, t in zip(prompts, out.tokens)], np.int32)


def probe_capture(target, drafter, readings: dict[str, CaptureSpec], seed: int = 0
                  ) -> dict[str, float]:
  """Top-1 agreement of the drafter with the target's greedy next token under each reading.

  Position ``s`` feeds the features at ``s`` and the token ``s + 1`` (as in training) and is
  right when ``d2t(argmax)`` equals the target's argmax at ``s + 1``; only positions of the
  greedy continuation count. Costs one generate of ``PROBE_PROMPTS`` prompts, one forward
  capturing every layer and one drafter pass per reading.
  """
  from eagle3jax.drafter_io import draft_logits  # pylint: disable=import-outside-toplevel
  seqs = probe_sequences(target, drafter, seed)
  layers = sorted({i for spec in readings.values() for i in spec.layer_ids})
  feats, logits = layer_features(target, seqs, layers)
  want = logits.argmax(-1)[:, 1:]                                # target's next at s + 1
  d2t = to_host(drafter.d2t[...])
  start = PROBE_PROMPT_LEN - 1
  scores = {}
  width = drafter.config.capture.width(drafter.config.feature_size)
  for name, spec in readings.items():
    if spec.width(target.hidden_size) != width:
      continue
    aux = np.concatenate([feats[i] for i in spec.layer_ids], axis=-1)[:, :-1]
    dl = to_host(draft_logits(drafter, seqs[:, 1:], aux))
    got = dl.argmax(-1)
    got = got + d2t[got]
    scores[name] = float((got[:, start:] == want[:, start:]).mean())
  return scores


class CaptureWarning(UserWarning):
  """A drafter without a capture record agrees with the target's greedy tokens almost never
  under every reading of its capture: it was probably trained for another target."""


def judge_probe(scores: dict[str, float], readings: dict[str, CaptureSpec], chosen: str,
                *, where: str = "the drafter") -> str:
  """Refuses ``chosen`` when another reading scores far higher, and warns when even the best
  is near none (``PROBE_FLOOR``); returns an explanation."""
  best = max(scores, key=scores.get)
  mine = scores[chosen]
  top = scores[best]
  if top < PROBE_FLOOR:
    warnings.warn(
        f"{where} has no capture record, and under every reading of its capture it predicts "
        f"the target's next token at most {top:.2f} of the time ("
        + ", ".join(dict.fromkeys(f"{readings[k].as_list()}: {v:.2f}"
                                  for k, v in scores.items()))
        + "; a drafter trained on this target scores about 0.7): it was very likely trained "
        "for another target, or not trained. Decoding stays correct but gains nothing; use "
        "the target it was trained for, or retrain it on this one", CaptureWarning,
        stacklevel=checks.outside_stacklevel())
  if best != chosen and readings[best] != readings[chosen] and (
      mine < PROBE_RATIO * top and mine < top - PROBE_MARGIN):
    raise ValueError(
        f"{where} has no capture record, so its capture was probed: configured target layers "
        f"{readings[chosen].as_list()} ({chosen!r} reading) give top-1 agreement {mine:.2f} "
        f"with the target's greedy tokens, but {readings[best].as_list()} ({best!r}) give "
        f"{top:.2f}. The configured list is very likely not what the drafter was trained on; "
        f"fix eagle_config.{IDS_KEY} (or aux_layer_convention), or pass verify_capture=False "
        f"if you know better")
  return "probed top-1 agreement " + ", ".join(
      f"{k} {readings[k].as_list()}: {v:.2f}" for k, v in scores.items())
