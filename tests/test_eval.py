"""The evaluator end to end on a tiny random model: every method runs, the report has its schema."""

import json

import pytest
import torch
import yaml

from conftest import random_heads, tiny_model
from medusa.cli import main
from medusa.eval.config import load_config
from medusa.eval.driver import prompts_for_batch
from medusa.errors import MedusaError
from medusa.eval.report import validate


def tiny_checkpoint(root):
    """A tiny Llama with a word-level tokenizer and random heads, saved as a user would pass them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama", seed=4)
    model_dir, heads_dir = root / "model", root / "heads"
    model.save_pretrained(model_dir)
    vocab = {f"w{i}": i for i in range(97)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(model_dir)
    random_heads(model).save(heads_dir)
    g = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{int(t)}" for t in torch.randint(0, 97, (n,), generator=g)) for n in (3, 9, 5, 12)]
    (root / "prompts.txt").write_text("\n".join(prompts) + "\n")
    return model_dir, heads_dir, root / "prompts.txt"


def test_eval_end_to_end_schema(tmp_path, capsys):
    model_dir, heads_dir, prompts = tiny_checkpoint(tmp_path)
    cfg = {"model": str(model_dir), "heads": str(heads_dir), "dtype": "fp32", "device": "cpu",
           "prompts": str(prompts), "raw_prompts": True, "max_new_tokens": 12, "repeats": 2, "threads": 1,
           "batch_sizes": [1, 4, 8], "hf_batch_sizes": [1, 4],
           "methods": [{"method": "plain"}, {"method": "heads", "tree": "tree-8"},
                       {"method": "draft", "draft": "layers:1", "k": 3}, {"method": "lookup", "k": 4},
                       {"method": "hf"}, {"method": "hf_assisted", "draft": "layers:1", "k": 3},
                       {"method": "hf_lookup", "k": 4}],
           "cost_model": {"tokens": [1, 2, 4], "prefix": 16, "repeats": 1}}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    rc = main(["eval", "--config", str(tmp_path / "eval.yaml"), "--out", str(out), "--batch-sizes", "1,4",
               "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    validate(report)
    got = {(r["method"], r["batch_size"]) for r in report["results"]}
    ours = {"plain", "heads:tree-8", "draft", "lookup"}
    assert got == {(m, b) for m in ours for b in (1, 4)} | {("hf", 1), ("hf", 4), ("hf_assisted", 1),
                                                           ("hf_lookup", 1)}
    for r in report["results"]:
        assert r["greedy_mismatches"] == 0, r  # lossless: every output equals its plain reference
        assert r["tokens_per_s_total"] > 0 and r["tokens_per_s_per_user"] > 0
        if r["method"] == "plain":
            assert r["speedup_vs_plain"] == 1.0 and r["mean_accepted"] == 1.0
        elif r["kind"] in ("heads", "draft", "lookup"):
            assert r["mean_accepted"] >= 1.0 and len(r["acceptance_by_head"]) >= 1
            assert all(0 <= a <= 1 for a in r["acceptance_by_head"])
    assert report["max_new_tokens"] == 12 and report["dtype"] == "fp32" and report["num_prompts"] == 4
    cm = report["cost_model"]
    assert set(cm["recommendation"]) == {"1", "4"} and set(cm["recommendation"].values()) <= {"heads", "draft", "plain"}
    assert cm["best_tree"]["1"] == "tree-8"
    assert cm["recommendation_source"] == {"1": "measured", "4": "measured"}
    assert {"target", "draft", "heads"} <= set(cm["latency_ms"])
    assert set(report["crossover"]) >= {"heads", "draft"}
    assert json.loads((out / "cost_model.json").read_text())["recommendation"] == cm["recommendation"]
    for name in ("report.md", "speedup.png", "throughput.png", "acceptance.png", "predicted_vs_measured.png"):
        assert (out / name).stat().st_size > 0
    assert "| draft | 4 |" in (out / "report.md").read_text()
    # An interrupted evaluation can still be finished from the summaries written after every run.
    rc = main(["eval", "--config", str(tmp_path / "eval.yaml"), "--out", str(tmp_path / "again"),
               "--from-partial", str(out / "partial.json"), "--no-progress"])
    assert rc == 0
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    validate(again)
    assert again["interrupted"] and len(again["results"]) == len(report["results"])
    assert set(again["cost_model"]["recommendation"]) == {"1", "4"}


def test_eval_sampled(tmp_path, capsys):
    """--temperature: every method samples, medusa by rejection; the report says so and skips equality."""
    model_dir, heads_dir, prompts = tiny_checkpoint(tmp_path)
    cfg = {"model": str(model_dir), "heads": str(heads_dir), "dtype": "fp32", "device": "cpu",
           "prompts": str(prompts), "raw_prompts": True, "max_new_tokens": 10, "repeats": 1, "threads": 1,
           "batch_sizes": [1, 4], "methods": [{"method": "plain"}, {"method": "heads", "tree": "tree-8"},
                                               {"method": "hf"}],
           "cost_model": {"enabled": False}}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    rc = main(["eval", "--config", str(tmp_path / "eval.yaml"), "--out", str(tmp_path / "out"),
               "--temperature", "0.8", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    validate(report)
    assert report["sampling"] == {"temperature": 0.8, "top_p": 1.0, "acceptance": "rejection"}
    assert all(r["greedy_mismatches"] is None for r in report["results"])
    medusa = [r for r in report["results"] if r["kind"] == "heads"]
    assert medusa and all(r["mean_accepted"] >= 1.0 for r in medusa)
    from medusa.eval.config import load_config as load_eval

    with pytest.raises(MedusaError, match="temperature"):
        load_eval(str(tmp_path / "eval.yaml"), {"temperature": -1})


def test_prompts_fill_whole_batches():
    assert prompts_for_batch([[1], [2], [3]], 2) == [[1], [2], [3], [1]]
    assert prompts_for_batch([[1], [2]], 4) == [[1], [2], [1], [2]]


@pytest.mark.parametrize("cfg, message", [
    ({"batch_sizes": [0, 2]}, "batch_sizes"),
    ({"methods": [{"method": "beam"}]}, "methods.0.method"),
    ({"methods": [{"method": "draft", "k": 0}]}, "methods.0.k"),
    ({"colour": "red"}, "colour"),
    ({"methods": [{"method": "heads"}, {"method": "heads"}]}, "duplicate"),
])
def test_bad_config_is_a_clear_error(tmp_path, cfg, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(MedusaError, match=message):
        load_config(str(path))


def test_cli_bad_config_path(capsys):
    rc = main(["eval", "--config", "/no/such.yaml", "--out", "/tmp/x"])
    err = capsys.readouterr().err
    assert rc == 2 and "--config" in err and "Traceback" not in err


def test_eval_runs_default_flags_batch_invariant_over_several_prompt_sets(tmp_path, capsys):
    """`method: auto` is what `medusa generate` does without --mode; prompts may list several sources
    (max_prompts from each); `--batch-invariant on` reaches the runtime (on a CPU whose kernels cannot give
    invariance it is refused with the flag named, and the run goes on without). Every output is plain
    decoding's."""
    from medusa.decoding.target.invariant import probe

    model_dir, heads_dir, prompts = tiny_checkpoint(tmp_path)
    # Held-out accuracies: auto mode plans from them (and the run records the share of gain it delivered).
    (heads_dir / "eval.json").write_text(json.dumps({"rank_accuracy": [[0.9, 0.05], [0.8, 0.1]]}))
    more = tmp_path / "more.txt"
    more.write_text("w5 w6 w7\nw1 w2 w3 w4 w5 w6\nw9\n")
    cfg = {"model": str(model_dir), "heads": str(heads_dir), "dtype": "fp32", "device": "cpu",
           "prompts": [str(prompts), str(more)], "max_prompts": 3, "raw_prompts": True, "max_new_tokens": 10,
           "repeats": 1, "threads": 1, "batch_sizes": [1, 2],
           "methods": [{"method": "plain"}, {"method": "auto", "label": "default"}],
           "cost_model": {"enabled": False}}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    invariant = probe("cpu", torch.float32) is None
    rc = main(["eval", "--config", str(tmp_path / "eval.yaml"), "--out", str(out), "--batch-invariant", "on",
               "--no-progress"])
    if not invariant:
        assert rc == 2 and "--batch-invariant on" in capsys.readouterr().err
        rc = main(["eval", "--config", str(tmp_path / "eval.yaml"), "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    validate(report)
    assert report["num_prompts"] == 6 and report["config"]["batch_invariant"] is invariant
    auto = [r for r in report["results"] if r["method"] == "default"]
    assert {r["batch_size"] for r in auto} == {1, 2} and all(r["kind"] == "auto" for r in auto)
    assert all(r["greedy_mismatches"] == 0 and r["mean_accepted"] >= 1.0 for r in auto)
    assert "auto" in report["measured_crossover"]
    # Planned from accuracies, so the run says what share of the planned gain its steps delivered (if it
    # speculated at all: a machine where no tree pays plans plain decoding throughout).
    assert all(r.get("realised", 0.0) >= 0.0 for r in auto)
    assert all("realised" in r for r in auto if r["mean_accepted"] > 1.0)
