#!/usr/bin/env python3
"""Size a deployment on paper: compile the real model's serving programs without its weights.

Example: python scripts/plan.py --config configs/kimi-k2.5.json \
    --drafter-config configs/kimi-k2.5-eagle3.json --mesh 1,8 --batch 1 --context 32768
"""

import argparse
import json
import os
import sys

from eagle3jax.flags import parse_ints, read_json


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="a Hugging Face config.json as published")
  p.add_argument("--drafter-config", default=None, help="an EAGLE-3 drafter config.json")
  p.add_argument("--mesh", default="1,8", help="DATA,TENSOR")
  p.add_argument("--device", default="h200", choices=("h200", "h100"))
  p.add_argument("--hbm-gib", type=float, default=None, help="default: the device's")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--context", type=int, default=32768, help="cache length")
  p.add_argument("--prompt-len", type=int, default=None,
                 help="prefill length compiled (default: 2048, or the context if shorter)")
  p.add_argument("--quantization", default="keep", choices=("keep", "dequantize"))
  p.add_argument("--steps", type=int, default=None,
                 help="drafted levels (default 7; needs --drafter-config)")
  p.add_argument("--topk", type=int, default=None,
                 help="branches per node (default 1, a chain; needs --drafter-config)")
  p.add_argument("--draft-tokens", type=int, default=None,
                 help="tree nodes verified, root included (default 8; a chain verifies "
                      "steps + 1; needs --drafter-config)")
  p.add_argument("--no-cost", action="store_true", help="skip the per-round cost fit")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  args = p.parse_args()
  try:
    data, tensor = parse_ints(args.mesh, "--mesh", count=2, form="DATA,TENSOR")
  except ValueError as e:
    print(f"plan.py: error: {e}", file=sys.stderr)
    return 2
  # Fake CPU devices for the mesh: set before JAX initialises.
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={data * tensor}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from eagle3jax.plan import markdown, plan  # pylint: disable=import-outside-toplevel
  try:
    hf = read_json(args.config, "--config", want_object=True)
    drafter = None
    tree_flags = {"--steps": args.steps, "--topk": args.topk, "--draft-tokens": args.draft_tokens}
    if args.drafter_config:
      drafter = read_json(args.drafter_config, "--drafter-config", want_object=True)
    elif any(v is not None for v in tree_flags.values()):
      given = [k for k, v in tree_flags.items() if v is not None]
      raise ValueError(f"{', '.join(given)} shape the draft tree, but without "
                       "--drafter-config the plan is autoregressive: add the drafter's "
                       "config.json, or drop them")
    steps = 7 if args.steps is None else args.steps
    topk = 1 if args.topk is None else args.topk
    draft_tokens = 8 if args.draft_tokens is None else args.draft_tokens
    if drafter is not None and topk == 1 and args.draft_tokens not in (None, steps + 1):
      print(f"note: --topk 1 is a chain of --steps {steps} drafts: it verifies {steps + 1} "
            f"tokens, not --draft-tokens {args.draft_tokens}", file=sys.stderr)
      draft_tokens = steps + 1
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    result = plan(hf, drafter, data=data, tensor=tensor, hbm_gib=args.hbm_gib,
                  device=args.device, batch=args.batch, context=args.context,
                  prompt_len=args.prompt_len, quantization=args.quantization,
                  steps=steps, topk=topk, draft_tokens=draft_tokens,
                  with_cost=not args.no_cost, log=log)
  except (ValueError, OSError) as e:
    print(f"plan.py: error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(result, indent=1) if args.json else markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
