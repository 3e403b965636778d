"""`medusa bench`: decoding speed of HF generate, our plain decoding and Medusa, side by side.

Methods run interleaved (one prompt each in turn, repeated), so machine noise hits all of them alike;
medians are reported. The verification-cost curve times one target pass over trees of 1..64 nodes after a
fixed prefix, relative to a plain step of the same engine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from medusa.decoding.target.hardware import DTYPE_CHOICES, provenance
from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.prompts import load_prompts
from medusa.decoding.trees.tree import chain, load_tree
from medusa.io import write_json_atomic
from medusa.errors import MedusaError
from medusa.eval.driver import run_engine, sync
from medusa.runtime.args import int_list


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="HF generate vs plain vs Medusa decoding speed, and tree pass cost")
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="default")
    p.add_argument("--tree", default=None, help="fixed Medusa tree(s) to time beside auto mode, comma-separated "
                                                "(default: the heads' default tree)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="{auto,bf16,fp16,fp32}")
    p.add_argument("--device", default=None)
    p.add_argument("--batch-invariant", default="off", choices=["on", "off"],
                   help="time batch-invariant decoding (see `medusa generate --help`)")
    p.add_argument("--prompts", default="mtbench", help="mtbench, sharegpt, humaneval or a file; several "
                                                          "comma-separated, --num-prompts from each")
    p.add_argument("--num-prompts", type=int, default=6, help="prompts from each source")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--batch-sizes", type=int_list, default=[1], metavar="1,2,4,8",
                   help="also time plain decoding against default flags (auto mode) at these batch sizes: "
                        "batches of that many prompts, both methods side by side (bs 1 times every method)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--feature", default="auto", help="feature heads (EAGLE-style) timed beside Medusa: a "
                   "directory, 'none', or 'auto' (the shipped ones, when there are any)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=run)


def time_it(fn, device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def tree_pass_curve(rt, sizes=(1, 8, 16, 32, 64), prefix: int = 256, reps: int = 15) -> dict[int, float]:
    """Median ms of one target pass (plus lm_head) over a tree of each size after `prefix` cached tokens."""
    model = rt.model
    dev = model.device
    trees = {n: (load_tree(f"tree-{n}") if n > 1 else chain(0)) for n in sizes}
    batch = rt.engine.new_batch(1, prefix + 80, 8)
    rt.engine.add(batch, [0], [list(range(1000, 1000 + prefix))], 8)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        for _ in range(reps):
            for n, tree in trees.items():
                buf = tree.buffers(dev)
                tokens = torch.randint(0, 1000, (1, tree.size), device=dev)
                pos = batch.cache.lens[:1, None] + buf.node_depth
                times[n].append(time_it(lambda: model.lm_head(model(tokens, pos, batch.cache, slice(0, 1),
                                                                     buf.mask)), dev))
    return {n: statistics.median(v) * 1000 for n, v in times.items()}


def run(args: argparse.Namespace) -> int:
    from medusa.runtime import Runtime

    if args.threads:
        torch.set_num_threads(args.threads)
    rt = Runtime.load(args.model, args.heads, args.dtype, args.device, batch_invariant=args.batch_invariant == "on")
    if rt.heads is None and rt.feature is None:
        # Untrained heads (zero blocks) cost exactly what trained ones cost; only tau is meaningless.
        print("note: no heads for this model, Medusa runs with untrained heads (speed only, tau meaningless)")
        rt.heads = MedusaHeads(HeadsConfig(rt.hf_model.config.hidden_size,
                                           rt.hf_model.get_output_embeddings().weight.shape[0])).attach(rt.hf_model)
    if args.max_new_tokens <= 0:
        raise MedusaError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    # Without --tree: the heads' default tree (the Medusa heads' own when feature heads were loaded beside them)
    trees = args.tree.split(",") if args.tree else [rt.heads.tree().name if rt.heads is not None else None]
    fixed = {f"heads:{p.tree.name}": p for p in (rt.proposer("heads", t) for t in trees)}
    from medusa.runtime.feature import bench_methods

    fixed.update(bench_methods(rt, args.feature))
    alone = rt.proposer("retrieval")  # retrieval alone: what auto mode grafts onto the heads' trees
    fixed[alone.tree.name] = alone  # retrieval:N, named as its mode
    prompts = rt.encode([t for source in args.prompts.split(",") for t in load_prompts(source, args.num_prompts)])
    rt.auto(1)  # calibrate (once per machine) before anything is timed
    n_new = args.max_new_tokens
    eos = rt.engine.eos.tolist()

    def hf(p):
        ids = torch.tensor([p], device=rt.model.device)
        out = rt.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                   do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        return out.shape[1] - len(p)

    methods = {"plain": lambda p: run_engine(rt.engine, [p], 1, n_new),
               # Auto mode as a user gets it: a fresh decision and gate per call, probe step included.
               "auto": lambda p: run_engine(rt.engine, [p], 1, n_new, policy=rt.auto(1, progress=False)),
               **{name: (lambda p, prop=prop: run_engine(rt.engine, [p], 1, n_new, prop)) for name, prop in fixed.items()}}
    if not args.no_hf:
        methods = {"hf_generate": hf, **methods}
    # Warm-up: first calls allocate and pick kernels.
    for fn in methods.values():
        fn(prompts[0][:32])
    rates: dict[str, list[float]] = {m: [] for m in methods}
    extra: dict[str, dict] = {m: {"tokens": 0, "forward_passes": 0, "accepted": []} for m in methods}
    mismatches: dict[str, int] = {m: 0 for m in methods if m not in ("hf_generate", "plain")}
    names = list(methods)
    for r in range(args.repeats):
        for i, p in enumerate(prompts):
            outputs = {}
            # The order rotates per prompt: no method always runs right after the same other one (a
            # method following plain decoding measured several percent slower than the same method later).
            k = (r * len(prompts) + i) % len(names)
            for name in names[k:] + names[:k]:
                fn = methods[name]
                start = time.perf_counter()
                result = fn(p)
                seconds = time.perf_counter() - start
                if name == "hf_generate":
                    tokens = result
                else:
                    tokens = result.stats.new_tokens
                    extra[name]["forward_passes"] += result.stats.forward_passes
                    extra[name]["accepted"].append(result.stats.mean_accepted)
                    outputs[name] = result.outputs[0]
                extra[name]["tokens"] += tokens
                rates[name].append(tokens / seconds)
            for name in mismatches:
                mismatches[name] += outputs[name] != outputs["plain"]
    curve = tree_pass_curve(rt)
    ours = [m for m in methods if m != "hf_generate"]
    res = {"model": rt.hf_model.name_or_path, "dtype": rt.dtype.name, "dtype_reason": rt.dtype.reason,
           **provenance(rt.dtype.name, machine_=rt.machine), "device": str(rt.model.device),
           "threads": torch.get_num_threads(), "prompts": len(prompts), "max_new_tokens": n_new,
           "auto_plan": rt.auto(1, progress=False).plan(1).to_dict(),
           "tokens_per_s": {m: statistics.median(v) for m, v in rates.items()},
           "tokens_per_s_all": rates,
           "mean_accepted": {m: statistics.median(extra[m]["accepted"]) for m in ours},
           "forward_passes": {m: extra[m]["forward_passes"] for m in ours},
           "new_tokens": {m: extra[m]["tokens"] for m in methods},
           "greedy_mismatches": mismatches, "tree_pass_ms": curve,
           "tree_pass_vs_plain_step": {n: v / curve[1] for n, v in curve.items()}}
    tps = res["tokens_per_s"]
    print(f"model {res['model']} {rt.dtype.name} ({rt.dtype.reason}) on {rt.machine.describe()}, "
          f"{len(prompts)} prompts x {n_new} new tokens, bs=1, medians of {len(prompts) * args.repeats} runs")
    plan = res["auto_plan"]
    print(f"  auto plans {plan['tree'] or 'plain'} at bs 1: {plan['reason']}")
    for m, v in tps.items():
        vs = f"{v / tps['plain']:.2f}x plain" if m != "plain" else ""
        acc = f"tau {res['mean_accepted'][m]:.2f}" if m in res["mean_accepted"] else ""
        mis = f"greedy mismatches {mismatches[m]}" if m in mismatches else ""
        print(f"  {m:16s} {v:7.1f} tok/s  {vs:12s} {acc:10s} {mis}")
    if "hf_generate" in tps:
        print(f"  plain / hf_generate  = {tps['plain'] / tps['hf_generate']:.2f}x")
    print("  one target pass over a tree (ms, x plain step): " +
          ", ".join(f"{n}: {v:.1f} ({v / curve[1]:.2f}x)" for n, v in curve.items()))
    batched = [b for b in args.batch_sizes if b > 1]
    if batched:
        res["batched"] = batched_rates(rt, prompts, batched, n_new, args.repeats)
        print("  default flags against plain decoding by batch size (medians of tokens per second over batches):")
        for b, r in res["batched"].items():
            print(f"    bs {b:<3d} plain {r['plain']:7.1f} tok/s  auto {r['auto']:7.1f} tok/s  "
                  f"{r['speedup']:.2f}x (paired)  tau {r['auto_tau']:.2f}, steps {r['auto_steps']}, "
                  f"planned {r['auto_plan']['tree'] or 'plain'}, planning {r['planning_s']:.3f} s; "
                  f"greedy mismatches {r['greedy_mismatches']}")
    if args.json:
        write_json_atomic(args.json, res)
    return 0


def batched_rates(rt, prompts: list[list[int]], sizes: list[int], n_new: int, repeats: int,
                  max_groups: int | None = None) -> dict[int, dict]:
    """Plain decoding and default flags (a fresh auto mode per call, as `medusa generate` makes one) on batches
    of each size: consecutive groups of the prompts, the two methods alternating which runs first. Returns
    per batch size the median tokens per second of each, `speedup`: the median over batches of auto's rate
    over plain's on the same batch (batches differ in length and speed, so the two medians may come from
    different batches and their ratio is not a paired comparison), auto's plan, steps, tau, time spent choosing
    steps and the greedy outputs that differ from plain decoding's (0 in fp32). `max_groups`: at most that
    many batches per size and repeat."""
    out = {}
    for b in sizes:
        groups = [prompts[i: i + b] for i in range(0, len(prompts) - b + 1, b)] or [(prompts * b)[:b]]
        groups = groups[:max_groups]
        rates: dict[str, list[float]] = {"plain": [], "auto": []}
        taus, steps, choosing, mismatches = [], {"plain": 0, "speculative": 0}, 0.0, 0
        rt.auto(b, progress=False)  # this batch size's curve, measured once per machine, before any timing
        for r in range(repeats):
            for i, group in enumerate(groups):
                results = {}
                for name in (["plain", "auto"] if (r + i) % 2 == 0 else ["auto", "plain"]):
                    start = time.perf_counter()  # auto's set-up (reading the curve, planning) counts too
                    auto = rt.auto(b, progress=False) if name == "auto" else None
                    gen = rt.engine.generate(group, n_new, policy=auto)
                    rates[name].append(gen.stats.new_tokens / (time.perf_counter() - start))
                    results[name] = [o.tokens for o in gen.outputs]
                    if auto is not None:
                        taus.append(gen.stats.mean_accepted)
                        choosing += auto.choosing_seconds
                        for k, v in auto.steps.items():
                            steps[k] += v
                mismatches += sum(x != y for x, y in zip(results["auto"], results["plain"]))
        out[b] = {"plain": statistics.median(rates["plain"]), "auto": statistics.median(rates["auto"]),
                  "speedup": statistics.median(a / p for a, p in zip(rates["auto"], rates["plain"])),
                  "plain_all": rates["plain"], "auto_all": rates["auto"], "auto_tau": statistics.median(taus),
                  "auto_steps": steps, "auto_plan": rt.auto(b, progress=False).plan(b).to_dict(),
                  "planning_s": choosing, "batches": len(groups) * repeats, "greedy_mismatches": mismatches}
    return out
