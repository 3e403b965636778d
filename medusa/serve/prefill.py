"""How many prompt tokens the scheduler prefills at a step boundary, so that long prompts never stall the
streams already running.

A long prompt is prefilled in chunks. While rows are decoding, each chunk rides in their decode pass
(`Engine.step(..., prefill=N)`: the weights are read once for both), and the chunk is sized so that the pass
takes at most (1 + stall) times a decode pass alone:

    decoding rows:   N = stall x (decode pass time) / (time per extra prompt token in the pass), >= MIN_CHUNK
    no row decoding: N = MAX_CHUNK (nothing to stall; a request that arrives waits for one chunk at most)

so a running stream's inter-token latency stays within (1 + stall) x its own while prompts are prefilled,
and a prompt of any length advances every step. Both times start from this machine's calibrated curve
(`medusa calibrate`) where one is cached, and follow the passes actually measured: under load they slow
down alike. A decode pass alone is the median of the last WINDOW measured with the same rows and tree width (a
single slow pass, such as the one where a prompt joins the batch, moves it not; a pass of another shape is not
this one). A chunk's measured time per token includes what carrying a chunk at all costs
(a second attention per layer), so the estimate settles where the pass takes (1 + stall) x its own; it is the
ratio of running sums (time the chunks added over the tokens they carried), so small chunks' noisy times weigh
by their size. Short prompts that fit the same budget are prefilled whole.

A fixed budget (`prefill_tokens_per_step: N`) instead gives the prompt N tokens less the decode pass's
tokens (at least MIN_CHUNK), and N when no row decodes.

With a latency target (`--tpot-slo`, `Target`) the chunk instead fills what the target leaves of the step:

    N = (target - decode pass time) / (time per prompt token),  target = T ms, or F x a stream's step alone

(at least one token: where a prompt token costs more than a sixteenth of what the target leaves, as on a slow
CPU with one stream running, the chunk is smaller than MIN_CHUNK rather than the step longer than the target),
so running streams keep the target whatever their number, as long as their step alone leaves room for one prompt
token. When it does not (more streams than the machine serves at the target) the target is missed: `missed`
turns true, once per spell (kept again only once the step alone leaves clear room: hysteresis), and the
scheduler says so in the log and in /metrics.
Meanwhile the chunk is sized as if the target were F x the running rows' own step (a target in ms: twice it), so
prompts keep advancing at a share of every step rather than MIN_CHUNK tokens at a time.
A stream's step alone is the decode pass measured with one row running at the width of the rows running now,
else the calibrated curve's.

A long prompt of P tokens then waits about P x (time per prompt token) / (share of each step left for prefill)
= P x c x T / (T - d) for its first token, where d is the running rows' step alone (docs/serving.md).
"""

from __future__ import annotations

import logging
import re
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable

MIN_CHUNK = 16  # tokens: a long prompt always advances
MAX_CHUNK = 512  # tokens of one prefill pass when no row decodes (auto)
SMOOTHING = 0.5  # weight of the newest measurement in the running sums of chunk cost
WINDOW = 9  # decode passes alone kept per (rows, width): their median is the pass alone
RECOVER = 0.9  # a missed target counts as kept again once the step alone leaves a token and 1 - RECOVER of it
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
        self.alone: dict[tuple[int | None, int | None], deque[float]] = {}  # (rows, width) -> last decode passes
        self.latest: float | None = None  # the last decode pass alone, whatever its shape
        self.token_ms: float | None = None  # what each prompt token adds to a pass (running mean)
        self.missed = False  # the target cannot be kept: the running rows' step alone leaves no room
        self.target_ms: float | None = None  # the target of the last boundary, in ms
        self._added = self._carried = 0.0  # running sums: ms the chunks added to their passes, tokens carried
        if curve is not None:  # a 64-token pass's time per token: carrying a chunk costs more than its tokens
            self._added, self._carried = curve(1, 64), 64.0
            self.token_ms = self._added / self._carried

    def tokens(self, rows: int, width: int) -> int:
        decode_tokens = rows * width
        if self.fixed is not None:
            return self.fixed if not rows else max(self.fixed - decode_tokens, MIN_CHUNK)
        if not rows:
            return MAX_CHUNK
        decode_ms = self.pass_alone(rows, width)
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
        return min(max(int(room / self.token_ms), 1), MAX_CHUNK)

    def fallback_share(self) -> float:
        """While the target cannot be kept: the prefill's part of a step, as a multiple of the running rows'
        own step (a factor target F keeps F - 1 of it, a target in ms as much as the step itself)."""
        return self.target.factor - 1 if self.target.factor is not None else 1.0

    def pass_alone(self, rows: int | None, width: int | None, fallback: bool = True) -> float | None:
        """A decode pass of `rows` rows `width` tokens wide without prompt tokens, in ms: the median of those
        measured, else the calibrated curve's, else (`fallback`) the last measured of any shape."""
        seen = self.alone.get((rows, width))
        if seen:
            return statistics.median(seen)
        if self.curve is not None and rows is not None and width is not None:
            return self.curve(rows, width)
        return self.latest if fallback else None

    def step_target(self, width: int, decode_ms: float) -> float:
        """The target in ms: as given, or its factor times a stream's step alone (measured with one row
        running, else the calibrated curve's, else the running rows' own step)."""
        if self.target.ms is not None:
            return self.target.ms
        solo = self.pass_alone(1, width, fallback=False)
        return self.target.factor * (solo if solo is not None else decode_ms)

    def _judge(self, room: float, target: float, decode_ms: float, rows: int) -> None:
        """The target is missed when the step alone leaves less than one prompt token's time under it, and
        kept again once it leaves a token's time and 1 - RECOVER of the target besides: said once per spell,
        not per step."""
        token_ms = self.token_ms or 0.0
        if not self.missed and room < token_ms:
            self.missed = True
            log.warning("step-time target %.0f ms (%s) cannot be kept: %d running rows take %.0f ms a step "
                        "alone; until the load falls, prompts are prefilled in chunks that take %gx that step",
                        target, self.target, rows, decode_ms, self.fallback_share())
        elif self.missed and room >= token_ms + (1 - RECOVER) * target:
            self.missed = False
            log.info("step-time target %.0f ms kept again (%d running rows, %.0f ms a step alone)", target, rows,
                     decode_ms)

    def observe(self, seconds: float, prompt_tokens: int = 0, rows: int | None = None,
                width: int | None = None) -> None:
        """A decode step over `rows` rows `width` tokens wide took `seconds`, carrying `prompt_tokens` of a
        chunked prompt."""
        ms = 1000 * seconds
        if not prompt_tokens:
            self.alone.setdefault((rows, width), deque(maxlen=WINDOW)).append(ms)
            self.latest = ms
            return
        alone = self.pass_alone(rows, width)
        if alone is not None:
            # What the chunk added (at least a twentieth of the pass: noise must not make tokens free).
            self._added = _mean(self._added, max(ms - alone, ms / 20))
            self._carried = _mean(self._carried, float(prompt_tokens))
            self.token_ms = self._added / self._carried


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
