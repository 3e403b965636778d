"""Two processes (torchrun + DeepSpeed ZeRO-2, and plain DDP) compute the same heads as one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import fake_distilled, save_tiny_model, write_config

REPO = Path(__file__).resolve().parent.parent
ZERO2 = ["--deepspeed", str(REPO / "configs" / "deepspeed" / "zero2.json")]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: Path, procs: int, extra: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests"),
           **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={_free_port()}",
           "-m", "medusa.cli", "train", "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize("launcher", ["deepspeed", "ddp"])
def test_two_processes_match_one(tmp_path, launcher):
    from train.config import load_config
    from train.trainer import run_training

    model = save_tiny_model(tmp_path / "model")
    data = fake_distilled(tmp_path / "data", model, n=16)
    common = dict(max_steps=6, batch_size=32, grad_accum=2, checkpoint_every=100)
    single = load_config(write_config(tmp_path / "one.yaml", model, data, tmp_path / "one", **common))
    run_training(single)
    two = write_config(tmp_path / "two.yaml", model, data, tmp_path / "two", **common)
    extra = ZERO2 if launcher == "deepspeed" else []
    proc = _launch(two, 2, extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_heads(tmp_path / "one" / "heads", tmp_path / "two" / "heads", rtol=1e-3, atol=1e-4)


def _same_heads(dir_a: Path, dir_b: Path, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    a = load_file(str(dir_a / "heads.safetensors"))
    b = load_file(str(dir_b / "heads.safetensors"))
    assert a.keys() == b.keys()
    assert max(float(v.abs().max()) for v in a.values()) > 1e-3  # the heads did train
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=rtol, atol=atol)


def test_deepspeed_resume_after_kill_matches_uninterrupted_run(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    data = fake_distilled(tmp_path / "data", model, n=16)
    common = dict(max_steps=10, batch_size=16, grad_accum=1, checkpoint_every=5)
    straight = _launch(write_config(tmp_path / "a.yaml", model, data, tmp_path / "a", **common), 2, ZERO2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    config = write_config(tmp_path / "b.yaml", model, data, tmp_path / "b", **common)
    # Both ranks SIGKILL themselves after step 7: the last checkpoint (step 5, with each rank's ZeRO
    # optimizer partition) is where the second launch picks up.
    killed = _launch(config, 2, ZERO2, {"MEDUSA_TRAIN_KILL_AFTER_STEP": "7"})
    assert killed.returncode != 0
    assert [p.name for p in (tmp_path / "b" / "checkpoints").glob("step-*")] == ["step-00000005"]
    resumed = _launch(config, 2, ZERO2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    _same_heads(tmp_path / "a" / "heads", tmp_path / "b" / "heads")
