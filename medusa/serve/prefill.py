"""How many prompt tokens the scheduler prefills at a step boundary, so that long prompts never stall the
streams already running.

Each step boundary runs one decode pass over the running rows (n rows x the tokens of their tree) and, beside
it, one prefill pass: whole short prompts, or the next chunk of a long one. The two share one budget:

    decoding rows:  prefill pass time <= stall x decode pass time, at least MIN_CHUNK tokens
    no row decoding: MAX_CHUNK tokens (nothing to stall; a request that arrives waits for one chunk at most)

so a running stream's inter-token latency stays within (1 + stall) x its own while prompts are prefilled,
and a prompt of any length advances every step. The prefill pass's time per token comes from the
calibrated curve of this machine (`medusa calibrate`) where one is cached, and follows the chunks actually
measured after that (a running mean), as does the decode pass's time: under load both slow down alike.

A fixed budget (`prefill_tokens_per_step: N`) instead gives the prefill pass N tokens less the decode pass's
tokens (at least MIN_CHUNK), and N when no row decodes.
"""

from __future__ import annotations

from typing import Callable

MIN_CHUNK = 16  # tokens: a long prompt always advances
MAX_CHUNK = 512  # tokens of one prefill pass when no row decodes (auto)
SMOOTHING = 0.3  # weight of the newest measurement in the running means


class PrefillBudget:
    """`tokens(rows, width)`: prompt tokens for the prefill pass at this step boundary, when `rows` rows
    decode `width` tokens each in the decode pass; `observe_*` hear how the passes went.

    tokens_per_step: "auto" (time-based, above) or a fixed token budget shared with the decode pass.
    stall:           auto: the prefill pass may take this times the decode pass's time.
    curve:           ms of a pass over (rows, tokens) from this machine's calibration, or None.
    """

    def __init__(self, tokens_per_step: int | str = "auto", stall: float = 1.0,
                 curve: Callable[[int, int], float] | None = None):
        self.fixed = None if tokens_per_step == "auto" else int(tokens_per_step)
        self.stall = stall
        self.curve = curve
        self.decode_ms: float | None = None  # the last decode passes' time (running mean)
        self.token_ms: float | None = None  # a prefill pass's time per prompt token (running mean)
        if curve is not None:
            self.token_ms = curve(1, 64) / 64

    def tokens(self, rows: int, width: int) -> int:
        decode_tokens = rows * width
        if self.fixed is not None:
            return self.fixed if not rows else max(self.fixed - decode_tokens, MIN_CHUNK)
        if not rows:
            return MAX_CHUNK
        decode_ms = self.decode_ms
        if decode_ms is None and self.curve is not None:
            decode_ms = self.curve(rows, width)
        if decode_ms is None or self.token_ms is None:  # nothing measured yet: as many tokens as the decode pass
            return min(max(decode_tokens, MIN_CHUNK), MAX_CHUNK)
        return min(max(int(self.stall * decode_ms / self.token_ms), MIN_CHUNK), MAX_CHUNK)

    def observe_decode(self, seconds: float) -> None:
        self.decode_ms = _mean(self.decode_ms, 1000 * seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_CHUNK:  # tiny passes are all fixed cost: they would overstate the per-token time
            self.token_ms = _mean(self.token_ms, 1000 * seconds / tokens)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
