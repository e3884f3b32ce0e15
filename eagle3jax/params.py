"""Turning an abstract NNX model into one with real, sharded parameters.

Models are constructed abstractly (``nnx.eval_shape``); each parameter carries logical
``axes`` and an ``init`` kind. ``materialize`` asks a ``fill`` function for each parameter's
host value (from a checkpoint or a seeded RNG) and places it with the sharding the parameter
rules give, transferring to each device only its own shard
(``jax.make_array_from_callback``). ``fill`` may return a lazy view of a memory-mapped
checkpoint: only the slices this process's devices hold are then read.

Stacked layers (``eagle3jax.stack``: a leading ``LAYERS`` axis) are filled one layer at a
time: ``fill`` is asked for ``layers.{i}.<path>`` in the per-layer shape, as checkpoints name
them, and each layer is written into its slot of the stacked device array (donated, so at most
one layer's host copy exists at a time).
"""

from __future__ import annotations

import functools
import warnings
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eagle3jax import checks, quant
from eagle3jax.sharding import KV_HEADS, LAYERS, param_spec, undivided

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
  with jax.set_mesh(mesh):  # not a caller's mesh context: the layer writes trace on this one
    return _materialize(factory, mesh, fill, kv_repeat)


def _materialize(factory, mesh: Mesh, fill: Fill, kv_repeat: int) -> nnx.Module:
  abstract = nnx.eval_shape(factory)
  graphdef, state = nnx.split(abstract)
  flat = nnx.to_flat_state(state)
  _warn_replicated(flat, mesh)
  leaves = [None] * len(flat)
  for unit in _units(flat):
    first_meta = flat[unit[0]][1].get_metadata()
    if first_meta.get("axes") is None:
      raise ValueError(f"parameter {path_str(flat[unit[0]][0])} has no logical axes")
    if first_meta["axes"][0] != LAYERS:
      for j in unit:
        path, var = flat[j]
        meta, value = var.get_metadata(), var.get_value()
        shape, axes = tuple(value.shape), meta["axes"]
        sharding = NamedSharding(mesh, param_spec(axes, shape, mesh))
        host = fill(path_str(path), _logical(shape, axes, kv_repeat), meta.get("init", "normal"))
        leaves[j] = var.replace(_place(host, path_str(path), shape, axes, value.dtype, sharding,
                                       kv_repeat))
      continue
    # A layer stack: one layer at a time into its slot; the parts of a quantized weight
    # (values, scale) are filled together, so a loader converts each layer's module once.
    arrays = {}
    for j in unit:
      value = flat[j][1].get_value()
      axes = flat[j][1].get_metadata()["axes"]
      arrays[j] = _zeros(tuple(value.shape), value.dtype,
                         NamedSharding(mesh, param_spec(axes, value.shape, mesh)))
    for i in range(flat[unit[0]][1].get_value().shape[0]):
      for j in unit:
        path, var = flat[j]
        meta, value = var.get_metadata(), var.get_value()
        shape, axes = tuple(value.shape), meta["axes"]
        layer_name = f"layers.{meta.get('layer_offset', 0) + i}.{path_str(path[1:])}"
        layer_sharding = NamedSharding(mesh, P(*tuple(param_spec(axes, shape, mesh))[1:]))
        host = fill(layer_name, _logical(shape[1:], axes[1:], kv_repeat),
                    meta.get("init", "normal"))
        piece = _place(host, layer_name, shape[1:], axes[1:], value.dtype, layer_sharding,
                       kv_repeat)
        arrays[j] = _set_layer(arrays[j], piece, i)
    for j in unit:
      leaves[j] = flat[j][1].replace(arrays[j])
  state = nnx.from_flat_state([(p, v) for (p, _), v in zip(flat, leaves)])
  return nnx.merge(graphdef, state)


def _warn_replicated(flat, mesh: Mesh) -> None:
  """Warns when the mesh leaves weights whole on every device that the rules would split (a
  ``tensor`` size that does not divide the heads, MLP columns or vocabulary): tensor
  parallelism the caller asked for that they would otherwise only meet as memory.

  A quantized weight counts once, by its stored bytes: its values (INT4 packed, FP8) and those
  of its scales that are left whole too. Scales alone never warn: their block counts are not
  model dimensions, and a weight split while its scales are not costs little."""
  dims, nbytes, count = {}, 0, 0
  for unit in _units(flat):
    found_any, scales = False, []
    for j in unit:
      meta, value = flat[j][1].get_metadata(), flat[j][1].get_value()
      part = quant.part_of(meta.get("init", "normal"))
      if meta.get("axes") is None:
        continue  # refused by the caller, naming the parameter
      found = undivided(meta["axes"], value.shape, mesh)
      if part is not None and part[1] == "scale":
        scales.append(value.size * np.dtype(value.dtype).itemsize if found else 0)
        continue
      for name, dim, mesh_axis, size in found:
        dims[(name, dim, mesh_axis, size)] = None
      if found:
        found_any = True
        nbytes += value.size * np.dtype(value.dtype).itemsize
    if found_any:
      count += 1
      nbytes += sum(scales)
  if dims:
    what = ", ".join(f"{name} ({dim}) over {axis}={size}" for name, dim, axis, size in dims)
    mib = nbytes / 2**20
    amount = f"{mib:.1f}" if mib >= 1 else f"{mib:.4g}"  # a tiny model's weights are not 0.0
    warnings.warn(f"this mesh does not divide {what}: {count} weights ({amount} "
                  "MiB) are replicated on every device instead of split. Use a mesh axis size "
                  "that divides them to shard them", stacklevel=checks.outside_stacklevel())


def _units(flat) -> list[list[int]]:
  """Indices of ``flat`` grouped into fill units: the parts of one quantized weight
  (``eagle3jax.quant``: same parent path) together, every other parameter alone."""
  units, parents = [], {}
  for j, (path, var) in enumerate(flat):
    if quant.part_of(var.get_metadata().get("init", "normal")) is None:
      units.append([j])
    elif tuple(path[:-1]) in parents:
      units[parents[tuple(path[:-1])]].append(j)
    else:
      parents[tuple(path[:-1])] = len(units)
      units.append([j])
  return units


def _logical(shape, axes, kv_repeat: int) -> tuple[int, ...]:
  """The shape ``fill`` is asked for: KV heads before replication."""
  logical = list(shape)
  if KV_HEADS in axes:
    logical[list(axes).index(KV_HEADS)] //= kv_repeat
  return tuple(logical)


def _place(host, name, shape, axes, dtype, sharding, kv_repeat: int) -> jax.Array:
  """Checks a host value's shape, replicates KV heads and places it with ``sharding``.

  ``host`` may be a lazy view (a memory-mapped checkpoint tensor, transposed or reshaped):
  each device's callback reads, converts and KV-replicates only the slice that device holds,
  and ``make_array_from_callback`` asks only for this process's devices, so in a
  multi-process run every process reads just its own shards from disk.
  """
  if not (hasattr(host, "shape") and hasattr(host, "__getitem__")):
    host = np.asarray(host)  # lazy views (arrays, weights.StackedView) stay lazy
  logical = _logical(shape, axes, kv_repeat)
  if tuple(host.shape) != logical:
    raise ValueError(f"weight for {name}: shape {tuple(host.shape)} does not match the "
                     f"model's {logical}")
  kv_axis = list(axes).index(KV_HEADS) if KV_HEADS in axes and kv_repeat > 1 else None
  return jax.make_array_from_callback(
      tuple(shape), sharding, lambda idx: _read_slice(host, idx, kv_axis, kv_repeat, dtype))


def _read_slice(host: np.ndarray, idx: tuple, kv_axis: int | None, kv_repeat: int,
                dtype) -> np.ndarray:
  """``np.repeat(host, kv_repeat, kv_axis)[idx].astype(dtype)``, reading only that slice."""
  idx = tuple(idx) + (slice(None),) * (host.ndim - len(idx))
  if kv_axis is not None:
    rows = np.arange(host.shape[kv_axis] * kv_repeat)[idx[kv_axis]] // kv_repeat
    idx = idx[:kv_axis] + (rows,) + idx[kv_axis + 1:]
  return np.array(host[idx], dtype=dtype)  # a copy: device arrays never alias the file


def clear_programs() -> None:
  """Frees the zero-fill programs kept for later loads (``eagle3jax.clear_compiled``)."""
  _zeros_fn.cache_clear()


def _zeros(shape, dtype, sharding):
  return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.lru_cache(maxsize=64)
def _zeros_fn(shape, dtype, sharding):
  # Kept per (shape, dtype, sharding), so a second load of the same model compiles nothing
  # (a fresh jax.jit per call compiled every zero-filled buffer again).
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_layer(stack: jax.Array, piece: jax.Array, i) -> jax.Array:
  return jax.lax.dynamic_update_index_in_dim(stack, piece.astype(stack.dtype), i, 0)


def random_fill(seed: int = 0, std: float = 0.02) -> Fill:
  """Seeded N(0, std) weights, ones for norms, zeros for biases, quantized weights of about
  that size (``quant.random_part``); identical on every mesh."""
  seed, std = checks.seed_and_std(seed, std)
  def fill(name, shape, init):
    if quant.part_of(init) is not None:
      rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
      return quant.random_part(init, shape, rng, std)
    if init == "ones":
      return np.ones(shape, np.float32)
    if init == "zeros":
      return np.zeros(shape, np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.normal(0.0, std, shape).astype(np.float32)
  return fill
