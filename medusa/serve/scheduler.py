"""Continuous batching: one background thread drives `engine.step` over a batch that requests join and leave.

Each loop iteration is one step boundary: drop cancelled and timed-out requests, prefill waiting requests
into free rows (at most `prefill_tokens_per_step` padded prompt tokens, so running rows are not stalled
behind a burst of long prompts), then run one decode step in the mode the speculation policy picks.
New tokens are detokenised incrementally per request; a stop string ends the request there (the row is
removed from the batch and the string trimmed from the text). Results go back to the HTTP side through a
callback per request that must be thread-safe (the app hands in `loop.call_soon_threadsafe`).

Failures are contained to the request that caused them where it can be told apart: a prefill that raises is
retried one request at a time, so only the request that fails alone is refused; detokenising or delivering
one row's tokens that raises retires that row; a speculative step whose proposer raises is redone without
speculation. Only a step that fails as such (the engine's own fault) fails every running request; the
engine is then reported unhealthy until a step succeeds again (a probe decode runs while idle).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from medusa.decoding.engine import Batch, Engine, StepOutput
from medusa.errors import MedusaError
from medusa.decoding.sampling import GREEDY, SamplingParams

from medusa.serve.metrics import Metrics
from medusa.serve.policy import Decision, SpeculationPolicy

log = logging.getLogger("medusa.serve.scheduler")
PROBE_INTERVAL_S = 2.0  # how often an idle, unhealthy engine tries a one-row probe decode
DRAIN_WINDOW_S = 30.0  # completions over this window give the drain rate behind Retry-After
RETRY_AFTER_MAX_S = 120


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
    sent: int = 0  # characters of `text` already sent
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    done: bool = False
    tag: str = ""  # the id the client sees (response id), quoted in error messages and the log
    logprobs: int | None = None  # None, or how many top alternatives to report per token (0..20)
    unsent: int = 0  # tokens not yet handed out with an event (their text may be held back)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)


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
        self.started_at = time.monotonic()
        self.completions: deque[float] = deque(maxlen=4096)  # monotonic times rows were freed
        self.fault: str | None = None  # set while the engine is unhealthy: what failed
        self.probed_at = 0.0
        self.proposer_failures = 0

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

    def submit(self, *reqs: Request) -> None:
        """Queue requests (the choices of one HTTP request): all of them, or none when they do not fit."""
        with self.cond:
            free_rows = self.max_batch - len(self.running)
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
    def load(self) -> tuple[int, int]:
        return len(self.running), len(self.queue)

    @property
    def healthy(self) -> bool:
        return self.fault is None

    def retry_after(self) -> int:
        """Seconds until a new request would likely get a row: the requests ahead of it over the rate rows
        were freed in the last DRAIN_WINDOW_S, clamped to [1, RETRY_AFTER_MAX_S]."""
        now = time.monotonic()
        with self.cond:
            ahead = len(self.queue) + 1 - max(self.max_batch - len(self.running), 0)
            while self.completions and now - self.completions[0] > DRAIN_WINDOW_S:
                self.completions.popleft()
            freed = len(self.completions)
        if ahead <= 0:
            return 1
        window = min(DRAIN_WINDOW_S, max(now - self.started_at, 1.0))
        if freed == 0:  # nothing drained lately: no evidence of an early slot
            return RETRY_AFTER_MAX_S
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(ahead * window / freed)))

    # ---- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.cond:
                while not (self.stopping or self.queue or self.running or self._probe_due()):
                    self.cond.wait(timeout=0.5)
                if self.stopping:
                    break
                admitted = self._take_admissible()
            try:
                if not (admitted or self.running) and self._probe_due():
                    self._probe()
                self._drop_cancelled()
                if admitted:
                    self._prefill(admitted)
                if self.batch.n:
                    self._decode()
            except Exception as exc:  # the engine itself failed: fail the batch, say so, keep serving
                self._engine_fault(exc)
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
        n0 = self.batch.n
        for r in reqs:
            self.running[r.id] = r
        try:
            return self.engine.add(self.batch, [r.id for r in reqs], [r.prompt for r in reqs],
                                   [r.max_tokens for r in reqs], sampling=[r.sampling for r in reqs],
                                   logprobs=[r.logprobs for r in reqs])
        except BaseException:
            for r in reqs:
                self.running.pop(r.id, None)
                self.batch.logprobs.pop(r.id, None)
            # New rows go after the first n0, and only they can finish inside `add`: rows below n0 are
            # untouched, so cutting the batch back to n0 rows undoes the failed admission.
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

    def _decode(self) -> None:
        with self.cond:
            queued = len(self.queue)
        decision = self.policy.decide(self.batch.n, queued)
        proposer = self.proposer_for(decision)
        if proposer is None and decision.mode != "plain":
            decision = Decision("plain", None, f"{decision.mode} unavailable")
        if proposer is not None and self.batch.logprobs and getattr(proposer, "owns_step", False):
            # Proposers that run their own step do not report log-probabilities; plain decoding does.
            decision, proposer = Decision("plain", None, "log-probabilities asked for"), None
        steps0 = self.batch.stats.steps
        n = self.batch.n
        start = time.perf_counter()
        try:
            out = self.engine.step(self.batch, proposer)
        except Exception as exc:
            if proposer is None or self.batch.stats.steps != steps0:
                raise
            decision, proposer = self._without_proposer(decision, exc)
            out = self.engine.step(self.batch, None)
        seconds = time.perf_counter() - start
        if self.fault is not None:
            self._recovered("a decode step succeeded")
        self.metrics.step_seconds.observe(seconds)
        self.steps += 1
        self.metrics.steps.labels(decision.mode).inc()
        spec = decision.mode != "plain"
        self.metrics.spec_steps.labels("on" if spec else "off").inc()
        self.metrics.spec_on.set(1 if spec else 0)
        for m in ("medusa", "draft", "plain"):
            self.metrics.mode_info.labels(m).set(1 if m == decision.mode else 0)
        tau = self._acceptance(proposer, out) if spec else 1.0
        self.policy.observe(decision, n, tau, seconds)
        log.debug("step %d: %s%s rows=%d tau=%.2f %.1f ms", self.steps, decision.mode,
                  f" {decision.tree}" if decision.tree else "", n, tau, 1000 * seconds)
        self._deliver(out)

    def _without_proposer(self, decision: Decision, exc: Exception) -> tuple[Decision, None]:
        """A proposer that raised before the step committed anything: redo the step plainly (lossless)."""
        self.proposer_failures += 1
        self.metrics.failures.labels("proposer").inc()
        n = self.proposer_failures
        log.error("%s proposal failed (%d so far): %s: %s; this step decodes without speculation",
                  decision.mode, n, type(exc).__name__, exc, exc_info=exc if n & (n - 1) == 0 else None)
        return Decision("plain", None, f"{decision.mode} failed"), None

    def _acceptance(self, proposer: Any, out: StepOutput) -> float:
        """Tokens per row of the speculative step just taken (tau); updates the acceptance metrics.

        Read from the step's own per-row counts: a row emitted its target token plus `count - 1`
        accepted candidates (a row cut at EOS or max_tokens counts what it emitted)."""
        accepted = (out.counts - 1).clamp(min=0).tolist()
        rows = max(len(accepted), 1)
        self.metrics.observe_drafts(accepted, proposer.tree.size - 1, proposer.tree.depth)
        return 1 + sum(accepted) / rows

    # ---- results ------------------------------------------------------------------------------------
    def _deliver(self, out: StepOutput) -> None:
        now = time.perf_counter()
        finished = {f.id: f.reason for f in out.finished}
        counts = out.counts.tolist()
        lp = out.logprobs
        if lp is not None:  # one conversion per step, only when some row asked
            lp_token, lp_ids, lp_top = lp.token.tolist(), lp.top_ids.tolist(), lp.top.tolist()
        stopped: list[Request] = []
        broken: list[tuple[Request, Exception]] = []
        for i, rid in enumerate(out.ids):
            req = self.running.get(rid)
            if req is None:
                continue
            try:  # a try costs nothing until it catches: no per-row price on the hot path
                new = out.tokens[i, : counts[i]].tolist()
                if req.logprobs is not None and lp is not None:
                    k = req.logprobs
                    req.token_logprobs.extend(
                        (t, lp_token[i][j], list(zip(lp_ids[i][j][:k], lp_top[i][j][:k])))
                        for j, t in enumerate(new))
                if self._take(req, new, now, rid in finished):
                    stopped.append(req)
                elif rid in finished:
                    del self.running[rid]
                    self._finish(req, finished[rid])
            except Exception as exc:
                broken.append((req, exc))
        if stopped:
            self.batch.remove([r.id for r in stopped if r.id in self.batch.ids])
            for r in stopped:
                del self.running[r.id]
                self._finish(r, "stop")
        if broken:
            self._retire(broken)

    def _take(self, req: Request, new: list[int], now: float, final: bool) -> bool:
        """Append a row's new tokens and send the text they complete; True when a stop string was hit."""
        if new:
            if req.first_token_at is None:
                req.first_token_at = now
                self.metrics.observe_first_token(now - req.arrival)
            else:
                self.metrics.observe_inter_token(now - req.last_token_at)
            req.last_token_at = now
            req.tokens.extend(new)
            self.metrics.tokens.inc(len(new))
        return self._detokenize(req, final=final)

    def _retire(self, broken: list[tuple[Request, Exception]]) -> None:
        """Rows whose results could not be handled leave the batch with an error; the others go on."""
        in_batch = [r.id for r, _ in broken if r.id in self.batch.ids]
        if in_batch:
            self.batch.remove(in_batch)
        for req, exc in broken:
            log.error("request %s failed while handling its tokens", req.tag, exc_info=exc)
            self.metrics.failures.labels("row").inc()
            self.running.pop(req.id, None)
            self._error(req, 500, f"internal error while decoding this request (request id {req.tag})",
                        "server_error", None)

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
            req.on_event(Event("delta", text[req.sent: safe], len(req.tokens), **self._unsent(req)))
            req.sent = safe
        return hit

    @staticmethod
    def _unsent(req: Request) -> dict[str, Any]:
        """The tokens (and their log-probabilities) not yet handed out: they go with the next event."""
        start, req.unsent = req.unsent, len(req.tokens)
        lp = req.token_logprobs[start:] if req.logprobs is not None else None
        return {"token_ids": req.tokens[start:], "logprobs": lp}

    def _finish(self, req: Request, reason: str) -> None:
        if req.done:
            return
        req.done = True
        self.completions.append(time.monotonic())
        self.metrics.requests.labels(reason).inc()
        if req.first_token_at is not None and len(req.tokens) > 1:
            self.metrics.tpot.observe((req.last_token_at - req.first_token_at) / (len(req.tokens) - 1))
        if reason != "cancelled":
            tail = req.text[req.sent:]
            req.sent = len(req.text)
            req.on_event(Event("done", tail, len(req.tokens), finish_reason=reason, **self._unsent(req)))

    def _error(self, req: Request, status: int, message: str, error_type: str, code: str | None) -> None:
        if req.done:
            return
        req.done = True
        self.completions.append(time.monotonic())
        try:
            req.on_event(Event("error", message, status=status, error_type=error_type, code=code))
        except Exception:  # the receiver is gone (e.g. its event loop closed): nothing left to tell
            log.warning("could not deliver the error of request %s", req.tag, exc_info=True)

    def _fail_all(self, message: str, status: int = 500) -> None:
        """Fail every running request (and on shutdown, 503, the queued ones too) and reset the batch.

        `message` may contain `{tag}`, replaced by each request's id."""
        with self.cond:
            victims = list(self.running.values()) + (list(self.queue) if status == 503 else [])
            self.running.clear()
            if status == 503:
                self.queue.clear()
        for r in victims:
            self._error(r, status, message.replace("{tag}", r.tag), "server_error", None)
        # A failed step may have left the batch half-updated: start from a clean one.
        self.batch = self.engine.new_batch(self.max_batch, self.capacity, self.max_context)

    # ---- engine faults and health -------------------------------------------------------------------
    def _engine_fault(self, exc: Exception) -> None:
        tags = ", ".join(r.tag for r in self.running.values())
        log.error("decoding step failed; failing the running requests (%s)", tags or "none", exc_info=exc)
        self.metrics.failures.labels("engine").inc()
        self.fault = f"decoding step failed: {type(exc).__name__}"
        self.metrics.healthy.set(0)
        self.probed_at = time.monotonic()
        self._fail_all("internal error in the decoding engine; the batch was reset (request id {tag})")

    def _probe_due(self) -> bool:
        return self.fault is not None and time.monotonic() - self.probed_at >= PROBE_INTERVAL_S

    def _probe(self) -> None:
        """One short decode on a batch of its own: the engine is healthy again once this works."""
        self.probed_at = time.monotonic()
        try:
            self.engine.generate([[0]], 2)
        except Exception as exc:
            log.warning("engine probe failed: %s: %s", type(exc).__name__, exc)
            return
        self._recovered("a probe decode succeeded")

    def _recovered(self, why: str) -> None:
        log.warning("engine healthy again (%s) after: %s", why, self.fault)
        self.fault = None
        self.metrics.healthy.set(1)

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.queued.set(len(self.queue))
