"""Atomic training checkpoints: heads + optimizer + scheduler + RNG state + where the data order stood.

A checkpoint is written into a temporary directory next to its final place and renamed, so a reader (or a
run resumed after `kill -9`) sees either the whole checkpoint or none. `meta.json` records the base model
and head configuration; resuming with another base or head layout is refused.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from medusa.errors import MedusaError
from medusa.io import atomic_dir

STATE = "trainer_state.pt"


def rng_state() -> dict:
    """CPU, Python and (where CUDA is available) this process's CUDA generator states."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        # Only the current device's generator: each rank owns one device (medusa.train.trainer.rank_device).
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved; a CUDA state is restored only where CUDA is available (a checkpoint
    made on a GPU machine still resumes on a CPU one, and an older one without it still loads)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: Path, step: int, meta: dict, fill_extra, keep: int) -> Path:
    """root/step-XXXXXXXX; `fill_extra(tmpdir)` writes heads, state and anything else."""
    def fill(tmp: Path) -> None:
        fill_extra(tmp)
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")

    path = atomic_dir(root / f"step-{step:08d}", fill)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / "meta.json").exists())


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def check_meta(path: Path, expected: dict) -> dict:
    """Refuse a checkpoint made for another base model or head configuration."""
    meta = json.loads((path / "meta.json").read_text())
    for key in ("base", "heads"):
        if meta.get(key) != expected.get(key):
            raise MedusaError(f"checkpoint {path} was made for {key} {meta.get(key)}, but this run has "
                              f"{expected.get(key)}; use another run_dir or the matching config")
    return meta
