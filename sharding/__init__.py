"""Meshes, logical axis names and sharding rules (imported as ``eagle3jax.sharding``)."""

from eagle3jax.sharding.mesh import DATA, MESH_AXES, TENSOR, make_mesh, single_device_mesh
from eagle3jax.sharding.rules import (
    ACTIVATION_RULES, BATCH, CAPTURE, EMBED, EXPERT, HEAD_DIM, HEADS, KV_HEADS, LAYERS, LORA, MLP,
    PARAM_RULES, SEQ, VOCAB, activation_spec, batch_major, current_mesh, gather_rows, pick_rows, out_spec, param_sharding, param_spec, shard)
