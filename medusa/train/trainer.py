"""Training loop for Medusa heads: Medusa-1 from cached hidden states or live forwards, Medusa-2 with LoRA.

One process, `torchrun` (DDP over gloo/nccl) or `deepspeed` (ZeRO 1/2) run the same code. Every process
sees the same global batch order (seeded per epoch) and takes its slice; losses are normalised by the
global label count, so N processes compute the same update as one. The loop is one path over a batch
iterator (medusa.train.batches); what it trains is its strategy's (medusa.train.strategy, medusa2).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.decoding.target.model import load_target
from medusa.train import checkpoint as ckpt
from medusa.train.batches import Batches, SequenceBatches, TableBatches, cached_tables
from medusa.train.config import TrainConfig
from medusa.train.data import load_examples, split_groups
from medusa.train.dist import Dist, init_dist
from medusa.train.hidden import hf_hidden_fn, table_hidden_fn
from medusa.train.logs import Logger, merge_stats
from medusa.train.objective import HeadObjective
from medusa.train.optim import Stepper
from medusa.train.outputs import finish
from medusa.train.strategy import HeadsOnly


@dataclass
class Run:
    cfg: TrainConfig
    d: Dist
    hf_model: object
    tokenizer: object
    objective: HeadObjective
    strategy: HeadsOnly                                # what trains: heads, or heads + LoRA (Medusa2)
    meta: dict
    run_dir: Path
    history: list = field(default_factory=list)
    answer_counts: torch.Tensor | None = None          # token frequencies of the training answers


def run_training(cfg: TrainConfig, eval_only: bool = False, prepare_only: bool = False) -> dict:
    torch.manual_seed(cfg.seed)
    d = init_dist(bool(cfg.deepspeed))
    hf_model, tokenizer = load_target(cfg.model, cfg.dtype, d.device)
    if d.world > 1 and d.main:
        print(f"training in {d.world} processes (world size {d.world}, rank 0 on {d.device})", file=sys.stderr,
              flush=True)
    run = make_run(cfg, d, hf_model, tokenizer)
    train_groups, eval_ex = split_groups(cfg, load_examples(cfg, tokenizer))
    if prepare_only:
        if cfg.cache_hidden:
            _table(run, train_groups)
        return {"rank": d.rank, "prepared": [name for name, _ in train_groups]}
    state = train_heads(run, train_groups, eval_only)
    return finish(run, eval_ex, state)


def make_run(cfg: TrainConfig, d: Dist, hf_model, tokenizer) -> Run:
    """Heads on the target (with a LoRA adapter for Medusa-2), their objective and strategy."""
    if cfg.medusa2.enabled:
        from medusa.train.medusa2 import add_lora

        hf_model = add_lora(hf_model, cfg.medusa2)
    base = hf_model.get_base_model() if hasattr(hf_model, "get_base_model") else hf_model
    hcfg = HeadsConfig(hidden_size=base.config.hidden_size, vocab_size=base.get_output_embeddings().weight.shape[0],
                       num_heads=cfg.heads.num_heads, num_layers=cfg.heads.num_layers,
                       own_lm_head=cfg.heads.own_lm_head, base_model=getattr(base, "name_or_path", cfg.model))
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(hcfg, base.get_output_embeddings()).float().to(d.device)
    objective = HeadObjective(heads, base.get_output_embeddings().weight, cfg.head_weights(), cfg.loss.kind,
                              cfg.loss.kl_temperature)
    if cfg.medusa2.enabled:
        from medusa.train.medusa2 import Medusa2

        strategy = Medusa2(objective, cfg, hf_model, tokenizer)
    else:
        strategy = HeadsOnly(objective, cfg)
    meta = {"base": ckpt.base_fingerprint(base, hcfg.base_model), "heads": asdict(hcfg) | {"base_model": None},
            "medusa2": cfg.medusa2.enabled}
    return Run(cfg, d, hf_model, tokenizer, objective, strategy, meta, Path(cfg.run_dir))


def _table(run: Run, groups: list[tuple[str, list[dict]]]):
    return cached_tables(groups, run.meta["base"], run.cfg.dtype, run.run_dir / "hidden", run.d,
                         table_hidden_fn(run.hf_model, run.d.device))


def make_batches(run: Run, groups: list[tuple[str, list[dict]]]) -> Batches:
    """Positions of the cached hidden-state table, or sequences the target (or the strategy) runs on."""
    if run.cfg.cache_hidden:
        return TableBatches(run.cfg, run.d, _table(run, groups))
    examples = [e for _, exs in groups for e in exs]
    hidden_fn = None if run.strategy.runs_base else hf_hidden_fn(run.hf_model)
    return SequenceBatches(run.cfg, run.d, examples, hidden_fn)


def restrict_vocab(run: Run, answers: torch.Tensor) -> None:
    """Count the answer tokens (the exported candidates) and, with loss.vocab_subset, train the softmax over
    them plus the lowest ids."""
    vocab = run.objective.projection[0].shape[0]
    run.answer_counts = torch.bincount(answers, minlength=vocab)
    if run.cfg.loss.vocab_subset is not None:
        run.objective.restrict_vocab(torch.cat([answers, torch.arange(min(run.cfg.loss.vocab_subset, vocab))]))
        run.objective.remap = run.objective.remap.to(run.d.device)  # indexed by labels on the rank's device


def train_heads(run: Run, groups: list[tuple[str, list[dict]]], eval_only: bool) -> dict:
    """Resume from the latest checkpoint, then step until the configured total."""
    t0 = time.perf_counter()
    batches = make_batches(run, groups)
    table_seconds = time.perf_counter() - t0 if run.cfg.cache_hidden else 0.0
    total = batches.total_steps()
    restrict_vocab(run, batches.answers())
    stepper = Stepper(run.cfg, run.d, run.strategy.module, run.strategy.param_groups(), total)
    step = ckpt.resume(run, stepper)
    if eval_only:
        return {"step": step, "total": total}
    logger = Logger(run.cfg, run.d, run.run_dir, run.history, total)
    trained, train_seconds = 0, 0.0
    steps = batches.steps(step, total)
    while step < total:
        start = time.perf_counter()
        batch = next(steps)
        agg = None
        for micro in batch.micro:
            loss, stats = run.strategy.loss(stepper.model, micro, step)
            stepper.backward(loss)
            agg = merge_stats(agg, loss, stats)
        stepper.step()
        step += 1
        seconds = time.perf_counter() - start
        trained, train_seconds = trained + batch.positions, train_seconds + seconds
        logger.log(step, agg, stepper.lr(), batch.positions, seconds)
        if step % run.cfg.checkpoint_every == 0 or step == total:
            ckpt.save(run, stepper, step)
        fault_injection(step)
    logger.close()
    return {"step": step, "total": total, "history": run.history, "table_seconds": table_seconds,
            "train_seconds": train_seconds, "trained_positions": trained}


def fault_injection(step: int) -> None:
    """MEDUSA_TRAIN_KILL_AFTER_STEP=N: SIGKILL this process after step N (how the resume test crashes)."""
    if os.environ.get("MEDUSA_TRAIN_KILL_AFTER_STEP") == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
