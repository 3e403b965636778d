"""Is speculation paying, by measurement? The acceptance gate shared by `--mode auto` and the server.

A prediction (the calibrated pass-cost curve and the heads' held-out accuracy) picks a tree; this gate
checks it against what the steps really do. Per batch-size bucket (1, 2, 3-4, 5-8, ...) it keeps the
recent step times of speculative and plain steps and the tokens per row-step (tau) of speculative ones.
Speculation pays while tau exceeds the cost of its step relative to a plain one. When the rolling mean tau
over the last `window` speculative steps (judged from MIN_EVIDENCE on) lies two standard errors below
max(min_tau, t_spec / t_plain), speculation pauses in that bucket, and in the larger ones, for
`retry_after_steps` steps, doubling after each consecutive failure up to MAX_BACKOFF times; then it is
tried again. A bucket's first step is plain, to measure the cost a speculative step has to beat, and so are
the steps after its 4th and 8th speculative ones (PLAIN_PROBES in all): one plain step timed at one moment
is a poor reference (the first step after a prefill is often the slowest of all, and one measured 1.8x the
plain steps after it), and a reference too dear makes a losing tree look as if it paid.

A bucket a batch reaches only as its rows finish (4 rows, then 2, then 1) would pay those probes again for
a few steps of tail. Given `plain_scale` (a plain step at one batch size over one at another: the
calibrated curve's ratio), a bucket without plain steps of its own borrows the nearest bucket's plain
cost, scaled, and times its own plain steps only after every BORROWED_PROBE_EVERY speculative ones (a
server bucket that stays in use soon has its own reference; a batch's tail never pays for one).

A step's cost is its own time plus what choosing it took (planning a tree for a new batch size, building a
proposer): t_spec = median recent speculative step + the bucket's mean choosing time per speculative step,
and alike for plain steps (see `AcceptanceGate.cost_ratio`); the choosing time is work the step really adds, so
it is counted in full and spread over the steps it served.
A planner that is slow, once per batch size or on every step, therefore closes the gate like a slow step.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Callable

MIN_STD = 0.5  # floor on one row-step's tau spread, so a few equal samples are not taken as certainty


def mean_and_stderr(taus: "deque[float]", rows: int) -> tuple[float, float]:
    """Mean tau and its standard error. A step's tau is itself a mean over its rows, hence the floor's
    1/sqrt(rows): at batch size 1 four steps prove little, at 16 rows they prove a lot."""
    std = statistics.stdev(taus) if len(taus) > 1 else 0.0
    return statistics.fmean(taus), max(std, MIN_STD / max(rows, 1) ** 0.5) / len(taus) ** 0.5


def bucket(n: int) -> int:
    """Batch sizes grouped by powers of two: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(n - 1, 0).bit_length()


class _Record:
    """One bucket's evidence."""

    TIMES = 16  # recent step times kept per kind

    def __init__(self, window: int):
        self.taus: deque[float] = deque(maxlen=window)
        self.paused_until = -1
        self.failures = 0
        self.seconds: dict[str, deque[float]] = {}  # recent step times: "spec" / "plain"
        self.overhead: dict[str, list[float]] = {}  # [total choosing seconds, steps] per kind, all steps
        self.spec_steps = 0  # speculative steps observed here, ever (taus is cleared on a pause)

    def time(self, kind: str, seconds: float, overhead: float = 0.0) -> None:
        self.seconds.setdefault(kind, deque(maxlen=self.TIMES)).append(seconds)
        total = self.overhead.setdefault(kind, [0.0, 0])
        total[0] += max(overhead, 0.0)
        total[1] += 1

    def cost(self, kind: str) -> float:
        """A step's cost: the median recent one plus the mean time spent choosing it."""
        total, steps = self.overhead[kind]
        return statistics.median(self.seconds[kind]) + total / steps

    def plain_steps(self) -> int:
        return len(self.seconds.get("plain", ()))


class AcceptanceGate:
    MIN_EVIDENCE = 4  # speculative steps before the gate may pause (a full window to clear a failure)
    Z = 2.0  # pause only when mean tau is this many standard errors below what a step must yield
    MAX_BACKOFF = 16
    PLAIN_PROBES, PROBE_EVERY = 3, 4  # plain steps timed per bucket: one first, then one every 4 speculative

    BORROWED_PROBE_EVERY = 16  # a bucket borrowing its plain reference times its own after this many

    def __init__(self, window: int = 16, min_tau: float = 1.0, retry_after_steps: int = 128,
                 plain_scale: Callable[[int, int], float] | None = None):
        """`plain_scale(b, ref)`: a plain step's cost at batch size b over one at `ref` (None: every bucket
        times its own plain steps from its first)."""
        self.window, self.min_tau, self.retry_after_steps = window, min_tau, retry_after_steps
        self.plain_scale = plain_scale
        self.records: dict[int, _Record] = {}
        self.step = 0

    def record(self, n: int) -> _Record:
        b = bucket(n)
        if b not in self.records:
            self.records[b] = _Record(self.window)
        return self.records[b]

    def tick(self) -> None:
        """One more step decided (pauses are counted in decided steps)."""
        self.step += 1

    def needs_plain_probe(self, n: int) -> bool:
        """Whether this step should be plain to time the cost speculation has to beat (see the docstring)."""
        rec = self.record(n)
        if rec.plain_steps() < self.PLAIN_PROBES and self.lender(n) is not None:
            return rec.plain_steps() < min(self.PLAIN_PROBES, rec.spec_steps // self.BORROWED_PROBE_EVERY)
        return rec.plain_steps() < min(self.PLAIN_PROBES, 1 + rec.spec_steps // self.PROBE_EVERY)

    def lender(self, n: int) -> int | None:
        """The bucket whose plain steps stand in for bucket(n)'s (the nearest with its full PLAIN_PROBES),
        or None: n's own bucket has them, or no `plain_scale` was given, or no bucket has them yet."""
        b = bucket(n)
        if self.plain_scale is None or (b in self.records and self.records[b].plain_steps() >= self.PLAIN_PROBES):
            return None
        full = [size for size, r in self.records.items() if size != b and r.plain_steps() >= self.PLAIN_PROBES]
        return min(full, key=lambda size: (abs(size.bit_length() - b.bit_length()), size)) if full else None

    def cost_ratio(self, n: int) -> float | None:
        """A speculative step's cost over a plain one's at n rows (`_Record.cost`: median recent step time
        plus the mean time spent choosing it), the plain cost borrowed from the `lender` while bucket(n)
        has too few plain steps of its own. Medians, now that every bucket times PLAIN_PROBES plain steps
        spread over its first speculative ones: the fastest step of each kind, used while the plain
        reference was a single probe step, favoured speculation wherever its step times vary more than
        plain ones (dynamic trees, retrieval nodes): on an AVX2 CPU it kept trees measured at 0.85x plain
        decoding. A single step at a busy moment moves neither median."""
        rec = self.record(n)
        if "spec" not in rec.seconds:
            return None
        lender = self.lender(n)
        if lender is not None:
            plain = self.records[lender].cost("plain") * self.plain_scale(bucket(n), lender)
        elif "plain" in rec.seconds:
            plain = rec.cost("plain")
        else:
            return None
        return rec.cost("spec") / max(plain, 1e-9)

    def paused(self, n: int) -> bool:
        """Paused here or at a smaller bucket: a larger batch makes speculation relatively dearer, with
        about the same acceptance, so a failure at a small batch size holds for the larger ones too."""
        b = bucket(n)
        return any(r.paused_until > self.step for size, r in self.records.items() if size <= b)

    def observe(self, n: int, speculative: bool, tau: float, seconds: float, overhead: float = 0.0) -> str | None:
        """Feed back a finished step of `n` rows (`overhead`: the time choosing it took); returns a
        description when it pauses speculation."""
        rec = self.record(n)
        rec.time("spec" if speculative else "plain", seconds, overhead)
        if not speculative:
            return None
        rec.spec_steps += 1
        rec.taus.append(tau)
        if len(rec.taus) < min(self.MIN_EVIDENCE, rec.taus.maxlen):
            return None
        mean, stderr = mean_and_stderr(rec.taus, n)
        need = max(self.min_tau, self.cost_ratio(n) or 0.0)
        if mean + self.Z * stderr >= need:
            if len(rec.taus) == rec.taus.maxlen:
                rec.failures = 0
            return None
        steps = len(rec.taus)
        pause = self.retry_after_steps * min(2 ** rec.failures, self.MAX_BACKOFF)
        rec.failures += 1
        rec.paused_until = self.step + pause
        rec.taus.clear()
        return (f"speculation paused for {pause} steps at batch bucket {bucket(n)}: mean tau {mean:.2f} < "
                f"{need:.2f} over {steps} steps")
