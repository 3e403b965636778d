"""Everything a running server holds (runtime, policy, proposers, scheduler, metrics) and the way from a
request body to scheduler requests and back to API errors."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

from medusa.runtime import Runtime
from medusa.runtime.calibrate import cached_curve
from medusa.serve.body import parse_body
from medusa.serve.config import ServeConfig
from medusa.serve.errors import ApiError
from medusa.serve.metrics import Metrics
from medusa.serve.policy import SpeculationPolicy
from medusa.serve.prefill import PrefillBudget, parse_tpot_slo
from medusa.serve.prefix import ServedPrefixes, parse_megabytes
from medusa.serve.proposers import calibrated_policy, default_trees, drafts_without_draft_model, heads_proposers
from medusa.serve.protocol import ChatCompletionRequest, CompletionRequest
from medusa.serve.request import Event, Overloaded, Request
from medusa.serve.scheduler import Scheduler
from medusa.serve.translate import chat_limit, chat_prompt, completion_prompt, make_requests


def served_name(cfg: ServeConfig, rt: Runtime) -> str:
    if cfg.served_model_name:
        return cfg.served_model_name
    name = str(getattr(rt.hf_model, "name_or_path", "") or cfg.model)
    return Path(name).name if Path(name).exists() else name


def prefill_budget(cfg: ServeConfig, curve) -> PrefillBudget:
    """The prefill budget: chunks sized to the step-time target (`tpot_slo`, default 2x a stream's step
    alone), or to `prefill_stall` when that older dial is set instead."""
    if cfg.prefill_stall is not None:
        return PrefillBudget(cfg.prefill_tokens_per_step, cfg.prefill_stall, curve)
    target = parse_tpot_slo(cfg.tpot_slo if cfg.tpot_slo is not None else "2x")
    return PrefillBudget(cfg.prefill_tokens_per_step, None, curve, target=target)


class Server:
    """Everything a running server holds: runtime, policy, proposers, scheduler, metrics."""

    def __init__(self, cfg: ServeConfig, rt: Runtime, draft: Any = None):
        self.cfg, self.rt = cfg, rt
        self.name = served_name(cfg, rt)
        self.api_key = cfg.api_key or os.environ.get("MEDUSA_API_KEY") or None
        self.metrics = Metrics()
        calibrated, planned = calibrated_policy(cfg, rt, draft)
        self.policy = SpeculationPolicy(cfg.policy, has_heads=drafts_without_draft_model(rt),
                                        has_draft=draft is not None, calibrated=calibrated,
                                        default_trees=default_trees(rt))
        self.policy.serve(heads_proposers(rt, self.policy, planned), draft)
        self.scheduler = Scheduler(
            rt.engine, rt.tokenizer, self.policy, self.metrics,
            max_batch=cfg.max_batch, max_context=cfg.max_context, max_queue=cfg.max_queue,
            queue_timeout_s=cfg.queue_timeout_s,
            budget=prefill_budget(cfg, cached_curve(rt)), chunked_prefill=cfg.chunked_prefill,
            prefix=ServedPrefixes(self.metrics, parse_megabytes(cfg.prefix_cache_mb), cfg.prefix_cache_block,
                                  rt.engine.model, cfg.max_batch) if cfg.prefix_cache else None)

    # ---- request -> engine requests -----------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model not in (self.name, self.cfg.model):
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.name!r} "
                           "(see GET /v1/models)", "model", "model_not_found")

    def prepare(self, raw: bytes, chat: bool) -> tuple[Any, list[int], int | None, str]:
        """Body bytes -> (request model, prompt token ids, max tokens, the prompt's field name).

        Runs in a worker thread: parsing and tokenising a large body takes long enough to stall streams."""
        tok = self.rt.tokenizer
        if chat:
            body = parse_body(raw, ChatCompletionRequest)
            self.check_model(body.model)
            limit = chat_limit(body)
            return body, chat_prompt(tok, body), limit, "messages"
        body = parse_body(raw, CompletionRequest)
        self.check_model(body.model)
        return body, completion_prompt(tok, self.rt.model.config.vocab_size, body), body.max_tokens, "prompt"

    def make_requests(self, prompt: list[int], body: Any, max_tokens: int | None, param: str,
                      on_event: Callable[[int], Callable[[Event], None]], tag: str = "") -> list[Request]:
        return make_requests(self.cfg, prompt, body, max_tokens, param, on_event, tag)

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(self, token: int) -> str:
        """One token's text, as logprobs report it (cached: top-20 alternatives repeat a lot)."""
        return self.rt.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # ---- the scheduler, seen from a request ---------------------------------------------------------
    def submit(self, reqs: list[Request]) -> None:
        try:
            self.scheduler.admission.submit(*reqs)
        except Overloaded:
            raise self.overloaded(429, "server overloaded: the request queue is full; retry later", "queue_full",
                                  "rate_limit_error") from None

    def cancel(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.scheduler.admission.cancel(r)  # a no-op once finished; frees the row if the client left

    def overloaded(self, status: int, message: str, code: str | None, error_type: str) -> ApiError:
        retry = {"Retry-After": str(self.scheduler.admission.retry_after())}
        return ApiError(status, message, None, code, error_type, retry)

    def failed(self, ev: Event) -> ApiError:
        """The API error of a request the scheduler failed or refused."""
        if ev.status in (429, 503):
            return self.overloaded(ev.status, ev.text, ev.code, ev.error_type)
        return ApiError(ev.status, ev.text, None, ev.code, ev.error_type)
