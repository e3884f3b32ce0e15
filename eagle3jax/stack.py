"""Decoder layers stacked ``[L, ...]`` and run as a ``lax.scan``.

A target's layers are one module whose every parameter carries a leading ``LAYERS`` axis
(``stack_layers``), so a compiled forward holds one copy of the layer's program whatever the
depth: compiling a 61-layer target costs about what a 6-layer one does. Captures stay static:
``segments`` splits ``[0, L)`` after every captured layer (and at the boundaries between
stacks, e.g. DeepSeek's dense and MoE layers), each segment is one scan, and each capture falls
out between two segments, where it goes through ``CaptureSpec.annotate`` as before.

Each scan step slices layer ``i`` out of the stacked parameters by index (the whole stack is
the scan's constant, never copied per segment) and reads/writes layer ``i`` of the stacked
KV cache (``eagle3jax.kv_cache.LayerKV``) in place: a layer writes only its new tokens.

Parameters of a stack record ``layer_offset``, the global index of its first layer, so that
loaders (``eagle3jax.params.materialize``) ask for layer ``offset + l`` by its per-layer name
``layers.{offset + l}.<path>``, as checkpoints name them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3jax import kv_cache as kv_lib
from eagle3jax.sharding import LAYERS


_PEEL: list[frozenset] = [frozenset()]


@contextlib.contextmanager
def peeled(offsets):
  """Traces each segment of the stacks starting at ``offsets`` (segments of two or more layers)
  with its first layer outside the scan, i.e. one more copy of the layer's program.

  ``cost_analysis`` counts a loop body once, so the cost of one layer of a stack is the
  difference between a program compiled with it and without it (``eagle3jax.plan``). Serving
  never peels.
  """
  _PEEL.append(frozenset(offsets))
  try:
    yield
  finally:
    _PEEL.pop()


def stack_layers(factory: Callable[[], nnx.Module], count: int, offset: int = 0) -> nnx.Module:
  """``factory()`` with every variable grown to ``[count, ...]`` (logical axis ``LAYERS``).

  Called inside ``nnx.eval_shape`` (models are built abstractly, then filled); ``offset`` is the
  global index of the stack's first layer.
  """
  if count < 1:
    raise ValueError(f"a layer stack needs at least one layer; got {count}")
  graphdef, state = nnx.split(factory())

  def grow(var):
    value = var.get_value()
    meta = var.get_metadata()
    return var.replace(jnp.zeros((count,) + tuple(value.shape), value.dtype),
                       axes=(LAYERS,) + tuple(meta.get("axes") or (None,) * value.ndim),
                       layer_offset=offset)

  state = jax.tree.map(grow, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, state)


def stack_size(stack: nnx.Module) -> int:
  """Number of layers in a stack built by ``stack_layers``."""
  return jax.tree.leaves(nnx.state(stack))[0].shape[0]


def layer_at(stack: nnx.Module, i) -> nnx.Module:
  """Layer ``i`` (static or traced index) of a stack, as an ordinary layer module."""
  graphdef, state = nnx.split(stack)
  return nnx.merge(graphdef, jax.tree.map(lambda w: w[i], state))


LAYER_LOOPS = ("scan", "split")


def default_layer_loop() -> str:
  """``"split"`` on CPU, ``"scan"`` elsewhere (see ``split_stack``)."""
  return "split" if jax.default_backend() == "cpu" else "scan"


def split_stack(stack: nnx.Module, offset: int) -> list[tuple[nnx.Module, int]]:
  """A stack as one-layer stacks ``[(stack_i, offset + i)]`` (called outside jit, once).

  XLA:CPU copies a layer's weights out of a ``[L, ...]`` stack wherever a scan step slices them
  for a matmul (3.2 MB per layer of the demo target: most of an autoregressive step). A
  one-layer stack is read whole, which XLA reduces to the array itself, so the forward runs
  without weight copies at the price of one copy of the layer program per layer (compile time
  grows with depth again). Serving on CPU uses it (``layer_loop="split"``); accelerators and
  deep targets keep the scan.
  """
  graphdef, state = nnx.split(stack)

  def part(i):
    def one(var):
      return var.replace(jax.tree.map(lambda w: w[i:i + 1], var.get_value()),
                         layer_offset=offset + i)
    return nnx.merge(graphdef, jax.tree.map(one, state,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable)))
  return [(part(i), offset + i) for i in range(stack_size(stack))]


def stack_bounds(stacks) -> list[tuple[int, int]]:
  """``[(start, end)]`` global layer ranges of ``[(stack, offset)]`` (``layer_stacks()``)."""
  return [(off, off + stack_size(st)) for st, off in stacks]


def segments(bounds: Sequence[tuple[int, int]], cuts: Sequence[int]) -> list[tuple[int, int, int]]:
  """Splits stacks into scan segments.

  Args:
    bounds: ``[(start, end)]`` global layer ranges of the stacks, in order.
    cuts: layer ids after which the forward must stop (captured layers).

  Returns:
    ``[(stack_index, start, end)]`` covering every layer once, in order, each ending at a cut,
    at a stack boundary or at the last layer.
  """
  out = []
  for s, (lo, hi) in enumerate(bounds):
    edges = sorted({lo, hi} | {c + 1 for c in cuts if lo <= c < hi - 1})
    out += [(s, a, b) for a, b in zip(edges[:-1], edges[1:])]
  return out


def scan_layers(stack: nnx.Module, offset: int, start: int, end: int, x: jax.Array,
                cache_kv, step: Callable):
  """Runs global layers ``[start, end)`` of ``stack`` (whose first layer is ``offset``).

  Args:
    stack: a module from ``stack_layers``.
    offset: global index of the stack's first layer.
    start, end: the global layer range of this segment.
    x: ``[B, T, D]`` hidden states entering layer ``start``.
    cache_kv: ``(k, v)`` stacked caches ``[L, ...]`` indexed by global layer, or None.
    step: ``step(layer, x, k_buf, v_buf) -> (x, k_buf, v_buf)`` for one layer: the buffers are
      ``kv_cache.LayerKV`` views of layer ``g`` (None without a cache).

  Returns:
    ``(x, cache_kv)`` after the segment.
  """
  graphdef, state = nnx.split(stack)

  def body(carry, g):
    x, kv = carry
    layer = nnx.merge(graphdef, jax.tree.map(lambda w: w[g - offset], state))
    if kv is None:
      x, _, _ = step(layer, x, None, None)
      return (x, None), None
    k_view, v_view = kv_lib.LayerKV(kv[0], g), kv_lib.LayerKV(kv[1], g)
    x, k_view, v_view = step(layer, x, k_view, v_view)
    return (x, (k_view.stacked, v_view.stacked)), None

  if end - start == 1:  # one layer (e.g. split stacks): no loop
    (x, cache_kv), _ = body((x, cache_kv), jnp.int32(start))
    return x, cache_kv
  if offset in _PEEL[-1] and end - start >= 2:
    (x, cache_kv), _ = body((x, cache_kv), jnp.int32(start))
    start += 1
  (x, cache_kv), _ = jax.lax.scan(body, (x, cache_kv), jnp.arange(start, end, dtype=jnp.int32))
  return x, cache_kv
