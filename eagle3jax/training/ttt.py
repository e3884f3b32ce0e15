"""Training-time test (TTT): the EAGLE-3 drafter loss, unrolled over K draft steps.

At inference a depth-j draft node is produced from the drafter's own output of depth j-1, not
from target features. TTT trains that situation (EAGLE-3, Li et al. 2025; reference section 5)
on a sequence ``x_0 .. x_{T-1}`` with target features ``f_t`` and target logits ``l_t`` (of
which only the draft vocabulary's columns and the argmax enter, ``TargetFeatures``):

* step 0, position t: hidden ``fc(f_t)``, token ``x_{t+1}``, RoPE position t;
* step j >= 1, position t: hidden = the step j-1 pre-norm output ``a`` at t, token
  ``x_{t+j+1}`` (teacher forced), RoPE position ``t + j``;
* query (j, t) attends causally to the step-0 keys ``s <= t`` and to the keys of steps
  1..j at the same t (the diagonal): what a depth-j draft node sees at inference. All steps so
  far are one concatenated key set ``[step 0 | step 1 | ... | step j]`` with the explicit mask
  ``ttt_attention_mask(T, j)``;
* step j at t predicts ``x_{t+j+2}``; its soft target is ``softmax(l_{t+j+1})`` restricted to
  the draft vocabulary and renormalised. Positions are dropped where ``x_{t+j+2}`` is not a
  response token (or lies past the sequence) and where the target's full-vocabulary argmax has
  no draft id. Step j is weighted ``decay**j`` (0.8 in EAGLE-3).

Accuracy of step j: fraction of kept-by-loss-mask positions (out-of-draft-vocab argmaxes
included, as misses) where the drafter's argmax, mapped to a target id, equals the target's
argmax: a proxy for per-depth acceptance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eagle3jax import attention as attn_lib
from eagle3jax.sharding import BATCH, SEQ, VOCAB, batch_major, out_spec, shard
from eagle3jax.training.data import TargetFeatures


def ttt_attention_mask(seq_len: int, step: int) -> np.ndarray:
  """Boolean ``[T, (step + 1) * T]``: may query t of ``step`` read key column c.

  Columns are the keys of steps ``0..step`` concatenated (``c = i * T + s`` is key s of step
  i): causal over step 0 (``s <= t``), and only ``s == t`` in steps ``1..step``.
  """
  if seq_len < 1 or step < 0:
    raise ValueError(f"ttt_attention_mask: seq_len={seq_len} must be >= 1 and step={step} >= 0")
  t = np.arange(seq_len)
  mask = np.zeros((seq_len, (step + 1) * seq_len), bool)
  mask[:, :seq_len] = t[None, :] <= t[:, None]
  for i in range(1, step + 1):
    mask[t, i * seq_len + t] = True
  return mask


def drafter_layer(drafter, tokens, hidden, positions, past_k, past_v, mask):
  """The drafter layer over keys of earlier TTT steps (same maths as ``Eagle3Drafter``).

  Args:
    drafter: an ``Eagle3Drafter`` (its submodules are used; nothing is copied).
    tokens: ``[B, T]`` ids whose embeddings are ``e``.
    hidden: ``[B, T, D]`` ``fc`` of features (step 0) or the previous step's ``a``.
    positions: ``[B, T]`` RoPE positions.
    past_k, past_v: lists of ``[B, T, K, H]`` keys/values of the earlier steps (RoPE applied).
    mask: ``[T, W]`` bool over the concatenated keys ``past + [new]``, ``W = (len(past)+1)*T``.

  Returns:
    ``(a [B, T, D], k [B, T, K, H], v [B, T, K, H])``: pre-norm output and this step's keys.
  """
  b, t = tokens.shape
  hidden, q, k, v = drafter.attention_inputs(tokens, hidden, positions)
  k_all = jnp.concatenate(list(past_k) + [k], axis=1)                  # [B, W, K, H]
  v_all = jnp.concatenate(list(past_v) + [v], axis=1)
  w = k_all.shape[1]
  if mask.shape != (t, w):
    raise ValueError(f"drafter_layer: mask shape {mask.shape} != ({t}, {w})")
  tree_mask = shard(jnp.broadcast_to(jnp.asarray(mask), (b, t, w)), (BATCH, SEQ, SEQ))
  lengths = batch_major(jnp.zeros((b,), jnp.int32))
  o = attn_lib.attend(q, k_all, v_all, lengths, tree_mask, scale=drafter.attention_scale,
                      impl="xla")
  return drafter.attention_output(hidden, o), k, v


def _shift(x: jax.Array, n: int) -> jax.Array:
  """``x[:, n:]`` padded with zeros at the end back to length T (axis 1)."""
  t = x.shape[1]
  if n >= t:
    return jnp.zeros_like(x)
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, n)
  return jnp.pad(x[:, n:], pad)


def ttt_loss(drafter, features: TargetFeatures, tokens, loss_mask, *, steps: int = 7,
             decay: float = 0.8):
  """The TTT loss of a batch.

  Args:
    drafter: the ``Eagle3Drafter`` being trained.
    features: the target's ``TargetFeatures`` of ``tokens`` (``target_features`` with the
      drafter's draft vocabulary): captures ``[B, T, k*Dt]``, logits at the draft vocabulary
      ``[B, T, N]`` and the full-vocabulary argmax ``[B, T]``.
    tokens: ``[B, T]`` int32 sequences (padded).
    loss_mask: ``[B, T]`` bool, True on response tokens.
    steps: K, the number of unrolled draft steps.
    decay: step j is weighted ``decay**j``.

  Returns:
    ``(loss, metrics)`` with ``metrics = {"loss": [K], "acc": [K], "count": [K]}`` (per-step
    loss, accuracy and number of positions counted for accuracy).
  """
  if steps < 1:
    raise ValueError(f"ttt steps={steps} must be >= 1")
  b, t = tokens.shape
  n = drafter.config.draft_vocab_size
  if features.draft_logits.shape != (b, t, n):
    raise ValueError(f"target draft logits {features.draft_logits.shape} do not match tokens "
                     f"{(b, t)} and the drafter's draft_vocab_size={n}; compute them with "
                     "target_features(..., draft_ids) for this drafter's vocabulary")
  tokens = shard(tokens.astype(jnp.int32), (BATCH, SEQ))
  loss_mask = shard(loss_mask.astype(bool), (BATCH, SEQ))
  sel = shard(features.draft_logits.astype(jnp.float32), (BATCH, SEQ, VOCAB))
  probs = jax.nn.softmax(sel, axis=-1)                                  # [B, T, N]
  target_argmax = shard(features.argmax.astype(jnp.int32), (BATCH, SEQ))
  in_vocab = drafter.t2d[...].at[target_argmax].get(out_sharding=out_spec((BATCH, SEQ),
                                                                          (b, t)))
  base_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

  hidden = drafter.project(features.aux)
  past_k, past_v = [], []
  losses, accs, counts = [], [], []
  total = jnp.float32(0.0)
  for j in range(steps):
    # --- Step j: token x_{t+j+1} at position t+j predicts x_{t+j+2} (target logits t+j+1).
    tok_j = _shift(tokens, j + 1)
    pos_j = shard(base_pos + j, (BATCH, SEQ))
    a, k, v = drafter_layer(drafter, tok_j, hidden, pos_j, past_k, past_v,
                            ttt_attention_mask(t, j))
    past_k.append(k)
    past_v.append(v)
    hidden = a
    logp = jax.nn.log_softmax(drafter.logits(a), axis=-1)                # [B, T, N]
    valid = _shift(loss_mask, j + 2)
    keep = (valid & _shift(in_vocab, j + 1)).astype(jnp.float32)
    ce = -jnp.sum(_shift(probs, j + 1) * logp, axis=-1)                 # [B, T]
    loss_j = jnp.sum(ce * keep) / jnp.maximum(jnp.sum(keep), 1.0)
    pred = drafter.to_target_ids(jnp.argmax(logp, axis=-1).astype(jnp.int32))
    hit = ((pred == _shift(target_argmax, j + 1)) & valid).astype(jnp.float32)
    count = jnp.sum(valid.astype(jnp.float32))
    total = total + (decay ** j) * loss_j
    losses.append(loss_j)
    accs.append(jnp.sum(hit) / jnp.maximum(count, 1.0))
    counts.append(count)
  metrics = {"loss": jnp.stack(losses), "acc": jnp.stack(accs), "count": jnp.stack(counts)}
  return total, metrics
