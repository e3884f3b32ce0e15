"""Argument checks shared by the public entry points: what counts as an integer or a real
number argument (Python, NumPy and 0-d JAX scalars; never bools, never whole floats standing
in for integers), so ``generate``, ``TreeShape``, ``CaptureSpec``, ``make_mesh``, ``plan`` and
``TrainConfig`` accept and refuse the same values."""

from __future__ import annotations

import math

import jax
import numpy as np


def _scalar(value):
  """A 0-d NumPy or JAX array as its Python value; anything else unchanged."""
  if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer) \
      and value.ndim == 0:
    return value.item()
  return value


def is_integer(value) -> bool:
  """An int, a NumPy integer or a 0-d integer array; not a bool."""
  value = _scalar(value)
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
  """An int or float (Python, NumPy, or a 0-d array); not a bool."""
  value = _scalar(value)
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, (bool, np.bool_)))


def integer(name: str, value, minimum: int | None = None) -> int:
  """``value`` as a Python int, or a ``ValueError`` naming ``name``."""
  if not is_integer(value):
    raise ValueError(f"{name}={value!r} must be an integer"
                     + (f" >= {minimum}" if minimum is not None else ""))
  value = int(_scalar(value))
  if minimum is not None and value < minimum:
    raise ValueError(f"{name}={value} must be an integer >= {minimum}")
  return value


def real(name: str, value) -> float:
  """``value`` as a Python float, or a ``ValueError`` naming ``name`` (a ``TypeError`` for a
  traced value: the entry points that call this run on the host, outside ``jax.jit``)."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a concrete number: this entry point runs on the host, "
                    "outside jax.jit")
  if not is_real(value):
    raise ValueError(f"{name}={value!r} must be a number")
  return float(_scalar(value))


def norm_eps(field: str, value) -> None:
  """An RMSNorm epsilon: a small positive number (NaN, 0, negative or huge values give NaN or
  flat activations, so a model with one decodes garbage without failing)."""
  if not (is_real(value) and 0 < value < 1 and math.isfinite(value)):
    raise ValueError(f"{field}={value!r} must be a small positive number (typically 1e-6 or "
                     "1e-5)")
