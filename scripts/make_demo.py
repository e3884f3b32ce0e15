#!/usr/bin/env python3
"""Rebuild the shipped demo (models/default) from scratch: corpus manifest, tokenizer, target,
drafter. Takes about 1 hour 20 to 40 minutes on a 2-core CPU with the defaults, by the
machine and its hour (the target about 42 minutes; the drafter about 38 to 54: regeneration 5
to 10, the feature cache 2 to 3, the 3500 training steps 30 to 39)."""

import argparse
import dataclasses
import json
import logging
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from eagle3jax.demo import (DEFAULT_DIR, DemoConfig, check_drafter_recipe, make_demo,
                            make_drafter, plot_curve)
from eagle3jax.flags import check_writable, require_modules


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", default=DEFAULT_DIR, help="output folder")
  p.add_argument("--drafter-only", action="store_true",
                 help="keep OUT/target and OUT/manifest.json; retrain only OUT/drafter")
  p.add_argument("--curve", default=os.path.join(REPO, "docs", "drafter_curve.json"),
                 help="where the drafter's learning curve goes (JSON; the PNG plot beside it)")
  p.add_argument("--state-dir", default=None,
                 help="with --drafter-only: keep the drafter's data and checkpoints here "
                      "(a run given the same folder resumes)")
  for field in dataclasses.fields(DemoConfig):
    if isinstance(field.default, bool):  # --draft-cache-features / --no-draft-cache-features
      p.add_argument(f"--{field.name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                     default=field.default, help=f"DemoConfig.{field.name}")
      continue
    p.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                   default=field.default, help=f"DemoConfig.{field.name}")
  args = p.parse_args()
  logging.basicConfig(format="%(message)s")
  logging.getLogger("eagle3jax").setLevel(logging.INFO)  # the learning curve as it is measured
  try:
    # All at once, not after the target's 42 minutes.
    cfg = DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)})
    check_drafter_recipe(cfg)
    check_writable(args.curve, "--curve")
    if os.path.splitext(args.curve)[1].lower() == ".png":
      raise ValueError(f"--curve {args.curve!r} is where the JSON goes, and the plot goes "
                       "beside it with .png: the plot would overwrite it. Give a .json path")
    if args.state_dir and not args.drafter_only:
      raise ValueError("--state-dir keeps a drafter-only run's data and checkpoints; a full "
                       "rebuild retrains the target, so that data would not fit it. Add "
                       "--drafter-only, or drop --state-dir")
    if cfg.heldout_every:  # a learning curve to plot
      require_modules({"matplotlib": "the learning curve's plot"}, "pip install -e '.[bench]'")
    log = lambda m: print(m, flush=True)  # noqa: E731
    if args.drafter_only:
      curve = make_drafter(args.out, cfg, log=log, state_dir=args.state_dir)
    else:
      curve = make_demo(args.out, cfg, log=log)
    if curve:
      with open(args.curve, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "curve": curve}, f, indent=1)
      plot_curve(curve, os.path.splitext(args.curve)[0] + ".png")
      log(f"wrote {args.curve} and its plot")
  except (ValueError, OSError, FloatingPointError) as e:
    print(f"make_demo.py: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
