"""Atomic training checkpoints: heads + optimizer + scheduler + RNG state + where the data order stood.

A checkpoint is written into a temporary directory next to its final place and renamed, so a reader (or a
run resumed after `kill -9`) sees either the whole checkpoint or none. `meta.json` records the base model
and head configuration; resuming with another base or head layout is refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import torch

from medusa.errors import MedusaError
from medusa.io import atomic_dir

STATE = "trainer_state.pt"


def rng_state() -> dict:
    """CPU, Python and (where CUDA is available) this process's CUDA generator states."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        # Only the current device's generator: each rank owns one device (medusa.train.dist.rank_device).
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


def base_fingerprint(hf_model, name: str) -> dict:
    """What a checkpoint must match: architecture sizes and a checksum of the output projection."""
    w = hf_model.get_output_embeddings().weight
    c = hf_model.config
    return {"name": name, "hidden_size": c.hidden_size, "vocab_size": w.shape[0],
            "layers": c.num_hidden_layers, "lm_head_sum": round(float(w[:256].float().abs().sum()), 2)}


def save(run, stepper, step: int) -> None:
    """A checkpoint of a heads training run (`medusa.train.trainer.Run`): heads, what the run's strategy
    adds (the Medusa-2 adapter), optimizer, scheduler, RNG and loss history."""
    if stepper.engine is not None:
        _save_deepspeed(run, stepper, step)
        return
    if not run.d.main:
        return

    def fill(tmp: Path) -> None:
        run.objective.heads.save(tmp / "heads")
        run.strategy.save(tmp)
        torch.save({"step": step, **stepper.state(), "rng": rng_state(), "history": run.history}, tmp / STATE)

    save_checkpoint(run.run_dir / "checkpoints", step, run.meta, fill, run.cfg.keep_checkpoints)


def _save_deepspeed(run, stepper, step: int) -> None:
    def fill(t: Path) -> None:
        run.objective.heads.save(t / "heads")
        torch.save({"step": step, "rng": rng_state(), "history": run.history}, t / STATE)

    save_sharded(run.run_dir / "checkpoints", run.d, stepper.engine, step, run.meta, fill, run.cfg.keep_checkpoints,
                 {"step": step, "history": run.history})


def save_sharded(root: Path, d, engine, step: int, meta: dict, fill, keep: int, client_state: dict) -> None:
    """A DeepSpeed run's checkpoint: every process writes its optimizer partition into a shared temporary
    directory (`ds/`), then rank 0 adds what `fill(tmpdir)` writes and renames the whole into place."""
    tmp = root / f".step-{step:08d}.ds"
    if d.main:
        root.mkdir(parents=True, exist_ok=True)
    d.barrier()
    engine.save_checkpoint(str(tmp), tag="ds", client_state=client_state)
    d.barrier()
    if d.main:
        def fill_all(t: Path) -> None:
            fill(t)
            os.replace(tmp / "ds", t / "ds")

        save_checkpoint(root, step, meta, fill_all, keep)
        shutil.rmtree(tmp, ignore_errors=True)
    d.barrier()


def resume(run, stepper) -> int:
    """Load the run's latest checkpoint, if any, into heads, strategy, optimizer and RNG; returns its step."""
    from medusa.decoding.proposers.heads import MedusaHeads

    path = latest_checkpoint(run.run_dir / "checkpoints")
    if path is None:
        return 0
    check_meta(path, run.meta)
    run.objective.heads.load_state_dict(MedusaHeads.load(path / "heads").state_dict())
    state = torch.load(path / STATE, map_location="cpu", weights_only=False)
    if stepper.engine is not None:
        stepper.engine.load_checkpoint(str(path), tag="ds")
    else:
        stepper.load_state(state)
    run.strategy.load(path)
    set_rng_state(state["rng"])
    run.history[:] = state.get("history", [])
    if run.d.main:
        print(f"resumed from {path} (step {state['step']})", file=sys.stderr)
    return int(state["step"])
