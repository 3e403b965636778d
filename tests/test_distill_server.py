"""`medusa distill --server URL`: answers from an OpenAI-compatible server (here `medusa serve` over a tiny
model), written in the same shards, resumable; a server that is not there is one clear error."""

from __future__ import annotations

import json

import pytest
import yaml

from medusa.cli import main
from medusa.train.distill import load_distilled
from test_serve import alone, chat_ids, serve

PROMPTS = ["Name a colour.", "Count to three.", "Say hi.", "What is two plus two?", "Name a fruit.",
           "Spell cat.", "Name a month."]


def _config(tmp_path, limit: int) -> str:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfg = {"model": "default", "dtype": "fp32",
           "data": {"sources": [str(tmp_path / "prompts.jsonl")], "limit": limit, "max_new_tokens": 12,
                    "shard_size": 3, "distill_dir": str(tmp_path / "distilled")}}
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_answers_come_from_the_server_in_shards_and_resume(rt, tokenizer, tmp_path, capsys):
    with serve(rt, policy={"mode": "plain"}) as url:
        assert main(["distill", "--config", _config(tmp_path, 6), "--server", url, "--concurrency", "3",
                     "--no-progress"]) == 0
        first = load_distilled(tmp_path / "distilled")
        shard = json.loads((tmp_path / "distilled" / "shard-00000" / "count.json").read_text())
        assert len(first) == 6 and shard["server"] == url and shard["served_model"] == "default"
        for row in first:  # the server's greedy answer, as decoding the prompt alone here gives it
            text, _, reason = alone(rt, chat_ids(tokenizer, row["prompt"]), 12)
            assert row["response"].strip() == text.strip() and row["finish_reason"] == reason
            assert row["prompt_ids"] == chat_ids(tokenizer, row["prompt"])
        # One more prompt: only its shard is asked for; the finished ones stay as they were.
        assert main(["distill", "--config", _config(tmp_path, 7), "--server", url + "/v1", "--no-progress"]) == 0
    again = load_distilled(tmp_path / "distilled")
    assert len(again) == 7 and again[:6]["response_ids"] == first["response_ids"]


def test_no_server_there_is_one_clear_error(tmp_path, capsys):
    from test_serve import free_port

    rc = main(["distill", "--config", _config(tmp_path, 3), "--server", f"http://127.0.0.1:{free_port()}",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--server: cannot list the models of" in err and "Traceback" not in err
    assert main(["distill", "--config", _config(tmp_path, 3), "--server", "ftp://x", "--no-progress"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err


def test_a_server_with_another_tokenizer_is_refused(rt, tmp_path, capsys):
    from train_helpers import save_tiny_model

    other = save_tiny_model(tmp_path / "word-level")  # a target whose tokenizer is not the served one's
    cfg = yaml.safe_load(open(_config(tmp_path, 3)))
    cfg["model"] = str(other)
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(cfg))
    with serve(rt, policy={"mode": "plain"}) as url:
        rc = main(["distill", "--config", str(tmp_path / "other.yaml"), "--server", url, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not tokenise as the target does" in err and "'default'" in err
    assert not list((tmp_path / "distilled").glob("shard-*"))


def test_the_embedded_model_served_gives_the_tokens_of_in_process_distillation(embedded, tmp_path):
    """fp32, greedy, served with the default (speculating) policy: the same token ids as distilling here."""
    from medusa.train.config import load_config
    from medusa.train.distill import run_distill

    path = _config(tmp_path, 3)
    here = load_config(path, ["data.distill_dir=" + str(tmp_path / "here")])
    run_distill(here, runtime=embedded, show_progress=False)
    with serve(embedded, policy={"mode": "dynamic"}) as url:
        run_distill(load_config(path), show_progress=False, server=url, concurrency=2)
    a, b = load_distilled(tmp_path / "here"), load_distilled(tmp_path / "distilled")
    assert a["prompt_ids"] == b["prompt_ids"] and a["finish_reason"] == b["finish_reason"]
    assert a["response_ids"] == b["response_ids"] and all(len(r) >= 3 for r in a["response_ids"])
