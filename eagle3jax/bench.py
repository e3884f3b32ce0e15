"""Greedy decoding benchmark on held-out prompts: acceptance, and speculative vs
autoregressive vs ``transformers`` tokens/s measured side by side in one run."""

from __future__ import annotations

import json
import os
import time

import numpy as np

SETTINGS = ((3, 1, 4), (5, 1, 6), (7, 1, 8), (5, 4, 8), (7, 10, 60))


def _run(gen, prompts, batch, *, paired=None):
  """Decodes ``prompts`` in batches; returns (outputs, tokens/s, stats of all rounds).

  ``paired``: another generate function run on each batch just before ``gen`` (the
  autoregressive baseline), so both are timed side by side over the same stretch of wall
  clock; its tokens/s is the fifth value returned (None without ``paired``).
  """
  outs, new, seconds, rounds, accepted = [], 0, 0.0, 0, 0.0
  per_pos = []
  base_new, base_s = 0, 0.0
  for i in range(0, len(prompts), batch):
    if paired is not None:
      rb = paired(prompts[i:i + batch])
      base_new += rb.stats["new_tokens"]
      base_s += rb.stats["prefill_s"] + rb.stats["decode_s"]
    r = gen(prompts[i:i + batch])
    outs += r.tokens
    new += r.stats["new_tokens"]
    seconds += r.stats["prefill_s"] + r.stats["decode_s"]
    rounds += r.stats["rounds"]
    accepted += r.stats["accept_length_mean"] * r.stats["rounds"]
    if r.stats["acceptance_per_position"]:
      per_pos.append((r.stats["rounds"], np.asarray(r.stats["acceptance_per_position"])))
  pos = (sum(n * a for n, a in per_pos) / max(rounds, 1)).tolist() if per_pos else []
  base = base_new / base_s if paired is not None else None
  return outs, new / seconds, accepted / max(rounds, 1), pos, base


def transformers_tokens_per_s(target_dir: str, prompts, max_new_tokens: int) -> float:
  """``transformers`` greedy ``generate`` (PyTorch CPU, 2 threads) on the same weights."""
  import torch
  import transformers
  torch.set_num_threads(2)
  model = transformers.AutoModelForCausalLM.from_pretrained(target_dir,
                                                            dtype=torch.float32).eval()
  new, seconds = 0, 0.0
  with torch.no_grad():
    ids = torch.tensor([prompts[0]])
    model.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up
    for p in prompts:
      ids = torch.tensor([p])
      t0 = time.perf_counter()
      out = model.generate(ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                           do_sample=False)
      seconds += time.perf_counter() - t0
      new += out.shape[1] - ids.shape[1]
  return new / seconds


def run_benchmark(target_dir: str, drafter_dir: str, *, num_prompts: int = 8,
                  prompt_len: int = 48, max_new_tokens: int = 128, batches=(1, 4),
                  settings=SETTINGS, with_transformers: bool = True, log=print) -> dict:
  import jax.numpy as jnp
  import eagle3jax
  from eagle3jax import demo
  from eagle3jax.text import TextCodec

  target = eagle3jax.load_target(target_dir, dtype=jnp.float32)
  drafter = eagle3jax.load_drafter(drafter_dir, target=target)
  manifest_path = os.path.join(os.path.dirname(os.path.abspath(target_dir)), "manifest.json")
  with open(manifest_path) as f:
    manifest = json.load(f)
  codec = TextCodec(target_dir)
  prompts = demo.prompts_from(codec.tokenizer, demo.read_files(manifest["heldout"]),
                              num_prompts, prompt_len, seed=1234)
  kw = dict(max_new_tokens=max_new_tokens, eos_ids=[])
  rows = []
  ar_gen = lambda ps: eagle3jax.generate(target, None, ps, **kw)  # noqa: E731
  for batch in batches:
    ar_gen(prompts[:batch])  # compile
    ar_out, ar_tps, _, _, _ = _run(ar_gen, prompts, batch)
    log(f"batch {batch}: autoregressive {ar_tps:.1f} tokens/s")
    for steps, topk, n in settings:
      gen = lambda ps, s=steps, k=topk, n=n: eagle3jax.generate(  # noqa: E731
          target, drafter, ps, num_steps=s, topk=k, num_draft_tokens=n, **kw)
      gen(prompts[:batch])  # compile
      # Speculative and autoregressive decoding alternate batch by batch, so that drift in
      # the machine's speed hits both alike; the ratio uses these paired timings.
      out, tps, tau, pos, pair_ar = _run(gen, prompts, batch, paired=ar_gen)
      row = {"batch": batch, "steps": steps, "topk": topk, "draft_tokens": n,
             "accept_length_mean": tau, "acceptance_per_position": pos,
             "tokens_per_s": tps, "ar_tokens_per_s": pair_ar, "speedup": tps / pair_ar,
             "matches_autoregressive": out == ar_out}
      rows.append(row)
      log(f"batch {batch} ({steps},{topk},{n}): tau {tau:.2f}  {tps:.1f} tokens/s  "
          f"(autoregressive {pair_ar:.1f})  speedup {tps / pair_ar:.2f}x  "
          f"lossless {row['matches_autoregressive']}")
  result = {"prompts": num_prompts, "prompt_len": prompt_len,
            "max_new_tokens": max_new_tokens, "rows": rows}
  if with_transformers:
    # The engine's own batch-1 decoding is timed again right before transformers, so the two
    # are compared over the same stretch of wall clock.
    ar_gen(prompts[:1])  # warm (compiles only if batch 1 was not benchmarked)
    _, ar1, _, _, _ = _run(ar_gen, prompts, 1)
    hf = transformers_tokens_per_s(target_dir, prompts, max_new_tokens)
    result["transformers_tokens_per_s"] = hf
    result["engine_ar_tokens_per_s_beside_transformers"] = ar1
    result["engine_ar_vs_transformers"] = ar1 / hf
    log(f"transformers generate {hf:.1f} tokens/s; eagle3jax autoregressive / transformers "
        f"= {ar1 / hf:.2f}x")
  best = max((r for r in rows if r["batch"] == 1), key=lambda r: r["speedup"])
  result["best_batch1"] = {k: best[k] for k in ("steps", "topk", "draft_tokens")}
  return result


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["rows"]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for batch in sorted({r["batch"] for r in rows}):
    rs = [r for r in rows if r["batch"] == batch]
    labels = [f"({r['steps']},{r['topk']},{r['draft_tokens']})" for r in rs]
    axes[0].plot(labels, [r["accept_length_mean"] for r in rs], "o-", label=f"batch {batch}")
    axes[1].plot(labels, [r["speedup"] for r in rs], "o-", label=f"batch {batch}")
  axes[0].set_title("mean acceptance length")
  axes[1].set_title("speedup vs autoregressive (wall clock)")
  axes[1].axhline(1.0, color="gray", lw=0.5)
  for ax in axes:
    ax.set_xlabel("(steps, topk, draft tokens)")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
