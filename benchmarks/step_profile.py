"""Where a decoding step's time goes: plain decoding and speculative steps, phase by phase.

    python benchmarks/step_profile.py --shapes dynamic-12x3,dynamic-16x5 --num-prompts 4 --max-new-tokens 128 \
        --json benchmarks/results/step_profile.json

Greedy, the default model and feature head (`--heads`), prompts decoded in groups of `--batch-size` (tau is
then tokens per step over plain decoding's, one per live row). Each method decodes every prompt
`--repeats` times, interleaved with the others, after an unmeasured warm-up; the phases are timed by
wrapping the engine's and the proposer's methods (on a GPU each timer waits for the device first, which
itself costs a little). Every phase is reported in ms per step and as a multiple of a plain step, so

    speedup = tau / (sum of a speculative step's phases, in plain steps)

reads off the table. Phases: the target's pass over the tree (`target pass`) and its vocabulary projection
(`target lm_head`), verification, the head's bookkeeping of the committed features, and drafting, split into
the head's layer passes, its draft-vocabulary projections and the choice of the tree's nodes; `rest` is the
step's time outside all of them (commit, emit, the engine's own tensor work).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import Counter, defaultdict

import torch

# (label, owner, method); drafting's parts are nested inside `draft`.
PHASES = [
    ("step", "medusa.decoding.engine:Engine", "step"),
    ("target pass", "medusa.decoding.target.transformer:Transformer", "forward"),
    ("verify", "medusa.decoding.verifier:Verifier", "verify"),
    ("feature bookkeeping", "medusa.decoding.proposers.feature_proposer:FeatureState", "committed"),
    ("draft", "medusa.decoding.engine:Engine", "draft"),
    ("draft/head layer", "medusa.decoding.proposers.feature_proposer:HeadRunner", "forward"),
    ("draft/head vocabulary", "medusa.decoding.proposers.feature_proposer:HeadRunner", "logits"),
    ("draft/head inputs", "medusa.decoding.proposers.feature_proposer:HeadRunner", "inputs"),
    ("draft/tree nodes", "medusa.decoding.trees.dynamic_tree:Pool", "trees"),
    ("draft/retrieval", "medusa.decoding.proposers.retrieval:Retriever", "chains"),
]
TOP = ["target pass", "target lm_head", "verify", "feature bookkeeping", "draft"]
NESTED = ["draft/head layer", "draft/head vocabulary", "draft/head inputs", "draft/tree nodes", "draft/retrieval"]


class Timers:
    """Accumulated seconds and calls per label, from wrapped callables."""

    def __init__(self, cuda: bool):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.cuda = cuda
        self.in_step = False  # phases count inside the engine's steps only (not the prompts' prefill)

    def wrap(self, fn, label: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if label == "step":
                self.in_step = True
            elif not self.in_step:
                return fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
                if label == "step":
                    self.in_step = False
        return timed

    def install(self, lm_head: torch.nn.Module) -> None:
        import importlib

        for label, where, name in PHASES:
            module, cls = where.split(":")
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, name, self.wrap(getattr(owner, name), label))
        lm_head.forward = self.wrap(lm_head.forward, "target lm_head")

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.target.hardware import provenance
    from medusa.eval.driver import run_engine
    from medusa.io import write_json_atomic
    from medusa.prompts import load_prompts
    from medusa.runtime import Runtime
    from medusa.runtime.feature import method_proposer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="default", help="feature head directory (default: the shipped one)")
    ap.add_argument("--shapes", default="dynamic-12x3,dynamic-16x5", help="comma-separated dynamic tree shapes")
    ap.add_argument("--prompts", default="mtbench", help="comma-separated: mtbench, sharegpt, humaneval, heldout or prompt files (--num-prompts of each)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=1, help="rows decoded together (prompts in groups of it)")
    ap.add_argument("--retrieval", action="store_true",
                    help="graft retrieval into every shape, as default flags do (`<shape>+retrieval`)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = Runtime.load("default", heads=args.heads, dtype=args.dtype)
    if rt.feature is None:
        ap.error(f"--heads {args.heads}: no feature head there")
    prompts = rt.encode([t for source in args.prompts.split(",") for t in load_prompts(source, args.num_prompts)])
    shapes = [s for s in args.shapes.split(",") if s]
    methods = {"plain": None, **{s: method_proposer(rt, args.heads, s) for s in shapes}}
    if args.retrieval:
        from medusa.decoding.proposers.retrieval import MergedProposer

        methods = {"plain": None, **{f"{s}+retrieval": MergedProposer(methods[s], rt.retriever()) for s in shapes}}
    n_new, bs = args.max_new_tokens, args.batch_size
    groups = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]

    def decode(group, proposer):
        return run_engine(rt.engine, group, bs, n_new, proposer)

    for proposer in methods.values():  # warm-up: kernels chosen, buffers allocated
        decode([p[:32] for p in groups[0]], proposer)
    timers = Timers(rt.model.device.type == "cuda")
    timers.install(rt.model.lm_head)
    seconds: dict[str, dict[str, float]] = {m: defaultdict(float) for m in methods}
    steps: Counter = Counter()
    tokens: Counter = Counter()
    rates: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for group in groups:
            for name, proposer in methods.items():
                timers.reset()
                start = time.perf_counter()
                gen = decode(group, proposer)
                rates[name].append(gen.stats.new_tokens / (time.perf_counter() - start))
                for label, s in timers.seconds.items():
                    seconds[name][label] += s
                steps[name] += timers.calls["step"]
                tokens[name] += gen.stats.new_tokens
    plain_ms = 1000 * seconds["plain"]["step"] / steps["plain"]
    report = {**provenance(rt.dtype.name, rt.model.device, rt.machine), "threads": torch.get_num_threads(),
              "prompts": len(prompts), "batch_size": bs, "max_new_tokens": n_new, "repeats": args.repeats,
              "plain_step_ms": plain_ms, "methods": {}}
    print(f"{rt.machine.describe()}, {rt.dtype.name}, bs {bs}, {len(prompts)} prompts x {n_new} tokens "
          f"x {args.repeats}; ms per step (x plain step)")
    for name in methods:
        n = steps[name]
        per = {label: 1000 * s / n for label, s in seconds[name].items()}
        rest = per["step"] - sum(per.get(label, 0.0) for label in TOP)
        phases = {**{label: per.get(label, 0.0) for label in TOP + NESTED}, "rest": rest}
        # Tokens per step over plain's (plain makes one per live row): tau at batch size 1, and at any batch
        # size the factor by which a step must not cost more than a plain one.
        tau = (tokens[name] / n) / (tokens["plain"] / steps["plain"])
        report["methods"][name] = {
            "tokens_per_s": statistics.median(rates[name]), "steps": n, "tau": tau, "step_ms": per["step"],
            "step_plain_steps": per["step"] / plain_ms,
            "phases_ms": phases, "phases_plain_steps": {k: v / plain_ms for k, v in phases.items()},
            "speedup_from_phases": tau / (per["step"] / plain_ms)}
        m = report["methods"][name]
        print(f"== {name}: {m['tokens_per_s']:.1f} tok/s (median), tau {tau:.2f}, {per['step']:.2f} ms/step "
              f"= {per['step'] / plain_ms:.2f} plain steps -> {m['speedup_from_phases']:.2f}x")
        for label, ms in phases.items():
            if ms > 0 or label == "rest":
                indent = "    " if label in NESTED else "  "
                print(f"{indent}{label:26s} {ms:7.2f} ms  {ms / plain_ms:5.2f}")
    if args.json:
        write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
