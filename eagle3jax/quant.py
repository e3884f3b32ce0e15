"""Quantized linear weights held as stored and dequantized next to the matmul that uses them.

A linear weight is ``[*lead, *in_dims, *out_dims]`` in our layout (``eagle3jax.weights``: the
transpose of Hugging Face's ``[out, in]``, heads split out; ``lead`` is e.g. the expert axis).
A ``QuantizedParam`` holds it as two parameters with the weight's logical axes, so both shard
as the weight would:

* ``values``: FP8 (``fp8_block``): the bytes of float8 e4m3 (held as uint8: XLA:CPU converts
  a float8 stack whole where a scan slices it, an integer stack it slices in place; decoded by
  bit arithmetic next to the matmul) in the weight's shape. INT4 (``int4_group``):
  uint8 ``[*lead, *in_dims[:-1], in_last / 2, *out_dims]``, two 4-bit values per byte along the
  last in dim (element ``2j`` in the low nibble, ``2j + 1`` in the high one), each stored
  offset by 8 (``q + 8``, ``q`` in ``[-8, 7]``): the byte order of compressed-tensors'
  ``pack_to_int32`` read as bytes, so conversion is a transpose.
* ``scale``: ``[*lead, *in_dims[:-1], in_last / g, *out_dims]`` (FP8 float32, INT4 as stored,
  bf16): one scale per out element and per group of ``g`` consecutive in elements, where
  ``g = gcd(group_size, in_last)``; checkpoint blocks that span several out elements (FP8's
  128 rows) or straddle a head boundary are expanded on the host, which is exact.

The weight is ``values * scale`` (per group). ``dequantize(w, dtype)`` computes it inside the
jitted computation where the weight is used: per layer inside the layer scan (the scan slices
``values`` and ``scale`` of layer ``i``), and ``take(w, ids)`` gathers only the rows (experts)
used before dequantizing. A whole stacked ``[L, ...]`` weight is never dequantized.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from eagle3jax.layers import param
from eagle3jax.sharding import current_mesh

FP8_BLOCK = "fp8_block"
INT4_GROUP = "int4_group"
KINDS = (FP8_BLOCK, INT4_GROUP)
# ``init`` kinds of the two parts (``eagle3jax.params`` fills them; ``part_of`` reads them).
_INITS = {(FP8_BLOCK, "values"): "fp8_values", (FP8_BLOCK, "scale"): "fp8_scale",
          (INT4_GROUP, "values"): "int4_values", (INT4_GROUP, "scale"): "int4_scale"}
INT4_OFFSET = 8


@dataclasses.dataclass(frozen=True)
class QuantScheme:
  """How a linear weight is quantized.

  Attributes:
    kind: ``fp8_block`` (e4m3 with a float32 scale per ``block_out x group_size`` block) or
      ``int4_group`` (symmetric 4-bit with a scale per ``group_size`` in elements of a row).
    group_size: consecutive input (HF ``in``) elements sharing a scale.
    block_out: output rows sharing a scale (FP8 blocks; 1 for INT4).
  """
  kind: str
  group_size: int
  block_out: int = 1

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"QuantScheme kind={self.kind!r}; supported: {KINDS}")
    for name in ("group_size", "block_out"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"QuantScheme {name}={value!r} must be a positive integer")

  @property
  def values_dtype(self):
    return np.uint8  # FP8: the bytes of e4m3 (see the module docstring)

  @property
  def scale_dtype(self):
    return np.float32 if self.kind == FP8_BLOCK else ml_dtypes.bfloat16

  def group(self, in_last: int) -> int:
    """The device group ``g`` along an in dim of size ``in_last``."""
    return math.gcd(self.group_size, in_last)

  def layout(self, shape, n_out: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(values_shape, scale_shape)`` of a weight ``shape`` with ``n_out`` out dims."""
    shape = tuple(shape)
    ax = len(shape) - n_out - 1
    if ax < 0:
      raise ValueError(f"a quantized weight of shape {shape} with {n_out} out dims has no "
                       "in dim")
    in_last = shape[ax]
    values = list(shape)
    if self.kind == INT4_GROUP:
      if in_last % 2:
        raise ValueError(f"an INT4 weight of shape {shape} has an odd in dim {in_last}: two "
                         "values are packed per byte along it")
      values[ax] = in_last // 2
    scale = list(shape)
    scale[ax] = in_last // self.group(in_last)
    return tuple(values), tuple(scale)


def part_of(init: str) -> tuple[str, str] | None:
  """``(kind, part)`` of a quantized parameter's ``init`` kind (None for plain parameters)."""
  for key, value in _INITS.items():
    if value == init:
      return key
  return None


class QuantizedParam(nnx.Module):
  """A quantized linear weight (see the module docstring): ``values`` and ``scale``.

  ``w[...]`` (or ``dequantize(w)``) is the dequantized ``[*lead, *in_dims, *out_dims]`` weight
  in ``dtype``; use it inside jit, next to the matmul.
  """

  def __init__(self, shape, axes, scheme: QuantScheme, *, n_out: int, dtype):
    if len(shape) != len(axes):
      raise ValueError(f"param shape {shape} and axes {axes} differ in rank")
    vshape, sshape = scheme.layout(shape, n_out)
    self.values = nnx.Param(jnp.zeros(vshape, scheme.values_dtype), axes=tuple(axes),
                            init=_INITS[(scheme.kind, "values")])
    self.scale = nnx.Param(jnp.zeros(sshape, scheme.scale_dtype), axes=tuple(axes),
                           init=_INITS[(scheme.kind, "scale")])
    self.scheme = scheme
    self.n_out = n_out
    self.dtype = jnp.dtype(dtype)

  @property
  def shape(self) -> tuple[int, ...]:
    """The dequantized shape (a stacked module's includes the layer axis)."""
    return _dequantized_shape(self.values.get_value().shape, self.scheme, self.n_out)

  def __getitem__(self, index):
    return dequantize(self)[index]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArrays:
  """The arrays of a ``QuantizedParam`` as a plain pytree (values and scale are its leaves, the
  scheme static), for code that passes weights through ``jax.shard_map`` or ``lax.scan``:
  ``dequantize`` and ``take`` read it like the parameter."""
  values: jax.Array
  scale: jax.Array
  scheme: QuantScheme = dataclasses.field(metadata=dict(static=True))
  n_out: int = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    """The dequantized shape of the arrays held (a shard's, inside ``shard_map``)."""
    return _dequantized_shape(self.values.shape, self.scheme, self.n_out)


def arrays(w):
  """A weight's arrays: ``QuantizedArrays`` for a ``QuantizedParam``, else the plain array."""
  if isinstance(w, QuantizedParam):
    return QuantizedArrays(w.values[...], w.scale[...], w.scheme, w.n_out, w.dtype)
  if isinstance(w, nnx.Variable):
    return w[...]
  return w


def _dequantized_shape(vshape, scheme: QuantScheme, n_out: int) -> tuple[int, ...]:
  shape = list(vshape)
  if scheme.kind == INT4_GROUP:
    shape[len(shape) - n_out - 1] *= 2
  return tuple(shape)


def linear_param(shape, axes, dtype, *, n_out: int, scheme: QuantScheme | None = None,
                 init: str = "normal"):
  """A linear weight ``[*lead, *in_dims, *out_dims]`` (``n_out`` trailing out dims): a plain
  ``nnx.Param`` without ``scheme``, else a ``QuantizedParam``. Read it with ``w[...]``."""
  if scheme is None:
    return param(shape, axes, dtype, init=init)
  return QuantizedParam(shape, axes, scheme, n_out=n_out, dtype=dtype)


def _e4m3_bits_to_f32(v):
  """float8 e4m3fn bytes (uint8) as float32, by bit arithmetic (elementwise, any sharding):
  sign, 4 exponent bits (bias 7; 0 = subnormal), 3 mantissa bits; 0x7f / 0xff are NaN."""
  v = v.astype(jnp.int32)
  e = (v >> 3) & 0xF
  m = (v & 7).astype(jnp.float32)
  mag = jnp.where(e == 0, m * 2.0 ** -9,
                  (8.0 + m) * jnp.exp2((e - 10).astype(jnp.float32)))
  mag = jnp.where((v & 0x7F) == 0x7F, jnp.nan, mag)
  return jnp.where(v >= 0x80, -mag, mag)


def _dequantize_arrays(values, scale, scheme: QuantScheme, n_out: int, dtype):
  """``values * scale`` per group (arrays as ``QuantizedParam`` holds them, any lead dims)."""
  ax = values.ndim - n_out - 1
  if scheme.kind == INT4_GROUP:
    lo = (values & 0xF).astype(jnp.int8) - INT4_OFFSET
    hi = (values >> 4).astype(jnp.int8) - INT4_OFFSET
    q = jnp.stack([lo, hi], axis=ax + 1)                       # [..., in/2, 2, *out]
    q = q.reshape(values.shape[:ax] + (values.shape[ax] * 2,) + values.shape[ax + 1:])
  else:
    q = _e4m3_bits_to_f32(values)
  # Each scale repeated over its group (not a [groups, g] split of the weight's in dim, which
  # a tensor-sharded in dim with fewer groups than shards cannot take under Explicit axes).
  mesh = jax.sharding.get_abstract_mesh()
  out_sharding = None if mesh.empty else jax.typeof(q).sharding.spec
  full = jnp.repeat(scale.astype(jnp.float32), q.shape[ax] // scale.shape[ax], axis=ax,
                    out_sharding=out_sharding)
  return (q.astype(jnp.float32) * full).astype(dtype)


def dequantize(w, dtype=None):
  """The weight as an array: ``QuantizedParam`` dequantized (to ``dtype``, default its own),
  a plain ``nnx.Variable`` read, an array returned (cast to ``dtype`` when given)."""
  if isinstance(w, (QuantizedParam, QuantizedArrays)):
    w = arrays(w)
    return _dequantize_arrays(w.values, w.scale, w.scheme, w.n_out,
                              w.dtype if dtype is None else dtype)
  if isinstance(w, nnx.Variable):
    w = w[...]
  return w if dtype is None else w.astype(dtype)


def take(w, ids, axis: int = 0, dtype=None, out_sharding=None):
  """Rows ``ids`` of a weight along a lead ``axis`` (e.g. the used experts of ``[E, D, F]``),
  dequantized after the gather, so that only those rows are ever dequantized.

  ``ids`` may have any shape (the result has ``ids.shape`` in place of ``axis``). Under an
  Explicit mesh the gathered dims take ``out_sharding`` (a ``PartitionSpec`` of the result,
  applied to values and scales alike); by default the gathered rows are replicated and the
  other dims keep their sharding.
  """
  if isinstance(w, (QuantizedParam, QuantizedArrays)):
    w = arrays(w)
    values = _gather(w.values, ids, axis, out_sharding)
    scale = _gather(w.scale, ids, axis, out_sharding)
    return _dequantize_arrays(values, scale, w.scheme, w.n_out,
                              w.dtype if dtype is None else dtype)
  return dequantize(_gather(dequantize(w), ids, axis, out_sharding), dtype)


def _gather(x, ids, axis: int, out_sharding):
  ids = jnp.asarray(ids)
  index = (slice(None),) * axis + (ids,)
  if current_mesh() is None:
    return x[index]
  if out_sharding is None:
    spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    out_sharding = jax.sharding.PartitionSpec(*spec[:axis], *(None,) * ids.ndim,
                                              *spec[axis + 1:x.ndim])
  return x.at[index].get(out_sharding=out_sharding)


# --- sizes ---

def _leaves(module):
  return [v for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]


def nbytes(module) -> int:
  """Resident bytes of a module's parameters as held (quantized values plus scales)."""
  return sum(math.prod(v.get_value().shape) * np.dtype(v.get_value().dtype).itemsize
             for v in _leaves(module))


def dequantized_nbytes(module, dtype=jnp.bfloat16) -> int:
  """Bytes of the same parameters with every quantized weight dequantized to ``dtype``
  (plain parameters as held)."""
  total = nbytes(module)
  for _, sub in nnx.iter_graph(module):
    if isinstance(sub, QuantizedParam):
      total -= nbytes(sub)
      total += math.prod(sub.shape) * np.dtype(dtype).itemsize
  return total


# --- random values (eagle3jax.params.random_fill) ---

def random_part(init: str, shape, rng: np.random.Generator, std: float) -> np.ndarray:
  """Random stored values for a quantized part, so that the weight is about N(0, std)-sized:
  INT4 values uniform in [-8, 7] (std ~4.6), FP8 values N(0, 8) rounded to e4m3, scales near
  ``std / 4.6`` and ``std / 8``."""
  kind, part = part_of(init)
  if part == "values":
    if kind == INT4_GROUP:
      return rng.integers(0, 256, shape).astype(np.uint8)
    return (8.0 * rng.normal(size=shape)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  spread = std / (4.6 if kind == INT4_GROUP else 8.0)
  return (spread * rng.uniform(0.5, 1.5, shape)).astype(np.float32)
