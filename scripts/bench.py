#!/usr/bin/env python3
"""Greedy speculative-decoding benchmark on held-out prompts: every timing repeated --runs times
(medians and ranges), the round breakdown per setting; writes JSON, a PNG plot and prints the
README tables."""

import argparse
import json
import os
import sys

from eagle3jax.bench import SETTINGS, markdown, plot, run_benchmark
from eagle3jax.demo import DEFAULT_DIR
from eagle3jax.flags import (check_writable, measured_new_tokens, parse_ints, positive_int,
                             require_modules, write_output)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--target", default=os.path.join(DEFAULT_DIR, "target"),
                 help="the target/ folder of a demo folder (make_demo.py's --out: its "
                      "manifest.json, beside this folder, names the held-out prompts)")
  p.add_argument("--drafter", default=os.path.join(DEFAULT_DIR, "drafter"),
                 help="the drafter folder")
  p.add_argument("--prompts", type=int, default=8, help="held-out prompts")
  p.add_argument("--max-new-tokens", type=measured_new_tokens, default=128)
  p.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
  p.add_argument("--runs", type=positive_int, default=3,
                 help="timed repetitions (medians, ranges)")
  p.add_argument("--no-breakdown", action="store_true",
                 help="skip the per-phase breakdown of batch-1 rounds")
  p.add_argument("--no-transformers", action="store_true",
                 help="skip the transformers generate baseline")
  p.add_argument("--device", default=None, help="label only (the default JAX backend runs)")
  p.add_argument("--out", default="bench.json", help="JSON output; the plot goes beside it")
  args = p.parse_args()
  try:
    check_writable(args.out, "--out")  # before the run, not after it
    if os.path.splitext(args.out)[1].lower() == ".png":
      raise ValueError(f"--out {args.out!r} is where the JSON goes, and the plot goes beside "
                       "it with .png: the plot would overwrite it. Give a .json path")
    needs = {"matplotlib": "the plot"}
    if not args.no_transformers:
      needs.update(torch="the transformers baseline, or pass --no-transformers",
                   transformers="the transformers baseline, or pass --no-transformers")
    require_modules(needs, "pip install -e '.[bench]'")
    result = run_benchmark(args.target, args.drafter, num_prompts=args.prompts,
                           max_new_tokens=args.max_new_tokens,
                           batches=parse_ints(args.batches, "--batches", unique=True),
                           settings=SETTINGS, runs=args.runs,
                           with_transformers=not args.no_transformers,
                           breakdown=not args.no_breakdown,
                           log=lambda m: print(m, flush=True))
    result["device"] = args.device
    print(markdown(result))  # first: a failed write below still leaves the table on screen
    write_output(args.out, "--out", lambda f: json.dump(result, f, indent=1))
    plot(result, os.path.splitext(args.out)[0] + ".png")
  except (ValueError, OSError) as e:
    print(f"bench.py: error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
