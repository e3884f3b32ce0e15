"""Pallas kernels (imported as ``eagle3jax.kernels``).

``tree_attention`` is the attention of speculative-decoding verification: ``P`` tree tokens
attend to each row's committed KV-cache prefix and to their tree ancestors. XLA's version
materialises a ``[P, S]`` score matrix per head over the whole cache and cannot skip cache blocks
past each row's length; the kernel reads only each row's valid blocks (flash-decoding with an
online softmax). Every kernel ships with a plain-``jnp`` reference, one input validation shared
by both, and an ``interpret`` flag so that it runs (slowly) on CPU.
"""

# --- Tree attention ---
from eagle3jax.kernels.tree_attention import (
    MAX_TREE_TOKENS, tree_attention, tree_attention_reference, validate_inputs)
# --- On a device mesh ---
from eagle3jax.kernels._sharded import tree_attention_sharded

__all__ = [
    "MAX_TREE_TOKENS",
    "tree_attention",
    "tree_attention_reference",
    "tree_attention_sharded",
    "validate_inputs",
]
