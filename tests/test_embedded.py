"""Integration on the embedded SmolLM2-135M-Instruct (fp32): the real model, the real chat template."""

import json

import pytest
import torch

from conftest import hf_greedy, without_gate
from medusa.cli import main
from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.decoding.target.model import embedded_gguf, resolve_model_dir
from medusa.decoding.proposers import MedusaProposer
from medusa.decoding.trees.tree import load_tree

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers and explain why they are prime."]


def test_plain_and_medusa_match_hf_generate(embedded):
    rt = embedded
    prompts = rt.encode(PROMPTS)
    assert len({len(p) for p in prompts}) == 3
    eos = rt.engine.eos.tolist()[0]
    reference = [hf_greedy(rt.hf_model, p, 40, eos=eos) for p in prompts]
    plain = rt.engine.generate(prompts, 40)
    assert [o.tokens for o in plain.outputs] == reference
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(576, 49152, 4)).attach(rt.hf_model)
    for block in heads.blocks:
        torch.nn.init.normal_(block[0].linear.weight, std=0.02)
    candidates = [heads]
    if rt.heads is not None:
        candidates.append(rt.heads)  # the shipped, trained heads
    for h in candidates:
        spec = rt.engine.generate(prompts, 40, MedusaProposer(h, load_tree("tree-16")))
        assert [o.tokens for o in spec.outputs] == reference
    assert "Paris" in rt.decode(plain.outputs[0].tokens)


def test_gguf_path_uses_the_same_cache():
    assert resolve_model_dir(str(embedded_gguf())) == resolve_model_dir("default")


def test_cli_generate_json(embedded, capsys):
    rc = main(["generate", "--prompt", "Say hello.", "--prompt", "Count to five.", "--mode", "plain",
               "--max-new-tokens", "12", "--dtype", "fp32", "--device", "cpu", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the last line: other libraries may log
    assert len(data["outputs"]) == 2 and all(o["text"] and o["token_ids"] for o in data["outputs"])
    stats = data["stats"]
    assert {"mode", "batch_size", "new_tokens", "forward_passes", "mean_accepted", "tokens_per_s",
            "seconds"} <= set(stats)
    assert stats["batch_size"] == 2 and stats["mode"] == "plain" and stats["mean_accepted"] == 1.0
    assert stats["new_tokens"] == sum(len(o["token_ids"]) for o in data["outputs"])
    # Plain decoding calibrates nothing: its passes are the prefill and one per step after the first token.
    assert stats["overhead"]["calibration_passes"] == 0 and stats["overhead"]["planning_in_decoding_s"] == 0
    assert stats["forward_passes"] == 1 + max(len(o["token_ids"]) for o in data["outputs"]) - 1


def test_cli_generate_counts_calibration_passes_apart(embedded, capsys, tmp_path, monkeypatch):
    """Default flags on a machine with no cached curve: the calibration's timing passes are counted in
    forward_passes and reported under overhead, apart from decoding's seconds."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    from medusa.runtime import calibrate

    monkeypatch.setattr(calibrate, "calibration_path", lambda key: tmp_path / "curve.json")
    monkeypatch.setattr(calibrate, "TOKENS", [1, 2, 4, 8])
    monkeypatch.setattr(calibrate, "REPEATS", 1)
    monkeypatch.setattr(calibrate, "DRAFT_TOKENS", [1, 2, 4, 8])
    rc = main(["generate", "--prompt", "Say hello.", "--max-new-tokens", "8", "--dtype", "fp32", "--device", "cpu",
               "--json"])
    assert rc == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    over = stats["overhead"]
    assert over["calibration_passes"] > 0 and over["calibration_s"] > 0
    assert stats["forward_passes"] >= over["calibration_passes"] + 1


def test_cli_model_directory_qwen2(embedded, tmp_path, capsys):
    """--model takes a local HF checkpoint of another architecture."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.3, eos_token_id=2)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    embedded.tokenizer.save_pretrained(tmp_path)
    rc = main(["generate", "--prompt", "hello", "--model", str(tmp_path), "--mode", "plain", "--raw",
               "--max-new-tokens", "5", "--dtype", "fp32", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["new_tokens"] == 5


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "  "], "--prompt 1 is empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--prompt", "hi", "--model", "/no/such/model"], "--model"),
    (["--prompt", "hi", "--tree", "tree-7"], "--tree"),
    (["--prompt", "hi", "--heads", "/no/such/heads"], "--heads"),
])
def test_cli_bad_input_is_a_clear_error(embedded, capsys, argv, message):
    rc = main(["generate", "--dtype", "fp32", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_cli_heads_for_another_model(embedded, tmp_path, capsys):
    MedusaHeads(HeadsConfig(hidden_size=128, vocab_size=49152)).save(tmp_path)
    rc = main(["generate", "--prompt", "hi", "--heads", str(tmp_path), "--dtype", "fp32"])
    err = capsys.readouterr().err
    assert rc == 2 and "hidden size 128" in err


def test_auto_mode_plans_from_the_shipped_heads_and_decodes_losslessly(embedded, tmp_path, monkeypatch):
    """Auto mode on the real model: calibrates (a short sweep, into a temporary file), predicts from the
    shipped heads' eval.json, and, whatever it picks per step, gives plain decoding's tokens (fp32)."""
    from medusa.runtime import calibrate

    monkeypatch.setattr(calibrate, "TOKENS", [1, 2, 4, 8, 16])
    monkeypatch.setattr(calibrate, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "calibration_path", lambda key: tmp_path / "curve.json")
    rt = embedded
    if rt.heads is None:
        pytest.skip("no shipped heads for the embedded model")
    auto = rt.auto(2, progress=False)
    assert auto is not None and auto.predicted
    without_gate(auto)
    plan = auto.plan(2)  # what the calibrated curve predicts at the batch decoded below
    assert plan.reason and (plan.tree is None or plan.speedup >= 1.05)
    assert json.loads((tmp_path / "curve.json").read_text())["key"]["dtype"] == "fp32"
    if plan.tree is None:  # plain predicted on this machine: decode with the heads' own tree instead,
        from medusa.runtime.auto import Plan  # so that the tokens compared below come from speculation

        forced = Plan(2, rt.heads.tree(), 1.0, 1.0, "the heads' own tree")
        monkeypatch.setattr(auto, "_plans", lambda rows: forced)
    prompts = rt.encode(PROMPTS[:2])
    plain = rt.engine.generate(prompts, 32)
    mixed = rt.engine.generate(prompts, 32, policy=auto)
    assert [o.tokens for o in mixed.outputs] == [o.tokens for o in plain.outputs]
    assert sum(auto.steps.values()) == mixed.stats.steps
    assert auto.steps["speculative"] > 0
    assert sum(a * c for a, c in enumerate(mixed.stats.accept_hist)) > 0  # the shipped heads were accepted


def test_generate_auto_json_reports_machine_dtype_and_plan(embedded, capsys, tmp_path, monkeypatch):
    from medusa.runtime import calibrate

    monkeypatch.setattr(calibrate, "TOKENS", [1, 2, 4, 8, 16])
    monkeypatch.setattr(calibrate, "REPEATS", 2)
    monkeypatch.setattr(calibrate, "calibration_path", lambda key: tmp_path / "curve.json")
    assert main(["generate", "--prompt", "Name a color.", "--max-new-tokens", "8", "--dtype", "float32",
                 "--json"]) == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.out)["stats"]
    assert stats["mode"] == "auto" and stats["dtype"] == "fp32"
    assert stats["auto"]["machine"]["device"] == "cpu" and stats["auto"]["plan"]["batch_size"] == 1
    assert "auto mode on" in captured.err
    assert main(["generate", "--prompt", "x", "--tree", "tree-16"]) == 2
    assert "--tree" in capsys.readouterr().err
