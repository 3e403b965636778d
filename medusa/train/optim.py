"""Optimizer, learning-rate schedule and stepping (plain, DDP or DeepSpeed) behind one interface."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch

from medusa.train.dist import Dist


def lr_schedule(warmup: int, total: int, schedule: str = "cosine", floor: float = 0.0) -> Callable[[int], float]:
    """Learning-rate factor per step: linear warm-up over `warmup` steps, then constant or a cosine
    decay to `floor` at `total`."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def lr_lambda(cfg, total: int) -> Callable[[int], float]:
    """The schedule a config's `optim` section describes (training and feature-head configs alike)."""
    o = cfg.optim
    return lr_schedule(o.warmup_steps, total, o.schedule, o.min_lr_ratio)


def adamw(cfg, groups: list[dict], total: int):
    """AdamW over parameter groups with the config's schedule; returns (optimizer, scheduler)."""
    o = cfg.optim
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))


class Stepper:
    """Wraps DDP / DeepSpeed / plain optimizer stepping behind one interface.

    `ddp=False` (several processes without DeepSpeed): no DDP wrapper; `step` sums the gradients over the
    processes itself. For a loss whose forward is not one call of the module (a feature head unrolled over
    its own outputs), where DDP's hooks would not see the whole backward. The loss must then be normalised
    by global counts: the summed gradients are the gradient one process computes over the whole batch."""

    def __init__(self, cfg, d: Dist, module: torch.nn.Module, groups: list[dict], total: int, ddp: bool = True):
        self.cfg, self.d = cfg, d
        self.opt, self.sched = adamw(cfg, groups, total)
        self.engine = None
        self.model = module
        self.sum_grads = d.world > 1 and not getattr(cfg, "deepspeed", None) and not ddp
        if d.world > 1 and getattr(cfg, "deepspeed", None):
            self._deepspeed(module)
        elif d.world > 1 and ddp:
            ids = [d.device.index] if d.device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(module, device_ids=ids, find_unused_parameters=True)

    def _deepspeed(self, module: torch.nn.Module) -> None:
        import deepspeed

        cfg = self.cfg
        ds_cfg = json.loads(Path(cfg.deepspeed).read_text())
        ds_cfg["gradient_accumulation_steps"] = getattr(cfg, "grad_accum", 1)
        ds_cfg["train_micro_batch_size_per_gpu"] = max(1, cfg.batch_size // self.d.world)
        ds_cfg.pop("train_batch_size", None)
        ds_cfg["gradient_clipping"] = cfg.optim.grad_clip
        ds_cfg["zero_allow_untested_optimizer"] = True
        self.engine, self.opt, _, self.sched = deepspeed.initialize(
            model=module, optimizer=self.opt, lr_scheduler=self.sched, config=ds_cfg,
            model_parameters=[p for p in module.parameters() if p.requires_grad])
        self.model = self.engine

    def backward(self, loss: torch.Tensor) -> None:
        # Losses are already normalised by global counts; undo the averaging DDP / DeepSpeed apply.
        scale = self.d.world
        if self.engine is not None:
            # DeepSpeed divides by its accumulation count and counts micro-steps itself: step() after each
            # backward, the optimizer moves only at the accumulation boundary.
            self.engine.backward(loss * scale * getattr(self.cfg, "grad_accum", 1))
            self.engine.step()
        elif self.sum_grads:
            loss.backward()  # summed over the processes in step()
        else:
            (loss * scale).backward()

    def step(self) -> None:
        if self.engine is not None:
            return  # stepped in backward()
        if self.sum_grads:
            params = [p for g in self.opt.param_groups for p in g["params"] if p.requires_grad]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.flatten() for g in grads])
            self.d.all_reduce(flat)  # one message for every gradient
            for p, g in zip(params, flat.split([q.numel() for q in params])):
                p.grad = g.view_as(p).clone()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]],
                                           self.cfg.optim.grad_clip)
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
