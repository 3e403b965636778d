"""Tokens per step (tau) of proposer specs with and without a datastore, per prompt set, batch size 1, greedy.

    python benchmarks/retrieval_tau.py --specs feature,feature+retrieval --tree dynamic-16x5 \
        --datastore runs/ds-8k --prompts mtbench,benchmarks/prompts/sharegpt_later_turns.jsonl \
        --num-prompts 8 --json benchmarks/results/retrieval_tau.json

Each spec (see `medusa.runtime.proposers`) decodes every prompt alone; `--datastore` adds runs of the
specs that retrieve with that corpus beside the row's own text. tau does not depend on machine load, so this
runs beside other work; speed is `medusa bench`'s job.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.target.hardware import provenance
    from medusa.io import write_json_atomic
    from medusa.prompts import load_prompts
    from medusa.runtime import Runtime
    from medusa.runtime.proposers import build_proposer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--specs", default="feature,feature+retrieval")
    ap.add_argument("--tree", default="dynamic-16x5")
    ap.add_argument("--datastore", default=None)
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    stores = [None] + ([args.datastore] if args.datastore else [])
    runtimes = {s: Runtime.load("default", "default", args.dtype, datastore=s) for s in stores}
    rows = []
    for source in args.prompts.split(","):
        for store, rt in runtimes.items():
            prompts = rt.encode(load_prompts(source, args.num_prompts))
            for spec in args.specs.split(","):
                if store is not None and "retrieval" not in spec:
                    continue  # a datastore changes only what retrieval drafts
                proposer = build_proposer(rt, spec, args.tree)
                taus = [rt.engine.generate([p], args.max_new_tokens, proposer).stats.mean_accepted for p in prompts]
                rows.append({"prompts": source, "spec": spec, "tree": args.tree, "datastore": store,
                             "tau": round(statistics.fmean(taus), 3), "per_prompt": [round(t, 3) for t in taus]})
                print(f"{source:50s} {spec:16s} datastore={store or '-':12s} tau {rows[-1]['tau']:.2f}", flush=True)
    out = {"rows": rows, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
           **provenance(args.dtype, threads=args.threads)}
    if args.json:
        write_json_atomic(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
