"""Incremental detokenisation: a request's text so far, cut at a stop string, and how much of it is safe
to send (not a tail that could still become a stop string, not half a multi-byte character)."""

from __future__ import annotations

from typing import Any


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


def visible_text(tokenizer: Any, tokens: list[int], stop: list[str], seen: int,
                 final: bool) -> tuple[str, int, bool]:
    """(text of `tokens` up to any stop string, characters safe to send, whether a stop string was hit);
    `seen` is the length of the text the previous call returned."""
    text = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    text, hit = stop_at(text, stop, seen)
    return text, safe_length(text, stop, final or hit), hit
