"""A training run writes only under its run_dir; `medusa export` is the one way heads leave it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from medusa.cli import main
from medusa.errors import MedusaError
from train_helpers import VOCAB, save_tiny_model

REPO = Path(__file__).resolve().parent.parent
SHIPPED_CONFIG = REPO / "configs" / "train" / "smollm2-medusa1.yaml"


def tree_hashes() -> dict[str, str]:
    """Every file under the directories a run must never write into."""
    return {str(p.relative_to(REPO)): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in (REPO / "medusa" / "assets", REPO / "configs") for p in sorted(root.rglob("*"))
            if p.is_file()}


def dir_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def fake_heads(directory: Path, top1: float, hidden: int = 64, num_heads: int = 3, vocab: int = VOCAB) -> Path:
    """Untrained heads with an eval.json claiming `top1` for head 1 and the trees built from it."""
    from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
    from medusa.train.outputs import write_trees

    MedusaHeads(HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads)).save(directory)
    acc = [[top1 * 0.5 ** k, top1 * 0.2 * 0.5 ** k, 0.01] for k in range(num_heads)]
    (directory / "eval.json").write_text(json.dumps({"rank_accuracy": acc}))
    write_trees(acc, [4, 8, 16], directory / "trees")
    return directory


# ---- the README's training commands ------------------------------------------------------------------
def test_readme_training_commands_write_only_under_run_dir(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"t{5 + i} t{9 + i % 7} t{20 + i % 11}" for i in range(16)) + "\n")
    run_dir = tmp_path / "run"
    tiny = ["--set", f"model={tiny_model_dir}", "--set", f"data.sources=[{prompts}]",
            "--set", f"data.distill_dir={tmp_path / 'distilled'}", "--set", "data.max_new_tokens=32",
            "--set", "data.eval_fraction=0.25", "--set", "wandb.mode=disabled"]
    before = tree_hashes()
    runs_before = (REPO / "runs").exists()

    assert main(["distill", "--config", str(SHIPPED_CONFIG), "--no-progress", "--set", "data.limit=16",
                 "--set", f"run_dir={run_dir}", *tiny]) == 0
    assert main(["train", "--config", str(SHIPPED_CONFIG), "--set", f"run_dir={run_dir}", "--set", "epochs=1",
                 *tiny]) == 0

    assert tree_hashes() == before
    assert (REPO / "runs").exists() == runs_before
    heads = run_dir / "heads"
    assert sorted(p.name for p in (heads / "trees").iterdir()) == [f"tree-{b}.yaml" for b in (16, 32, 64, 8)]
    assert {"heads.json", "heads.safetensors", "eval.json", "train_config.yaml"} <= {p.name for p in heads.iterdir()}
    saved = yaml.safe_load((heads / "train_config.yaml").read_text())
    assert "export_heads" not in saved and "write_trees" not in saved
    out = capsys.readouterr().out
    assert f"medusa generate --model {tiny_model_dir} --heads {heads} --prompt" in out
    assert "head 3: held-out top-1" in out and "tree-64" in out
    assert "expected accepted length (tau) per pass: tree-8 " in out and "hidden cache" in out


def test_old_export_keys_are_refused_with_a_pointer_to_export(tmp_path, capsys):
    for key, value in (("export_heads", "medusa/assets/heads"), ("write_trees", "configs/trees")):
        assert main(["train", "--config", str(SHIPPED_CONFIG), "--set", f"{key}={value}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{key}: no longer a config key" in err and "medusa export" in err
    legacy = tmp_path / "old.yaml"
    legacy.write_text(SHIPPED_CONFIG.read_text() + "write_trees: configs/trees\n")
    from medusa.train.config import load_config

    with pytest.raises(MedusaError, match="write_trees: no longer a config key"):
        load_config(legacy)


def test_shipped_configs_carry_no_export_keys():
    for path in (REPO / "configs" / "train").glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        assert not {"export_heads", "write_trees"} & set(data), path


# ---- where trees live and how names resolve ------------------------------------------------------------
def test_shipped_trees_live_with_the_shipped_heads_and_agree_with_their_eval():
    from medusa.decoding.proposers.heads import SHIPPED_DIR, MedusaHeads
    from medusa.decoding.trees.tree import DEFAULT_TREE, build_tree, load_tree

    assert not (REPO / "configs" / "trees").exists()
    acc = json.loads((SHIPPED_DIR / "eval.json").read_text())["rank_accuracy"]
    for budget in (8, 16, 32, 64):
        assert load_tree(f"tree-{budget}").nodes == build_tree(acc, budget).nodes
    heads = MedusaHeads.load("default")
    assert heads.directory == SHIPPED_DIR and heads.trees_dir == SHIPPED_DIR / "trees"
    assert heads.tree().name == DEFAULT_TREE
    assert len(load_tree("prior-16").nodes) == 16  # hand-made trees, medusa/assets/trees


def test_tree_names_resolve_against_the_heads_own_trees(tiny_model_dir, tmp_path):
    from medusa.runtime import Runtime
    from medusa.decoding.trees.tree import load_tree

    heads = fake_heads(tmp_path / "heads", 0.9)
    (heads / "trees" / "tree-16.yaml").write_text("paths: [[0], [0, 0], [0, 0, 0]]\n")  # unlike the shipped one
    assert load_tree("tree-16", heads_dir=heads).nodes == [(0,), (0, 0), (0, 0, 0)]
    assert len(load_tree("tree-16").nodes) == 16
    assert len(load_tree("tree-32", heads_dir=heads).nodes) == 32  # not among its own: the shipped one
    rt = Runtime.load(str(tiny_model_dir), heads=str(heads), dtype="fp32", device="cpu")
    assert rt.proposer("heads", "tree-16").tree.nodes == [(0,), (0, 0), (0, 0, 0)]
    from medusa.decoding.proposers import MedusaProposer

    assert MedusaProposer(rt.heads, "tree-16").tree.nodes == [(0,), (0, 0), (0, 0, 0)]
    assert rt.proposer("heads").tree.nodes == load_tree(str(heads / "trees" / "tree-8.yaml")).nodes
    with pytest.raises(MedusaError, match="tree-7"):
        rt.proposer("heads", "tree-7")


# ---- medusa export --out -------------------------------------------------------------------------------
def test_export_out_copies_heads_trees_and_eval(tmp_path, capsys):
    src = fake_heads(tmp_path / "run" / "heads", 0.5)
    out = tmp_path / "exported"
    assert main(["export", "--heads", str(src), "--out", str(out)]) == 0
    assert dir_hashes(out) == dir_hashes(src)
    assert {"trees/tree-8.yaml", "eval.json", "heads.json"} <= set(dir_hashes(out))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind
    # Exporting again replaces the directory as a whole: nothing stale survives.
    (out / "trees" / "tree-99.yaml").write_text("paths: [[0]]\n")
    assert main(["export", "--heads", str(src), "--out", str(out)]) == 0
    assert dir_hashes(out) == dir_hashes(src)
    assert "exported" in capsys.readouterr().out


@pytest.mark.parametrize("where, words", [("notes", "holds no heads"), ("shipped", "--to-shipped"),
                                          ("inside", "must not be"), ("file", "not a directory")])
def test_export_out_refuses_dangerous_destinations(tmp_path, capsys, where, words):
    from medusa.decoding.proposers.heads import SHIPPED_DIR

    src = fake_heads(tmp_path / "heads", 0.5)
    out = {"notes": tmp_path / "notes", "shipped": SHIPPED_DIR, "inside": src / "copy",
           "file": tmp_path / "f.txt"}[where]
    if where == "notes":
        out.mkdir()
        (out / "todo.txt").write_text("keep me")
    if where == "file":
        out.write_text("keep me")
    before = tree_hashes()
    assert main(["export", "--heads", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err and words in err
    assert tree_hashes() == before and not (src / "copy").exists()
    if where == "notes":
        assert (out / "todo.txt").read_text() == "keep me"


def test_export_needs_heads(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["export", "--heads", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "holds no heads" in capsys.readouterr().err and not (tmp_path / "o").exists()


# ---- medusa export --to-shipped ------------------------------------------------------------------------
@pytest.fixture
def shipped(tmp_path, monkeypatch) -> Path:
    """A stand-in for the shipped heads, so these tests never write the real assets."""
    import medusa.decoding.proposers.heads

    where = fake_heads(tmp_path / "shipped", 0.5)
    monkeypatch.setattr(medusa.decoding.proposers.heads, "SHIPPED_DIR", where)
    return where


def test_to_shipped_refuses_worse_heads_unless_forced(tmp_path, shipped, capsys):
    real = tree_hashes()
    old = dir_hashes(shipped)
    worse = fake_heads(tmp_path / "worse", 0.3)
    assert main(["export", "--heads", str(worse), "--to-shipped"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "measure worse" in err and "--force" in err
    assert dir_hashes(shipped) == old
    assert main(["export", "--heads", str(worse), "--to-shipped", "--force"]) == 0
    assert dir_hashes(shipped) == dir_hashes(worse)
    assert tree_hashes() == real


def test_to_shipped_accepts_better_heads_and_they_load_as_default(tmp_path, shipped, capsys):
    from medusa.decoding.proposers.heads import MedusaHeads

    better = fake_heads(tmp_path / "better", 0.8)
    (better / "trees" / "tree-8.yaml").write_text("paths: [[0], [1], [0, 0]]\n")
    assert main(["export", "--heads", str(better), "--to-shipped"]) == 0
    assert dir_hashes(shipped) == dir_hashes(better)
    assert "shipped heads replaced" in capsys.readouterr().out
    heads = MedusaHeads.load("default")
    assert heads.directory == shipped and heads.tree().nodes == [(0,), (1,), (0, 0)]


def test_to_shipped_refuses_unmeasured_or_treeless_heads(tmp_path, shipped, capsys):
    old = dir_hashes(shipped)
    unmeasured = fake_heads(tmp_path / "unmeasured", 0.9)
    (unmeasured / "eval.json").unlink()
    assert main(["export", "--heads", str(unmeasured), "--to-shipped"]) == 2
    assert "no eval.json" in capsys.readouterr().err
    treeless = fake_heads(tmp_path / "treeless", 0.9)
    shutil.rmtree(treeless / "trees")
    assert main(["export", "--heads", str(treeless), "--to-shipped", "--force"]) == 2
    assert "trees/tree-8.yaml" in capsys.readouterr().err
    other = fake_heads(tmp_path / "other", 0.9, hidden=32)
    assert main(["export", "--heads", str(other), "--to-shipped"]) == 2
    assert "hidden size" in capsys.readouterr().err
    another_vocab = fake_heads(tmp_path / "another_vocab", 0.9, vocab=VOCAB + 8)
    assert main(["export", "--heads", str(another_vocab), "--to-shipped"]) == 2
    assert f"({64}, {VOCAB + 8})" in capsys.readouterr().err  # hidden size/vocabulary named
    assert dir_hashes(shipped) == old


def test_expected_tau_by_hand():
    from medusa.decoding.trees.tree import expected_tau

    acc = [[0.5, 0.2], [0.4, 0.1]]
    # 1 + P(h1 rank 0) + P(h1 rank 1) + P(h1 rank 0, h2 rank 0) + P(h1 rank 0, h2 rank 1); depth 3 is unmeasured.
    assert expected_tau([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)], acc) == pytest.approx(1 + 0.5 + 0.2 + 0.2 + 0.05)


def test_export_shipped_names_as_generate_reads_them(tmp_path, shipped, tiny_model_dir, capsys):
    """`--heads medusa` exports the shipped Medusa heads (here a stand-in), e.g. to serve them with vLLM;
    `--heads default` names what `medusa generate --heads default` drafts with: the shipped feature heads while
    they are marked preferred, which a Medusa layout cannot hold."""
    out = tmp_path / "vllm"
    assert main(["export", "--heads", "medusa", "--format", "vllm", "--out", str(out),
                 "--model", str(tiny_model_dir)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3
    assert (out / "trees" / "tree-8.yaml").read_text() == (shipped / "trees" / "tree-8.yaml").read_text()
    assert main(["export", "--heads", "medusa", "--out", str(tmp_path / "by-kind")]) == 0
    assert dir_hashes(tmp_path / "by-kind") == dir_hashes(shipped)
    from medusa.runtime.feature import shipped_preferred

    if shipped_preferred():
        capsys.readouterr()
        assert main(["export", "--heads", "default", "--format", "vllm", "--out", str(tmp_path / "d"),
                     "--model", str(tiny_model_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--heads" in err and "--format vllm" in err
        assert not (tmp_path / "d").exists()
