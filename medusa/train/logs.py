"""Training logs: console lines, the run's loss history and (offline by default) wandb."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from medusa.train.dist import Dist


def start_wandb(cfg, run_dir: Path):
    """Offline or disabled unless the config asks for online; WANDB_MODE=disabled always wins."""
    mode = cfg.wandb.mode
    if os.environ.get("WANDB_MODE") == "disabled" or mode == "disabled":
        return None
    if mode == "offline":
        os.environ["WANDB_MODE"] = "offline"
    try:
        import wandb
    except ImportError:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, dir=str(run_dir),
                      mode=mode, config=cfg.model_dump(), reinit="finish_previous")


def merge_stats(agg: dict | None, loss: torch.Tensor, stats: torch.Tensor) -> dict:
    """Sum one micro-batch's loss and per-head counts ([3, K]: top-1, top-5, labels) into the step's
    totals, on the device (read once per step, by the log line)."""
    if agg is None:
        return {"loss": loss.detach().float(), "stats": stats.detach().clone()}
    agg["loss"] = agg["loss"] + loss.detach().float()
    agg["stats"] += stats.detach()
    return agg


class Logger:
    """Console lines and wandb: loss, per-head top-1/top-5, lr, tokens/s; `history` keeps (step, loss)."""

    def __init__(self, cfg, d: Dist, run_dir: Path, history: list, total: int):
        self.cfg, self.d, self.history, self.total = cfg, d, history, total
        self.wandb = start_wandb(cfg, run_dir) if d.main else None

    def log(self, step: int, agg: dict, lr: float, positions: int, seconds: float) -> None:
        row = self._row(step, agg, lr, positions, seconds)
        self.history.append({"step": step, "loss": row["loss"]})
        if not self.d.main:
            return
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if step % self.cfg.log_every == 0 or step == self.total or step == 1:
            k = agg["stats"].shape[1]
            accs = " ".join(f"{row[f'head{i}/top1']:.3f}" for i in range(k))
            print(f"step {step}/{self.total} loss {row['loss']:.4f} top1 [{accs}] lr {lr:.2e} "
                  f"{row['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)

    def _row(self, step: int, agg: dict, lr: float, positions: int, seconds: float) -> dict:
        t = torch.cat([agg["loss"].reshape(1), agg["stats"].flatten()]).to(dtype=torch.float64)
        t = self.d.all_reduce(t).cpu()  # on the device for NCCL, on the CPU for gloo: where training runs
        k = agg["stats"].shape[1]
        # Each process's loss is its share of the global loss (global normalisation): the sum is the loss.
        c1, c5, n = t[1: 1 + k], t[1 + k: 1 + 2 * k], t[1 + 2 * k:].clamp_min(1)
        return {"step": step, "loss": float(t[0]), "lr": lr, "tokens_per_s": positions / max(seconds, 1e-9),
                **{f"head{i}/top1": float(c1[i] / n[i]) for i in range(k)},
                **{f"head{i}/top5": float(c5[i] / n[i]) for i in range(k)}}

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
