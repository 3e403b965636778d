"""Prompts as the model sees them: chat messages through the tokenizer's chat template, or raw text.

One place for the encoding every entry point shares (generation, training data, the server), so a
prompt is the same token ids wherever it is decoded."""

from __future__ import annotations

from typing import Any

from medusa.errors import MedusaError

Messages = list[dict[str, str]]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_ids(tokenizer: Any, prompt: str | Messages, raw: bool = False) -> list[int]:
    """Token ids of a prompt, ending with the assistant header the reply follows.

    `prompt` is a list of {"role", "content"} messages or one user message's text. Text is tokenised as
    it is when `raw` is set or the tokenizer has no chat template; messages need a template."""
    if isinstance(prompt, str):
        if raw or not has_chat_template(tokenizer):
            return list(tokenizer(prompt)["input_ids"])
        prompt = [{"role": "user", "content": prompt}]
    elif not has_chat_template(tokenizer):
        raise MedusaError("this tokenizer has no chat template to format messages with")
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (a dict) where 4.x returned the list of ids.
    return list(ids if isinstance(ids, list) else ids["input_ids"])
