"""Prompt sources and tokenisation: chat template, loss only on the assistant's tokens.

A training example is `input_ids` (chat-formatted prompt followed by the answer) with `loss_mask` 1 on
the answer's tokens. Head k (0-based) at position t is trained on the token at t+k+2, counted only when
that token is an answer token, so the prompt and the system text never appear as labels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from medusa.decoding.target.chat import chat_ids
from medusa.errors import MedusaError
from medusa.prompts import mtbench_prompts, pair_of, read_records, sharegpt_conversations


def later_turns(records: list[dict]) -> list[tuple[str, str | None]]:
    """Every human turn after the first of each conversation, as a prompt of its own, with the reply that
    followed it (None at the end)."""
    out = []
    for rec in records:
        conv = rec["conversations"]
        for i in range(2, len(conv)):
            turn = conv[i]
            if turn.get("from") == "human" and isinstance(turn.get("value"), str) and turn["value"].strip():
                nxt = conv[i + 1] if i + 1 < len(conv) else {}
                out.append((turn["value"], nxt.get("value") if nxt.get("from") == "gpt" else None))
    return out


def load_pairs(source: str) -> list[tuple[str, str | None]]:
    """First user turn (and the source's own answer, when it has one) of every record of a source;
    `sharegpt-turns`: ShareGPT's later user turns, each a prompt of its own."""
    if source == "mtbench":
        raise MedusaError("data.sources: 'mtbench' is the evaluation set and cannot be trained on")
    if source == "sharegpt-turns":
        return later_turns(sharegpt_conversations())
    if source == "sharegpt":
        items = sharegpt_conversations()
    elif Path(source).exists():
        items = read_records(Path(source), "data.sources")
    elif source.count("/") == 1:
        from datasets import load_dataset

        try:
            items = list(load_dataset(source, split="train"))
        except Exception as exc:  # offline, unknown id, ...: one line for the user
            raise MedusaError(f"data.sources: cannot load hub dataset {source!r}: {str(exc)[:200]}") from None
    else:
        raise MedusaError(f"data.sources: {source!r} is neither 'sharegpt', 'sharegpt-turns', a local file nor "
                          "a hub id")
    pairs = []
    for item in items:
        pair = pair_of(item)
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


def answer_ids(tokenizer, answer: str, eos_id: int | None) -> list[int]:
    """A reference answer's tokens, closed by the end-of-turn token as the template would."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return list(ids) + ([eos_id] if eos_id is not None else [])


def example(prompt_ids: list[int], response_ids: list[int], max_tokens: int, min_answer: int = 3,
            context: int | None = None) -> dict | None:
    """input_ids + loss_mask, cut to max_tokens; None when fewer than `min_answer` answer tokens remain.
    With `context`, a long example first loses the front of its prompt (down to `context` tokens), so that
    the answer's start is kept, and only then its tail."""
    ids = list(prompt_ids) + list(response_ids)
    mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    if context is not None and len(ids) > max_tokens:
        cut = min(len(ids) - max_tokens, max(len(prompt_ids) - context, 0))
        ids, mask = ids[cut:], mask[cut:]
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    if sum(mask) < min_answer:
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


def length_batches(examples: list[dict], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of the examples in batches of similar length (shortest first), each padded batch holding
    at most `batch_tokens` tokens (a longer example gets a batch of its own)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * len(examples[order[j]]["input_ids"]) <= batch_tokens:
            j += 1
        yield order[i:j]
        i = j


def split_eval(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train / held-out split of n examples (at least one held out when fraction > 0)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    k = max(1, int(round(n * fraction))) if fraction > 0 and n > 1 else 0
    return sorted(order[k:]), sorted(order[:k])


def load_examples(cfg, tokenizer) -> list[tuple[str, list[dict]]]:
    """Tokenised training examples in named groups (one per distilled shard, so that a cache built from a
    shard is reused when more shards arrive): distilled answers, or the sources' own answers. Reads
    cfg.data only (training and feature-head configs alike)."""
    groups = _distilled_groups(cfg) if cfg.data.use == "distilled" else [("source", _source_examples(cfg, tokenizer))]
    if sum(len(g) for _, g in groups) < 2:
        raise MedusaError("data: fewer than 2 usable examples (distil more prompts or raise data.limit)")
    return groups


def _distilled_groups(cfg) -> list[tuple[str, list[dict]]]:
    """The distilled shards in order, the first `data.limit` prompts of them (all without a limit), so a
    run trains on the same prompts after more were distilled."""
    from medusa.train.distill import distill_dir, load_shards

    groups = []
    left = cfg.data.limit
    for name, ds in load_shards(distill_dir(cfg)):
        if left is not None and left <= 0:
            break
        pairs = list(zip(ds["prompt_ids"], ds["response_ids"]))[:left]
        left = None if left is None else left - len(pairs)
        exs = [example(p, r, cfg.data.max_seq_tokens) for p, r in pairs]
        groups.append((name, [e for e in exs if e is not None]))
    return groups


def _source_examples(cfg, tokenizer) -> list[dict]:
    vocab = tokenizer.get_vocab()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in vocab else tokenizer.eos_token_id
    exs = []
    for prompt, answer in training_pairs(cfg.data.sources, cfg.data.limit):
        if answer:
            e = example(chat_ids(tokenizer, prompt), answer_ids(tokenizer, answer, eos), cfg.data.max_seq_tokens)
            if e is not None:
                exs.append(e)
    return exs


def split_groups(cfg, groups: list[tuple[str, list[dict]]]) -> tuple[list[tuple[str, list[dict]]], list[dict]]:
    """Held-out examples drawn from every group; returns ([(name, train examples)], eval examples)."""
    train, held = [], []
    for name, exs in groups:
        tr, ev = split_eval(len(exs), cfg.data.eval_fraction, cfg.seed)
        train.append((name, [exs[i] for i in tr]))
        held += [exs[i] for i in ev]
    return train, held
