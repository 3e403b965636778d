"""Continuous batching: one background thread drives the engine over a batch that requests join and leave.

Three parts, one responsibility each: `Admission` (medusa.serve.admission) is the queue the HTTP side
submits to; `Scheduler` owns the engine thread and the batch rows; `Outcomes` (medusa.serve.outcomes) turns a
row's new tokens into text and events for its client and ends each request once.

Each loop iteration is one step boundary: drop cancelled and timed-out requests, prefill within the
boundary's token budget (whole short prompts into free rows, or the next chunk of a long prompt, so running
rows are never stalled behind long prompts; see `medusa.serve.prefill`), then run one decode step in the
mode the speculation policy picks (`Engine.policy_step`). Results go back to the HTTP side through a
callback per request that must be thread-safe (the app hands in `loop.call_soon_threadsafe`).

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
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

import torch

from medusa.decoding.batch import Batch
from medusa.decoding.engine import Engine
from medusa.decoding.outputs import StepOutput
from medusa.decoding.proposers import Proposer
from medusa.decoding.target.transformer import cache_capacity
from medusa.errors import MedusaError
from medusa.serve.admission import Admission
from medusa.serve.metrics import Metrics
from medusa.serve.outcomes import Outcomes, keep_logprobs
from medusa.serve.policy import MODES, Decision, SpeculationPolicy
from medusa.serve.memory import RELEASE_AFTER_S, MemoryGauges
from medusa.serve.prefill import PrefillBudget
from medusa.serve.prefix import ServedPrefixes
from medusa.serve.request import Request

log = logging.getLogger("medusa.serve.scheduler")
PROBE_INTERVAL_S = 2.0  # how often an idle, unhealthy engine tries a one-row probe decode
T = TypeVar("T")


class Scheduler:
    """The engine thread and the batch rows: what the HTTP side queued in `admission` is prefilled into rows,
    decoded step by step, and ended through `outcomes`."""

    def __init__(self, engine: Engine, tokenizer: Any, policy: SpeculationPolicy, metrics: Metrics, *,
                 max_batch: int, max_context: int, max_queue: int, queue_timeout_s: float, budget: PrefillBudget,
                 chunked_prefill: bool = True, prefix: ServedPrefixes | None = None):
        """`policy` chooses each step's proposer and sets up their per-row state in every new batch;
        `prefix`: the prefix cache (None: off)."""
        self.engine, self.policy, self.metrics, self.prefix = engine, policy, metrics, prefix
        self.missed = False  # the step-time target could not be kept at the last boundary
        self.max_batch, self.max_context, self.budget = max_batch, max_context, budget
        self.admission = Admission(metrics, lambda: self.occupied, max_batch=max_batch, max_queue=max_queue,
                                   queue_timeout_s=queue_timeout_s, chunked_prefill=chunked_prefill)
        self.outcomes = Outcomes(tokenizer, metrics, self.admission.freed)
        self.width = 1  # tokens per row of the last decode pass (its tree's size)
        # Room past the longest request for the candidate block of one verification pass.
        self.capacity = cache_capacity(max_context, 1, policy.max_tree_size)
        self.running: dict[int, Request] = {}
        self.prefilling: Request | None = None  # the request whose prompt is being prefilled in chunks
        self.batch: Batch | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.steps = 0
        self.fault: str | None = None  # set while the engine is unhealthy: what failed
        self.probed_at = 0.0
        # used: work since the last trim (start-up's loading and calibration count: they leave free memory too)
        self.memory, self.used = MemoryGauges(metrics.registry, 0), True

    @property
    def occupied(self) -> int:
        """Rows taken: running requests and the one being prefilled in chunks."""
        return len(self.running) + (self.prefilling is not None)

    @property
    def load(self) -> tuple[int, int]:
        return self.occupied, len(self.admission)

    def start(self) -> None:
        self.batch = self.new_batch()
        self.memory.kv.set(self.batch.cache.data.numel() * self.batch.cache.data.element_size())
        self.thread = threading.Thread(target=self._loop, name="medusa-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.admission.cond:
            self.stopping = True
            self.admission.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def new_batch(self) -> Batch:
        batch = self.engine.new_batch(self.max_batch, self.capacity, self.max_context)
        self.policy.attach(batch)
        if self.prefix is not None:
            self.prefix.attach(batch)
        return batch

    # ---- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.admission.cond:
                idle = False
                while not (self.stopping or self.admission or self.running or self.prefilling or self._probe_due()):
                    # Idle RELEASE_AFTER_S after work: the step temporaries' free memory goes back.
                    if not self.admission.cond.wait(timeout=RELEASE_AFTER_S if self.used else 0.5) and self.used:
                        idle = True
                        break
                if self.stopping:
                    break
            if idle:
                self.used = False
                self.memory.trim()
                continue
            self.used = True
            self.boundary()
        self._fail_all("server is shutting down", status=503)

    def boundary(self) -> None:
        """One step boundary: drop cancelled requests, prefill within the budget (whole prompts, or the
        next chunk of a long one), then one decode step over the running rows."""
        with self.admission.cond:
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
        if self.prefix is not None:
            alive = set(self.running)
            if self.prefilling is not None:
                alive.add(self.prefilling.id)
            self.prefix.sweep(alive)
        self._update_gauges()

    # ---- prefill: queued requests into rows ---------------------------------------------------------
    def _take_admissible(self, tokens: int) -> tuple[list[Request], Request | None]:
        """Under the lock: end the queue entries that were cancelled or waited too long, then pop what this
        boundary prefills within `tokens` prompt tokens (nothing while a long prompt is being chunked: it is
        finished before the next starts)."""
        cancelled, late = self.admission.expire()
        for req in cancelled:
            self.outcomes.finish(req, "cancelled")
        for req in late:
            self.outcomes.error(req, 503, f"request waited more than {self.admission.queue_timeout_s:g} s for a "
                                "free slot (server busy); retry later", "server_busy", "queue_timeout")
        if self.prefilling is not None:
            return [], None
        # Cancelled rows are dropped before this prefill, so their slots count as free.
        free = self.batch.free + sum(1 for r in self.running.values() if r.cancelled)
        return self.admission.take(max(free, 0), tokens, self.prefix.cost if self.prefix is not None else None)

    def _drop_cancelled(self) -> None:
        gone = [r for r in self.running.values() if r.cancelled]
        if gone:
            self.batch.remove([r.id for r in gone])
            for r in gone:
                del self.running[r.id]
                self.outcomes.finish(r, "cancelled")
        req = self.prefilling
        if req is not None and req.cancelled:
            self.engine.abandon(self.batch)
            self.prefilling = None
            self.outcomes.finish(req, "cancelled")

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
        self.metrics.prompt_tokens.inc(sum(len(r.prompt) - r.cached_tokens for r in reqs))
        self._deliver(out)

    def _add(self, reqs: list[Request]) -> StepOutput:
        start = None
        if self.prefix is not None:
            # Rows with equal cached prefixes side by side: the engine prefills each run in one pass.
            hits = sorted(((r, self.prefix.lookup(r)) for r in reqs), key=lambda rh: rh[1].tokens)
            reqs = [r for r, _ in hits]
            start = [self.prefix.restore(self.batch, self.batch.n + i, r, hit) for i, (r, hit) in enumerate(hits)]
        for r in reqs:
            self.running[r.id] = r
        with self._undone_on_failure(reqs):
            return self.engine.add(self.batch, [r.id for r in reqs], [r.prompt for r in reqs],
                                   [r.max_tokens for r in reqs], sampling=[r.sampling for r in reqs],
                                   logprobs=[r.logprobs for r in reqs], start=start)

    def _begin(self, req: Request) -> None:
        """Start prefilling a long prompt in chunks (`_advance`, or decode steps carrying them, run them)."""
        try:
            start = 0
            if self.prefix is not None:  # the top slot is where a chunked prompt is prefilled
                start = self.prefix.restore(self.batch, self.batch.cache.rows - 1, req, self.prefix.lookup(req))
            self.engine.begin(self.batch, req.id, req.prompt, req.max_tokens, req.sampling, req.logprobs,
                              start=start)
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
        """A failed admission leaves the batch (`Batch.undone_on_failure`) and the running set as they were."""
        try:
            with self.batch.undone_on_failure([r.id for r in reqs]):
                yield
        except BaseException:
            for r in reqs:
                self.running.pop(r.id, None)
            raise

    def _refuse(self, req: Request, exc: Exception) -> None:
        if isinstance(exc, MedusaError):  # the engine's own input check: the request's fault
            self.outcomes.error(req, 400, str(exc), "invalid_request_error", None)
            return
        log.error("request %s failed in prefill", req.tag, exc_info=exc)
        self.metrics.failures.labels("prefill").inc()
        self.outcomes.error(req, 500, f"internal error while starting this request (request id {req.tag})",
                            "server_error", None)

    def _decode(self, prefill: int = 0) -> None:
        """One decode step over the running rows (`Engine.policy_step`), carrying `prefill` chunked-prompt tokens."""
        with self.admission.cond:
            self.policy.waiting(len(self.admission))
        n, failures = self.batch.n, self.policy.failures
        start = time.perf_counter()
        run = lambda: self.engine.policy_step(self.batch, policy=self.policy, prefill=prefill)  # noqa: E731
        out = self._chunked(run, prefill) if prefill else run()
        seconds = time.perf_counter() - start
        decision, proposer = self.policy.chosen
        self.metrics.failures.labels("proposer").inc(self.policy.failures - failures)
        self.width = proposer.max_nodes if proposer is not None else 1
        if not (prefill and self.prefilling is None):  # the step that ended a prompt also ran its join: not a price
            self.budget.observe(seconds, prefill, n, self.width)
        if self.fault is not None:
            self._recovered("a decode step succeeded")
        self._record(decision, proposer, out, n, seconds, prefill)
        self._deliver(out)

    def _record(self, decision: Decision, proposer: Proposer | None, out: StepOutput, rows: int, seconds: float,
                prefill: int = 0) -> None:
        """The step's metrics (the policy heard of the step from the engine)."""
        self.steps += 1
        self.metrics.observe_step(decision.mode, MODES, seconds, out.accepted_list if proposer is not None else None,
                                  proposer)
        log.debug("step %d: %s %s rows=%d tau=%.2f prefill=%d target=%s ms %.1f ms", self.steps, decision.mode,
                  decision.tree or "", rows, out.tau, prefill, self.budget.target_ms, 1000 * seconds)

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
                if self.outcomes.tokens(req, new, now, rid in finished):
                    stopped.append(req)
                elif rid in finished:
                    del self.running[rid]
                    self.outcomes.finish(req, finished[rid])
            except Exception as exc:
                broken.append((req, exc))
        if stopped:
            self.batch.remove([r.id for r in stopped if r.id in self.batch.ids])
            for r in stopped:
                del self.running[r.id]
                self.outcomes.finish(r, "stop")
        if broken:
            self._retire(broken)

    def _retire(self, broken: list[tuple[Request, Exception]]) -> None:
        """Rows whose results could not be handled leave the batch with an error; the others go on."""
        in_batch = [r.id for r, _ in broken if r.id in self.batch.ids]
        if in_batch:
            self.batch.remove(in_batch)
        for req, exc in broken:
            log.error("request %s failed while handling its tokens", req.tag, exc_info=exc)
            self.metrics.failures.labels("row").inc()
            self.running.pop(req.id, None)
            self.outcomes.error(req, 500, f"internal error while decoding this request (request id {req.tag})",
                        "server_error", None)

    def _fail_all(self, message: str, status: int = 500) -> None:
        """Fail every running request (and on shutdown, 503, the queued ones too) and reset the batch.

        `message` may contain `{tag}`, replaced by each request's id."""
        with self.admission.cond:
            victims = list(self.running.values()) + (self.admission.clear() if status == 503 else [])
            if self.prefilling is not None and self.prefilling.id not in self.running:
                victims.append(self.prefilling)
            self.running.clear()
            self.prefilling = None
        for r in victims:
            self.outcomes.error(r, status, message.replace("{tag}", r.tag), "server_error", None)
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
        self.metrics.queued.set(len(self.admission))
        if self.prefix is not None:
            self.prefix.update_metrics()
        if self.budget.target is not None:
            self.missed = self.metrics.observe_target(self.budget.target_ms, self.budget.missed, self.missed)

