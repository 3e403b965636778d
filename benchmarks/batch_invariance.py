"""Does speculation change bf16 output? Greedy tokens of every proposer, alone and batched, against plain
decoding alone, with batch-invariant attention on and off; and what invariance costs in speed.

    python benchmarks/batch_invariance.py --num-prompts 50 --max-new-tokens 256 \
        --json benchmarks/results/batch-invariance.json

Prompts: `benchmarks/prompts/mixed.jsonl` (translation, summarisation, reading comprehension, math, code,
writing), then MT-bench and ShareGPT first turns up to --num-prompts. For each setting (invariance on, off)
the reference is plain decoding of each prompt alone; every proposer (`--specs`, the mode names of
`medusa generate --mode`) then decodes the prompts in consecutive batches of each `--batch-sizes` (rows of
different lengths finish and leave at different steps), and each row's tokens are compared with its
reference: identical rows, and where the others first part. Speed: plain decoding and the default
(auto) decoding of the first prompts at batch size 1, invariance on and off interleaved, medians.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def prompt_set(n: int) -> list[str]:
    from medusa.prompts import load_prompts

    texts = [json.loads(line)["prompt"] for line in Path("benchmarks/prompts/mixed.jsonl").read_text().splitlines()
             if line.strip()]
    for source in ("mtbench", "sharegpt"):
        if len(texts) < n:
            texts += [t for t in load_prompts(source, n) if t not in texts]
    return texts[:n]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(rt, prompts, reference, specs, sizes, new: int) -> dict:
    out = {}
    for spec in specs:
        tree = "dynamic-16x5" if spec == "medusa" else None
        for size in sizes:
            proposer = rt.proposer(spec, tree)
            got = []
            for i in range(0, len(prompts), size):
                got += [o.tokens for o in rt.engine.generate(prompts[i: i + size], new, proposer).outputs]
            diffs = [first_difference(r, g) for r, g in zip(reference, got)]
            out[f"{spec} x{size}"] = {"identical": sum(d is None for d in diffs), "rows": len(diffs),
                                      "first_differences": [d for d in diffs if d is not None]}
            print(f"  {spec:>12} batch {size}: identical {out[f'{spec} x{size}']['identical']}/{len(diffs)}",
                  flush=True)
    return out


def speed(rt, prompts, new: int, repeats: int) -> dict:
    """tokens/s of plain and auto decoding at batch size 1, invariance off/on interleaved."""
    times: dict[str, list[float]] = {}
    auto = rt.auto(1, progress=False)
    for _ in range(repeats):
        for inv in (False, True):
            rt.model.invariant = inv
            for name, policy in (("plain", None), ("auto", auto)):
                tokens, start = 0, time.perf_counter()
                for p in prompts:
                    tokens += rt.engine.generate([p], new, policy=policy).stats.new_tokens
                times.setdefault(f"{name} invariant={'on' if inv else 'off'}", []).append(tokens / (time.perf_counter() - start))
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    for name in ("plain", "auto"):
        med[f"{name} cost of invariance"] = round(1 - med[f"{name} invariant=on"] / med[f"{name} invariant=off"], 3)
    return med


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.hardware import machine
    from medusa.runtime import Runtime

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--specs", default="plain,medusa,lookup,draft", help="mode names, comma-separated "
                    "(medusa: the default heads' dynamic-16x5 tree)")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--speed-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-compare", action="store_true", help="speed only (on a quiet machine)")
    ap.add_argument("--json", default="benchmarks/results/batch-invariance.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = Runtime.load("default", "default", "bf16", "cpu", batch_invariant=True)
    prompts = rt.encode(prompt_set(args.num_prompts))
    specs, sizes = args.specs.split(","), [int(s) for s in args.batch_sizes.split(",")]
    report = {"cpu": {"model": machine(rt.model.device).name, "machine": platform.machine(),
                      "threads": torch.get_num_threads(), "native_bf16": machine(rt.model.device).native_bf16},
              "dtype": "bf16", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "settings": {}}
    for inv in () if args.no_compare else (True, False):
        rt.model.invariant = inv
        print(f"batch invariance {'on' if inv else 'off'}", flush=True)
        reference = [rt.engine.generate([p], args.max_new_tokens).outputs[0].tokens for p in prompts]
        report["settings"]["on" if inv else "off"] = compare(rt, prompts, reference, specs, sizes, args.max_new_tokens)
    report["speed_tokens_per_s"] = speed(rt, prompts[: args.speed_prompts], min(args.max_new_tokens, 128), args.repeats)
    print(json.dumps(report["speed_tokens_per_s"], indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
