"""Prompt and training-pair files: one reader for the CLI's `--prompts` and training's `data.sources`."""

from __future__ import annotations

import json

import pytest

from medusa.errors import MedusaError
from medusa.prompts import load_prompts
from medusa.train.data import load_pairs

RECORDS = ["a plain string",
           {"prompt": "with an answer", "response": "the answer"},
           {"turns": ["first turn", "second turn"]},
           {"conversations": [{"from": "human", "value": "sharegpt style"}, {"from": "gpt", "value": "reply"}]},
           {"messages": [{"role": "user", "content": "chat style"}, {"role": "assistant", "content": "hi"}]}]
PROMPTS = ["a plain string", "with an answer", "first turn", "sharegpt style", "chat style"]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_every_record_kind_in_every_file_kind(tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(RECORDS))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    else:
        from datasets import Dataset

        rows = [r for r in RECORDS if isinstance(r, dict) and "messages" in r]  # parquet wants one schema
        Dataset.from_list(rows).to_parquet(str(path))
    want = PROMPTS if suffix != ".parquet" else ["chat style"]
    assert load_prompts(str(path)) == want
    assert [p for p, _ in load_pairs(str(path))] == want
    assert load_prompts(str(path), limit=1) == want[:1]
    if suffix != ".parquet":
        assert dict(load_pairs(str(path)))["with an answer"] == "the answer"


def test_text_files_and_clear_errors(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert load_prompts(str(txt)) == ["one", "two"]
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps([{"text": "no known key"}]))
    with pytest.raises(MedusaError, match="prompt file .*'prompt', 'turns', 'conversations' or 'messages'"):
        load_prompts(str(bad))
    odd = tmp_path / "p.csv"
    odd.write_text("x\n")
    with pytest.raises(MedusaError, match=r"prompt file: .*p.csv: use .txt, .json, .jsonl or .parquet"):
        load_prompts(str(odd))
    with pytest.raises(MedusaError, match=r"data.sources: .*p.csv: use"):
        load_pairs(str(odd))
