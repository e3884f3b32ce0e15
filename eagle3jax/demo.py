"""The embedded demo: a target and an EAGLE-3 drafter trained here from an offline corpus.

Corpus: the Python standard library's own source files, which every Python install has. A
fixed manifest (``models/default/manifest.json``) lists the files and splits them into train
and held-out sets by a hash of the path (never overlapping). ``make_demo`` reproduces the
shipped folder from scratch: BPE tokenizer (``tokenizers``), a 12-layer Llama target trained
with optax, and a drafter trained with ``eagle3jax.training`` on the target's own greedy
continuations. Everything is stored in bfloat16.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sysconfig
import time
import warnings
import zlib

import numpy as np

from eagle3jax import checks
from eagle3jax.flags import parse_ints
from eagle3jax.semantics import standard_numpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = os.path.join(REPO, "models", "default")
EOS = "<|endoftext|>"
_SKIP_TOP = {"test", "site-packages", "idlelib", "tkinter", "lib2to3", "turtledemo",
             "ensurepip", "__pycache__"}


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def build_manifest(heldout_mod: int = 10) -> dict:
  """All stdlib ``.py`` files outside tests/GUI/vendored folders, split by a path hash."""
  root = stdlib_root()
  files = []
  for d, dirs, names in os.walk(root):
    rel = os.path.relpath(d, root)
    parts = [] if rel == "." else rel.split(os.sep)
    if (parts and (parts[0] in _SKIP_TOP or parts[0].startswith("config-"))) or \
        "tests" in parts or "__pycache__" in parts:
      dirs[:] = []
      continue
    files += [os.path.join(*parts, n) if parts else n for n in names if n.endswith(".py")]
  files.sort()
  heldout = [f for f in files if zlib.crc32(f.encode()) % heldout_mod == 0]
  train = [f for f in files if zlib.crc32(f.encode()) % heldout_mod != 0]
  return {"corpus": "python-stdlib", "split": f"crc32(path) % {heldout_mod} == 0 is held out",
          "python": _python(), "train": train, "heldout": heldout,
          "train_digest": corpus_digest(read_files(train)),
          "heldout_digest": corpus_digest(read_files(heldout))}


def _python() -> str:
  return platform.python_version()  # patch releases change stdlib files too


def corpus_digest(texts: list[str]) -> str:
  """A digest of the files' contents, in order: what the manifest's split read here."""
  h = hashlib.sha256()
  for t in texts:
    b = t.encode("utf-8", errors="replace")
    h.update(len(b).to_bytes(8, "little") + b)
  return h.hexdigest()[:16]


def read_split(manifest: dict, split: str) -> list[str]:
  """The manifest's ``split`` ("train" or "heldout") read from this interpreter's stdlib.
  Warns when they are not the files the manifest was built from (another Python version's
  stdlib: files missing or changed), since prompts drawn from them then differ from those the
  demo's figures (README, the drafter's record) were measured on."""
  paths = manifest[split]
  texts = read_files(paths)
  digest = manifest.get(f"{split}_digest")
  if digest and corpus_digest(texts) != digest:
    root = stdlib_root()
    missing = sum(not os.path.exists(os.path.join(root, p)) for p in paths)
    warnings.warn(
        f"the manifest's {split} files as read from {root} (Python {_python()}) differ from "
        f"those it was built from (Python {manifest.get('python', '?')}): {missing} of "
        f"{len(paths)} missing, the rest not all the same; prompts drawn from them differ, so "
        "acceptance measured on them will not match the README's or the drafter's record",
        stacklevel=2)
  return texts


def read_files(paths: list[str]) -> list[str]:
  """Reads manifest files from this interpreter's stdlib (missing ones are skipped)."""
  root = stdlib_root()
  texts = []
  for p in paths:
    full = os.path.join(root, p)
    if os.path.exists(full):
      with open(full, encoding="utf-8", errors="replace") as f:
        texts.append(f.read())
  if not texts:
    raise ValueError(f"none of the manifest's {len(paths)} files exist under {root}")
  return texts


def train_tokenizer(texts: list[str], vocab_size: int):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return tok


def encode_corpus(tok, texts: list[str]) -> np.ndarray:
  eos = tok.token_to_id(EOS)
  ids = []
  for enc in tok.encode_batch(texts):
    ids.extend(enc.ids)
    ids.append(eos)
  return np.asarray(ids, np.int32)


def prompts_with_sources(tok, texts: list[str], n: int, length: int, seed: int
                         ) -> tuple[list[list[int]], list[int]]:
  """``n`` prompts of ``length`` tokens, each starting at a random line of a random file, and
  the index in ``texts`` of each one's file (prompts of one file are not independent:
  ``acceptance_stats``' ``groups``)."""
  rng = np.random.default_rng(seed)
  out, sources = [], []
  while len(out) < n:
    source = int(rng.integers(len(texts)))
    lines = texts[source].splitlines(keepends=True)
    if len(lines) < 4:
      continue
    start = int(rng.integers(len(lines) - 2))
    ids = tok.encode("".join(lines[start:start + 60])).ids
    if len(ids) >= length:
      out.append(ids[:length])
      sources.append(source)
  return out, sources


def prompts_from(tok, texts: list[str], n: int, length: int, seed: int) -> list[list[int]]:
  """``n`` prompts of ``length`` tokens, each starting at a random line of a random file."""
  return prompts_with_sources(tok, texts, n, length, seed)[0]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Attributes: sizes and budgets of the demo (defaults: the shipped models)."""
  vocab_size: int = 8192
  hidden_size: int = 256
  intermediate_size: int = 704
  num_layers: int = 12
  num_heads: int = 4
  max_position_embeddings: int = 1024
  lm_steps: int = 560
  lm_seconds: float = 2520.0
  lm_batch: int = 16
  lm_seq_len: int = 256
  lm_lr: float = 3e-3
  draft_vocab_size: int = 1024
  draft_prompts: int = 6144
  prompt_len: int = 48
  response_len: int = 96
  draft_steps: int = 3500
  draft_lr: float = 2e-3
  draft_batch: int = 8
  ttt_steps: int = 7
  draft_intermediate_size: int = 0
  draft_num_heads: int = 16
  draft_head_dim: int = 0
  draft_head_init: str = "random"
  draft_label_temperature: float = 0.0
  draft_step_decay: float = 0.8
  draft_align_topk: int = 0
  draft_capture: str = ""
  draft_cache_features: bool = True
  heldout_every: int = 100
  seed: int = 0

  def __post_init__(self):
    """Refuses sizes and budgets that could not build the demo, at once: a bad value used to
    fail (or train on nothing, or diverge) after the tokenizer and the target's 42 minutes.
    The drafter's fields are checked further by ``check_drafter_recipe``."""
    checks.int_fields(self, (
        "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
        "max_position_embeddings", "lm_steps", "lm_batch", "lm_seq_len", "draft_vocab_size",
        "draft_prompts", "prompt_len", "response_len", "draft_steps", "draft_batch",
        "ttt_steps"), 1, "DemoConfig")
    checks.int_fields(self, ("draft_intermediate_size", "draft_num_heads", "draft_head_dim",
                             "draft_align_topk", "heldout_every", "seed"), 0, "DemoConfig")
    for name in ("lm_seconds", "lm_lr", "draft_lr", "draft_label_temperature",
                 "draft_step_decay"):
      value = getattr(self, name)
      if not checks.is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"DemoConfig {name}={value!r} must be a finite number >= 0")
    for name, length in (("lm_seq_len", self.lm_seq_len),
                         ("prompt_len + response_len", self.prompt_len + self.response_len)):
      if length > self.max_position_embeddings:
        raise ValueError(f"DemoConfig {name}={length} exceeds max_position_embeddings="
                         f"{self.max_position_embeddings}")
    if not isinstance(self.draft_cache_features, bool):
      raise ValueError(f"DemoConfig draft_cache_features={self.draft_cache_features!r} must be "
                       "True or False")
    lm_train_config(self)  # learning rate, steps, warmup


def lm_train_config(cfg: DemoConfig):
  """The target's pre-training recipe (``training.lm.LMTrainConfig``) of a demo config."""
  from eagle3jax.training.lm import LMTrainConfig  # pylint: disable=import-outside-toplevel
  return LMTrainConfig(learning_rate=cfg.lm_lr, total_steps=cfg.lm_steps,
                       batch_size=cfg.lm_batch, seq_len=cfg.lm_seq_len, seed=cfg.seed,
                       max_seconds=cfg.lm_seconds, warmup_steps=min(50, cfg.lm_steps // 5))


def make_demo(out_dir: str = DEFAULT_DIR, cfg: DemoConfig = DemoConfig(),
              log=print) -> list[dict]:
  """Builds ``out_dir/{manifest.json, target/, drafter/}`` from scratch; returns the drafter's
  learning curve (``make_drafter``)."""
  import jax.numpy as jnp
  import eagle3jax
  from eagle3jax.hf_export import save_target
  from eagle3jax.training.lm import train_lm

  t_start = time.perf_counter()
  os.makedirs(out_dir, exist_ok=True)
  target_dir = os.path.join(out_dir, "target")
  manifest = build_manifest()
  with open(os.path.join(out_dir, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  train_texts = read_split(manifest, "train")
  log(f"corpus: {len(manifest['train'])} train files, {len(manifest['heldout'])} held out")

  tok = train_tokenizer(train_texts, cfg.vocab_size)
  os.makedirs(target_dir, exist_ok=True)
  tok.save(os.path.join(target_dir, "tokenizer.json"))
  stream = encode_corpus(tok, train_texts)
  log(f"tokenizer: {tok.get_vocab_size()} tokens; train stream {len(stream)} tokens")

  eos = tok.token_to_id(EOS)
  tcfg = target_config(cfg, tok.get_vocab_size(), eos_token_ids=(eos,))
  target = eagle3jax.init_target(tcfg, dtype=jnp.float32, seed=cfg.seed, std=0.02)
  lm_cfg = lm_train_config(cfg)

  def lm_log(step, loss, seconds):
    if step % 25 == 0:
      log(f"target step {step}: loss {loss:.3f} ({seconds:.0f} s)")

  losses = train_lm(target, stream, lm_cfg, lm_log)
  log(f"target: {len(losses)} steps, loss {losses[0]:.3f} -> {np.mean(losses[-20:]):.3f}")
  save_target(target, target_dir)
  curve = make_drafter(out_dir, cfg, log=log, train_texts=train_texts)
  log(f"done in {time.perf_counter() - t_start:.0f} s")
  return curve


# The held-out prompts the benchmark and the drafter's recorded acceptance use.
HELDOUT = dict(n=8, length=48, seed=1234)
HELDOUT_NEW_TOKENS = 128


def read_manifest(out_dir: str, hint: str = "pass such a folder, e.g. models/default") -> dict:
  """``out_dir/manifest.json`` of a demo folder (``make_demo`` writes it beside ``target/``),
  or a ``ValueError`` that says what is expected there and, in ``hint``, what to pass (a
  caller given the target folder says so)."""
  path = os.path.join(out_dir, "manifest.json")
  if not os.path.exists(path):
    raise ValueError(f"{out_dir!r} has no manifest.json: held-out and training prompts come "
                     "from a demo folder (manifest.json beside target/ and drafter/, as "
                     f"make_demo.py writes it); {hint}")
  try:
    with open(path) as f:
      manifest = json.load(f)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from None
  if not isinstance(manifest, dict) or not {"train", "heldout"} <= set(manifest):
    raise ValueError(f"{path} must be a JSON object with 'train' and 'heldout' file lists")
  return manifest


def heldout_prompts_with_sources(out_dir: str, tok, n: int = HELDOUT["n"],
                                 seed: int = HELDOUT["seed"], *,
                                 hint: str = "pass such a folder, e.g. models/default"
                                 ) -> tuple[list[list[int]], list[int]]:
  """``n`` prompts of the held-out files (the default: the 8 the curves and records use) and
  the file of each, its index among the held-out files read (the manifest's list, when none is
  missing); ``hint`` as in ``read_manifest``."""
  return prompts_with_sources(tok, read_split(read_manifest(out_dir, hint), "heldout"), n,
                              HELDOUT["length"], seed)


def heldout_prompts(out_dir: str, tok, n: int = HELDOUT["n"],
                    seed: int = HELDOUT["seed"], *,
                    hint: str = "pass such a folder, e.g. models/default") -> list[list[int]]:
  """``n`` prompts of the held-out files (the default: the 8 the curves and records use);
  ``hint`` as in ``read_manifest``."""
  return heldout_prompts_with_sources(out_dir, tok, n, seed, hint=hint)[0]


def load_demo_target(out_dir: str):
  """``(target, tokenizer)`` of ``out_dir/target`` as the demo trains and measures on it:
  float32, the default layer loop."""
  import jax.numpy as jnp
  import eagle3jax
  from eagle3jax.stack import default_layer_loop
  from eagle3jax.text import TextCodec
  target_dir = os.path.join(out_dir, "target")
  target = eagle3jax.load_target(target_dir, dtype=jnp.float32,
                                 layer_loop=default_layer_loop())
  return target, TextCodec(target_dir).tokenizer


@dataclasses.dataclass(frozen=True)
class DrafterComparison:
  """``compare_drafters``' result.

  Attributes:
    measured: ``{drafter_dir: {"steps,topk,tokens": acceptance_stats.PromptAcceptance}}``,
      the greedy rounds and accepted tokens of every prompt (``.length`` pools them).
    sources: ``[P]`` the held-out file of each prompt (its index among the held-out files
      read): prompts of one file are resampled together.
  """
  measured: dict
  sources: tuple[int, ...]

  def summary(self, level: float | None = None) -> dict:
    """The numbers: per drafter and shape the pooled acceptance length (``"acceptance"``; a
    shape where no prompt ran a round has none), its bootstrap interval (``"interval"``,
    ``[low, high]``), and for every drafter after the first its paired difference from the
    first on the same prompts (``"difference"``: ``{"against", "difference", "low",
    "high"}``), both resampling the held-out files (``acceptance_stats``, ``groups``;
    ``level``: ``acceptance_stats.DEFAULT_LEVEL`` unless given); ``"files"``: how many files
    the prompts came from. Where the prompts that ran a round came from fewer than 2 files,
    a shape has no interval and no difference."""
    from eagle3jax import acceptance_stats as st
    level = st.DEFAULT_LEVEL if level is None else level
    first = next(iter(self.measured))
    out = {"level": level, "files": len(set(self.sources)), "acceptance": {}, "interval": {},
           "difference": {}}

    def files_with_rounds(*ms):
      return st.sources_with_rounds(*ms, groups=self.sources)

    for d, shapes in self.measured.items():
      out["acceptance"][d] = {k: round(m.length, 4) for k, m in shapes.items()
                              if m.length is not None}
      intervals = {k: [round(x, 4) for x in st.interval(m, groups=self.sources, level=level)]
                   for k, m in shapes.items() if files_with_rounds(m) >= 2}
      if intervals:
        out["interval"][d] = intervals
      if d == first:
        continue
      diffs = {}
      for k, m in shapes.items():
        base = self.measured[first].get(k)
        if base is None or files_with_rounds(m, base) < 2:
          continue
        diff, low, high = st.paired_difference(m, base, groups=self.sources, level=level)
        diffs[k] = {"against": first, "difference": round(diff, 4), "low": round(low, 4),
                    "high": round(high, 4)}
      if diffs:
        out["difference"][d] = diffs
    for key in ("interval", "difference"):
      if not out[key]:
        del out[key]
    return out


@standard_numpy
def compare_drafters(out_dir: str, drafter_dirs: list[str], *, num_prompts: int = 64,
                     seed: int = 99, shapes=((7, 1, 8), (5, 4, 8)), max_new_tokens: int = 128,
                     batch_size: int = 8, loaded=None, log=print) -> DrafterComparison:
  """Greedy rounds and accepted tokens per prompt, per tree shape, of each drafter for
  ``out_dir/target`` on ``num_prompts`` held-out prompts drawn with ``seed``: a larger sample
  than the 8 prompts of the learning curves, which were off the 64-prompt figure by up to 0.29
  at (7, 1, 8). ``seed=HELDOUT["seed"]`` draws the curves' 8 first, then more.
  ``loaded``: ``load_demo_target(out_dir)``'s result, to reuse a target already loaded.
  ``.summary()`` gives the lengths, their intervals and the paired differences."""
  import eagle3jax
  from eagle3jax import monitor
  if num_prompts < 1 or batch_size < 1 or not drafter_dirs:
    raise ValueError(f"compare_drafters needs num_prompts >= 1 (got {num_prompts}), "
                     f"batch_size >= 1 (got {batch_size}) and at least one drafter folder")
  target, tok = loaded or load_demo_target(out_dir)
  prompts, sources = heldout_prompts_with_sources(out_dir, tok, num_prompts, seed)
  out = {}
  for d in drafter_dirs:
    drafter = eagle3jax.load_drafter(d, target=target)
    out[d] = monitor.measure_acceptance_per_prompt(
        target, drafter, prompts, tuple(shapes), max_new_tokens=max_new_tokens,
        batch_size=batch_size, eos_ids=[])
    log(f"{d}: " + ", ".join(f"({k}) {m.length:.4f}" for k, m in out[d].items()))
  return DrafterComparison(out, tuple(sources))


@standard_numpy
def drafter_misses(out_dir: str, drafter_dirs: list[str], *, num_prompts: int = 64,
                   seed: int = 99, response_len: int = 128, batch_size: int = 16,
                   loaded=None, log=print) -> dict:
  """``training.miss_breakdown`` of each drafter on ``num_prompts`` held-out prompts (drawn
  with ``seed``, as ``compare_drafters``) continued greedily by ``out_dir/target`` for
  ``response_len`` tokens (``loaded`` as in ``compare_drafters``). Returns
  ``{drafter_dir: MissBreakdown}``."""
  import eagle3jax
  from eagle3jax.training import miss_breakdown, pack, regenerate
  if num_prompts < 1 or response_len < 1 or not drafter_dirs:
    raise ValueError(f"drafter_misses needs num_prompts >= 1 (got {num_prompts}), "
                     f"response_len >= 1 (got {response_len}) and at least one drafter folder")
  target, tok = loaded or load_demo_target(out_dir)
  prompts = heldout_prompts(out_dir, tok, num_prompts, seed)
  responses = regenerate(target, prompts, max_new_tokens=response_len, batch_size=64,
                         eos_ids=[])
  data = pack(prompts, responses, HELDOUT["length"] + response_len)
  out = {}
  for d in drafter_dirs:
    drafter = eagle3jax.load_drafter(d, target=target)
    out[d] = miss_breakdown(target, drafter, data.tokens, data.loss_mask,
                            batch_size=batch_size)
    log(f"{d}: step-0 accuracy {out[d].accuracy:.3f} over {out[d].positions} positions")
  return out


def reexport_drafter(out_dir: str = DEFAULT_DIR, cfg: DemoConfig = DemoConfig(),
                     log=print, train_texts: list[str] | None = None) -> dict:
  """Writes ``out_dir/drafter`` again, without retraining: with the target's embedding, the
  capture record (calibration ids: the first training prompt) and the held-out greedy
  acceptance per tree shape (batch 1, as the benchmark). Returns that acceptance.
  ``train_texts``: the manifest's train split when the caller has read it already."""
  import eagle3jax
  from eagle3jax import monitor

  import ml_dtypes
  drafter_dir = os.path.join(out_dir, "drafter")
  target, tok = load_demo_target(out_dir)
  if train_texts is None:
    train_texts = read_split(read_manifest(out_dir), "train")
  calibration = prompts_from(tok, train_texts, 1, cfg.prompt_len, cfg.seed)[0]
  # Verified on load (its record, or a probe), and save_drafter verifies that record again
  # before it writes the new one. Stored in bfloat16 first, then loaded as stored, so the
  # acceptance measured is that of the weights shipped.
  drafter = eagle3jax.load_drafter(drafter_dir, target=target)
  eagle3jax.save_drafter(drafter, drafter_dir, target=target, calibration_ids=calibration,
                         dtype=ml_dtypes.bfloat16)
  drafter = eagle3jax.load_drafter(drafter_dir, target=target)
  acceptance = monitor.measure_acceptance(
      target, drafter, heldout_prompts(out_dir, tok), monitor.DEFAULT_SHAPES + ((5, 4, 8),),
      max_new_tokens=HELDOUT_NEW_TOKENS, batch_size=1, eos_ids=[])
  log(f"held-out acceptance: {acceptance}")
  eagle3jax.save_drafter(drafter, drafter_dir, target=target, calibration_ids=calibration,
                         acceptance=acceptance, dtype=ml_dtypes.bfloat16)
  return acceptance


def make_drafter(out_dir: str = DEFAULT_DIR, cfg: DemoConfig = DemoConfig(), log=print,
                 state_dir: str | None = None,
                 train_texts: list[str] | None = None) -> list[dict]:
  """Trains ``out_dir/drafter`` for the (already built) ``out_dir/target``.

  ``state_dir`` keeps the regenerated data and checkpoints (default: a temporary folder); a
  run given the same folder resumes. ``train_texts``: the manifest's train split when the
  caller has read it already (read once, so a stdlib mismatch warns once). Returns the
  learning curve: held-out greedy acceptance length at (7, 1, 8) every
  ``cfg.heldout_every`` steps (``plot_curve`` draws it).
  """
  import tempfile
  from eagle3jax.training import train_drafter

  drafter_dir = os.path.join(out_dir, "drafter")
  if train_texts is None:  # first: a mistyped out_dir is named before anything is created
    train_texts = read_split(read_manifest(out_dir), "train")
  # Its first write is the export after training: a folder that cannot take it is named now,
  # not after the regeneration and training (about 55 minutes).
  try:
    os.makedirs(drafter_dir, exist_ok=True)
  except OSError as e:
    raise ValueError(f"the drafter's folder {drafter_dir!r} cannot be created ({e}); remove "
                     "what is in the way or choose another --out") from None
  if not os.access(drafter_dir, os.W_OK):
    raise ValueError(f"the drafter's folder {drafter_dir!r} is not writable")
  target, tok = load_demo_target(out_dir)
  prompts = prompts_from(tok, train_texts, cfg.draft_prompts, cfg.prompt_len, cfg.seed)
  dcfg = drafter_train_config(cfg)
  heldout, sources = heldout_prompts_with_sources(out_dir, tok)
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    result = train_drafter(target, prompts, drafter_dir, dcfg,
                           checkpoint_dir=state_dir or tmp, progress=False,
                           heldout_prompts=heldout, heldout_sources=sources,
                           heldout_every=cfg.heldout_every,
                           capture=drafter_capture(cfg),
                           drafter_overrides=drafter_overrides(cfg))
  last = result.history[-1] if result.history else {}
  log(f"drafter: {len(result.history)} steps in {time.perf_counter() - t0:.0f} s, coverage "
      f"{result.vocab.coverage:.3f}, last loss {last.get('loss')}, step accuracy "
      f"{last.get('acc')}")
  for point in result.curve:
    interval = (f" (95% interval {point['interval'][0]:.2f}-{point['interval'][1]:.2f})"
                if "interval" in point else "")
    log(f"  held-out acceptance at step {point['step']}: {point['accept_length']:.2f}"
        f"{interval} ({point['seconds']:.0f} s)")
  # Stored in bfloat16; the record keeps the acceptance of the stored drafter at batch 1, as
  # the benchmark measures it.
  reexport_drafter(out_dir, cfg, log=log, train_texts=train_texts)
  return result.curve


def drafter_train_config(cfg: DemoConfig):
  """The drafter's ``TrainConfig`` for a demo config (greedy regeneration of the responses)."""
  from eagle3jax.training import TrainConfig
  return TrainConfig(learning_rate=cfg.draft_lr, warmup_steps=min(60, cfg.draft_steps // 5),
                     total_steps=cfg.draft_steps, batch_size=cfg.draft_batch,
                     seq_len=cfg.prompt_len + cfg.response_len,
                     draft_vocab_size=cfg.draft_vocab_size, max_new_tokens=cfg.response_len,
                     temperature=0.0, gen_batch_size=128,
                     checkpoint_every=max(50, cfg.draft_steps // 4), seed=cfg.seed,
                     ttt_steps=cfg.ttt_steps, label_temperature=cfg.draft_label_temperature,
                     step_decay=cfg.draft_step_decay, head_init=cfg.draft_head_init,
                     align_topk=cfg.draft_align_topk, cache_features=cfg.draft_cache_features)


def drafter_capture(cfg: DemoConfig) -> tuple[int, ...] | None:
  """The target layers the drafter reads (``draft_capture``: comma-separated output-convention
  ids, e.g. ``"1,5,10"``; empty: ``CaptureSpec.eagle3_default``, the outputs of layers 1,
  L/2 - 1 and L - 4)."""
  if not cfg.draft_capture.strip():
    return None
  return parse_ints(cfg.draft_capture, "--draft-capture (DemoConfig.draft_capture)",
                    form="comma-separated layer ids, e.g. '1,5,10'")


def drafter_overrides(cfg: DemoConfig) -> dict | None:
  """The drafter's ``DrafterConfig`` fields that differ from one target layer's: a wider MLP
  (``draft_intermediate_size``), other attention heads (``draft_num_heads`` query and as many
  key/value heads; 0 keeps the target's) and their width (``draft_head_dim``; 0 splits the
  hidden size over the heads, ``hidden_size // heads``, as the official EAGLE-3 code derives
  it). The defaults give 16 heads of 16 over the demo's hidden size of 256."""
  out = {}
  if cfg.draft_intermediate_size:
    out["intermediate_size"] = cfg.draft_intermediate_size
  if cfg.draft_num_heads:
    out.update(num_attention_heads=cfg.draft_num_heads, num_key_value_heads=cfg.draft_num_heads)
  if cfg.draft_num_heads or cfg.draft_head_dim:
    heads = cfg.draft_num_heads or cfg.num_heads
    if not cfg.draft_head_dim and cfg.hidden_size % heads:
      raise ValueError(f"--draft-num-heads {heads} does not divide hidden_size="
                       f"{cfg.hidden_size}, so the heads cannot split it (--draft-head-dim 0); "
                       "choose a divisor, or give the head width with --draft-head-dim")
    out["head_dim"] = cfg.draft_head_dim or cfg.hidden_size // heads
  return out or None


def target_config(cfg: DemoConfig, vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
  """The demo target's ``LlamaConfig`` (``vocab_size``: the trained tokenizer's)."""
  from eagle3jax.config import LlamaConfig
  return LlamaConfig(
      vocab_size=vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
      max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
      rms_norm_eps=1e-5, eos_token_ids=eos_token_ids)


def check_drafter_recipe(cfg: DemoConfig) -> None:
  """Refuses a drafter recipe that could not train, before anything is built: its
  ``TrainConfig``, capture ids and drafter shape against a target of ``cfg``'s shape (so a bad
  ``--draft-*`` flag fails at once, not after the target's pre-training or the regeneration)."""
  from eagle3jax.capture import CaptureSpec
  from eagle3jax.drafter import DrafterConfig
  drafter_train_config(cfg)
  if cfg.draft_vocab_size > cfg.vocab_size:  # refused by the training, after the target's
    raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} exceeds vocab_size="
                     f"{cfg.vocab_size}: the draft vocabulary is a subset of the target's")
  target_cfg = target_config(cfg, cfg.vocab_size)
  ids = drafter_capture(cfg)
  capture = (CaptureSpec(ids) if ids is not None else
             CaptureSpec.eagle3_default(cfg.num_layers))
  capture.validate(cfg.num_layers)
  DrafterConfig.for_target(target_cfg, capture,
                           draft_vocab_size=cfg.draft_vocab_size,
                           **(drafter_overrides(cfg) or {}))


def plot_curve(curve: list[dict], path: str, title: str = "") -> None:
  """Held-out acceptance length against training steps (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.6))
  steps = [p["step"] for p in curve]
  ax.plot(steps, [p["accept_length"] for p in curve], "o-", label="acceptance length")
  if all("interval" in p for p in curve):  # curves written before 2026-12-07 have none
    ax.fill_between(steps, [p["interval"][0] for p in curve], [p["interval"][1] for p in curve],
                    alpha=0.2, label="95% interval over the held-out files (bootstrap)")
    ax.legend(loc="lower right", fontsize=8)
  ax.set_xlabel("training step (8 sequences each)")
  ax.set_ylabel("held-out acceptance length, (7, 1, 8)")
  ax.set_title(title or "drafter learning curve (8 held-out prompts, greedy)")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
