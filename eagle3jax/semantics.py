"""The numpy semantics the library's code is written for, whatever the caller's JAX config.

Research code often runs with ``jax_numpy_rank_promotion="raise"`` or
``jax_numpy_dtype_promotion="strict"``. The library's code relies on JAX's defaults (implicit
rank broadcasting, standard type promotion), so every public entry point and the models'
``__call__`` (which a caller may trace inside its own ``jax.jit``) run under them: the caller's
setting still holds for the caller's own code, before and after.
"""

from __future__ import annotations

import functools

import jax


def standard_numpy(fn):
  """Runs ``fn`` (and everything it traces) with standard rank and dtype promotion."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
      return fn(*args, **kwargs)
  return wrapped
