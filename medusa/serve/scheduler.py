"""Continuous batching: one background thread drives `engine.step` over a batch that requests join and leave.

Each loop iteration is one step boundary: drop cancelled and timed-out requests, prefill within the
boundary's token budget (whole short prompts into free rows, or the next chunk of a long prompt, so running
rows are never stalled behind long prompts; see `medusa.serve.prefill` and `medusa.serve.admission`), then
run one decode step in the mode the speculation policy picks (`Engine.policy_step`). New tokens are
detokenised incrementally per request; a stop string ends the request there (the row is removed from the batch and the string trimmed from the text). Results go back to
the HTTP side through a callback per request that must be thread-safe (the app hands in
`loop.call_soon_threadsafe`).

Failures are contained to the request that caused them where it can be told apart: a prefill that raises is
retried one request at a time, so only the request that fails alone is refused; detokenising or delivering
one row's tokens that raises retires that row; a speculative step whose proposer raises is redone without
speculation. Only a step that fails as such (the engine's own fault) fails every running request; the
engine is then reported unhealthy until a step succeeds again (a probe decode runs while idle).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import torch

from medusa.decoding.batch import Batch
from medusa.decoding.engine import Engine
from medusa.decoding.outputs import StepOutput
from medusa.decoding.proposers import Proposer
from medusa.decoding.transformer import cache_capacity
from medusa.serve.admission import Admission
from medusa.serve.detokenize import visible_text
from medusa.serve.metrics import Metrics
from medusa.serve.policy import MODES, Decision, SpeculationPolicy
from medusa.serve.prefill import PrefillBudget
from medusa.serve.request import Event, Request

log = logging.getLogger("medusa.serve.scheduler")
PROBE_INTERVAL_S = 2.0  # how often an idle, unhealthy engine tries a one-row probe decode


class Scheduler(Admission):
    def __init__(self, engine: Engine, tokenizer: Any, policy: SpeculationPolicy, metrics: Metrics, *,
                 max_batch: int, max_context: int, max_queue: int, queue_timeout_s: float, budget: PrefillBudget,
                 chunked_prefill: bool = True):
        """`policy` chooses each step's proposer and sets up their per-row state in every new batch."""
        self.engine, self.tokenizer, self.policy, self.metrics = engine, tokenizer, policy, metrics
        self.max_batch, self.max_context = max_batch, max_context
        self.max_queue, self.queue_timeout_s = max_queue, queue_timeout_s
        self.budget, self.chunked_prefill = budget, chunked_prefill
        self.width = 1  # tokens per row of the last decode pass (its tree's size)
        # Room past the longest request for the candidate block of one verification pass.
        self.capacity = cache_capacity(max_context, 1, policy.max_tree_size)
        self.queue: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.prefilling: Request | None = None
        self.cond = threading.Condition()
        self.batch: Batch | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.steps = 0
        self.completions: deque[float] = deque(maxlen=4096)  # monotonic times rows were freed
        self.fault: str | None = None  # set while the engine is unhealthy: what failed
        self.probed_at = 0.0

    def start(self) -> None:
        self.batch = self.new_batch()
        self.thread = threading.Thread(target=self._loop, name="medusa-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def new_batch(self) -> Batch:
        batch = self.engine.new_batch(self.max_batch, self.capacity, self.max_context)
        self.policy.attach(batch)
        return batch

    # ---- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.cond:
                while not (self.stopping or self.queue or self.running or self.prefilling or self._probe_due()):
                    self.cond.wait(timeout=0.5)
                if self.stopping:
                    break
            self.boundary()
        self._fail_all("server is shutting down", status=503)

    def boundary(self) -> None:
        """One step boundary: drop cancelled requests, prefill within the budget (whole prompts, or the
        next chunk of a long one), then one decode step over the running rows."""
        with self.cond:
            tokens = self.budget.tokens(self.batch.n, self.width)
            admitted, chunked = self._take_admissible(tokens)
        try:
            if not (admitted or chunked or self.running or self.prefilling) and self._probe_due():
                self._probe()
            self._drop_cancelled()
            if admitted:
                self._prefill(admitted)
            if chunked is not None:
                self._begin(chunked)
            if self.prefilling is not None and not self.batch.n:
                self._advance(tokens)
            if self.batch.n:  # a prompt being prefilled rides in the decode pass
                self._decode(tokens if self.prefilling is not None else 0)
        except Exception as exc:  # the engine itself failed: fail the batch, say so, keep serving
            self._engine_fault(exc)
        self._update_gauges()

    def _decode(self, prefill: int = 0) -> None:
        """One decode step over the running rows in the policy's mode (`Engine.policy_step`), carrying
        `prefill` tokens of the chunked prompt."""
        with self.cond:
            self.policy.waiting(len(self.queue))
        n, failures = self.batch.n, self.policy.failures
        start = time.perf_counter()
        run = lambda: self.engine.policy_step(self.batch, policy=self.policy, prefill=prefill)  # noqa: E731
        out = self._chunked(run, prefill) if prefill else run()
        seconds = time.perf_counter() - start
        decision, proposer = self.policy.chosen
        self.metrics.failures.labels("proposer").inc(self.policy.failures - failures)
        self.budget.observe(seconds, prefill)
        self.width = proposer.tree.size if proposer is not None else 1
        if self.fault is not None:
            self._recovered("a decode step succeeded")
        self._record(decision, proposer, out, n, seconds)
        self._deliver(out)

    def _record(self, decision: Decision, proposer: Proposer | None, out: StepOutput, rows: int,
                seconds: float) -> None:
        """The step's metrics (the policy heard of the step from the engine)."""
        self.metrics.step_seconds.observe(seconds)
        self.steps += 1
        self.metrics.steps.labels(decision.mode).inc()
        spec = proposer is not None
        self.metrics.spec_steps.labels("on" if spec else "off").inc()
        self.metrics.spec_on.set(1 if spec else 0)
        for m in MODES:
            self.metrics.mode_info.labels(m).set(1 if m == decision.mode else 0)
        if spec:
            self.metrics.observe_drafts(out.accepted_list, proposer.tree.size - 1, proposer.tree.depth)
        log.debug("step %d: %s%s rows=%d tau=%.2f %.1f ms", self.steps, decision.mode,
                  f" {decision.tree}" if decision.tree else "", rows, out.tau, 1000 * seconds)

    # ---- results ------------------------------------------------------------------------------------
    def _deliver(self, out: StepOutput) -> None:
        now = time.perf_counter()
        finished = {f.id: f.reason for f in out.finished}
        counts = out.count_list
        tokens = out.tokens.tolist()  # one device read per step, not one per row
        lp = None
        if out.logprobs is not None:  # one conversion per step, only when some row asked
            lp = out.logprobs.token.tolist(), out.logprobs.top_ids.tolist(), out.logprobs.top.tolist()
        stopped: list[Request] = []
        broken: list[tuple[Request, Exception]] = []
        for i, rid in enumerate(out.ids):
            req = self.running.get(rid)
            if req is None:
                continue
            try:  # a try costs nothing until it catches: no per-row price on the hot path
                new = tokens[i][: counts[i]]
                if req.logprobs is not None and lp is not None:
                    keep_logprobs(req, new, lp, i)
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
        req.text, safe, hit = visible_text(self.tokenizer, req.decoded, req.text, req.tokens, req.stop, final)
        if safe > req.sent:
            req.on_event(Event("delta", req.text[req.sent: safe], len(req.tokens), **req.take_unsent()))
            req.sent = safe
        return hit

    def _close(self, req: Request) -> bool:
        """Mark the request done and its row freed; False when it already was (it ends only once)."""
        if req.done:
            return False
        req.done = True
        self.completions.append(time.monotonic())
        return True

    def _finish(self, req: Request, reason: str) -> None:
        if not self._close(req):
            return
        self.metrics.requests.labels(reason).inc()
        if req.first_token_at is not None and len(req.tokens) > 1:
            self.metrics.tpot.observe((req.last_token_at - req.first_token_at) / (len(req.tokens) - 1))
        if reason != "cancelled":
            tail = req.text[req.sent:]
            req.sent = len(req.text)
            req.on_event(Event("done", tail, len(req.tokens), finish_reason=reason, **req.take_unsent()))

    def _error(self, req: Request, status: int, message: str, error_type: str, code: str | None) -> None:
        if not self._close(req):
            return
        try:
            req.on_event(Event("error", message, status=status, error_type=error_type, code=code))
        except Exception:  # the receiver is gone (e.g. its event loop closed): nothing left to tell
            log.warning("could not deliver the error of request %s", req.tag, exc_info=True)

    def _fail_all(self, message: str, status: int = 500) -> None:
        """Fail every running request (and on shutdown, 503, the queued ones too) and reset the batch.

        `message` may contain `{tag}`, replaced by each request's id."""
        with self.cond:
            victims = list(self.running.values()) + (list(self.queue) if status == 503 else [])
            if self.prefilling is not None and self.prefilling.id not in self.running:
                victims.append(self.prefilling)
            self.running.clear()
            self.prefilling = None
            if status == 503:
                self.queue.clear()
        for r in victims:
            self._error(r, status, message.replace("{tag}", r.tag), "server_error", None)
        # A failed step may have left the batch half-updated: start from a clean one.
        self.batch = self.new_batch()

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
        self.metrics.running.set(self.occupied)
        self.metrics.queued.set(len(self.queue))


def keep_logprobs(req: Request, new: list[int], lp: tuple[list, list, list], row: int) -> None:
    """Store the log-probabilities of a row's new tokens (the step's as lists: chosen, top ids, top)."""
    token, ids, top = lp[0][row], lp[1][row], lp[2][row]
    k = req.logprobs
    req.token_logprobs.extend((t, token[j], list(zip(ids[j][:k], top[j][:k]))) for j, t in enumerate(new))
