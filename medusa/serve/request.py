"""What the scheduler holds per choice (a batch row's request) and what it reports back (events)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from medusa.decoding.sampling import GREEDY, SamplingParams
from medusa.serve.detokenize import IncrementalText

# One emitted token's log-probability and the top alternatives [(token id, log-probability), ...].
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass
class Event:
    kind: str  # "delta" (new text), "done" (finished), "error"
    text: str = ""
    tokens: int = 0  # completion tokens so far
    finish_reason: str | None = None
    status: int = 200
    error_type: str = ""
    code: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the tokens since the previous event
    logprobs: list[TokenLogprob] | None = None  # theirs, when the request asked for log-probabilities


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    on_event: Callable[[Event], None]
    sampling: SamplingParams = GREEDY
    stop: list[str] = field(default_factory=list)
    id: int = field(default_factory=itertools.count().__next__)
    arrival: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    decoded: IncrementalText = field(default_factory=IncrementalText)  # how far `tokens` are in `text`
    sent: int = 0  # characters of `text` already sent
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    done: bool = False
    tag: str = ""  # the id the client sees (response id), quoted in error messages and the log
    logprobs: int | None = None  # None, or how many top alternatives to report per token (0..20)
    unsent: int = 0  # tokens not yet handed out with an event (their text may be held back)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)

    def take_unsent(self) -> dict[str, Any]:
        """The tokens (and their log-probabilities) not yet handed out: they go with the next event."""
        start, self.unsent = self.unsent, len(self.tokens)
        lp = self.token_logprobs[start:] if self.logprobs is not None else None
        return {"token_ids": self.tokens[start:], "logprobs": lp}


class Overloaded(Exception):
    """The admission queue is full."""
