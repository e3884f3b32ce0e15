"""The numpy semantics the library's code is written for, whatever the caller's JAX config.

Research code often runs with ``jax_numpy_rank_promotion="raise"`` or
``jax_numpy_dtype_promotion="strict"``. The library's code relies on JAX's defaults (implicit
rank broadcasting, standard type promotion), so every public entry point and the models'
``__call__`` (which a caller may trace inside its own ``jax.jit``) run under them: the caller's
setting still holds for the caller's own code, before and after, and in the callbacks the
library calls back into (``as_caller``: ``generate``'s ``on_tokens``).
"""

from __future__ import annotations

import functools
import threading

import jax

_CALLERS = threading.local()  # .settings: the callers' settings, outermost first (JAX's are
                              # thread-local too)


def standard_numpy(fn):
  """Runs ``fn`` (and everything it traces) with standard rank and dtype promotion."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    stack = _CALLERS.__dict__.setdefault("settings", [])
    stack.append((jax.config.jax_numpy_rank_promotion, jax.config.jax_numpy_dtype_promotion))
    try:
      with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        return fn(*args, **kwargs)
    finally:
      stack.pop()
  return wrapped


def as_caller(fn, *args, **kwargs):
  """Calls the caller's ``fn`` with the settings the library's outermost entry point found.
  While it runs the stack is set aside, so an entry point ``fn`` calls records ``fn``'s own
  settings (and a callback of that one gets them)."""
  stack = getattr(_CALLERS, "settings", None)
  if not stack:
    return fn(*args, **kwargs)
  rank, dtype = stack[0]
  _CALLERS.settings = []
  try:
    with jax.numpy_rank_promotion(rank), jax.numpy_dtype_promotion(dtype):
      return fn(*args, **kwargs)
  finally:
    _CALLERS.settings = stack
