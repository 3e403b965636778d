"""`target_sharding: fsdp`: with features online, the frozen target sharded over two processes by FSDP2
(`fully_shard`, gloo on the CPU) trains the head the replicated target trains."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_feature_distributed import RUN, _torchrun
from train_helpers import fake_distilled, save_tiny_model

# Both runs: features online in two processes, an evaluation at step 3 and at the end (rank 0 evaluates
# on held-out features every process helped extract when the target is sharded).
SETTINGS = {**RUN, "features": "online", "eval_every": 3, "measure_tau_prompts": 1,
            "measure_tau_tokens": 8, "max_steps": 6}


def _config(root: Path, model: Path, data: Path, name: str, **extra) -> Path:
    cfg = {**SETTINGS, "model": str(model), "run_dir": str(root / name),
           "data": {"sources": ["sharegpt"], "distill_dir": str(data), "use": "distilled", "eval_fraction": 0.2},
           **extra}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(run_dir: Path) -> list[float]:
    """Every step's loss (the whole batch's, as rank 0 logs it), from the last checkpoint's history."""
    state = torch.load(run_dir / "checkpoints" / "step-00000006" / "trainer_state.pt", weights_only=False)
    return [row["loss"] for row in state["history"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same online run in two processes with the target replicated and sharded."""
    root = tmp_path_factory.mktemp("feature-fsdp")
    model = save_tiny_model(root / "model")
    data = fake_distilled(root / "data", model, n=16, answer_len=16)
    out = {}
    for sharding in ("replicate", "fsdp"):
        proc = _torchrun(_config(root, model, data, sharding, target_sharding=sharding), 2)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-3000:]
        out[sharding] = log
    return root, out


def test_sharded_target_trains_the_replicated_head(runs):
    root, logs = runs
    # The target really was sharded: rank 0 held about half of its weights (dim-0 shards, padded).
    held = re.search(r"target sharded with FSDP2 over 2 processes: rank 0 holds ([0-9,]+) of its ([0-9,]+)",
                     logs["fsdp"])
    assert held, logs["fsdp"][-3000:]
    local, whole = (int(g.replace(",", "")) for g in held.groups())
    assert 0.45 * whole <= local <= 0.55 * whole
    assert "target sharded" not in logs["replicate"]
    # Same loss at every step and the same head. Tolerance: 1e-5 relative (fp32); the gathered weights are
    # the original ones, so the target's arithmetic is the same and in practice the runs agree exactly.
    a, b = _losses(root / "replicate"), _losses(root / "fsdp")
    assert len(a) == len(b) == 6 and a[0] != a[-1]
    assert a == pytest.approx(b, rel=1e-5)
    x, y = (load_file(str(root / name / "head" / "feature_head.safetensors")) for name in ("replicate", "fsdp"))
    assert x.keys() == y.keys()
    for k in x:
        assert torch.allclose(x[k].float(), y[k].float(), rtol=1e-5, atol=1e-6), k
    # The held-out evaluation (rank 0, on features the sharded target extracted) agrees too; decoding to
    # measure tau needs the whole target, so the sharded run says it did not.
    ea, eb = (json.loads((root / name / "head" / "eval.json").read_text()) for name in ("replicate", "fsdp"))
    assert torch.allclose(torch.tensor(ea["rank_accuracy"]), torch.tensor(eb["rank_accuracy"]), atol=1e-6)
    assert ea["expected_tau"] == pytest.approx(eb["expected_tau"], abs=1e-3)
    assert "measured_tau" in ea and "measured_tau" not in eb
    assert "not measured with a sharded target" in logs["fsdp"]
    assert len(re.findall(r"step 3 held-out top-1", logs["fsdp"])) == 1


def test_target_sharding_is_validated_by_name(tmp_path):
    from medusa.errors import MedusaError
    from medusa.train.feature import load_feature_config

    def load(**cfg):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"model": "m", **cfg}))
        return load_feature_config(path)

    with pytest.raises(MedusaError, match=r"target_sharding: .*'replicate' or 'fsdp'"):
        load(features="online", target_sharding="zero3")
    with pytest.raises(MedusaError, match="target_sharding: fsdp .* needs features: online"):
        load(target_sharding="fsdp")
    with pytest.raises(MedusaError, match="target_sharding: fsdp is not combined with deepspeed"):
        load(features="online", target_sharding="fsdp", deepspeed="configs/deepspeed/zero2.json")
    assert load(features="online", target_sharding="fsdp").target_sharding == "fsdp"
