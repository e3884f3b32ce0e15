"""Routed mixture of experts: DeepSeek's noaux_tc routing and dropless grouped expert compute.

Axis letters: N tokens (batch and sequence flattened), D model, F expert MLP, E experts,
k experts per token (top-k), P = N * k routed (token, expert) pairs, R padded pair rows.

Routing (DeepSeek-V3 technical report, 2024, "noaux_tc"): sigmoid scores; the
``e_score_correction_bias`` steers *selection* only; experts are split into ``n_group`` groups,
each group scored by the sum of its best two biased scores, a token keeps the best
``topk_group`` groups and picks its top-k experts among them; the chosen experts' unbiased
scores are normalised to sum to one and scaled by ``routed_scaling_factor``.

Expert compute, one SwiGLU per routed pair ``y += w * down(silu(x @ gate) * (x @ up))``:

* ``moe_reference``: every expert on every token, unchosen ones multiplied by zero (the
  original dense evaluation, kept as the oracle: arithmetic and weight traffic scale with E);
* ``"gather"`` (few tokens: decode, verify): each pair gathers its expert's three matrices and
  multiplies, so only the touched experts are read and the cost scales with P, not E;
* ``"tiles"`` (many tokens: prefill, training features): pairs sorted by expert, each expert's
  group padded to a multiple of a tile, a loop of matmuls over the tiles (each tile reads one
  expert's matrices in place; gathering every tile's matrices into one batched matmul is ~10x
  slower on XLA:CPU, whose large-slice gathers are slow), then un-sorted and combined. At most
  ``(P + min(E, P) (tile - 1)) / tile`` tiles exist, and the tile is the mean load per expert,
  so fewer than 2P rows are computed whatever the routing (tiles past the last expert's group
  are skipped by a ``lax.cond``: their matrices are not read);
* ``"ragged"``: the same sorted pairs through ``jax.lax.ragged_dot`` (a real grouped matmul on
  GPU/TPU; XLA:CPU evaluates it densely over all groups, so ``auto`` never picks it there; it
  takes plain matrices, so quantized experts are all dequantized first, and ``auto`` does not
  pick it for them).

``impl="auto"`` picks, on GPU/TPU, ``gather`` for up to four pairs per local expert (decode and
verify rounds; it reads at most 4x the weights a grouped kernel reads once, and the plan
counts it exactly) and ``ragged`` beyond, or ``tiles`` for quantized experts (``ragged_dot``
takes plain matrices, so it would dequantize the whole local stack on every call);
``choose_impl``. On CPU always ``tiles`` (with no more pairs than experts the tile is one row,
so the loop reads exactly the chosen experts' matrices, and measured here it beats ``gather``
for 8 tokens at E = 16 and 256: XLA:CPU's gathers of whole matrices are slow).

Expert parallelism (``routed_experts`` under a mesh): the expert stacks are sharded over the
mesh axis their ``EXPERT`` dimension maps to (``tensor``), so each device holds ``E / n`` experts
and never another device's. Activations are replicated over that axis (the activation rules
shard only the batch), so every device already holds its tokens: inside ``jax.shard_map`` each
device routes its tokens, computes the pairs whose expert it owns, and one ``psum`` over the
expert axis returns every token's sum of its experts' outputs (the all-reduce a row-parallel
matmul does anyway; exchanging pairs with an all-to-all would move ``2 P D / n`` rows plus an
all-gather of ``N D``, more than the ``psum``'s ``~2 N D`` whenever k >= n / 2).

Every read of an expert matrix goes through ``take`` (some experts) or ``full`` (all), so that
quantized experts plug in by replacing those two functions (and ``_num_experts``, which reads
``w.shape[0]``). Duck typing on a ``take`` method would be wrong: ``jax.Array.take`` exists and
flattens.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from eagle3jax import quant
from eagle3jax.sharding import out_spec, shard

IMPLS = ("auto", "reference", "gather", "tiles", "ragged")
# DeepSeek's noaux_tc scores each group by its best two experts.
_GROUP_SCORE_TOP = 2
_NORM_EPS = 1e-20
# Largest tile of the "tiles" path (rows per expert matrix read).
_MAX_TILE = 128
# Tiles per step of the tiles loop (XLA:CPU's per-iteration overhead dominates small tiles;
# ``unrolled_tiles`` unrolls it fully, for cost_analysis).
_TILE_UNROLL = 16
_UNROLL_TILES = [False]


@contextlib.contextmanager
def unrolled_tiles():
  """Traces the tiles loop fully unrolled, so that ``cost_analysis`` (which counts a loop body
  once) counts every tile. Serving never unrolls."""
  _UNROLL_TILES.append(True)
  try:
    yield
  finally:
    _UNROLL_TILES.pop()


_BACKEND = [None]
# Under ``as_accelerator`` decode-sized calls (pairs up to this many times the local experts)
# gather per pair, a loop-free program that cost_analysis counts exactly; it reads at most this
# factor times the weights a grouped kernel would.
_PLAN_GATHER_FACTOR = 4


@contextlib.contextmanager
def as_accelerator():
  """Chooses ``auto`` paths as on a GPU/TPU while tracing on XLA:CPU, except that ``ragged``
  (evaluated densely over every group on XLA:CPU) is replaced by ``tiles``: how
  ``eagle3jax.plan`` compiles the serving programs of a GPU node on fake CPU devices. Calls of
  up to ``_PLAN_GATHER_FACTOR`` pairs per local expert (decode rounds) gather per pair."""
  _BACKEND.append("accelerator")
  try:
    yield
  finally:
    _BACKEND.pop()


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  """Static routing settings.

  Attributes:
    num_experts: E, routed experts.
    top_k: experts chosen per token.
    n_group: expert groups (must divide E).
    topk_group: groups a token may route to.
    norm_topk_prob: normalise the chosen weights to sum to one.
    routed_scaling_factor: multiplies the (normalised) weights.
  """
  num_experts: int
  top_k: int
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0

  def __post_init__(self):
    if self.num_experts % self.n_group:
      raise ValueError(f"RoutingConfig: n_group={self.n_group} must divide "
                       f"num_experts={self.num_experts}")
    if self.num_experts // self.n_group < _GROUP_SCORE_TOP:
      raise ValueError(f"RoutingConfig: groups of {self.num_experts // self.n_group} experts; "
                       f"noaux_tc scores a group by its best {_GROUP_SCORE_TOP}, so use fewer "
                       "groups (n_group)")
    if not 1 <= self.topk_group <= self.n_group:
      raise ValueError(f"RoutingConfig: topk_group={self.topk_group} must be in "
                       f"[1, n_group={self.n_group}]")
    if not 1 <= self.top_k <= self.num_experts // self.n_group * self.topk_group:
      raise ValueError(f"RoutingConfig: top_k={self.top_k} must be at least 1 and at most the "
                       f"experts in the allowed groups "
                       f"({self.num_experts // self.n_group * self.topk_group})")

  @classmethod
  def from_deepseek(cls, cfg) -> "RoutingConfig":
    """From a ``DeepseekConfig``."""
    return cls(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
               cfg.norm_topk_prob, cfg.routed_scaling_factor)


class Experts(NamedTuple):
  """Stacked SwiGLU experts: ``gate [E, D, F]``, ``up [E, D, F]``, ``down [E, F, D]`` (arrays,
  or any pytree that ``take`` / ``full`` can read)."""
  gate: jax.Array
  up: jax.Array
  down: jax.Array


# --- the one accessor of expert matrices ---

def take(w, ids: jax.Array) -> jax.Array:
  """``w[ids]``: the matrices of experts ``ids`` (any shape) as a plain array; quantized
  experts (``quant.QuantizedArrays``) are gathered as stored and only those dequantized."""
  return quant.take(w, ids)


def full(w) -> jax.Array:
  """All experts' matrices ``[E, ...]`` as a plain array (quantized ones dequantized)."""
  return quant.dequantize(w)


def _num_experts(w) -> int:
  return w.shape[0]


# --- routing ---

def _select(x: jax.Array, gate: jax.Array, bias: jax.Array, rc: RoutingConfig):
  """Sigmoid scores ``[..., E]`` float32 and the chosen experts ``[..., k]`` int32."""
  e, g = rc.num_experts, rc.n_group
  logits = jnp.einsum("...D,DE->...E", x.astype(jnp.float32), gate)
  scores = jax.nn.sigmoid(logits)
  choice = scores + bias
  grouped = choice.reshape(choice.shape[:-1] + (g, e // g))
  group_scores = jax.lax.top_k(grouped, _GROUP_SCORE_TOP)[0].sum(-1)             # [..., G]
  _, top_groups = jax.lax.top_k(group_scores, rc.topk_group)
  group_ok = jax.nn.one_hot(top_groups, g, dtype=jnp.int32).sum(-2) > 0         # [..., G]
  expert_ok = jnp.repeat(group_ok, e // g, axis=-1)                            # [..., E]
  choice = jnp.where(expert_ok, choice, -jnp.inf)
  _, top = jax.lax.top_k(choice, rc.top_k)
  return scores, top.astype(jnp.int32)


def route(x: jax.Array, gate: jax.Array, bias: jax.Array, rc: RoutingConfig):
  """Routes tokens ``x [..., D]`` with router ``gate [D, E]`` and correction ``bias [E]``.

  Returns:
    ``(ids [..., k] int32, weights [..., k] float32)``: the chosen experts and their weights
    (normalised when ``norm_topk_prob``, times ``routed_scaling_factor``).
  """
  scores, top = _select(x, gate, bias, rc)
  weights = jnp.take_along_axis(scores, top, axis=-1)
  if rc.norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + _NORM_EPS)
  return top, weights * rc.routed_scaling_factor


def combine_weights(x: jax.Array, gate: jax.Array, bias: jax.Array,
                    rc: RoutingConfig) -> jax.Array:
  """The same routing as dense combine weights ``[..., E]`` float32, zero off the chosen
  experts (the reference's form)."""
  scores, top = _select(x, gate, bias, rc)
  chosen = jax.nn.one_hot(top, rc.num_experts, dtype=jnp.float32).sum(-2)        # [..., E]
  weights = scores * chosen
  if rc.norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + _NORM_EPS)
  return weights * rc.routed_scaling_factor


# --- expert compute ---

def moe_reference(x: jax.Array, combine: jax.Array, experts: Experts, act_axes=None,
                  expert_axes=None) -> jax.Array:
  """Dense evaluation: every expert on every token, weighted by ``combine [B, T, E]``.

  ``x [B, T, D]`` -> ``[B, T, D]``. ``act_axes`` / ``expert_axes`` are the logical layouts of
  the output and of ``[B, T, E, F]`` intermediates under a mesh (None outside one).
  """
  def ein(eq, a, b, axes):
    if axes is None:
      return jnp.einsum(eq, a, b)
    lhs, out = eq.split("->")
    sizes = dict(zip(lhs.split(",")[0], a.shape)) | dict(zip(lhs.split(",")[1], b.shape))
    return jnp.einsum(eq, a, b, out_sharding=out_spec(axes, tuple(sizes[c] for c in out)))

  g = ein("BTD,EDF->BTEF", x, full(experts.gate), expert_axes)
  u = ein("BTD,EDF->BTEF", x, full(experts.up), expert_axes)
  h = jax.nn.silu(g) * u * combine[..., None].astype(x.dtype)
  return ein("BTEF,EFD->BTD", h, full(experts.down), act_axes)


def choose_impl(num_tokens: int, top_k: int, num_local_experts: int, impl: str = "auto",
                quantized: bool = False) -> str:
  """The expert-compute path for ``num_tokens`` tokens (see the module docstring).

  On GPU/TPU, and under ``as_accelerator`` (the plan), one rule: ``gather`` up to
  ``_PLAN_GATHER_FACTOR`` pairs per local expert (decode and verify rounds); beyond,
  ``ragged`` for plain expert stacks and ``tiles`` for ``quantized`` ones (``ragged_dot``
  takes plain matrices, so it would dequantize every local expert on every call: 4 GB of
  bfloat16 per Kimi-K2.5 layer on tensor=8). The plan runs ``tiles`` for ``ragged`` too
  (XLA:CPU evaluates ``ragged_dot`` densely). On CPU, always ``tiles``.
  """
  if impl not in IMPLS:
    raise ValueError(f"unknown MoE impl {impl!r}; choose one of {IMPLS}")
  if impl != "auto":
    return impl
  cpu = jax.default_backend() == "cpu"
  if cpu and _BACKEND[-1] != "accelerator":
    return "tiles"
  if num_tokens * top_k <= _PLAN_GATHER_FACTOR * num_local_experts:
    return "gather"
  return "tiles" if cpu or quantized else "ragged"


def tile_size(num_pairs: int, num_local_experts: int) -> int:
  """Rows per tile: the mean load per expert, rounded up (at most 128)."""
  return max(1, min(_MAX_TILE, -(-num_pairs // num_local_experts)))


def num_tiles(num_pairs: int, num_local_experts: int, tile: int) -> int:
  """A bound on the tiles any routing of ``num_pairs`` pairs needs:
  ``sum_e ceil(c_e / tile) <= (P + min(E, P) (tile - 1)) / tile``."""
  return max(1, (num_pairs + min(num_local_experts, num_pairs) * (tile - 1)) // tile)


def _swiglu_rows(x, g, u, d, w):
  """``w * down(silu(x g) * (x u))`` for rows ``x [R, D]`` of one expert (``g``, ``u``
  ``[D, F]``, ``d [F, D]``) with row weights ``w [R]``: ``[R, D]``."""
  h = jax.nn.silu(x @ g) * (x @ u)
  return (h * w[:, None].astype(x.dtype)) @ d


def _gather(x, ids, weights, experts):
  """Per pair: gather the expert's matrices and multiply. ``x [N, D]``, ``ids [N, k]`` local
  ids (out-of-range ones contribute nothing) -> ``[N, D]``."""
  e = _num_experts(experts.gate)
  ok = (ids >= 0) & (ids < e)
  idx = jnp.clip(ids, 0, e - 1)
  w = jnp.where(ok, weights, 0.0)
  g, u, d = take(experts.gate, idx), take(experts.up, idx), take(experts.down, idx)
  h = jax.nn.silu(jnp.einsum("ND,NKDF->NKF", x, g)) * jnp.einsum("ND,NKDF->NKF", x, u)
  h = h * w[..., None].astype(x.dtype)
  return jnp.einsum("NKF,NKFD->ND", h, d)


def _sort_pairs(ids, e):
  """Pairs sorted by local expert: order ``[P]``, per-expert counts ``[E]``, and each sorted
  pair's expert ``[P]`` (``e`` for pairs of other devices' experts, which sort last)."""
  flat = ids.reshape(-1)
  key = jnp.where((flat >= 0) & (flat < e), flat, e)
  order = jnp.argsort(key, stable=True)
  counts = jnp.zeros((e + 1,), jnp.int32).at[key].add(1)[:e]
  return order, counts, key[order]


def _tiles(x, ids, weights, experts, tile):
  """Sorted pairs, padded per expert to ``tile`` rows, one batched matmul over the tiles."""
  n, k = ids.shape
  p = n * k
  e = _num_experts(experts.gate)
  nt = num_tiles(p, e, tile)
  order, counts, key = _sort_pairs(ids, e)
  padded = -(-counts // tile) * tile
  ends = jnp.cumsum(padded)                                                      # [E]
  starts = ends - padded
  first = jnp.cumsum(counts) - counts                                            # [E]
  local = key < e
  kk = jnp.minimum(key, e - 1)
  rank = jnp.arange(p, dtype=jnp.int32) - first[kk]
  rows = jnp.where(local, starts[kk] + rank, nt * tile)                          # [P] -> row
  src = jnp.full((nt * tile,), p, jnp.int32).at[rows].set(order, mode="drop")    # row -> pair
  live = src < p
  tok = jnp.where(live, src // k, 0)
  w = jnp.where(live, weights.reshape(-1)[jnp.minimum(src, p - 1)], 0.0)
  tile_e = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nt) * tile, side="right"), e - 1)

  used = jnp.arange(nt) * tile < ends[-1]  # tiles past the last group: skipped, not read

  def one_tile(_, a):  # reads one expert's matrices, in place
    xt, et, wt, ut = a                                                           # [tile, D]
    return None, jax.lax.cond(
        ut, lambda: _swiglu_rows(xt, take(experts.gate, et), take(experts.up, et),
                                 take(experts.down, et), wt),
        lambda: jnp.zeros_like(xt))
  unroll = True if _UNROLL_TILES[-1] else min(nt, _TILE_UNROLL)
  _, y = jax.lax.scan(one_tile, None, (x[tok].reshape(nt, tile, -1), tile_e,
                                       w.reshape(nt, tile), used), unroll=unroll)  # [nt, tile, D]
  return jnp.zeros_like(x).at[tok].add(y.reshape(nt * tile, -1))


def _ragged(x, ids, weights, experts):
  """Sorted pairs through ``jax.lax.ragged_dot`` (pairs of other devices' experts sort past
  the last group and come out zero)."""
  n, k = ids.shape
  e = _num_experts(experts.gate)
  order, counts, _ = _sort_pairs(ids, e)
  tok = order // k
  xs = x[tok]                                                                    # [P, D]
  w = weights.reshape(-1)[order]
  h = (jax.nn.silu(jax.lax.ragged_dot(xs, full(experts.gate), counts))
       * jax.lax.ragged_dot(xs, full(experts.up), counts))
  h = h * w[:, None].astype(x.dtype)
  y = jax.lax.ragged_dot(h, full(experts.down), counts)
  return jnp.zeros_like(x).at[tok].add(y)


def grouped(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: Experts,
            impl: str = "auto") -> jax.Array:
  """The routed experts' output for tokens ``x [N, D]`` routed to ``ids [N, k]`` (indices into
  ``experts``; ids outside ``[0, E)`` contribute nothing) with ``weights [N, k]``: ``[N, D]``.

  ``impl``: ``auto``, ``gather``, ``tiles`` or ``ragged`` (see the module docstring).
  """
  n, k = ids.shape
  e = _num_experts(experts.gate)
  impl = choose_impl(n, k, e, impl, quantized=isinstance(
      experts.gate, (quant.QuantizedArrays, quant.QuantizedParam)))
  if impl == "gather":
    return _gather(x, ids, weights, experts)
  if impl == "tiles":
    return _tiles(x, ids, weights, experts, tile_size(n * k, e))
  if impl == "ragged":
    return _ragged(x, ids, weights, experts)
  raise ValueError(f"grouped: impl {impl!r} is not a grouped path; use gather, tiles, ragged "
                   "or auto (the dense path is moe_reference)")


def _expert_axis(w):
  """The mesh axis the experts' first dimension is sharded over (None: replicated)."""
  spec = tuple(jax.typeof(w).sharding.spec)
  return spec[0] if spec else None


def routed_experts(x: jax.Array, gate: jax.Array, bias: jax.Array, experts: Experts,
                   rc: RoutingConfig, impl: str = "auto", act_axes=None,
                   expert_axes=None) -> jax.Array:
  """Routes ``x [B, T, D]`` and returns the routed experts' output ``[B, T, D]``.

  Outside a mesh everything is local. Under a mesh the grouped paths run inside
  ``jax.shard_map``: each device routes its own tokens, computes the pairs of the experts it
  holds, and a ``psum`` over the expert axis sums each token's experts (module docstring).
  ``impl="reference"`` is the dense evaluation (laid out by ``act_axes`` / ``expert_axes``).
  """
  if impl not in IMPLS:
    raise ValueError(f"unknown MoE impl {impl!r}; choose one of {IMPLS}")
  if impl == "reference":
    combine = combine_weights(x, gate, bias, rc)
    if expert_axes is not None:
      combine = shard(combine, expert_axes[:3])
    return moe_reference(x, combine, experts, act_axes, expert_axes)

  def local(x, gate, bias, experts, offset):
    b, t, d = x.shape
    ids, weights = route(x.reshape(b * t, d), gate, bias, rc)
    out = grouped(x.reshape(b * t, d), ids - offset, weights, experts, impl)
    return out.reshape(b, t, d)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(x, gate, bias, experts, 0)
  axis = _expert_axis(jax.tree.leaves(experts)[0])
  x_spec = jax.typeof(x).sharding.spec
  specs = lambda tree: jax.tree.map(lambda a: jax.typeof(a).sharding.spec, tree)

  def body(x, gate, bias, experts):
    if axis is None:
      return local(x, gate, bias, experts, 0)
    offset = jax.lax.axis_index(axis) * _num_experts(experts.gate)
    return jax.lax.psum(local(x, gate, bias, experts, offset), axis)

  return jax.shard_map(body, in_specs=(x_spec, specs(gate), specs(bias), specs(experts)),
                       out_specs=P(*x_spec))(x, gate, bias, experts)
