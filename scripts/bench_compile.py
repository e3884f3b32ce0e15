#!/usr/bin/env python3
"""Compile time against target depth (forward with captures, speculative decode loop)."""

import argparse
import sys

from eagle3jax.bench import report
from eagle3jax.bench_compile import compile_scaling, markdown
from eagle3jax.flags import parse_ints


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--depths", default="6,48", help="comma-separated layer counts")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", default=None, help="also write the result here")
  args = p.parse_args()
  try:
    depths = parse_ints(args.depths, "--depths")
  except ValueError as e:
    print(f"bench_compile.py: error: {e}", file=sys.stderr)
    return 2
  result = compile_scaling(depths, args.repeats)
  return report(result, markdown(result), args.json)


if __name__ == "__main__":
  sys.exit(main())
