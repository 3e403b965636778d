"""How often a retrieval draft is right, by match length: the table `medusa.decoding.proposers.retrieval` scores
its branches with.

Reads distilled answers (the target's own greedy output, so a draft that agrees with it is exactly a draft
the verifier accepts) and, at every answer position, asks the suffix automaton of prompt + answer so far
for its ranked continuations. For each continuation it records whether its first token is right (by the
bucket of its match length, and whether it ranks first at its suffix) and, after a right token, whether the
next one is right too.

    python benchmarks/retrieval_acceptance.py --distilled data/distill-sharegpt --shards 8 \
        --json benchmarks/results/retrieval_acceptance.json

With `--datastore DIR` the continuations come from a datastore (`medusa datastore build`) matched against
prompt + answer so far instead: build it from other answers than the ones measured, e.g. the first 64
shards (`--limit 8192`), and measure on the last ones.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from medusa.decoding.proposers.retrieval import MATCH_BUCKETS, match_bucket
from medusa.decoding.proposers.suffix import SuffixAutomaton


def measure(pairs, k: int, depth: int, store=None) -> dict:
    first = defaultdict(lambda: [0, 0])  # (bucket, top) -> [right, drafted]
    nxt = defaultdict(lambda: [0, 0])  # bucket -> [right, tried after a right token]
    for prompt, answer in pairs:
        sam = SuffixAutomaton(prompt) if store is None else store.matcher()
        if store is not None:
            sam.feed(prompt)
        for i, tok in enumerate(answer):
            truth = answer[i:]
            level_top = set()
            for c in sam.continuations(k, depth):
                top = c.match_len not in level_top
                level_top.add(c.match_len)
                b = match_bucket(c.match_len)
                ok = 0
                while ok < min(len(c.tokens), len(truth)) and c.tokens[ok] == truth[ok]:
                    ok += 1
                cell = first[(b, top)]
                cell[0] += ok > 0
                cell[1] += 1
                tried = min(len(c.tokens), len(truth)) - 1
                if ok:
                    nxt[b][0] += min(ok, tried + 1) - 1
                    nxt[b][1] += min(ok, tried)
            if store is None:
                sam.extend(tok)
            else:
                sam.feed([tok])
    table = []
    for b, lo in enumerate(MATCH_BUCKETS):
        row = {"match_len_from": lo}
        for top in (True, False):
            r, n = first[(b, top)]
            row["first_top" if top else "first_other"] = round(r / n, 3) if n else None
            row["n_top" if top else "n_other"] = n
        r, n = nxt[b]
        row["next"] = round(r / n, 3) if n else None
        row["n_next"] = n
        table.append(row)
    return {"k": k, "depth": depth, "buckets": table}


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.target.hardware import provenance
    from medusa.io import write_json_atomic
    from medusa.train.distill import load_shards

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--distilled", default="data/distill-sharegpt")
    ap.add_argument("--shards", type=int, default=8, help="the last N complete shards")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--datastore", default=None, help="continuations from this datastore instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shards = load_shards(args.distilled)[-args.shards:]
    pairs = [(list(p), list(r)) for _, ds in shards for p, r in zip(ds["prompt_ids"], ds["response_ids"])]
    store = None
    if args.datastore:
        from medusa.decoding.proposers.suffix import Datastore

        store = Datastore.load(args.datastore)
    out = measure(pairs, args.k, args.depth, store)
    out.update(source=args.distilled, shards=[name for name, _ in shards], answers=len(pairs),
               datastore=args.datastore, **provenance(None))
    print(f"{'match':>6} {'first(top)':>11} {'n':>7} {'first(other)':>13} {'n':>7} {'next':>6} {'n':>7}")
    for row in out["buckets"]:
        print(f"{row['match_len_from']:>5}+ {row['first_top']!s:>11} {row['n_top']:>7} {row['first_other']!s:>13} "
              f"{row['n_other']:>7} {row['next']!s:>6} {row['n_next']:>7}")
    if args.json:
        write_json_atomic(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
