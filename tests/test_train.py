"""Training pipeline on tiny random models: config validation, labels, hidden states, training, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medusa.errors import MedusaError
from train_helpers import fake_distilled, save_tiny_model, write_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = save_tiny_model(root / "model")
    data = fake_distilled(root / "data", model)
    return root, model, data


# ---- configuration ----------------------------------------------------------------------------------
def test_config_rejects_unknown_and_bad_keys(tmp_path):
    from medusa.train.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(MedusaError, match=r"optim\.lrr: unknown key"):
        load_config(path)
    path.write_text("loss:\n  decay: 1.5\n")
    with pytest.raises(MedusaError, match=r"loss\.decay"):
        load_config(path)
    path.write_text("data:\n  sources: [mtbench]\n")
    with pytest.raises(MedusaError, match="evaluation set"):
        load_config(path)
    path.write_text("batch_size: 8\n")
    with pytest.raises(MedusaError, match=r"--set: 'oops'"):
        load_config(path, ["oops"])
    cfg = load_config(path, ["loss.decay=0.5", "heads.num_heads=3"])
    assert cfg.head_weights() == [1.0, 0.5, 0.25]


def test_shipped_configs_validate():
    from medusa.train.config import load_config

    paths = sorted((REPO / "configs" / "train").glob("*.yaml"))
    assert paths, "no training configs found under configs/train"
    for path in paths:
        load_config(path)


# ---- labels and hidden states -----------------------------------------------------------------------
def test_labels_only_on_answer_tokens_and_table_agrees():
    from medusa.train.data import example, head_labels, pad_batch
    from medusa.train.hidden import build_table

    ex = [example([5, 6, 7], [10, 11, 12, 13], 64), example([8, 9], [20, 21, 22], 64)]
    batch = pad_batch(ex)
    labels = head_labels(batch["input_ids"], batch["loss_mask"], 2)
    # Position 2 (last prompt token) -> head 0 predicts index 4 (token 11), head 1 index 5 (token 12).
    assert labels[0, 2].tolist() == [11, 12]
    assert labels[0, 1].tolist() == [-100, -100]  # heads never run before the last prompt token
    assert labels[1, 3].tolist() == [-100, -100]  # past the end, and padding
    table = build_table(ex, lambda b: torch.randn(*b["input_ids"].shape, 4))
    idx = table.trainable()
    got = table.labels(idx, 2)
    want = labels[labels[..., 0] >= 0]
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))


def test_hf_last_hidden_state_is_what_the_engine_sees():
    from conftest import tiny_model
    from medusa.decoding.target.transformer import Transformer
    from medusa.train.data import pad_batch
    from medusa.train.hidden import hf_hidden_fn

    model = tiny_model()
    ours = Transformer(model)
    batch = pad_batch([{"input_ids": [3, 4, 5, 6, 7], "loss_mask": [0] * 5}])
    cache = ours.new_cache(1, 8)
    expect = ours(batch["input_ids"], torch.arange(5)[None], cache, slice(0, 1),
                  torch.ones(5, 5, dtype=torch.bool).tril())
    torch.testing.assert_close(hf_hidden_fn(model)(batch), expect, rtol=0, atol=1e-5)


# ---- training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_objective_masks_unlabelled_rows_as_if_they_were_dropped(kind):
    """Rows without a label are masked inside the objective (no device wait): loss, gradients and the
    top-1 / top-5 / label counts equal those of the labelled rows alone."""
    from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
    from medusa.train.objective import HeadObjective

    torch.manual_seed(0)
    hidden, vocab, rows = 16, 50, 12
    heads = MedusaHeads(HeadsConfig(hidden, vocab, 3, 1))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    objective = HeadObjective(heads, torch.randn(vocab, hidden), [1.0, 0.8, 0.6], kind)
    x = torch.randn(rows, hidden)
    labels = torch.randint(0, vocab, (rows, 3))
    labels[torch.rand(rows, 3) < 0.4] = -100
    labels[:, 2] = -100  # a head with no label at all in this micro-batch
    teacher = torch.randn(rows, 3, hidden)
    norm = torch.tensor([9.0, 7.0, 5.0])
    loss, stats = objective(x, labels, norm, teacher)
    grads = torch.autograd.grad(loss, list(heads.parameters()))
    expected_loss = torch.zeros(())
    counts = []
    for k in range(3):
        valid = labels[:, k] >= 0
        lk = objective.logits(x[valid], full=False)[k]
        if kind == "kl":
            target = torch.softmax(objective.base_logits(teacher[valid, k]), -1)
            per = (target * (target.clamp_min(1e-20).log() - torch.log_softmax(lk, -1))).sum(-1)
        else:
            per = torch.nn.functional.cross_entropy(lk, labels[valid, k], reduction="none")
        expected_loss = expected_loss + objective.weights[k] * per.sum() / norm[k]
        top = lk.topk(5, -1).indices if valid.any() else torch.zeros(0, 5, dtype=torch.long)
        hit = top == labels[valid, k][:, None]
        counts.append([int(hit[:, :1].sum()), int(hit.sum()), int(valid.sum())])
    expected_grads = torch.autograd.grad(expected_loss, list(heads.parameters()))
    assert torch.allclose(loss, expected_loss, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, expected_grads))
    assert stats.shape == (3, 3) and stats.T.tolist() == counts
    assert counts[2] == [0, 0, 0] and counts[0][2] > 0


def test_train_cached_writes_loadable_heads_eval_and_trees(tiny, tmp_path):
    from medusa.decoding.proposers.heads import MedusaHeads
    from medusa.decoding.trees.tree import load_tree
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    root, model, data = tiny
    cfg = load_config(write_config(tmp_path / "c.yaml", model, data, tmp_path / "run", epochs=4))
    result = run_training(cfg)
    losses = [h["loss"] for h in result["history"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
    heads = MedusaHeads.load(tmp_path / "run" / "heads")
    assert heads.config.num_heads == 3
    report = json.loads((tmp_path / "run" / "heads" / "eval.json").read_text())
    assert len(report["topk_accuracy"]) == 3 and len(report["topk_accuracy"][0]) == 10
    assert all(0 <= a <= 1 for row in report["topk_accuracy"] for a in row)
    # The trees live with the heads, and names resolve to them before the shipped trees.
    own = tmp_path / "run" / "heads" / "trees"
    assert sorted(p.name for p in own.iterdir()) == ["tree-4.yaml", "tree-8.yaml"]
    tree = load_tree("tree-8", heads_dir=tmp_path / "run" / "heads")
    assert len(tree.nodes) == 8 and tree.nodes == load_tree(str(own / "tree-8.yaml")).nodes
    assert heads.directory == tmp_path / "run" / "heads" and heads.trees_dir == own
    assert heads.tree().nodes == tree.nodes and len(heads.tree("tree-4").nodes) == 4
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert ckpts and (ckpts[-1] / "eval.json").exists()


def test_train_plain_path_and_kl_loss(tiny, tmp_path):
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    root, model, data = tiny
    cfg = load_config(write_config(tmp_path / "c.yaml", model, data, tmp_path / "run", cache_hidden=False,
                                   batch_size=4, epochs=1, loss__kind="kl", heads__candidates=16,
                                   data__eval_fraction=0.0))  # every answer is a training answer
    result = run_training(cfg)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result["history"])
    # heads.candidates: the exported heads propose only the 16 most frequent answer tokens
    from medusa.decoding.proposers.heads import MedusaHeads
    from medusa.train.distill import load_distilled

    heads = MedusaHeads.load(tmp_path / "run" / "heads")
    counts = torch.bincount(torch.tensor([t for r in load_distilled(data)["response_ids"] for t in r]))
    assert heads.config.candidates == 16 and len(set(heads.candidate_ids.tolist())) == 16
    rest = torch.ones_like(counts, dtype=torch.bool)
    rest[heads.candidate_ids] = False
    assert counts[heads.candidate_ids].min() >= counts[rest].max()


def _train_cli(config: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    # The threads of this process (conftest): the same kernels split the same sums, so runs compare bit for bit.
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO / "tests"),
           "OMP_NUM_THREADS": str(torch.get_num_threads()), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "medusa.cli", "train", "--config", str(config)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_resume_after_kill_matches_uninterrupted_run(tiny, tmp_path, one_thread):
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    root, model, data = tiny
    straight = run_training(load_config(write_config(tmp_path / "a.yaml", model, data, tmp_path / "a")))
    config = write_config(tmp_path / "b.yaml", model, data, tmp_path / "b")
    # The process SIGKILLs itself after step 7; the last checkpoint is step 5, steps 6-7 are redone.
    killed = _train_cli(config, {"MEDUSA_TRAIN_KILL_AFTER_STEP": "7"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [p.name for p in (tmp_path / "b" / "checkpoints").glob("step-*")] == ["step-00000005"]
    # A checkpoint half-written when the kill came is never picked up.
    (tmp_path / "b" / "checkpoints" / ".step-00000010.partial").mkdir()
    resumed = _train_cli(config)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr
    state = torch.load(next((tmp_path / "b" / "checkpoints").glob(f"step-{straight['step']:08d}")) /
                       "trainer_state.pt", weights_only=False)
    # The resumed run is the uninterrupted one, bit for bit: every step's loss and the heads it writes.
    assert [h["loss"] for h in state["history"]] == [h["loss"] for h in straight["history"]]
    assert_same_weights(tmp_path / "b" / "heads", tmp_path / "a" / "heads")


def assert_same_weights(a: Path, b: Path) -> None:
    """The safetensors files of directories a and b hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in b.glob("*.safetensors"))
    for name in files:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name


def test_checkpoint_from_other_head_config_is_refused(tiny, tmp_path):
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    root, model, data = tiny
    run_training(load_config(write_config(tmp_path / "a.yaml", model, data, tmp_path / "run", max_steps=5)))
    other = load_config(write_config(tmp_path / "b.yaml", model, data, tmp_path / "run", max_steps=6,
                                     heads__num_heads=2))
    with pytest.raises(MedusaError, match="was made for heads"):
        run_training(other)
    other_base = save_tiny_model(tmp_path / "model2", seed=5)
    cfg = load_config(write_config(tmp_path / "c.yaml", other_base, data, tmp_path / "run", max_steps=6))
    with pytest.raises(MedusaError, match="was made for base"):
        run_training(cfg)


def test_distill_is_resumable(tiny, tmp_path):
    from medusa.train.config import load_config
    from medusa.train.distill import load_distilled, run_distill

    root, model, _ = tiny
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"t{5 + i} t{9 + i} t{20 + i}" for i in range(5)) + "\n")
    cfg = load_config(write_config(tmp_path / "c.yaml", model, tmp_path / "data", tmp_path / "run",
                                   data__sources=[str(prompts)], data__shard_size=2, data__max_new_tokens=6,
                                   data__distill_batch_size=3))
    out = run_distill(cfg, show_progress=False)
    ds = load_distilled(out)
    assert len(ds) == 5 and all(len(r) == 6 for r in ds["response_ids"])
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    import shutil

    shutil.rmtree(out / "shard-00001")
    run_distill(cfg, show_progress=False)
    again = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert again["shard-00000"] == stamps["shard-00000"] and again["shard-00002"] == stamps["shard-00002"]
    assert load_distilled(out)["response_ids"] == ds["response_ids"]
    # a batch wider than a shard answers prompts of several shards at once: each shard still gets its own
    one = load_config(write_config(tmp_path / "one.yaml", model, tmp_path / "one", tmp_path / "run",
                                   data__sources=[str(prompts)], data__shard_size=2, data__max_new_tokens=6,
                                   data__distill_batch_size=1))
    assert load_distilled(run_distill(one, show_progress=False))["response_ids"] == ds["response_ids"]


def test_distill_extends_with_more_sources_keeping_every_answered_shard(tiny, tmp_path):
    """A distilled directory grows by appending a source: the shards already answered stay as they are
    (their prompts come first), the new prompts fill new shards, and other settings are still refused."""
    from medusa.train.config import load_config
    from medusa.train.distill import load_distilled, run_distill

    root, model, _ = tiny
    first, more = tmp_path / "first.txt", tmp_path / "more.txt"
    first.write_text("\n".join(f"t{5 + i} t{9 + i}" for i in range(4)) + "\n")
    more.write_text("\n".join(f"t{30 + i} t{40 + i}" for i in range(3)) + "\n")
    common = dict(data__shard_size=2, data__max_new_tokens=4, data__distill_batch_size=2)
    a = load_config(write_config(tmp_path / "a.yaml", model, tmp_path / "data", tmp_path / "run",
                                 data__sources=[str(first)], **common))
    out = run_distill(a, show_progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert sorted(stamps) == ["shard-00000", "shard-00001"]
    b = load_config(write_config(tmp_path / "b.yaml", model, tmp_path / "data", tmp_path / "run",
                                 data__sources=[str(first), str(more)], **common))
    run_distill(b, show_progress=False)
    again = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert sorted(again) == ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]
    assert all(again[k] == v for k, v in stamps.items())
    assert load_distilled(out)["prompt"][4:] == [f"t{30 + i} t{40 + i}" for i in range(3)]
    other = load_config(write_config(tmp_path / "c.yaml", model, tmp_path / "data", tmp_path / "run",
                                     data__sources=[str(more), str(first)], **common))
    with pytest.raises(MedusaError, match="data.distill_dir"):
        run_distill(other, show_progress=False)


def test_distill_batch_size_auto_reads_the_calibrated_curve(monkeypatch, tmp_path):
    """auto: the smallest measured batch size within 5% of the best answer tokens per second, B / ms(B, 1);
    never more rows than prompts; a number is taken as it is."""
    from medusa.runtime import calibrate
    from medusa.train import distill
    from medusa.train.config import TrainConfig

    ms = {8: 10.0, 16: 12.0, 32: 20.0, 64: 38.0, 128: 80.0}  # tokens/ms: 0.8, 1.33, 1.6, 1.68, 1.6
    asked = []

    def fake(rt, batch_sizes=None, tokens=None, **_):
        asked.append((batch_sizes, tokens))
        return calibrate.Calibration({}, {(b, 1): v for b, v in ms.items()})

    monkeypatch.setattr(calibrate, "load_or_measure", fake)
    cfg = TrainConfig(run_dir=str(tmp_path))
    assert cfg.data.distill_batch_size == "auto"
    assert distill.distill_batch_size(cfg, None, 1000) == 32  # 1.6 >= 0.95 x 1.68
    assert asked == [(distill.DISTILL_BATCH_SIZES, [1])]
    ms[32] = 24.0  # 1.33: now only 64 is within 5%
    assert distill.distill_batch_size(cfg, None, 1000) == 64
    assert distill.distill_batch_size(cfg, None, 20) == 20
    fixed = TrainConfig(run_dir=str(tmp_path), data={"distill_batch_size": 12})
    assert distill.distill_batch_size(fixed, None, 1000) == 12 and len(asked) == 3


def test_later_sharegpt_turns_are_prompts_of_their_own():
    from medusa.train.data import later_turns

    conv = [{"from": "human", "value": "first"}, {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "second"}, {"from": "gpt", "value": "a2"},
            {"from": "human", "value": " "}, {"from": "gpt", "value": "a3"}, {"from": "human", "value": "last"}]
    assert later_turns([{"conversations": conv}]) == [("second", "a2"), ("last", None)]


def test_vocab_subset_covering_everything_equals_full_softmax(tiny, tmp_path):
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    root, model, data = tiny
    full = run_training(load_config(write_config(tmp_path / "a.yaml", model, data, tmp_path / "a", max_steps=4)))
    sub = run_training(load_config(write_config(tmp_path / "b.yaml", model, data, tmp_path / "b", max_steps=4,
                                                loss__vocab_subset=97)))
    assert [h["loss"] for h in sub["history"]] == pytest.approx([h["loss"] for h in full["history"]], rel=1e-5)
    small = run_training(load_config(write_config(tmp_path / "c.yaml", model, data, tmp_path / "c", epochs=3,
                                                  loss__vocab_subset=0)))
    losses = [h["loss"] for h in small["history"]]
    assert losses[-1] < losses[0]


def test_medusa2_lora_trains_adapter_and_heads(tiny, tmp_path):
    from safetensors.torch import load_file
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    root, model, data = tiny
    cfg = load_config(write_config(tmp_path / "c.yaml", model, data, tmp_path / "run", cache_hidden=False,
                                   batch_size=4, max_steps=6, medusa2={"enabled": True, "heads_only_steps": 2,
                                                                        "lora_r": 4, "target_modules": ["q_proj", "v_proj"]}))
    result = run_training(cfg)
    heads = tmp_path / "run" / "heads"
    adapter = load_file(str(heads / "adapter" / "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(float(v.abs().max()) > 0 for v in lora_b)  # B starts at zero: it trained
    assert (tmp_path / "run" / "merged" / "config.json").exists() and result["merged_model"]
    from medusa.runtime import Runtime

    rt = Runtime.load(str(tmp_path / "run" / "merged"), heads=str(heads), dtype="fp32", device="cpu")
    gen = rt.engine.generate([[5, 6, 7]], 8, rt.proposer("heads", [[0], [0, 0]]))
    assert len(gen.outputs[0].tokens) == 8


def test_wandb_offline_writes_locally(tiny, tmp_path, monkeypatch):
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    root, model, data = tiny
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(write_config(tmp_path / "c.yaml", model, data, tmp_path / "run", max_steps=3,
                                   wandb={"mode": "offline"}))
    run_training(cfg)
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert os.environ.get("WANDB_MODE") == "offline"  # nothing was sent anywhere


def test_mtbench_questions_are_never_training_prompts(monkeypatch):
    """Any source's prompt that is also an MT-bench question (the evaluation set) is dropped, whitespace
    aside, and `mtbench` itself is refused as a source."""
    from medusa.prompts import mtbench_prompts
    from medusa.train import data

    question = mtbench_prompts()[3]
    monkeypatch.setattr(data, "load_pairs", lambda source: [(question, "a"), ("something else", "b"),
                                                            ("  " + question + "\n", None)])
    assert data.training_pairs(["any"]) == [("something else", "b")]
    monkeypatch.undo()
    with pytest.raises(MedusaError, match="evaluation set"):
        data.load_pairs("mtbench")
