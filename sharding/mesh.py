"""The device mesh: the one place where mesh axis types are chosen.

Every mesh in eagle3jax has two named axes, ``data`` (batch) and ``tensor`` (attention heads,
MLP columns, vocabulary), and both are **Explicit** axes. With Explicit axes an array's sharding
is part of its type inside ``jax.jit``: an operation whose operands disagree on layout (for
example concatenating a replicated embedding with tensor-sharded layer outputs) raises
``ShardingTypeError`` while tracing instead of silently producing a feature of the wrong width.
That is exactly the failure eagle3jax exists to prevent (see the README, "capture convention"),
so no other module picks axis types.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import AxisType, Mesh

from eagle3jax.checks import is_integer

DATA = "data"
TENSOR = "tensor"
MESH_AXES = (DATA, TENSOR)


def make_mesh(data: int = 1, tensor: int = 1, *, devices=None) -> Mesh:
  """Builds a ``(data, tensor)`` mesh with Explicit axis types.

  Args:
    data: size of the batch axis.
    tensor: size of the tensor-parallel axis.
    devices: devices to use (default: ``jax.devices()``, which in a multi-process run are
      every process's devices); the first ``data * tensor`` are used. In a multi-process run
      the mesh must use all of them.

  Returns:
    A ``jax.sharding.Mesh`` with axes ``("data", "tensor")``, both ``AxisType.Explicit``.

  Raises:
    ValueError: if a size is not a positive integer, there are too few devices, a device is
      listed twice, or a multi-process mesh leaves devices out.
  """
  for name, size in (("data", data), ("tensor", tensor)):
    if not is_integer(size) or size < 1:
      raise ValueError(f"make_mesh: {name}={size!r} must be a positive integer")
  data, tensor = int(data), int(tensor)
  devices = list(jax.devices() if devices is None else devices)
  repeated = sorted({str(d) for d in devices if devices.count(d) > 1})
  if repeated:  # XLA fails later, at the first placement, with a shard-count error
    raise ValueError(f"make_mesh(devices=...) lists {repeated} more than once: a mesh needs "
                     "distinct devices")
  need = data * tensor
  processes = jax.process_count()
  if processes > 1 and need != len(devices):
    raise ValueError(
        f"make_mesh(data={data}, tensor={tensor}) uses {need} devices, but this run has "
        f"{processes} processes with {len(devices)} devices in all "
        f"({jax.local_device_count()} per process); a multi-process mesh must span every "
        f"device: choose DATA*TENSOR={len(devices)}")
  if len(devices) < need:
    platform = devices[0].platform if devices else "none"
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    hint = ("choose a mesh of at most that many devices" if platform != "cpu" or forced else
            "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing "
            "jax, or choose a smaller mesh")
    raise ValueError(
        f"make_mesh(data={data}, tensor={tensor}) needs {need} devices but only "
        f"{len(devices)} are available ({platform}): {hint}")
  return jax.make_mesh(
      (data, tensor), MESH_AXES, axis_types=(AxisType.Explicit, AxisType.Explicit),
      devices=devices[:need])


def validate_mesh(mesh: Mesh | None) -> Mesh:
  """The mesh a model is placed on: ``mesh`` itself when it is one ``make_mesh`` would build
  (axes ``("data", "tensor")``, both Explicit), ``single_device_mesh()`` for None.

  Raises:
    ValueError: naming what differs (not a ``Mesh``, other axis names, axes that are not
      Explicit), so a hand-built mesh fails here rather than at the first annotation.
  """
  if mesh is None:
    return single_device_mesh()
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh built by eagle3jax.make_mesh(data, "
                     f"tensor); got {type(mesh).__name__}")
  if tuple(mesh.axis_names) != MESH_AXES:
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} must be {MESH_AXES} (batch, then "
                     "tensor parallelism); build the mesh with eagle3jax.make_mesh(data, tensor)")
  types = tuple(getattr(mesh, "axis_types", ()) or ())
  loose = [n for n, t in zip(mesh.axis_names, types) if t != AxisType.Explicit]
  if len(types) != len(mesh.axis_names) or loose:
    raise ValueError(
        f"mesh axes {loose or list(mesh.axis_names)} are not Explicit (axis types "
        f"{[str(t) for t in types]}): eagle3jax needs Explicit axes so that a capture laid out "
        "differently from the others fails while tracing instead of feeding the drafter a "
        "wrong feature; build the mesh with eagle3jax.make_mesh(data, tensor)")
  return mesh


def single_device_mesh() -> Mesh:
  """A 1x1 mesh on the first device: the default when the caller passes no mesh."""
  return make_mesh(1, 1)
