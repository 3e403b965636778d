"""`medusa` command line: generate, bench (and the subcommands other packages register)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

from medusa.errors import MedusaError
from medusa.runtime.auto import describe_auto
from medusa.runtime.args import add_model_args, add_sampling_args, sampling_from_args
from medusa.runtime.proposers import MERGEABLE, SPECS, ProposerSpec

# Subcommands that live elsewhere register themselves through `add_parser(subparsers)`.
EXTERNAL_COMMANDS = ["medusa.eval.cli", "medusa.runtime.calibrate", "medusa.train.datastore", "medusa.train.cli",
                     "medusa.serve.cli"]


# The distribution's name (pyproject.toml); the package it installs is `medusa`.
DISTRIBUTION = "medusa-decoding"


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medusa", description="Self-speculative decoding with Medusa heads")
    # The deepspeed launcher puts `--local_rank=N` before the subcommand; the rank's device comes from
    # the LOCAL_RANK variable every launcher sets (medusa.train.dist.rank_device), so the flag is only accepted.
    parser.add_argument("--local_rank", "--local-rank", dest="launcher_local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate text for one or more prompts (batched)")
    g.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    add_model_args(g)
    g.add_argument("--mode", default="auto", metavar="MODE",
                   help="auto (default): speculate where this machine's calibrated pass costs and the heads' "
                        "accuracy predict a gain, and while measured steps confirm it; heads: the heads always; "
                        "retrieval: drafts from the text itself (prompt and output so far) always, no heads needed; "
                        "heads+retrieval: both in one tree; plain: never; also feature[:DIR], draft[:PATH], "
                        f"lookup[:K] (all: {SPECS})")
    g.add_argument("--retrieval", default="on", choices=["on", "off"],
                   help="auto mode drafts from the text itself too (merged into feature heads' trees, or alone "
                        "without heads); off: heads alone")
    g.add_argument("--datastore", default=None, help="retrieval also drafts from this corpus (`medusa datastore "
                   "build`)")
    g.add_argument("--tree", default=None, help="with --mode heads: tree file or name (tree-8/16/32/64), or a "
                   "per-row dynamic tree dynamic-N[xD[xK]] (N nodes, D draft steps, top-K; feature heads take only these)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_args(g)
    g.add_argument("--raw", action="store_true", help="use prompts as raw text, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.set_defaults(func=cmd_generate)

    for name in EXTERNAL_COMMANDS:
        if importlib.util.find_spec(name.split(".")[0]) and importlib.util.find_spec(name):
            importlib.import_module(name).add_parser(sub)

    args = parser.parse_args(argv)
    if args.command is None:  # a bare `medusa`: say what there is, not just that something is missing
        parser.print_help()
        return 0
    try:
        return args.func(args) or 0
    except MedusaError as exc:
        print(f"medusa {args.command}: error: {exc}", file=sys.stderr)
        return 2


def cmd_generate(args: argparse.Namespace) -> int:
    from medusa.runtime import Runtime

    if args.max_new_tokens <= 0:
        raise MedusaError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    mode = None if args.mode == "auto" else ProposerSpec.parse(args.mode)
    if args.tree is not None and (mode is None or mode.kind not in MERGEABLE):
        raise MedusaError("--tree chooses the tree of --mode heads or feature (also with +retrieval); --mode auto "
                          "picks its own")
    sampling = sampling_from_args(args)
    own_heads = mode is None or mode.kind in MERGEABLE  # the others draft without the runtime's heads
    rt = Runtime.load(args.model, args.heads if own_heads else "none", args.dtype, args.device,
                      retrieval=args.retrieval == "on", datastore=args.datastore,
                      batch_invariant=args.batch_invariant == "on")
    prompts = rt.encode(args.prompt, raw=args.raw)
    started, passes = time.perf_counter(), rt.model.passes
    auto = rt.auto(len(prompts)) if mode is None else None  # loads this machine's curve (measures it once)
    calibrated, calibration_passes = time.perf_counter(), rt.model.passes - passes
    proposer = rt.proposer(mode, args.tree) if mode is not None else None
    if mode is None:
        print(describe_auto(rt, auto, len(prompts)), file=sys.stderr)
    planned = time.perf_counter()
    gen = rt.engine.generate(prompts, args.max_new_tokens, proposer, sampling, policy=auto)
    choosing = auto.choosing_seconds if auto is not None else 0.0
    stats = {"mode": gen.mode, "dtype": rt.dtype.name, "acceptance": sampling.acceptance if not sampling.greedy else "greedy",
             "batch_size": len(prompts), "new_tokens": gen.stats.new_tokens,
             # every target pass the call ran: decoding's, and calibration's timing passes (`overhead`)
             "forward_passes": rt.model.passes - passes, "mean_accepted": round(gen.stats.mean_accepted, 4),
             "tokens_per_s": round(gen.tokens_per_s, 2), "seconds": round(gen.seconds, 3),
             # outside `seconds`: calibrating (loading or measuring the pass-cost curve) and the first plan;
             # inside it: choosing each step (planning for new batch sizes, building proposers)
             "overhead": {"calibration_s": round(calibrated - started, 3), "calibration_passes": calibration_passes,
                          "planning_s": round(planned - calibrated + choosing, 3),
                          "planning_in_decoding_s": round(choosing, 3)}}
    if proposer is not None:
        stats["tree"] = proposer.tree.name
    if proposer is not None or auto is not None:
        stats["acceptance_by_head"] = [round(a, 4) for a in gen.stats.acceptance_by_head()]
    if mode is None:
        stats["auto"] = {"machine": rt.machine.to_dict(),
                         "plan": auto.plan(len(prompts)).to_dict() if auto is not None else None,
                         "steps": auto.steps if auto is not None else {"plain": gen.stats.steps},
                         "gate": auto.events if auto is not None else []}
    outputs = [{"text": rt.decode(o.tokens), "token_ids": o.tokens, "finish_reason": o.reason}
               for o in gen.outputs]
    if args.json:
        print(json.dumps({"outputs": outputs, "stats": stats}))
        return 0
    for i, o in enumerate(outputs):
        print(f"--- [{i}] ({len(o['token_ids'])} tokens, {o['finish_reason']})\n{o['text']}")
    print("--- stats: " + ", ".join(f"{k}={v}" for k, v in stats.items()))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
