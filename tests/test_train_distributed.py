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


def _launch(config: Path, procs: int, extra: list[str], env_extra: dict | None = None,
            probe: Path | None = None) -> subprocess.CompletedProcess:
    """`medusa train` in `procs` processes; with `probe`, each rank records there what it trained on."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests"),
           **(env_extra or {})}
    entry = ["-m", "medusa.cli"] if probe is None else [str(REPO / "tests" / "rank_data_probe.py"), str(probe)]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={_free_port()}",
           *entry, "train", "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize("launcher", ["deepspeed", "ddp"])
def test_two_processes_match_one(tmp_path, launcher, monkeypatch):
    import rank_data_probe
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    model = save_tiny_model(tmp_path / "model")
    data = fake_distilled(tmp_path / "data", model, n=16)
    common = dict(max_steps=6, batch_size=32, grad_accum=2, checkpoint_every=100)
    single = load_config(write_config(tmp_path / "one.yaml", model, data, tmp_path / "one", **common))
    monkeypatch.delenv("RANK", raising=False)
    rank_data_probe.install(tmp_path / "probe-one", setattr=monkeypatch.setattr)
    run_training(single)
    monkeypatch.undo()
    two = write_config(tmp_path / "two.yaml", model, data, tmp_path / "two", **common)
    extra = ZERO2 if launcher == "deepspeed" else []
    proc = _launch(two, 2, extra, probe=tmp_path / "probe-two")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _ranks_split_the_data(rank_data_probe.read(tmp_path / "probe-one"),
                          [rank_data_probe.read(tmp_path / "probe-two", r) for r in (0, 1)])
    _same_heads(tmp_path / "one" / "heads", tmp_path / "two" / "heads", rtol=1e-3, atol=1e-4)


def _ranks_split_the_data(one: dict, ranks: list[dict]) -> None:
    """Every step, the two ranks trained on disjoint halves of what the single process trained on; over the
    first epoch that is every example the epoch draws, each once."""
    steps = sorted(one["steps"])
    assert steps == list(range(6)) and all(sorted(r["steps"]) == steps for r in ranks)
    for step in steps:
        a, b = (set(r["steps"][step]) for r in ranks)
        assert len(ranks[0]["steps"][step]) == len(ranks[1]["steps"][step]) == one["unit"] // 2
        assert not a & b, f"step {step}: both ranks trained on items {sorted(a & b)[:10]}"
        assert a | b == set(one["steps"][step]), f"step {step}: the ranks did not cover the global batch"
    first_epoch = [i for step in steps[:one["per_epoch"]] for i in one["steps"][step]]
    assert one["per_epoch"] < len(steps)  # the run goes past one epoch
    assert len(first_epoch) == len(set(first_epoch)) == one["per_epoch"] * one["unit"]
    assert set(first_epoch) <= set(range(one["items"]))


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


# ---- other launchers: the deepspeed launcher and accelerate launch -----------------------------------------
@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """A tiny model, its distilled data and the heads one process trains from them (the reference)."""
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    root = tmp_path_factory.mktemp("launchers")
    model = save_tiny_model(root / "model")
    data = fake_distilled(root / "data", model, n=16)
    run_training(load_config(write_config(root / "one.yaml", model, data, root / "one", **LAUNCH_RUN)))
    return root, model, data


LAUNCH_RUN = dict(max_steps=6, batch_size=32, grad_accum=2, checkpoint_every=100)


def _run_launcher(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


def test_deepspeed_launcher_trains_in_two_processes(one_process):
    # The launcher passes `--local_rank=N` ahead of the subcommand; on a machine without GPUs DeepSpeed picks
    # its CPU accelerator and `--num_gpus 2` still starts two processes (gloo).
    root, model, data = one_process
    config = write_config(root / "ds.yaml", model, data, root / "ds", **LAUNCH_RUN)
    launcher = Path(sys.executable).parent / "deepspeed"
    port = _free_port()
    proc = _run_launcher([str(launcher), "--num_gpus", "2", "--master_port", str(port), "--module",
                          "medusa.cli", "train", "--config", str(config), *ZERO2])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "--local_rank=1" in proc.stdout + proc.stderr  # what the launcher passed, and was accepted
    assert "training in 2 processes" in proc.stdout + proc.stderr
    # DeepSpeed's CPU all-reduce buffers (shared memory, one per rank) are removed when the run ends.
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    _same_heads(root / "one" / "heads", root / "ds" / "heads", rtol=1e-3, atol=1e-4)


def test_accelerate_launch_trains_in_two_processes(one_process):
    # `--multi_gpu` is accelerate's torchrun launcher; on a machine without GPUs the ranks train on the CPU
    # over gloo. (`--cpu --num_processes 2` starts a single process unless mpirun is set up.)
    root, model, data = one_process
    config = write_config(root / "acc.yaml", model, data, root / "acc", **LAUNCH_RUN)
    launcher = Path(sys.executable).parent / "accelerate"
    proc = _run_launcher([str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                          "--mixed_precision", "no", "--dynamo_backend", "no",
                          "--main_process_port", str(_free_port()), "-m", "medusa.cli", "train",
                          "--config", str(config)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "training in 2 processes" in proc.stderr
    _same_heads(root / "one" / "heads", root / "acc" / "heads", rtol=1e-3, atol=1e-4)


# ---- each rank on its own device -----------------------------------------------------------------------------
@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend this machine has two CUDA devices; records the devices made current."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(d))
    return current


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_each_rank_takes_the_gpu_of_its_local_rank(fake_cuda, monkeypatch, local_rank):
    from medusa.train.dist import rank_device

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert rank_device() == torch.device("cuda", int(local_rank))
    assert fake_cuda == [int(local_rank)]


def test_rank_device_without_cuda_or_with_too_few_gpus(fake_cuda, monkeypatch):
    from medusa.errors import MedusaError
    from medusa.train.dist import rank_device

    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(MedusaError, match="LOCAL_RANK: 2 but this machine has 2 visible CUDA"):
        rank_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device() == torch.device("cpu") and fake_cuda == []


def test_training_loads_the_target_on_the_ranks_device(fake_cuda, monkeypatch):
    """run_training asks for the target on cuda:LOCAL_RANK, not on whatever `cuda` means (GPU 0)."""
    import medusa.train.trainer as trainer
    from medusa.train.config import TrainConfig

    asked = []

    class Stop(Exception):
        pass

    def fake_load_target(model, dtype, device):
        asked.append(device)
        raise Stop

    monkeypatch.setattr(trainer, "load_target", fake_load_target)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(Stop):
        trainer.run_training(TrainConfig(model="unused"))
    assert asked == [torch.device("cuda", 1)] and fake_cuda == [1]


def test_launcher_rank_flags_are_accepted(capsys):
    """`--local_rank=N` before the subcommand (the deepspeed launcher) or `--local-rank N` after it is
    accepted and ignored: the bad config key is what gets reported, not the flag."""
    from medusa.cli import main

    config = str(REPO / "configs" / "train" / "smollm2-medusa1.yaml")
    for argv in (["--local_rank=1", "train"], ["train", "--local-rank", "1"], ["distill", "--local_rank=0"]):
        assert main([*argv, "--config", config, "--set", "optim.lrr=1"]) == 2
        err = capsys.readouterr().err
        assert "optim.lrr: unknown key" in err and "unrecognized" not in err


def test_checkpoints_carry_the_cuda_generator_where_there_is_one(monkeypatch):
    from medusa.train import checkpoint as ckpt

    assert "cuda" not in ckpt.rng_state() or torch.cuda.is_available()
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7, 8], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(s.tolist()))
    state = ckpt.rng_state()
    assert state["cuda"].tolist() == [7, 8]
    ckpt.set_rng_state(state)
    assert restored == [[7, 8]]
    # A checkpoint from a GPU machine resumes on a CPU one (the CUDA state is skipped), and an old one
    # without a CUDA state still loads.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ckpt.set_rng_state(state)
    ckpt.set_rng_state({k: v for k, v in state.items() if k != "cuda"})
    assert restored == [[7, 8]]


def test_distill_under_a_launcher_runs_only_on_rank_0(monkeypatch, capsys):
    from medusa.cli import main

    monkeypatch.setenv("RANK", "1")
    config = str(REPO / "configs" / "train" / "smollm2-medusa1.yaml")
    assert main(["--local_rank=1", "distill", "--config", config]) == 0
    assert "rank 1 has nothing to do" in capsys.readouterr().err


def test_a_ranks_shared_memory_buffer_is_released(monkeypatch):
    """The name DeepSpeed gives a rank's CPU all-reduce buffer is removed at the end of a run (and only that
    rank's, of that run's address and port)."""
    from medusa.train.dist import release_shm_buffer

    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm on this machine")
    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    mine, other = (shm / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{r}" for r in (1, 0))
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    try:
        assert release_shm_buffer(1) and not mine.exists() and other.exists()
        assert not release_shm_buffer(1)  # nothing left to remove
    finally:
        for p in (mine, other):
            p.unlink(missing_ok=True)
