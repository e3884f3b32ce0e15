"""Rotary position embeddings: the frequency table for each supported ``rope_type``.

Supported types: ``default``, ``linear`` and ``llama3`` (Llama 3.1 frequency smoothing), the
same formulas as ``transformers``' ROPE_INIT_FUNCTIONS. Anything else is refused by
``RopeConfig.from_hf`` with the field named.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding settings.

  Attributes:
    theta: base of the geometric frequency progression.
    rope_type: one of ``SUPPORTED_ROPE_TYPES``.
    factor: scaling factor (``linear``, ``llama3``).
    low_freq_factor: ``llama3`` only.
    high_freq_factor: ``llama3`` only.
    original_max_position_embeddings: ``llama3`` only: the pre-training context length.
  """
  theta: float = 10000.0
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: "
                       f"{SUPPORTED_ROPE_TYPES}")
    if not self.theta > 0:
      raise ValueError(f"rope_theta={self.theta!r} must be positive")
    if not self.factor > 0:
      raise ValueError(f"rope factor={self.factor!r} must be positive")

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], *, default_theta: float = 10000.0) -> "RopeConfig":
    """Reads both config styles seen in real checkpoints.

    Published style: ``rope_theta`` at the top level and ``rope_scaling`` (with ``rope_type``
    or the older ``type`` key) or null. transformers 5 style: ``rope_parameters`` holding
    ``rope_type``, ``rope_theta`` and the scaling fields.
    """
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
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"config field {where}.rope_type={rope_type!r} is not supported; "
                       f"supported: {SUPPORTED_ROPE_TYPES}")
    known = {"factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings"}
    unknown = sorted(set(params) - known)
    if unknown:
      raise ValueError(f"config field {where} has unsupported keys {unknown} for rope type "
                       f"{rope_type!r}")
    kwargs = {k: params[k] for k in known if k in params}
    if rope_type == "default":
      kwargs.pop("factor", None)
    return cls(theta=float(theta), rope_type=rope_type, **kwargs)

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
    return inv


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
