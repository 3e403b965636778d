"""Prefill of prompts added together: one right-padded pass against one unpadded pass of parts.

    python benchmarks/packed_prefill.py --batch-sizes 4,8 --repeats 3 --json benchmarks/results/packed-prefill.json

Greedy, the default model, prompts of several kinds in groups of each batch size, exactly as `medusa bench
--batch-sizes` groups them. Each group is added to an empty batch (its prompts' prefill and first token, one
call of `Engine.add`) with the padded pass forced and with the unpadded one forced (`PACK_PADDING`),
interleaved `--repeats` times after an unmeasured warm-up. Reports each group's real and padded token counts,
the median time of each way and their ratio, and whether the default rule (`PACK_PADDING`) packs it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding import prefilling
    from medusa.decoding.target.hardware import provenance
    from medusa.io import write_json_atomic
    from medusa.prompts import load_prompts
    from medusa.runtime import Runtime

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="benchmarks/prompts/mixed.jsonl,benchmarks/prompts/sharegpt_later_turns.jsonl,"
                    "humaneval", help="comma-separated prompt sources (--num-prompts of each)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--batch-sizes", default="4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rt = Runtime.load("default", heads="none", dtype=args.dtype)
    prompts = rt.encode([t for source in args.prompts.split(",") for t in load_prompts(source, args.num_prompts)])
    default_rule = prefilling.PACK_PADDING
    ways = {"padded": float("inf"), "packed": 0.0}

    def add(group: list[list[int]]) -> float:
        batch = rt.engine.new_batch(len(group), max(len(p) for p in group) + 2, 1)
        start = time.perf_counter()
        rt.engine.add(batch, list(range(len(group))), group, 1)
        return time.perf_counter() - start

    report = {**provenance(rt.dtype.name, rt.model.device, rt.machine), "threads": torch.get_num_threads(),
              "pack_padding": default_rule, "repeats": args.repeats, "groups": []}
    print(f"{rt.machine.describe()}, {rt.dtype.name}; prefill seconds, median of {args.repeats}")
    try:
        for b in (int(x) for x in args.batch_sizes.split(",")):
            groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
            for group in groups:
                for way in ways.values():  # warm-up
                    prefilling.PACK_PADDING = way
                    add([p[:16] for p in group])
                seconds: dict[str, list[float]] = {w: [] for w in ways}
                for r in range(args.repeats):
                    for w in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                        prefilling.PACK_PADDING = ways[w]
                        seconds[w].append(add(group))
                real, padded = sum(len(p) for p in group), len(group) * max(len(p) for p in group)
                med = {w: statistics.median(s) for w, s in seconds.items()}
                row = {"batch_size": b, "tokens": real, "padded_tokens": padded, "padding": padded / real - 1,
                       "packs_by_default": padded > (1 + default_rule) * real, **{f"{w}_s": med[w] for w in ways},
                       "packed_over_padded": med["packed"] / med["padded"], "all": seconds}
                report["groups"].append(row)
                print(f"  bs {b}: {real} tokens ({row['padding']:.0%} padding): padded {med['padded']:.3f} s, "
                      f"packed {med['packed']:.3f} s ({row['packed_over_padded']:.2f}x)"
                      f"{'' if row['packs_by_default'] else ', kept padded by default'}")
    finally:
        prefilling.PACK_PADDING = default_rule
    if args.json:
        write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
