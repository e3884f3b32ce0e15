"""Targets and drafters for engine tests."""

import jax
import jax.numpy as jnp
import numpy as np

import eagle3jax
from eagle3jax.capture import CaptureSpec

CFG = eagle3jax.LlamaConfig.tiny(num_hidden_layers=8, vocab_size=131, eos_token_ids=(2,))
CAPTURE = CaptureSpec((-1, 3, 6))


def ancestors(parent, i: int) -> list[int]:
  """Node ``i`` and its ancestors up to the root (parent -1), deepest first."""
  out = []
  while i >= 0:
    out.append(i)
    i = parent[i]
  return out


def ancestor_mask(parent) -> np.ndarray:
  """``[P, P]`` bool: node i sees node j iff j is i or one of its ancestors (a tree
  verification mask written independently of ``eagle3jax.tree``)."""
  mask = np.zeros((len(parent), len(parent)), bool)
  for i in range(len(parent)):
    mask[i, ancestors(parent, i)] = True
  return mask


def branch(parent, tokens, i: int) -> list:
  """The tokens on the path from the root to node ``i``, root first."""
  return [tokens[j] for j in ancestors(parent, i)[::-1]]


def target(mesh=None, cfg=CFG):
  return eagle3jax.init_target(cfg, mesh=mesh, seed=0, std=0.1)


def random_drafter(tgt, capture=CAPTURE, seed=1):
  cfg = eagle3jax.DrafterConfig.for_target(tgt.config, capture)
  return eagle3jax.init_drafter(cfg, target=tgt, seed=seed, std=0.1)


def copy_drafter(tgt, capture=CAPTURE):
  """A drafter that proposes the token two positions back (exact on 2-cycles, which random
  tiny targets fall into): fc passes the embedding capture (-1) through, attention and MLP
  add nothing, and the head scores tokens by embedding similarity. So drafts are accepted
  sometimes and rejected sometimes: every acceptance path of the engine runs."""
  assert capture.layer_ids[0] == -1
  return make_copy_drafter(random_drafter(tgt, capture), tgt)


def full_vocab_copy_drafter(tgt, capture):
  """``copy_drafter`` for any target family (Llama or DeepSeek config), with the full
  vocabulary as draft vocabulary."""
  from eagle3jax.rope import RopeConfig  # pylint: disable=import-outside-toplevel
  c = tgt.config
  dcfg = eagle3jax.DrafterConfig(
      hidden_size=c.hidden_size, intermediate_size=88, num_attention_heads=8,
      num_key_value_heads=2, vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size,
      capture=capture, rms_norm_eps=c.rms_norm_eps, rope=RopeConfig(theta=10000.0),
      max_position_embeddings=c.max_position_embeddings)
  return make_copy_drafter(eagle3jax.init_drafter(dcfg, target=tgt, seed=1, std=0.1), tgt)


def make_copy_drafter(dr, tgt):
  """Sets ``dr``'s weights so that it proposes the token two positions back (see above)."""
  d = tgt.config.hidden_size
  k = len(dr.config.capture.layer_ids)
  fc = np.zeros((k * d, d), np.float32)
  fc[:d] = np.eye(d)
  emb = np.asarray(tgt.embed_tokens[...], np.float32)

  def put(var, value):
    old = var[...]
    var[...] = jax.device_put(jnp.asarray(value, old.dtype), old.sharding)

  put(dr.fc, fc)
  put(dr.self_attn.o_proj, np.zeros(dr.self_attn.o_proj[...].shape))
  put(dr.mlp.down_proj, np.zeros(dr.mlp.down_proj[...].shape))
  put(dr.norm.weight, np.ones(d))
  put(dr.lm_head, emb.T * 10.0)
  return dr


PROMPTS = [[5, 6, 7, 8, 9, 10, 3], [1, 2 + 1, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def decode_program_text(mesh, tgt, dr, spec, *, batch: int, prompt_len: int = 16,
                        max_len: int = 64, temperature: float = 0.0, top_p: float = 1.0) -> str:
  """The compiled decode loop (``engine._decode_jit``, 4 rounds) on ``mesh`` as HLO text, for
  ``batch`` rows of ``prompt_len`` tokens in a ``max_len``-slot cache."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from eagle3jax import engine as eng  # pylint: disable=import-outside-toplevel
  from eagle3jax.sharding import BATCH, SEQ, shard  # pylint: disable=import-outside-toplevel
  graphdef, params = nnx.split((tgt, dr))
  b, t = batch, prompt_len
  with jax.set_mesh(mesh):
    tokens = shard(jnp.zeros((b, t), jnp.int32), (BATCH, SEQ))
    lengths = shard(jnp.full((b,), t, jnp.int32), (BATCH,))
    keys = shard(jnp.zeros((b, 2), jnp.uint32), (BATCH, None))
    dyn = eng.Dynamic(temperature=jnp.float32(temperature), top_p=jnp.float32(top_p),
                      eos=jnp.asarray(eng.eos_array()), max_new=jnp.int32(8))
    st = jax.eval_shape(lambda p: eng._prefill_jit(graphdef, p, tokens, lengths, keys, dyn,
                                                   spec=spec, max_len=max_len,
                                                   out_size=max_len), params)
    return eng._decode_jit.lower(graphdef, params, st, dyn, jnp.int32(4),
                                 spec=spec).compile().as_text()
