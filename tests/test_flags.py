"""eagle3jax.flags.parse_ints: the scripts' integer-list flags, and that every script refuses a
malformed list by its flag's name (exit 2, one line) instead of a traceback."""

import runpy
import sys

import pytest

from eagle3jax.flags import parse_ints, positive_int, require_modules


def test_parse_ints_refuses_repeats_where_asked():
  assert parse_ints("1,4", "--batches", unique=True) == (1, 4)
  assert parse_ints("1,1", "--mesh", count=2) == (1, 1)  # a mesh may repeat a size
  with pytest.raises(ValueError, match=r"^--depths '6,3,6,3' names \[3, 6\] more than once; "):
    parse_ints("6,3,6,3", "--depths", unique=True)


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
    # The plot beside it used to overwrite the JSON.
    ("scripts/bench.py", ["--out", "/tmp/b.png"], "--out '/tmp/b.png' is where the JSON goes"),
    # A typo in a later folder used to fail only after the earlier drafters were measured.
    ("scripts/compare_drafters.py", ["models/default/drafter", "/nonexistent"],
     "drafter folder '/nonexistent' has no config.json"),
    ("scripts/compare_drafters.py", ["models/default/drafter", "models/default/drafter/"],
     "drafter folders 'models/default/drafter' and 'models/default/drafter/' are the same"),
    # Ignored without --drafter-only before.
    ("scripts/make_demo.py", ["--state-dir", "/tmp/s", "--curve", "/tmp/c.json"],
     "--state-dir keeps a drafter-only run's data"),
    # A batch larger than the prompts used to run on fewer rows under the larger label.
    ("scripts/bench.py", ["--prompts", "1", "--batches", "1,4", "--out", "/tmp/b.json"],
     "a batch of 4 needs at least that many prompts, but --prompts is 1"),
    # These four used to end in tracebacks, some after the whole run.
    ("scripts/bench_train.py", ["--target", "/nonexistent"],
     "bench_train.py: error: checkpoint directory '/nonexistent' does not exist"),
    ("scripts/bench_moe.py", ["--experts", "4", "--json", "/nonexistent-dir/m.json"],
     "--json '/nonexistent-dir/m.json': folder '/nonexistent-dir' does not exist"),
    ("scripts/bench_moe.py", ["--experts", "4", "--top-k", "8"],
     "bench_moe.py: error: RoutingConfig: top_k=8 must be"),
    # Said as a routing-groups error before (with advice the script has no flag for).
    ("scripts/bench_moe.py", ["--experts", "0,4"],
     "--experts '0,4': every expert count must be at least 2"),
    ("scripts/bench_moe.py", ["--experts", "1"],
     "--experts '1': every expert count must be at least 2"),
    # A value given twice was measured twice and pooled into one row (or broke the table).
    ("scripts/bench_moe.py", ["--experts", "8,8"], "--experts '8,8' names [8] more than once"),
    ("scripts/bench_compile.py", ["--depths", "4,3,3"],
     "--depths '4,3,3' names [3] more than once"),
    ("scripts/bench.py", ["--batches", "1,1", "--out", "/tmp/b.json"],
     "--batches '1,1' names [1] more than once"),
    # Root passes os.access on any folder: the write itself is tried before the run (the run
    # used to end in a FileNotFoundError traceback).
    ("scripts/bench.py", ["--out", "/proc/b.json"],
     "--out '/proc/b.json': folder '/proc' is not writable"),
    # The folder of --target, not the demo folder, has to hold manifest.json.
    ("scripts/bench.py", ["--target", "tests", "--no-transformers", "--out", "/tmp/b.json"],
     "--target must be the target/ folder of such a folder, e.g. models/default/target"),
    # The JSON used to be written, then overwritten by its own plot, after the whole run.
    ("scripts/make_demo.py", ["--curve", "/tmp/c.png"], "--curve '/tmp/c.png' is where the JSON"),
    # Refused by the drafter's training, after the target's 42 minutes, before.
    ("scripts/make_demo.py", ["--draft-vocab-size", "10000", "--curve", "/tmp/c.json"],
     "draft_vocab_size=10000 exceeds vocab_size=8192"),
    # The boolean flag parses (a bool-typed flag took any string as True).
    ("scripts/make_demo.py", ["--no-draft-cache-features", "--draft-num-heads", "12",
                              "--curve", "/tmp/c.json"],
     "--draft-num-heads 12 does not divide hidden_size=256"),
    ("scripts/bench_compile.py", ["--depths", "2,4"], "depths=[2, 4] must be layer counts >= 3"),
    ("scripts/bench_compile.py", ["--json", "tests"], "--json 'tests' is a folder"),
    ("scripts/bench_kernel.py", ["--small", "--interpret", "--out", "/nonexistent-dir/k.json"],
     "--out '/nonexistent-dir/k.json': folder '/nonexistent-dir' does not exist"),
    # A zero count used to end in statistics.StatisticsError after the run.
    ("scripts/bench_train.py", ["--runs", "0"], "argument --runs: 0 must be >= 1"),
    ("scripts/bench_compile.py", ["--repeats", "0"], "argument --repeats: 0 must be >= 1"),
    ("scripts/bench_moe.py", ["--repeats", "-1"], "argument --repeats: -1 must be >= 1"),
    ("scripts/bench_kernel.py", ["--small", "--interpret", "--iters", "0"],
     "argument --iters: 0 must be >= 1"),
    ("scripts/bench.py", ["--runs", "x"], "argument --runs: 'x' is not an integer"),
    # With one new token no round runs: bench.py divided by zero rounds after its whole run,
    # compare_drafters.py indexed a missing acceptance.
    ("scripts/bench.py", ["--max-new-tokens", "1"], "argument --max-new-tokens: 1 must be >= 2"),
    ("scripts/compare_drafters.py", ["d", "--max-new-tokens", "1"],
     "argument --max-new-tokens: 1 must be >= 2"),
    ("scripts/compare_drafters.py", ["d", "--level", "95"],
     "argument --level: 95.0 must be between 0 and 1 (e.g. 0.95)"),
    ("scripts/compare_drafters.py", ["d", "--level", "x"], "argument --level: 'x' is not a number"),
    # A chain drafts steps + 1 tokens whatever it is given: (7, 1, 5) ran (7, 1, 8).
    ("scripts/compare_drafters.py", ["d", "--shapes", "7,1,5;5,4,8"],
     "--shapes=(7, 1, 5): a chain (topk 1) verifies steps + 1 = 8 tokens"),
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


def test_outputs_are_tried_and_a_late_failure_is_one_line(capsys):
  from eagle3jax.bench import report
  from eagle3jax.flags import check_writable, write_output
  with pytest.raises(ValueError, match=r"^--out '/proc/x.json': folder '/proc' is not writable"):
    check_writable("/proc/x.json", "--out")
  with pytest.raises(ValueError, match=r"^--json '/proc/x.json' could not be written: "):
    write_output("/proc/x.json", "--json", lambda f: f.write("{}"))
  # A folder that goes away during the run: the benchmark's table is printed, then one line.
  assert report({"a": 1}, "| table |", "/proc/x.json", "bench_x.py") == 2
  out, err = capsys.readouterr()
  assert out.strip() == "| table |"
  assert err.startswith("bench_x.py: error: --json '/proc/x.json' could not be written")


def test_bench_train_finds_the_manifest_beside_a_relative_target(monkeypatch):
  """--target target from inside the demo folder looked for target/manifest.json."""
  import os
  from eagle3jax import bench_train, demo
  seen = []

  class Found(Exception):
    pass

  def heldout(out_dir, tok, *a, **kw):
    seen.append(out_dir)
    raise Found
  monkeypatch.setattr(demo, "heldout_prompts", heldout)
  monkeypatch.chdir(os.path.join(os.path.dirname(os.path.dirname(__file__)), "models",
                                 "default"))
  with pytest.raises(Found):
    bench_train.train_step_times("target", runs=1, repeats=1)
  assert seen == [os.getcwd()]


def test_positive_int_and_require_modules():
  import argparse
  assert positive_int("3") == 3
  for bad, message in (("0", "0 must be >= 1"), ("-2", "-2 must be >= 1"),
                       ("1.5", "'1.5' is not an integer")):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
      positive_int(bad)
  require_modules({"json": "reading"}, "pip install nothing")
  with pytest.raises(ValueError, match=r"^missing no_such_module_e3j \(the plot\): install "
                                       r"with pip install -e '.\[bench\]'$"):
    require_modules({"json": "reading", "no_such_module_e3j": "the plot"},
                    "pip install -e '.[bench]'")


def test_bench_names_its_missing_optional_packages_before_running(monkeypatch, capsys):
  """Without the [bench] extra, bench.py used to run for minutes and then fail importing
  torch (the transformers baseline) or matplotlib (the plot)."""
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in ("torch", "matplotlib") else real(name, *a))
  for argv, message in (([], "missing matplotlib (the plot), torch (the transformers baseline, "
                             "or pass --no-transformers)"),
                        (["--no-transformers"], "missing matplotlib (the plot): install with "
                                                "pip install -e '.[bench]'")):
    monkeypatch.setattr(sys, "argv", ["scripts/bench.py", "--out", "/tmp/b.json"] + argv)
    code = None
    try:
      code = runpy.run_path("scripts/bench.py", run_name="__main__")
    except SystemExit as stop:
      code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
