"""Greedy decoding benchmark on held-out prompts: acceptance, and speculative vs
autoregressive vs ``transformers`` tokens/s measured side by side in one run, repeated
``runs`` times (medians and ranges), plus where a batch-1 round goes
(``eagle3jax.round_profile``)."""

from __future__ import annotations

import os
import platform
import statistics
import time

import numpy as np

from eagle3jax.flags import write_json

SETTINGS = ((3, 1, 4), (5, 1, 6), (7, 1, 8), (5, 4, 8), (7, 10, 60))


def spread(values) -> dict:
  """``{"median", "min", "max", "runs"}`` of repeated measurements."""
  values = [float(v) for v in values]
  return {"median": statistics.median(values), "min": min(values), "max": max(values),
          "runs": values}


def report(result: dict, table: str, json_path: str | None, script: str) -> int:
  """What the benchmark scripts end with: prints ``table`` and, given ``json_path`` (the
  ``--json`` flag), writes ``result`` there; returns the exit status (2, with ``script``'s
  error line, when the file cannot be written)."""
  print(table)
  return write_json(json_path, "--json", result, script) if json_path else 0


def machine() -> dict:
  """What the numbers ran on: CPU model, cores, date."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"cpu": model, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def _run(gen, prompts, batch, *, paired=None):
  """Decodes ``prompts`` in batches; returns (outputs, tokens/s, acceptance length,
  acceptance per position, paired autoregressive tokens/s).

  ``paired``: another generate function run on each batch just before ``gen`` (the
  autoregressive baseline), so both are timed side by side over the same stretch of wall
  clock; its tokens/s is the fifth value returned (None without ``paired``).
  """
  outs, new, seconds, rounds, accepted = [], 0, 0.0, 0, 0
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
    accepted += r.stats["accepted"]
    if r.stats["acceptance_per_position"]:
      per_pos.append((r.stats["rounds"], np.asarray(r.stats["acceptance_per_position"])))
  pos = (sum(n * a for n, a in per_pos) / max(rounds, 1)).tolist() if per_pos else []
  base = base_new / base_s if paired is not None else None
  return outs, new / seconds, accepted / max(rounds, 1), pos, base


class _Transformers:
  """``transformers`` greedy ``generate`` (PyTorch CPU, 2 threads) on the same weights."""

  def __init__(self, target_dir: str):
    import torch
    import transformers
    torch.set_num_threads(2)
    self.torch = torch
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32).eval()

  def tokens_per_s(self, prompts, max_new_tokens: int) -> float:
    torch = self.torch
    new, seconds = 0, 0.0
    with torch.no_grad():
      self.model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)
      for p in prompts:
        ids = torch.tensor([p])
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=max_new_tokens,
                                  min_new_tokens=max_new_tokens, do_sample=False)
        seconds += time.perf_counter() - t0
        new += out.shape[1] - ids.shape[1]
    return new / seconds


def layer_loop_steps(target_dir: str, prompts, max_new_tokens: int, runs: int) -> dict:
  """Autoregressive ms per step of the same target held as a scan and as one-layer stacks
  (``layer_loop``), alternating prompt by prompt, ``runs`` times."""
  import jax.numpy as jnp
  import eagle3jax
  targets = {loop: eagle3jax.load_target(target_dir, dtype=jnp.float32, layer_loop=loop)
             for loop in ("scan", "split")}
  kw = dict(max_new_tokens=max_new_tokens, eos_ids=[])
  ms = {loop: [] for loop in targets}
  for t in targets.values():
    eagle3jax.generate(t, None, prompts[:1], **kw)  # compile
  for _ in range(runs):
    sec = {loop: 0.0 for loop in targets}
    steps = {loop: 0 for loop in targets}
    for p in prompts:
      for loop, t in targets.items():
        r = eagle3jax.generate(t, None, [p], **kw)
        sec[loop] += r.stats["decode_s"]
        steps[loop] += r.stats["rounds"]
    for loop in targets:
      ms[loop].append(1e3 * sec[loop] / steps[loop])
  return {**{f"{loop}_step_ms": spread(v) for loop, v in ms.items()},
          "scan_over_split": spread([a / b for a, b in zip(ms["scan"], ms["split"])])}


def run_benchmark(target_dir: str, drafter_dir: str, *, num_prompts: int = 8,
                  prompt_len: int = 48, max_new_tokens: int = 128, batches=(1, 4),
                  settings=SETTINGS, runs: int = 3, with_transformers: bool = True,
                  breakdown: bool = True, log=print) -> dict:
  """Everything timed ``runs`` times over (after one compile); rows keep each run's value and
  report medians and ranges (``spread``)."""
  import jax.numpy as jnp
  import eagle3jax
  from eagle3jax.stack import default_layer_loop
  from eagle3jax import demo, round_profile
  from eagle3jax.text import TextCodec
  from eagle3jax.tree import TreeShape

  if runs < 1:
    raise ValueError(f"runs={runs} must be >= 1")
  max_new_tokens = round_profile.check_new_tokens(max_new_tokens)  # before the timing
  if num_prompts < 1 or not batches or min(batches) < 1:
    raise ValueError(f"--prompts {num_prompts} and --batches {list(batches)} must be >= 1")
  if max(batches) > num_prompts:
    raise ValueError(f"--batches {list(batches)}: a batch of {max(batches)} needs at least "
                     f"that many prompts, but --prompts is {num_prompts}")
  manifest = demo.read_manifest(os.path.dirname(os.path.abspath(target_dir)), hint=(
      "--target must be the target/ folder of such a folder, e.g. models/default/target"))
  target = eagle3jax.load_target(target_dir, dtype=jnp.float32,
                                 layer_loop=default_layer_loop())
  drafter = eagle3jax.load_drafter(drafter_dir, target=target)
  codec = TextCodec(target_dir)
  prompts = demo.prompts_from(codec.tokenizer, demo.read_split(manifest, "heldout"),
                              num_prompts, prompt_len, seed=1234)
  kw = dict(max_new_tokens=max_new_tokens, eos_ids=[])
  ar_gen = lambda ps: eagle3jax.generate(target, None, ps, **kw)  # noqa: E731

  def spec_gen(steps, topk, n):
    return lambda ps: eagle3jax.generate(target, drafter, ps, num_steps=steps, topk=topk,
                                         num_draft_tokens=n, **kw)

  cells = {}   # (batch, setting) -> per-run measurements
  ar_out = {}
  for batch in batches:
    ar_gen(prompts[:batch])  # compile
    ar_out[batch] = _run(ar_gen, prompts, batch)[0]
    for setting in settings:
      spec_gen(*setting)(prompts[:batch])  # compile
      cells[batch, setting] = {"tps": [], "ar": [], "tau": None, "pos": None, "exact": True}
  hf = _Transformers(target_dir) if with_transformers else None
  hf_runs, ar1_runs, profiles = [], [], {}
  for run in range(runs):
    for batch in batches:
      for setting in settings:
        # Speculative and autoregressive decoding alternate batch by batch, so that drift in
        # the machine's speed hits both alike; the ratio uses these paired timings.
        out, tps, tau, pos, pair_ar = _run(spec_gen(*setting), prompts, batch, paired=ar_gen)
        cell = cells[batch, setting]
        cell["tps"].append(tps)
        cell["ar"].append(pair_ar)
        cell["tau"], cell["pos"] = tau, pos
        cell["exact"] &= out == ar_out[batch]
        log(f"run {run + 1}/{runs} batch {batch} {setting}: tau {tau:.2f}  {tps:.1f} tokens/s "
            f"(autoregressive {pair_ar:.1f})  speedup {tps / pair_ar:.2f}x  "
            f"lossless {out == ar_out[batch]}")
    if hf is not None:
      # The engine's own batch-1 decoding is timed right before transformers, so the two are
      # compared over the same stretch of wall clock.
      ar_gen(prompts[:1])  # warm (compiles only if batch 1 was not benchmarked)
      ar1_runs.append(_run(ar_gen, prompts, 1)[1])
      hf_runs.append(hf.tokens_per_s(prompts, max_new_tokens))
      log(f"run {run + 1}/{runs}: transformers {hf_runs[-1]:.1f} tokens/s, eagle3jax "
          f"autoregressive {ar1_runs[-1]:.1f}")
    if breakdown:
      for setting in settings:
        p = round_profile.profile_round(target, drafter, prompts, TreeShape(*setting),
                                        max_new_tokens=max_new_tokens)
        profiles.setdefault(setting, []).append(p)
        log(f"run {run + 1}/{runs} round {setting}: " + "  ".join(
            f"{k} {p[k + '_ar']:.2f}" for k in round_profile.PHASES + ("other", "round"))
            + " autoregressive steps")
  rows = []
  for (batch, (steps, topk, n)), cell in cells.items():
    speedups = [a / b for a, b in zip(cell["tps"], cell["ar"])]
    rows.append({"batch": batch, "steps": steps, "topk": topk, "draft_tokens": n,
                 "accept_length_mean": cell["tau"], "acceptance_per_position": cell["pos"],
                 "tokens_per_s": spread(cell["tps"]), "ar_tokens_per_s": spread(cell["ar"]),
                 "speedup": spread(speedups), "matches_autoregressive": cell["exact"]})
  result = {"machine": machine(), "runs": runs, "prompts": num_prompts,
            "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "rows": rows}
  if hf is not None:
    result["transformers_tokens_per_s"] = spread(hf_runs)
    result["engine_ar_tokens_per_s_beside_transformers"] = spread(ar1_runs)
    result["engine_ar_vs_transformers"] = spread([a / b for a, b in zip(ar1_runs, hf_runs)])
  if breakdown:
    result["layer_loops"] = layer_loop_steps(target_dir, prompts, max_new_tokens, runs)
    log(f"autoregressive step: scan {result['layer_loops']['scan_step_ms']['median']:.2f} ms, "
        f"split {result['layer_loops']['split_step_ms']['median']:.2f} ms")
    keys = [f"{k}_{u}" for k in round_profile.PHASES + ("other", "round") for u in ("ms", "ar")]
    result["round_breakdown"] = [
        {"steps": s[0], "topk": s[1], "draft_tokens": s[2], "ar_step_ms": spread(
            [p["ar_step_ms"] for p in ps]), **{k: spread([p[k] for p in ps]) for k in keys}}
        for s, ps in profiles.items()]
  best = max((r for r in rows if r["batch"] == 1), key=lambda r: r["speedup"]["median"],
             default=None)
  if best is not None:
    result["best_batch1"] = {k: best[k] for k in ("steps", "topk", "draft_tokens")}
  return result


def _mr(s: dict, fmt: str = "{:.2f}", unit: str = "") -> str:
  """``median (min-max)``."""
  return (f"{fmt.format(s['median'])}{unit} ({fmt.format(s['min'])}-"
          f"{fmt.format(s['max'])}{unit})")


def markdown(result: dict) -> str:
  """The README's tables for a benchmark result."""
  m = result["machine"]
  lines = [f"{m['cores']}-core {m['cpu']}, {m['date']}; medians (ranges) of {result['runs']} "
           "runs.", "",
           "| batch | (steps, topk, draft tokens) | accept length | acceptance per position | "
           "tokens/s | autoregressive tokens/s | speedup | lossless |",
           "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    pos = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"])
    lines.append(
        f"| {r['batch']} | ({r['steps']}, {r['topk']}, {r['draft_tokens']}) | "
        f"{r['accept_length_mean']:.2f} | {pos} | {_mr(r['tokens_per_s'], '{:.0f}')} | "
        f"{_mr(r['ar_tokens_per_s'], '{:.0f}')} | {_mr(r['speedup'], unit='x')} | "
        f"{'yes' if r['matches_autoregressive'] else 'NO'} |")
  if "transformers_tokens_per_s" in result:
    lines += ["", f"`transformers` greedy `generate`, batch 1: "
              f"{_mr(result['transformers_tokens_per_s'], '{:.0f}')} tokens/s; eagle3jax "
              f"autoregressive beside it "
              f"{_mr(result['engine_ar_tokens_per_s_beside_transformers'], '{:.0f}')} tokens/s: "
              f"{_mr(result['engine_ar_vs_transformers'], unit='x')}."]
  if "layer_loops" in result:
    ll = result["layer_loops"]
    lines += ["", f"Autoregressive step, batch 1: {_mr(ll['split_step_ms'])} ms with one-layer "
              f"stacks (`layer_loop=split`), {_mr(ll['scan_step_ms'])} ms as a "
              f"scan: {_mr(ll['scan_over_split'], unit='x')}."]
  if "round_breakdown" in result:
    lines += ["", "| (steps, topk, draft tokens) | autoregressive step ms | draft | verify | "
              "accept + commit | catch-up | other | round |", "|---|---|---|---|---|---|---|---|"]
    for b in result["round_breakdown"]:
      cells = [f"{b[k + '_ms']['median']:.2f} ms = {_mr(b[k + '_ar'])}"
               for k in ("draft", "verify", "accept_commit", "catch_up", "other", "round")]
      lines.append(f"| ({b['steps']}, {b['topk']}, {b['draft_tokens']}) | "
                   f"{_mr(b['ar_step_ms'])} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  """Grouped bars per setting (one group per batch size) with their ranges: acceptance length,
  and tokens/s with the autoregressive and ``transformers`` baselines on the same axes."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["rows"]
  batches = sorted({r["batch"] for r in rows})
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
  width = 0.8 / len(batches)
  for bi, batch in enumerate(batches):
    rs = [r for r in rows if r["batch"] == batch]
    x = np.arange(len(rs)) + (bi - (len(batches) - 1) / 2) * width
    axes[0].bar(x, [r["accept_length_mean"] for r in rs], width, label=f"batch {batch}")
    tps = [r["tokens_per_s"] for r in rs]
    err = np.array([[t["median"] - t["min"] for t in tps], [t["max"] - t["median"] for t in tps]])
    axes[1].bar(x, [t["median"] for t in tps], width, yerr=err, capsize=3,
                label=f"speculative, batch {batch}")
    ar = spread([v for r in rs for v in r["ar_tokens_per_s"]["runs"]])
    axes[1].axhspan(ar["min"], ar["max"], color=f"C{bi}", alpha=0.15)
    axes[1].axhline(ar["median"], color=f"C{bi}", ls="--", lw=1,
                    label=f"autoregressive, batch {batch}")
  if "transformers_tokens_per_s" in result:
    hf = result["transformers_tokens_per_s"]
    axes[1].axhspan(hf["min"], hf["max"], color="gray", alpha=0.2)
    axes[1].axhline(hf["median"], color="gray", ls=":", lw=1.5,
                    label="transformers generate, batch 1")
  labels = [f"({r['steps']},{r['topk']},{r['draft_tokens']})" for r in rows
            if r["batch"] == batches[0]]
  for ax in axes:
    ax.set_xticks(np.arange(len(labels)), labels)
    ax.set_xlabel("(steps, topk, draft tokens)")
  axes[0].set_title("mean acceptance length (held-out prompts)")
  m = result.get("machine", {})
  axes[1].set_title(f"tokens/s, median and range of {result.get('runs', 1)} runs "
                    f"({m.get('cores', '?')} cores, {m.get('date', '')})")
  axes[0].legend()
  axes[1].legend(fontsize=7, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
