#!/usr/bin/env python3
"""Rebuild the shipped demo (models/default) from scratch: corpus manifest, tokenizer, target,
drafter. Takes about 1.5 hours on a 2-core CPU with the defaults."""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3jax.demo import DEFAULT_DIR, DemoConfig, make_demo  # noqa: E402


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", default=DEFAULT_DIR, help="output folder")
  for field in dataclasses.fields(DemoConfig):
    p.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                   default=field.default, help=f"DemoConfig.{field.name}")
  args = p.parse_args()
  cfg = DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)})
  try:
    make_demo(args.out, cfg, log=lambda m: print(m, flush=True))
  except (ValueError, OSError) as e:
    print(f"make_demo.py: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
