"""eagle3jax: EAGLE-3 speculative decoding in JAX on sharded device meshes.

Public API:
"""

# --- Configuration and capture contract ---
from eagle3jax.capture import CaptureSpec
from eagle3jax.config import LlamaConfig
from eagle3jax.deepseek_config import DeepseekConfig
from eagle3jax.rope import RopeConfig

# --- Targets ---
from eagle3jax.hf_target import init_target, load_target
from eagle3jax.api import ForwardOutput, forward
from eagle3jax.llama import LlamaForCausalLM
from eagle3jax.kv_cache import KVCache
from eagle3jax.deepseek import DeepseekForCausalLM
from eagle3jax.hf_deepseek import init_deepseek
from eagle3jax.quant_config import QuantizationConfig

# --- Meshes ---
from eagle3jax.sharding import make_mesh

__all__ = [
    "CaptureSpec", "LlamaConfig", "RopeConfig", "init_target", "load_target", "ForwardOutput",
    "forward", "LlamaForCausalLM", "KVCache", "make_mesh", "DeepseekConfig",
    "DeepseekForCausalLM", "init_deepseek", "QuantizationConfig",
]

# --- Drafter and engine ---
from eagle3jax.drafter import DrafterConfig, Eagle3Drafter
from eagle3jax.drafter_io import (PortabilityWarning, draft_logits, init_drafter, load_drafter,
                                  save_drafter)
from eagle3jax.generate import GenerateResult, clear_compiled, generate, set_max_compiled
from eagle3jax.capture_contract import CaptureRecord, CaptureWarning
from eagle3jax.monitor import AcceptanceWarning

__all__ += ["DrafterConfig", "Eagle3Drafter", "draft_logits", "init_drafter", "load_drafter",
            "save_drafter", "GenerateResult", "generate", "clear_compiled", "set_max_compiled",
            "CaptureRecord", "CaptureWarning", "AcceptanceWarning", "PortabilityWarning"]


# --- Drafter training ---
from eagle3jax.training import TrainConfig, Trainer, train_drafter

__all__ += ["TrainConfig", "Trainer", "train_drafter"]
