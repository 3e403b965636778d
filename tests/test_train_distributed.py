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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: Path, procs: int, extra: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")}
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
    extra = ["--deepspeed", str(REPO / "configs" / "deepspeed" / "zero2.json")] if launcher == "deepspeed" else []
    proc = _launch(two, 2, extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = load_file(str(tmp_path / "one" / "heads" / "heads.safetensors"))
    b = load_file(str(tmp_path / "two" / "heads" / "heads.safetensors"))
    assert a.keys() == b.keys()
    moved = max(float(v.abs().max()) for v in a.values())
    assert moved > 1e-3  # the heads did train
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4)
