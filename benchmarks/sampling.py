"""Sampled decoding with speculation: tau and speedup of rejection vs typical acceptance.

Medusa (shipped heads) and the draft model, at temperature 0.7 on MT-bench first turns, batch sizes 1 and
8, against plain sampling at the same batch size. Methods run interleaved; medians of the repeats.

    python benchmarks/sampling.py --num-prompts 4 --max-new-tokens 64 --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from medusa.decoding.proposers.draft import DraftProposer, load_draft
from medusa.decoding.target.hardware import provenance
from medusa.io import write_json_atomic
from medusa.prompts import load_prompts
from medusa.runtime import Runtime
from medusa.decoding.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = Runtime.load()
    prompts = rt.encode(load_prompts("mtbench", args.num_prompts))
    medusa = rt.proposer("heads")
    draft = DraftProposer(load_draft("default", rt.hf_model), 3)
    methods = {"plain": (None, "rejection"), "medusa/rejection": (medusa, "rejection"),
               "medusa/typical": (medusa, "typical"), "draft/rejection": (draft, "rejection"),
               "draft/typical": (draft, "typical")}
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        batches = [(prompts * bs)[i: i + bs] for i in range(0, len(prompts), bs)] if bs <= len(prompts) \
            else [(prompts * bs)[:bs]]
        rates = {m: [] for m in methods}
        taus = {m: [] for m in methods}
        for rep in range(args.repeats):
            for batch in batches:
                for name, (proposer, rule) in methods.items():
                    params = SamplingParams(temperature=args.temperature, acceptance=rule, seed=rep)
                    gen = rt.engine.generate(batch, args.max_new_tokens, proposer, params)
                    rates[name].append(gen.tokens_per_s)
                    taus[name].append(gen.stats.mean_accepted)
        base = statistics.median(rates["plain"])
        for name in methods:
            tps = statistics.median(rates[name])
            rows.append({"method": name, "batch_size": bs, "tokens_per_s_total": round(tps, 2),
                         "mean_accepted": round(statistics.median(taus[name]), 3),
                         "speedup_vs_plain": round(tps / base, 3)})
            print(f"bs={bs:<3} {name:18s} {tps:7.1f} tok/s  tau {rows[-1]['mean_accepted']:.2f}  "
                  f"speedup {rows[-1]['speedup_vs_plain']:.2f}x", flush=True)
    if args.out:
        write_json_atomic(args.out, {**provenance(rt.dtype.name, machine_=rt.machine),
                                     "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                                     "prompts": len(prompts), "results": rows})


if __name__ == "__main__":
    main()
