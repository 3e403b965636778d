"""Every written result says where it was measured and how: the machine (with the dtype) and the command."""

import json
import sys
from pathlib import Path

import yaml

from medusa.cli import main
from medusa.decoding.target.hardware import command_line, machine, provenance
from test_eval import tiny_checkpoint

MACHINE_KEYS = {"device", "name", "capability", "native_bf16", "threads", "dtype"}


def _as_run(monkeypatch, argv: list[str]) -> str:
    """sys.argv as the installed `medusa` entry point sets it; returns the command line a result records."""
    monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).parent / "medusa"), *argv])
    return command_line()


def test_provenance_names_the_machine_dtype_and_command(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/soak.py", "--out", "a b.json"])
    got = provenance("float32", threads=1)
    assert got["command"] == "benchmarks/soak.py --out 'a b.json'"
    assert got["machine"] == {**machine().to_dict(), "threads": 1, "dtype": "fp32"}
    assert set(got["machine"]) == MACHINE_KEYS
    assert _as_run(monkeypatch, ["bench", "--json", "x.json"]) == "medusa bench --json x.json"


def test_bench_json_carries_machine_and_command(tmp_path, monkeypatch, capsys):
    import medusa.eval.bench as bench

    model_dir, heads_dir, prompts = tiny_checkpoint(tmp_path)
    # The tree pass timings feed tokens 1000+, beyond the tiny model's vocabulary.
    monkeypatch.setattr(bench, "tree_pass_curve", lambda rt: {1: 1.0, 8: 1.2})
    argv = ["bench", "--model", str(model_dir), "--heads", str(heads_dir), "--dtype", "fp32", "--device", "cpu",
            "--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens", "4", "--no-hf",
            "--feature", "none", "--threads", "1", "--json", str(tmp_path / "bench.json")]
    expected = _as_run(monkeypatch, argv)
    assert main(argv) == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["command"] == expected and expected.startswith("medusa bench --model ")
    assert set(res["machine"]) == MACHINE_KEYS
    assert res["machine"]["dtype"] == "fp32" and res["machine"]["threads"] == 1
    assert res["machine"]["name"] == machine().name


def test_eval_report_carries_machine_and_command(tmp_path, monkeypatch, capsys):
    model_dir, heads_dir, prompts = tiny_checkpoint(tmp_path)
    cfg = {"model": str(model_dir), "heads": str(heads_dir), "dtype": "fp32", "device": "cpu",
           "prompts": str(prompts), "raw_prompts": True, "max_new_tokens": 4, "repeats": 1, "threads": 1,
           "batch_sizes": [1], "methods": [{"method": "plain"}, {"method": "heads", "tree": "tree-8"}],
           "cost_model": {"enabled": False}}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    argv = ["eval", "--config", str(tmp_path / "eval.yaml"), "--out", str(tmp_path / "out"), "--no-progress"]
    expected = _as_run(monkeypatch, argv)
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["command"] == expected and expected.startswith("medusa eval --config ")
    assert set(report["machine"]) == MACHINE_KEYS
    assert report["machine"]["dtype"] == report["dtype"] == "fp32" and report["machine"]["threads"] == 1
