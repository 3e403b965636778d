"""OpenAI response objects: whole chat or text completions, their stream chunks, and log-probabilities in
OpenAI's two shapes (chat's list of entries, completions' parallel lists)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from medusa.serve.request import Event, TokenLogprob

if TYPE_CHECKING:
    from medusa.serve.server import Server

MIN_LOGPROB = -9999.0  # JSON has no -Infinity: a token the model rules out is reported at this floor


class Choice:
    """What a non-streaming response collects of one choice."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.tokens = 0
        self.finish_reason: str | None = None

    def add(self, ev: Event) -> None:
        self.text += ev.text
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs or []
        self.tokens = ev.tokens
        if ev.kind == "done":
            self.finish_reason = ev.finish_reason


class Shape:
    """Builds OpenAI response objects for one request (chat or text completion, `n` choices)."""

    def __init__(self, server: Server, chat: bool, prompt: list[int], request_id: str, body: Any):
        self.server, self.chat, self.model = server, chat, server.name
        self.prompt, self.prompt_tokens = prompt, len(prompt)
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.want_logprobs = body.logprobs_k() is not None
        self.token_ids = bool(body.return_token_ids)
        self.as_ids = bool(body.return_tokens_as_token_ids)
        self.per_token = self.want_logprobs or self.token_ids  # chunks carry per-token data
        self.offsets: dict[int, int] = {}  # streamed completions: characters of text each choice has sent
        self.sent_prompt: set[int] = set()

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def _head(self, suffix: str) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj + suffix, "created": self.created, "model": self.model}

    # ---- logprobs in OpenAI's two shapes -------------------------------------------------------------
    def _token(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.server.token_text(token)

    def _chat_entry(self, token: int, logprob: float) -> dict:
        text = self._token(token)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return {"content": [{**self._chat_entry(t, lp), "top_logprobs": [self._chat_entry(a, b) for a, b in top]}
                                for t, lp, top in entries], "refusal": None}
        return self._completion_logprobs(entries, offset)

    def _completion_logprobs(self, entries: list[TokenLogprob], offset: int) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in entries:
            text = self._token(t)
            alternatives = {self._token(a): max(b, MIN_LOGPROB) for a, b in top}
            alternatives.setdefault(text, max(lp, MIN_LOGPROB))  # the chosen token is always listed
            out["tokens"].append(text)
            out["token_logprobs"].append(max(lp, MIN_LOGPROB))
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(offset)
            offset += len(self.server.token_text(t))
        return out

    # ---- whole responses and stream chunks -----------------------------------------------------------
    def full(self, choices: list[Choice], cached_tokens: int = 0) -> dict:
        out = [self._full_choice(i, c) for i, c in enumerate(choices)]
        body = {**self._head(""), "choices": out, "usage": self.usage(sum(c.tokens for c in choices), cached_tokens)}
        if self.token_ids and self.chat:
            body["prompt_token_ids"] = self.prompt
        return body

    def _full_choice(self, index: int, c: Choice) -> dict:
        lp = self._logprobs(c.logprobs)
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            if self.token_ids:
                choice["prompt_token_ids"] = self.prompt
        if self.token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def chunk(self, index: int, ev: Event, finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else ({"content": ev.text} if ev.text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": ev.text, "logprobs": None, "finish_reason": finish}
        if ev.token_ids:
            offset = self.offsets.get(index, 0)
            choice["logprobs"] = self._logprobs(ev.logprobs or [], offset)
            self.offsets[index] = offset + len(ev.text)
            if self.token_ids:
                choice["token_ids"] = ev.token_ids
        body = {**self._head(".chunk" if self.chat else ""), "choices": [choice]}
        if self.token_ids and index not in self.sent_prompt and (role or not self.chat):
            self.sent_prompt.add(index)  # the prompt's ids once, in the choice's first chunk
            (body if self.chat else choice)["prompt_token_ids"] = self.prompt
        return body

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {**self._head(".chunk" if self.chat else ""), "choices": [],
                "usage": self.usage(completion_tokens, cached_tokens)}
