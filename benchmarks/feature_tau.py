"""Measured tau (tokens per verification step), acceptance by depth and speed of feature heads on a prompt
set: MT-bench first turns by default, `--prompts` for any other (`sharegpt`, or a file such as
`benchmarks/prompts/mixed.jsonl`: translation, summarisation, reading comprehension, math, code, writing).

    python benchmarks/feature_tau.py --heads runs/smollm2-feature/head --shapes dynamic-16x5,dynamic-32x6 \
        --num-prompts 8 --max-new-tokens 128 --threads 1 --json benchmarks/results/feature_tau.json

Every head directory (ours or an EAGLE layout; a training checkpoint's `head/` works too) runs each tree
shape at batch size 1, greedy, beside plain decoding and (with --medusa) the shipped Medusa heads' default
tree, interleaved per prompt so machine load hits all methods alike. With --trained-tokens the heads'
checkpoints' trained positions are read from their trainer_state.pt (tau against training tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def trained_tokens(head_dir: Path) -> int | None:
    state = head_dir.parent / "trainer_state.pt"
    if state.exists():
        return int(torch.load(state, map_location="cpu", weights_only=False).get("trained", 0))
    report = head_dir / "eval.json"
    if report.exists():
        return json.loads(report.read_text()).get("trained_tokens")
    return None


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.proposers.feature_heads import FeatureHead
    from medusa.decoding.trees.dynamic_tree import parse_shape
    from medusa.decoding.proposers.feature_proposer import FeatureProposer
    from medusa.prompts import load_prompts
    from medusa.runtime import Runtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", nargs="+", required=True)
    ap.add_argument("--shapes", default="dynamic-16x5,dynamic-32x6")
    ap.add_argument("--prompts", default="mtbench", help="mtbench, sharegpt or a prompt file")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--medusa", action="store_true", help="also the shipped Medusa heads (tree-8)")
    ap.add_argument("--no-plain", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rt = Runtime.load("default", heads="default" if args.medusa else "none", dtype=args.dtype)
    prompts = rt.encode(load_prompts(args.prompts, args.num_prompts))
    methods: dict[str, object] = {}
    if not args.no_plain:
        methods["plain"] = None
    if args.medusa and rt.heads is not None:
        methods["heads:tree-8"] = rt.proposer("heads", "tree-8")
    for spec in args.heads:
        head = FeatureHead.load(spec, rt.hf_model)
        for shape in args.shapes.split(","):
            if shape == "planned":  # what --mode heads picks at batch size 1 from the calibrated curve
                from dataclasses import replace

                from medusa.runtime.feature import feature_proposer

                proposer = feature_proposer(replace(rt, feature=head), None)
                methods[f"{spec}:planned-{proposer.tree.name}"] = proposer
            else:
                methods[f"{spec}:{shape}"] = FeatureProposer(head, rt.model, parse_shape(shape))
    stats = {name: {"tokens": 0, "seconds": 0.0, "row_steps": 0, "accepted": 0.0, "per_prompt": [], "hist": []}
             for name in methods}
    for name, proposer in methods.items():  # warm-up
        rt.engine.generate(prompts[:1], 8, proposer)
    for i, prompt in enumerate(prompts):
        for name, proposer in methods.items():
            t0 = time.perf_counter()
            gen = rt.engine.generate([prompt], args.max_new_tokens, proposer)
            dt = time.perf_counter() - t0
            s = stats[name]
            s["tokens"] += gen.stats.new_tokens
            s["seconds"] += dt
            s["row_steps"] += gen.stats.row_steps
            s["accepted"] += gen.stats.mean_accepted * gen.stats.row_steps
            s["per_prompt"].append(round(gen.stats.new_tokens / dt, 2))
            hist = gen.stats.accept_hist
            s["hist"] = [a + b for a, b in zip(s["hist"] + [0] * len(hist), hist + [0] * len(s["hist"]))]
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    plain_rate = None
    rows = []
    for name, s in stats.items():
        rate = s["tokens"] / max(s["seconds"], 1e-9)
        tau = s["accepted"] / max(s["row_steps"], 1) if name != "plain" else 1.0
        if name == "plain":
            plain_rate = rate
        head = name.rsplit(":", 1)[0]
        hist = s["hist"]
        deepest = max((k for k, n in enumerate(hist) if n), default=0)  # the longest accepted run
        by_depth = [round(sum(hist[k + 1:]) / max(sum(hist[k:]), 1), 3) for k in range(deepest)]
        rows.append({"method": name, "tau": round(tau, 3), "acceptance_by_depth": by_depth,
                     "tokens_per_s": round(rate, 2),
                     "median_prompt_tokens_per_s": statistics.median(s["per_prompt"]),
                     "trained_tokens": trained_tokens(Path(head)) if Path(head).is_dir() else None})
    for r in rows:
        r["vs_plain"] = round(r["tokens_per_s"] / plain_rate, 3) if plain_rate else None
        print(f"{r['method']:<70} tau {r['tau']:.2f}  {r['tokens_per_s']:6.1f} tok/s  "
              f"{r['vs_plain'] if r['vs_plain'] is not None else '-'}x plain  trained {r['trained_tokens']}")
    if args.json:
        import platform

        from medusa.decoding.target.hardware import provenance
        from medusa.io import write_json_atomic

        out = {**provenance(rt.dtype.name, machine_=rt.machine),
               "python": platform.python_version(), "torch": torch.__version__,
               "threads": args.threads, "dtype": args.dtype, "prompts": args.prompts, "num_prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "results": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(args.json), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
