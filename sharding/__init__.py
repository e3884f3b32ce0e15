"""Meshes, logical axis names and sharding rules (imported as ``eagle3jax.sharding``)."""

from eagle3jax.sharding.mesh import (
    DATA, MESH_AXES, TENSOR, make_mesh, single_device_mesh, validate_mesh)
from eagle3jax.sharding.rules import (
    ACTIVATION_RULES, BATCH, CAPTURE, EMBED, EXPERT, HEAD_DIM, HEADS, KV_HEADS, LAYERS, LORA, MLP,
    PARAM_RULES, SEQ, VOCAB, activation_spec, batch_major, current_mesh, devices_along,
    gather_rows, out_spec, param_sharding, param_spec, pick_rows, require_mesh, shard, undivided)

__all__ = [
    # Meshes
    "DATA", "MESH_AXES", "TENSOR", "make_mesh", "single_device_mesh", "validate_mesh",
    "current_mesh", "require_mesh",
    "devices_along",
    # Logical axes
    "BATCH", "CAPTURE", "EMBED", "EXPERT", "HEAD_DIM", "HEADS", "KV_HEADS", "LAYERS", "LORA",
    "MLP", "SEQ", "VOCAB",
    # Rules and annotations
    "ACTIVATION_RULES", "PARAM_RULES", "activation_spec", "out_spec", "param_sharding",
    "param_spec", "shard", "batch_major", "gather_rows", "pick_rows", "undivided",
]
