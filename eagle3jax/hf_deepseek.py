"""DeepSeek-V3 / Kimi-K2 checkpoints: FP8 weights and random initialisation.

Loading goes through ``eagle3jax.load_target`` (one body for every family, names from
``eagle3jax.weights.deepseek_table``).

FP8 checkpoints (``quantization_config: {quant_method: fp8, weight_block_size: [bo, bi]}``)
store e4m3 weights with a ``<name>_scale_inv`` float per ``bo x bi`` block (the last blocks may
be partial); they are dequantised on the host (``w * scale_inv``) to the requested dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from eagle3jax.deepseek import DeepseekForCausalLM
from eagle3jax.deepseek_config import DeepseekConfig, unwrap_text_config
from eagle3jax.params import materialize, random_fill
from eagle3jax.safetensors_io import SafetensorsDir
from eagle3jax.sharding import single_device_mesh

_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn),)


def fp8_block_size(hf: dict) -> tuple[int, int] | None:
  """The FP8 weight block of a config's ``quantization_config`` (None: not quantised)."""
  q = unwrap_text_config(hf).get("quantization_config")
  if q is None:
    return None
  method = q.get("quant_method")
  if method != "fp8":
    raise ValueError(f"config field quantization_config.quant_method={method!r} is not "
                     "supported (only 'fp8')")
  fmt = q.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise ValueError(f"config field quantization_config.fmt={fmt!r} is not supported "
                     "(only 'e4m3')")
  block = q.get("weight_block_size")
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(x, int) and x > 0 for x in block)):
    raise ValueError(f"config field quantization_config.weight_block_size={block!r} must be "
                     "two positive integers (per-block scales; per-tensor FP8 is not supported)")
  return int(block[0]), int(block[1])


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """``w [out, in]`` (e4m3) times its per-block ``scale_inv [ceil(out/bo), ceil(in/bi)]``."""
  out, inn = w.shape
  bo, bi = block
  want = (-(-out // bo), -(-inn // bi))
  if tuple(scale_inv.shape) != want:
    raise ValueError(f"FP8 scale_inv has shape {tuple(scale_inv.shape)}; a {w.shape} weight "
                     f"with {bo}x{bi} blocks needs {want}")
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, 0), bi, 1)[:out, :inn]
  return np.asarray(w, np.float32) * scale


def read_dequantized(tensors: SafetensorsDir, name: str, block, used: set) -> np.ndarray:
  """Tensor ``name`` as a host array; float8 weights are dequantised with their
  ``<name>_scale_inv`` (recorded in ``used``).

  Other tensors stay lazy memory-map views (each device then reads only its slice, see
  ``eagle3jax.params``); a float8 tensor is dequantised whole, so every process reads all of
  it.
  """
  w = tensors.get(name)
  if w.dtype in _FP8:
    scale_name = name + "_scale_inv"
    if block is None or scale_name not in tensors:
      raise ValueError(f"weight {name!r} is float8 but the checkpoint has no "
                       f"{'quantization_config' if block is None else repr(scale_name)}")
    used.add(scale_name)
    return dequantize_fp8(w, tensors.get(scale_name), block)
  return np.asarray(w)


def init_deepseek(cfg: DeepseekConfig, *, mesh: Mesh | None = None, dtype=jnp.float32,
                  seed: int = 0, std: float = 0.02):
  """A randomly initialised DeepSeek-family target (the same weights on every mesh)."""
  mesh = mesh or single_device_mesh()
  model = materialize(lambda: DeepseekForCausalLM(cfg, dtype=dtype), mesh,
                      random_fill(seed, std))
  model.mesh = mesh
  return model
