"""Argument checks shared by the public entry points: what counts as an integer or a real
number argument (Python, NumPy and 0-d JAX scalars; never bools, never whole floats standing
in for integers), so ``generate``, ``TreeShape``, ``CaptureSpec``, ``make_mesh``, ``plan`` and
``TrainConfig`` accept and refuse the same values."""

from __future__ import annotations

import math
import sys

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


def int_fields(obj, names, minimum: int, prefix: str) -> None:
  """Sets the frozen dataclass fields ``names`` of ``obj`` to Python ints (NumPy integers
  accepted, as everywhere else), or raises a ``ValueError`` naming the field."""
  kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
      minimum, f"an integer >= {minimum}")
  for name in names:
    value = getattr(obj, name)
    if not is_integer(value) or _scalar(value) < minimum:
      raise ValueError(f"{prefix} {name}={value!r} must be {kind}")
    object.__setattr__(obj, name, int(_scalar(value)))


def hf_number(hf, key: str, default, kind=float, where: str = "config field"):
  """A numeric ``config.json`` field: ``default`` when absent; a ``ValueError`` naming it when
  it is null or not a number (``float(None)`` would fail deep in a loader otherwise). An
  integer field may be written as a whole float (``8192.0``), as some tools write JSON."""
  if key not in hf:
    return default
  value = _scalar(hf[key])
  whole = is_real(value) and math.isfinite(value) and float(value).is_integer()  # 8192.0
  if not (whole if kind is int else is_real(value)):
    sep = "" if where.endswith(".") else " "
    what = "an integer" if kind is int else "a number"
    absent = "" if default is None else f" (or absent, for {default})"
    raise ValueError(f"{where}{sep}{key}={value!r} must be {what}{absent}")
  return kind(value)


def token_ids(field: str, ids, vocab_size: int) -> tuple[int, ...]:
  """Token ids (e.g. a config's EOS ids) as a tuple of ints in ``[0, vocab_size)``."""
  bad = [i for i in ids if not is_integer(i) or not 0 <= _scalar(i) < vocab_size]
  if bad:
    raise ValueError(f"{field}={list(ids)}: {bad} are not token ids in [0, vocab_size="
                     f"{vocab_size})")
  return tuple(int(_scalar(i)) for i in ids)


FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def float_dtype(name: str, dtype):
  """A parameter dtype: one of ``FLOAT_DTYPES`` (``jnp.bfloat16``, ``"float32"``, ...).
  Integer or 8-bit dtypes would be accepted by the casts and fail (or round everything away)
  inside the first jitted forward."""
  try:
    dt = None if dtype is None else np.dtype(dtype)  # np.dtype(None) is float64
  except TypeError:
    dt = None
  if dt is None or dt.name not in FLOAT_DTYPES:
    raise ValueError(f"{name}={dtype!r} is not a parameter dtype: use one of {FLOAT_DTYPES} "
                     "(jnp.bfloat16 or jnp.float32 usually)")
  return dtype


def seed_and_std(seed, std) -> tuple[int, float]:
  """Random initialisation arguments: a seed >= 0 and a finite std >= 0."""
  seed = integer("seed", seed, 0)
  std = real("std", std)
  if not (math.isfinite(std) and std >= 0):
    raise ValueError(f"std={std} must be a finite number >= 0 (the weights' standard "
                     "deviation)")
  return seed, std


def outside_stacklevel() -> int:
  """``warnings.warn``'s ``stacklevel`` for the first frame outside this package, called from
  the function that warns: the warning names the caller's line, however deep the library's
  own calls (and ``semantics.standard_numpy``'s wrappers) run."""
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "eagle3jax":
    frame, level = frame.f_back, level + 1
  return level
