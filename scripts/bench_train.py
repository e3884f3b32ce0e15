#!/usr/bin/env python3
"""Drafter training step: the TTT loss written plainly against ttt_loss, and the trainer's step
computing the target's features against taking them from the feature cache, side by side."""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from eagle3jax.bench import report
from eagle3jax.bench_train import markdown, train_step_times
from eagle3jax.flags import check_writable, positive_int


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--target", default=os.path.join(REPO, "models", "default", "target"),
                 help="the target/ folder of a demo folder (make_demo.py's --out: its "
                      "manifest.json, beside this folder, names the held-out prompts)")
  p.add_argument("--runs", type=positive_int, default=3,
                 help="repeated runs (medians and ranges)")
  p.add_argument("--repeats", type=positive_int, default=5,
                 help="timed steps per loss in each run")
  p.add_argument("--json", default=None, help="also write the result here")
  args = p.parse_args()
  try:
    if args.json:
      check_writable(args.json, "--json")
    result = train_step_times(args.target, runs=args.runs, repeats=args.repeats)
  except (ValueError, OSError) as e:
    print(f"bench_train.py: error: {e}", file=sys.stderr)
    return 2
  return report(result, markdown(result), args.json, "bench_train.py")


if __name__ == "__main__":
  sys.exit(main())
