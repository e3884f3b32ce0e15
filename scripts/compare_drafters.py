#!/usr/bin/env python3
"""Greedy acceptance length of several drafters for one demo target, on more held-out prompts
than the 8 of the learning curves (default 64, drawn with another seed; --seed 1234 draws the
curves' 8 first): prints Markdown tables, and with --json the numbers. Each length comes with
its bootstrap interval, and every drafter after the first with its paired difference from the
first on the same prompts, both resampling the held-out files the prompts came from
(eagle3jax.acceptance_stats). With --misses,
also where each drafter misses the target's token (training.miss_breakdown): per-step
accuracy, and step 0's by the target's top-1 minus top-2 logit gap and by position in the
response."""

import argparse
import os
import sys

from eagle3jax.capture_contract import tree_key
from eagle3jax.demo import DEFAULT_DIR, compare_drafters, drafter_misses, load_demo_target
from eagle3jax.flags import (check_writable, confidence_level, measured_new_tokens,
                             nonnegative_int, parse_ints, positive_int, write_json)
from eagle3jax.tree import checked_shape


def _parse_shapes(text: str) -> list[tuple[int, ...]]:
  """'7,1,8;5,4,8' -> [(7, 1, 8), (5, 4, 8)]."""
  try:
    shapes = [parse_ints(s, "--shapes", count=3) for s in text.split(";") if s.strip()]
  except ValueError:
    shapes = []
  if not shapes:
    raise ValueError(f"--shapes {text!r}: expected 'steps,topk,tokens;...' (integers)")
  for s in shapes:  # before the models load, and named as the flag
    checked_shape(s, "--shapes")
  return shapes


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _print_misses(drafter: str, b) -> None:
  steps = ", ".join(f"{a:.3f}" for a in b.step_accuracy)
  print(f"\n{drafter}: teacher-forced accuracy of steps 0..{len(b.step_accuracy) - 1}: "
        f"{steps}; step 0 over {b.positions} response positions: {b.accuracy:.3f}\n")
  for title, bins, unit in (("target's top-1 minus top-2 logit", b.by_gap, "nats"),
                            ("position in the response", b.by_position, "tokens")):
    print(f"| {title} ({unit}) | share of positions | step-0 accuracy | share of misses |")
    print("|---|---|---|---|")
    for x in bins:
      print(f"| [{x.low:g}, {x.high:g}) | {x.fraction:.3f} | {x.accuracy:.3f} | "
            f"{x.miss_share:.3f} |")
    print()


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("drafters", nargs="+", help="drafter folders (EAGLE-3 layout)")
  p.add_argument("--demo-dir", default=DEFAULT_DIR,
                 help="folder with target/ and manifest.json (held-out files)")
  p.add_argument("--prompts", type=positive_int, default=64, help="held-out prompts")
  p.add_argument("--seed", type=nonnegative_int, default=99,
                 help="which held-out prompts are drawn")
  p.add_argument("--shapes", default="7,1,8;5,4,8",
                 help="tree shapes 'steps,topk,tokens', separated by ';'")
  p.add_argument("--max-new-tokens", type=measured_new_tokens, default=128,
                 help="new tokens per prompt (>= 2: with 1 no round runs)")
  p.add_argument("--batch", type=positive_int, default=8, help="prompts per generate call")
  p.add_argument("--level", type=confidence_level, default=0.95,
                 help="confidence level of the intervals (bootstrap over the held-out files)")
  p.add_argument("--misses", action="store_true",
                 help="also break each drafter's misses down by the target's logit gap and by "
                      "position in the response (on the same prompts' greedy responses)")
  p.add_argument("--json", default=None, help="also write the numbers to this file")
  args = p.parse_args()
  try:
    if args.json:
      check_writable(args.json, "--json")  # before the run, not after it
    shapes = _parse_shapes(args.shapes)
    seen = {}
    for d in args.drafters:  # all named now, not after the drafters before them are measured
      if not os.path.isfile(os.path.join(d, "config.json")):
        raise ValueError(f"drafter folder {d!r} has no config.json")
      key = os.path.realpath(d)
      if key in seen:
        raise ValueError(f"drafter folders {seen[key]!r} and {d!r} are the same folder")
      seen[key] = d
    loaded = load_demo_target(args.demo_dir)  # one target for both measurements
    result = compare_drafters(args.demo_dir, args.drafters, num_prompts=args.prompts,
                              seed=args.seed, shapes=shapes,
                              max_new_tokens=args.max_new_tokens, batch_size=args.batch,
                              loaded=loaded, log=log)
    misses = drafter_misses(args.demo_dir, args.drafters, num_prompts=args.prompts,
                            seed=args.seed, response_len=args.max_new_tokens,
                            loaded=loaded, log=log) if args.misses else {}
    summary = result.summary(args.level)
  except (ValueError, OSError) as e:
    print(f"compare_drafters.py: error: {e}", file=sys.stderr)
    return 2
  keys = [tree_key(*s) for s in shapes]
  shown = lambda k: f"({k.replace(',', ', ')})"  # noqa: E731
  level = f"{args.level * 100:g}%"
  print(f"{args.prompts} held-out prompts (seed {args.seed}) from {summary['files']} files, "
        f"{args.max_new_tokens} new tokens, greedy\n")
  print("mean acceptance length (accepted drafts + 1 per round) per tree (steps, topk, draft "
        "tokens)" + (f", with its {level} interval (bootstrap over the held-out files):\n"
                     if "interval" in summary else
                     " (no interval: the prompts came from fewer than 2 files):\n"))
  print("| drafter | " + " | ".join(shown(k) for k in keys) + " |")
  print("|---|" + "---|" * len(keys))
  for d, acc in summary["acceptance"].items():
    iv = summary.get("interval", {}).get(d, {})
    print(f"| {d} | " + " | ".join(
        (f"{acc[k]:.2f}" if k in acc else "no round")
        + (f" ({iv[k][0]:.2f}-{iv[k][1]:.2f})" if k in iv else "") for k in keys) + " |")
  if summary.get("difference"):
    first = next(iter(summary["acceptance"]))
    print(f"\ndifference from {first} on the same prompts, with its {level} interval "
          "(paired bootstrap; an interval without 0 is more than the prompts' draw):\n")
    print("| drafter | " + " | ".join(shown(k) for k in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for d, diff in summary["difference"].items():
      print(f"| {d} | " + " | ".join(
          f"{diff[k]['difference']:+.2f} ({diff[k]['low']:+.2f} to {diff[k]['high']:+.2f})"
          if k in diff else "-" for k in keys) + " |")
  for d, b in misses.items():
    _print_misses(d, b)
  if args.json:
    out = {"prompts": args.prompts, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
           **summary,
           "sources": list(result.sources),
           "per_prompt": {d: {k: m.to_dict() for k, m in by_shape.items()}
                          for d, by_shape in result.measured.items()}}
    if misses:
      out["misses"] = {d: b.to_dict() for d, b in misses.items()}
    return write_json(args.json, "--json", out, "compare_drafters.py")
  return 0


if __name__ == "__main__":
  sys.exit(main())
