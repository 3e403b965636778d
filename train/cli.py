"""`medusa distill` and `medusa train` subcommands."""

from __future__ import annotations

import argparse

from .config import load_config


def add_parser(subparsers) -> None:
    d = subparsers.add_parser("distill", help="have the target answer training prompts (resumable)")
    d.add_argument("--config", required=True, help="training YAML (its data section is used)")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. data.limit=256 (repeatable)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_distill)

    t = subparsers.add_parser("train", help="train Medusa heads (also under torchrun / deepspeed)")
    t.add_argument("--config", required=True, help="training YAML, e.g. configs/train/smollm2-medusa1.yaml")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. optim.lr=3e-4 (repeatable)")
    t.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    t.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config (overrides the config key)")
    t.add_argument("--eval-only", action="store_true", help="evaluate the latest checkpoint and write trees")
    t.add_argument("--prepare-only", action="store_true", help="build the hidden-state cache and stop")
    t.set_defaults(func=cmd_train)


def cmd_distill(args: argparse.Namespace) -> int:
    from .distill import run_distill

    cfg = load_config(args.config, args.set)
    out = run_distill(cfg, show_progress=not args.no_progress)
    print(f"distilled dataset: {out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .trainer import run_training

    overrides = list(args.set) + ([f"deepspeed={args.deepspeed}"] if args.deepspeed else [])
    cfg = load_config(args.config, overrides)
    result = run_training(cfg, eval_only=args.eval_only, prepare_only=args.prepare_only)
    if args.prepare_only:
        print(f"hidden states cached for {', '.join(result['prepared'])}")
        return 0
    if result.get("rank", 0) == 0:
        print(f"heads: {result['heads_dir']}")
        for k, acc in enumerate(result.get("accuracy", [])):
            print(f"head {k}: top-1 {acc[0]:.3f}  top-5 {acc[min(4, len(acc) - 1)]:.3f}")
    return 0
