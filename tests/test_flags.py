"""eagle3jax.flags.parse_ints: the scripts' integer-list flags, and that every script refuses a
malformed list by its flag's name (exit 2, one line) instead of a traceback."""

import runpy
import sys

import pytest

from eagle3jax.flags import parse_ints


def test_parse_ints_reads_lists_and_refuses_by_name():
  assert parse_ints("1,5,8", "--capture") == (1, 5, 8)
  assert parse_ints(" 2, 6 ,11 ", "--capture") == (2, 6, 11)
  assert parse_ints("1,8,", "--mesh", count=2) == (1, 8)  # a trailing comma is harmless
  assert parse_ints("-1,3", "--capture") == (-1, 3)  # -1: the embedding capture
  for bad in ("", " ", "1,,2", "1;5", "x", "1.5", ",", ",1"):
    with pytest.raises(ValueError, match=r"^--capture .*: expected comma-separated integers$"):
      parse_ints(bad, "--capture")
  with pytest.raises(ValueError, match=r"^--mesh '8': expected DATA,TENSOR$"):
    parse_ints("8", "--mesh", count=2, form="DATA,TENSOR")
  with pytest.raises(ValueError, match=r"^--mesh '1,2,4': expected DATA,TENSOR$"):
    parse_ints("1,2,4", "--mesh", count=2, form="DATA,TENSOR")


@pytest.mark.parametrize("script,argv,flag", [
    ("scripts/bench_compile.py", ["--depths", "6;48"], "--depths '6;48'"),
    ("scripts/bench_moe.py", ["--experts", "16,x"], "--experts '16,x'"),
    ("scripts/bench.py", ["--batches", "1 4", "--no-transformers"], "--batches '1 4'"),
    ("scripts/compare_drafters.py", ["--shapes", "7,1", "d"], "--shapes '7,1'"),
])
def test_scripts_refuse_a_malformed_list_by_name(script, argv, flag, monkeypatch, capsys):
  # Each script parses its list before any model or program is built.
  monkeypatch.setattr(sys, "argv", [script] + argv)
  with pytest.raises(SystemExit) as stop:
    runpy.run_path(script, run_name="__main__")
  err = capsys.readouterr().err
  assert stop.value.code == 2, err
  assert flag in err and "expected" in err and "Traceback" not in err
  assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("script,argv,message", [
    ("scripts/bench.py", ["--out", "/nonexistent-dir/b.json"],
     "--out '/nonexistent-dir/b.json': folder '/nonexistent-dir' does not exist"),
    ("scripts/compare_drafters.py", ["d", "--json", "/nonexistent-dir/x.json"],
     "--json '/nonexistent-dir/x.json': folder '/nonexistent-dir' does not exist"),
    ("scripts/bench.py", ["--out", "tests"], "--out 'tests' is a folder"),
    # A batch larger than the prompts used to run on fewer rows under the larger label.
    ("scripts/bench.py", ["--prompts", "1", "--batches", "1,4", "--out", "/tmp/b.json"],
     "a batch of 4 needs at least that many prompts, but --prompts is 1"),
])
def test_scripts_refuse_bad_outputs_and_sizes_before_running(script, argv, message, monkeypatch,
                                                             capsys):
  monkeypatch.setattr(sys, "argv", [script] + argv)
  code = None
  try:
    code = runpy.run_path(script, run_name="__main__")
  except SystemExit as stop:
    code = stop.code
  err = capsys.readouterr().err
  assert code == 2, err
  assert message in err and "Traceback" not in err, err
