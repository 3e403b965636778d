"""The pass-cost curve on a GPU, and where each kind of speculation stops paying there.

    python benchmarks/gpu_curve.py            # a CUDA machine: ~1.1B Llama in bf16, B 1..256 x T 1..64
    python benchmarks/gpu_curve.py --tiny     # any machine, seconds: a small model and a few points

The target is memory-bound at small batch sizes: a Llama of about 1.1B parameters (hidden 2048, 16
layers, 32 query / 8 KV heads, intermediate 5632, vocabulary 32000) built on the device with random
weights (a pass costs the same whatever the weights hold), run through medusa's own Transformer. For every
batch size B and tokens per row T, `medusa.runtime.timing.measure_forward` times one target pass with the full
vocabulary projection after a 256-token prefix (fastest of `--repeats` rounds, as calibration does).
Beside it, at the same batch sizes:

- Medusa heads (4 heads x 1 residual layer over the shared lm_head): `measure_heads`, as calibration;
- a feature head (EAGLE-style, one decoder layer of the target's shape, a `--feature-vocab` draft
  vocabulary): one draft pass over 2 and over top-k entries per row (`medusa.runtime.timing.draft_pass_ms`);
- an external draft model: the target's first `--draft-layers` layers with a `--draft-vocab` projection.

Predicted speedup over plain decoding at each B, from the acceptance measured on the embedded model
(`--eval-json`, the evaluator's report: Medusa's tau per tree, the draft's tau and K) and, for feature
heads, `--feature-tau` (default 2.0: the order the public record gives for EAGLE-3 heads on small targets,
~2.0-2.2; ours are not measured yet):

    Medusa:  tau * pass(B, 1) / (pass(B, tree size) + heads(B))
    feature: tau * pass(B, 1) / (pass(B, nodes + 1) + draft(B, 2) + (depth - 1) * draft(B, top-k))
    draft:   tau * pass(B, 1) / (pass(B, K + 1) + draft(B, 2) + (K - 1) * draft(B, 1))

The crossover is the smallest measured B where the prediction is no longer above 1 (null: it pays at
every B measured). Writes JSON to `--out` (default `$OUT/gpu_curve.json`, `$OUT` defaulting to
benchmarks/results/) and prints the table. `--budget-s` bounds the wall clock: batch sizes are measured in
increasing order and the ones the budget leaves out are listed in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TARGET = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
TOKENS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64]
EVAL_JSON = REPO / "benchmarks" / "results" / "eval-mtbench-final.json"
FEATURE_TAU = 2.0


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from medusa.decoding.target.hardware import TORCH_DTYPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small model and a few grid points (runs on CPU)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu (with --tiny)")
    p.add_argument("--dtype", default=None, choices=list(TORCH_DTYPES), help="default: bf16 (fp32 with --tiny)")
    p.add_argument("--batch-sizes", type=int_list, default=None, help=f"default {BATCH_SIZES} (--tiny: 1,2,4)")
    p.add_argument("--tokens", type=int_list, default=None,
                   help=f"tokens per row, default {TOKENS} (--tiny: 1,2,4); the sizes the predictions need "
                        "are always added")
    p.add_argument("--prefix", type=int, default=None, help="cached tokens per row (default 256, --tiny 16)")
    p.add_argument("--repeats", type=int, default=None, help="rounds per point, fastest kept (default 5, --tiny 1)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="wall-clock budget for the measurements; batch sizes past it are skipped (default 300)")
    p.add_argument("--eval-json", type=Path, default=EVAL_JSON,
                   help="the evaluator's report with Medusa's and the draft's measured tau (default: %(default)s)")
    p.add_argument("--feature-tau", type=float, default=FEATURE_TAU,
                   help="feature heads' tokens per step (default %(default)s: the public record's order for "
                        "EAGLE-3 heads on small targets; not measured on the embedded model yet)")
    p.add_argument("--feature-shape", default="dynamic-16x5",
                   help="feature heads' dynamic tree, dynamic-NxD[xK] (default %(default)s: 16 nodes, 5 steps, top-4)")
    p.add_argument("--feature-vocab", type=int, default=8192, help="feature head draft vocabulary (default 8192)")
    p.add_argument("--draft-layers", type=int, default=2,
                   help="external draft: the target's first N layers (default 2, about the share of the "
                        "embedded model's 4-of-30-layer draft)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="external draft vocabulary (default 8192)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default $OUT/gpu_curve.json, or gpu_curve_tiny.json with --tiny)")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cpu" and not tiny:
        p.error("no CUDA device: the full curve (a 1.1B model, up to 256 x 64 tokens a pass) is for a GPU; "
                "use --tiny to run the same code on the CPU")
    args.dtype = args.dtype or ("fp32" if tiny else "bf16")
    args.batch_sizes = sorted(set(args.batch_sizes or ([1, 2, 4] if tiny else BATCH_SIZES)))
    args.tokens = sorted(set(args.tokens or ([1, 2, 4] if tiny else TOKENS)))
    args.prefix = args.prefix or (16 if tiny else 256)
    args.repeats = args.repeats or (1 if tiny else 5)
    if args.out is None:
        out_dir = Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
        args.out = out_dir / ("gpu_curve_tiny.json" if tiny else "gpu_curve.json")
    return args


def acceptance(path: Path) -> dict:
    """Medusa's tau per tree and the draft's (tau, K, alpha) from an evaluator report's cost model."""
    try:
        report = json.loads(path.read_text())
        acc = report["cost_model"]["acceptance"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"gpu_curve: --eval-json {path}: no evaluator acceptance there ({exc})") from None
    medusa = {name: {"tau": t["tau"], "tree_size": t["tree_size"]} for name, t in (acc.get("heads") or acc.get("medusa") or {}).items()}
    draft = acc.get("draft")
    if not medusa or not draft:
        raise SystemExit(f"gpu_curve: --eval-json {path}: needs Medusa and draft acceptance")
    source = {"file": str(path), "model": report.get("model"), "dtype": report.get("dtype"),
              "device": report.get("device"), "prompts": report.get("prompts")}
    return {"medusa": medusa, "draft": {k: draft[k] for k in ("tau", "k", "alpha")}, "source": source}


def build_llama(config: dict, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**config, max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def machine(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                "torch": torch.__version__}
    from medusa.decoding.target.hardware import cpu_name

    return {"device": "cpu", "name": cpu_name() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


def measure(args, acc: dict, shape) -> dict:
    from medusa.runtime.timing import measure_forward, measure_heads
    from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
    from medusa.decoding.proposers.feature_proposer import HeadRunner
    from medusa.runtime.timing import draft_pass_ms
    from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
    from medusa.decoding.target.hardware import TORCH_DTYPES
    from medusa.decoding.target.transformer import Transformer

    dtype, dev = TORCH_DTYPES[args.dtype], args.device
    start = time.perf_counter()
    config = TINY if args.tiny else TARGET
    hf = build_llama(config, dtype, dev)
    target = Transformer(hf)
    params = sum(p.numel() for p in hf.parameters())
    needed = {t["tree_size"] for t in acc["medusa"].values()} | {acc["draft"]["k"] + 1, shape.nodes + 1}
    tokens = sorted(set(args.tokens) | needed | {1})
    grid, done, skipped, notes = [], [], [], []
    for b in args.batch_sizes:
        if done and time.perf_counter() - start > args.budget_s:  # the smallest B is always measured
            skipped.append(b)
            continue
        try:
            grid += measure_forward(target, [b], tokens, args.prefix, args.repeats)
            done.append(b)
        except RuntimeError as exc:
            if not _oom(exc):
                raise
            notes.append(f"B={b}: out of memory")
            skipped.append(b)
        print(f"  target B={b:<4d} measured ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not done:
        raise SystemExit("gpu_curve: no batch size measured within the budget")
    # Medusa heads, as calibration measures them (all heads through the shared lm_head, then top-k).
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(config["hidden_size"], config["vocab_size"], 4, 1)).attach(hf)
    heads_ms = measure_heads(heads, config["hidden_size"], done, 10, dtype, dev, args.repeats)
    # A feature head of the target's shape over a reduced draft vocabulary.
    fvocab = min(args.feature_vocab, config["vocab_size"])
    with torch.device(dev):
        head = FeatureHead(FeatureHeadConfig(config["hidden_size"], config["vocab_size"], fvocab), hf,
                           draft_ids=torch.arange(fvocab))
    runner = HeadRunner(head, dtype).to(dev)
    feature_grid = [(b, t, draft_pass_ms(runner, b, t, args.prefix, args.repeats))
                    for b in done for t in sorted({2, shape.topk})]
    # An external draft: the target's shape cut to a few layers, with a reduced vocabulary.
    dconfig = {**config, "num_hidden_layers": args.draft_layers,
               "vocab_size": min(args.draft_vocab, config["vocab_size"])}
    draft = Transformer(build_llama(dconfig, dtype, dev))
    draft_grid = measure_forward(draft, done, [1, 2, 3], args.prefix, args.repeats)
    return {"parameters": params, "config": config, "draft_config": dconfig, "tokens": tokens,
            "batch_sizes": done, "skipped_batch_sizes": skipped, "notes": notes, "grid": grid,
            "heads_ms": heads_ms, "feature_grid": feature_grid, "draft_grid": draft_grid,
            "seconds": time.perf_counter() - start}


def predictions(m: dict, acc: dict, shape, feature_tau: float) -> dict:
    """Per batch size: predicted speedup of each method, the best Medusa tree, and each crossover."""
    from medusa.eval.costmodel import Latency, crossover, predict

    model = {"latency_ms": {"target": Latency(m["grid"]).to_dict(), "draft": Latency(m["draft_grid"]).to_dict(),
                            "heads": {str(b): ms for b, ms in m["heads_ms"].items()}},
             "acceptance": {"heads": acc["medusa"], "draft": acc["draft"]}}
    predict(model, m["batch_sizes"])
    target = Latency(m["grid"])
    feature = {(b, t): ms for b, t, ms in m["feature_grid"]}
    table = {}
    for b in m["batch_sizes"]:
        row = model["predicted"][str(b)]
        drafting = feature[(b, 2)] + (shape.depth - 1) * feature[(b, shape.topk)]
        table[b] = {"medusa": row["heads"], "medusa_tree": row["heads_tree"], "draft": row["draft"],
                    "feature": feature_tau * target(b, 1) / (target(b, shape.nodes + 1) + drafting),
                    "pass_ms": target(b, 1)}
    return {"speedup": {str(b): r for b, r in table.items()},
            "crossover": {k: crossover({b: r[k] for b, r in table.items()}) for k in ("medusa", "feature", "draft")},
            "cost_model": model}


def print_table(result: dict) -> None:
    grid = {(b, t): ms for b, t, ms in result["grid"]}
    show = [t for t in (2, 4, 9, 17, 32, 64) if any((b, t) in grid for b in result["batch_sizes"])]
    print(f"\n{result['machine'].get('name')}: {result['parameters'] / 1e6:.1f}M-parameter Llama, "
          f"{result['dtype']}, prefix {result['prefix']}; pass cost over T tokens per row as a multiple of a "
          f"1-token pass, and predicted speedup over plain decoding")
    head = "".join(f"{'T=' + str(t):>8s}" for t in show)
    print(f"{'B':>5s} {'1 token':>9s}{head}   {'medusa':>7s} {'feature':>8s} {'draft':>7s}")
    for b in result["batch_sizes"]:
        one = grid[(b, 1)]
        cells = "".join(f"{grid[(b, t)] / one:7.2f}x" if (b, t) in grid else f"{'':8s}" for t in show)
        s = result["speedup"][str(b)]
        print(f"{b:5d} {one:7.2f}ms{cells}   {s['medusa']:6.2f}x {s['feature']:7.2f}x {s['draft']:6.2f}x")
    cross = result["crossover"]
    print("stops paying at B = " + ", ".join(f"{k}: {v if v is not None else 'never (within the sizes measured)'}"
                                             for k, v in cross.items()))
    if result["skipped_batch_sizes"]:
        print(f"not measured (budget or memory): B = {result['skipped_batch_sizes']} {result['notes']}")


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.trees.dynamic_tree import parse_shape

    args = parse_args(argv)
    acc = acceptance(args.eval_json)
    shape = parse_shape(args.feature_shape)
    acc["feature"] = {"tau": args.feature_tau, "nodes": shape.nodes, "depth": shape.depth, "topk": shape.topk,
                      "source": "--feature-tau" if args.feature_tau != FEATURE_TAU else
                      "default: public record's order for small targets, not measured here"}
    torch.manual_seed(0)
    m = measure(args, acc, shape)
    result = {"machine": machine(args.device), "dtype": args.dtype, "tiny": args.tiny, "prefix": args.prefix,
              "repeats": args.repeats, "acceptance": acc, **m}
    result.update(predictions(m, acc, shape, args.feature_tau))
    result["grid"] = [[b, t, ms] for b, t, ms in m["grid"]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
