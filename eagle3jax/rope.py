"""Rotary position embeddings: the frequency table for each supported ``rope_type``.

Supported types: ``default``, ``linear``, ``llama3`` (Llama 3.1 frequency smoothing) and
``yarn`` (DeepSeek-V3 / Kimi-K2 only), the same formulas as ``transformers``'
ROPE_INIT_FUNCTIONS. Anything else is refused by ``RopeConfig.from_hf`` with the field named.
YaRN also changes the attention: ``RopeConfig.attention_factor`` scales cos/sin and
``RopeConfig.softmax_scale`` is DeepSeek's ``mscale``-corrected softmax scale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from eagle3jax import checks

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# What ``from_hf`` accepts unless the caller allows more (Llama-family models do not apply
# YaRN's attention factor, so they do not accept ``yarn``).
LLAMA_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA_KEYS = frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"})
# What transformers requires of each scaled type (``yarn`` derives a missing factor below).
_REQUIRED_KEYS = {"linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings")}
_YARN_KEYS = frozenset({"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                        "mscale", "mscale_all_dim", "attention_factor", "truncate"})


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding settings.

  Attributes:
    theta: base of the geometric frequency progression.
    rope_type: one of ``SUPPORTED_ROPE_TYPES``.
    factor: scaling factor (``linear``, ``llama3``).
    low_freq_factor: ``llama3`` only.
    high_freq_factor: ``llama3`` only.
    original_max_position_embeddings: ``llama3``/``yarn``: the pre-training context length.
    beta_fast: ``yarn`` only: rotations bounding the extrapolated (unscaled) dimensions.
    beta_slow: ``yarn`` only: rotations bounding the interpolated (scaled) dimensions.
    mscale: ``yarn`` only: numerator of the cos/sin attention factor (0 = absent).
    mscale_all_dim: ``yarn`` only: denominator of that factor, and DeepSeek's softmax-scale
      correction (0 = absent).
    yarn_attention_factor: ``yarn`` only: explicit ``attention_factor`` (None: derived).
    truncate: ``yarn`` only: round the correction range to whole dimensions.
  """
  theta: float = 10000.0
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  yarn_attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: "
                       f"{SUPPORTED_ROPE_TYPES}")
    if not 0 < self.theta < float("inf"):
      raise ValueError(f"rope_theta={self.theta!r} must be a finite positive number")
    if not 0 < self.factor < float("inf"):
      raise ValueError(f"rope factor={self.factor!r} must be a finite positive number")

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], *, default_theta: float = 10000.0,
              rope_types: tuple[str, ...] = LLAMA_ROPE_TYPES) -> "RopeConfig":
    """Reads both config styles seen in real checkpoints.

    Published style: ``rope_theta`` at the top level and ``rope_scaling`` (with ``rope_type``
    or the older ``type`` key) or null. transformers 5 style: ``rope_parameters`` holding
    ``rope_type``, ``rope_theta`` and the scaling fields. ``rope_types`` are the types the
    calling model implements.
    """
    for key in ("rope_parameters", "rope_scaling"):
      if hf.get(key) is not None and not isinstance(hf[key], Mapping):
        raise ValueError(f"config field {key}={hf[key]!r} must be a JSON object (or null)")
    params = hf.get("rope_parameters")
    if params is not None:
      params = dict(params)
      theta = params.pop("rope_theta", hf.get("rope_theta", default_theta))
      where = "rope_parameters"
    else:
      params = dict(hf.get("rope_scaling") or {})
      theta = hf.get("rope_theta", default_theta)
      where = "rope_scaling"
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in rope_types:
      raise ValueError(f"config field {where}.rope_type={rope_type!r} is not supported; "
                       f"supported: {rope_types}")
    known = _YARN_KEYS if rope_type == "yarn" else _LLAMA_KEYS
    unknown = sorted(set(params) - known)
    if unknown:
      raise ValueError(f"config field {where} has unsupported keys {unknown} for rope type "
                       f"{rope_type!r}")
    kwargs = {k: params[k] for k in known if k in params}
    if rope_type == "default":
      kwargs.pop("factor", None)
    missing = [k for k in _REQUIRED_KEYS.get(rope_type, ()) if kwargs.get(k) is None]
    if missing:  # transformers refuses these too; the dataclass defaults are not the model's
      raise ValueError(f"config field {where} is missing {missing} for rope type "
                       f"{rope_type!r}")
    for key in _REQUIRED_KEYS.get(rope_type, ()):
      kwargs[key] = checks.hf_number(kwargs, key, None,
                                     int if key == "original_max_position_embeddings"
                                     else float, where=f"config field {where}.")
    if rope_type == "yarn":
      for key in list(kwargs):
        if kwargs[key] is None:  # null or absent: transformers' defaults
          kwargs.pop(key)
      where_ = f"config field {where}."
      top = checks.hf_number(hf, "max_position_embeddings", None, int)
      orig = checks.hf_number(kwargs, "original_max_position_embeddings", top, int, where_)
      if "factor" not in kwargs:  # transformers: the context-extension ratio
        if orig is None or top is None:
          raise ValueError(f"config field {where}.factor is missing for rope type 'yarn' (and "
                           "max_position_embeddings / original_max_position_embeddings do not "
                           "give it)")
        kwargs["factor"] = top / orig
      kwargs["original_max_position_embeddings"] = 8192 if orig is None else orig
      if "attention_factor" in kwargs:
        kwargs["yarn_attention_factor"] = checks.hf_number(kwargs, "attention_factor", None,
                                                           where=where_)
        kwargs.pop("attention_factor")
      for key in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if key in kwargs:
          kwargs[key] = checks.hf_number(kwargs, key, None, where=where_)
      kwargs["truncate"] = bool(kwargs.get("truncate", True))
    if not checks.is_real(theta):
      raise ValueError(f"config field rope_theta={theta!r} must be a number (or absent, for "
                       f"{default_theta})")
    return cls(theta=float(theta), rope_type=rope_type, **kwargs)

  def to_hf(self) -> dict | None:
    """The ``rope_scaling`` entry of a Llama-layout ``config.json`` (None for ``default``):
    the keys transformers reads for this type, which ``from_hf`` reads back."""
    if self.rope_type == "default":
      return None
    if self.rope_type not in _REQUIRED_KEYS:
      raise ValueError(f"rope type {self.rope_type!r} has no Llama-layout rope_scaling; "
                       f"the Llama layout holds {LLAMA_ROPE_TYPES}")
    return {"rope_type": self.rope_type,
            **{k: getattr(self, k) for k in _REQUIRED_KEYS[self.rope_type]}}

  def inv_frequencies(self, rotary_dim: int) -> np.ndarray:
    """Inverse frequencies ``[rotary_dim // 2]`` (float64 numpy, cast at use)."""
    inv = 1.0 / (self.theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    if self.rope_type == "linear":
      inv = inv / self.factor
    elif self.rope_type == "llama3":
      old = self.original_max_position_embeddings
      low_wavelen = old / self.low_freq_factor
      high_wavelen = old / self.high_freq_factor
      wavelen = 2 * math.pi / inv
      scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
      smooth = (old / wavelen - self.low_freq_factor) / (
          self.high_freq_factor - self.low_freq_factor)
      smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
      medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
      inv = np.where(medium, smoothed, scaled)
    elif self.rope_type == "yarn":
      inv = self._yarn_inv_frequencies(inv, rotary_dim)
    return inv

  def _yarn_inv_frequencies(self, extrapolation: np.ndarray, dim: int) -> np.ndarray:
    """Blends ``extrapolation`` (unscaled) with ``extrapolation / factor`` dimension-wise."""
    def correction_dim(rotations):
      return (dim * math.log(self.original_max_position_embeddings
                             / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))
    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low frequencies)
    return extrapolation / self.factor * (1 - keep) + extrapolation * keep

  @property
  def attention_factor(self) -> float:
    """The factor transformers multiplies cos and sin by (1 except for ``yarn``)."""
    if self.rope_type != "yarn":
      return 1.0
    if self.yarn_attention_factor is not None:
      return float(self.yarn_attention_factor)
    if self.mscale and self.mscale_all_dim:
      return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor,
                                                                          self.mscale_all_dim)
    return yarn_get_mscale(self.factor)

  def softmax_scale(self, head_dim: int) -> float:
    """DeepSeek's attention softmax scale: ``head_dim ** -0.5``, times ``mscale ** 2`` with
    ``mscale = yarn_get_mscale(factor, mscale_all_dim)`` for scaled rope types."""
    scale = head_dim ** -0.5
    if self.rope_type != "default" and self.mscale_all_dim:
      scale *= yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2
    return scale


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates ``x [B, T, N, H]`` at ``positions [B, T]`` (half-split layout, as Llama).

  The first and second halves of the head dimension form the rotation pairs, matching
  ``transformers``' ``rotate_half``. Computed in float32, returned in ``x.dtype``.
  """
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  cos = jnp.cos(freqs)[:, :, None, :]  # [B, T, 1, H/2]
  sin = jnp.sin(freqs)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
