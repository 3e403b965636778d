"""Incremental detokenisation: a request's text so far, cut at a stop string, and how much of it is safe
to send (not a tail that could still become a stop string, not half a multi-byte character).

Each step decodes only a short window of the newest tokens (`IncrementalText`), so the work per token is
constant, not proportional to the text so far (re-decoding a long answer every step is quadratic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DECODE = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}


@dataclass
class IncrementalText:
    """Turns a growing token list into text, a few tokens at a time. `tokens[prefix:read]` are already
    text; they are decoded again beside the new tokens as context, because a token's text depends on its
    neighbours (tokenizers that drop a leading space at the start of a decode, characters whose bytes
    span tokens), and only the difference is new."""

    prefix: int = 0
    read: int = 0

    def extend(self, tokenizer: Any, tokens: list[int], final: bool = False) -> str:
        """The text the tokens after `read` add ('' while they end inside a character; once `final`, the
        bytes of an unfinished last character are dropped, not shown as U+FFFD)."""
        if self.read >= len(tokens):
            return ""
        before = tokenizer.decode(tokens[self.prefix: self.read], **DECODE)
        after = tokenizer.decode(tokens[self.prefix:], **DECODE)
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""  # nothing visible yet, or half a character: wait for the next tokens
        if final:  # the request ended inside a character (say, cut by max_tokens): drop those bytes
            after = after.rstrip("\ufffd")
        self.prefix, self.read = self.read, len(tokens)
        return after[len(before):]


def stop_at(text: str, stop: list[str], seen: int) -> tuple[str, bool]:
    """`text` cut before its first stop string, and whether one was found. Only the text after the
    first `seen` characters (plus an overlap the length of the longest stop string) can hold a new match."""
    if not stop:
        return text, False
    start = max(0, seen - max(len(s) for s in stop))
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def safe_length(text: str, stop: list[str], final: bool) -> int:
    """Characters of `text` that can be sent now: all once the request ends, else all but a tail that
    could still grow into a stop string or is an unfinished multi-byte character."""
    safe = len(text)
    if final:
        return safe
    if stop:
        safe -= max(len(s) for s in stop) - 1
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    return safe


def visible_text(tokenizer: Any, decoded: IncrementalText, text: str, tokens: list[int], stop: list[str],
                 final: bool) -> tuple[str, int, bool]:
    """(the text of `tokens` up to any stop string, characters safe to send, whether a stop string was hit);
    `text` is what the previous call returned, `decoded` the request's decoding state."""
    seen = len(text)
    text, hit = stop_at(text + decoded.extend(tokenizer, tokens, final), stop, seen)
    return text, safe_length(text, stop, final or hit), hit
