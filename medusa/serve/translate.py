"""HTTP request bodies -> engine requests: the prompt's token ids (chat template or completion prompt),
the token budget checked against the context, and one scheduler request per choice."""

from __future__ import annotations

from typing import Any, Callable

import jinja2

from medusa.decoding.target.chat import chat_ids, has_chat_template
from medusa.decoding.sampling import SamplingParams
from medusa.errors import MedusaError
from medusa.serve.config import ServeConfig
from medusa.serve.errors import ApiError
from medusa.serve.protocol import ChatCompletionRequest, CompletionRequest, choice_seed, torch_seed
from medusa.serve.request import Event, Request


def chat_prompt(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    if not has_chat_template(tokenizer):
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in body.messages]
    try:
        return chat_ids(tokenizer, messages)
    except jinja2.TemplateError as exc:  # the template refuses the input (e.g. the role order)
        raise ApiError(400, f"messages could not be formatted with the chat template: {exc}",
                       "messages") from None


def completion_prompt(tokenizer: Any, vocab_size: int, body: CompletionRequest) -> list[int]:
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], int):
        if min(p) < 0 or max(p) >= vocab_size:
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        return list(p)
    text = p[0] if isinstance(p, list) else p
    return list(tokenizer(text)["input_ids"])


def chat_limit(body: ChatCompletionRequest) -> int | None:
    """The completion token limit of a chat request: max_tokens or its newer name, not both."""
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
    return body.max_tokens if body.max_tokens is not None else body.max_completion_tokens


def completion_budget(cfg: ServeConfig, prompt: list[int], max_tokens: int | None, param: str) -> int:
    """Tokens the request may generate: its max_tokens, or the default cut to what the context leaves."""
    if not prompt:
        raise ApiError(400, "the prompt is empty", param)
    room = cfg.max_context - len(prompt)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; this server's context is "
                       f"{cfg.max_context} tokens", param, "context_length_exceeded")
    if max_tokens is None:
        return min(cfg.default_max_tokens, room)
    if max_tokens > room:
        raise ApiError(400, f"max_tokens {max_tokens} + prompt {len(prompt)} tokens exceeds this "
                       f"server's context of {cfg.max_context} tokens", "max_tokens", "context_length_exceeded")
    return max_tokens


def sampling_of(body: Any, index: int) -> SamplingParams:
    """Choice `index`'s sampling; with a seed, it samples with `choice_seed(seed, index)`."""
    seed = None if body.seed is None else torch_seed(choice_seed(body.seed, index))
    try:
        return SamplingParams(temperature=body.temperature or 0.0, top_p=body.top_p or 1.0,
                              top_k=body.top_k or 0, seed=seed)
    except MedusaError as exc:
        raise ApiError(400, str(exc), "temperature") from None


def make_requests(cfg: ServeConfig, prompt: list[int], body: Any, max_tokens: int | None, param: str,
                  on_event: Callable[[int], Callable[[Event], None]], tag: str = "") -> list[Request]:
    """The request's `n` choices, each a batch row; `on_event(i)` is the callback of choice i."""
    n = body.n or 1
    if n > cfg.max_batch + cfg.max_queue:  # could never be admitted together: not worth a retry
        raise ApiError(400, f"n = {n} choices exceed what this server can hold at once "
                       f"({cfg.max_batch} rows + {cfg.max_queue} queued)", "n")
    limit = completion_budget(cfg, prompt, max_tokens, param)
    reqs = []
    for i in range(n):
        req = Request(prompt, limit, on_event(i), sampling_of(body, i), body.stop_list(), tag=tag)
        req.logprobs = body.logprobs_k()
        reqs.append(req)
    return reqs
