"""The scheduler's way in: the admission queue (bounded, with a wait limit and a Retry-After estimate),
cancellation, and prefill of waiting requests into free batch rows within each step boundary's token budget
(`medusa.serve.prefill`): short prompts whole, a long prompt a chunk per step boundary."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, TypeVar

from medusa.decoding.batch import Batch
from medusa.decoding.engine import Engine
from medusa.decoding.outputs import StepOutput
from medusa.errors import MedusaError
from medusa.serve.metrics import Metrics
from medusa.serve.prefill import PrefillBudget
from medusa.serve.request import Overloaded, Request

log = logging.getLogger("medusa.serve.scheduler")
DRAIN_WINDOW_S = 30.0  # completions over this window give the drain rate behind Retry-After
RETRY_AFTER_MAX_S = 120
T = TypeVar("T")


class Admission:
    """The queue side of `Scheduler`, which sets these attributes and supplies `_deliver`, `_finish` and
    `_error` (how results and failures reach the client)."""

    engine: Engine
    metrics: Metrics
    batch: Batch
    cond: threading.Condition
    queue: deque[Request]
    running: dict[int, Request]
    max_batch: int
    max_queue: int
    queue_timeout_s: float
    budget: PrefillBudget
    chunked_prefill: bool  # False: a prompt longer than the budget is prefilled whole, alone
    prefilling: Request | None  # the request whose prompt is being prefilled in chunks
    completions: deque[float]  # monotonic times rows were freed

    # ---- called from the HTTP side -------------------------------------------------------------------
    def submit(self, *reqs: Request) -> None:
        """Queue requests (the choices of one HTTP request): all of them, or none when they do not fit."""
        with self.cond:
            free_rows = self.max_batch - self.occupied
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

    @property
    def occupied(self) -> int:
        """Rows taken: running requests and the one being prefilled in chunks."""
        return len(self.running) + (self.prefilling is not None)

    @property
    def load(self) -> tuple[int, int]:
        return self.occupied, len(self.queue)

    def retry_after(self) -> int:
        """Seconds until a new request would likely get a row: the requests ahead of it over the rate rows
        were freed at in the last DRAIN_WINDOW_S (from the oldest of those completions to now), clamped to
        [1, RETRY_AFTER_MAX_S]."""
        now = time.monotonic()
        with self.cond:
            ahead = len(self.queue) + 1 - max(self.max_batch - self.occupied, 0)
            while self.completions and now - self.completions[0] > DRAIN_WINDOW_S:
                self.completions.popleft()
            freed = len(self.completions)
        if ahead <= 0:
            return 1
        if freed == 0:  # nothing drained lately: no evidence of an early slot
            return RETRY_AFTER_MAX_S
        # The rate over the span the window's completions cover (a burst after an idle spell drains at the
        # burst's rate, not at the burst spread over the whole window).
        span = max(now - self.completions[0], 1.0)
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(ahead * span / freed)))

    # ---- the engine thread, at a step boundary ------------------------------------------------------
    def _take_admissible(self, tokens: int) -> tuple[list[Request], Request | None]:
        """Pop what this step boundary prefills within `tokens` prompt tokens (under the lock): queued
        requests whose prompts fit whole, or else the first one, to be prefilled in chunks (one at a time,
        in arrival order: a prompt being chunked is finished before the next starts)."""
        self._expire_queued()
        if self.prefilling is not None:
            return [], None
        # Cancelled rows are dropped before this prefill, so their slots count as free.
        free = self.batch.free + sum(1 for r in self.running.values() if r.cancelled)
        chosen: list[Request] = []
        longest = 0
        while self.queue and len(chosen) < max(free, 0):
            nxt = max(longest, len(self.queue[0].prompt))
            # Prompts are right-padded into one pass, so its cost is rows x longest prompt.
            if (len(chosen) + 1) * nxt > tokens:
                break
            chosen.append(self.queue.popleft())
            longest = nxt
        if not chosen and self.queue and free > 0:  # longer than the budget: in chunks, or whole if not chunking
            return ([], self.queue.popleft()) if self.chunked_prefill else ([self.queue.popleft()], None)
        return chosen, None

    def _expire_queued(self) -> None:
        """Drop cancelled queue entries and refuse those that waited past queue_timeout_s."""
        now = time.perf_counter()
        kept: deque[Request] = deque()
        for req in self.queue:
            if req.cancelled:
                self._finish(req, "cancelled")
            elif now - req.arrival > self.queue_timeout_s:
                self.metrics.rejected.labels("queue_timeout").inc()
                self._error(req, 503, f"request waited more than {self.queue_timeout_s:g} s for a free "
                            "slot (server busy); retry later", "server_busy", "queue_timeout")
            else:
                kept.append(req)
        self.queue = kept

    def _drop_cancelled(self) -> None:
        gone = [r for r in self.running.values() if r.cancelled]
        if gone:
            self.batch.remove([r.id for r in gone])
            for r in gone:
                del self.running[r.id]
                self._finish(r, "cancelled")
        req = self.prefilling
        if req is not None and req.cancelled:
            self.engine.abandon(self.batch)
            self.prefilling = None
            self._finish(req, "cancelled")

    def _prefill(self, reqs: list[Request]) -> None:
        """Add requests to the batch; when that fails, add them one at a time so only the culprit fails."""
        try:
            out = self._add(reqs)
        except Exception as exc:
            if len(reqs) == 1:
                self._refuse(reqs[0], exc)
                return
            log.warning("prefill of %d requests failed (%s: %s); admitting them one at a time", len(reqs),
                        type(exc).__name__, exc)
            for r in reqs:
                self._prefill([r])
            return
        self.metrics.prompt_tokens.inc(sum(len(r.prompt) for r in reqs))
        self._deliver(out)

    def _add(self, reqs: list[Request]) -> StepOutput:
        for r in reqs:
            self.running[r.id] = r
        with self._undone_on_failure(reqs):
            return self.engine.add(self.batch, [r.id for r in reqs], [r.prompt for r in reqs],
                                   [r.max_tokens for r in reqs], sampling=[r.sampling for r in reqs],
                                   logprobs=[r.logprobs for r in reqs])

    def _begin(self, req: Request) -> None:
        """Start prefilling a long prompt in chunks (`_advance` runs them)."""
        try:
            self.engine.begin(self.batch, req.id, req.prompt, req.max_tokens, req.sampling, req.logprobs)
        except Exception as exc:
            self._refuse(req, exc)
            return
        self.prefilling = req

    def _advance(self, tokens: int) -> None:
        """The next chunk of the prompt being prefilled, in a pass of its own (no row is decoding); a
        failure refuses that request alone."""
        req = self.prefilling
        try:
            self._chunked(lambda: self.engine.advance(self.batch, tokens), tokens)
        except Exception as exc:
            if self.prefilling is req:
                self.engine.abandon(self.batch)
                self.prefilling = None
            self._refuse(req, exc)

    def _chunked(self, run: Callable[[], T], tokens: int) -> T:
        """Run what prefills the next at most `tokens` tokens of the chunked prompt (a pass of its own, or a
        decode step carrying them); once the prompt is all in, the request runs and gets its first token."""
        req, left = self.prefilling, self.batch.pending.left
        out = run()
        self.metrics.prompt_tokens.inc(min(tokens, left))
        self.metrics.prefill_chunks.inc()
        if self.batch.pending is not None and self.batch.pending.left == 0:
            self.running[req.id] = req
            with self._undone_on_failure([req]):
                joined = self.engine.join(self.batch)
            self.prefilling = None
            self._deliver(joined)
        return out

    @contextmanager
    def _undone_on_failure(self, reqs: list[Request]):
        """A failed admission leaves the batch as it was: new rows go after the first n0, and only they can
        finish inside the admission, so cutting the batch back to n0 rows undoes it."""
        n0 = self.batch.n
        try:
            yield
        except BaseException:
            for r in reqs:
                self.running.pop(r.id, None)
                self.batch.logprobs.pop(r.id, None)
            del self.batch.ids[n0:]
            self.batch.n = n0
            raise

    def _refuse(self, req: Request, exc: Exception) -> None:
        if isinstance(exc, MedusaError):  # the engine's own input check: the request's fault
            self._error(req, 400, str(exc), "invalid_request_error", None)
            return
        log.error("request %s failed in prefill", req.tag, exc_info=exc)
        self.metrics.failures.labels("prefill").inc()
        self._error(req, 500, f"internal error while starting this request (request id {req.tag})",
                    "server_error", None)

    def _deliver(self, out: StepOutput) -> None:
        raise NotImplementedError

    def _finish(self, req: Request, reason: str) -> None:
        raise NotImplementedError

    def _error(self, req: Request, status: int, message: str, error_type: str, code: str | None) -> None:
        raise NotImplementedError
