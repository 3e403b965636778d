"""Auto mode (default flags) against variants of itself that undo one of its rules, interleaved in one process.

    own probes     every batch-size bucket times its own PLAIN_PROBES plain steps (`medusa.runtime.gate`),
                   where auto mode lets a bucket that a batch reaches as its rows finish (4 rows, then 2, then 1)
                   borrow the nearest timed bucket's plain cost, scaled by the calibrated curve
    step evidence  the realised share of the expected gain (`medusa.runtime.auto.Realised`) judged after 8
                   steps whatever their rows, where auto mode judges it after 8 row-steps

Each variant and plain decoding decode the same prompts at each batch size, in turn, `--rounds` times
(the order reversed every other round); it reports the median speed over rounds, each variant's median
ratio to default flags over rounds, and the plain steps each took.

    python benchmarks/auto_variants.py --batch-sizes 2,4,8 --num-prompts 8 --rounds 5 --dtype fp32 \
        --json benchmarks/results/auto-variants-epyc-zen3-avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

VARIANTS = ("own probes", "step evidence")


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.target.hardware import provenance
    from medusa.io import write_json_atomic
    from medusa.prompts import load_prompts
    from medusa.runtime import Runtime

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="mtbench,benchmarks/prompts/mixed.jsonl", help="comma-separated sources")
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts from each source")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = Runtime.load(dtype=args.dtype)
    prompts = rt.encode([p for src in args.prompts.split(",") for p in load_prompts(src, args.num_prompts)])
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    def run(batch: int, variant: str) -> tuple[float, int]:
        """(tokens per second, plain steps) decoding every prompt in batches of `batch` rows."""
        made, plain, start = 0, 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            policy = None
            if variant != "plain":
                policy = rt.auto(batch, progress=False)
                if variant == "own probes":
                    policy.gate.plain_scale = None
                elif variant == "step evidence":
                    add = policy.realised.add
                    policy.realised.add = lambda measured, expected, rows=1, add=add: add(measured, expected, 1)
            gen = rt.engine.generate(prompts[i: i + batch], args.max_new_tokens, None, policy=policy)
            made += sum(len(f.tokens) for f in gen.outputs)
            plain += policy.steps["plain"] if policy is not None else gen.stats.steps
        return made / (time.perf_counter() - start), plain

    variants = ("plain", "default", *VARIANTS)
    for b in sizes:  # warm-up: calibration, planning caches, first-call allocations
        run(b, "default")
    speeds = {b: {v: [] for v in variants} for b in sizes}
    plains = {b: {v: [] for v in variants} for b in sizes}
    for r in range(args.rounds):
        for b in sizes:
            order = variants if r % 2 == 0 else tuple(reversed(variants))
            for v in order:
                s, p = run(b, v)
                speeds[b][v].append(s)
                plains[b][v].append(p)
    rows = []
    for b in sizes:
        med = {v: statistics.median(speeds[b][v]) for v in variants}
        over = {v: statistics.median(x / y for x, y in zip(speeds[b][v], speeds[b]["default"])) for v in VARIANTS}
        steps = {v: statistics.median(plains[b][v]) for v in variants}
        rows.append({"batch_size": b, "tokens_per_s": med, "plain_steps": steps, "over_default": over,
                     "default_over_plain": med["default"] / med["plain"], "rounds": speeds[b]})
        print(f"bs {b}: plain {med['plain']:.1f} tok/s, default {med['default']:.1f} "
              f"({med['default'] / med['plain']:.2f}x plain, {steps['default']:.0f} plain steps); "
              + "; ".join(f"{v} {med[v]:.1f} ({over[v]:.2f}x default, {steps[v]:.0f} plain steps)" for v in VARIANTS))
    if args.json:
        write_json_atomic(args.json, {"machine": provenance(rt.model.dtype, threads=torch.get_num_threads()), "args": vars(args), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
