"""How good a feature head is: held-out rank accuracy per draft step, the tau it predicts for a dynamic
tree, and tau measured by decoding with it (`medusa train-feature`, at intervals and at the end)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from medusa.io import write_json_atomic
from medusa.train.feature_data import Features, draft_map, extract, feature_fn
from medusa.train.feature_loss import shifted, unrolled

if TYPE_CHECKING:
    from medusa.train.feature import FeatureTrainConfig


def evaluate_saved(cfg: FeatureTrainConfig, head_dir: str | Path) -> dict:
    """Measure the head in `head_dir` again on `cfg`'s held-out split (e.g. at more draft steps) and
    rewrite its eval.json, keeping what the training recorded there (steps, trained positions)."""
    from medusa.decoding.proposers.feature_heads import FeatureHead
    from medusa.decoding.target.model import load_target
    from medusa.train.data import load_examples, split_groups
    from medusa.train.feature import chunk_groups

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    hf, tokenizer = load_target(cfg.model, cfg.dtype, "cpu" if not torch.cuda.is_available() else None)
    hf.eval().requires_grad_(False)
    _, held = split_groups(cfg, chunk_groups(cfg, load_examples(cfg, tokenizer)))
    head = FeatureHead.load(head_dir, hf).float()
    full_to_draft = draft_map(head.config.vocab_size, head.draft_ids)
    path = Path(head_dir) / "eval.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    report = {k: v for k, v in old.items() if k in ("step", "trained_tokens", "extract_seconds")}
    report = evaluate_head(head, cfg, hf, feature_fn(hf, cfg.head.feature_layers), held, full_to_draft) | report
    write_json_atomic(path, report)
    return report


def predicted_tau(tree: str, report: dict) -> float:
    """The tokens per step a `tree` (dynamic-N[xD[xK]]) of this head is expected to accept, from its
    held-out rank accuracies (what auto mode plans with)."""
    from medusa.decoding.trees.dynamic_tree import parse_shape
    from medusa.decoding.trees.dynamic_tree import expected_tau_dynamic

    return expected_tau_dynamic(parse_shape(tree), report["rank_accuracy"])


@torch.no_grad()
def measure_tau(cfg: FeatureTrainConfig, hf, tokenizer, head, held: list[dict]) -> float:
    """Tokens per step when the head drafts `cfg.tau_tree` for the target, greedy, over the first
    `measure_tau_prompts` held-out prompts (`measure_tau_tokens` new tokens each)."""
    from medusa.decoding.engine import Engine
    from medusa.decoding.target.transformer import Transformer
    from medusa.runtime.feature import feature_proposer
    from medusa.runtime.runtime import Runtime, eos_ids

    head.eval()
    prompts = [e["input_ids"][: e["loss_mask"].index(1)] for e in held[: cfg.measure_tau_prompts] if 1 in e["loss_mask"]]
    model = Transformer(hf)
    rt = Runtime(hf, tokenizer, model, Engine(model, eos_ids(hf, tokenizer)), None, feature=head)
    proposer = feature_proposer(rt, cfg.tau_tree)
    steps = rows = 0.0
    for p in prompts:  # one at a time: tau at batch size 1, as the expectation is
        gen = rt.engine.generate([p], cfg.measure_tau_tokens, proposer)
        steps += gen.stats.mean_accepted * gen.stats.row_steps
        rows += gen.stats.row_steps
    return steps / max(rows, 1)


@torch.no_grad()
def other_answers(cfg: FeatureTrainConfig, hf, tokenizer) -> list[dict]:
    """The target's greedy answers to the first `other_prompts_count` prompts of `cfg.other_prompts`
    (`other_answer_tokens` new tokens each, decoded together), as held-out sequences (input_ids, loss_mask).
    Written once to run_dir/other_answers.json and read back from there after (a resumed run, a later
    evaluation), so every report of a run counts the same texts."""
    from medusa.decoding.engine import Engine
    from medusa.decoding.target.transformer import Transformer
    from medusa.prompts import load_prompts
    from medusa.runtime.runtime import Runtime, eos_ids

    path = Path(cfg.run_dir) / "other_answers.json"
    if path.is_file():
        return json.loads(path.read_text())["sequences"]
    model = Transformer(hf)
    rt = Runtime(hf, tokenizer, model, Engine(model, eos_ids(hf, tokenizer)), None)
    prompts = rt.encode(load_prompts(cfg.other_prompts, cfg.other_prompts_count))
    gen = rt.engine.generate(prompts, cfg.other_answer_tokens)
    sequences = [{"input_ids": list(p) + list(o.tokens), "loss_mask": [0] * len(p) + [1] * len(o.tokens)}
                 for p, o in zip(prompts, gen.outputs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"source": cfg.other_prompts, "answer_tokens": cfg.other_answer_tokens,
                             "sequences": sequences})
    return sequences


@torch.no_grad()
def evaluate_head(head, cfg: FeatureTrainConfig, hf, fn, held: list[dict], full_to_draft: torch.Tensor,
                  feats: Features | None = None, examples: int | None = None) -> dict:
    """Held-out rank accuracy per draft step (step j: the head's own j previous outputs as features), the
    target's greedy token as the label. rank_accuracy[j][r] = P(label is the head's rank-r token at depth
    j + 1 | the path to it was accepted), counted along the chain the head drafts from each position
    (`rank_paths`, `path_accuracy`): what a tree's node is accepted with once its parent is, as
    `expected_tau_dynamic` multiplies them. `top1` / `topk_accuracy` / `marginal_rank_accuracy`: the same
    per depth over every position, accepted path or not.
    `feats`: the held-out features when already extracted; `examples`: the first that many sequences only."""
    if not held:
        return {}
    head.eval()
    feats = feats if feats is not None else extract(held, fn)
    steps = max(cfg.loss.unroll, cfg.eval_steps)
    k = cfg.eval_topk
    paths = rank_paths(head, feats, full_to_draft, steps, k, examples)
    acc = path_accuracy(paths, k)
    marginal = marginal_accuracy(paths, k)
    return {"examples": min(len(held), examples or len(held)),
            "labels_per_step": [int((paths[:, j] >= 0).sum()) for j in range(steps)],
            "rank_accuracy": acc, "rank_accuracy_given": "the path accepted: ranks below eval_topk at every depth before",
            "marginal_rank_accuracy": marginal, "top1": [a[0] for a in marginal],
            "topk_accuracy": [[sum(a[: r + 1]) for r in range(len(a))] for a in marginal]}


@torch.no_grad()
def rank_paths(head, feats: Features, full_to_draft: torch.Tensor, depth: int, k: int,
               examples: int | None = None, scores: bool = False):
    """[P, depth] long: for every position o with a label (o + 2 an answer token), the rank of the target's
    token at each draft depth along the chain the head drafts from o (depth d: unrolled step d - 1 at
    position o + d - 1, reading the head's own outputs and the true tokens, as a drafted path that is
    still being accepted reads them). Rank k: not among the head's top k; -1: no label (past the answer).
    `scores`: also [P, depth, k], the head's log-probabilities of its top k tokens there."""
    head.eval()
    dev = full_to_draft.device
    out, logq = [], []
    for i in range(min(len(feats), examples or len(feats))):
        f, tok, ans, top, _ = (x.to(dev) for x in feats.batch([i], 1 << 30))
        t = f.shape[1]
        if t < 4:
            continue
        emb = head.embed(shifted(tok)).float()
        lab = full_to_draft[shifted(top)][0]
        label_ok = torch.zeros(1, t, dtype=torch.bool, device=dev)
        label_ok[:, : t - 2] = ans[:, 2:]
        ranks = torch.full((t, depth), -1, dtype=torch.long, device=dev)
        lq = torch.zeros(t, depth, k, device=dev) if scores else None
        for j, o, ok in unrolled(head, emb, f[..., : head.config.feature_dim], label_ok, depth):
            logits = head.logits(o)[0].float()
            top = (torch.log_softmax(logits, -1) if scores else logits).topk(k, -1)
            hit = top.indices == lab[:, None]  # [T, k]
            r = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(lab, k))
            ranks[: t - j, j] = torch.where(ok[0], r, -1)[j:]  # step j at position s: the chain from s - j
            if scores:
                lq[: t - j, j] = top.values[j:]
        out.append(ranks[label_ok[0]].cpu())
        if scores:
            logq.append(lq[label_ok[0]].cpu())
    ranks = torch.cat(out) if out else torch.zeros(0, depth, dtype=torch.long)
    return (ranks, torch.cat(logq) if logq else torch.zeros(0, depth, k)) if scores else ranks


def path_accuracy(paths: torch.Tensor, k: int) -> list[list[float]]:
    """Rank accuracy per depth among the positions whose path was accepted up to the depth before (their
    ranks there all below k): what a tree's node at that depth is accepted with, given its parent was."""
    out = []
    alive = torch.ones(paths.shape[0], dtype=torch.bool)
    for j in range(paths.shape[1]):
        r = paths[alive & (paths[:, j] >= 0), j]
        out.append([float((r == i).float().mean()) if len(r) else 0.0 for i in range(k)])
        alive &= (paths[:, j] >= 0) & (paths[:, j] < k)
    return out


def marginal_accuracy(paths: torch.Tensor, k: int) -> list[list[float]]:
    """Rank accuracy per depth over every position with a label there, whether or not its path was
    accepted up to that depth (multiplying these treats the depths as independent)."""
    out = []
    for j in range(paths.shape[1]):
        r = paths[paths[:, j] >= 0, j]
        out.append([float((r == i).float().mean()) if len(r) else 0.0 for i in range(k)])
    return out
