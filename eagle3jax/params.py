"""Turning an abstract NNX model into one with real, sharded parameters.

Models are constructed abstractly (``nnx.eval_shape``); each parameter carries logical
``axes`` and an ``init`` kind. ``materialize`` asks a ``fill`` function for each parameter's
host value (from a checkpoint or a seeded RNG) and places it with the sharding the parameter
rules give, transferring to each device only its own shard
(``jax.make_array_from_callback``).
"""

from __future__ import annotations

import zlib
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from eagle3jax.sharding import KV_HEADS, param_spec

# fill(path, logical_shape, init) -> host array in the logical (unreplicated) shape.
Fill = Callable[[str, tuple[int, ...], str], np.ndarray]


def path_str(path) -> str:
  return ".".join(str(p) for p in path)


def materialize(factory: Callable[[], nnx.Module], mesh: Mesh, fill: Fill,
                kv_repeat: int = 1) -> nnx.Module:
  """Builds ``factory()`` abstractly and fills every parameter through ``fill``.

  Parameters with a ``KV_HEADS`` axis are asked for in their logical shape (K heads) and
  replicated ``kv_repeat`` times along that axis (see ``llama.kv_head_replication``).
  """
  abstract = nnx.eval_shape(factory)
  graphdef, state = nnx.split(abstract)
  flat = nnx.to_flat_state(state)
  leaves = []
  for path, var in flat:
    meta = var.get_metadata()
    axes = meta.get("axes")
    value = var.get_value()
    shape, dtype = tuple(value.shape), value.dtype
    name = path_str(path)
    if axes is None:
      raise ValueError(f"parameter {name} has no logical axes")
    logical = list(shape)
    kv_axis = axes.index(KV_HEADS) if KV_HEADS in axes else None
    if kv_axis is not None:
      logical[kv_axis] //= kv_repeat
    host = np.asarray(fill(name, tuple(logical), meta.get("init", "normal")))
    if tuple(host.shape) != tuple(logical):
      raise ValueError(f"weight for {name}: shape {tuple(host.shape)} does not match the "
                       f"model's {tuple(logical)}")
    if kv_axis is not None and kv_repeat > 1:
      host = np.repeat(host, kv_repeat, axis=kv_axis)
    host = host.astype(dtype)
    sharding = NamedSharding(mesh, param_spec(axes, shape, mesh))
    arr = jax.make_array_from_callback(shape, sharding, lambda idx, h=host: h[idx])
    leaves.append(var.replace(arr))
  state = nnx.from_flat_state([(p, v) for (p, _), v in zip(flat, leaves)])
  return nnx.merge(graphdef, state)


def random_fill(seed: int = 0, std: float = 0.02) -> Fill:
  """Seeded N(0, std) weights, ones for norms, zeros for biases; identical on every mesh."""
  def fill(name, shape, init):
    if init == "ones":
      return np.ones(shape, np.float32)
    if init == "zeros":
      return np.zeros(shape, np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.normal(0.0, std, shape).astype(np.float32)
  return fill
