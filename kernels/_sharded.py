"""Tree attention on a device mesh: batch over one mesh axis, attention heads over another.

Attention is independent per row and per KV head group, so the kernel runs unchanged on each
device's shard under ``jax.shard_map``: rows over ``batch_axis``; query heads ``N`` and KV heads
``K`` together over ``head_axis`` (a contiguous block of ``N / t`` query heads uses exactly the
local block of ``K / t`` KV heads). ``lengths`` and ``tree_mask`` follow the batch. A dimension
that its mesh axis does not divide (or an axis the mesh lacks) is replicated instead, the same
rule as ``eagle3jax.sharding``; heads are sharded only when both ``N`` and ``K`` divide.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3jax.kernels.tree_attention import (
    check_tree_tokens, tree_attention, tree_attention_reference, validate_inputs)

_IMPLS = ("pallas", "reference")


def _axis_if_divides(mesh, axis: str | None, *dims: int) -> str | None:
  if axis is None or axis not in mesh.axis_names:
    return None
  size = dict(mesh.shape)[axis]
  return axis if all(d % size == 0 for d in dims) else None


def tree_attention_sharded(q, k, v, lengths, tree_mask, *, mesh, batch_axis: str | None = "data",
                           head_axis: str | None = "tensor", impl: str = "pallas",
                           interpret: bool = False, sm_scale=None):
  """:func:`tree_attention` under ``jax.shard_map`` on ``mesh``.

  Args:
    q, k, v, lengths, tree_mask: as in :func:`tree_attention` (global shapes).
    mesh: a ``Mesh`` or ``AbstractMesh`` (e.g. ``jax.sharding.get_abstract_mesh()`` inside
      ``jax.jit`` under ``jax.set_mesh``). An empty mesh runs the kernel unsharded.
    batch_axis: mesh axis for ``B`` (replicated if it does not divide ``B``).
    head_axis: mesh axis for ``N`` and ``K`` (replicated unless it divides both).
    impl: ``"pallas"`` (the kernel) or ``"reference"`` (plain jnp).
    interpret: run the Pallas kernel in interpret mode.
    sm_scale: score scale, default ``1 / sqrt(H)``.

  Returns:
    ``[B, P, N, H]`` in ``q``'s dtype, laid out ``P(batch_axis, None, head_axis, None)`` (with
    the replicated axes dropped).
  """
  if impl not in _IMPLS:
    raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
  validate_inputs(q, k, v, lengths, tree_mask)
  if impl == "pallas":
    check_tree_tokens(q.shape[1])  # before shard_map, so the message is not a traced one
    local = functools.partial(tree_attention, sm_scale=sm_scale, interpret=interpret)
  else:
    local = functools.partial(tree_attention_reference, sm_scale=sm_scale)
  if mesh is None or mesh.empty:
    return local(q, k, v, lengths, tree_mask)

  b, _, n, _ = q.shape
  data = _axis_if_divides(mesh, batch_axis, b)
  heads = _axis_if_divides(mesh, head_axis, n, k.shape[1])
  q_spec = P(data, None, heads, None)                                    # [B, P, N, H]
  cache_spec = P(data, heads, None, None)                                # [B, K, S, H]
  specs = (q_spec, cache_spec, cache_spec, P(data), P(data, None, None))
  args = (q, k, v, lengths, tree_mask)
  if _is_explicit(mesh):
    # Under Explicit axes the sharding is part of the type: move each input to its spec first
    # (a no-op when it already matches) so shard_map sees the layout it asks for.
    args = tuple(jax.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, specs))
  fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
  return fn(*args)


def _is_explicit(mesh) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
