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
  ``ttt_attention_mask(T, j, start)`` (``drafter_layer``, the plain form);
  ``ttt_step_layer`` computes the same attention as step-0 scores plus the j diagonal ones;
* step j at t predicts ``x_{t+j+2}``; its soft target is ``softmax(l_{t+j+1})`` restricted to
  the draft vocabulary and renormalised. Positions are dropped where ``x_{t+j+2}`` is not a
  response token (or lies past the sequence) and where the target's full-vocabulary argmax has
  no draft id. Step j is weighted ``decay**j`` (0.8 in EAGLE-3).
* ``align_topk`` k > 0 (token alignment, as GRIFFIN, Hu et al. 2025, calls it): step j at t
  also takes no loss unless every earlier step i < j at t had a response token as its label and
  ranked the target's token within its top k. A chain (top-1) or a tree of top-k branches
  only ever reads step j after steps 0..j-1 drafted the target's tokens, so the positions
  where an earlier step missed are states decoding never reaches (the teacher-forced token
  hides the miss); without the mask they take a share of the loss. 0: every position counts
  (EAGLE-3).

Accuracy of step j: fraction of kept-by-loss-mask positions (out-of-draft-vocab argmaxes
included, as misses) where the drafter's argmax, mapped to a target id, equals the target's
argmax: a proxy for per-depth acceptance.

Cost: steps >= 1 and every step's draft-vocabulary head run only from ``start`` on (the
prompt's positions before it can take no loss; ``loss_start``), their attention skips the
masked-out scores (``ttt_step_layer``), and the head and its cross-entropy have written-out
backwards (``draft_head``, ``soft_cross_entropy``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eagle3jax import attention as attn_lib
from eagle3jax import kv_cache as kv_lib
from eagle3jax.layers import einsum
from eagle3jax.sharding import (BATCH, HEAD_DIM, KV_HEADS, SEQ, VOCAB, batch_major,
                                current_mesh, out_spec, require_mesh, shard)
from eagle3jax.training.data import TargetFeatures
from eagle3jax.semantics import standard_numpy


def ttt_attention_mask(seq_len: int, step: int, start: int = 0) -> np.ndarray:
  """Boolean ``[T - start, T + step * (T - start)]``: may query t of ``step`` read key c.

  Queries are positions ``start .. T-1`` (steps >= 1 run only where a loss can fall). The
  plain layer (``drafter_layer``, ``reference_ttt_loss``) applies it; ``ttt_loss``'s steps >= 1
  compute the same attention without the masked scores (``ttt_step_layer``). Columns are the
  step-0 keys ``0 .. T-1`` followed by the keys of steps ``1..step`` at positions
  ``start .. T-1`` (``c = T + (i - 1) * (T - start) + (s - start)`` is key s of step i): causal
  over step 0 (``s <= t``), and only ``s == t`` in steps ``1..step``.
  """
  if seq_len < 1 or step < 0 or not 0 <= start < seq_len:
    raise ValueError(f"ttt_attention_mask: seq_len={seq_len} must be >= 1, step={step} >= 0 "
                     f"and start={start} in [0, seq_len)")
  n = seq_len - start
  t = np.arange(start, seq_len)
  mask = np.zeros((n, seq_len + step * n), bool)
  mask[:, :seq_len] = np.arange(seq_len)[None, :] <= t[:, None]
  for i in range(1, step + 1):
    mask[np.arange(n), seq_len + (i - 1) * n + np.arange(n)] = True
  return mask


def loss_start(loss_mask: np.ndarray, steps: int) -> int:
  """The first position any of ``steps`` TTT steps can take a loss at, for host ``loss_mask
  [M, T]`` (all the training data): step j at t predicts token ``t + j + 2``, so positions
  before ``first response token - steps - 1`` never count, and ``ttt_loss(start=...)``
  skips them (the drafter's step 0 still runs there: its keys are the context)."""
  loss_mask = np.asarray(loss_mask, bool)
  rows = loss_mask.any(axis=1)
  if not rows.any():
    return 0
  first = int(np.argmax(loss_mask[rows], axis=1).min())
  return max(0, first - steps - 1)


@standard_numpy
def drafter_layer(drafter, tokens, hidden, positions, past_k, past_v, mask):
  """The drafter layer over keys of earlier TTT steps (same maths as ``Eagle3Drafter``).

  Args:
    drafter: an ``Eagle3Drafter`` (its submodules are used; nothing is copied).
    tokens: ``[B, T]`` ids whose embeddings are ``e``.
    hidden: ``[B, T, D]`` ``fc`` of features (step 0) or the previous step's ``a``.
    positions: ``[B, T]`` RoPE positions.
    past_k, past_v: lists of ``[B, K, T, H]`` keys/values of the earlier steps (RoPE applied),
      as this function returns them: slabs in the cache's layout (``eagle3jax.kv_cache``).
    mask: ``[T, W]`` bool over the concatenated keys ``past + [new]``, ``W = (len(past)+1)*T``.

  Returns:
    ``(a [B, T, D], k [B, K, T, H], v [B, K, T, H])``: pre-norm output and this step's keys
    and values.
  """
  b, t = tokens.shape
  hidden, q, k, v = drafter.attention_inputs(tokens, hidden, positions)
  k, v = kv_lib.as_slab(k), kv_lib.as_slab(v)
  k_all = jnp.concatenate(list(past_k) + [k], axis=2)                  # [B, K, W, H]
  v_all = jnp.concatenate(list(past_v) + [v], axis=2)
  w = k_all.shape[2]
  if mask.shape != (t, w):
    raise ValueError(f"drafter_layer: mask shape {mask.shape} != ({t}, {w})")
  tree_mask = shard(jnp.broadcast_to(jnp.asarray(mask), (b, t, w)), (BATCH, SEQ, SEQ))
  lengths = batch_major(jnp.zeros((b,), jnp.int32))
  o = attn_lib.attend(q, k_all, v_all, lengths, tree_mask, scale=drafter.attention_scale,
                      impl="xla")
  return drafter.attention_output(hidden, o), k, v


@standard_numpy
def ttt_step_layer(drafter, tokens, hidden, positions, past_k, past_v):
  """The drafter layer of an unrolled step j >= 1, its attention written for the TTT key set.

  The queries are positions ``start .. T-1`` (``n = T - start`` of them, ``start = T - n``);
  query t reads the step-0 keys ``s <= t`` and the keys of steps ``1..j`` at t only: the
  mask ``ttt_attention_mask(T, j, start)`` that ``drafter_layer`` applies to all ``T + j * n``
  keys. Here the step-0 scores are ``[n, T]`` and the other steps' are the ``j`` diagonal
  entries, ``[n, j]``, one softmax over both: the same maths without the ``n * j * (n - 1)``
  masked scores (and their backward), which grew with every step and took about 30% of a
  training step at the demo's size (``bench_train.py``: 1.40x).

  Args:
    tokens, hidden, positions: ``[B, n, ...]`` as ``drafter_layer``'s.
    past_k, past_v: step 0's ``[B, K, T, H]`` slab, then the slabs ``[B, K, n, H]`` of steps
      ``1 .. j-1``, as ``drafter_layer`` and this function return them.

  Returns:
    ``(a [B, n, D], k [B, K, n, H], v [B, K, n, H])`` as ``drafter_layer``.
  """
  b, n = tokens.shape
  hidden, q, k, v = drafter.attention_inputs(tokens, hidden, positions)
  k, v = kv_lib.as_slab(k), kv_lib.as_slab(v)                          # [B, K, n, H]
  if not past_k or len(past_k) != len(past_v) or past_k[0].shape[2] < n:
    raise ValueError(f"ttt_step_layer: the past keys must start with step 0's slab over T >= "
                     f"n={n} positions (got {len(past_k)} key and {len(past_v)} value slabs"
                     f"{f', T={past_k[0].shape[2]}' if past_k else ''})")
  k0, v0 = past_k[0], past_v[0]                                        # [B, K, T, H]
  kh, t, h = k0.shape[1], k0.shape[2], k0.shape[3]
  g = q.shape[2] // kh
  qg = q.reshape(b, n, kh, g, h)
  f32 = jnp.float32
  s0 = jnp.einsum("BTKGH,BKSH->BKGTS", qg, k0, preferred_element_type=f32,
                  out_sharding=out_spec((BATCH, KV_HEADS, None, SEQ, SEQ), (b, kh, g, n, t)))
  causal = np.arange(t)[None, :] <= np.arange(t - n, t)[:, None]       # [n, T]
  s0 = jnp.where(causal, s0 * drafter.attention_scale, -1e30)
  dk = jnp.stack(list(past_k[1:]) + [k], axis=3)                       # [B, K, n, j, H]
  dv = jnp.stack(list(past_v[1:]) + [v], axis=3)
  j = dk.shape[3]
  sd = jnp.einsum("BTKGH,BKTJH->BKGTJ", qg, dk, preferred_element_type=f32,
                  out_sharding=out_spec((BATCH, KV_HEADS, None, SEQ, None), (b, kh, g, n, j)))
  sd = sd * drafter.attention_scale
  top = jnp.maximum(jnp.max(s0, axis=-1, keepdims=True), jnp.max(sd, axis=-1, keepdims=True))
  e0, ed = jnp.exp(s0 - top), jnp.exp(sd - top)
  total = jnp.sum(e0, axis=-1, keepdims=True) + jnp.sum(ed, axis=-1, keepdims=True)
  o_spec = out_spec((BATCH, KV_HEADS, None, SEQ, HEAD_DIM), (b, kh, g, n, h))
  o = (jnp.einsum("BKGTS,BKSH->BKGTH", (e0 / total).astype(v.dtype), v0,
                  preferred_element_type=f32, out_sharding=o_spec)
       + jnp.einsum("BKGTJ,BKTJH->BKGTH", (ed / total).astype(v.dtype), dv,
                    preferred_element_type=f32, out_sharding=o_spec))
  o = o.transpose(0, 3, 1, 2, 4).reshape(b, n, kh * g, h).astype(q.dtype)  # [B, n, N, H]
  return drafter.attention_output(hidden, o), k, v


def _window(x: jax.Array, n: int, start: int) -> jax.Array:
  """``x[:, start + n:]`` padded with zeros at the end to length ``T - start`` (axis 1): the
  values ``n`` positions ahead of positions ``start .. T-1``."""
  t = x.shape[1]
  if start + n >= t:
    return jnp.zeros((x.shape[0], t - start) + x.shape[2:], x.dtype)
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, n)
  return jnp.pad(x[:, start + n:], pad)


@jax.custom_vjp
def soft_cross_entropy(logits: jax.Array, probs: jax.Array) -> jax.Array:
  """``-sum(probs * log_softmax(logits))`` over the last axis, ``[..., N] -> [...]``, for
  ``probs`` rows that sum to 1 (or whose result the caller masks out).

  The value is ``logsumexp(logits) - sum(probs * logits)``; the gradient ``softmax(logits) -
  probs`` comes out of one fused pass instead of log-softmax's backward (which, on the
  ``[B, T, N]`` draft-vocabulary logits of every TTT step, cost about as much as the head's
  matmuls). ``probs`` gets no gradient (it is the target's distribution).
  """
  return _soft_ce_fwd(logits, probs)[0]


@standard_numpy  # custom_vjp calls the rules directly: the primal runs through this one
def _soft_ce_fwd(logits, probs):
  lse = jax.nn.logsumexp(logits, axis=-1)
  return lse - jnp.sum(probs * logits, axis=-1), (logits, probs, lse)


@standard_numpy
def _soft_ce_bwd(res, g):
  logits, probs, lse = res
  return (g[..., None] * (jnp.exp(logits - lse[..., None]) - probs), jnp.zeros_like(probs))


soft_cross_entropy.defvjp(_soft_ce_fwd, _soft_ce_bwd)


def _like(x):
  """``out_sharding`` that keeps ``x``'s layout (None outside a mesh)."""
  return jax.typeof(x).sharding if current_mesh() is not None else None


@jax.custom_vjp
def draft_head(h: jax.Array, w: jax.Array) -> jax.Array:
  """The drafter's head, ``h [B, T, D] @ w [D, N]`` in float32 (``Eagle3Drafter.logits``
  after its norm): the same forward, with the backward's two matmuls written out so that XLA
  contracts the ``[B, T, N]`` gradient in place (autodiff's form made XLA:CPU transpose it,
  at every step, at a cost above the matmul's)."""
  return einsum("BTD,DV->BTV", h, w, (BATCH, SEQ, VOCAB)).astype(jnp.float32)


@standard_numpy
def _head_fwd(h, w):
  return draft_head(h, w), (h, w)


@standard_numpy
def _head_bwd(res, g):
  h, w = res
  g = g.astype(h.dtype)
  dh = jnp.einsum("BTV,DV->BTD", g, w, out_sharding=_like(h))
  dw = jnp.einsum("BTD,BTV->DV", h, g, out_sharding=_like(w))
  return dh, dw


draft_head.defvjp(_head_fwd, _head_bwd)


@standard_numpy
def label_distribution(draft_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """The TTT loss's labels from the target's draft-vocabulary logits ``[..., N]``.

  ``temperature`` 1 is EAGLE-3's: the target's distribution (what rejection sampling needs the
  drafter to match). Below 1 it is sharpened; 0 is one-hot on the target's top token (ties
  shared), the quantity a drafter served greedily is judged on: which token the target picks,
  not how probable the runners-up are.
  """
  logits = draft_logits.astype(jnp.float32)
  if temperature == 0:
    top = (logits >= jnp.max(logits, axis=-1, keepdims=True)).astype(jnp.float32)
    return top / jnp.sum(top, axis=-1, keepdims=True)
  return jax.nn.softmax(logits / temperature, axis=-1)


def _label_rank_ok(logits: jax.Array, onehot: jax.Array, k: int) -> jax.Array:
  """``[..., N] -> [...]`` bool: the label (``onehot``, the target's top draft token; ties
  shared) is within the top ``k`` of ``logits``: fewer than ``k`` logits above its own."""
  label = jnp.sum(onehot * logits, axis=-1, keepdims=True)
  return jnp.sum((logits > label).astype(jnp.int32), axis=-1) < k


def _check_align(align_topk) -> None:
  if isinstance(align_topk, bool) or not isinstance(align_topk, (int, np.integer)) \
      or align_topk < 0:
    raise ValueError(f"ttt align_topk={align_topk!r} must be an integer >= 0 (0: every "
                     "position takes a loss; k: only where every earlier step ranked the "
                     "target's token in its top k)")


@standard_numpy
def ttt_loss(drafter, features: TargetFeatures, tokens, loss_mask, *, steps: int = 7,
             decay: float = 0.8, start: int = 0, label_temperature: float = 1.0,
             align_topk: int = 0, with_hits: bool = False, masked_attention: bool = False):
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
    start: positions before it take no loss and run only step 0 (their keys): exact when
      ``loss_mask[:, :start + steps + 1]`` is all False, which ``loss_start(mask, steps)`` of
      the whole training data guarantees (the prompts). Saves the prompt's share of every
      step's layer and draft-vocabulary head.
    label_temperature: the labels are ``label_distribution(target logits, this)``.
    align_topk: k > 0: step j at t takes a loss only where steps 0..j-1 at t each had a
      response label and ranked the target's top draft token in their top k (module
      docstring); 0: everywhere. Accuracy still counts every valid position.
    with_hits: also return step 0's hits per position (``miss_breakdown``'s diagnostic).
    masked_attention: steps >= 1 attend over all the concatenated keys with
      ``ttt_attention_mask`` (``drafter_layer``, the plain form: the same result, slower; for
      the training benchmark) instead of ``ttt_step_layer``.

  Returns:
    ``(loss, metrics)`` with ``metrics = {"loss": [K], "acc": [K], "count": [K], "alive":
    [K]}`` (per-step loss, accuracy, number of positions counted for accuracy, and the
    fraction of them where every earlier step ranked the target's token in its top
    ``max(align_topk, 1)``: the chance a chain reaches step j, teacher forced); with
    ``with_hits`` also ``"hit0": [B, T]`` bool, at index i whether step 0 (run at position
    i - 2) predicted the target's argmax for token i, unmasked (False for i < start + 2).
  """
  if steps < 1:
    raise ValueError(f"ttt steps={steps} must be >= 1")
  require_mesh("ttt_loss", "drafter", "as the Trainer does")
  _check_align(align_topk)
  b, t = tokens.shape
  if not 0 <= start < t:
    raise ValueError(f"ttt start={start} must be in [0, seq_len={t})")
  n = drafter.config.draft_vocab_size
  if features.draft_logits.shape != (b, t, n):
    raise ValueError(f"target draft logits {features.draft_logits.shape} do not match tokens "
                     f"{(b, t)} and the drafter's draft_vocab_size={n}; compute them with "
                     "target_features(..., draft_ids) for this drafter's vocabulary")
  tokens = shard(tokens.astype(jnp.int32), (BATCH, SEQ))
  loss_mask = shard(loss_mask.astype(bool), (BATCH, SEQ))
  sel = shard(features.draft_logits.astype(jnp.float32), (BATCH, SEQ, VOCAB))
  probs = label_distribution(sel, label_temperature)                    # [B, T, N]
  # Top-k alignment needs the label's rank; top-1 (and the ``alive`` metric alone) is the
  # argmax comparison the accuracy makes anyway, so the default step does no extra pass.
  top = (None if align_topk <= 1 else
         probs if label_temperature == 0 else label_distribution(sel, 0.0))
  target_argmax = shard(features.argmax.astype(jnp.int32), (BATCH, SEQ))
  in_vocab = drafter.t2d[...].at[target_argmax].get(out_sharding=out_spec((BATCH, SEQ),
                                                                          (b, t)))
  base_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

  # Step 0 runs over every position (its keys are the context of all steps); from here on,
  # only positions start.. (T' of them) are computed.
  a, k, v = drafter_layer(drafter, _window(tokens, 1, 0), drafter.project(features.aux),
                          shard(base_pos, (BATCH, SEQ)), [], [], ttt_attention_mask(t, 0))
  past_k, past_v = [k], [v]
  hidden = a[:, start:]
  losses, accs, counts, alives = [], [], [], []
  hit0 = jnp.zeros((b, t), bool)
  total = jnp.float32(0.0)
  alive = jnp.ones((b, t - start - 1), bool)   # steps 0..j-1 at t all drafted the target's
  for j in range(steps):
    # --- Step j: token x_{t+j+1} at position t+j predicts x_{t+j+2} (target logits t+j+1).
    # Positions whose target lies inside the sequence: n_j = T' - j - 1.
    n_j = t - start - j - 1
    if n_j < 1:
      break
    if j:
      tok_j = _window(tokens, j + 1, start)
      pos_j = shard(base_pos[:, start:] + j, (BATCH, SEQ))
      if masked_attention:
        hidden, k, v = drafter_layer(drafter, tok_j, hidden, pos_j, past_k, past_v,
                                     ttt_attention_mask(t, j, start))
      else:
        hidden, k, v = ttt_step_layer(drafter, tok_j, hidden, pos_j, past_k, past_v)
      past_k.append(k)
      past_v.append(v)
    logits = draft_head(drafter.norm(hidden[:, :n_j]), drafter.lm_head[...])  # [B, n_j, N]
    valid = _window(loss_mask, j + 2, start)[:, :n_j]
    alive = alive[:, :n_j]
    ok = valid & in_vocab[:, start + j + 1:]
    keep = (ok & alive if align_topk else ok).astype(jnp.float32)
    ce = soft_cross_entropy(logits, probs[:, start + j + 1:])            # [B, n_j]
    loss_j = jnp.sum(ce * keep) / jnp.maximum(jnp.sum(keep), 1.0)
    pred = drafter.to_target_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    if j == 0 and with_hits:                    # token start + 2 + i; the last is past T
      hit0 = jnp.pad(pred[:, :n_j - 1] == target_argmax[:, start + 1:t - 1],
                     ((0, 0), (start + 2, 0)))
    drafted = pred == target_argmax[:, start + j + 1:]    # the target's token, top-1
    hit = (drafted & valid).astype(jnp.float32)
    count = jnp.sum(valid.astype(jnp.float32))
    total = total + (decay ** j) * loss_j
    losses.append(loss_j)
    accs.append(jnp.sum(hit) / jnp.maximum(count, 1.0))
    counts.append(count)
    alives.append(jnp.sum((alive & valid).astype(jnp.float32)) / jnp.maximum(count, 1.0))
    if top is not None:
      drafted = _label_rank_ok(logits, top[:, start + j + 1:start + j + 1 + n_j], align_topk)
    alive = alive & ok & drafted
  zero = [jnp.float32(0.0)] * (steps - len(losses))  # steps reaching past the sequence
  metrics = {"loss": jnp.stack(losses + zero), "acc": jnp.stack(accs + zero),
             "count": jnp.stack(counts + zero), "alive": jnp.stack(alives + zero)}
  if with_hits:
    metrics["hit0"] = hit0
  return total, metrics


@standard_numpy
def reference_ttt_loss(drafter, features: TargetFeatures, tokens, loss_mask, *, steps: int = 7,
                       decay: float = 0.8, label_temperature: float = 1.0,
                       align_topk: int = 0):
  """The TTT loss written plainly, for tests and the training benchmark: every step over every
  position with the full ``[T, (j + 1) T]`` mask, ``log_softmax`` and autodiff. Returns ``(loss,
  per-step accuracy [K])``; ``ttt_loss`` computes the same with fewer positions and written-out
  backwards."""
  _check_align(align_topk)
  b, t = tokens.shape

  def shift(x, n):
    return jnp.zeros_like(x) if n >= t else jnp.pad(
        x[:, n:], [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))

  tokens = shard(tokens.astype(jnp.int32), (BATCH, SEQ))
  probs = label_distribution(features.draft_logits, label_temperature)
  target_argmax = features.argmax.astype(jnp.int32)
  in_vocab = drafter.t2d[...].at[target_argmax].get(out_sharding=out_spec((BATCH, SEQ),
                                                                          (b, t)))
  pos = shard(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), (BATCH, SEQ))
  hidden, past_k, past_v, total, accs = drafter.project(features.aux), [], [], 0.0, []
  onehot = label_distribution(features.draft_logits, 0.0)
  alive = jnp.ones((b, t), bool)
  for j in range(steps):
    full = np.zeros((t, (j + 1) * t), bool)
    full[:, :t] = np.tril(np.ones((t, t), bool))
    for i in range(1, j + 1):
      full[np.arange(t), i * t + np.arange(t)] = True
    hidden, k, v = drafter_layer(drafter, shift(tokens, j + 1), hidden, pos + j, past_k,
                                 past_v, full)
    past_k.append(k)
    past_v.append(v)
    logp = jax.nn.log_softmax(drafter.logits(hidden), axis=-1)
    valid = shift(loss_mask.astype(bool), j + 2)
    labelled = valid & shift(in_vocab, j + 1)
    keep = (labelled & alive if align_topk else labelled).astype(jnp.float32)
    ce = -jnp.sum(shift(probs, j + 1) * logp, axis=-1)
    total = total + decay ** j * jnp.sum(ce * keep) / jnp.maximum(jnp.sum(keep), 1.0)
    # the target's token among the step's top k: fewer than k draft tokens scored above it
    label_logp = jnp.sum(shift(onehot, j + 1) * logp, axis=-1, keepdims=True)
    in_top = jnp.sum(logp > label_logp, axis=-1) < max(align_topk, 1)
    alive = alive & labelled & in_top
    pred = drafter.to_target_ids(jnp.argmax(logp, axis=-1).astype(jnp.int32))
    hit = (pred == shift(target_argmax, j + 1)) & valid
    accs.append(jnp.sum(hit) / jnp.maximum(jnp.sum(valid), 1))
  return total, jnp.stack(accs)
