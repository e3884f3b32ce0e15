"""Small building blocks shared by the target and the drafter.

Parameters carry their logical axes as metadata (``axes``) and an ``init`` kind; they are
created abstractly and filled by ``eagle3jax.params`` (random init or checkpoint), which
places each one with the sharding the parameter rules give its axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3jax.sharding import out_spec


def param(shape, axes, dtype, init: str = "normal") -> nnx.Param:
  """An (abstract) parameter with logical ``axes`` and an ``init`` kind (normal|ones|zeros)."""
  if len(shape) != len(axes):
    raise ValueError(f"param shape {shape} and axes {axes} differ in rank")
  return nnx.Param(jnp.zeros(shape, dtype), axes=tuple(axes), init=init)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm as Llama computes it: float32 statistics, scale applied in the input dtype."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, dtype, axes=(None,)):
    self.weight = param((dim,), axes, dtype, init="ones")
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.weight[...], self.eps)


def einsum(eq: str, a: jax.Array, b: jax.Array, out_axes) -> jax.Array:
  """``jnp.einsum`` whose output layout is given by logical ``out_axes``.

  Needed under Explicit axes when a contracted dimension is sharded (o_proj, down_proj): the
  result is reduced over the tensor axis and laid out as the activation rules say.
  """
  lhs, out = eq.replace(" ", "").split("->")
  sizes = {}
  for spec, arr in zip(lhs.split(","), (a, b)):
    sizes.update(zip(spec, arr.shape))
  out_shape = tuple(sizes[c] for c in out)
  return jnp.einsum(eq, a, b, out_sharding=out_spec(out_axes, out_shape))


def merge_heads(out: jax.Array, w: jax.Array, out_axes) -> jax.Array:
  """``einsum("BTNH,NHD->BTD", out, w)`` as one ``[B, T, N*H] x [N*H, D]`` matmul.

  Contracting over two dimensions let XLA:CPU pick a layout in which it copied the (N, H, D)
  weight transposed on every call (a 256 KB copy per layer per step for the demo target);
  merged heads contract over one row-major dimension, for free on the weight.
  """
  b, t, n, h = out.shape
  return einsum("BTF,FD->BTD", out.reshape(b, t, n * h), w.reshape(n * h, w.shape[-1]),
                out_axes)
