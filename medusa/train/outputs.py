"""What a heads training run leaves under its run_dir once it is over: `heads/` (heads, eval.json,
train_config.yaml, trees/ and what the strategy adds, in one atomic directory, so heads and their trees never
drift apart), eval.json next to the last checkpoint, and the strategy's own outputs (Medusa-2's merged model).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from medusa.io import atomic_dir, write_json_atomic, write_text_atomic
from medusa.train import checkpoint as ckpt
from medusa.train.hidden import build_table, table_hidden_fn
from medusa.train.objective import rank_accuracy


def evaluate(run, eval_ex: list[dict]) -> dict:
    """Per-head top-1..top-k accuracy on the held-out split (hidden states of the trained base)."""
    cfg = run.cfg
    if not eval_ex:
        return {}
    table = build_table(eval_ex, table_hidden_fn(run.hf_model, run.d.device))
    idx = table.trainable()
    labels = table.labels(idx, cfg.heads.num_heads)
    device = run.d.device
    acc, counts = rank_accuracy(run.objective, table.hidden[idx].to(device), labels.to(device), cfg.eval_topk)
    cumulative = [[sum(a[: r + 1]) for r in range(len(a))] for a in acc]
    return {"examples": len(eval_ex), "labels_per_head": counts, "rank_accuracy": acc,
            "topk_accuracy": cumulative,
            "top1": [c[0] for c in cumulative], "top5": [c[min(4, len(c) - 1)] for c in cumulative]}


def finish(run, eval_ex: list[dict], state: dict) -> dict:
    """Write the run's outputs (rank 0; the others wait) and say where they are."""
    cfg, d = run.cfg, run.d
    heads_dir = run.run_dir / "heads"
    result = {"rank": d.rank, "run_dir": str(run.run_dir), "heads_dir": str(heads_dir), "step": state.get("step"),
              **{k: state[k] for k in ("table_seconds", "train_seconds", "trained_positions") if k in state}}
    if not d.main:
        d.barrier()
        return result
    run.objective.eval()
    report = evaluate(run, eval_ex) if cfg.evaluate else {}
    report["step"] = state.get("step")
    if cfg.heads.candidates and run.answer_counts is not None:
        top = torch.argsort(run.answer_counts, descending=True, stable=True)[: cfg.heads.candidates]
        run.objective.heads.set_candidates(top.sort().values)
    write_heads_dir(run, heads_dir, report)
    latest = ckpt.latest_checkpoint(run.run_dir / "checkpoints")
    if latest is not None:
        write_json_atomic(latest / "eval.json", report)
        result["checkpoint"] = str(latest)
    result.update(run.strategy.outputs(run.run_dir))
    d.barrier()
    measured = "rank_accuracy" in report
    result.update(accuracy=report.get("topk_accuracy", []), history=state.get("history", []), eval=report,
                  trees=[str(heads_dir / "trees" / f"tree-{b}.yaml") for b in cfg.tree_budgets if measured],
                  model=cfg.model)
    return result


def write_heads_dir(run, heads_dir: Path, report: dict) -> None:
    """heads, eval.json, train_config.yaml, trees/ (when measured) and the strategy's state, atomically."""
    def fill(tmp: Path) -> None:
        run.objective.heads.save(tmp)
        (tmp / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "train_config.yaml").write_text(yaml.safe_dump(run.cfg.model_dump(), sort_keys=False))
        if "rank_accuracy" in report:
            write_trees(report["rank_accuracy"], run.cfg.tree_budgets, tmp / "trees")
        run.strategy.save(tmp)

    atomic_dir(heads_dir, fill)


def write_trees(accuracy: list[list[float]], budgets: list[int], directory: Path) -> list[Path]:
    """tree-{budget}.yaml from measured head accuracies (medusa.decoding.trees.tree.build_tree)."""
    from medusa.decoding.trees.tree import build_tree

    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for budget in budgets:
        tree = build_tree(accuracy, budget, name=f"tree-{budget}")
        lines = [f"# {budget}-node tree (root not counted), greedy construction from the measured per-head",
                 "# top-k accuracies of the heads this directory belongs to (../eval.json).",
                 "# Each path lists top-k ranks: [i, j] = head 1's i-th token, then head 2's j-th.", "paths:"]
        lines += [f"  - {list(p)}" for p in tree.nodes]
        path = directory / f"tree-{budget}.yaml"
        write_text_atomic(path, "\n".join(lines) + "\n")
        out.append(path)
    return out
