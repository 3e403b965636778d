"""How a request's results reach its client: new tokens detokenised incrementally (a stop string ends the
request there and is trimmed from the text), the final event with its finish reason, or an error. Every
request ends exactly once; ending frees its row for the queue's drain rate (`Admission.freed`)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from medusa.serve.detokenize import visible_text
from medusa.serve.metrics import Metrics
from medusa.serve.request import Event, Request

log = logging.getLogger("medusa.serve.scheduler")


class Outcomes:
    def __init__(self, tokenizer: Any, metrics: Metrics, freed: Callable[[], None]):
        self.tokenizer, self.metrics, self.freed = tokenizer, metrics, freed

    def tokens(self, req: Request, new: list[int], now: float, final: bool) -> bool:
        """Append a row's new tokens (at perf_counter time `now`) and send the text they complete; True when a
        stop string was hit."""
        if new:
            if req.first_token_at is None:
                req.first_token_at = now
                self.metrics.observe_first_token(now - req.arrival)
            else:
                self.metrics.observe_inter_token(now - req.last_token_at)
            req.last_token_at = now
            req.tokens.extend(new)
            self.metrics.tokens.inc(len(new))
        return self.detokenize(req, final=final)

    def detokenize(self, req: Request, final: bool) -> bool:
        """Update the request's text, send what is safe to send; True when a stop string was hit."""
        req.text, safe, hit = visible_text(self.tokenizer, req.decoded, req.text, req.tokens, req.stop, final)
        if safe > req.sent:
            req.on_event(Event("delta", req.text[req.sent: safe], len(req.tokens), **req.take_unsent()))
            req.sent = safe
        return hit

    def finish(self, req: Request, reason: str) -> None:
        """End the request: the rest of its text and `reason` (nothing is sent to a cancelled one)."""
        if not self._close(req):
            return
        self.metrics.requests.labels(reason).inc()
        if req.first_token_at is not None and len(req.tokens) > 1:
            self.metrics.tpot.observe((req.last_token_at - req.first_token_at) / (len(req.tokens) - 1))
        if reason != "cancelled":
            tail = req.text[req.sent:]
            req.sent = len(req.text)
            req.on_event(Event("done", tail, len(req.tokens), finish_reason=reason, **req.take_unsent()))

    def error(self, req: Request, status: int, message: str, error_type: str, code: str | None) -> None:
        """End the request with an HTTP error."""
        if not self._close(req):
            return
        try:
            req.on_event(Event("error", message, status=status, error_type=error_type, code=code))
        except Exception:  # the receiver is gone (e.g. its event loop closed): nothing left to tell
            log.warning("could not deliver the error of request %s", req.tag, exc_info=True)

    def _close(self, req: Request) -> bool:
        """Mark the request done and its row freed; False when it already was (it ends only once)."""
        if req.done:
            return False
        req.done = True
        self.freed()
        return True


def keep_logprobs(req: Request, new: list[int], lp: tuple[list, list, list], row: int) -> None:
    """Store the log-probabilities of a row's new tokens (the step's as lists: chosen, top ids, top)."""
    token, ids, top = lp[0][row], lp[1][row], lp[2][row]
    k = req.logprobs
    req.token_logprobs.extend((t, token[j], list(zip(ids[j][:k], top[j][:k]))) for j, t in enumerate(new))
