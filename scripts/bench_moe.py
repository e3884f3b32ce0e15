#!/usr/bin/env python3
"""MoE forward time against the number of experts at a fixed top-k (dense vs grouped)."""

import argparse
import sys

from eagle3jax.bench import report
from eagle3jax.bench_moe import markdown, moe_scaling
from eagle3jax.flags import check_writable, parse_ints, positive_int


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--experts", default="16,64,256", help="comma-separated expert counts")
  p.add_argument("--top-k", type=positive_int, default=4)
  p.add_argument("--hidden", type=positive_int, default=512, help="model width D")
  p.add_argument("--ffn", type=positive_int, default=256, help="expert MLP width F")
  p.add_argument("--repeats", type=positive_int, default=20)
  p.add_argument("--json", default=None, help="also write the result here")
  args = p.parse_args()
  try:
    experts = parse_ints(args.experts, "--experts", unique=True)
    if min(experts) < 2:  # noaux_tc routing scores a group of experts by its best 2
      raise ValueError(f"--experts {args.experts!r}: every expert count must be at least 2")
    if args.json:
      check_writable(args.json, "--json")
    result = moe_scaling(experts, args.top_k, args.hidden, args.ffn, args.repeats)
  except (ValueError, OSError) as e:
    print(f"bench_moe.py: error: {e}", file=sys.stderr)
    return 2
  return report(result, markdown(result), args.json, "bench_moe.py")


if __name__ == "__main__":
  sys.exit(main())
