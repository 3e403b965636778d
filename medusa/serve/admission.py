"""The server's way in: a bounded queue of requests waiting for a batch row, with a wait limit, cancellation,
a Retry-After estimate from the rate rows were freed at, and the choice of what one step boundary prefills
within its token budget (`medusa.serve.prefill`): short prompts whole, else one long prompt in chunks.

The queue knows rows only by count (`occupied`, supplied by the scheduler); it never touches the engine."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable

from medusa.serve.metrics import Metrics
from medusa.serve.request import Overloaded, Request

DRAIN_WINDOW_S = 30.0  # completions kept for the drain rate behind Retry-After
# The drain rate is measured over the shortest of these trailing windows that holds DRAIN_EVIDENCE
# completions: the rate now, not one averaged with a slower start (a long prefill, a batch filling up).
DRAIN_SPANS_S = (5.0, 10.0, DRAIN_WINDOW_S)
DRAIN_EVIDENCE = 4
RETRY_AFTER_MAX_S = 120


class Admission:
    """Shared by the HTTP side (`submit`, `cancel`, `retry_after`) and the engine thread (`expire`, `take`,
    `freed`). `cond` guards the queue and is the lock the engine thread sleeps on while there is no work."""

    def __init__(self, metrics: Metrics, occupied: Callable[[], int], *, max_batch: int, max_queue: int,
                 queue_timeout_s: float, chunked_prefill: bool = True, clock: Callable[[], float] = time.monotonic):
        """`occupied()`: batch rows taken now. `chunked_prefill` False: a prompt longer than a boundary's
        budget is prefilled whole, alone. `clock`: the time completions are stamped with (tests pass theirs)."""
        self.clock = clock
        self.metrics, self.occupied = metrics, occupied
        self.max_batch, self.max_queue, self.queue_timeout_s = max_batch, max_queue, queue_timeout_s
        self.chunked_prefill = chunked_prefill
        self.cond = threading.Condition()
        self.queue: deque[Request] = deque()
        self.completions: deque[float] = deque(maxlen=4096)  # monotonic times rows were freed

    def __len__(self) -> int:
        return len(self.queue)

    # ---- the HTTP side ------------------------------------------------------------------------------
    def submit(self, *reqs: Request) -> None:
        """Queue requests (the choices of one HTTP request): all of them, or none when they do not fit."""
        with self.cond:
            free_rows = self.max_batch - self.occupied()
            if len(self.queue) + len(reqs) > self.max_queue + max(free_rows, 0):
                self.metrics.rejected.labels("queue_full").inc()
                raise Overloaded()
            self.queue.extend(reqs)
            self.metrics.queued.set(len(self.queue))
            self.cond.notify_all()

    def cancel(self, req: Request) -> None:
        """Client went away: the row (or queue entry) is dropped at the next step boundary."""
        with self.cond:
            if not req.done:
                req.cancelled = True
                self.cond.notify_all()

    def retry_after(self) -> int:
        """Seconds until a new request would likely get a row: the requests ahead of it over the rate rows
        are being freed at now, clamped to [1, RETRY_AFTER_MAX_S]. The rate is measured over the shortest
        trailing window (DRAIN_SPANS_S) holding DRAIN_EVIDENCE completions, from the oldest completion in it
        to now (a burst after an idle spell drains at the burst's rate)."""
        now = self.clock()
        with self.cond:
            ahead = len(self.queue) + 1 - max(self.max_batch - self.occupied(), 0)
            while self.completions and now - self.completions[0] > DRAIN_WINDOW_S:
                self.completions.popleft()
            times = list(self.completions)
        if ahead <= 0:
            return 1
        if not times:  # nothing drained lately: no evidence of an early slot
            return RETRY_AFTER_MAX_S
        for span_s in DRAIN_SPANS_S:
            recent = [t for t in times if now - t <= span_s]
            if len(recent) >= DRAIN_EVIDENCE:
                break
        else:
            recent = times
        span = max(now - recent[0], 1.0)
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(ahead * span / len(recent))))

    # ---- the engine thread, at a step boundary (under `cond`) ---------------------------------------
    def freed(self) -> None:
        """A request ended: its row (or queue entry) is free; the drain rate counts it."""
        self.completions.append(self.clock())

    def expire(self) -> tuple[list[Request], list[Request]]:
        """Take the cancelled entries and those that waited past queue_timeout_s out of the queue:
        (cancelled, timed out), for the caller to end."""
        now = time.perf_counter()
        cancelled, late, kept = [], [], deque()
        for req in self.queue:
            if req.cancelled:
                cancelled.append(req)
            elif now - req.arrival > self.queue_timeout_s:
                self.metrics.rejected.labels("queue_timeout").inc()
                late.append(req)
            else:
                kept.append(req)
        self.queue = kept
        return cancelled, late

    def take(self, free: int, tokens: int, cost: Callable[[Request], int] | None = None
             ) -> tuple[list[Request], Request | None]:
        """Pop what one step boundary prefills into `free` rows within `tokens` prompt tokens: queued
        requests whose prompts fit whole, or else the first one, to be prefilled in chunks (one at a time,
        in arrival order). `cost(request)`: the prompt tokens its prefill runs (default: all of them; less
        what a prefix cache holds)."""
        chosen: list[Request] = []
        longest = 0
        while self.queue and len(chosen) < free:
            nxt = max(longest, cost(self.queue[0]) if cost is not None else len(self.queue[0].prompt))
            # Prompts are right-padded into one pass, so its cost is rows x longest prompt.
            if (len(chosen) + 1) * nxt > tokens:
                break
            chosen.append(self.queue.popleft())
            longest = nxt
        if not chosen and self.queue and free > 0:  # longer than the budget: in chunks, or whole if not chunking
            return ([], self.queue.popleft()) if self.chunked_prefill else ([self.queue.popleft()], None)
        return chosen, None

    def clear(self) -> list[Request]:
        """Empty the queue (shutdown): the requests that were waiting."""
        waiting, self.queue = list(self.queue), deque()
        return waiting
