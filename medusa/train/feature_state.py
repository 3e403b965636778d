"""A feature-head training run's state: checkpoints written atomically (rank 0, or every process's optimizer
partition under DeepSpeed), the checkpoint a run continues from, and loading one back at any process count."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from medusa.errors import MedusaError
from medusa.train import checkpoint as ckpt
from medusa.train.dist import Dist
from medusa.train.optim import Stepper


def save_state(run_dir: Path, head, stepper: Stepper, meta, step: int, trained: int, history: list, keep: int,
          d: Dist | None = None) -> None:
    """A checkpoint written by rank 0 (with DeepSpeed, every process adds its optimizer partition)."""
    d = d or Dist()
    sharded = stepper.engine is not None

    def fill(tmp: Path) -> None:
        head.save(tmp / "head")
        optimizer = {} if sharded else stepper.state()
        torch.save({"step": step, "trained": trained, **optimizer, "rng": ckpt.rng_state(), "history": history,
                    "world_size": d.world}, tmp / ckpt.STATE)

    if sharded:
        ckpt.save_sharded(run_dir / "checkpoints", d, stepper.engine, step, meta, fill, keep, {"step": step})
    elif d.main:
        ckpt.save_checkpoint(run_dir / "checkpoints", step, meta, fill, keep)
    d.barrier()


def resume_point(run_dir: Path, resume_from: str | None) -> Path | None:
    """The checkpoint a run continues from: its own latest, else `resume_from` (a checkpoint directory or a
    run directory), else none."""
    path = ckpt.latest_checkpoint(run_dir / "checkpoints")
    if path is not None or resume_from is None:
        return path
    src = Path(resume_from)
    if (src / "meta.json").is_file() and (src / ckpt.STATE).is_file():
        return src
    found = ckpt.latest_checkpoint(src / "checkpoints") or ckpt.latest_checkpoint(src)
    if found is None:
        raise MedusaError(f"resume_from: {src} is neither a checkpoint (meta.json, {ckpt.STATE}) nor a run "
                          "directory with checkpoints")
    return found


def load_state(path: Path | None, head, stepper: Stepper, meta, d: Dist | None = None) -> tuple[int, int, list]:
    """Load checkpoint `path` into the head and the optimizer. A checkpoint of a run without DeepSpeed holds
    the whole optimizer and resumes at any process count; one with DeepSpeed's partitions (`ds/`) resumes
    under DeepSpeed, and elsewhere, or where DeepSpeed cannot read it, with fresh optimizer moments (said)."""
    from safetensors.torch import load_file

    d = d or Dist()
    if path is None:
        return 0, 0, []
    ckpt.check_meta(path, meta)
    head.load_state_dict(load_file(str(path / "head" / "feature_head.safetensors")), strict=False)
    st = torch.load(path / ckpt.STATE, map_location="cpu", weights_only=False)
    fresh = None
    if stepper.engine is not None:
        try:
            if not (path / "ds").is_dir():
                raise MedusaError("it holds no DeepSpeed optimizer partitions")
            stepper.engine.load_checkpoint(str(path), tag="ds", load_module_strict=False)
        except Exception as exc:  # another process count, another ZeRO stage, a checkpoint without DeepSpeed
            fresh = str(exc).splitlines()[0][:200]
    elif "optimizer" in st:
        stepper.load_state(st)
    else:
        fresh = "it was saved by DeepSpeed (optimizer partitions), and this run does not use DeepSpeed"
    if fresh is not None:
        stepper.sched.last_epoch = int(st["step"]) - 1  # the schedule continues where it was
        stepper.sched.step()
        if d.main:
            print(f"resuming {path}: optimizer moments start fresh ({fresh})", file=sys.stderr)
    ckpt.set_rng_state(st["rng"])
    if d.main:
        print(f"resumed from {path} (step {st['step']}, world size {st.get('world_size', 1)} then, "
              f"{d.world} now)", file=sys.stderr)
    return int(st["step"]), int(st["trained"]), list(st.get("history", []))
