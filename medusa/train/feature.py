"""`medusa train-feature`: train a feature head (EAGLE-style) on a frozen target.

Data. Every training sequence (chat prompt + answer: ShareGPT's own answers, `data.use: source`, or the
target's distilled answers, `data.use: distilled`) goes through the frozen target once; its features and
the target's greedy next token at every position are cached (medusa.train.feature_data).

The objective (medusa.train.feature_loss): the head predicts the next feature and the target's distribution,
unrolled over its own outputs (EAGLE-3 / HASS), exactly what a j-deep draft sees. Batches hold sequences of
similar lengths (`group_by_length`), in one process or several (`_train`). Checkpoints (`train/checkpoint.py`,
resumable by re-running the command), wandb (offline by default), `run_dir/head/` (the head, eval.json with
per-step rank accuracies and tau, medusa.train.feature_eval, and train_config.yaml) at the end.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import Field, field_validator, model_validator

from medusa.errors import MedusaError
from medusa.io import atomic_dir, read_yaml, validate
from medusa.train import checkpoint as ckpt
from medusa.train.config import OptimConfig, RunConfig, StrictConfig, WandbConfig, apply_overrides
from medusa.train.data import load_examples, split_groups
from medusa.train.dist import Dist, shard_target
from medusa.train.feature_data import (Features, OnlineFeatures, cached_features, draft_map, draft_vocabulary,
                                       extract, extract_missing, feature_fn, sequence_order)
from medusa.train.feature_eval import evaluate_head, evaluate_saved, measure_tau, other_answers, predicted_tau  # noqa: F401
from medusa.train.feature_loss import head_loss, step_counts, unrolled, unrolled_mask  # noqa: F401
from medusa.train.hidden import table_key
from medusa.train.logs import start_wandb
from medusa.train.optim import Stepper
from medusa.train.trainer import fault_injection
from medusa.train.feature_state import load_state, resume_point, save_state


class HeadSection(StrictConfig):
    style: Literal["eagle1", "eagle3"] = "eagle1"
    feature_layers: list[int] = Field(default_factory=list)
    draft_vocab: int = Field(default=8192, gt=0)       # the most frequent answer tokens (+ ids below 256)


class FeatureLoss(StrictConfig):
    feature_weight: float = Field(default=1.0, ge=0.0)
    ce_weight: float = Field(default=0.1, ge=0.0)
    unroll: int = Field(default=3, ge=1, le=8)            # draft steps trained per position (1: EAGLE-1)
    decay: float = Field(default=0.8, gt=0.0, le=1.0)
    noise: float = Field(default=0.1, ge=0.0)             # uniform noise half-width on input features


class FeatureTrainConfig(RunConfig):
    dtype: Literal["bf16", "fp32"] = "bf16"
    run_dir: str = "runs/feature"
    head: HeadSection = Field(default_factory=HeadSection)
    loss: FeatureLoss = Field(default_factory=FeatureLoss)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    batch_size: int = Field(default=8, gt=0)              # sequences per step
    group_by_length: bool = True                          # feature_data.sequence_order
    chunk: int = Field(default=128, gt=0)                 # sequences per cached feature file
    epochs: float = Field(default=1.0, gt=0.0)
    max_steps: int | None = Field(default=None, gt=0)
    max_train_tokens: int | None = Field(default=None, gt=0)  # stop after this many trained positions
    checkpoint_every: int = Field(default=100, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    log_every: int = Field(default=10, gt=0)
    eval_topk: int = Field(default=10, gt=0, le=50)
    # Draft steps the held-out accuracy is measured at (at least loss.unroll): auto mode plans a tree's depth
    # from them, so a head is measured as deep as it will draft.
    eval_steps: int = Field(default=6, ge=1, le=12)
    threads: int | None = Field(default=None, gt=0)
    # Matmuls of the training step: bf16 under autocast with fp32 master weights and fp32 losses, or
    # fp32 throughout; auto: bf16 where the device multiplies bf16 natively (medusa.decoding.target.hardware).
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # Where a run with no checkpoint of its own starts: a checkpoint directory (`.../checkpoints/step-N`) or a
    # run directory (its latest checkpoint), e.g. one committed from another machine (`--resume PATH`).
    resume_from: str | None = None
    # DeepSpeed JSON config (ZeRO-1/2) for runs of several processes; without it they sum their gradients
    # themselves (torchrun, `accelerate launch`, or the deepspeed launcher without a config).
    deepspeed: str | None = None
    # Where the target's features come from: `offline` caches them under run_dir/features/ first (extracted
    # once, reused by every epoch and every later run); `online` runs the frozen target inside each training
    # step on that step's sequences, caching nothing (for targets whose cache would not fit the disk: see
    # docs/feature-heads.md, "Features online or cached").
    features: Literal["offline", "online"] = "offline"
    # How the frozen target is held when several processes compute features online: `replicate` (a whole
    # copy in every process) or `fsdp` (FSDP2 `fully_shard` over all processes: each keeps 1/N of every
    # weight and gathers one decoder layer at a time during the step's target pass; for targets that do not
    # fit one device). See docs/feature-heads.md, "A target too large for one device".
    target_sharding: Literal["replicate", "fsdp"] = "replicate"
    # Acceptance while training: every `eval_every` steps (None: at the end only) the held-out rank accuracy
    # on up to `eval_examples` held-out sequences and the tau it predicts for `tau_tree` (logged to the console
    # and wandb); at the end, that prediction beside tau measured by decoding `measure_tau_prompts` held-out
    # prompts (`measure_tau_tokens` new tokens each, greedy, the head drafting `tau_tree`; 0: not measured).
    eval_every: int | None = Field(default=None, gt=0)
    eval_examples: int = Field(default=256, gt=0)
    tau_tree: str = "dynamic-16x5"
    measure_tau_prompts: int = Field(default=8, ge=0)
    measure_tau_tokens: int = Field(default=64, gt=0)
    # A second prediction, for prompts unlike the training data: the held-out split comes from the training
    # sources, so its tau is the head's best case. With `other_prompts` (a prompt source: `heldout`, six task
    # kinds no training source holds, or a file), the target's greedy answers to the first
    # `other_prompts_count` of them (`other_answer_tokens` each, written once to run_dir/other_answers.json)
    # are counted as the split is, and each report carries `expected_tau_other` beside `expected_tau`.
    other_prompts: str | None = None
    other_prompts_count: int = Field(default=48, gt=0)
    other_answer_tokens: int = Field(default=128, gt=0)

    @field_validator("tau_tree")
    @classmethod
    def _dynamic(cls, v: str) -> str:
        from medusa.decoding.trees.dynamic_tree import is_dynamic, parse_shape

        if not is_dynamic(v):
            raise ValueError(f"{v!r}: feature heads grow dynamic trees (dynamic-N, dynamic-NxD, dynamic-NxDxK)")
        parse_shape(v)
        return v

    @model_validator(mode="after")
    def _sharding(self) -> FeatureTrainConfig:
        if self.target_sharding == "fsdp" and self.features != "online":
            raise ValueError("target_sharding: fsdp shards the target that runs inside each training step; "
                             "it needs features: online (an offline cache is extracted by whole targets)")
        if self.target_sharding == "fsdp" and self.deepspeed:
            raise ValueError("target_sharding: fsdp is not combined with deepspeed (ZeRO shards the head's "
                             "optimizer, FSDP2 the target); use one of them")
        return self


def load_feature_config(path: str | Path, overrides: list[str] | None = None) -> FeatureTrainConfig:
    data = apply_overrides(read_yaml(path), overrides)
    if "mtbench" in (data.get("data") or {}).get("sources", []):
        raise MedusaError("data.sources: 'mtbench' is the evaluation set and cannot be trained on")
    return validate(FeatureTrainConfig, data, str(path))


# ---- the run --------------------------------------------------------------------------------------


def chunk_groups(cfg: FeatureTrainConfig, groups: list[tuple[str, list[dict]]]) -> list[tuple[str, list[dict]]]:
    """Each group cut into named chunks of `cfg.chunk` sequences (one cached feature file each)."""
    out = []
    for name, exs in groups:
        for c in range(0, len(exs), cfg.chunk):
            out.append((f"{name}-{c // cfg.chunk:04d}", exs[c: c + cfg.chunk]))
    return out


def training_features(cfg: FeatureTrainConfig, groups, base: dict, fn, progress: bool, d: Dist | None = None) -> Features:
    """Every chunk's cached features. The missing ones are extracted first (several chunks per extraction,
    `extract_missing`); with several processes each takes every world-th chunk (the target runs in all of
    them at once). Then all read every chunk from the shared run directory."""
    d = d or Dist()
    run_dir = Path(cfg.run_dir)
    keyed = [(name, table_key(base, cfg.dtype, cfg.head.feature_layers, name, [e["input_ids"] for e in exs]), exs)
             for name, exs in groups]
    extract_missing(run_dir, keyed[d.rank::d.world], fn, progress and d.main)
    if d.world > 1:
        d.barrier()
    return Features.cat([cached_features(run_dir, name, key, lambda exs=exs: extract(exs, fn))
                         for name, key, exs in keyed])


def make_head(cfg: FeatureTrainConfig, hf, feats: Features, resume: Path | None):
    """A new head for the target and the map from full token ids to draft ids (-1: outside it). Its draft
    vocabulary: the most frequent answer tokens, or the checkpoint's when the run resumes (the data may have
    grown since, and the state trained on those ids)."""
    from safetensors.torch import load_file

    from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig

    if resume is None:
        ids = draft_vocabulary(torch.bincount(feats.answer_tokens(), minlength=hf.config.vocab_size),
                               cfg.head.draft_vocab)
    else:
        ids = load_file(str(resume / "head" / "feature_head.safetensors"))["draft_ids"]
    hcfg = FeatureHeadConfig(hf.config.hidden_size, hf.get_output_embeddings().weight.shape[0], len(ids),
                             style=cfg.head.style, feature_layers=list(cfg.head.feature_layers),
                             base_model=str(getattr(hf, "name_or_path", cfg.model)))
    torch.manual_seed(cfg.seed)
    head = FeatureHead(hcfg, hf, ids).float()
    return head, draft_map(hcfg.vocab_size, ids)


def run_feature_training(cfg: FeatureTrainConfig, progress: bool = True, prepare_only: bool = False) -> dict:
    from medusa.decoding.target.model import load_target
    from medusa.train.dist import init_dist

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    d = init_dist(bool(cfg.deepspeed))
    if cfg.batch_size < d.world:
        raise MedusaError(f"batch_size: {cfg.batch_size} sequences cannot be shared by {d.world} processes; "
                          f"use at least {d.world}")
    if d.world > 1 and d.main:
        print(f"training in {d.world} processes (world size {d.world}, rank 0 on {d.device})", file=sys.stderr,
              flush=True)
    sharded = cfg.target_sharding == "fsdp" and d.world > 1
    if cfg.target_sharding == "fsdp" and d.world == 1:
        print("target_sharding: fsdp with one process: nothing to shard, the target stays whole", file=sys.stderr,
              flush=True)
    # A target to be sharded is read into host memory, and fully_shard moves each process's shards to its
    # device: the whole target never sits on one device.
    hf, tokenizer = load_target(cfg.model, cfg.dtype, "cpu" if sharded else d.device)
    hf.eval().requires_grad_(False)
    train_groups, held = split_groups(cfg, chunk_groups(cfg, load_examples(cfg, tokenizer)))
    base = ckpt.base_fingerprint(hf, cfg.model)
    fn = feature_fn(hf, cfg.head.feature_layers)
    t0 = time.perf_counter()
    if cfg.features == "online":
        if prepare_only:
            raise MedusaError("--prepare-only caches features; with features: online there is nothing to cache")
        feats = OnlineFeatures([e for _, exs in train_groups for e in exs], fn, d.device)
    else:
        feats = training_features(cfg, train_groups, base, fn, progress, d)
    extract_seconds = time.perf_counter() - t0
    if prepare_only:
        return {"sequences": len(feats), "positions": feats.positions(), "seconds": extract_seconds}
    point = resume_point(Path(cfg.run_dir), cfg.resume_from)
    head, full_to_draft = make_head(cfg, hf, feats, point)
    head, full_to_draft = head.to(d.device), full_to_draft.to(d.device)
    meta = {"base": base, "heads": asdict(head.config) | {"base_model": None}}
    held_features: list[Features] = []  # the held-out features, extracted on first use and kept
    if sharded:
        shard_target(hf, head, d)
        if held:  # every process runs the (sharded) target over them; rank 0 keeps them for its evaluations
            held_features.append(extract(held, fn))
            if not d.main:
                held_features.clear()

    other: list[tuple[list[dict], Features]] = []  # the other prompts' answers and features, made on first use

    def acceptance(step: int, examples: int | None) -> dict:
        if not held_features:
            held_features.append(extract(held, fn))
        report = evaluate_head(head, cfg, hf, fn, held, full_to_draft, held_features[0], examples)
        report["expected_tau"] = {cfg.tau_tree: round(predicted_tau(cfg.tau_tree, report), 3)} if report else {}
        line = ""
        if report and cfg.other_prompts and not sharded:  # answering needs the target whole in one process
            if not other:
                answers = other_answers(cfg, hf, tokenizer)
                other.append((answers, extract(answers, fn)))
            rest = evaluate_head(head, cfg, hf, fn, other[0][0], full_to_draft, other[0][1], examples)
            report["expected_tau_other"] = {cfg.tau_tree: round(predicted_tau(cfg.tau_tree, rest), 3)}
            report["other_prompts"] = {"source": cfg.other_prompts, "examples": rest["examples"],
                                       "rank_accuracy": rest["rank_accuracy"]}
            line = f", on {cfg.other_prompts} prompts {report['expected_tau_other'][cfg.tau_tree]:.2f}"
        if report and d.main:
            print(f"step {step} held-out top-1 [{' '.join(f'{a:.3f}' for a in report['top1'][:cfg.loss.unroll + 1])}] "
                  f"expected tau ({cfg.tau_tree}) {report['expected_tau'][cfg.tau_tree]:.2f}{line}", file=sys.stderr,
                  flush=True)
        return report

    t0 = time.perf_counter()
    step, trained = _train(cfg, head, feats, full_to_draft, meta, point, d, acceptance if held else None)
    train_seconds = time.perf_counter() - t0
    if not d.main:  # rank 0 measures and writes the head
        d.barrier()
        return {"rank": d.rank, "step": step, "trained_tokens": trained, "train_seconds": train_seconds}
    report = acceptance(step, None) if held else {}
    if report and cfg.measure_tau_prompts and sharded:
        print("measured tau: not measured with a sharded target (decoding needs it whole in one process); "
              "measure the head afterwards with `medusa eval` or benchmarks/feature_tau.py", file=sys.stderr,
              flush=True)
    elif report and cfg.measure_tau_prompts:
        report["measured_tau"] = {cfg.tau_tree: round(measure_tau(cfg, hf, tokenizer, head, held), 3)}
        print(f"tau ({cfg.tau_tree}): expected {report['expected_tau'][cfg.tau_tree]:.2f}, measured "
              f"{report['measured_tau'][cfg.tau_tree]:.2f} decoding {min(cfg.measure_tau_prompts, len(held))} "
              f"held-out prompts", file=sys.stderr, flush=True)
    report.update(step=step, trained_tokens=trained, extract_seconds=round(extract_seconds, 1))
    out = Path(cfg.run_dir) / "head"

    def fill(tmp: Path) -> None:
        head.save(tmp)
        (tmp / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "train_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))

    atomic_dir(out, fill)
    d.barrier()
    return {"run_dir": str(Path(cfg.run_dir)), "head_dir": str(out), "step": step, "trained_tokens": trained,
            "train_seconds": train_seconds, "eval": report, "world_size": d.world}


def step_autocast(precision: str, device: torch.device) -> torch.autocast:
    """The autocast context of a training step: bf16 matmuls (fp32 master weights) when `precision` says
    bf16, or says auto and the device multiplies bf16 natively; disabled otherwise."""
    from medusa.decoding.target.hardware import machine

    bf16 = precision == "bf16" or (precision == "auto" and machine(device).native_bf16)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def _train(cfg: FeatureTrainConfig, head, feats: Features, full_to_draft: torch.Tensor, meta: dict,
           point: Path | None, d: Dist | None = None, acceptance=None) -> tuple[int, int]:
    """Step until max_steps / epochs / max_train_tokens (resuming from checkpoint `point`, if any); returns the
    step reached and the positions trained.

    Several processes: every one draws the same global batch of `batch_size` sequences and takes every
    world-th of them; each step's loss is averaged over the whole batch's labels (`step_counts` summed over
    the processes) and the gradients are summed, so N processes make the update one process makes, and a
    checkpoint (the head, AdamW and the schedule, written by rank 0) resumes at any process count.
    `acceptance(step, examples)`: rank 0's held-out report, every `eval_every` steps (logged to wandb)."""
    d = d or Dist()
    run_dir = Path(cfg.run_dir)
    per_epoch = max(1, len(feats) // cfg.batch_size)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
    stepper = Stepper(cfg, d, head, [{"params": [p for p in head.parameters() if p.requires_grad],
                                      "lr": cfg.optim.lr}], total, ddp=False)
    step, trained, history = load_state(point, head, stepper, meta, d)
    autocast = step_autocast(cfg.precision, next(head.parameters()).device)
    wb = start_wandb(cfg, run_dir) if step < total and d.main else None
    lengths, order, seen = feats.lengths().clamp(max=cfg.data.max_seq_tokens), None, None
    while step < total and (cfg.max_train_tokens is None or trained < cfg.max_train_tokens):
        epoch, within = divmod(step, per_epoch)
        if epoch != seen:
            seen, order = epoch, sequence_order(cfg.seed, epoch, lengths, cfg.batch_size if cfg.group_by_length else 0)
        pick = order[within * cfg.batch_size: (within + 1) * cfg.batch_size].tolist()[d.rank:: d.world]
        start = time.perf_counter()
        head.train()
        batch = [x.to(d.device) for x in feats.batch(pick, cfg.data.max_seq_tokens)]
        counts = d.all_reduce(step_counts(batch[2], batch[4], cfg.loss.unroll)) if d.world > 1 else None
        with autocast:
            loss, stats = head_loss(head, cfg, *batch, full_to_draft, counts=counts)
        stepper.backward(loss)
        stepper.step()
        if d.world > 1:  # the whole batch's loss and hits, for the log
            n = len(stats)
            total_stats = d.all_reduce(torch.tensor([float(loss.detach())] + [float(c) for c, _ in stats]
                                                    + [float(m) for _, m in stats], dtype=torch.float64))
            loss = total_stats[0]
            stats = [(int(total_stats[1 + j]), int(total_stats[1 + n + j])) for j in range(n)]
        step, trained = step + 1, trained + stats[0][1]
        row = _log(cfg, step, total, loss, stepper.lr(), trained, stats, time.perf_counter() - start, d.main)
        history.append({"step": step, "loss": row["loss"], "trained_tokens": trained})
        if acceptance is not None and cfg.eval_every and step % cfg.eval_every == 0 and step < total and d.main:
            report = acceptance(step, cfg.eval_examples)
            head.train()
            if report:
                row.update({"eval/expected_tau": report["expected_tau"][cfg.tau_tree],
                            **({"eval/expected_tau_other": report["expected_tau_other"][cfg.tau_tree]}
                               if "expected_tau_other" in report else {}),
                            **{f"eval/step{j}/top1": a for j, a in enumerate(report["top1"])}})
        if wb is not None:
            wb.log(row, step=step)
        if step % cfg.checkpoint_every == 0 or step == total:
            save_state(run_dir, head, stepper, meta, step, trained, history, cfg.keep_checkpoints, d)
        fault_injection(step)
    if wb is not None:
        wb.finish()
    return step, trained


def _log(cfg: FeatureTrainConfig, step: int, total: int, loss: torch.Tensor, lr: float, trained: int,
         stats: list, seconds: float, show: bool = True) -> dict:
    row = {"step": step, "loss": float(loss.detach()), "lr": lr, "trained_tokens": trained,
           "tokens_per_s": stats[0][1] / max(seconds, 1e-9),
           **{f"step{j}/top1": c / max(m, 1) for j, (c, m) in enumerate(stats)}}
    if show and (step % cfg.log_every == 0 or step == 1):
        accs = " ".join(f"{row[f'step{j}/top1']:.3f}" for j in range(len(stats)))
        print(f"step {step}/{total} loss {row['loss']:.4f} top1 [{accs}] tokens {trained} "
              f"{row['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
    return row
