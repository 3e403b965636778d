"""Does speculation change bf16 output? Greedy tokens of every proposer, alone and batched, against plain
decoding alone, with batch-invariant attention on and off; and what invariance costs in speed.

    python benchmarks/batch_invariance.py --num-prompts 50 --max-new-tokens 256 \
        --json benchmarks/results/batch-invariance.json

Split over processes (one thread each), the proposers divided between them and plain decoding done once:

    python benchmarks/batch_invariance.py --invariance on --threads 1 --specs plain,heads:tree-8,lookup \
        --reference runs/reference.json --json A.json &
    python benchmarks/batch_invariance.py --invariance on --threads 1 --specs heads:dynamic-16x5,draft \
        --reference runs/reference.json --wait-reference --json B.json

Prompts: `benchmarks/prompts/mixed.jsonl` (translation, summarisation, reading comprehension, math, code,
writing), then MT-bench and ShareGPT first turns up to --num-prompts. For each setting (invariance on, off)
the reference is plain decoding of each prompt alone; every proposer (`--specs`: the shipped Medusa heads'
static tree, the shipped feature head's dynamic tree, lookup, the draft model) then decodes the prompts in
consecutive batches of each `--batch-sizes` (rows of different lengths finish and leave at different steps;
plain decoding alone is the reference itself and is not repeated) and in a running batch of each `--joining`
size that a new prompt joins whenever a row leaves; each row's tokens are compared with its reference:
identical rows, and where the others first part. The JSON is rewritten after every case, so a stopped run
keeps what it measured. Speed: plain decoding and the default (auto) decoding of the first prompts at batch
size 1, invariance on and off interleaved, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from medusa.io import write_json_atomic


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


def continuous(engine, prompts: list[list[int]], new: int, proposer, size: int) -> tuple[list[list[int]], list[int]]:
    """Each prompt's tokens when `size` rows decode at a time and the next prompt joins the running batch
    (its own prefill pass) as soon as a row leaves; prompts get different token limits (new, 3/4 new, new/2),
    so rows leave at different steps."""
    from medusa.decoding.target.transformer import cache_capacity

    limits = [max(1, new * (4 - i % 3) // 4) for i in range(len(prompts))]
    batch = engine.new_batch(size, cache_capacity(max(map(len, prompts)), new, proposer.span if proposer else 1),
                             new)
    if proposer is not None:
        proposer.attach(batch)
    done: dict[int, list[int]] = {}
    waiting = list(range(len(prompts)))
    while waiting or batch.n:
        take, waiting = waiting[: batch.free], waiting[batch.free:]
        outs = [engine.add(batch, take, [prompts[i] for i in take], [limits[i] for i in take])] if take else []
        if batch.n:
            outs.append(engine.step(batch, proposer))
        for out in outs:
            done.update({f.id: f.tokens for f in out.finished})
    return [done[i] for i in range(len(prompts))], limits


def compare(rt, prompts, reference, specs, sizes, joining, new: int, out: dict, save) -> dict:
    """Every proposer's rows against `reference()` (plain decoding alone) into `out`: in consecutive fixed
    batches of each of `sizes`, and in running batches of each of `joining` with rows joining as others
    leave; `save()` after every case."""
    for spec in specs:
        mode, _, tree = spec.partition(":")
        tree = tree or ("dynamic-16x5" if mode == "heads" else None)
        cases = [(size, False) for size in sizes if not (mode == "plain" and size == 1)]
        for size, joins in cases + [(size, True) for size in joining]:
            if joins:
                got, limits = continuous(rt.engine, prompts, new, rt.proposer(mode, tree), size)
                name = f"{spec} x{size} joining"
            else:
                got, limits = [], [new] * len(prompts)
                for i in range(0, len(prompts), size):
                    gen = rt.engine.generate(prompts[i: i + size], new, rt.proposer(mode, tree))
                    got += [o.tokens for o in gen.outputs]
                name = f"{spec} x{size}"
            diffs = [first_difference(r[:n], g) for r, g, n in zip(reference(), got, limits)]
            out[name] = {"identical": sum(d is None for d in diffs), "rows": len(diffs),
                         "first_differences": [d for d in diffs if d is not None]}
            print(f"  {name:>32}: identical {out[name]['identical']}/{len(diffs)}", flush=True)
            save()
    return out


def plain_alone(rt, prompts, new: int, path: str | None, wait: bool, setting: str):
    """A callable giving plain decoding of each prompt alone (the reference), computed at its first call;
    with `path`, read from that file when it holds this setting, prompts and length (with `wait`, until
    another process has written it), else computed and written there."""
    key = {"setting": setting, "prompts": prompts, "max_new_tokens": new}
    cached: list = []

    def read():
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
        return data["tokens"] if {k: data.get(k) for k in key} == key else None

    def get():
        if cached:
            return cached[0]
        tokens = read() if path else None
        while tokens is None and wait:
            time.sleep(10)
            tokens = read()
        if tokens is None:
            tokens = [rt.engine.generate([p], new).outputs[0].tokens for p in prompts]
            if path:
                write_json_atomic(Path(path), {**key, "tokens": tokens})
        cached.append(tokens)
        return tokens
    return get


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
    from medusa.decoding.target.hardware import machine
    from medusa.runtime import Runtime

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--specs", default="plain,heads:tree-8,heads:dynamic-16x5,lookup,draft",
                    help="mode names of `medusa generate --mode`, comma-separated, each with :TREE where it takes "
                    "one (heads:tree-8: the shipped Medusa heads' static tree; heads:dynamic-16x5: the shipped "
                    "feature head's dynamic tree, also what a bare `heads` means)")
    ap.add_argument("--invariance", choices=("both", "on", "off"), default="both",
                    help="the settings compared (both: on, then off)")
    ap.add_argument("--batch-sizes", default="1,2,4,8", help="fixed consecutive batches ('': none)")
    ap.add_argument("--joining", default="2,4,8", help="running batches that prompts join ('': none)")
    ap.add_argument("--reference", default=None,
                    help="file for plain decoding alone, shared by processes that split --specs")
    ap.add_argument("--wait-reference", action="store_true",
                    help="wait for another process to write --reference instead of computing it")
    ap.add_argument("--speed-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="speed rounds (0: no speed measurement)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="fp32: what auto picks on CPUs without native bf16 (speed and tokens alike)")
    ap.add_argument("--no-compare", action="store_true", help="speed only (on a quiet machine)")
    ap.add_argument("--json", default="benchmarks/results/batch-invariance.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = Runtime.load("default", "default", args.dtype, "cpu", batch_invariant=True)
    prompts = rt.encode(prompt_set(args.num_prompts))
    specs = args.specs.split(",")
    sizes, joining = ([int(s) for s in arg.split(",") if s] for arg in (args.batch_sizes, args.joining))
    report = {"cpu": {"model": machine(rt.model.device).name, "machine": platform.machine(),
                      "threads": torch.get_num_threads(), "native_bf16": machine(rt.model.device).native_bf16,
                      "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")},
              "dtype": args.dtype, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "settings": {}}

    for path in filter(None, (args.json, args.reference)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)

    def save():
        write_json_atomic(Path(args.json), report, indent=1)

    settings = {"both": (True, False), "on": (True,), "off": (False,)}[args.invariance]
    for inv in () if args.no_compare else settings:
        rt.model.invariant = inv
        setting = "on" if inv else "off"
        print(f"batch invariance {setting}", flush=True)
        reference = plain_alone(rt, prompts, args.max_new_tokens, args.reference and f"{args.reference}.{setting}",
                                args.wait_reference, setting)
        report["settings"][setting] = {}
        compare(rt, prompts, reference, specs, sizes, joining, args.max_new_tokens, report["settings"][setting], save)
    if args.repeats:
        report["speed_tokens_per_s"] = speed(rt, prompts[: args.speed_prompts], min(args.max_new_tokens, 128),
                                             args.repeats)
        print(json.dumps(report["speed_tokens_per_s"], indent=1))
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
