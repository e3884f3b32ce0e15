#!/usr/bin/env python3
"""Compile time against target depth (forward with captures, speculative decode loop)."""

import argparse
import sys

from eagle3jax.bench import report
from eagle3jax.bench_compile import compile_scaling, markdown
from eagle3jax.flags import check_writable, parse_ints, positive_int


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--depths", default="6,48", help="comma-separated layer counts")
  p.add_argument("--repeats", type=positive_int, default=3)
  p.add_argument("--json", default=None, help="also write the result here")
  args = p.parse_args()
  try:
    depths = parse_ints(args.depths, "--depths", unique=True)
    if args.json:
      check_writable(args.json, "--json")
    result = compile_scaling(depths, args.repeats)
  except (ValueError, OSError) as e:
    print(f"bench_compile.py: error: {e}", file=sys.stderr)
    return 2
  return report(result, markdown(result), args.json, "bench_compile.py")


if __name__ == "__main__":
  sys.exit(main())
