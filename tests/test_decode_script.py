"""scripts/decode.py end to end on a tiny checkpoint with a tokenizer (in-process)."""

import json
import subprocess
import sys

import jax.numpy as jnp
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import eagle3jax
from eagle3jax.decode_cli import run
from tests import hf_models

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(94)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("decode")
  target_dir, drafter_dir = root / "target", root / "drafter"
  hf_models.make_checkpoint(str(target_dir), "llama", layers=8)
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(target_dir / "tokenizer.json"))
  target = eagle3jax.load_target(str(target_dir), dtype=jnp.float32)
  cfg = eagle3jax.DrafterConfig.for_target(target.config,
                                           eagle3jax.CaptureSpec.eagle3_default(8))
  eagle3jax.save_drafter(eagle3jax.init_drafter(cfg, target=target, seed=3), str(drafter_dir),
                         target=target, acceptance={"3,1,4": 1.5})
  return str(target_dir), str(drafter_dir)


def test_json_with_baseline(dirs, capsys):
  target, drafter = dirs
  rc = run(["--target", target, "--drafter", drafter, "--prompt", "w5 w6 w7 w8",
            "--max-new-tokens", "12", "--steps", "3", "--json", "--baseline"])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)  # stdout holds exactly one JSON object
  for key in ("output_ids", "text", "accept_length_mean", "acceptance_per_position",
              "accept_length_recorded", "tokens_per_s", "baseline_tokens_per_s", "speedup", "matches_baseline"):
    assert key in report
  assert len(report["output_ids"]) == 12 and report["matches_baseline"] is True
  assert report["accept_length_recorded"] == 1.5  # the drafter's record at (3, 1, 4)
  assert report["text"].split()[0].startswith("w") or report["text"].split()[0].startswith("<")


def test_streaming_text_and_stats_table(dirs, capsys):
  target, drafter = dirs
  assert run(["--target", target, "--drafter", drafter, "--prompt-ids", "5,6,7",
              "--max-new-tokens", "6", "--steps", "3", "--topk", "2",
              "--draft-tokens", "5"]) == 0
  out = capsys.readouterr().out
  assert "accept length (mean)" in out and "tokens/s" in out
  assert "accept length (held-out)" in out and "not recorded" in out  # none at (3, 2, 5)


def test_sampling_labels_the_greedy_record_and_skips_the_comparison(dirs, capsys):
  target, drafter = dirs
  assert run(["--target", target, "--drafter", drafter, "--prompt-ids", "5,6,7",
              "--max-new-tokens", "4", "--steps", "3", "--temperature", "0.7",
              "--baseline"]) == 0
  out = capsys.readouterr().out
  assert ("1.50 (drafter's greedy record, this tree; not comparable with this run's "
          "sampling at temperature 0.7)") in out
  assert "not compared (sampling)" in out


def test_default_draft_tokens_fit_a_small_tree(dirs, capsys):
  # The default 8 used to exceed this tree's 7 nodes and fail, naming num_draft_tokens.
  target, drafter = dirs
  assert run(["--target", target, "--drafter", drafter, "--prompt-ids", "5,6,7",
              "--max-new-tokens", "4", "--steps", "2", "--topk", "2", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["tree"] == {"steps": 2, "topk": 2, "draft_tokens": 7}, out


def test_draft_tokens_unused_by_a_chain_is_said(dirs, capsys):
  target, drafter = dirs
  assert run(["--target", target, "--drafter", drafter, "--prompt-ids", "5,6,7",
              "--max-new-tokens", "4", "--steps", "3", "--topk", "1", "--draft-tokens", "6",
              "--json"]) == 0
  err = capsys.readouterr().err
  assert "--topk 1 drafts a chain of --steps + 1 = 4 tokens; --draft-tokens 6 is not used" in err


@pytest.mark.parametrize("argv,message", [
    (["--target", "/nonexistent"], "--target '/nonexistent' is not a directory"),
    # Said without the flag before ("'tests' has no config.json").
    (["--drafter", "tests"], "--drafter 'tests' has no config.json: give the folder of a "
                             "drafter checkpoint"),
    (["--mesh", "1"], "expected DATA,TENSOR"),
    (["--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens=0"),
    (["--prompt-ids", "1,2", "--mesh", "4,4"], "needs 16 devices"),
])
def test_one_line_errors(dirs, capsys, argv, message):
  target, drafter = dirs
  base = ["--target", target, "--drafter", drafter]
  assert run(base + argv) == 2
  err = capsys.readouterr().err
  assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_prompt_ids_need_no_readable_tokenizer(dirs, tmp_path, capsys):
  """With --prompt-ids the tokenizer only shows the output as text: a damaged one used to stop
  the run, advising the ids already given (and a flag decode.py does not have)."""
  import shutil
  target, drafter = dirs
  broken = tmp_path / "target"
  shutil.copytree(target, broken)
  (broken / "tokenizer.json").write_text("{not a tokenizer")
  assert run(["--target", str(broken), "--drafter", drafter, "--prompt-ids", "5,6,7",
              "--max-new-tokens", "4", "--steps", "3", "--json"]) == 0
  out, err = capsys.readouterr()
  assert len(json.loads(out)["output_ids"]) == 4
  assert "could not be read as a tokenizer" in err and "printing token ids" in err
  assert "--prompt-ids-file" not in err


def test_script_help_runs():
  out = subprocess.run([sys.executable, "scripts/decode.py", "--help"], capture_output=True,
                       text=True, check=True).stdout
  for flag in ("--target", "--drafter", "--prompt", "--prompt-ids", "--max-new-tokens",
               "--temperature", "--top-p", "--steps", "--topk", "--draft-tokens", "--mesh",
               "--aux-layer-convention", "--no-verify-capture", "--baseline", "--json"):
    assert flag in out


def test_streaming_holds_back_a_character_split_between_rounds(monkeypatch, capsys):
  """A byte-level tokenizer splits a character over several tokens, and a round can end
  between them: the stream printed U+FFFD there and never took it back."""
  from eagle3jax.decode_cli import DEFAULT_TARGET
  from eagle3jax.generate import GenerateResult
  from eagle3jax.text import TextCodec
  text = "x = '日本語 café'\n"
  codec = TextCodec(DEFAULT_TARGET)  # the shipped byte-level BPE
  ids = codec.encode_prompt(text)
  assert any("\ufffd" in codec.decode(ids[:n]) for n in range(len(ids)))  # a split exists

  def fake_generate(target, drafter, prompts, on_tokens=None, **kw):
    for n in range(1, len(ids) + 1):  # one token per round: every split is seen
      if on_tokens is not None:
        on_tokens([ids[:n]])
    return GenerateResult([list(ids)], {"accept_length_mean": 1.0, "rounds": len(ids),
                                        "acceptance_per_position": [0.0],
                                        "accept_length_recorded": None, "tokens_per_s": 1.0})
  monkeypatch.setattr(eagle3jax, "generate", fake_generate)
  assert run(["--prompt-ids", "5,6,7", "--max-new-tokens", str(len(ids))]) == 0
  streamed = capsys.readouterr().out.split("\n\n")[0]
  assert streamed == text.rstrip("\n"), repr(streamed)
