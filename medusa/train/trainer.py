"""Training loop for Medusa heads: Medusa-1 from cached hidden states or live forwards, Medusa-2 with LoRA.

One process, `torchrun` (DDP over gloo/nccl) or `deepspeed` (ZeRO 1/2) run the same code. Every process
sees the same global batch order (seeded per epoch) and takes its slice; losses are normalised by the
global label count, so N processes compute the same update as one.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from medusa.errors import MedusaError
from medusa.decoding.heads import HeadsConfig, MedusaHeads
from medusa.decoding.model import load_target

from medusa.io import atomic_dir, write_json_atomic, write_text_atomic
from medusa.train import checkpoint as ckpt
from medusa.train.config import TrainConfig
from medusa.train.data import example, head_labels, pad_batch, split_eval, training_pairs
from medusa.train.hidden import PositionTable, build_table, cached_table, hf_hidden_fn, table_key
from medusa.train.objective import HeadObjective, rank_accuracy


# ---- process group --------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def local_rank() -> int:
    """This process's index on its machine. torchrun, `deepspeed` and `accelerate launch` all set
    LOCAL_RANK (the deepspeed launcher also passes `--local_rank=N`, which the CLI accepts and ignores)."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise MedusaError(f"LOCAL_RANK: expected an integer, got {value!r}") from None


def rank_device(rank: int | None = None) -> torch.device:
    """The device this process trains on: `cuda:LOCAL_RANK` (made the current CUDA device, so that NCCL and
    every bare `cuda` tensor use it) when CUDA is available, else the CPU. Without this every rank would
    land on GPU 0."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    rank = local_rank() if rank is None else rank
    count = torch.cuda.device_count()
    if not 0 <= rank < count:
        raise MedusaError(f"LOCAL_RANK: {rank} but this machine has {count} visible CUDA device(s); "
                          "start at most that many processes per machine (or set CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def init_dist(cfg: TrainConfig) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # The device is chosen before the process group starts: NCCL binds each rank to the current device.
    device = rank_device()
    if world == 1:
        return Dist(device=device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if cfg.deepspeed:
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend)
        else:
            dist.init_process_group(backend)
        # A process group still alive when the interpreter tears down may abort the process ("terminate
        # called without an active exception") after training has finished: close it first.
        atexit.register(_close_process_group)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def _close_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- data -----------------------------------------------------------------------------------------
def load_examples(cfg: TrainConfig, tokenizer) -> list[tuple[str, list[dict]]]:
    """Tokenised training examples in named groups (one per distilled shard, so that the hidden-state
    cache of a shard is reused when more shards arrive): distilled answers, or the sources' own answers."""
    groups = []
    if cfg.data.use == "distilled":
        from medusa.train.distill import distill_dir, load_shards

        for name, ds in load_shards(distill_dir(cfg)):
            exs = [example(p, r, cfg.data.max_seq_tokens) for p, r in zip(ds["prompt_ids"], ds["response_ids"])]
            groups.append((name, [e for e in exs if e is not None]))
    else:
        from medusa.train.data import answer_ids, chat_prompt_ids

        eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() \
            else tokenizer.eos_token_id
        exs = []
        for prompt, answer in training_pairs(cfg.data.sources, cfg.data.limit):
            if answer:
                e = example(chat_prompt_ids(tokenizer, prompt), answer_ids(tokenizer, answer, eos),
                            cfg.data.max_seq_tokens)
                if e is not None:
                    exs.append(e)
        groups.append(("source", exs))
    if sum(len(g) for _, g in groups) < 2:
        raise MedusaError("data: fewer than 2 usable examples (distil more prompts or raise data.limit)")
    return groups


def split_groups(cfg: TrainConfig, groups: list[tuple[str, list[dict]]]):
    """Held-out examples drawn from every group; returns ([(name, train examples)], eval examples)."""
    train, held = [], []
    for name, exs in groups:
        tr, ev = split_eval(len(exs), cfg.data.eval_fraction, cfg.seed)
        train.append((name, [exs[i] for i in tr]))
        held += [exs[i] for i in ev]
    return train, held


def base_fingerprint(hf_model, name: str) -> dict:
    """What a checkpoint must match: architecture sizes and a checksum of the output projection."""
    w = hf_model.get_output_embeddings().weight
    c = hf_model.config
    return {"name": name, "hidden_size": c.hidden_size, "vocab_size": w.shape[0],
            "layers": c.num_hidden_layers, "lm_head_sum": round(float(w[:256].float().abs().sum()), 2)}


# ---- schedule -------------------------------------------------------------------------------------
def lr_lambda(cfg: TrainConfig, total: int):
    def f(step: int) -> float:
        if step < cfg.optim.warmup_steps:
            return (step + 1) / cfg.optim.warmup_steps
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.optim.warmup_steps) / max(1, total - cfg.optim.warmup_steps))
        floor = cfg.optim.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


# ---- the run --------------------------------------------------------------------------------------
@dataclass
class Run:
    cfg: TrainConfig
    d: Dist
    hf_model: object
    tokenizer: object
    objective: HeadObjective
    module: torch.nn.Module          # what the optimizer trains (objective, or objective + LoRA)
    meta: dict
    run_dir: Path
    history: list = field(default_factory=list)
    lora_params: list = field(default_factory=list)    # Medusa-2: adapter parameters (own lr)
    save_adapter: object = None                        # Medusa-2: callables writing / reading the adapter
    load_adapter: object = None
    answer_counts: torch.Tensor | None = None          # token frequencies of the training answers


def run_training(cfg: TrainConfig, eval_only: bool = False, prepare_only: bool = False) -> dict:
    torch.manual_seed(cfg.seed)
    d = init_dist(cfg)
    run_dir = Path(cfg.run_dir)
    hf_model, tokenizer = load_target(cfg.model, cfg.dtype, d.device)
    if d.world > 1 and d.main:
        print(f"training in {d.world} processes (rank 0 on {d.device})", file=sys.stderr, flush=True)
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
    meta = {"base": base_fingerprint(base, hcfg.base_model), "heads": asdict(hcfg) | {"base_model": None},
            "medusa2": cfg.medusa2.enabled}
    run = Run(cfg, d, hf_model, tokenizer, objective, objective, meta, run_dir)
    train_groups, eval_ex = split_groups(cfg, load_examples(cfg, tokenizer))
    if prepare_only:
        if cfg.cache_hidden:
            _tables(run, train_groups)
        return {"rank": d.rank, "prepared": [name for name, _ in train_groups]}
    if cfg.medusa2.enabled:
        from medusa.train.medusa2 import attach

        attach(run)
    state = train_heads(run, train_groups, eval_only)
    return finish(run, eval_ex, state)


def _tables(run: Run, groups: list[tuple[str, list[dict]]]) -> PositionTable:
    """One cached table per group (reused while that group is unchanged), concatenated."""
    cfg = run.cfg
    tables = []
    for name, exs in groups:
        key = table_key(run.meta["base"], cfg.dtype, name, len(exs), [e["input_ids"] for e in exs])
        path = run.run_dir / "hidden" / f"{name}.safetensors"
        build = lambda exs=exs: build_table(exs, _table_hidden_fn(run), progress=run.d.main)
        if run.d.world > 1:
            # One process builds the cache, the others wait and read it.
            if run.d.main:
                cached_table(path, key, build)
            run.d.barrier()
        tables.append(cached_table(path, key, build))
    return PositionTable.cat(tables)


def make_optimizer(run: Run, total: int):
    cfg = run.cfg
    groups = [{"params": [p for p in run.objective.parameters() if p.requires_grad], "lr": cfg.optim.lr}]
    extra = run.lora_params
    if extra:
        groups.append({"params": extra, "lr": cfg.medusa2.lora_lr or cfg.optim.lr})
    opt = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    return opt, sched


class Stepper:
    """Wraps DDP / DeepSpeed / plain optimizer stepping behind one interface."""

    def __init__(self, run: Run, module: torch.nn.Module, total: int):
        cfg = run.cfg
        self.run = run
        self.opt, self.sched = make_optimizer(run, total)
        self.engine = None
        self.model = module
        if run.d.world > 1 and cfg.deepspeed:
            import deepspeed

            ds_cfg = json.loads(Path(cfg.deepspeed).read_text())
            ds_cfg["gradient_accumulation_steps"] = cfg.grad_accum
            ds_cfg["train_micro_batch_size_per_gpu"] = max(1, cfg.batch_size // run.d.world)
            ds_cfg.pop("train_batch_size", None)
            ds_cfg["gradient_clipping"] = cfg.optim.grad_clip
            ds_cfg["zero_allow_untested_optimizer"] = True
            self.engine, self.opt, _, self.sched = deepspeed.initialize(
                model=module, optimizer=self.opt, lr_scheduler=self.sched, config=ds_cfg,
                model_parameters=[p for p in module.parameters() if p.requires_grad])
            self.model = self.engine
        elif run.d.world > 1:
            ids = [run.d.device.index] if run.d.device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(module, device_ids=ids, find_unused_parameters=True)

    def backward(self, loss: torch.Tensor) -> None:
        # Losses are already normalised by global counts; undo the averaging DDP / DeepSpeed apply.
        scale = self.run.d.world
        if self.engine is not None:
            # DeepSpeed divides by its accumulation count and counts micro-steps itself: step() after each
            # backward, the optimizer moves only at the accumulation boundary.
            self.engine.backward(loss * scale * self.run.cfg.grad_accum)
            self.engine.step()
        else:
            (loss * scale).backward()

    def step(self) -> None:
        if self.engine is not None:
            return  # stepped in backward()
        if self.run.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]],
                                           self.run.cfg.optim.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def state(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def load_state(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])


def train_heads(run: Run, groups: list[tuple[str, list[dict]]], eval_only: bool) -> dict:
    """The step loop: cached positions (Medusa-1 fast path) or sequence batches (plain / Medusa-2)."""
    cfg, d = run.cfg, run.d
    train_ex = [e for _, exs in groups for e in exs]
    num_heads = cfg.heads.num_heads
    t0 = time.perf_counter()
    table = _tables(run, groups) if cfg.cache_hidden else None
    table_seconds = time.perf_counter() - t0
    if table is not None:
        positions = table.trainable()
        unit = cfg.batch_size * cfg.grad_accum
        per_epoch = len(positions) // unit
        if per_epoch == 0:
            raise MedusaError(f"batch_size: {unit} positions per step exceed the {len(positions)} available")
    else:
        per_epoch = len(train_ex) // (cfg.batch_size * cfg.grad_accum)
        if per_epoch == 0:
            raise MedusaError(f"batch_size: {cfg.batch_size * cfg.grad_accum} sequences per step exceed the "
                              f"{len(train_ex)} training examples")
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
    answers = table.tokens[table.answer] if table is not None else torch.tensor(
        [t for e in train_ex for t, m in zip(e["input_ids"], e["loss_mask"]) if m], dtype=torch.long)
    vocab = run.objective.projection[0].shape[0]
    run.answer_counts = torch.bincount(answers, minlength=vocab)
    if cfg.loss.vocab_subset is not None:
        run.objective.restrict_vocab(torch.cat([answers, torch.arange(min(cfg.loss.vocab_subset, vocab))]))
        run.objective.remap = run.objective.remap.to(d.device)  # indexed by labels on the rank's device
    stepper = Stepper(run, run.module, total)
    step = resume(run, stepper)
    if eval_only:
        return {"step": step, "total": total}
    logger = Logger(run, total)
    micro = cfg.batch_size // d.world
    trained, train_seconds = 0, 0.0
    if cfg.batch_size % d.world:
        raise MedusaError(f"batch_size: {cfg.batch_size} is not divisible by the {d.world} processes")
    while step < total:
        epoch, within = divmod(step, per_epoch)
        n_items = len(positions) if table is not None else len(train_ex)
        order = torch.randperm(n_items, generator=torch.Generator().manual_seed(cfg.seed * 100003 + epoch))
        start = time.perf_counter()
        agg = None
        global_idx = [order[(within * cfg.grad_accum + m) * cfg.batch_size:
                            (within * cfg.grad_accum + m + 1) * cfg.batch_size] for m in range(cfg.grad_accum)]
        if table is not None:
            sel = [positions[g] for g in global_idx]
            labels = [table.labels(s, num_heads) for s in sel]
            norm = sum((lab >= 0).sum(0) for lab in labels).to(d.device)
            for m in range(cfg.grad_accum):
                mine = slice(d.rank * micro, (d.rank + 1) * micro)
                idx, lab = sel[m][mine], labels[m][mine].to(d.device)
                teacher = _teacher_from_table(table, idx, num_heads).to(d.device) if cfg.loss.kind == "kl" else None
                loss, stats = stepper.model(table.hidden[idx].to(d.device), lab, norm, teacher)
                stepper.backward(loss)
                agg = _merge(agg, loss, stats)
        else:
            batches = [pad_batch([train_ex[int(i)] for i in g]) for g in global_idx]
            labels = [head_labels(b["input_ids"], b["loss_mask"], num_heads) for b in batches]
            norm = sum((lab >= 0).sum((0, 1)) for lab in labels).to(d.device)
            base_norm = sum(b["loss_mask"][:, 1:].sum() for b in batches).to(d.device)
            for m in range(cfg.grad_accum):
                mine = slice(d.rank * micro, (d.rank + 1) * micro)
                part = {k: v[mine].to(d.device) for k, v in batches[m].items()}
                if cfg.medusa2.enabled:
                    loss, stats = stepper.model(part, labels[m][mine].to(d.device), norm, base_norm,
                                                step < cfg.medusa2.heads_only_steps, cfg.loss.kind == "kl")
                    stepper.backward(loss)
                    agg = _merge(agg, loss, stats)
                    continue
                with torch.no_grad():
                    hidden = hf_hidden_fn(run.hf_model)(part)
                lab = labels[m][mine].to(d.device)
                keep = (lab >= 0).any(-1)
                teacher = _teacher_from_seq(hidden, num_heads)[keep] if cfg.loss.kind == "kl" else None
                loss, stats = stepper.model(hidden[keep], lab[keep], norm, teacher)
                stepper.backward(loss)
                agg = _merge(agg, loss, stats)
        stepper.step()
        step += 1
        seconds = time.perf_counter() - start
        trained, train_seconds = trained + int(norm[0]), train_seconds + seconds
        logger.log(step, agg, stepper.lr(), int(norm[0]), seconds)
        if step % cfg.checkpoint_every == 0 or step == total:
            save(run, stepper, step)
        _fault_injection(step)
    logger.close()
    return {"step": step, "total": total, "history": run.history, "table_seconds": table_seconds,
            "train_seconds": train_seconds, "trained_positions": trained}


def _table_hidden_fn(run: Run):
    """The frozen base's hidden states for a CPU batch, computed on the rank's device and kept on the CPU
    (where cached tables live)."""
    fn = hf_hidden_fn(run.hf_model)
    return lambda batch: fn({k: v.to(run.d.device) for k, v in batch.items()}).cpu()


def _fault_injection(step: int) -> None:
    """MEDUSA_TRAIN_KILL_AFTER_STEP=N: SIGKILL this process after step N (how the resume test crashes)."""
    if os.environ.get("MEDUSA_TRAIN_KILL_AFTER_STEP") == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _teacher_from_table(table: PositionTable, idx: torch.Tensor, num_heads: int) -> torch.Tensor:
    j = torch.stack([(idx + k + 1).clamp(max=len(table) - 1) for k in range(num_heads)], 1)
    return table.hidden[j]


def _teacher_from_seq(hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
    b, t, h = hidden.shape
    j = (torch.arange(t)[:, None] + torch.arange(1, num_heads + 1)[None]).clamp(max=t - 1)  # [T, K]
    return hidden[:, j]  # [B, T, K, H]


def _merge(agg, loss, stats):
    if agg is None:
        return {"loss": float(loss.detach()), **{k: list(v) for k, v in stats.items()}}
    agg["loss"] += float(loss.detach())
    for k, v in stats.items():
        agg[k] = [a + b for a, b in zip(agg[k], v)]
    return agg


# ---- logging ----------------------------------------------------------------------------------------
class Logger:
    """Console lines and (offline by default) wandb: loss, per-head top-1/top-5, lr, tokens/s."""

    def __init__(self, run: Run, total: int):
        self.run, self.total = run, total
        self.wandb = None
        self.t0 = time.perf_counter()
        self.positions = 0
        if run.d.main:
            self.wandb = start_wandb(run)

    def log(self, step: int, agg: dict, lr: float, positions: int, seconds: float) -> None:
        d = self.run.d
        t = torch.tensor([agg["loss"]] + agg["correct1"] + agg["correct5"] + agg["count"], dtype=torch.float64)
        d.all_reduce(t)
        k = len(agg["count"])
        # Each process's loss is its share of the global loss (global normalisation): the sum is the loss.
        c1, c5, n = t[1: 1 + k], t[1 + k: 1 + 2 * k], t[1 + 2 * k:].clamp_min(1)
        self.positions += positions
        row = {"step": step, "loss": float(t[0]), "lr": lr,
               "tokens_per_s": positions / max(seconds, 1e-9),
               **{f"head{i}/top1": float(c1[i] / n[i]) for i in range(k)},
               **{f"head{i}/top5": float(c5[i] / n[i]) for i in range(k)}}
        self.run.history.append({"step": step, "loss": row["loss"]})
        if not d.main:
            return
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if step % self.run.cfg.log_every == 0 or step == self.total or step == 1:
            accs = " ".join(f"{row[f'head{i}/top1']:.3f}" for i in range(k))
            print(f"step {step}/{self.total} loss {row['loss']:.4f} top1 [{accs}] lr {lr:.2e} "
                  f"{row['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def start_wandb(run: Run):
    """Offline or disabled unless the config asks for online; WANDB_MODE=disabled always wins."""
    mode = run.cfg.wandb.mode
    if os.environ.get("WANDB_MODE") == "disabled" or mode == "disabled":
        return None
    if mode == "offline":
        os.environ["WANDB_MODE"] = "offline"
    try:
        import wandb
    except ImportError:
        return None
    run.run_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=run.cfg.wandb.project, name=run.cfg.wandb.name, dir=str(run.run_dir),
                      mode=mode, config=run.cfg.model_dump(), reinit="finish_previous")


# ---- checkpoints ----------------------------------------------------------------------------------
def save(run: Run, stepper: Stepper, step: int) -> None:
    root = run.run_dir / "checkpoints"
    if stepper.engine is not None:
        _save_deepspeed(run, stepper, step)
        return
    if not run.d.main:
        return

    def fill(tmp: Path) -> None:
        run.objective.heads.save(tmp / "heads")
        if run.save_adapter:
            run.save_adapter(tmp / "adapter")
        torch.save({"step": step, **stepper.state(), "rng": ckpt.rng_state(), "history": run.history},
                   tmp / ckpt.STATE)

    ckpt.save_checkpoint(root, step, run.meta, fill, run.cfg.keep_checkpoints)


def _save_deepspeed(run: Run, stepper: Stepper, step: int) -> None:
    """Every process writes its optimizer partition into a shared temporary directory; rank 0 renames."""
    root = run.run_dir / "checkpoints"
    tmp = root / f".step-{step:08d}.ds"
    if run.d.main:
        root.mkdir(parents=True, exist_ok=True)
    run.d.barrier()
    stepper.engine.save_checkpoint(str(tmp), tag="ds", client_state={"step": step, "history": run.history})
    run.d.barrier()
    if run.d.main:
        def fill(t: Path) -> None:
            run.objective.heads.save(t / "heads")
            os.replace(tmp / "ds", t / "ds")
            torch.save({"step": step, "rng": ckpt.rng_state(), "history": run.history}, t / ckpt.STATE)

        ckpt.save_checkpoint(root, step, run.meta, fill, run.cfg.keep_checkpoints)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    run.d.barrier()


def resume(run: Run, stepper: Stepper) -> int:
    path = ckpt.latest_checkpoint(run.run_dir / "checkpoints")
    if path is None:
        return 0
    ckpt.check_meta(path, run.meta)
    loaded = MedusaHeads.load(path / "heads")
    run.objective.heads.load_state_dict(loaded.state_dict())
    state = torch.load(path / ckpt.STATE, map_location="cpu", weights_only=False)
    if stepper.engine is not None:
        stepper.engine.load_checkpoint(str(path), tag="ds")
    else:
        stepper.load_state(state)
    if run.load_adapter:
        run.load_adapter(path / "adapter")
    ckpt.set_rng_state(state["rng"])
    run.history[:] = state.get("history", [])
    if run.d.main:
        print(f"resumed from {path} (step {state['step']})", file=sys.stderr)
    return int(state["step"])


# ---- evaluation and outputs -----------------------------------------------------------------------
def evaluate(run: Run, eval_ex: list[dict]) -> dict:
    """Per-head top-1..top-k accuracy on the held-out split (hidden states of the trained base)."""
    cfg = run.cfg
    if not eval_ex:
        return {}
    table = build_table(eval_ex, _table_hidden_fn(run))
    idx = table.trainable()
    labels = table.labels(idx, cfg.heads.num_heads)
    device = run.d.device
    acc, counts = rank_accuracy(run.objective, table.hidden[idx].to(device), labels.to(device), cfg.eval_topk)
    cumulative = [[sum(a[: r + 1]) for r in range(len(a))] for a in acc]
    return {"examples": len(eval_ex), "labels_per_head": counts, "rank_accuracy": acc,
            "topk_accuracy": cumulative,
            "top1": [c[0] for c in cumulative], "top5": [c[min(4, len(c) - 1)] for c in cumulative]}


def finish(run: Run, eval_ex: list[dict], state: dict) -> dict:
    """Write the run's outputs, all under run_dir: heads with eval.json, train_config.yaml and trees in
    `heads/` (one atomic directory, so heads and their trees never drift apart), eval.json next to the last
    checkpoint, and for Medusa-2 the merged model."""
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

    def fill(tmp: Path) -> None:
        run.objective.heads.save(tmp)
        (tmp / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "train_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        if "rank_accuracy" in report:
            write_trees(report["rank_accuracy"], cfg.tree_budgets, tmp / "trees")
        if run.save_adapter:
            run.save_adapter(tmp / "adapter")

    atomic_dir(heads_dir, fill)
    latest = ckpt.latest_checkpoint(run.run_dir / "checkpoints")
    if latest is not None:
        write_json_atomic(latest / "eval.json", report)
        result["checkpoint"] = str(latest)
    if cfg.medusa2.enabled:
        from medusa.train.medusa2 import save_merged

        save_merged(run, run.run_dir / "merged")
        result["merged_model"] = str(run.run_dir / "merged")
    d.barrier()
    result.update(accuracy=report.get("topk_accuracy", []), history=state.get("history", []), eval=report,
                  trees=[str(heads_dir / "trees" / f"tree-{b}.yaml") for b in cfg.tree_budgets if "rank_accuracy" in report],
                  model=cfg.model)
    return result


def write_trees(accuracy: list[list[float]], budgets: list[int], directory: Path) -> list[Path]:
    """tree-{budget}.yaml from measured head accuracies (medusa.decoding.tree.build_tree)."""
    from medusa.decoding.tree import build_tree

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
