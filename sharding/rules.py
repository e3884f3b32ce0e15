"""Logical axis names and the rules that map them to mesh axes.

Model code names *logical* axes (``EMBED``, ``HEADS``, ...), never mesh axes. Two tables map
logical names to mesh axes: one for parameters and one for activations. The rules are the
usual tensor-parallel layout of serving engines: attention heads and MLP columns over
``tensor``, a vocab-parallel embedding and LM head, the batch over ``data``. Logits keep the
head's layout (vocabulary over ``tensor``): argmax, top-k, sampling and rejection sampling
reduce them shard by shard (``eagle3jax.vocab_parallel``), never gathering whole rows.

A mesh axis is dropped (that dimension replicated) when it does not divide the dimension, so a
tiny test model with 3 KV heads still runs on ``tensor=8``; for KV heads the target model
first replicates heads so that they do divide (see ``kv_head_replication``).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eagle3jax.sharding.mesh import DATA, TENSOR

# Logical axis names. Constants, so that a typo is a NameError, not a silent replication.
BATCH = "batch"
SEQ = "seq"            # query tokens (T) or cache slots (S)
EMBED = "embed"        # model width D
HEADS = "heads"        # query heads N
KV_HEADS = "kv_heads"  # key/value heads K
HEAD_DIM = "head_dim"  # H
MLP = "mlp"            # F
VOCAB = "vocab"        # V
EXPERT = "expert"      # E (mixture of experts)
LORA = "lora"          # low-rank latent dims (MLA); always replicated
CAPTURE = "capture"    # the concatenated capture features k*D
LAYERS = "layers"      # L: stacked decoder layers (scanned over, never sharded)

PARAM_RULES: dict[str, str | None] = {
    EMBED: None,
    HEADS: TENSOR,
    KV_HEADS: TENSOR,
    HEAD_DIM: None,
    MLP: TENSOR,
    VOCAB: TENSOR,
    EXPERT: TENSOR,
    LORA: None,
    CAPTURE: None,
    LAYERS: None,
}

ACTIVATION_RULES: dict[str, str | None] = {
    BATCH: DATA,
    SEQ: None,
    EMBED: None,
    HEADS: TENSOR,
    KV_HEADS: TENSOR,
    HEAD_DIM: None,
    MLP: TENSOR,
    VOCAB: TENSOR,     # logits stay vocab-parallel: eagle3jax.vocab_parallel reduces them
    EXPERT: TENSOR,
    LORA: None,
    CAPTURE: None,
    LAYERS: None,
}

Axes = Sequence[str | None]


def _spec(rules: dict[str, str | None], axes: Axes, shape: Sequence[int] | None,
          mesh: Mesh | None) -> P:
  out = []
  for i, name in enumerate(axes):
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise ValueError(f"unknown logical axis {name!r}; known: {sorted(rules)}")
    mesh_axis = rules[name]
    if mesh_axis is not None and shape is not None and mesh is not None:
      size = mesh.shape[mesh_axis]
      if shape[i] % size:
        mesh_axis = None  # does not divide: replicate this dimension
    out.append(mesh_axis)
  return P(*out)


def undivided(axes: Axes, shape: Sequence[int], mesh: Mesh,
              rules: dict[str, str | None] = PARAM_RULES) -> list[tuple[str, int, str, int]]:
  """``(logical axis, size, mesh axis, mesh size)`` of each dimension the rules would split
  over a mesh axis of more than one device, but that it does not divide (so it is replicated)."""
  out = []
  for name, dim in zip(axes, shape):
    mesh_axis = rules.get(name) if name is not None else None
    if mesh_axis is not None and mesh.shape[mesh_axis] > 1 and dim % mesh.shape[mesh_axis]:
      out.append((name, int(dim), mesh_axis, int(mesh.shape[mesh_axis])))
  return out


def param_spec(axes: Axes, shape: Sequence[int] | None = None, mesh: Mesh | None = None) -> P:
  """PartitionSpec of a parameter with logical ``axes`` (and ``shape`` on ``mesh``)."""
  return _spec(PARAM_RULES, axes, shape, mesh)


def activation_spec(axes: Axes, shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None) -> P:
  """PartitionSpec of an activation with logical ``axes`` (and ``shape`` on ``mesh``)."""
  return _spec(ACTIVATION_RULES, axes, shape, mesh)


def param_sharding(mesh: Mesh, axes: Axes, shape: Sequence[int]) -> NamedSharding:
  return NamedSharding(mesh, param_spec(axes, shape, mesh))


def current_mesh():
  """The abstract mesh set by ``jax.set_mesh`` (inside or outside jit), or None outside one."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def require_mesh(who: str, owner: str, hint: str) -> None:
  """Raises ``ValueError`` when ``who`` (a model or function whose arrays carry Explicit
  shardings of ``owner``'s mesh) runs outside a mesh context; ``hint`` says what else to do."""
  if current_mesh() is None:
    raise ValueError(f"{who} was called outside a mesh context: call it under "
                     f"jax.set_mesh({owner}.mesh) (in or out of jax.jit), {hint}")


def devices_along(mesh, entries) -> int:
  """How many devices the partition-spec ``entries`` (each None, a mesh axis name or a tuple of
  names) split an array over on ``mesh``: 1 when they leave it whole."""
  names = [a for e in entries if e is not None for a in (e if isinstance(e, tuple) else (e,))]
  return math.prod(dict(mesh.shape)[a] for a in names)


def shard(x: jax.Array, axes: Axes) -> jax.Array:
  """Lays out activation ``x`` as the activation rules say for logical ``axes``.

  Every activation annotation in eagle3jax goes through this function. Under an Explicit mesh it
  moves data with ``jax.reshard`` (a no-op when the layout already matches), so the result's
  *type* carries the layout and later mixing with another layout is a trace-time error.
  Outside a mesh it returns ``x`` unchanged.
  """
  if len(axes) != x.ndim:
    raise ValueError(f"shard: {len(axes)} logical axes {tuple(axes)} for an array of rank "
                     f"{x.ndim} (shape {x.shape})")
  mesh = current_mesh()
  if mesh is None:
    return x
  return jax.reshard(x, activation_spec(axes, x.shape, mesh))


def out_spec(axes: Axes, shape: Sequence[int]) -> P | None:
  """The ``out_sharding`` for an op producing logical ``axes`` (None outside a mesh)."""
  mesh = current_mesh()
  if mesh is None:
    return None
  return activation_spec(axes, shape, mesh)


def batch_major(x: jax.Array) -> jax.Array:
  """``shard(x, (BATCH, None, ...))``: for small per-row bookkeeping arrays, so that arrays
  created inside jit (``jnp.zeros((B,))``) and model outputs share one batch layout."""
  return shard(x, (BATCH,) + (None,) * (x.ndim - 1))


def pick_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """``x[b, index[b]]`` for ``x [B, N, ...]`` and ``index [B]``, as a masked sum.

  A one-hot reduction instead of a gather: it keeps the batch layout under Explicit axes for
  any B (a gather with size-1 index dimensions has no unambiguous output sharding).
  """
  hit = jnp.arange(x.shape[1])[None, :] == index[:, None]                 # [B, N]
  hit = hit.reshape(hit.shape + (1,) * (x.ndim - 2))
  if x.dtype == jnp.bool_:
    return jnp.any(hit & x, axis=1)
  return jnp.sum(jnp.where(hit, x, jnp.zeros((), x.dtype)), axis=1)


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """``out[b, m] = x[b, index[b, m]]`` for ``x [B, N, ...]`` and ``index [B, M]``.

  Under Explicit axes the output keeps ``x``'s layout (batch and any sharded trailing dims),
  which a plain ``take_along_axis`` cannot always infer.
  """
  b = x.shape[0]
  rows = batch_major(jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], index.shape))
  index = batch_major(index.astype(jnp.int32))
  if current_mesh() is None:
    return x[rows, index]
  spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
  return x.at[rows, index].get(out_sharding=P(spec[0], None, *spec[2:x.ndim]))
