"""Test setup: 8 fake CPU devices (before JAX initialises) and float32 matmuls.

The repository root goes last on ``sys.path`` (and leaves ``PYTHONPATH``, which subprocesses
inherit). ``python -m pytest`` and pytest-xdist put it first, where its ``kernels/`` and
``sharding/`` folders, imported as ``eagle3jax.kernels`` and ``eagle3jax.sharding``, would also
be found as the top-level packages ``kernels`` and ``sharding`` and shadow the installed ones of
those names (transformers >= 5.25 imports PyPI's ``kernels``). pytest's importlib import mode
(pyproject.toml) keeps it from putting the root back; last, it still serves ``tests.*``.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _not_root(entries):
  return [p for p in entries if os.path.abspath(p or os.curdir) != REPO]


sys.path[:] = _not_root(sys.path) + [REPO]
if "PYTHONPATH" in os.environ:
  os.environ["PYTHONPATH"] = os.pathsep.join(
      _not_root(os.environ["PYTHONPATH"].split(os.pathsep)))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
