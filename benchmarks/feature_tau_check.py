"""Where a feature head's predicted tau parts from its measured tau: the prediction from held-out rank
accuracies (what `medusa train-feature` logs and auto mode plans with) beside tau measured by decoding,
on the training run's held-out split and on another prompt set (MT-bench first turns by default).

For each set of texts (held-out distilled answers; the target's own greedy answers to the decoded prompts)
the head runs unrolled over the teacher-forced features (`feature_eval.rank_paths`): at every answer position
the rank of the target's token at each draft depth, along the chain the head drafts from there. From these:

    marginal   expected_tau_dynamic over per-depth rank accuracies counted over every position (what
               eval.json's rank_accuracy held before; now its marginal_rank_accuracy)
    chain      ... over the accuracies at each depth among the positions whose chain was accepted so far
               (path_accuracy: what eval.json's rank_accuracy holds now)
    joint      the same static tree, counted on the positions themselves (no independence assumed)
    measured   tau decoding the prompts with the head drafting `--tree` (batch size 1, greedy)

    python benchmarks/feature_tau_check.py --heads medusa/assets/feature_heads --tree dynamic-16x5x8 \
        --held 128 --prompts mtbench --num-prompts 16 --max-new-tokens 128 --dtype fp32 --threads 2 --json OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.trees.dynamic_tree import parse_shape
    from medusa.decoding.proposers.feature_heads import FeatureHead
    from medusa.decoding.proposers.feature_proposer import FeatureProposer
    from medusa.decoding.trees.dynamic_tree import expected_tau_dynamic
    from medusa.decoding.trees.tree import build_tree
    from medusa.prompts import load_prompts
    from medusa.runtime import Runtime
    from medusa.train.data import load_examples, split_groups
    from medusa.train.feature import chunk_groups, load_feature_config
    from medusa.train.feature_data import draft_map, extract, feature_fn
    from medusa.train.feature_eval import path_accuracy, rank_paths

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="medusa/assets/feature_heads")
    ap.add_argument("--config", default=None, help="the head's training config (default: its train_config.yaml)")
    ap.add_argument("--tree", default="dynamic-16x5x8")
    ap.add_argument("--held", type=int, default=128, help="held-out sequences for the rank statistics")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts decoded, per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = parse_shape(args.tree)
    rt = Runtime.load("default", heads="none", dtype=args.dtype)
    hf = rt.hf_model
    head = FeatureHead.load(args.heads, hf)
    float_head = FeatureHead.load(args.heads, hf).float()
    full_to_draft = draft_map(head.config.vocab_size, head.draft_ids)
    fn = feature_fn(hf, head.config.feature_layers)
    cfg = load_feature_config(args.config or Path(args.heads) / "train_config.yaml", [f"dtype={args.dtype}"])
    _, held = split_groups(cfg, chunk_groups(cfg, load_examples(cfg, rt.tokenizer)))

    def stats(examples: list[dict]) -> dict:
        paths, logq = rank_paths(float_head, extract(examples, fn), full_to_draft, max(shape.depth, 6), 10,
                                 scores=True)
        marginal = marginal_accuracy(paths, 10)
        chain = path_accuracy(paths, 10)
        first = top1_chain_accuracy(paths, 10)
        tree = build_tree([r[: shape.topk] for r in marginal[: shape.depth]], shape.nodes).nodes
        # The static tree the head's own scores pick on average (sum of mean log-probabilities along a path).
        mean_lq = [logq[paths[:, j] >= 0, j, : shape.topk].mean(0).exp().tolist() for j in range(shape.depth)]
        by_score = build_tree(mean_lq, shape.nodes).nodes
        return {"positions": int(paths.shape[0]),
                "top1": [round(a[0], 4) for a in marginal], "chain_top1": [round(a[0], 4) for a in chain],
                "top1_given_top1s": [round(a[0], 4) for a in first],
                "mean_q": [[round(x, 4) for x in r[:4]] for r in mean_lq],
                "marginal": round(expected_tau_dynamic(shape, marginal), 3),
                "chain": round(expected_tau_dynamic(shape, chain), 3),
                "given_top1s": round(expected_tau_dynamic(shape, first), 3),
                "joint": round(joint_tau(paths[:, : shape.depth], tree), 3),
                "joint_best": round(best_joint_tau(paths[:, : shape.depth], shape.nodes, shape.topk), 3),
                "joint_score_tree": round(joint_tau(paths[:, : shape.depth], by_score), 3),
                "tree": [list(n) for n in tree], "score_tree": [list(n) for n in by_score]}

    def decode(prompts: list[list[int]]) -> tuple[float, list[dict]]:
        proposer = FeatureProposer(head, rt.model, shape)
        rt.engine.generate(prompts[:1], 8, proposer)  # warm-up
        steps = rows = 0.0
        texts = []
        for p in prompts:
            gen = rt.engine.generate([p], args.max_new_tokens, proposer)
            steps += gen.stats.mean_accepted * gen.stats.row_steps
            rows += gen.stats.row_steps
            answer = gen.outputs[0].tokens
            texts.append({"input_ids": list(p) + list(answer), "loss_mask": [0] * len(p) + [1] * len(answer)})
        return steps / max(rows, 1), texts

    out = {"command": " ".join(["benchmarks/feature_tau_check.py", *(argv or sys.argv[1:])]), "tree": args.tree,
           "dtype": args.dtype, "threads": args.threads, "heads": args.heads}
    t0 = time.perf_counter()
    out["held_out_answers"] = {"sequences": min(args.held, len(held)), **stats(held[: args.held])}
    print("held-out answers", out["held_out_answers"], f"{time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    sets = {"held_out": [e["input_ids"][: e["loss_mask"].index(1)] for e in held if 1 in e["loss_mask"]][: args.num_prompts],
            args.prompts: rt.encode(load_prompts(args.prompts, args.num_prompts))}
    for name, prompts in sets.items():
        t0 = time.perf_counter()
        measured, texts = decode(prompts)
        out[name] = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "measured": round(measured, 3),
                     **stats(texts)}
        print(name, out[name], f"{time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    from medusa.decoding.target.hardware import provenance

    out["machine"] = provenance(rt.dtype.name, machine_=rt.machine)["machine"]
    print(json.dumps(out, indent=2))
    if args.json:
        from medusa.io import write_json_atomic

        write_json_atomic(Path(args.json), out)
    return 0


def marginal_accuracy(paths: torch.Tensor, k: int) -> list[list[float]]:
    """Per-depth rank accuracy over every position with a label at that depth (rank_accuracy)."""
    out = []
    for j in range(paths.shape[1]):
        r = paths[:, j]
        r = r[r >= 0]
        out.append([float((r == i).float().mean()) if len(r) else 0.0 for i in range(k)])
    return out


def top1_chain_accuracy(paths: torch.Tensor, k: int) -> list[list[float]]:
    """Per-depth rank accuracy among the positions whose head was right (rank 0) at every depth before."""
    out = []
    alive = torch.ones(paths.shape[0], dtype=torch.bool)
    for j in range(paths.shape[1]):
        r = paths[alive & (paths[:, j] >= 0), j]
        out.append([float((r == i).float().mean()) if len(r) else 0.0 for i in range(k)])
        alive &= paths[:, j] == 0
    return out


def best_joint_tau(paths: torch.Tensor, nodes: int, topk: int) -> float:
    """The best static tree of `nodes` nodes counted on the positions: the most frequent rank prefixes."""
    from collections import Counter

    counts = Counter()
    for row in paths.tolist():
        for d in range(1, len(row) + 1):
            if not 0 <= row[d - 1] < topk:
                break
            counts[tuple(row[:d])] += 1
    return 1 + sum(c for _, c in counts.most_common(nodes)) / max(len(paths), 1)


def joint_tau(paths: torch.Tensor, tree: list) -> float:
    """1 + the mean over positions of how deep their rank path runs inside the static `tree` (a position
    whose path leaves the tree at depth d accepts d - 1 drafted tokens)."""
    nodes = {tuple(p) for p in tree}
    total = 0
    for row in paths.tolist():
        for d in range(1, len(row) + 1):
            if tuple(row[:d]) not in nodes:
                break
            total += 1
    return 1 + total / max(len(paths), 1)


if __name__ == "__main__":
    sys.exit(main())
