"""The decode command (``scripts/decode.py``): flags, loading, streaming, stats."""

from __future__ import annotations

import argparse
import json
import os
import sys

from eagle3jax.distributed import distributed_flags, initialize_from_flags, is_main_process
from eagle3jax.flags import parse_ints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TARGET = os.path.join(REPO, "models", "default", "target")
DEFAULT_DRAFTER = os.path.join(REPO, "models", "default", "drafter")
TIMING_RUNS = 3  # with --baseline: timed runs of each decoding, alternating
DEFAULT_PROMPT = "def fibonacci(n):"


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="decode.py", description="EAGLE-3 speculative decoding with eagle3jax.")
  p.add_argument("--target", default=DEFAULT_TARGET,
                 help="Hugging Face target directory (config.json, safetensors, tokenizer.json)")
  p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="EAGLE-3 drafter directory")
  src = p.add_mutually_exclusive_group()
  src.add_argument("--prompt", default=None, help="prompt text (tokenised with the target's "
                   "tokenizer.json; chat template applied when the directory has one)")
  src.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0)
  # The default tree is the benchmark's best batch-1 setting on the shipped pair (README).
  p.add_argument("--steps", type=int, default=7, help="draft steps (tree depth)")
  p.add_argument("--topk", type=int, default=1, help="branching per draft step (1 = chain)")
  p.add_argument("--draft-tokens", type=int, default=None,
                 help="verified tokens per round, root included (default 8, or all of a "
                      "smaller tree's nodes; a chain, --topk 1, always verifies steps + 1)")
  p.add_argument("--mesh", default="1,1", help="DATA,TENSOR mesh shape")
  p.add_argument("--aux-layer-convention", choices=("input", "output", "auto"), default=None,
                 help="needed only for drafters whose config gives capture ids without one "
                      "(auto: measure both readings)")
  p.add_argument("--no-verify-capture", action="store_true",
                 help="skip the load-time capture check (record or probe)")
  p.add_argument("--layer-loop", choices=("scan", "split"), default=None,
                 help="target layers as scans, or one-layer stacks (faster on CPU; default: "
                      "split on CPU, scan elsewhere)")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32",
                 help="dtype the target is loaded in, and the drafter with it (default float32)")
  p.add_argument("--seed", type=int, default=0,
                 help="random seed of sampling (temperature > 0); greedy ignores it")
  p.add_argument("--baseline", action="store_true",
                 help="also run autoregressive decoding; report speedup and, for greedy, "
                      "whether the outputs match")
  p.add_argument("--json", action="store_true", help="print exactly one JSON object")
  distributed_flags(p)
  return p


def _mesh(text: str):
  import eagle3jax  # pylint: disable=import-outside-toplevel
  return eagle3jax.make_mesh(*parse_ints(text, "--mesh", count=2, form="DATA,TENSOR, e.g. 1,8"))


def run(argv=None) -> int:
  args = parser().parse_args(argv)
  try:
    return _run(args)
  except (ValueError, OSError) as e:
    print(f"decode.py: error: {e}", file=sys.stderr)
    return 2


def _run(args) -> int:
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import eagle3jax  # pylint: disable=import-outside-toplevel
  from eagle3jax.stack import default_layer_loop  # pylint: disable=import-outside-toplevel
  from eagle3jax.text import TextCodec  # pylint: disable=import-outside-toplevel

  for flag, path in (("--target", args.target), ("--drafter", args.drafter)):
    if not os.path.isdir(path):
      hint = (" (the shipped default models are not in this checkout; pass --target and "
              "--drafter)" if path in (DEFAULT_TARGET, DEFAULT_DRAFTER) else "")
      raise ValueError(f"{flag} {path!r} is not a directory{hint}")
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise ValueError(f"{flag} {path!r} has no config.json: give the folder of a "
                       f"{'target model' if flag == '--target' else 'drafter'} checkpoint")
  initialize_from_flags(args)
  main = is_main_process()  # only process 0 prints
  mesh = _mesh(args.mesh)
  dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
  target = eagle3jax.load_target(args.target, mesh=mesh, dtype=dtype,
                                 layer_loop=args.layer_loop or default_layer_loop())
  drafter = eagle3jax.load_drafter(args.drafter, target=target,
                                   aux_layer_convention=args.aux_layer_convention,
                                   verify_capture=not args.no_verify_capture)
  codec = None
  if args.prompt_ids is not None:
    prompt = list(parse_ints(args.prompt_ids, "--prompt-ids"))
    if os.path.exists(os.path.join(args.target, "tokenizer.json")):
      try:  # only to show the output as text: the ids need no tokenizer
        codec = TextCodec(args.target)
      except ValueError as e:
        print(f"note: {e}; printing token ids", file=sys.stderr)
  else:
    codec = TextCodec(args.target)
    prompt = codec.encode_prompt(args.prompt if args.prompt is not None else DEFAULT_PROMPT)
  kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
  if args.draft_tokens is None:
    # 8, or every node a smaller tree has (--steps 2 --topk 2 has 7); an invalid --steps or
    # --topk is left to the tree's own check, which names it.
    from eagle3jax.tree import max_draft_tokens  # pylint: disable=import-outside-toplevel
    draft_tokens = max(2, min(8, max_draft_tokens(args.steps, args.topk)))
  else:
    draft_tokens = args.draft_tokens
  if args.topk == 1 and args.draft_tokens not in (None, args.steps + 1) and main:
    print(f"note: --topk 1 drafts a chain of --steps + 1 = {args.steps + 1} tokens; "
          f"--draft-tokens {args.draft_tokens} is not used", file=sys.stderr)
  spec_kw = dict(num_steps=args.steps, topk=args.topk, num_draft_tokens=draft_tokens)

  printed = [0]

  def stream(tokens, final=False):
    if not main:
      return
    text = codec.decode(tokens[0]) if codec else " ".join(map(str, tokens[0]))
    if not final:  # a round can end inside a character's bytes: hold its U+FFFD back
      text = text.rstrip("\ufffd")
    if len(text) > printed[0]:
      sys.stdout.write(text[printed[0]:])
      sys.stdout.flush()
      printed[0] = len(text)

  # The first run compiles (and, without --json, streams the text as rounds are accepted,
  # which costs a host sync per round); the second, with the same shapes, is the timed one.
  first = eagle3jax.generate(target, drafter, [prompt], **kw, **spec_kw,
                             on_tokens=None if args.json else stream)
  if not args.json:
    stream(first.tokens, final=True)
  result = eagle3jax.generate(target, drafter, [prompt], **kw, **spec_kw)
  out = result.tokens[0]
  tree = (args.steps, args.topk, args.steps + 1 if args.topk == 1 else draft_tokens)
  report = {
      "tree": {"steps": tree[0], "topk": tree[1], "draft_tokens": tree[2]},
      "output_ids": out,
      "text": codec.decode(out) if codec else None,
      "accept_length_mean": result.stats["accept_length_mean"],
      "acceptance_per_position": result.stats["acceptance_per_position"],
      "accept_length_recorded": result.stats.get("accept_length_recorded"),
      "tokens_per_s": result.stats["tokens_per_s"],
  }
  if args.baseline:
    eagle3jax.generate(target, None, [prompt], **kw)  # compile
    # One run is a fraction of a second, and this machine's speed drifts: time speculative
    # and autoregressive decoding alternately, TIMING_RUNS times each, and keep each one's
    # best (timing noise only ever slows a run down).
    spec_tps, base_tps = [result.stats["tokens_per_s"]], []
    for i in range(TIMING_RUNS):
      base = eagle3jax.generate(target, None, [prompt], **kw)
      base_tps.append(base.stats["tokens_per_s"])
      if i + 1 < TIMING_RUNS:
        spec_tps.append(eagle3jax.generate(target, drafter, [prompt], **kw,
                                           **spec_kw).stats["tokens_per_s"])
    report["tokens_per_s"] = max(spec_tps)
    report["baseline_tokens_per_s"] = max(base_tps)
    report["speedup"] = report["tokens_per_s"] / report["baseline_tokens_per_s"]
    report["matches_baseline"] = (base.tokens[0] == out) if args.temperature == 0 else None
  if not main:
    return 0
  if args.json:
    print(json.dumps(report))
    return 0
  print("\n")
  recorded = report["accept_length_recorded"]
  if recorded is None:
    recorded = "not recorded"
  elif args.temperature == 0:
    recorded = f"{recorded:.2f} (drafter's greedy record, this tree)"
  else:  # the record is greedy; sampled acceptance is not comparable with it
    recorded = (f"{recorded:.2f} (drafter's greedy record, this tree; not comparable with "
                f"this run's sampling at temperature {args.temperature:g})")
  rows = [("tree", f"({tree[0]}, {tree[1]}, {tree[2]}) (steps, topk, draft tokens)"),
          ("new tokens", len(out)), ("rounds", result.stats["rounds"]),
          ("accept length (mean)", "no round ran" if report["accept_length_mean"] is None
           else f"{report['accept_length_mean']:.2f}"),
          ("accept length (held-out)", recorded),
          ("acceptance per position",
           " ".join(f"{a:.2f}" for a in report["acceptance_per_position"] or [])),
          ("tokens/s", f"{report['tokens_per_s']:.1f}")]
  if args.baseline:
    rows += [("baseline tokens/s", f"{report['baseline_tokens_per_s']:.1f}"),
             ("speedup", f"{report['speedup']:.2f}x"),
             ("matches baseline", "not compared (sampling)" if report["matches_baseline"]
              is None else report["matches_baseline"])]
  for name, value in rows:
    print(f"{name:<26}{value}")
  return 0
