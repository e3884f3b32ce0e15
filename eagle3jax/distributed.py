"""Runs that span several processes (hosts): JAX's own distributed runtime.

``initialize`` joins this process to a multi-process run before anything else touches JAX;
afterwards ``jax.devices()`` lists every process's devices, ``make_mesh`` spans them all, and
every jitted function runs as one program across the processes (each process drives its own
devices, and all of them must make the same calls in the same order).

The run is described by arguments, by the environment (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) or, with ``coordinator="auto"``, by a cluster
scheduler JAX recognises (SLURM, Open MPI, Cloud TPU, Kubernetes). On CPU the cross-process
collectives are gloo over TCP, so a test can run several processes on one machine.

Outputs (text, JSON, files) are written by the main process (``is_main_process``); values that
live sharded across processes come to every host through ``to_host``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import numpy as np

AUTO = "auto"
_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")


def _env_int(name: str) -> int | None:
  text = os.environ.get(name)
  if text is None or text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"environment variable {name}={text!r} must be an integer") from None


def requested(coordinator: str | None = None, num_processes: int | None = None,
              process_id: int | None = None) -> bool:
  """Whether these arguments or the environment ask for a multi-process run."""
  return (coordinator is not None or num_processes is not None or process_id is not None
          or any(os.environ.get(k) for k in _ENV))


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300) -> None:
  """Joins a multi-process run (``jax.distributed.initialize``); call before any JAX work.

  Args:
    coordinator: ``HOST:PORT`` of process 0's coordinator (every process passes the same), or
      ``"auto"`` to take everything from a cluster scheduler (SLURM, Open MPI, ...). Default:
      ``$JAX_COORDINATOR_ADDRESS``.
    num_processes: processes in the run (default ``$JAX_NUM_PROCESSES``).
    process_id: this process's index in ``[0, num_processes)`` (default ``$JAX_PROCESS_ID``).
    timeout_s: how long to wait for the other processes to join.

  Raises:
    ValueError: incomplete or inconsistent arguments, or a second call that disagrees with
      the first.
    RuntimeError: JAX already ran a computation in this process (initialize first).
  """
  auto = coordinator == AUTO
  if not auto:
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = num_processes if num_processes is not None else _env_int(
        "JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    missing = [k for k, v in given.items() if v is None]
    if missing:
      raise ValueError(
          f"a multi-process run needs coordinator, num_processes and process_id; {missing} "
          "not given (pass --coordinator HOST:PORT --num-processes N --process-id I, set "
          "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or use "
          "--coordinator auto under a cluster scheduler such as SLURM)")
    if not _ADDRESS.match(coordinator) or not 0 < int(_ADDRESS.match(coordinator).group(1)) \
        < 65536:
      raise ValueError(f"coordinator {coordinator!r} must be HOST:PORT (e.g. 10.0.0.1:1234), "
                       "the address of process 0, the same on every process")
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be an integer")
    if num_processes < 1:
      raise ValueError(f"num_processes={num_processes} must be >= 1")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must be in [0, num_processes="
                       f"{num_processes})")
  if jax.distributed.is_initialized():
    if not auto and (jax.process_count(), jax.process_index()) != (num_processes, process_id):
      raise ValueError(
          f"the distributed runtime is already initialised as process {jax.process_index()} "
          f"of {jax.process_count()}; cannot re-initialise as process {process_id} of "
          f"{num_processes}")
    return
  # gloo is JAX's default for CPU collectives; set it explicitly, so that CPU processes (the
  # tests' stand-in for hosts) can run collectives with each other whatever the default is.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    if auto:
      jax.distributed.initialize(initialization_timeout=timeout_s)
    else:
      jax.distributed.initialize(coordinator, num_processes, process_id,
                                 initialization_timeout=timeout_s)
  except ValueError as e:
    if auto:
      raise ValueError(f"--coordinator auto: no cluster scheduler JAX recognises was found "
                       f"({e}); pass --coordinator HOST:PORT --num-processes N --process-id "
                       "I instead") from None
    raise


def distributed_flags(p: argparse.ArgumentParser) -> None:
  """Adds ``--coordinator HOST:PORT --num-processes N --process-id I`` to a script's flags."""
  g = p.add_argument_group("multi-process runs (one process per host; README: Multi-host)")
  g.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                 help="process 0's address, the same on every process; 'auto' takes the run "
                      "from a cluster scheduler (SLURM, Open MPI)")
  g.add_argument("--num-processes", type=int, default=None, metavar="N",
                 help="number of processes in the run")
  g.add_argument("--process-id", type=int, default=None, metavar="I",
                 help="this process's index in [0, N)")


def initialize_from_flags(args: argparse.Namespace) -> None:
  """``initialize`` with the ``distributed_flags``, when they or the environment ask for a
  multi-process run (otherwise nothing: a single-process run).

  For scripts: the collectives library prints connection notes (``[Gloo] Rank 0 is connected
  ...``) on the process's standard output; they are sent to stderr, so that stdout carries
  only what the script prints (``--json``: exactly one JSON object).
  """
  if requested(args.coordinator, args.num_processes, args.process_id):
    initialize(args.coordinator, args.num_processes, args.process_id)
    _native_stdout_to_stderr()


def _native_stdout_to_stderr() -> None:
  """Points file descriptor 1 at stderr and ``sys.stdout`` at the original stdout."""
  sys.stdout.flush()
  original = os.dup(1)
  os.dup2(2, 1)
  sys.stdout = os.fdopen(original, "w", buffering=1)


def process_index() -> int:
  """This process's index (0 in a single-process run)."""
  return jax.process_index()


def process_count() -> int:
  """Number of processes in the run (1 when ``initialize`` was not called)."""
  return jax.process_count()


def is_main_process() -> bool:
  """True on process 0: the one that writes outputs."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier ``name`` (a no-op in one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


def to_host(x) -> np.ndarray:
  """The whole value of array ``x`` as a numpy array on every process.

  Arrays this process holds completely (single-process runs, replicated values) are copied
  directly; arrays sharded across processes are all-gathered (a collective: every process
  must call it for the same array).
  """
  return to_host_all(x)[0]


def to_host_all(*xs) -> tuple[np.ndarray, ...]:
  """``to_host`` of several arrays with at most one collective: the arrays sharded across
  processes are all-gathered together (streaming reads three per round)."""
  out = list(xs)
  remote = [i for i, x in enumerate(xs)
            if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)]
  for i, x in enumerate(xs):
    if i not in remote:
      out[i] = np.asarray(x)
  if remote:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    gathered = multihost_utils.process_allgather(tuple(xs[i] for i in remote), tiled=True)
    for i, g in zip(remote, gathered):
      out[i] = np.asarray(g)
  return tuple(out)


def same_on_all(value: int, what: str) -> None:
  """Raises ValueError unless every process passes the same integer ``value``.

  For decisions each process takes from its own disk (a checkpoint exists, a file is there):
  if they differ, the processes would run different programs and hang.
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  values = np.asarray(multihost_utils.process_allgather(np.int64(value))).reshape(-1)
  if (values != values[0]).any():
    raise ValueError(f"processes disagree on {what}: {values.tolist()} (by process); every "
                     "process must see the same files: put checkpoints and outputs on a "
                     "filesystem all hosts share")
