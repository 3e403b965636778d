"""`medusa` command line: generate, bench (and the subcommands other packages register)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys

from .errors import MedusaError
from .hardware import DTYPE_CHOICES

# Subcommands that live elsewhere register themselves through `add_parser(subparsers)`.
EXTERNAL_COMMANDS = ["medusa.bench", "medusa.calibrate", "medusa.evaluate", "train.cli", "serve.cli"]


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct), a model "
                   "directory, a .gguf file or a hub id")
    p.add_argument("--heads", default="default", help="heads directory (Medusa heads, or feature heads: ours or an "
                   "EAGLE-1/EAGLE-3 layout), 'default' (shipped), 'feature' (shipped feature heads) or 'none'")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="{auto,bf16,fp16,fp32}",
                   help="auto (default): bf16 where the hardware multiplies it natively, fp32 elsewhere")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--acceptance", default=None, choices=["greedy", "rejection", "typical"],
                   help="how speculative candidates are accepted when sampling (default: rejection, "
                        "lossless; greedy when temperature is 0)")
    p.add_argument("--typical-epsilon", type=float, default=0.3)
    p.add_argument("--typical-delta", type=float, default=0.09)


def sampling_from_args(args: argparse.Namespace):
    from .sampling import SamplingParams

    acceptance = args.acceptance or ("greedy" if args.temperature == 0 else "rejection")
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              acceptance=acceptance, typical_epsilon=args.typical_epsilon,
                              typical_delta=args.typical_delta)
    except MedusaError as exc:
        raise MedusaError(f"--{str(exc).split()[0].replace('_', '-')}: {exc}") from None


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("medusa")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medusa", description="Self-speculative decoding with Medusa heads")
    # The deepspeed launcher puts `--local_rank=N` before the subcommand; the rank's device comes from
    # the LOCAL_RANK variable every launcher sets (train.trainer.rank_device), so the flag is only accepted.
    parser.add_argument("--local_rank", "--local-rank", dest="launcher_local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate text for one or more prompts (batched)")
    g.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    add_model_args(g)
    g.add_argument("--mode", default="auto", choices=["auto", "plain", "medusa"],
                   help="auto (default): speculate where this machine's calibrated pass costs and the heads' "
                        "accuracy predict a gain, and while measured steps confirm it; medusa: always; plain: never")
    g.add_argument("--tree", default=None, help="with --mode medusa: tree file or name (tree-8/16/32/64), or a "
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
    from .runtime import Runtime

    if args.max_new_tokens <= 0:
        raise MedusaError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.tree is not None and args.mode != "medusa":
        raise MedusaError("--tree chooses the tree of --mode medusa; --mode auto picks its own")
    sampling = sampling_from_args(args)
    rt = Runtime.load(args.model, "none" if args.mode == "plain" else args.heads, args.dtype, args.device)
    prompts = rt.encode(args.prompt, raw=args.raw)
    auto = rt.auto(len(prompts)) if args.mode == "auto" else None
    proposer = rt.proposer(args.mode, args.tree) if args.mode != "auto" else None
    if args.mode == "auto":
        print(describe_auto(rt, auto, len(prompts)), file=sys.stderr)
    gen = rt.engine.generate(prompts, args.max_new_tokens, proposer, sampling, policy=auto)
    stats = {"mode": gen.mode, "dtype": rt.dtype.name, "acceptance": sampling.acceptance if not sampling.greedy else "greedy",
             "batch_size": len(prompts), "new_tokens": gen.stats.new_tokens,
             "forward_passes": gen.stats.forward_passes, "mean_accepted": round(gen.stats.mean_accepted, 4),
             "tokens_per_s": round(gen.tokens_per_s, 2), "seconds": round(gen.seconds, 3)}
    if proposer is not None:
        stats["tree"] = proposer.tree.name
    if proposer is not None or auto is not None:
        stats["acceptance_by_head"] = [round(a, 4) for a in gen.stats.acceptance_by_head()]
    if args.mode == "auto":
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


def describe_auto(rt, auto, batch_size: int) -> str:
    """One line: the machine, and what auto mode will do at this batch size and why."""
    where = rt.machine.describe()
    if auto is None:
        return f"medusa: auto mode on {where}: plain decoding (no heads for this model)"
    p = auto.plan(batch_size)
    what = f"Medusa with {p.tree.name} ({p.tree.size} tokens per pass)" if p.tree is not None else "plain decoding"
    return f"medusa: auto mode on {where}, batch size {batch_size}: {what}; {p.reason}"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
