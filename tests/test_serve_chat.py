"""Prompt encoding shared by every entry point, and the server's incremental detokenisation, alone."""

from __future__ import annotations

import pytest

from medusa.decoding.chat import chat_ids
from medusa.errors import MedusaError
from medusa.serve.detokenize import safe_length, stop_at


class Plain:
    """A tokenizer without a chat template; `returns` is what apply_chat_template gives once one is set."""

    chat_template = None

    def __init__(self, returns: object = None):
        self.returns = returns
        if returns is not None:
            self.chat_template = "{{ messages }}"

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages: list, add_generation_prompt: bool, tokenize: bool) -> object:
        assert add_generation_prompt and tokenize
        return self.returns


def test_chat_ids_match_every_entry_point(rt, tokenizer):
    for text in ("Hi", "Name a fruit"):
        assert chat_ids(tokenizer, text) == rt.encode([text])[0]
        assert chat_ids(tokenizer, text, raw=True) == rt.encode([text], raw=True)[0]
        assert chat_ids(tokenizer, [{"role": "user", "content": text}]) == chat_ids(tokenizer, text)


def test_chat_ids_without_a_template_and_with_a_dict_return():
    assert chat_ids(Plain(), "ab") == [97, 98]
    with pytest.raises(MedusaError, match="no chat template"):
        chat_ids(Plain(), [{"role": "user", "content": "ab"}])
    assert chat_ids(Plain(returns={"input_ids": [1, 2]}), "ab") == [1, 2]  # transformers 5
    assert chat_ids(Plain(returns=[3, 4]), "ab") == [3, 4]
    assert chat_ids(Plain(returns=[3, 4]), "ab", raw=True) == [97, 98]


def test_stop_strings_and_the_text_held_back():
    assert stop_at("hello world", ["o w"], 0) == ("hell", True)
    assert stop_at("hello world", ["o w"], 11) == ("hello world", False)  # only new text can match
    assert stop_at("hello", [], 0) == ("hello", False)
    assert safe_length("hello", ["xyz"], final=False) == 3  # a tail that may become "xyz"
    assert safe_length("ab\ufffd", [], final=False) == 2  # half a multi-byte character
    assert safe_length("ab\ufffd", ["xyz"], final=True) == 3
