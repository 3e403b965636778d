"""Auto mode against the tree it plans, run fixed, in one process: does the policy (retrieval drafts, the
acceptance gate, its plain probe steps) cost anything per step, or only change what is accepted?

    python benchmarks/auto_vs_fixed.py --num-prompts 8 --repeats 2 --json benchmarks/results/auto_vs_fixed.json

Batch size 1, greedy, default flags. Four methods decode every prompt, the order rotating from prompt to
prompt: plain decoding, `--mode auto` as a user gets it (a fresh plan and gate per call), auto's planned tree
fixed, and that tree with the retrieval drafts auto grafts in (no gate). Reported per method: total tokens over
total seconds, the median of per-call rates (what `medusa bench` prints), steps and ms per step. With bf16 the
methods' outputs can part at near-ties, so they may decode different texts of different lengths; the totals
weigh each call by its tokens, the medians weigh each call alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.target.hardware import provenance
    from medusa.prompts import load_prompts
    from medusa.runtime import Runtime
    from medusa.runtime.feature import feature_proposer

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="mtbench", help="mtbench, sharegpt or a prompt file")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rt = Runtime.load("default")
    if rt.feature is None:
        print("auto_vs_fixed.py: the default heads are not feature heads", file=sys.stderr)
        return 2
    prompts = rt.encode(load_prompts(args.prompts, args.num_prompts))
    planner = rt.auto(1)  # calibrates once per machine, before anything is timed
    plan = planner.plan(1)
    if plan.tree is None:
        print(f"auto_vs_fixed.py: auto mode decodes plainly here ({plan.reason})", file=sys.stderr)
        return 2
    tree = plan.tree.name
    fixed = feature_proposer(rt, tree)
    merged = planner.make_proposer(plan.tree)
    n = args.max_new_tokens
    methods = {
        "plain": lambda p: rt.engine.generate([p], n),
        "auto": lambda p: rt.engine.generate([p], n, policy=rt.auto(1, progress=False)),
        f"fixed {tree}": lambda p: rt.engine.generate([p], n, fixed),
        f"fixed {tree} + retrieval": lambda p: rt.engine.generate([p], n, merged),
    }
    names = list(methods)
    for fn in methods.values():  # warm-up: first calls allocate and pick kernels
        fn(prompts[0][:32])
    runs: dict[str, list[tuple[float, int, int]]] = {m: [] for m in names}
    for r in range(args.repeats):
        for i, p in enumerate(prompts):
            k = (r * len(prompts) + i) % len(names)
            for name in names[k:] + names[:k]:
                g = methods[name](p)
                runs[name].append((g.seconds, g.stats.new_tokens, g.stats.steps))
    rows = {}
    for name, rs in runs.items():
        seconds, tokens, steps = (sum(x[j] for x in rs) for j in range(3))
        rows[name] = {"tokens_per_s_total": tokens / seconds,
                      "tokens_per_s_median": statistics.median(t / s for s, t, _ in rs),
                      "tokens": tokens, "steps": steps, "ms_per_step": 1000 * seconds / steps}
    base = rows["plain"]
    for row in rows.values():
        row["speedup_total"] = row["tokens_per_s_total"] / base["tokens_per_s_total"]
        row["speedup_median"] = row["tokens_per_s_median"] / base["tokens_per_s_median"]
    print(f"{rt.machine.describe()}, {rt.dtype.name}, bs 1, {len(prompts)} prompts x {n} tokens x {args.repeats}; "
          f"auto plans {tree}")
    for name, row in rows.items():
        print(f"  {name:28s} total {row['tokens_per_s_total']:6.1f} tok/s {row['speedup_total']:.2f}x   "
              f"median {row['tokens_per_s_median']:6.1f} tok/s {row['speedup_median']:.2f}x   "
              f"{row['steps']} steps, {row['ms_per_step']:.2f} ms/step")
    if args.json:
        out = {**provenance(rt.dtype.name, machine_=rt.machine),
               "threads": torch.get_num_threads(), "prompts": args.prompts, "num_prompts": len(prompts),
               "max_new_tokens": n, "repeats": args.repeats, "auto_plan": plan.to_dict(), "methods": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
