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

With a latency target (`--tpot-slo`, `Target`) the chunk instead fills what the target leaves of the step:

    N = (target - decode pass time) / (time per prompt token),  target = T ms, or F x a stream's step alone

so running streams keep the target whatever their number, as long as their step alone fits under it with a
MIN_CHUNK chunk. When it does not (more streams than the machine serves at the target) the target is missed:
`missed` turns true, once per spell (with hysteresis), and the scheduler says so in the log and in /metrics.
Meanwhile the chunk is sized as if the target were F x the running rows' own step (a target in ms: twice it), so
prompts keep advancing at a share of every step rather than MIN_CHUNK tokens at a time.
A stream's step alone is the decode pass measured with one row running, else the calibrated curve's.

A long prompt of P tokens then waits about P x (time per prompt token) / (share of each step left for prefill)
= P x c x T / (T - d) for its first token, where d is the running rows' step alone (docs/serving.md).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

MIN_CHUNK = 16  # tokens: a long prompt always advances
MAX_CHUNK = 512  # tokens of one prefill pass when no row decodes (auto)
SMOOTHING = 0.5  # weight of the newest measurement in the running means
RECOVER = 0.9  # a missed target counts as kept again once the step alone is this share of it
log = logging.getLogger("medusa.serve.prefill")


@dataclass(frozen=True)
class Target:
    """A step-time target: `ms` milliseconds, or `factor` times a stream's step alone."""

    ms: float | None = None
    factor: float | None = None

    def __str__(self) -> str:
        return f"{self.ms:g} ms" if self.ms is not None else f"{self.factor:g}x a stream's step alone"


def parse_tpot_slo(value: str | float | int) -> Target:
    """`80`, `80ms`, `"80"` (milliseconds) or `2x` (times a stream's step alone) -> Target; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a step time; give milliseconds (80, 80ms) or a multiple like 2x")
    if isinstance(value, (int, float)):
        ms = float(value)
        if not 0 < ms < float("inf"):
            raise ValueError(f"{value!r}: a step time must be a positive number of milliseconds")
        return Target(ms=ms)
    text = str(value).strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|x)?", text)
    if m is None:
        raise ValueError(f"{value!r} is not a step time; give milliseconds (80, 80ms) or a multiple of a "
                         "stream's step alone (2x)")
    number = float(m.group(1))
    if m.group(2) == "x":
        if number <= 1:
            raise ValueError(f"{value!r}: a multiple of a stream's step alone must be above 1 (the step itself "
                             "leaves no room for prefill)")
        return Target(factor=number)
    if number <= 0:
        raise ValueError(f"{value!r}: a step time must be a positive number of milliseconds")
    return Target(ms=number)


class PrefillBudget:
    """`tokens(rows, width)`: prompt tokens to prefill at this step boundary, when `rows` rows decode `width`
    tokens each; `observe` hears how each decode step went and how many prompt tokens it carried.

    tokens_per_step: "auto" (time-based, above) or a fixed token budget shared with the decode pass.
    stall:           auto: the prompt tokens may add this times the decode pass's time to it.
    curve:           ms of a pass over (rows, tokens) from this machine's calibration, or None.
    """

    def __init__(self, tokens_per_step: int | str = "auto", stall: float | None = 1.0,
                 curve: Callable[[int, int], float] | None = None, target: Target | None = None):
        """`target` (a step-time target) replaces `stall` when given."""
        self.fixed = None if tokens_per_step == "auto" else int(tokens_per_step)
        self.stall = 1.0 if stall is None else stall
        self.target = target
        self.curve = curve
        self.decode_ms: float | None = None  # a decode pass without prompt tokens (running mean)
        self.solo_ms: float | None = None  # ... with one row running (running mean)
        self.token_ms: float | None = None  # what each prompt token adds to a pass (running mean)
        self.missed = False  # the target cannot be kept: the running rows' step alone leaves no room
        self.target_ms: float | None = None  # the target of the last boundary, in ms
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
        room = None
        if decode_ms is not None and self.target is not None:
            target = self.target_ms = self.step_target(width, decode_ms)
            room = target - decode_ms
            self._judge(room, target, decode_ms, rows)
        if decode_ms is None or self.token_ms is None:  # nothing measured: as many tokens as the decode pass
            return min(max(decode_tokens, MIN_CHUNK), MAX_CHUNK)
        if room is None:
            return min(max(int(self.stall * decode_ms / self.token_ms), MIN_CHUNK), MAX_CHUNK)
        if self.missed:  # the target's share over the running rows' own step: prompts keep advancing
            room = max(room, self.fallback_share() * decode_ms)
        return min(max(int(room / self.token_ms), MIN_CHUNK), MAX_CHUNK)

    def fallback_share(self) -> float:
        """While the target cannot be kept: the prefill's part of a step, as a multiple of the running rows'
        own step (a factor target F keeps F - 1 of it, a target in ms as much as the step itself)."""
        return self.target.factor - 1 if self.target.factor is not None else 1.0

    def step_target(self, width: int, decode_ms: float) -> float:
        """The target in ms: as given, or its factor times a stream's step alone (measured with one row
        running, else the calibrated curve's, else the running rows' own step)."""
        if self.target.ms is not None:
            return self.target.ms
        solo = self.solo_ms
        if solo is None and self.curve is not None:
            solo = self.curve(1, width)
        return self.target.factor * (solo if solo is not None else decode_ms)

    def _judge(self, room: float, target: float, decode_ms: float, rows: int) -> None:
        """The target is missed when the step alone leaves less than a MIN_CHUNK chunk's time under it, and
        kept again once the step alone is RECOVER of it: said once per spell, not per step."""
        if not self.missed and room < MIN_CHUNK * (self.token_ms or 0.0):
            self.missed = True
            log.warning("step-time target %.0f ms (%s) cannot be kept: %d running rows take %.0f ms a step "
                        "alone; until the load falls, prompts are prefilled in chunks that take %gx that step",
                        target, self.target, rows, decode_ms, self.fallback_share())
        elif self.missed and decode_ms <= RECOVER * target:
            self.missed = False
            log.info("step-time target %.0f ms kept again (%d running rows, %.0f ms a step alone)", target, rows,
                     decode_ms)

    def observe(self, seconds: float, prompt_tokens: int = 0, rows: int | None = None) -> None:
        """A decode step over `rows` rows took `seconds`, carrying `prompt_tokens` of a chunked prompt."""
        ms = 1000 * seconds
        if not prompt_tokens:
            self.decode_ms = _mean(self.decode_ms, ms)
            if rows == 1:
                self.solo_ms = _mean(self.solo_ms, ms)
        elif self.decode_ms is not None and prompt_tokens >= MIN_CHUNK:
            # What the chunk added (at least a twentieth of the pass: noise must not make tokens free).
            self.token_ms = _mean(self.token_ms, max(ms - self.decode_ms, ms / 20) / prompt_tokens)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
