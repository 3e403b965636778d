"""Continuous batching: one background thread drives `engine.step` over a batch that requests join and leave.

Each loop iteration is one step boundary: drop cancelled and timed-out requests, prefill waiting requests
into free rows (at most `prefill_tokens_per_step` padded prompt tokens, so running rows are not stalled
behind a burst of long prompts), then run one decode step in the mode the speculation policy picks.
New tokens are detokenised incrementally per request; a stop string ends the request there (the row is
removed from the batch and the string trimmed from the text). Results go back to the HTTP side through a
callback per request that must be thread-safe (the app hands in `loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from medusa.engine import Batch, Engine, StepOutput
from medusa.errors import MedusaError
from medusa.sampling import GREEDY, SamplingParams

from .metrics import Metrics
from .policy import Decision, SpeculationPolicy

log = logging.getLogger("serve.scheduler")


@dataclass
class Event:
    kind: str  # "delta" (new text), "done" (finished), "error"
    text: str = ""
    tokens: int = 0  # completion tokens so far
    finish_reason: str | None = None
    status: int = 200
    error_type: str = ""
    code: str | None = None


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
    sent: int = 0  # characters of `text` already sent
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    done: bool = False


class Overloaded(Exception):
    """The admission queue is full."""


class Scheduler:
    def __init__(self, engine: Engine, tokenizer: Any, policy: SpeculationPolicy,
                 proposer_for: Callable[[Decision], Any], metrics: Metrics, *, max_batch: int,
                 max_context: int, max_queue: int, queue_timeout_s: float, prefill_tokens_per_step: int,
                 max_proposal_tokens: int):
        self.engine, self.tokenizer, self.policy = engine, tokenizer, policy
        self.proposer_for, self.metrics = proposer_for, metrics
        self.max_batch, self.max_context = max_batch, max_context
        self.max_queue, self.queue_timeout_s = max_queue, queue_timeout_s
        self.prefill_budget = prefill_tokens_per_step
        # Room past the longest request for the candidate block of one verification pass.
        self.capacity = max_context + max_proposal_tokens + 2
        self.queue: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.cond = threading.Condition()
        self.batch: Batch | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.steps = 0
        self.tau_sum, self.tau_steps = 0.0, 0

    # ---- called from the HTTP side -------------------------------------------------------------------
    def start(self) -> None:
        self.batch = self.engine.new_batch(self.max_batch, self.capacity, self.max_context)
        self.thread = threading.Thread(target=self._loop, name="medusa-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def submit(self, req: Request) -> None:
        with self.cond:
            free_rows = self.max_batch - len(self.running)
            if len(self.queue) >= self.max_queue + max(free_rows, 0):
                self.metrics.rejected.labels("queue_full").inc()
                raise Overloaded()
            self.queue.append(req)
            self.metrics.queued.set(len(self.queue))
            self.cond.notify_all()

    def cancel(self, req: Request) -> None:
        """Client went away: the row (or queue entry) is dropped at the next step boundary."""
        with self.cond:
            if not req.done:
                req.cancelled = True
                self.cond.notify_all()

    @property
    def load(self) -> tuple[int, int]:
        return len(self.running), len(self.queue)

    # ---- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.cond:
                while not (self.stopping or self.queue or self.running):
                    self.cond.wait(timeout=0.5)
                if self.stopping:
                    break
                admitted = self._take_admissible()
            try:
                self._drop_cancelled()
                if admitted:
                    self._prefill(admitted)
                if self.batch.n:
                    self._decode()
            except Exception as exc:  # a bug must not take the server down: fail the batch, keep serving
                log.exception("engine step failed")
                self._fail_all(f"internal error in the decoding loop: {exc}")
            self._update_gauges()
        self._fail_all("server is shutting down", status=503)

    def _take_admissible(self) -> list[Request]:
        """Pop queued requests that fit the free rows and this step's prefill budget (under the lock)."""
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
        # Cancelled rows are dropped before this prefill, so their slots count as free.
        free = self.batch.free + sum(1 for r in self.running.values() if r.cancelled)
        chosen: list[Request] = []
        longest = 0
        while self.queue and len(chosen) < max(free, 0):
            nxt = max(longest, len(self.queue[0].prompt))
            # Prompts are right-padded into one pass, so its cost is rows x longest prompt.
            if chosen and (len(chosen) + 1) * nxt > self.prefill_budget:
                break
            chosen.append(self.queue.popleft())
            longest = nxt
        return chosen

    def _drop_cancelled(self) -> None:
        gone = [r for r in self.running.values() if r.cancelled]
        if gone:
            self.batch.remove([r.id for r in gone])
            for r in gone:
                del self.running[r.id]
                self._finish(r, "cancelled")

    def _prefill(self, reqs: list[Request]) -> None:
        ids = [r.id for r in reqs]
        prompts = [r.prompt for r in reqs]
        limits = [r.max_tokens for r in reqs]
        for r in reqs:
            self.running[r.id] = r
        try:
            out = self.engine.add(self.batch, ids, prompts, limits, sampling=[r.sampling for r in reqs])
        except MedusaError as exc:
            # The engine checks its input before touching the batch: only these requests fail.
            for r in reqs:
                del self.running[r.id]
                self._error(r, 400, str(exc), "invalid_request_error", None)
            return
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        self._deliver(out)

    def _decode(self) -> None:
        with self.cond:
            queued = len(self.queue)
        decision = self.policy.decide(self.batch.n, queued)
        proposer = self.proposer_for(decision)
        if proposer is None and decision.mode != "plain":
            decision = Decision("plain", None, f"{decision.mode} unavailable")
        stats = self.batch.stats
        hist0, rows0 = list(stats.accept_hist), stats.row_steps
        n = self.batch.n
        start = time.perf_counter()
        out = self.engine.step(self.batch, proposer)
        seconds = time.perf_counter() - start
        self.metrics.step_seconds.observe(seconds)
        self.steps += 1
        self.metrics.steps.labels(decision.mode).inc()
        spec = decision.mode != "plain"
        self.metrics.spec_steps.labels("on" if spec else "off").inc()
        self.metrics.spec_on.set(1 if spec else 0)
        for m in ("medusa", "draft", "plain"):
            self.metrics.mode_info.labels(m).set(1 if m == decision.mode else 0)
        tau = self._acceptance(proposer, hist0, rows0) if spec else 1.0
        self.policy.observe(decision, n, tau, seconds)
        log.debug("step %d: %s%s rows=%d tau=%.2f %.1f ms", self.steps, decision.mode,
                  f" {decision.tree}" if decision.tree else "", n, tau, 1000 * seconds)
        self._deliver(out)

    def _acceptance(self, proposer: Any, hist0: list[int], rows0: int) -> float:
        """Tokens per row of the step just taken (tau); updates the acceptance metrics."""
        hist = self.batch.stats.accept_hist
        delta = [c - (hist0[a] if a < len(hist0) else 0) for a, c in enumerate(hist)]
        rows = max(self.batch.stats.row_steps - rows0, 1)
        accepted = sum(a * c for a, c in enumerate(delta))
        tau = 1 + accepted / rows
        self.tau_sum += tau
        self.tau_steps += 1
        self.metrics.accepted.set(self.tau_sum / self.tau_steps)
        self.metrics.acceptance.set(accepted / (rows * max(proposer.tree.depth, 1)))
        return tau

    # ---- results ------------------------------------------------------------------------------------
    def _deliver(self, out: StepOutput) -> None:
        now = time.perf_counter()
        finished = {f.id: f.reason for f in out.finished}
        counts = out.counts.tolist()
        stopped: list[Request] = []
        for i, rid in enumerate(out.ids):
            req = self.running.get(rid)
            if req is None:
                continue
            new = out.tokens[i, : counts[i]].tolist()
            if new:
                if req.first_token_at is None:
                    req.first_token_at = now
                    self.metrics.ttft.observe(now - req.arrival)
                req.last_token_at = now
                req.tokens.extend(new)
                self.metrics.tokens.inc(len(new))
            hit_stop = self._detokenize(req, final=rid in finished)
            if rid in finished:
                del self.running[rid]
                self._finish(req, "stop" if hit_stop else finished[rid])
            elif hit_stop:
                stopped.append(req)
        if stopped:
            self.batch.remove([r.id for r in stopped])
            for r in stopped:
                del self.running[r.id]
                self._finish(r, "stop")

    def _detokenize(self, req: Request, final: bool) -> bool:
        """Update the request's text, send what is safe to send; True when a stop string was hit."""
        text = self.tokenizer.decode(req.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        hit = False
        if req.stop:
            # Only the new part (plus an overlap the length of the longest stop string) can hold a match.
            start = max(0, len(req.text) - max(len(s) for s in req.stop))
            found = [i for i in (text.find(s, start) for s in req.stop) if i >= 0]
            if found:
                text, hit = text[: min(found)], True
        safe = len(text)
        if not (final or hit):
            if req.stop:  # hold back a tail that could still become a stop string
                safe -= max(len(s) for s in req.stop) - 1
            while safe > 0 and text[safe - 1] == "\ufffd":  # an unfinished multi-byte character
                safe -= 1
        req.text = text
        if safe > req.sent:
            req.on_event(Event("delta", text[req.sent: safe], len(req.tokens)))
            req.sent = safe
        return hit

    def _finish(self, req: Request, reason: str) -> None:
        if req.done:
            return
        req.done = True
        self.metrics.requests.labels(reason).inc()
        if req.first_token_at is not None and len(req.tokens) > 1:
            self.metrics.tpot.observe((req.last_token_at - req.first_token_at) / (len(req.tokens) - 1))
        if reason != "cancelled":
            tail = req.text[req.sent:]
            req.sent = len(req.text)
            req.on_event(Event("done", tail, len(req.tokens), finish_reason=reason))

    def _error(self, req: Request, status: int, message: str, error_type: str, code: str | None) -> None:
        if not req.done:
            req.done = True
            req.on_event(Event("error", message, status=status, error_type=error_type, code=code))

    def _fail_all(self, message: str, status: int = 500) -> None:
        with self.cond:
            victims = list(self.running.values()) + (list(self.queue) if status == 503 else [])
            self.running.clear()
            if status == 503:
                self.queue.clear()
        for r in victims:
            self._error(r, status, message, "server_error", None)
        # A failed step may have left the batch half-updated: start from a clean one.
        self.batch = self.engine.new_batch(self.max_batch, self.capacity, self.max_context)

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.queued.set(len(self.queue))
