"""Prompt sources and tokenisation: chat template, loss only on the assistant's tokens.

A training example is `input_ids` (chat-formatted prompt followed by the answer) with `loss_mask` 1 on
the answer's tokens. Head k (0-based) at position t is trained on the token at t+k+2, counted only when
that token is an answer token, so the prompt and the system text never appear as labels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from medusa.errors import MedusaError
from medusa.prompts import mtbench_prompts, sharegpt_conversations


def _local_records(path: Path) -> list:
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
    raise MedusaError(f"data.sources: {path}: use .json, .jsonl, .parquet or .txt")


def _pair_of(item) -> tuple[str, str | None] | None:
    """(prompt, reference answer or None) from a string, a prompt/response row, or a conversation."""
    if isinstance(item, str):
        return item, None
    if not isinstance(item, dict):
        return None
    if "prompt" in item:
        return item["prompt"], item.get("response") or item.get("answer")
    if "turns" in item:
        return item["turns"][0], None
    conv = item.get("conversations") or item.get("messages")
    if isinstance(conv, list) and conv:
        first = conv[0]
        text = first.get("value", first.get("content", ""))
        answer = None
        if len(conv) > 1:
            answer = conv[1].get("value", conv[1].get("content"))
        return text, answer
    return None


def load_pairs(source: str) -> list[tuple[str, str | None]]:
    """First user turn (and the source's own answer, when it has one) of every record of a source."""
    if source == "mtbench":
        raise MedusaError("data.sources: 'mtbench' is the evaluation set and cannot be trained on")
    if source == "sharegpt":
        items = sharegpt_conversations()
    elif Path(source).exists():
        items = _local_records(Path(source))
    elif source.count("/") == 1:
        from datasets import load_dataset

        try:
            items = list(load_dataset(source, split="train"))
        except Exception as exc:  # offline, unknown id, ...: one line for the user
            raise MedusaError(f"data.sources: cannot load hub dataset {source!r}: {str(exc)[:200]}") from None
    else:
        raise MedusaError(f"data.sources: {source!r} is neither 'sharegpt', a local file nor a hub id")
    pairs = []
    for item in items:
        pair = _pair_of(item)
        if pair is not None and isinstance(pair[0], str) and pair[0].strip():
            pairs.append(pair)
    return pairs


def training_pairs(sources: list[str], limit: int | None = None) -> list[tuple[str, str | None]]:
    """Prompts from every source, de-duplicated, with anything that is also an MT-bench question removed."""
    try:
        held_out = {p.strip() for p in mtbench_prompts()}
    except MedusaError:
        held_out = set()  # no registry access: nothing to compare with
    seen, out = set(), []
    for source in sources:
        for prompt, answer in load_pairs(source):
            key = prompt.strip()
            if key in seen or key in held_out:
                continue
            seen.add(key)
            out.append((prompt, answer))
    return out[:limit] if limit else out


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the engine sees it: one user message and the assistant header."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if not isinstance(ids, list) else ids)
    return list(tokenizer(prompt)["input_ids"])


def answer_ids(tokenizer, answer: str, eos_id: int | None) -> list[int]:
    """A reference answer's tokens, closed by the end-of-turn token as the template would."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return list(ids) + ([eos_id] if eos_id is not None else [])


def example(prompt_ids: list[int], response_ids: list[int], max_tokens: int) -> dict | None:
    """input_ids + loss_mask, cut to max_tokens; None when fewer than 3 answer tokens remain."""
    ids = (list(prompt_ids) + list(response_ids))[:max_tokens]
    mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_tokens]
    if sum(mask) < 3:
        return None
    return {"input_ids": ids, "loss_mask": mask}


def head_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, T] -> [B, T, num_heads] label of head k at position t (token t+k+2), -100 where not trained:
    the target is not an answer token, or t lies before the last prompt token."""
    b, t = input_ids.shape
    mask = loss_mask.bool()
    # Heads only ever run on the last committed position, which is the last prompt token or later.
    source = mask.clone()
    source[:, :-1] |= mask[:, 1:]
    labels = torch.full((b, t, num_heads), -100, dtype=torch.long, device=input_ids.device)
    for k in range(num_heads):
        shift = k + 2
        if shift >= t:
            break
        ok = mask[:, shift:] & source[:, : t - shift]
        labels[:, : t - shift, k] = torch.where(ok, input_ids[:, shift:], -100)
    return labels


def pad_batch(examples: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    t = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), t, dtype=torch.long)
    attn = torch.zeros(len(examples), t, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        mask[i, :n] = torch.tensor(e["loss_mask"])
        attn[i, :n] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def split_eval(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train / held-out split of n examples (at least one held out when fraction > 0)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    k = max(1, int(round(n * fraction))) if fraction > 0 and n > 1 else 0
    return sorted(order[k:]), sorted(order[:k])
