"""One completion request from prepared input to response: its choices queued, the first result awaited
(so queue timeouts and errors still get a real status), then the scheduler's events gathered into one
response or written as server-sent events; either way the request is cancelled once its client has gone."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from medusa.serve.errors import error_body, outcome_of
from medusa.serve.request import Event, Request
from medusa.serve.responses import Choice, Shape
from medusa.serve.server import Server

POLL_S = 0.25  # how often a waiting handler checks whether its client is still connected
Item = tuple[int, Event]  # (choice index, event)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ClientWatch:
    """Hands out a request's scheduler events and notices, at least every POLL_S, a client that left."""

    def __init__(self, http: HttpRequest, events: asyncio.Queue):
        self.http, self.events = http, events
        self.checked = time.monotonic()

    async def next(self) -> Item | None:
        """The next (choice index, event), or None once the client has disconnected."""
        while True:
            # Checked on a clock, not only when idle: a busy request gets events every step.
            if time.monotonic() - self.checked >= POLL_S:
                self.checked = time.monotonic()
                if await self.http.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(self.events.get(), POLL_S)
            except asyncio.TimeoutError:
                pass


async def respond(server: Server, http: HttpRequest, body: Any, prompt: list[int], max_tokens: int | None,
                  param: str, chat: bool) -> Response:
    """The response to a prepared request (see `Server.prepare`)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Item] = asyncio.Queue()

    def on_event(i: int) -> Any:
        return lambda ev: loop.call_soon_threadsafe(events.put_nowait, (i, ev))

    shape = Shape(server, chat, prompt, http.state.request_id, body)
    reqs = server.make_requests(prompt, body, max_tokens, param, on_event, http.state.request_id)
    server.submit(reqs)
    watch = ClientWatch(http, events)
    first = await watch.next()
    if first is None:
        server.cancel(reqs)
        return Response(status_code=499)
    if first[1].kind == "error":
        server.cancel(reqs)
        raise server.failed(first[1])
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(http, server, watch, reqs, first, shape, usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await collect(server, watch, reqs, first, shape)


def cached(reqs: list[Request]) -> int:
    """Prompt tokens served from the prefix cache (the prompt is counted once for all `n` choices, and so
    is this: the most any choice was served)."""
    return max((r.cached_tokens for r in reqs), default=0)


async def collect(server: Server, watch: ClientWatch, reqs: list[Request], first: Item, shape: Shape) -> Response:
    """The whole response once every choice has finished (499 when the client left first)."""
    choices = [Choice() for _ in reqs]
    item: Item | None = first
    while True:
        if item is None:
            server.cancel(reqs)
            return Response(status_code=499)
        i, ev = item
        if ev.kind == "error":
            server.cancel(reqs)
            raise server.failed(ev)
        choices[i].add(ev)
        if all(c.finish_reason for c in choices):
            return JSONResponse(shape.full(choices, cached(reqs)))
        item = await watch.next()


async def stream(http: HttpRequest, server: Server, watch: ClientWatch, reqs: list[Request], first: Item,
                 shape: Shape, usage: bool) -> AsyncIterator[str]:
    """The response as server-sent events: a chunk per event, `data: [DONE]` once every choice finished."""
    http.state.outcome = "cancelled"  # until the stream ends one way or the other
    tokens = [0] * len(reqs)
    finished = 0
    try:
        if shape.chat:
            for i in range(len(reqs)):
                yield sse(shape.chunk(i, Event("delta"), role=True))
        item: Item | None = first
        while item is not None:
            i, ev = item
            if ev.kind == "error":
                http.state.outcome = outcome_of(ev.status, ev.code)
                yield sse(error_body(ev.text, ev.error_type, None, ev.code))
                break
            tokens[i] = ev.tokens
            if ev.text or (ev.token_ids and shape.per_token):
                yield sse(shape.chunk(i, ev))
            if ev.kind == "done":
                yield sse(shape.chunk(i, Event("delta"), ev.finish_reason))
                finished += 1
                if finished == len(reqs):
                    if usage:
                        yield sse(shape.usage_chunk(sum(tokens), cached(reqs)))
                    yield "data: [DONE]\n\n"
                    http.state.outcome = "ok"
                    break
            item = await watch.next()
    finally:
        server.cancel(reqs)
