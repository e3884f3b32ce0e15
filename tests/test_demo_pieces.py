"""The pieces of the embedded demo: HF export, target pre-training, corpus manifest,
tokenizer."""

import dataclasses
import json
import os
import pathlib
import platform
import sys
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

import eagle3jax
from eagle3jax import capture_contract as contract
from eagle3jax import demo
from eagle3jax import monitor
from eagle3jax.safetensors_io import SafetensorsFile
from eagle3jax.hf_export import save_target
from eagle3jax.training.lm import LMTrainConfig, batches, train_lm
from tests.script_loader import load_script


def test_exported_target_loads_in_transformers_and_eagle3jax(tmp_path):
  cfg = eagle3jax.LlamaConfig.tiny(num_hidden_layers=3, tie_word_embeddings=True)
  mesh = eagle3jax.make_mesh(1, 8)  # KV heads replicated 4x on this mesh: export undoes it
  model = eagle3jax.init_target(cfg, mesh=mesh, seed=2, std=0.1)
  save_target(model, str(tmp_path), dtype=np.float32)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 13))
  ours = np.asarray(eagle3jax.forward(model, ids).logits)
  reloaded = eagle3jax.load_target(str(tmp_path), dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(eagle3jax.forward(reloaded, ids).logits), ours,
                             atol=1e-5)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                         dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf(torch.as_tensor(ids)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-4)


def test_target_pretraining_loss_falls():
  cfg = eagle3jax.LlamaConfig.tiny(num_hidden_layers=2, vocab_size=50)
  model = eagle3jax.init_target(cfg, seed=0, std=0.02)
  # A repetitive stream: a small model learns it in a few steps.
  stream = np.tile(np.arange(3, 40), 200).astype(np.int32)
  losses = train_lm(model, stream, LMTrainConfig(learning_rate=1e-2, warmup_steps=3,
                                                 total_steps=40, batch_size=4, seq_len=32))
  assert losses[-1] < 0.5 * losses[0], losses


def test_manifest_split_is_fixed_and_disjoint():
  a, b = demo.build_manifest(), demo.build_manifest()
  assert a == b
  assert not set(a["train"]) & set(a["heldout"])
  assert len(a["heldout"]) > 10 and len(a["train"]) > 10 * len(a["heldout"]) // 2
  assert not any(p.startswith("test" + "/") for p in a["train"] + a["heldout"])


def test_manifest_split_warns_when_the_stdlib_differs(tmp_path, monkeypatch):
  # Prompts are drawn from the running interpreter's stdlib: another Python version's files
  # give other prompts, and figures that cannot match the README's. That is said, not silent.
  paths = demo.build_manifest()["heldout"][:3]
  manifest = {"python": "3.11.7", "heldout": paths,
              "heldout_digest": demo.corpus_digest(demo.read_files(paths))}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert demo.read_split(manifest, "heldout") == demo.read_files(paths)
  root = tmp_path / "lib"
  for i, p in enumerate(paths[:2]):  # one file changed, one missing
    (root / os.path.dirname(p)).mkdir(parents=True, exist_ok=True)
    text = (pathlib.Path(demo.stdlib_root()) / p).read_text(encoding="utf-8", errors="replace")
    (root / p).write_text(text + ("\n# changed\n" if i == 0 else ""), encoding="utf-8")
  monkeypatch.setattr(demo, "stdlib_root", lambda: str(root))
  with pytest.warns(UserWarning, match=r"1 of 3 missing, the rest not all the same.*will not "
                                       r"match the README's"):
    demo.read_split(manifest, "heldout")


@pytest.mark.parametrize("field, value, message", [
    ("draft_head_dim", 7, "head_dim=7 must be a positive even number"),
    ("draft_head_init", "bogus", "head_init='bogus'"),
    ("draft_capture", "1,5,12", r"out of range for a target with 12"),
    ("draft_lr", float("nan"), "draft_lr=nan must be a finite number"),
    # The target's fields failed (or trained on nothing, or diverged) after the tokenizer
    # and during or after the pre-training.
    ("draft_prompts", 0, "DemoConfig draft_prompts=0 must be a positive integer"),
    ("lm_seq_len", 0, "DemoConfig lm_seq_len=0 must be a positive integer"),
    ("lm_batch", 0, "DemoConfig lm_batch=0 must be a positive integer"),
    ("lm_steps", -1, "DemoConfig lm_steps=-1 must be a positive integer"),
    ("lm_lr", float("nan"), "DemoConfig lm_lr=nan must be a finite number >= 0"),
    ("lm_lr", 0.0, "LMTrainConfig learning_rate=0.0 must be a finite number > 0"),
    ("lm_seq_len", 2048, "DemoConfig lm_seq_len=2048 exceeds max_position_embeddings=1024"),
    ("response_len", 1000, "prompt_len \\+ response_len=1048 exceeds max_position_embeddings"),
])
def test_drafter_recipe_is_checked_before_anything_is_built(field, value, message):
  # make_demo.py runs this first: a bad --draft-* flag used to fail after the target's
  # pre-training (about 42 minutes) or the regeneration.
  demo.check_drafter_recipe(demo.DemoConfig())
  with pytest.raises(ValueError, match=message):
    demo.check_drafter_recipe(demo.DemoConfig(**{field: value}))


def test_read_manifest_says_what_a_demo_folder_holds(tmp_path):
  with pytest.raises(ValueError, match="has no manifest.json: held-out and training prompts "
                                       "come from a demo folder"):
    demo.read_manifest(str(tmp_path))
  (tmp_path / "manifest.json").write_text("[]")
  with pytest.raises(ValueError, match="with 'train' and 'heldout' file lists"):
    demo.read_manifest(str(tmp_path))
  assert demo.read_manifest(demo.DEFAULT_DIR)["heldout"]


def test_tokenizer_round_trip_and_prompts():
  texts = demo.read_files(demo.build_manifest()["heldout"][:5])
  tok = demo.train_tokenizer(texts, 400)
  assert tok.get_vocab_size() <= 400
  ids = tok.encode(texts[0][:200]).ids
  assert tok.decode(ids) == texts[0][:200]
  prompts = demo.prompts_from(tok, texts, 3, 16, seed=0)
  assert len(prompts) == 3 and all(len(p) == 16 for p in prompts)
  assert prompts == demo.prompts_from(tok, texts, 3, 16, seed=0)


def test_drafter_train_config_carries_the_demo_recipe():
  # make_demo.py exposes every DemoConfig field as a flag; the drafter's recipe fields must
  # reach its TrainConfig (a dropped one would silently train the default recipe).
  cfg = demo.DemoConfig(draft_steps=300, draft_lr=1e-3, draft_batch=4, ttt_steps=5,
                        draft_label_temperature=0.5, draft_step_decay=1.0, prompt_len=16,
                        response_len=32, draft_vocab_size=512, seed=3, draft_align_topk=2)
  t = demo.drafter_train_config(cfg)
  assert t.align_topk == 2
  assert (t.total_steps, t.learning_rate, t.batch_size, t.ttt_steps) == (300, 1e-3, 4, 5)
  assert (t.label_temperature, t.step_decay, t.seq_len) == (0.5, 1.0, 48)
  assert (t.draft_vocab_size, t.max_new_tokens, t.temperature, t.seed) == (512, 32, 0.0, 3)
  assert demo.drafter_train_config(demo.DemoConfig()).step_decay == 0.8
  # The demo computes the target's features once (README); --no-draft-cache-features not.
  assert demo.drafter_train_config(demo.DemoConfig()).cache_features is True
  assert demo.drafter_train_config(
      demo.DemoConfig(draft_cache_features=False)).cache_features is False
  with pytest.raises(ValueError, match="draft_cache_features='no' must be True or False"):
    demo.DemoConfig(draft_cache_features="no")


def test_drafter_overrides_carry_the_demo_drafter_shape():
  # The drafter's shape flags reach its DrafterConfig overrides. The defaults split the target
  # layer's width into 16 heads of 16 (the shipped drafter); 0 keeps one target layer's shape.
  d = demo.DemoConfig()
  assert demo.drafter_overrides(d) == {"num_attention_heads": 16, "num_key_value_heads": 16,
                                       "head_dim": 16}
  # A head width of 0 splits the hidden size over the heads, as the official code derives it.
  assert demo.drafter_overrides(dataclasses.replace(d, hidden_size=128))["head_dim"] == 8
  d = dataclasses.replace(d, draft_num_heads=0)
  assert demo.drafter_overrides(d) is None
  assert demo.drafter_overrides(dataclasses.replace(d, draft_num_heads=8)) == {
      "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": d.hidden_size // 8}
  assert demo.drafter_overrides(dataclasses.replace(d, draft_num_heads=8, draft_head_dim=32,
                                                    draft_intermediate_size=1408)) == {
      "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32,
      "intermediate_size": 1408}
  assert demo.drafter_overrides(dataclasses.replace(d, draft_head_dim=32)) == {"head_dim": 32}
  # Heads that do not divide the hidden size are named, not rounded down to a narrower layer.
  with pytest.raises(ValueError, match=r"--draft-num-heads 12 does not divide hidden_size=256"):
    demo.drafter_overrides(dataclasses.replace(d, draft_num_heads=12))
  assert demo.drafter_overrides(dataclasses.replace(d, draft_num_heads=12, draft_head_dim=20)) \
      == {"num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 20}


def test_drafter_capture_parses_the_demo_flag():
  # --draft-capture picks the target layers the drafter reads; empty keeps EAGLE-3's default
  # (train_drafter's CaptureSpec.eagle3_default), a malformed list is refused by name.
  d = demo.DemoConfig()
  assert demo.drafter_capture(d) is None
  assert demo.drafter_capture(dataclasses.replace(d, draft_capture="1,5,10")) == (1, 5, 10)
  assert demo.drafter_capture(dataclasses.replace(d, draft_capture=" 2, 6 ,11")) == (2, 6, 11)
  with pytest.raises(ValueError, match=r"--draft-capture \(DemoConfig.draft_capture\) '1;5': expected"):
    demo.drafter_capture(dataclasses.replace(d, draft_capture="1;5"))


def test_make_demo_script_builds_a_pair_that_loads(tmp_path, monkeypatch, caplog):
  """scripts/make_demo.py end to end at a tiny size: every stage the 90-minute rebuild runs
  (manifest, tokenizer, pre-training, export, regeneration, drafter training with its curve,
  bfloat16 export, the held-out record), and a folder the engine loads as the shipped one."""
  out, curve = tmp_path / "demo", tmp_path / "curve.json"
  # Shorter held-out measurements than the real demo's (8 prompts x 128 new tokens), so that
  # the test stays short: 2 prompts x 24 tokens.
  every_prompt = demo.heldout_prompts_with_sources
  measure = monitor.measure_acceptance_per_prompt  # the curve's, and the record's through it
  monkeypatch.setattr(demo, "heldout_prompts_with_sources",
                      lambda out_dir, tok, *a, **k: every_prompt(out_dir, tok, 2))
  monkeypatch.setattr(monitor, "measure_acceptance_per_prompt",
                      lambda *a, **k: measure(*a, **{**k, "max_new_tokens": 24}))
  monkeypatch.setattr(sys, "argv", [
      "make_demo.py", "--out", str(out), "--curve", str(curve), "--vocab-size", "512",
      "--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "8",
      "--num-heads", "2", "--max-position-embeddings", "256", "--lm-steps", "4",
      "--lm-batch", "4", "--lm-seq-len", "64", "--draft-vocab-size", "128",
      "--draft-prompts", "16", "--response-len", "16", "--draft-steps", "4",
      "--draft-batch", "4", "--ttt-steps", "3", "--heldout-every", "4"])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert load_script("make_demo").main() == 0
  # The stdlib read is the one the manifest was built from: no mismatch warning. The rebuild
  # checks its own drafter's capture (it used to load it unverified, and said so).
  assert "NOT verified" not in caplog.text
  assert not [w for w in caught if "differ from those it was built from" in str(w.message)]
  manifest = demo.read_manifest(str(out))
  assert manifest["python"] == platform.python_version() and manifest["train_digest"]
  target, tok = demo.load_demo_target(str(out))
  assert tok.get_vocab_size() == 512 and target.config.vocab_size == 512 and target.num_layers == 8
  drafter = eagle3jax.load_drafter(str(out / "drafter"), target=target)
  assert "capture record verified" in drafter.capture_explanation
  record = contract.read_record(str(out / "drafter"))
  acceptance = dict(record.acceptance)
  assert set(acceptance) == {"3,1,4", "5,1,6", "7,1,8", "5,4,8"}
  assert all(1.0 <= a <= 8.0 for a in acceptance.values())
  st = SafetensorsFile(str(out / "drafter" / "model.safetensors"))
  assert "embed_tokens.weight" in st.names  # loads in the official engine too (issue 14)
  assert st.get("fc.weight").dtype == ml_dtypes.bfloat16
  with open(curve) as f:
    points = json.load(f)["curve"]
  assert [p["step"] for p in points] == [4] and (tmp_path / "curve.png").exists()
  assert 1.0 <= points[0]["accept_length"] <= 8.0
  assert len(points[0]["rounds"]) == 2 == len(points[0]["accepted"])
  # The held-out prompts' files: an interval where the two prompts came from two files.
  two_files = len(set(every_prompt(str(out), tok, 2)[1])) == 2
  assert ("interval" in points[0]) == two_files


def test_make_drafter_names_an_unusable_drafter_folder_before_training(tmp_path):
  # Its first write used to be the export after regeneration and training (35-50 minutes).
  (tmp_path / "drafter").write_text("x")
  with pytest.raises(ValueError, match=r"the drafter's folder .*drafter' cannot be created"):
    demo.make_drafter(str(tmp_path), train_texts=["x"])  # refused before the target loads
  # A mistyped folder is named before anything is created in it.
  with pytest.raises(ValueError, match="manifest.json"):
    demo.make_drafter(str(tmp_path / "typo"))
  assert not (tmp_path / "typo").exists()


def test_lm_windows_of_a_stream_of_exactly_one_window():
  cfg = LMTrainConfig(seq_len=4, batch_size=3, warmup_steps=0, total_steps=1)
  # seq_len + 1 tokens are one window (refused as "fewer than seq_len + 1" before).
  np.testing.assert_array_equal(next(batches(np.arange(5), cfg)), np.tile(np.arange(5), (3, 1)))
  with pytest.raises(ValueError, match=r"the corpus has 4 tokens, fewer than seq_len \+ 1 = 5"):
    next(batches(np.arange(4), cfg))
  # The draws of a longer stream are the ones the shipped target was trained on.
  starts = next(batches(np.arange(100), LMTrainConfig(seq_len=4, batch_size=6)))[:, 0]
  np.testing.assert_array_equal(starts, np.random.default_rng(0).integers(0, 95, 6))
