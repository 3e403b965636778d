"""`medusa distill`, `medusa train`, `medusa train-feature`, `medusa train-draft` and `medusa export` subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from medusa.errors import MedusaError

from medusa.train.config import apply_overrides, load_config, parse_config
from medusa.train.export import FORMATS


def add_parser(subparsers) -> None:
    d = subparsers.add_parser("distill", help="have the target answer training prompts (resumable)")
    d.add_argument("--config", default=None, help="training YAML, Medusa or feature head (its model, dtype and "
                   "data sections are used; default: the defaults, the embedded model)")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. data.limit=256 (repeatable)")
    d.add_argument("--prompts", default=None, metavar="SOURCES",
                   help="comma-separated prompt sources (data.sources): sharegpt, sharegpt-turns, a file, a hub id, "
                        "or self:N, N prompts the target writes itself, e.g. sharegpt,self:1000")
    d.add_argument("--out", default=None, metavar="DIR", help="the distilled directory (data.distill_dir)")
    d.add_argument("--self-temperature", type=_positive, default=None,
                   help="with self:N: sampling temperature of the written prompts (data.self_prompts.temperature, "
                        "default 1.0)")
    d.add_argument("--self-top-p", type=_probability, default=None,
                   help="with self:N: nucleus sampling (data.self_prompts.top_p, default 1.0)")
    d.add_argument("--self-seed", type=int, default=None, help="with self:N: seed (data.self_prompts.seed, default 0)")
    d.add_argument("--self-max-tokens", type=int, default=None,
                   help="with self:N: longest prompt written, longer ones are dropped (data.self_prompts.max_tokens, "
                        "default 128)")
    d.add_argument("--self-topics", default=None, metavar="YAML",
                   help="with self:N: a YAML list of topics or task kinds to spread the prompts over "
                        "(data.self_prompts.topics)")
    d.add_argument("--server", default=None, metavar="URL",
                   help="ask this OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI, medusa serve) for the "
                        "answers instead of running the target here; the config's model gives the tokenizer")
    d.add_argument("--concurrency", type=int, default=8, help="with --server: requests in flight (default 8)")
    d.add_argument("--server-model", default=None, help="with --server: the model id to request (default: the "
                                                         "first the server lists)")
    d.add_argument("--api-key", default=None, help="with --server: sent as a bearer token (default: "
                                                    "$OPENAI_API_KEY, else none)")
    d.add_argument("--no-progress", action="store_true")
    # Launchers (deepspeed) may pass this; the device comes from LOCAL_RANK (medusa.train.dist.rank_device).
    d.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
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

    f = subparsers.add_parser("train-feature", help="train a feature head (EAGLE-style; resumable: re-run to continue; "
                                                    "also under torchrun / deepspeed / accelerate launch)")
    f.add_argument("--config", required=True, help="training YAML, e.g. configs/feature/smollm2-feature.yaml")
    f.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    f.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config, e.g. configs/deepspeed/zero2.json "
                                                     "(overrides the config key; used with several processes)")
    f.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. loss.unroll=2 (repeatable)")
    f.add_argument("--prepare-only", action="store_true", help="extract and cache the target's features, then stop")
    f.add_argument("--evaluate", metavar="HEAD_DIR", help="measure this head on the config's held-out split "
                                                          "(eval_steps draft steps) and rewrite its eval.json")
    f.add_argument("--resume", metavar="PATH", help="start from this checkpoint (or run directory's latest) when "
                                                    "the run has none of its own, e.g. one made on another machine")
    f.add_argument("--no-progress", action="store_true")
    f.set_defaults(func=cmd_train_feature)

    add_train_draft_parser(subparsers)

    e = subparsers.add_parser("export", help="copy a run's heads with their trees and eval.json to a directory, "
                                             "or make them the shipped heads; write the target for other loaders")
    e.add_argument("--heads", default=None, help="a run's heads directory (e.g. runs/smollm2-medusa1/heads), a hub "
                   "id, or the shipped heads as every command names them: 'default' (the shipped heads that "
                   "measured fastest), 'medusa' or 'feature'")
    where = e.add_mutually_exclusive_group()
    where.add_argument("--out", help="destination directory (created, or replaced atomically)")
    where.add_argument("--to-shipped", action="store_true",
                       help="replace the shipped Medusa heads (what --heads medusa loads); refused if these "
                            "measure worse")
    e.add_argument("--format", default="native", choices=sorted(FORMATS),
                   help="output layout (default: native, ours); vllm: vLLM's Medusa checkpoint; medusa: "
                        "FasterDecoding's medusa_lm_head.pt; eagle|eagle3: SafeAILab/EAGLE's (feature heads)")
    e.add_argument("--model", default=None, help="with --format vllm|medusa: the target model whose lm_head "
                   "they store (default: the one the heads record); with --base-model: the model to write "
                   "(default: the embedded one)")
    e.add_argument("--base", default=None, help="with --format vllm|medusa: base_model_name_or_path in their "
                   "config.json (default: the hub id of the embedded model, the absolute folder of a local one, "
                   "the --base-model folder when one is written)")
    e.add_argument("--base-model", default=None, metavar="DIR", help="also (or only) write a copy of the target "
                   "model to DIR in a layout transformers 4.x reads (for FasterDecoding's and SafeAILab/EAGLE's "
                   "loaders)")
    e.add_argument("--force", action="store_true", help="with --to-shipped: replace even if these measure worse")
    e.set_defaults(func=cmd_export)


def add_train_draft_parser(subparsers) -> None:
    t = subparsers.add_parser("train-draft", help="build a small draft model from the target's first layers")
    t.add_argument("--model", default="default")
    t.add_argument("--layers", type=int, default=4, help="how many of the target's first layers to keep")
    t.add_argument("--data", default=None, help="distilled dataset directory (`medusa distill`); default: "
                   "the training config's, else distil --distill-prompts prompts here")
    t.add_argument("--distill-prompts", type=int, default=128)
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--vocab", type=int, default=8192, help="score only this many token ids (the data's most "
                   "frequent; 0: the whole vocabulary): a full-vocabulary projection dominates a small draft")
    t.add_argument("--out", default=None, help="output directory (default: medusa/assets/draft)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from medusa.train.draft import train_draft

    out = train_draft(model=args.model, layers=args.layers, data=args.data, distill_prompts=args.distill_prompts,
                      steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      out=args.out, progress=not args.no_progress, vocab=args.vocab)
    print(f"draft model: {out}")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    import os
    import sys

    from medusa.io import read_yaml
    from medusa.train.distill import run_distill
    from medusa.train.feature import load_feature_config

    overrides = list(args.set) + distill_overrides(args)
    if args.config is None:
        cfg = parse_config(apply_overrides({"dtype": "auto"}, overrides), "medusa distill")  # auto resolved
    else:
        feature = "head" in read_yaml(args.config)
        cfg = (load_feature_config if feature else load_config)(args.config, overrides)
    if int(os.environ.get("RANK", "0")) > 0:
        # Distillation runs in one process; under a launcher the other ranks would repeat its work.
        print(f"medusa distill: rank {os.environ['RANK']} has nothing to do (rank 0 distils)", file=sys.stderr)
        return 0
    if args.server is None and (args.server_model or args.api_key):
        raise MedusaError("--server-model and --api-key go with --server")
    out = run_distill(cfg, show_progress=not args.no_progress, server=args.server, concurrency=args.concurrency,
                      api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), server_model=args.server_model)
    print(f"distilled dataset: {out}")
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def distill_overrides(args: argparse.Namespace) -> list[str]:
    """`medusa distill`'s own flags as config overrides (values in JSON, which YAML reads alike)."""
    import json

    from medusa.train.config import self_count

    out = {}
    if args.prompts is not None:
        sources = [s.strip() for s in args.prompts.split(",") if s.strip()]
        if not sources:
            raise MedusaError("--prompts: name at least one source, e.g. sharegpt or self:1000")
        for s in sources:
            if s.startswith("self") and not Path(s).exists() and (self_count(s) or 0) < 1:
                raise MedusaError(f"--prompts: {s!r}: write self:N with N a positive number, e.g. self:1000")
        out["data.sources"] = sources
    if args.self_topics is not None and not Path(args.self_topics).is_file():
        raise MedusaError(f"--self-topics: {args.self_topics}: no such file")
    if args.self_max_tokens is not None and args.self_max_tokens < 1:
        raise MedusaError(f"--self-max-tokens: must be at least 1, got {args.self_max_tokens}")
    for flag, key in (("out", "data.distill_dir"), ("self_temperature", "data.self_prompts.temperature"),
                      ("self_top_p", "data.self_prompts.top_p"), ("self_seed", "data.self_prompts.seed"),
                      ("self_max_tokens", "data.self_prompts.max_tokens"), ("self_topics", "data.self_prompts.topics")):
        if getattr(args, flag) is not None:
            out[key] = getattr(args, flag)
    return [f"{k}={json.dumps(v)}" for k, v in out.items()]


def cmd_train(args: argparse.Namespace) -> int:
    from medusa.train.trainer import run_training

    overrides = list(args.set) + ([f"deepspeed={args.deepspeed}"] if args.deepspeed else [])
    cfg = load_config(args.config, overrides)
    result = run_training(cfg, eval_only=args.eval_only, prepare_only=args.prepare_only)
    if args.prepare_only:
        print(f"hidden states cached for {', '.join(result['prepared'])}")
        return 0
    if result.get("rank", 0) == 0:
        print(summary(result))
    return 0


def cmd_train_feature(args: argparse.Namespace) -> int:
    from medusa.train.feature import evaluate_saved, load_feature_config, run_feature_training

    cfg = load_feature_config(args.config, args.set + ([f"resume_from={args.resume}"] if args.resume else [])
                              + ([f"deepspeed={args.deepspeed}"] if args.deepspeed else []))
    if args.evaluate:
        if not (Path(args.evaluate) / "heads.json").is_file():
            raise MedusaError(f"--evaluate: {args.evaluate} holds no feature head (no heads.json)")
        report = evaluate_saved(cfg, args.evaluate)
        print(f"{args.evaluate}/eval.json: held-out top-1 per draft step: "
              + ", ".join(f"{a:.3f}" for a in report.get("top1", [])))
        return 0
    result = run_feature_training(cfg, progress=not args.no_progress, prepare_only=args.prepare_only)
    if "head_dir" not in result and not args.prepare_only:
        return 0  # a rank other than 0: rank 0 reports
    if args.prepare_only:
        print(f"features cached: {result['sequences']} sequences, {result['positions']} label positions")
        return 0
    top1 = ", ".join(f"{a:.3f}" for a in result["eval"].get("top1", []))
    print(f"feature head: {result['head_dir']} (step {result['step']}, {result['trained_tokens']} trained positions; "
          f"held-out top-1 per draft step: {top1})\nuse it:  medusa generate --heads {result['head_dir']} "
          f"--prompt \"...\"")
    return 0


def summary(result: dict) -> str:
    """Where the run wrote everything, held-out accuracy per head, the tau each tree expects, and how to use
    the heads."""
    from medusa.decoding.trees.tree import expected_tau
    from medusa.decoding.trees.tree import DEFAULT_TREE, load_tree

    heads, run_dir = result["heads_dir"], result["run_dir"]
    lines = [f"run {run_dir} finished at step {result.get('step')}; everything is under it:",
             f"  heads        {heads}/ (heads, eval.json, train_config.yaml, trees/)"]
    if result.get("checkpoint"):
        lines.append(f"  checkpoints  {Path(result['checkpoint']).parent}/ (latest {Path(result['checkpoint']).name})")
    for sub, what in (("hidden", "hidden cache"), ("wandb", "wandb logs")):
        if (Path(run_dir) / sub).is_dir():
            lines.append(f"  {what:<12} {Path(run_dir) / sub}/")
    if result.get("merged_model"):
        lines.append(f"  merged model {result['merged_model']}")
    acc = result.get("eval", {}).get("rank_accuracy") or []
    for k, row in enumerate(result.get("accuracy", [])):
        lines.append(f"  head {k + 1}: held-out top-1 {row[0]:.3f}  top-5 {row[min(4, len(row) - 1)]:.3f}")
    taus = [f"{Path(t).stem} {expected_tau(load_tree(t).nodes, acc):.2f}" for t in result.get("trees", [])]
    if taus:
        lines.append(f"  expected accepted length (tau) per pass: {', '.join(taus)}")
    model = result.get("merged_model") or result.get("model", "default")
    use = "medusa generate" + (f" --model {model}" if model != "default" else "") + f" --heads {heads}"
    lines.append(f"use them:  {use} --prompt \"...\"   (default tree {DEFAULT_TREE}; --tree NAME picks "
                 f"{heads}/trees/NAME.yaml)")
    lines.append(f"export:    medusa export --heads {heads} --out DIR   (or --to-shipped to replace the shipped heads)")
    return "\n".join(lines)


def cmd_export(args: argparse.Namespace) -> int:
    from medusa.train.base_model import write_base_model
    from medusa.train.export import check_heads, export, export_to_shipped, shipped_dir

    if args.heads is None and (args.out or args.to_shipped):
        raise MedusaError("--heads: name the heads to export (a directory, a hub id, default, medusa or feature)")
    if args.heads is not None and not (args.out or args.to_shipped):
        raise MedusaError("--out: name the destination directory (or pass --to-shipped)")
    if args.heads is None and args.base_model is None:
        raise MedusaError("--heads: name the heads to export with --heads and --out (or the target to write with "
                          "--base-model DIR)")
    if args.base_model is not None and args.to_shipped:
        raise MedusaError("--base-model: not with --to-shipped (the shipped heads need no copy of the target)")
    if args.base_model is not None:
        if args.heads is not None:
            check_heads(args.heads, args.format)  # heads that cannot be exported: refused before the copy
        model = args.model or _heads_target(args.heads)
        out = write_base_model(model, Path(args.base_model))
        print(f"target {model} -> {out} (a layout transformers 4.x reads)")
    if args.heads is not None and not args.to_shipped:
        src = Path(args.heads)
        base = args.base
        if base is None and args.base_model is not None and args.format in ("medusa", "vllm"):
            base = str(Path(args.base_model).expanduser().resolve())
        model = args.model if args.format in ("medusa", "vllm") else None
        if args.model is not None and model is None and args.base_model is None:
            raise MedusaError("--model: only with --format vllm|medusa or --base-model")
        out = export(args.heads, Path(args.out), args.format, model, base)
        print(f"exported {src} -> {out} ({args.format}: heads, eval.json, trees)")
    if not args.to_shipped:
        return 0
    src = Path(args.heads)
    if args.model is not None or args.base is not None:
        raise MedusaError(f"{'--model' if args.model is not None else '--base'}: only with --out and --format "
                          "vllm|medusa")
    new, old = export_to_shipped(src, force=args.force, fmt=args.format)
    print(f"shipped heads replaced: {shipped_dir()} <- {src} (tau with their default tree {_tau(new)}, "
          f"previous {_tau(old)})")
    return 0


def _heads_target(heads: str | None) -> str:
    """The target the heads were trained for (their train_config.yaml's model, else the model they record),
    else the embedded model."""
    import json

    import yaml

    from medusa.train.export import SHIPPED_KINDS

    if heads is None or heads in SHIPPED_KINDS or not Path(heads).is_dir():
        return "default"
    d = Path(heads)
    if (d / "train_config.yaml").is_file():
        model = (yaml.safe_load((d / "train_config.yaml").read_text()) or {}).get("model")
        if model:
            return str(model)
    for name in ("heads.json", "config.json"):
        try:
            info = json.loads((d / name).read_text())
        except (OSError, ValueError):
            continue
        model = info.get("base_model") or info.get("base_model_name_or_path")
        if model:
            return str(model)
    return "default"


def _tau(m) -> str:
    return f"{m.tau:.3f}" if m is not None else "unmeasured"
