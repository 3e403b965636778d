"""`medusa train-feature` in two processes (torchrun, and the deepspeed launcher with ZeRO-2) makes the
head one process makes, and a checkpoint resumes at another process count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from train_helpers import fake_distilled, save_tiny_model

REPO = Path(__file__).resolve().parent.parent
# No input noise: the processes draw it for their own sequences, so with it the runs differ by those draws.
RUN = {"dtype": "fp32", "threads": 1, "head": {"draft_vocab": 48}, "loss": {"unroll": 2, "noise": 0.0},
       "optim": {"lr": 0.003, "warmup_steps": 2}, "batch_size": 4, "chunk": 8, "max_steps": 6,
       "checkpoint_every": 3, "keep_checkpoints": 4, "precision": "fp32", "wandb": {"mode": "disabled"}}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The tiny target, its distilled answers, and the head one process trains on them."""
    from medusa.train.feature import load_feature_config, run_feature_training

    root = tmp_path_factory.mktemp("feature-dist")
    model = save_tiny_model(root / "model")
    data = fake_distilled(root / "data", model, n=16, answer_len=16)
    result = run_feature_training(load_feature_config(_config(root, model, data, "one")), progress=False)
    assert result["step"] == 6
    return root, model, data


def _config(root: Path, model: Path, data: Path, name: str, **extra) -> Path:
    cfg = {**RUN, "model": str(model), "run_dir": str(root / name),
           "data": {"sources": ["sharegpt"], "distill_dir": str(data), "use": "distilled", "eval_fraction": 0.2},
           **extra}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(cmd: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env_extra or {})}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


def _torchrun(config: Path, procs: int, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
                 f"--master_port={_free_port()}", "-m", "medusa.cli", "train-feature", "--config", str(config),
                 "--no-progress"], env_extra)


def _same_head(a: Path, b: Path, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    import torch

    x, y = (load_file(str(p / "feature_head.safetensors")) for p in (a, b))
    assert x.keys() == y.keys()
    for k in x:
        assert torch.allclose(x[k].float(), y[k].float(), rtol=rtol, atol=atol), k
    # ...and training moved them: the two runs agree on a trained head, not on an untouched one.
    first = load_file(str(a.parent / "checkpoints" / "step-00000003" / "head" / "feature_head.safetensors"))
    assert any(not torch.equal(first[k], x[k]) for k in x if x[k].is_floating_point())


def test_torchrun_two_processes_make_the_head_one_makes(one_process):
    root, model, data = one_process
    proc = _torchrun(_config(root, model, data, "two"), 2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "training in 2 processes (world size 2" in out
    # Both processes extracted features: the chunks are shared out, each cached once.
    assert len(list((root / "two" / "features").glob("*.safetensors"))) == 2
    _same_head(root / "one" / "head", root / "two" / "head")


def test_a_two_process_run_killed_between_checkpoints_resumes_in_one_process(one_process):
    """SIGKILLed in two processes after step 4 of 6 (its last checkpoint: step 3), finished in one process:
    the head of the uninterrupted one-process run."""
    import torch

    from medusa.train.feature import load_feature_config, run_feature_training

    root, model, data = one_process
    config = _config(root, model, data, "cut")
    proc = _torchrun(config, 2, {"MEDUSA_TRAIN_KILL_AFTER_STEP": "4"})
    assert proc.returncode != 0 and (root / "cut" / "checkpoints" / "step-00000003").is_dir()
    assert not (root / "cut" / "checkpoints" / "step-00000004").exists() and not (root / "cut" / "head").exists()
    saved = torch.load(root / "cut" / "checkpoints" / "step-00000003" / "trainer_state.pt", weights_only=False)
    assert saved["world_size"] == 2
    result = run_feature_training(load_feature_config(config), progress=False)
    assert result["step"] == 6 and result["world_size"] == 1
    _same_head(root / "one" / "head", root / "cut" / "head")


def test_deepspeed_launcher_with_zero2_makes_the_same_head(one_process):
    root, model, data = one_process
    config = _config(root, model, data, "ds")
    launcher = Path(sys.executable).parent / "deepspeed"
    proc = _run([str(launcher), "--num_gpus", "2", "--master_port", str(_free_port()), "--module", "medusa.cli",
                 "train-feature", "--config", str(config), "--no-progress",
                 "--deepspeed", str(REPO / "configs" / "deepspeed" / "zero2.json")])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "training in 2 processes" in out and (root / "ds" / "checkpoints" / "step-00000006" / "ds").is_dir()
    _same_head(root / "one" / "head", root / "ds" / "head", rtol=1e-3, atol=1e-4)


def test_accelerate_launch_makes_the_same_head(one_process):
    # `--multi_gpu` is accelerate's torchrun launcher; without GPUs the ranks train on the CPU over gloo.
    root, model, data = one_process
    launcher = Path(sys.executable).parent / "accelerate"
    proc = _run([str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
                 "-m", "medusa.cli", "train-feature", "--config", str(_config(root, model, data, "acc")),
                 "--no-progress"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "world size 2" in out
    _same_head(root / "one" / "head", root / "acc" / "head")


def test_a_batch_smaller_than_the_processes_is_refused(one_process):
    root, model, data = one_process
    proc = _torchrun(_config(root, model, data, "small", batch_size=1), 2)
    # Each process exits with status 2 and the key named (torchrun itself then exits 1).
    assert proc.returncode != 0 and "batch_size: 1 sequences cannot be shared by 2 processes" in proc.stderr
    assert "Traceback" not in proc.stderr.split("batch_size: 1")[0]


def test_online_features_cache_nothing_and_train_the_cached_features_head(one_process):
    """`features: online` runs the target in each step (here in two processes) and ends on the head the
    cached features give, up to the target's batch shapes (fp32 sums in other orders)."""
    root, model, data = one_process
    proc = _torchrun(_config(root, model, data, "online", features="online"), 2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert not (root / "online" / "features").exists()
    _same_head(root / "one" / "head", root / "online" / "head", rtol=1e-3, atol=1e-4)


def test_online_and_cached_features_give_the_same_loss_on_the_same_batch(one_process):
    import torch

    from medusa.decoding.target.model import load_target
    from medusa.train.data import load_examples, split_groups
    from medusa.train.feature import (make_head, chunk_groups, head_loss, load_feature_config,
                                      training_features)
    from medusa.train.feature_data import OnlineFeatures, feature_fn
    from medusa.train import checkpoint as ckpt

    root, model, data = one_process
    cfg = load_feature_config(_config(root, model, data, "one"))  # its features are cached already
    hf, tok = load_target(cfg.model, "fp32", "cpu")
    groups, _ = split_groups(cfg, chunk_groups(cfg, load_examples(cfg, tok)))
    fn = feature_fn(hf, [])
    cached = training_features(cfg, groups, ckpt.base_fingerprint(hf, cfg.model), fn, False)
    online = OnlineFeatures([e for _, exs in groups for e in exs], fn)
    head, full_to_draft = make_head(cfg, hf, cached, None)
    pick = [0, 3, 5, 6]
    a, b = cached.batch(pick, 64), online.batch(pick, 64)
    valid = a[4]
    assert torch.equal(valid, b[4]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert torch.equal(a[3][valid], b[3][valid])  # the target's greedy tokens (padding: anything)
    assert torch.allclose(a[0][valid], b[0][valid], atol=2e-2)  # bf16 features of differently padded passes
    la, _ = head_loss(head, cfg, *a, full_to_draft, noise=False)
    lb, _ = head_loss(head, cfg, *b, full_to_draft, noise=False)
    assert torch.allclose(la, lb, rtol=1e-3)
