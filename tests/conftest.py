"""Test setup: 8 fake CPU devices (before JAX initialises), float32 matmuls, and one
persistent compilation cache per run (below).

The repository root goes last on ``sys.path`` (and leaves ``PYTHONPATH``, which subprocesses
inherit). ``python -m pytest`` and pytest-xdist put it first, where its ``kernels/`` and
``sharding/`` folders, imported as ``eagle3jax.kernels`` and ``eagle3jax.sharding``, would also
be found as the top-level packages ``kernels`` and ``sharding`` and shadow the installed ones of
those names (transformers >= 5.25 imports PyPI's ``kernels``). pytest's importlib import mode
(pyproject.toml) keeps it from putting the root back; last, it still serves ``tests.*``.
"""

import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _not_root(entries):
  return [p for p in entries if os.path.abspath(p or os.curdir) != REPO]


sys.path[:] = _not_root(sys.path) + [REPO]
if "PYTHONPATH" in os.environ:
  os.environ["PYTHONPATH"] = os.pathsep.join(
      _not_root(os.environ["PYTHONPATH"].split(os.pathsep)))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The tests check values, not speed, and most of their time is XLA compiling small programs:
# LLVM at optimisation level 0 compiles them faster (the suite took about a fifth less) and
# computes the same values. A level the caller set is kept; subprocesses inherit this one.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the run: many tests compile the same programs (the
# helper models, the shipped pair, the MoE layers) in different test files, which pytest-xdist
# spreads over its workers. The controller makes the folder before the workers start; they, and
# the scripts the tests run as subprocesses, inherit it through the environment, and it goes
# when the run ends. A cache the caller set (JAX_COMPILATION_CACHE_DIR) is used as it is.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="eagle3jax-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
