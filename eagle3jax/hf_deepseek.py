"""DeepSeek-V3 / Kimi-K2 random initialisation (plain or quantized).

Loading goes through ``eagle3jax.load_target`` (one body for every family, names from
``eagle3jax.weights.deepseek_table``); quantized checkpoints (FP8 blocks, compressed-tensors
INT4) are described in ``eagle3jax.quant_config`` and converted by ``eagle3jax.quant_io``
(``dequantize_fp8`` is re-exported here).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh

from eagle3jax import checks, model_kinds
from eagle3jax.deepseek import DeepseekForCausalLM
from eagle3jax.deepseek_config import DeepseekConfig
from eagle3jax.params import materialize, random_fill
from eagle3jax.quant_config import QuantizationConfig, linear_schemes
from eagle3jax.quant_io import dequantize_fp8
from eagle3jax.sharding import validate_mesh
from eagle3jax.weights import deepseek_table
from eagle3jax.semantics import standard_numpy

__all__ = ["dequantize_fp8", "init_deepseek"]


@standard_numpy
def init_deepseek(cfg: DeepseekConfig, *, mesh: Mesh | None = None, dtype=jnp.float32,
                  seed: int = 0, std: float = 0.02,
                  quantization: QuantizationConfig | None = None):
  """A randomly initialised DeepSeek-family target (the same weights on every mesh).

  With ``quantization`` the linears it quantizes are ``QuantizedParam``s holding random
  stored values and scales (dequantized weights of about ``std``), as a checkpoint with that
  ``quantization_config`` would load with ``quantization="keep"``.
  """
  model_kinds.require_config("init_deepseek", cfg, DeepseekConfig)
  mesh = validate_mesh(mesh)
  checks.float_dtype("dtype", dtype)
  schemes = linear_schemes(quantization, deepseek_table(cfg), cfg.num_hidden_layers)
  model = materialize(lambda: DeepseekForCausalLM(cfg, dtype=dtype, schemes=schemes), mesh,
                      random_fill(seed, std))
  model.mesh = mesh
  return model
