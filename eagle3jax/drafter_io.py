"""Loading and saving EAGLE-3 drafters in the public ``LlamaForCausalLMEagle3`` layout, and the
capture contract.

The capture contract (what the drafter was trained on is what it is served with):

* ``eagle_config.eagle_aux_hidden_state_layer_ids`` with a recorded ``aux_layer_convention``
  (``"output"``: id ``i`` is the output of layer ``i``, this project's convention; ``"input"``:
  id ``i`` is the input of layer ``i``, i.e. the output of layer ``i - 1``) is used as recorded.
* Ids without a convention are ambiguous (engines disagree by one layer): ``load_drafter``
  refuses them unless ``aux_layer_convention=`` settles it, and logs the physical layers.
* No ids at all: the official EAGLE-3 default, inputs of layers (2, L//2, L-3).

``save_drafter`` always records ids in the project convention with the convention field, so a
saved drafter reloads with no argument.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh

from eagle3jax.capture import CaptureSpec
from eagle3jax.distributed import barrier, is_main_process, to_host
from eagle3jax.drafter import DrafterConfig, Eagle3Drafter, drafter_kv_repeat
from eagle3jax.hf_target import read_config
from eagle3jax.params import materialize, random_fill
from eagle3jax.rope import RopeConfig
from eagle3jax.safetensors_io import SafetensorsDir
from eagle3jax.sharding import TENSOR

log = logging.getLogger("eagle3jax")

CONVENTIONS = ("input", "output")
_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


def resolve_capture(hf: dict, num_target_layers: int,
                    aux_layer_convention: str | None = None) -> tuple[CaptureSpec, str]:
  """Applies the capture contract to a drafter ``config.json``; returns (spec, explanation)."""
  if aux_layer_convention is not None and aux_layer_convention not in CONVENTIONS:
    raise ValueError(f"aux_layer_convention={aux_layer_convention!r}; choose 'input' or "
                     "'output'")
  eagle = hf.get("eagle_config") or {}
  ids = eagle.get(_IDS_KEY, hf.get(_IDS_KEY))
  recorded = eagle.get("aux_layer_convention", hf.get("aux_layer_convention"))
  if ids is None:
    spec = CaptureSpec.eagle3_default(num_target_layers)
    return spec, (f"no capture ids in the drafter config: using the official EAGLE-3 default "
                  f"(inputs of layers 2, L//2, L-3) = outputs of layers {spec.as_list()}")
  ids = [int(i) for i in ids]
  if recorded is not None:
    if recorded not in CONVENTIONS:
      raise ValueError(f"drafter config aux_layer_convention={recorded!r} is not 'input' or "
                       "'output'")
    if aux_layer_convention is not None and aux_layer_convention != recorded:
      raise ValueError(
          f"aux_layer_convention={aux_layer_convention!r} contradicts the drafter config, "
          f"which records {_IDS_KEY}={ids} with aux_layer_convention={recorded!r}; drop the "
          "argument")
    convention = recorded
  elif aux_layer_convention is None:
    as_input = [i - 1 for i in ids]
    raise ValueError(
        f"the drafter config gives {_IDS_KEY}={ids} without saying which convention they "
        f"use, and engines disagree by one layer: read as 'input of layer k' (vLLM) they are "
        f"the outputs of layers {as_input}; read as 'output of layer k' (SpecForge) they are "
        f"the outputs of layers {ids}. Pass aux_layer_convention='input' or "
        f"aux_layer_convention='output' to load_drafter (scripts/decode.py: "
        f"--aux-layer-convention) with the convention the drafter was trained with")
  else:
    convention = aux_layer_convention
  physical = [i - 1 for i in ids] if convention == "input" else ids
  spec = CaptureSpec(tuple(physical))
  spec.validate(num_target_layers)
  return spec, (f"{_IDS_KEY}={ids} read as {convention!r} of layer k: captures the outputs of "
                f"target layers {physical} (-1 = embedding)")


def config_from_hf(hf: dict, capture: CaptureSpec) -> DrafterConfig:
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"drafter config field hidden_act={act!r} is not supported (only 'silu')")
  missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                         "vocab_size") if k not in hf]
  if missing:
    raise ValueError(f"drafter config.json is missing required fields {missing}")
  rope_hf = {k: hf[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in hf}
  return DrafterConfig(
      hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
      num_attention_heads=hf["num_attention_heads"],
      num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
      head_dim=hf.get("head_dim"), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      rope=RopeConfig.from_hf(rope_hf, default_theta=10000.0),
      max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
      vocab_size=hf["vocab_size"],
      draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
      target_hidden_size=hf.get("target_hidden_size"), capture=capture)


def _hf_name_and_transform(name: str, cfg: DrafterConfig):
  d, n, h, k = (cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim,
                cfg.num_key_value_heads)
  table = {
      "embed_tokens": ("embed_tokens.weight", lambda w: w),
      "fc": ("fc.weight", lambda w: w.T),
      "hidden_norm.weight": ("midlayer.hidden_norm.weight", lambda w: w),
      "input_layernorm.weight": ("midlayer.input_layernorm.weight", lambda w: w),
      "post_attention_layernorm.weight": ("midlayer.post_attention_layernorm.weight",
                                          lambda w: w),
      "self_attn.q_proj": ("midlayer.self_attn.q_proj.weight",
                           lambda w: w.T.reshape(2 * d, n, h)),
      "self_attn.k_proj": ("midlayer.self_attn.k_proj.weight",
                           lambda w: w.T.reshape(2 * d, k, h)),
      "self_attn.v_proj": ("midlayer.self_attn.v_proj.weight",
                           lambda w: w.T.reshape(2 * d, k, h)),
      "self_attn.o_proj": ("midlayer.self_attn.o_proj.weight",
                           lambda w: w.T.reshape(n, h, d)),
      "mlp.gate_proj": ("midlayer.mlp.gate_proj.weight", lambda w: w.T),
      "mlp.up_proj": ("midlayer.mlp.up_proj.weight", lambda w: w.T),
      "mlp.down_proj": ("midlayer.mlp.down_proj.weight", lambda w: w.T),
      "norm.weight": ("norm.weight", lambda w: w),
      "lm_head": ("lm_head.weight", lambda w: w.T),
      "d2t": ("d2t", lambda w: w),
      "t2d": ("t2d", lambda w: w),
  }
  return table[name]


def _attach(drafter: Eagle3Drafter, target, mesh: Mesh) -> Eagle3Drafter:
  cfg = drafter.config
  if not drafter.own_embedding:
    table = target.embed_tokens[...]
    if table.shape != (cfg.vocab_size, cfg.hidden_size):
      raise ValueError(
          f"the drafter has no embed_tokens.weight and the target's embedding has shape "
          f"{tuple(table.shape)}, but the drafter needs [vocab_size={cfg.vocab_size}, "
          f"hidden_size={cfg.hidden_size}]; use a checkpoint that carries embed_tokens.weight")
    drafter.embed_tokens = target.embed_tokens  # shared, not copied
  drafter.mesh = mesh
  return drafter


def check_pair(target, drafter_cfg: DrafterConfig) -> None:
  """Raises ValueError when a drafter does not fit a target (vocab, widths, layers)."""
  tcfg = target.config
  if drafter_cfg.vocab_size != tcfg.vocab_size:
    raise ValueError(f"drafter vocab_size={drafter_cfg.vocab_size} differs from the target's "
                     f"vocab_size={tcfg.vocab_size}")
  if drafter_cfg.feature_size != tcfg.hidden_size:
    raise ValueError(f"drafter target_hidden_size={drafter_cfg.feature_size} differs from the "
                     f"target's hidden_size={tcfg.hidden_size}")
  drafter_cfg.capture.validate(tcfg.num_hidden_layers)


def load_drafter(path: str, *, target, mesh: Mesh | None = None,
                 aux_layer_convention: str | None = None, dtype=None) -> Eagle3Drafter:
  """Loads an EAGLE-3 drafter checkpoint (public ``LlamaForCausalLMEagle3`` layout).

  Args:
    path: directory with ``config.json`` and ``model.safetensors``.
    target: the target model it drafts for (its embedding is shared).
    mesh: defaults to the target's mesh.
    aux_layer_convention: ``"input"`` or ``"output"``; required only when the config gives
      capture ids without a recorded convention (see the module docstring).
    dtype: parameter dtype (default: the target's).
  """
  mesh = mesh or target.mesh
  hf = read_config(path)
  capture, explanation = resolve_capture(hf, target.num_layers, aux_layer_convention)
  log.info("drafter %s: %s", path, explanation)
  cfg = config_from_hf(hf, capture)
  check_pair(target, cfg)
  tensors = SafetensorsDir(path)
  own = "embed_tokens.weight" in tensors
  fc_in = tensors.shape("fc.weight")[1] if "fc.weight" in tensors else None
  if fc_in is not None and fc_in != capture.width(cfg.feature_size):
    raise ValueError(
        f"drafter fc.weight takes {fc_in} input features, but the capture spec "
        f"{capture.as_list()} gives {len(capture.layer_ids)} x {cfg.feature_size} = "
        f"{capture.width(cfg.feature_size)}: the capture list does not match the drafter")
  used = set()

  def fill(name, shape, init):
    hf_name, fn = _hf_name_and_transform(name, cfg)
    if hf_name not in tensors:
      if name == "d2t" and cfg.draft_vocab_size == cfg.vocab_size:
        return np.zeros(shape, np.int32)  # full vocabulary: draft id == target id
      if name == "t2d" and cfg.draft_vocab_size == cfg.vocab_size:
        return np.ones(shape, bool)
      raise ValueError(f"drafter checkpoint {path!r} is missing weight {hf_name!r}"
                       + (" (without d2t, draft ids cannot be mapped to target ids)"
                          if name in ("d2t", "t2d") else ""))
    used.add(hf_name)
    w = tensors.get(hf_name)
    try:
      out = fn(np.asarray(w))
    except ValueError:
      out = None
    if out is None or tuple(out.shape) != tuple(shape):
      raise ValueError(f"drafter weight {hf_name!r} has shape {tuple(w.shape)}, which does not "
                       f"fit the config (expected {shape} after the layout change)")
    return out

  dtype = dtype or target.dtype
  kv_repeat = drafter_kv_repeat(cfg, mesh.shape[TENSOR])
  drafter = materialize(lambda: Eagle3Drafter(cfg, kv_repeat=kv_repeat, own_embedding=own,
                                              dtype=dtype), mesh, fill, kv_repeat)
  extra = sorted(set(tensors.names) - used)
  if extra:
    raise ValueError(f"drafter checkpoint {path!r} has unexpected weights {extra[:8]}")
  drafter.capture_explanation = explanation
  return _attach(drafter, target, mesh)


def init_drafter(cfg: DrafterConfig, *, target, mesh: Mesh | None = None, dtype=None,
                 seed: int = 0, std: float = 0.02, d2t=None) -> Eagle3Drafter:
  """A randomly initialised drafter for ``target`` (optionally with a draft-vocab ``d2t``)."""
  mesh = mesh or target.mesh
  check_pair(target, cfg)
  base = random_fill(seed, std)

  def fill(name, shape, init):
    if name == "d2t":
      return np.zeros(shape, np.int32) if d2t is None else np.asarray(d2t, np.int32)
    if name == "t2d":
      if d2t is None:
        return np.ones(shape, bool)
      mask = np.zeros(shape, bool)
      mask[np.arange(len(d2t)) + np.asarray(d2t)] = True
      return mask
    return base(name, shape, init)

  dtype = dtype or target.dtype
  kv_repeat = drafter_kv_repeat(cfg, mesh.shape[TENSOR])
  drafter = materialize(lambda: Eagle3Drafter(cfg, kv_repeat=kv_repeat, dtype=dtype), mesh,
                        fill, kv_repeat)
  drafter.capture_explanation = "initialised in eagle3jax"
  return _attach(drafter, target, mesh)


def _host(x) -> np.ndarray:
  return to_host(x)


def save_drafter(drafter: Eagle3Drafter, path: str) -> None:
  """Writes ``config.json`` and ``model.safetensors`` in the public EAGLE-3 layout.

  The capture ids are recorded in the project convention with ``aux_layer_convention:
  "output"``, so ``load_drafter(path, target=...)`` needs no convention argument. In a
  multi-process run every process calls it (the parameters are gathered collectively) and
  process 0 writes the files.
  """
  cfg = drafter.config
  d, n, h, k = (cfg.hidden_size, cfg.num_attention_heads, cfg.resolved_head_dim,
                cfg.num_key_value_heads)
  r = drafter.kv_repeat
  attn = drafter.self_attn

  def kv(w):  # undo KV-head replication: [2D, K*r, H] -> HF [K*H, 2D]
    w = _host(w)[:, ::r, :]
    return w.reshape(2 * d, k * h).T

  tensors = {
      "fc.weight": _host(drafter.fc[...]).T,
      "midlayer.hidden_norm.weight": _host(drafter.hidden_norm.weight[...]),
      "midlayer.input_layernorm.weight": _host(drafter.input_layernorm.weight[...]),
      "midlayer.post_attention_layernorm.weight":
          _host(drafter.post_attention_layernorm.weight[...]),
      "midlayer.self_attn.q_proj.weight": _host(attn.q_proj[...]).reshape(2 * d, n * h).T,
      "midlayer.self_attn.k_proj.weight": kv(attn.k_proj[...]),
      "midlayer.self_attn.v_proj.weight": kv(attn.v_proj[...]),
      "midlayer.self_attn.o_proj.weight": _host(attn.o_proj[...]).reshape(n * h, d).T,
      "midlayer.mlp.gate_proj.weight": _host(drafter.mlp.gate_proj[...]).T,
      "midlayer.mlp.up_proj.weight": _host(drafter.mlp.up_proj[...]).T,
      "midlayer.mlp.down_proj.weight": _host(drafter.mlp.down_proj[...]).T,
      "norm.weight": _host(drafter.norm.weight[...]),
      "lm_head.weight": _host(drafter.lm_head[...]).T,
      "d2t": _host(drafter.d2t[...]).astype(np.int64),
      "t2d": _host(drafter.t2d[...]).astype(bool),
  }
  if drafter.own_embedding:
    tensors["embed_tokens.weight"] = _host(drafter.embed_tokens[...])
  tensors = {key: np.ascontiguousarray(v) for key, v in tensors.items()}
  if not is_main_process():
    barrier("eagle3jax.save_drafter")
    return
  os.makedirs(path, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
  hf = {
      "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
      "hidden_act": "silu", "hidden_size": d, "intermediate_size": cfg.intermediate_size,
      "num_attention_heads": n, "num_key_value_heads": k, "head_dim": h,
      "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
      "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
      "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.feature_size,
      "tie_word_embeddings": False, "torch_dtype": str(np.dtype(drafter.dtype)),
      "rope_theta": cfg.rope.theta,
      "rope_scaling": None if cfg.rope.rope_type == "default" else {
          "rope_type": cfg.rope.rope_type, "factor": cfg.rope.factor,
          "low_freq_factor": cfg.rope.low_freq_factor,
          "high_freq_factor": cfg.rope.high_freq_factor,
          "original_max_position_embeddings": cfg.rope.original_max_position_embeddings},
      "eagle_config": {_IDS_KEY: cfg.capture.as_list(), "use_aux_hidden_state": True,
                       "aux_layer_convention": "output"},
  }
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  barrier("eagle3jax.save_drafter")


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _draft_logits(graphdef, state, tokens, aux):
  drafter = nnx.merge(graphdef, state)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  a, _ = drafter(tokens, drafter.project(aux), positions)
  return drafter.logits(a)


def draft_logits(drafter: Eagle3Drafter, input_ids, aux_hidden) -> jax.Array:
  """Runs the drafter over a full sequence: ``[B, T, draft_vocab]`` float32 logits.

  Position ``s`` pairs the embedding of ``input_ids[:, s]`` with ``aux_hidden[:, s]`` (so pass
  the tokens shifted by one relative to the features, as in training), causal attention,
  positions ``0..T-1``.
  """
  from eagle3jax.api import check_tokens  # pylint: disable=import-outside-toplevel
  cfg = drafter.config
  tokens = check_tokens(input_ids, cfg.vocab_size)
  aux = jnp.asarray(aux_hidden)
  width = cfg.capture.width(cfg.feature_size)
  if aux.shape != tokens.shape + (width,):
    raise ValueError(f"aux_hidden has shape {tuple(aux.shape)}; expected "
                     f"{tokens.shape + (width,)} ([B, T, len(capture) * target_hidden_size] "
                     f"for capture {cfg.capture.as_list()})")
  graphdef, state = nnx.split(drafter)
  with jax.set_mesh(drafter.mesh):
    return _draft_logits(graphdef, state, jnp.asarray(tokens), aux)
