"""Prompt encoding shared by every entry point, and the server's incremental detokenisation, alone."""

from __future__ import annotations

import pytest

from medusa.decoding.target.chat import chat_ids
from medusa.errors import MedusaError
from medusa.serve.detokenize import IncrementalText, safe_length, stop_at, visible_text


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


TEXTS = ["Plain ASCII words, then numbers 12345 and   spaces.",
         "Multi-byte: caf\u00e9, na\u00efve, \u4e2d\u6587\u5b57\u7b26, \u0440\u0443\u0441\u0441\u043a\u0438\u0439, emoji \U0001f600\U0001f680\U0001f9d1\u200d\U0001f680 end",
         "Lines\n\n  indented\ttabs\r\n and a trailing space "]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_decoding_everything(tokenizer, text):
    """Fed 1-3 tokens at a time (with special tokens among them), the text so far is always a prefix of
    decoding every token, never holds half a character, and ends equal to it."""
    import random

    ids = tokenizer(text)["input_ids"]
    ids = ids[:5] + [tokenizer.eos_token_id] + ids[5:]  # skipped like any special token
    full = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    rng = random.Random(len(text))
    state, got, n = IncrementalText(), "", 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 3))
        got += state.extend(tokenizer, ids[:n], final=n == len(ids))
        assert full.startswith(got) and "\ufffd" not in got
    assert got == full


def test_incremental_text_decodes_each_token_a_bounded_number_of_times(tokenizer):
    """A long answer streamed a token per step costs decoding work linear in its length (re-decoding
    the whole text each step would be quadratic: about n^2 / 2 tokens)."""
    ids = tokenizer(" ".join(TEXTS) * 20)["input_ids"]
    decoded = []

    class Counting:
        def decode(self, tokens, **kw):
            decoded.append(len(tokens))
            return tokenizer.decode(tokens, **kw)

    state, text = IncrementalText(), ""
    for n in range(1, len(ids) + 1):
        text, _, _ = visible_text(Counting(), state, text, ids[:n], [], final=n == len(ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert sum(decoded) < 8 * len(ids) < len(ids) ** 2 / 2


def test_incremental_text_stops_at_a_stop_string_across_tokens(tokenizer):
    ids = tokenizer("The answer is 42. END of story")["input_ids"]
    state, text, hit = IncrementalText(), "", False
    for n in range(1, len(ids) + 1):
        text, safe, hit = visible_text(tokenizer, state, text, ids[:n], ["42. END"], final=False)
        if hit:
            break
    assert hit and text == "The answer is " and safe == len(text)
