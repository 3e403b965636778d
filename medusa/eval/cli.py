"""The measuring commands: `medusa bench`, `medusa eval` and `medusa crossover`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from medusa.decoding.target.hardware import DTYPE_CHOICES
from medusa.errors import MedusaError
from medusa.eval import bench
from medusa.eval.config import load_config
from medusa.eval.costmodel import analytic_speedup, expected_accepted, pays, predict
from medusa.eval.evaluate import evaluate, finish_from_partial
from medusa.io import read_json
from medusa.runtime.args import int_list


def add_parser(subparsers) -> None:
    bench.add_parser(subparsers)
    e = subparsers.add_parser("eval", help="compare plain, Medusa, draft-model, lookup and HF decoding")
    e.add_argument("--config", default=None, help="evaluation YAML, e.g. configs/eval/mtbench.yaml")
    e.add_argument("--out", required=True, help="output directory (report.json, report.md, plots)")
    e.add_argument("--max-prompts", type=int, default=None)
    e.add_argument("--batch-sizes", type=int_list, default=None, help="e.g. 1,4,16")
    e.add_argument("--max-new-tokens", type=int, default=None)
    e.add_argument("--repeats", type=int, default=None)
    e.add_argument("--model", default=None)
    e.add_argument("--heads", default=None)
    e.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, metavar="{auto,bf16,fp16,fp32}")
    e.add_argument("--device", default=None)
    e.add_argument("--temperature", type=float, default=None, help="sample at this temperature (0: greedy)")
    e.add_argument("--acceptance", default=None, choices=["rejection", "typical"],
                   help="how sampled speculation accepts candidates")
    e.add_argument("--batch-invariant", default=None, choices=["on", "off"],
                   help="decode batch-invariantly (bf16 reports then list 0 greedy mismatches); default: the "
                        "config's batch_invariant, off")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--from-partial", default=None, metavar="PARTIAL_JSON",
                   help="finish an interrupted evaluation: report (and cost model) from its partial.json")
    e.set_defaults(func=cmd_eval)

    c = subparsers.add_parser("crossover", help="recommended decoding regime per batch size")
    c.add_argument("--cost-model", default=None, help="cost-model JSON written by `medusa eval`")
    c.add_argument("--target-ms", type=_float_list, default=None,
                   help="target decode-step latency (ms), one value or one per --batch-sizes entry")
    c.add_argument("--draft-ms", type=_float_list, default=None, help="draft decode-step latency (ms), same")
    c.add_argument("--verify-ms", type=_float_list, default=None,
                   help="target latency of a K+1-token pass (default: --target-ms, the textbook assumption)")
    c.add_argument("--alpha", type=float, default=None, help="per-token acceptance rate of the draft")
    c.add_argument("--k", type=int_list, default=None, help="draft length(s); several: pick the best")
    c.add_argument("--batch-sizes", type=int_list, default=None)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_crossover)


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def cmd_eval(args: argparse.Namespace) -> int:
    overrides = {"max_prompts": args.max_prompts, "batch_sizes": args.batch_sizes,
                 "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "model": args.model,
                 "heads": args.heads, "dtype": args.dtype, "device": args.device,
                 "temperature": args.temperature, "acceptance": args.acceptance,
                 "batch_invariant": None if args.batch_invariant is None else args.batch_invariant == "on"}
    cfg = load_config(args.config, overrides)
    if args.from_partial:
        report = finish_from_partial(cfg, Path(args.out), Path(args.from_partial), progress=not args.no_progress)
    else:
        report = evaluate(cfg, Path(args.out), progress=not args.no_progress)
    print(f"wrote {Path(args.out) / 'report.json'} and report.md ({len(report['results'])} runs)")
    bad = [r for r in report["results"] if r["greedy_mismatches"]]
    for r in bad:
        print(f"warning: {r['method']} bs={r['batch_size']}: {r['greedy_mismatches']} outputs differ from plain")
    return 0


def cmd_crossover(args: argparse.Namespace) -> int:
    if args.cost_model:
        return _crossover_from_file(args)
    missing = [f for f, v in (("--target-ms", args.target_ms), ("--draft-ms", args.draft_ms),
                              ("--alpha", args.alpha), ("--k", args.k)) if v is None]
    if missing:
        raise MedusaError(f"give --cost-model FILE, or all of --target-ms, --draft-ms, --alpha, --k "
                          f"(missing {', '.join(missing)})")
    sizes = args.batch_sizes or ([1] if len(args.target_ms) == 1 else list(range(1, len(args.target_ms) + 1)))
    target = _per_batch(args.target_ms, sizes, "--target-ms")
    draft = _per_batch(args.draft_ms, sizes, "--draft-ms")
    verify = _per_batch(args.verify_ms, sizes, "--verify-ms") if args.verify_ms else target
    if any(v <= 0 for v in target + verify) or any(v < 0 for v in draft):
        raise MedusaError("--target-ms / --verify-ms must be positive and --draft-ms non-negative")
    rows = []
    for b, t, d, v in zip(sizes, target, draft, verify):
        # Generalised: S = E * t / (v + K d); with v = t it is exactly E / (1 + K c).
        by_k = {k: (analytic_speedup(args.alpha, k, d / t) if v == t
                    else expected_accepted(args.alpha, k) * t / (v + k * d)) for k in args.k}
        k = max(by_k, key=lambda kk: (by_k[kk], -kk))
        rows.append({"batch_size": b, "draft": by_k[k], "best_k": k, "c": d / t,
                     "regime": "draft" if pays(by_k[k]) else "plain"})
    cross = next((r["batch_size"] for r in rows if r["regime"] == "plain"), None)
    return _print_crossover(rows, {"draft": cross}, args.json)


def _crossover_from_file(args: argparse.Namespace) -> int:
    path = Path(args.cost_model)
    data = read_json(path, "--cost-model")
    data = data.get("cost_model", data)  # a whole report.json works too
    if "latency_ms" not in data:
        raise MedusaError(f"--cost-model: {path} has no 'latency_ms' (write it with `medusa eval`)")
    sizes = args.batch_sizes or sorted(int(b) for b in data.get("predicted", {})) or [1, 2, 4, 8, 16, 32, 64]
    by_method = data.get("predicted_by_method") or {}  # an evaluation's runs, each method predicted from its own
    model = predict(dict(data), sizes)
    rows = [{"batch_size": b, "heads": model["predicted"][str(b)].get("heads"),
             "draft": model["predicted"][str(b)].get("draft"),
             "best_tree": model["best_tree"].get(str(b)), "best_k": model["best_k"].get(str(b)),
             "regime": model["recommendation"][str(b)]} for b in sizes]
    if not by_method:
        return _print_crossover(rows, model["crossover"], args.json)
    # The evaluation's own per-method predictions and recommendation stand: the latency curve alone
    # would drop what its runs measured (host time, tree sizes as run, auto mode's plans).
    for row in rows:
        b = str(row["batch_size"])
        saved = (data.get("predicted") or {}).get(b, {})
        row.update(heads=saved.get("heads", saved.get("medusa")), draft=saved.get("draft"), methods=by_method.get(b, {}), regime=data.get("recommendation", {}).get(b, row["regime"]),
                   fastest=(data.get("fastest") or {}).get(b, {}).get("predicted"))
    return _print_crossover(rows, data.get("crossover_by_method") or {}, args.json)


def _per_batch(values: list[float], sizes: list[int], flag: str) -> list[float]:
    if len(values) == 1:
        return values * len(sizes)
    if len(values) != len(sizes):
        raise MedusaError(f"{flag}: {len(values)} values for {len(sizes)} batch sizes")
    return values


def _print_crossover(rows: list[dict], cross: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"rows": rows, "crossover": cross}))
        return 0
    fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else "-"  # noqa: E731
    if any("methods" in r for r in rows):
        names = list(dict.fromkeys(n for r in rows for n in r["methods"]))
        print(f"{'batch':>6} " + " ".join(f"{n:>{max(len(n), 6)}}" for n in names) + "  fastest  regime")
        for r in rows:
            print(f"{r['batch_size']:>6} " + " ".join(f"{fmt(r['methods'].get(n)):>{max(len(n), 6)}}"
                                                      for n in names) + f"  {r['fastest']}  {r['regime']}")
    else:
        print(f"{'batch':>6} {'heads S':>9} {'draft S':>8} {'best K':>6} {'best tree':>10}  regime")
        for r in rows:
            print(f"{r['batch_size']:>6} {fmt(r.get('heads')):>9} {fmt(r.get('draft')):>8} "
                  f"{str(r.get('best_k') or '-'):>6} {str(r.get('best_tree') or '-'):>10}  {r['regime']}")
    for name, b in cross.items():
        print(f"{name} stops paying at batch size {b}" if b else f"{name} pays at every batch size listed")
    return 0
