"""How many prompt tokens the scheduler prefills at a step boundary, so that long prompts never stall the
streams already running.

A long prompt is prefilled in chunks. While rows are decoding, each chunk rides in their decode pass
(`Engine.step(..., prefill=N)`: the weights are read once for both), and the chunk is sized so that the pass
takes at most (1 + stall) times a decode pass alone:

    decoding rows:   N = stall x (decode pass time) / (time per extra prompt token in the pass), >= MIN_CHUNK
    no row decoding: N = MAX_CHUNK (nothing to stall; a request that arrives waits for one chunk at most)

so a running stream's inter-token latency stays within (1 + stall) x its own while prompts are prefilled,
and a prompt of any length advances every step. Both times start from this machine's calibrated curve
(`medusa calibrate`) where one is cached, and follow the passes actually measured (running means): under
load they slow down alike. A chunk's measured time per token includes what carrying a chunk at all costs
(a second attention per layer), so the running mean settles where the pass takes (1 + stall) x its own. Short prompts that fit the same budget are prefilled whole.

A fixed budget (`prefill_tokens_per_step: N`) instead gives the prompt N tokens less the decode pass's
tokens (at least MIN_CHUNK), and N when no row decodes.
"""

from __future__ import annotations

from typing import Callable

MIN_CHUNK = 16  # tokens: a long prompt always advances
MAX_CHUNK = 512  # tokens of one prefill pass when no row decodes (auto)
SMOOTHING = 0.5  # weight of the newest measurement in the running means


class PrefillBudget:
    """`tokens(rows, width)`: prompt tokens to prefill at this step boundary, when `rows` rows decode `width`
    tokens each; `observe` hears how each decode step went and how many prompt tokens it carried.

    tokens_per_step: "auto" (time-based, above) or a fixed token budget shared with the decode pass.
    stall:           auto: the prompt tokens may add this times the decode pass's time to it.
    curve:           ms of a pass over (rows, tokens) from this machine's calibration, or None.
    """

    def __init__(self, tokens_per_step: int | str = "auto", stall: float = 1.0,
                 curve: Callable[[int, int], float] | None = None):
        self.fixed = None if tokens_per_step == "auto" else int(tokens_per_step)
        self.stall = stall
        self.curve = curve
        self.decode_ms: float | None = None  # a decode pass without prompt tokens (running mean)
        self.token_ms: float | None = None  # what each prompt token adds to a pass (running mean)
        if curve is not None:  # a 64-token pass's time per token: carrying a chunk costs more than its tokens
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
        if decode_ms is None or self.token_ms is None:  # nothing measured: as many tokens as the decode pass
            return min(max(decode_tokens, MIN_CHUNK), MAX_CHUNK)
        return min(max(int(self.stall * decode_ms / self.token_ms), MIN_CHUNK), MAX_CHUNK)

    def observe(self, seconds: float, prompt_tokens: int = 0) -> None:
        """A decode step took `seconds`, carrying `prompt_tokens` of a chunked prompt."""
        ms = 1000 * seconds
        if not prompt_tokens:
            self.decode_ms = _mean(self.decode_ms, ms)
        elif self.decode_ms is not None and prompt_tokens >= MIN_CHUNK:
            # What the chunk added (at least a twentieth of the pass: noise must not make tokens free).
            self.token_ms = _mean(self.token_ms, max(ms - self.decode_ms, ms / 20) / prompt_tokens)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
