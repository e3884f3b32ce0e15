"""Runs across processes: two processes x 4 CPU devices on localhost stand in for two hosts
(JAX's distributed runtime, gloo collectives), checked against one process with 8 devices."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import NamedSharding, PartitionSpec as P

import eagle3jax
from eagle3jax import decode_cli, distributed, params
from eagle3jax.sharding import EMBED, EXPERT, HEAD_DIM, KV_HEADS, MLP, TENSOR
from eagle3jax.weights import StackedView
from tests import hf_models
from tests.test_training import _script as train_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES = 2
TIMEOUT_S = 300  # per launch: generous for a loaded 2-core CI machine


class _Recorded(np.ndarray):
  """An array that records every index it is read with (a stand-in for a memory map)."""
  reads: list

  def __getitem__(self, idx):
    self.reads.append(np.asarray(super().__getitem__(idx)).size)
    return np.asarray(super().__getitem__(idx))


def test_each_device_reads_only_its_slice():
  host = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3).view(_Recorded)
  host.reads = []
  mesh = eagle3jax.make_mesh(1, 8)
  sharding = NamedSharding(mesh, P(None, TENSOR, None))
  # 2 KV heads replicated 4 times for 8 tensor ranks: each device holds (and reads) one head.
  arr = params._place(host, "k_proj", (4, 8, 3), (EMBED, KV_HEADS, HEAD_DIM), np.float32,
                      sharding, 4)
  np.testing.assert_array_equal(np.asarray(arr), np.repeat(np.asarray(host), 4, axis=1))
  assert host.reads and all(n == 4 * 3 for n in host.reads)


def test_each_device_reads_only_its_experts():
  parts = [np.full((2, 3), e, np.float32).view(_Recorded) for e in range(8)]
  for part in parts:
    part.reads = []
  mesh = eagle3jax.make_mesh(1, 8)
  arr = params._place(StackedView(parts), "experts", (8, 2, 3), (EXPERT, EMBED, MLP),
                      np.float32, NamedSharding(mesh, P(TENSOR, None, None)), 1)
  np.testing.assert_array_equal(np.asarray(arr), np.stack([np.asarray(p) for p in parts]))
  assert all(part.reads == [6] for part in parts)  # one expert per device, read once


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_processes=2, process_id=0), "['coordinator'] not given"),
    (dict(coordinator="localhost", num_processes=2, process_id=0), "must be HOST:PORT"),
    (dict(coordinator="localhost:1234", num_processes=2, process_id=2),
     "process_id=2 must be in [0, num_processes=2)"),
])
def test_initialize_refuses_incomplete_runs(kwargs, message, monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(ValueError) as e:
    distributed.initialize(**kwargs)
  assert message in str(e.value)


def test_decode_flags_error_is_one_line(monkeypatch, capsys):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  assert decode_cli.run(["--num-processes", "2", "--process-id", "0"]) == 2
  err = capsys.readouterr().err
  assert "['coordinator'] not given" in err and len(err.strip().splitlines()) == 1


def test_multiprocess_mesh_must_span_every_device(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"uses 4 devices, but this run has 2 processes with 8 "
                     r"devices in all .* choose DATA\*TENSOR=8"):
    eagle3jax.make_mesh(1, 4)
  assert eagle3jax.make_mesh(2, 4).devices.size == 8


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))}
  # 4 devices each; the other flags (tests/conftest.py's optimisation level) as in-process.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env.update(XLA_FLAGS=" ".join(["--xla_force_host_platform_device_count=4"] + flags),
             JAX_PLATFORMS="cpu",
             JAX_DEFAULT_MATMUL_PRECISION="highest")  # as tests/conftest.py sets in-process
  return env


def _start(script: str, argv: list[str], logs) -> list[subprocess.Popen]:
  """Launches the processes of one run; their stdout/stderr go to files under ``logs``."""
  port = _free_port()
  procs = []
  for i in range(PROCESSES):
    out, err = logs / f"{script}.{port}.{i}.out", logs / f"{script}.{port}.{i}.err"
    with open(out, "w") as fo, open(err, "w") as fe:
      p = subprocess.Popen(
          [sys.executable, os.path.join(REPO, "scripts", script), *argv,
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(PROCESSES),
           "--process-id", str(i)], cwd=REPO, env=_env(), stdout=fo, stderr=fe)
    p.out, p.err = out, err
    procs.append(p)
  return procs


def _kill(procs) -> None:
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGKILL)
  for p in procs:
    p.wait()


def _finish(procs) -> list[str]:
  """Waits for every process (bounded); returns their stdouts. As soon as one fails (or the
  time is up) all are killed: the others would wait for it at their next collective."""
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while any(p.poll() is None for p in procs):
      for i, p in enumerate(procs):
        if p.poll() not in (None, 0):
          pytest.fail(f"process {i} exited with {p.returncode}:\n{p.err.read_text()[-3000:]}")
      if time.monotonic() > deadline:
        pytest.fail(f"the processes did not finish within {TIMEOUT_S} s")
      time.sleep(0.1)
    for i, p in enumerate(procs):
      assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n" \
          f"{p.err.read_text()[-3000:]}"
    return [p.out.read_text() for p in procs]
  finally:
    _kill(procs)


def test_decode_two_processes_equals_one(capsys, tmp_path):
  argv = ["--mesh", "1,8", "--json", "--max-new-tokens", "16"]
  assert decode_cli.run(argv) == 0  # this process: 8 devices (tests/conftest.py)
  expected = json.loads(capsys.readouterr().out)
  out0, out1 = _finish(_start("decode.py", argv, tmp_path))
  got = json.loads(out0)  # process 0 prints exactly one JSON object ...
  assert out1 == ""  # ... and process 1 nothing
  assert got["output_ids"] == expected["output_ids"] and len(got["output_ids"]) == 16
  assert got["accept_length_mean"] == expected["accept_length_mean"]


def test_streaming_rows_sharded_across_processes(capsys, tmp_path):
  """On a (2, 4) mesh the one prompt runs as two rows (its batch bucket), one per process:
  streaming gathers the rows' tokens, lengths and flags each round (one collective) and
  prints the text one process alone prints."""
  argv = ["--mesh", "2,4", "--max-new-tokens", "16", "--prompt-ids", "5,6,7,8"]
  assert decode_cli.run(argv) == 0
  expected = capsys.readouterr().out.split("\n\n")[0]
  out0, out1 = _finish(_start("decode.py", argv, tmp_path))
  assert out1 == "" and len(expected.strip()) >= 16
  assert out0.split("\n\n")[0] == expected


def _read(path: str) -> dict:
  return safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))


def test_training_killed_and_resumed_across_processes(tmp_path):
  target = str(tmp_path / "target")
  hf_models.make_checkpoint(target, "llama", layers=4)  # 2 KV heads: replicated for tensor=4
  rng = np.random.default_rng(0)
  prompts = tmp_path / "prompts.json"
  # 7 sequences in batches of 4: a checkpoint at step 3 or 6 sits mid-epoch (cursor 5 or 3),
  # so a resume that lost the data cursor would train on other batches.
  prompts.write_text(json.dumps([rng.integers(3, 97, int(rng.integers(3, 8))).tolist()
                                 for _ in range(7)]))
  steps = 12

  def argv(out):  # data=2: batches (and regeneration) split across the two processes
    return ["--target", target, "--out", str(out), "--prompt-ids-file", str(prompts),
            "--mesh", "2,4", "--capture", "0,1,2", "--total-steps", str(steps),
            "--warmup-steps", "2", "--checkpoint-every", "3", "--batch-size", "4",
            "--seq-len", "24", "--ttt-steps", "2", "--max-new-tokens", "12",
            "--draft-vocab-size", "32", "--learning-rate", "0.003", "--no-progress"]

  # Uninterrupted, in this process (8 devices, the same 2 x 4 mesh).
  assert train_script().run(argv(tmp_path / "whole")) == 0

  # Two processes, killed (SIGKILL, both) as soon as the first checkpoint is complete.
  out = tmp_path / "split"
  first_ckpt = out / "train_state" / "steps" / "3"
  procs = _start("train_drafter.py", argv(out), tmp_path)
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while not first_ckpt.exists():
      assert all(p.poll() is None for p in procs), "a process exited before its checkpoint"
      assert time.monotonic() < deadline, f"no checkpoint within {TIMEOUT_S} s"
      time.sleep(0.02)
  finally:
    _kill(procs)
  saved = sorted(int(d) for d in os.listdir(out / "train_state" / "steps") if d.isdigit())
  assert saved[-1] < steps and not (out / "model.safetensors").exists(), (
      f"the first run got to checkpoints {saved} before it was killed")

  # The same command again resumes from the last checkpoint.
  out0, out1 = _finish(_start("train_drafter.py", argv(out), tmp_path))
  assert f"done: step {steps}" in out0 and out1 == ""
  whole, split = _read(str(tmp_path / "whole")), _read(str(out))
  assert sorted(whole) == sorted(split)
  for name in whole:
    np.testing.assert_allclose(split[name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)
