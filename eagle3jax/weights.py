"""Checkpoint weight names and layouts: one table per model family, for loading and export.

A ``WeightTable`` maps each of our parameter names (``embed_tokens``, ``layers.{i}.<path>``;
stacked layers are asked for one layer at a time, see ``eagle3jax.params``) to the Hugging Face
tensor names it is made of and a ``Layout`` that converts between the two:

* ``Linear(in_dims, out_dims)``: HF stores ``[out, in]``; ours is ``[*in_dims, *out_dims]``
  (the transpose, with heads split out), so every matmul reads ``x @ w`` with named axes.
* ``Plain(shape)``: a vector or table stored as is (reshaped to ``shape`` when given).
* ``Experts(count, linear)``: ``count`` per-expert HF tensors (``...experts.{e}...``) stacked
  into ``[E, *in_dims, *out_dims]``.

The same table drives ``load_target`` (HF -> ours) and ``hf_export.save_target`` (ours -> HF),
so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Linear:
  """HF ``[out, in]`` <-> ours ``[*in_dims, *out_dims]``."""
  in_dims: tuple[int, ...]
  out_dims: tuple[int, ...]

  def to_ours(self, w: np.ndarray) -> np.ndarray:
    want = (math.prod(self.out_dims), math.prod(self.in_dims))
    if tuple(w.shape) != want:
      raise ValueError(f"shape {tuple(w.shape)}, expected {want} ([out, in])")
    return w.T.reshape(*self.in_dims, *self.out_dims)

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    return w.reshape(math.prod(self.in_dims), math.prod(self.out_dims)).T


@dataclasses.dataclass(frozen=True)
class Plain:
  """Stored as is; ``shape`` reshapes (e.g. a ``[N*H]`` bias to ``[N, H]``)."""
  shape: tuple[int, ...] | None = None

  def to_ours(self, w: np.ndarray) -> np.ndarray:
    if self.shape is None:
      return w
    if w.size != math.prod(self.shape):
      raise ValueError(f"shape {tuple(w.shape)}, expected {self.shape} elements")
    return w.reshape(self.shape)

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    return w if self.shape is None else w.reshape(-1)


@dataclasses.dataclass(frozen=True)
class Experts:
  """``count`` per-expert ``Linear`` tensors stacked into ``[E, *in_dims, *out_dims]``."""
  count: int
  linear: Linear


Layout = Linear | Plain | Experts
PLAIN = Plain()


@dataclasses.dataclass(frozen=True)
class Entry:
  """One parameter: its HF tensor name(s) (one per expert for ``Experts``) and layout."""
  hf_names: tuple[str, ...]
  layout: Layout


@dataclasses.dataclass(frozen=True)
class WeightTable:
  """Our parameter names -> HF tensors, for one model family and config.

  Attributes:
    top: entries outside the decoder layers, by our name.
    layer: ``layer(i)`` -> entries of decoder layer ``i`` by our path inside the layer; HF
      names relative to the layer's prefix ``model.layers.{i}.``.
  """
  top: dict[str, tuple[str, Layout]]
  layer: Callable[[int], dict[str, tuple[str, Layout]]]

  def entry(self, name: str) -> Entry:
    """The entry of our parameter ``name`` (``embed_tokens`` or ``layers.{i}.<path>``)."""
    if name in self.top:
      hf, layout = self.top[name]
      return Entry((hf,), layout)
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 3 or not parts[1].isdigit():
      raise ValueError(f"no checkpoint tensor is known for parameter {name!r}")
    i, rest = int(parts[1]), ".".join(parts[2:])
    table = self.layer(i)
    if rest not in table:
      raise ValueError(f"no checkpoint tensor is known for parameter {name!r}")
    hf, layout = table[rest]
    prefix = f"model.layers.{i}."
    if isinstance(layout, Experts):
      return Entry(tuple(prefix + hf.format(e=e) for e in range(layout.count)), layout)
    return Entry((prefix + hf,), layout)


class StackedView:
  """``np.stack(parts)`` without the copy: indexing reads only the parts it selects (and only
  the slices of them the rest of the index asks for), so a device that holds some experts
  reads only those from a memory-mapped checkpoint (``eagle3jax.params``)."""

  def __init__(self, parts: list[np.ndarray]):
    self.parts = parts
    self.shape = (len(parts),) + tuple(parts[0].shape)
    self.ndim = len(self.shape)
    self.dtype = parts[0].dtype

  def __getitem__(self, idx):
    idx = idx if isinstance(idx, tuple) else (idx,)
    picks = np.arange(len(self.parts))[idx[0]]
    if picks.ndim == 0:
      return np.asarray(self.parts[int(picks)][idx[1:]])
    if picks.size == 0:
      return np.asarray(self)[idx]
    return np.stack([np.asarray(self.parts[int(e)][idx[1:]]) for e in picks])

  def __array__(self, dtype=None, copy=None):
    del copy
    out = np.stack([np.asarray(w) for w in self.parts])
    return out if dtype is None else out.astype(dtype)


def to_ours(entry: Entry, tensors: list[np.ndarray]) -> np.ndarray | StackedView:
  """HF tensors (float or already dequantised) -> our layout (views where the layout allows:
  a memory-mapped tensor is read only where it is indexed)."""
  layout = entry.layout
  if isinstance(layout, Experts):
    return StackedView([layout.linear.to_ours(np.asarray(w)) for w in tensors])
  return layout.to_ours(np.asarray(tensors[0]))


def to_hf(entry: Entry, value: np.ndarray) -> dict[str, np.ndarray]:
  """Our layout -> ``{hf_name: tensor}``."""
  layout = entry.layout
  if isinstance(layout, Experts):
    return {n: layout.linear.to_hf(value[e]) for e, n in enumerate(entry.hf_names)}
  return {entry.hf_names[0]: layout.to_hf(value)}


def linear_dims(layout: Layout) -> Linear | None:
  """The ``Linear`` of a layout (per expert for ``Experts``), or None for plain tensors."""
  if isinstance(layout, Experts):
    return layout.linear
  return layout if isinstance(layout, Linear) else None


# --- the tables ---

def llama_table(cfg) -> WeightTable:
  """Llama / Qwen2 / Qwen3 (``eagle3jax.config.LlamaConfig``)."""
  d, n, h, k = (cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim,
                cfg.num_key_value_heads)
  f, v = cfg.intermediate_size, cfg.vocab_size
  layer = {
      "self_attn.q_proj": ("self_attn.q_proj.weight", Linear((d,), (n, h))),
      "self_attn.k_proj": ("self_attn.k_proj.weight", Linear((d,), (k, h))),
      "self_attn.v_proj": ("self_attn.v_proj.weight", Linear((d,), (k, h))),
      "self_attn.o_proj": ("self_attn.o_proj.weight", Linear((n, h), (d,))),
      "self_attn.q_bias": ("self_attn.q_proj.bias", Plain((n, h))),
      "self_attn.k_bias": ("self_attn.k_proj.bias", Plain((k, h))),
      "self_attn.v_bias": ("self_attn.v_proj.bias", Plain((k, h))),
      "self_attn.o_bias": ("self_attn.o_proj.bias", PLAIN),
      "self_attn.q_norm.weight": ("self_attn.q_norm.weight", PLAIN),
      "self_attn.k_norm.weight": ("self_attn.k_norm.weight", PLAIN),
      "input_layernorm.weight": ("input_layernorm.weight", PLAIN),
      "post_attention_layernorm.weight": ("post_attention_layernorm.weight", PLAIN),
      **_mlp("mlp.", d, f),
  }
  return WeightTable(_top(d, v), lambda i: layer)


def deepseek_table(cfg) -> WeightTable:
  """DeepSeek-V3 / Kimi-K2 (``eagle3jax.deepseek_config.DeepseekConfig``)."""
  d, n, v = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
  qk, c, f = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.moe_intermediate_size
  attn = {
      "input_layernorm.weight": ("input_layernorm.weight", PLAIN),
      "post_attention_layernorm.weight": ("post_attention_layernorm.weight", PLAIN),
      "self_attn.kv_a_proj_with_mqa": ("self_attn.kv_a_proj_with_mqa.weight",
                                       Linear((d,), (c + cfg.qk_rope_head_dim,))),
      "self_attn.kv_a_layernorm.weight": ("self_attn.kv_a_layernorm.weight", PLAIN),
      "self_attn.kv_b_proj": ("self_attn.kv_b_proj.weight",
                              Linear((c,), (n, cfg.qk_nope_head_dim + cfg.v_head_dim))),
      "self_attn.o_proj": ("self_attn.o_proj.weight", Linear((n, cfg.v_head_dim), (d,))),
  }
  if cfg.q_lora_rank is None:
    attn["self_attn.q_proj"] = ("self_attn.q_proj.weight", Linear((d,), (n, qk)))
  else:
    r = cfg.q_lora_rank
    attn["self_attn.q_a_proj"] = ("self_attn.q_a_proj.weight", Linear((d,), (r,)))
    attn["self_attn.q_a_layernorm.weight"] = ("self_attn.q_a_layernorm.weight", PLAIN)
    attn["self_attn.q_b_proj"] = ("self_attn.q_b_proj.weight", Linear((r,), (n, qk)))
  dense = {**attn, **_mlp("mlp.", d, cfg.intermediate_size)}
  e = cfg.n_routed_experts
  moe = {
      **attn,
      "mlp.gate": ("mlp.gate.weight", Linear((d,), (e,))),
      "mlp.e_score_correction_bias": ("mlp.gate.e_score_correction_bias", PLAIN),
      "mlp.gate_proj": ("mlp.experts.{e}.gate_proj.weight", Experts(e, Linear((d,), (f,)))),
      "mlp.up_proj": ("mlp.experts.{e}.up_proj.weight", Experts(e, Linear((d,), (f,)))),
      "mlp.down_proj": ("mlp.experts.{e}.down_proj.weight", Experts(e, Linear((f,), (d,)))),
  }
  if cfg.n_shared_experts:
    moe.update(_mlp("mlp.shared_experts.", d, f * cfg.n_shared_experts))
  return WeightTable(_top(d, v), lambda i: moe if cfg.is_moe_layer(i) else dense)


def _top(d: int, v: int) -> dict[str, tuple[str, Layout]]:
  return {"embed_tokens": ("model.embed_tokens.weight", PLAIN),
          "lm_head": ("lm_head.weight", Linear((d,), (v,))),
          "norm.weight": ("model.norm.weight", PLAIN)}


def _mlp(prefix: str, d: int, f: int) -> dict[str, tuple[str, Layout]]:
  return {prefix + "gate_proj": (prefix + "gate_proj.weight", Linear((d,), (f,))),
          prefix + "up_proj": (prefix + "up_proj.weight", Linear((d,), (f,))),
          prefix + "down_proj": (prefix + "down_proj.weight", Linear((f,), (d,)))}
