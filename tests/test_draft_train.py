"""`medusa train-draft`: its command line and where it finds the distilled answers of the default model."""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_train_draft_reads_the_shipped_configs_distilled_dataset():
    """The defaults carried in code name the same distilled dataset as configs/train/smollm2-medusa1.yaml."""
    from medusa.train.config import load_config
    from medusa.train.distill import distill_dir
    from medusa.train.draft import shipped_distill_config

    config = load_config(REPO / "configs" / "train" / "smollm2-medusa1.yaml")
    assert distill_dir(shipped_distill_config()) == distill_dir(config)


def test_train_draft_command_and_its_defaults():
    from medusa.train.cli import add_parser, cmd_train_draft

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train-draft"])
    assert args.func is cmd_train_draft
    assert (args.model, args.layers, args.data, args.distill_prompts, args.steps, args.batch_size, args.seq_len,
            args.lr, args.vocab, args.out, args.no_progress) == ("default", 4, None, 128, 300, 8, 256, 3e-4, 8192,
                                                                 None, False)


def test_train_draft_refuses_bad_sizes_before_loading_anything(capsys):
    from medusa.cli import main

    assert main(["train-draft", "--steps", "0"]) == 2
    assert "--steps and --batch-size must be >= 1" in capsys.readouterr().err


def test_draft_schedule_warms_up_then_decays():
    from medusa.train.optim import lr_schedule

    f = lr_schedule(10, 100)
    assert f(0) == 0.1 and f(9) == 1.0 and f(10) == 1.0 and abs(f(100)) < 1e-12
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


def test_draft_trains_on_a_distilled_dataset(tmp_path):
    """The draft learns the distilled answers: after 30 steps its training loss is a fraction of the
    untrained draft's (the loss of a 1-step run, taken before its only update)."""
    import json

    from train_helpers import fake_distilled, save_tiny_model

    from medusa.train.draft import train_draft

    model = save_tiny_model(tmp_path / "model")
    data = fake_distilled(tmp_path / "data", model, n=12, answer_len=12)

    def run(steps: int, name: str) -> dict:
        out = train_draft(model=str(model), layers=1, data=str(data), steps=steps, batch_size=4, seq_len=32,
                          lr=3e-3, out=str(tmp_path / name), progress=False, vocab=50)
        return json.loads((out / "draft.json").read_text())

    untrained, meta = run(1, "untrained"), run(30, "draft")
    assert meta["num_layers"] == 1 and meta["vocab_subset"] == 50 and meta["steps"] == 30
    assert meta["data"] == str(data) and meta["examples"] == 11 and 0 <= meta["heldout_top1_after"] <= 1
    assert meta["final_loss"] < untrained["final_loss"] / 4, (untrained["final_loss"], meta["final_loss"])
