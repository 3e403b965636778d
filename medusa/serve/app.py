"""The HTTP layer: OpenAI-shaped endpoints over the scheduler.

POST /v1/chat/completions, /v1/completions (JSON or SSE streaming), GET /v1/models, /health, /metrics.
Every failure is answered as {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status. With
an API key configured, /v1/* needs `Authorization: Bearer <key>` (401 otherwise); /health and /metrics stay
open for monitors.

Input is checked at the edge, before anything reaches the engine: body size (413), JSON syntax, nesting
depth and text encoding, then the request model's types and bounds (400). Parsing, tokenisation and chat
template rendering run in a worker thread, so a large prompt never holds up the event loop that writes
every stream. An unexpected exception becomes a 500 that names a request id (the log has the traceback);
exception text never reaches the client.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import re
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
import jinja2
from fastapi import FastAPI, Request as HttpRequest
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from medusa.errors import MedusaError
from medusa.runtime.gate import bucket
from medusa.runtime import Runtime
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.tree import Tree, chain, load_tree

from medusa.serve.config import ServeConfig
from medusa.serve.metrics import Metrics
from medusa.serve.policy import CostModel, Decision, SpeculationPolicy
from medusa.serve.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, choice_seed, torch_seed
from medusa.serve.scheduler import Event, Overloaded, Request, Scheduler, TokenLogprob

log = logging.getLogger("medusa.serve.app")
POLL_S = 0.25  # how often a waiting handler checks whether its client is still connected
MAX_JSON_DEPTH = 16  # the deepest valid body is 5 levels (messages -> message -> content -> part)
MAX_PARAM_ECHO = 64  # characters of a client-chosen field name quoted back in an error
UNCOUNTED = ("/health", "/metrics")  # polled by monitors: not requests whose outcome is of interest
OUTCOME = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
           413: "too_large", 429: "queue_full", 499: "cancelled", 503: "unavailable"}
# A client's X-Request-Id is echoed (and used in response ids and the log) when it is this plain; anything
# else is replaced by a generated id, so a header cannot inject text into logs or other headers.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
PROTECTED = "/v1/"  # paths that need the API key when one is configured
MIN_LOGPROB = -9999.0  # JSON has no -Infinity: a token the model rules out is reported at this floor


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type, self.headers = error_type, headers


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.error_type, exc.param, exc.code), exc.status,
                        headers=exc.headers)


def outcome_of(status: int, code: str | None = None) -> str:
    """The `medusa_responses_total` label of a response."""
    if 200 <= status < 300:
        return "ok"
    if status == 503 and code == "queue_timeout":
        return code
    return OUTCOME.get(status, "server_error" if status >= 500 else "client_error")


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]


def request_id_of(scope: Scope) -> str:
    """The client's X-Request-Id when it is short and plain, else a new one."""
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if CLIENT_REQUEST_ID.fullmatch(text) else new_request_id()
    return new_request_id()


def bearer_ok(scope: Scope, key: str) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            # Constant time: the comparison must not tell an attacker how much of a guess was right.
            return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
    return False


class Guard:
    """ASGI wrapper around the routes: gives each request an id (`X-Request-Id`: the client's, if it sent a
    plain one, else a new one), checks the API key on /v1/* when one is set, turns any exception that
    escaped the handlers into an OpenAI-shaped 500 naming that id (the traceback goes to the log, not the
    client; and the connection stays usable, where the stock handler re-raises into the server), and
    counts every response by outcome."""

    def __init__(self, app: ASGIApp, metrics: Metrics, api_key: str | None = None):
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        rid = state["request_id"] = request_id_of(scope)
        status = 0

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", rid.encode()))
            await send(message)

        try:
            if self.api_key and scope["path"].startswith(PROTECTED) and not bearer_ok(scope, self.api_key):
                body = error_body("missing or incorrect API key: send `Authorization: Bearer <key>`",
                                  "invalid_request_error", None, "invalid_api_key")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, tracked)
            else:
                await self.app(scope, receive, tracked)
        except Exception:
            log.exception("request %s failed", rid)
            state["outcome"] = "server_error"
            if not status:  # nothing sent yet: the client still gets a proper answer
                body = error_body(f"internal server error (request id {rid})", "server_error")
                await JSONResponse(body, 500)(scope, receive, tracked)
        if scope["path"] not in UNCOUNTED:
            self.metrics.responses.labels(state.get("outcome") or outcome_of(status)).inc()


def calibrated_policy(cfg: ServeConfig, rt: Runtime, draft: Any) -> tuple[CostModel | None, dict[str, Tree]]:
    """The dynamic policy's defaults from this machine's calibrated curve and the heads' accuracy (the
    plans `--mode auto` makes), with the trees they name; nothing when a cost_model file decides, the
    policy is fixed, a draft is served, or the heads carry no eval.json to predict from."""
    pc = cfg.policy
    if pc.mode != "dynamic" or pc.cost_model or not pc.calibrate or draft is not None or rt.heads is None:
        return None, {}
    auto = rt.auto(cfg.max_batch)
    if auto is None or not auto.predicted:
        return None, {}
    plans = [auto.plan(1 << i) for i in range(bucket(cfg.max_batch).bit_length())]
    for p in plans:
        log.info("calibrated policy at batch size %d: %s (%s)", p.batch, p.tree.name if p.tree else "plain", p.reason)
    return CostModel.from_plans(plans), {p.tree.name: p.tree for p in plans if p.tree is not None}


def tree_by_name(name: str, heads_dir: Path | None = None) -> Tree:
    """A shipped/file tree (`tree-16`, a path) or `chain-K`: the heads' top-1 tokens only, K deep (what pays
    when the heads are weak or a tree costs too much)."""
    m = re.fullmatch(r"chain-(\d+)", name)
    if m:
        if not 1 <= int(m.group(1)) <= 16:
            raise MedusaError(f"policy.trees: {name}: chain depth must be 1..16")
        return chain(int(m.group(1)))
    try:
        return load_tree(name, heads_dir=heads_dir)
    except MedusaError as exc:
        raise MedusaError(f"policy.trees: {exc}") from None


def served_name(cfg: ServeConfig, rt: Runtime) -> str:
    if cfg.served_model_name:
        return cfg.served_model_name
    name = str(getattr(rt.hf_model, "name_or_path", "") or cfg.model)
    return Path(name).name if Path(name).exists() else name


class Server:
    """Everything a running server holds: runtime, policy, proposers, scheduler, metrics."""

    def __init__(self, cfg: ServeConfig, rt: Runtime, draft: Any = None):
        self.cfg, self.rt = cfg, rt
        self.name = served_name(cfg, rt)
        self.api_key = cfg.api_key or os.environ.get("MEDUSA_API_KEY") or None
        self.metrics = Metrics()
        calibrated, planned = calibrated_policy(cfg, rt, draft)
        self.policy = SpeculationPolicy(cfg.policy, has_medusa=rt.heads is not None, has_draft=draft is not None,
                                        calibrated=calibrated)
        # Build every proposer up front: a bad tree name or a heads/tree mismatch fails at startup.
        self.medusa = {}
        if rt.heads is not None:
            for name in sorted(set(self.policy.trees.values())):
                tree = planned.get(name) or tree_by_name(name, rt.heads.directory)
                self.medusa[name] = rt.proposer("medusa", tree)
        self.draft = draft
        sizes = [p.tree.size for p in self.medusa.values()] + ([draft.tree.size] if draft is not None else [])
        self.scheduler = Scheduler(
            rt.engine, rt.tokenizer, self.policy, self.proposer_for, self.metrics,
            max_batch=cfg.max_batch, max_context=cfg.max_context, max_queue=cfg.max_queue,
            queue_timeout_s=cfg.queue_timeout_s, prefill_tokens_per_step=cfg.prefill_tokens_per_step,
            max_proposal_tokens=max(sizes, default=1))

    def proposer_for(self, decision: Decision) -> Any:
        if decision.mode == "medusa":
            return self.medusa.get(decision.tree)
        if decision.mode == "draft":
            return self.draft
        return None

    # ---- request -> engine request ------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model not in (self.name, self.cfg.model):
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.name!r} "
                           "(see GET /v1/models)", "model", "model_not_found")

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.rt.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except jinja2.TemplateError as exc:  # the template refuses the input (e.g. the role order)
            raise ApiError(400, f"messages could not be formatted with the chat template: {exc}",
                           "messages") from None
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        return list(ids)

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            vocab = self.rt.model.config.vocab_size
            if min(p) < 0 or max(p) >= vocab:
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            return list(p)
        text = p[0] if isinstance(p, list) else p
        return list(self.rt.tokenizer(text)["input_ids"])

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(self, token: int) -> str:
        """One token's text, as logprobs report it (cached: top-20 alternatives repeat a lot)."""
        return self.rt.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def make_requests(self, prompt: list[int], body: Any, max_tokens: int | None, param: str,
                      on_event: Callable[[int], Callable[[Event], None]], tag: str = "") -> list[Request]:
        """The request's `n` choices, each a batch row; `on_event(i)` is the callback of choice i. With a
        seed, choice i samples with `choice_seed(seed, i)`."""
        n = body.n or 1
        if n > self.cfg.max_batch + self.cfg.max_queue:  # could never be admitted together: not worth a retry
            raise ApiError(400, f"n = {n} choices exceed what this server can hold at once "
                           f"({self.cfg.max_batch} rows + {self.cfg.max_queue} queued)", "n")
        reqs = []
        for i in range(n):
            req = self.make_request(prompt, body, max_tokens, param, on_event(i), tag, index=i)
            req.logprobs = body.logprobs_k()
            reqs.append(req)
        return reqs

    def make_request(self, prompt: list[int], body: Any, max_tokens: int | None, param: str,
                     on_event: Any, tag: str = "", index: int = 0) -> Request:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param)
        room = self.cfg.max_context - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this server's context is "
                           f"{self.cfg.max_context} tokens", param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.cfg.default_max_tokens, room)
        elif max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + prompt {len(prompt)} tokens exceeds this "
                           f"server's context of {self.cfg.max_context} tokens", "max_tokens",
                           "context_length_exceeded")
        try:
            sampling = SamplingParams(temperature=body.temperature or 0.0, top_p=body.top_p or 1.0,
                                      top_k=body.top_k or 0,
                                      seed=None if body.seed is None else torch_seed(choice_seed(body.seed, index)))
        except MedusaError as exc:
            raise ApiError(400, str(exc), "temperature") from None
        return Request(prompt, max_tokens, on_event, sampling, body.stop_list(), tag=tag)

    def prepare(self, raw: bytes, chat: bool) -> tuple[Any, list[int], int | None, str]:
        """Body bytes -> (request model, prompt token ids, max tokens, the prompt's field name).

        Runs in a worker thread: parsing and tokenising a large body takes long enough to stall streams."""
        if chat:
            body = parse_body(raw, ChatCompletionRequest)
            self.check_model(body.model)
            if body.max_tokens is not None and body.max_completion_tokens is not None:
                raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
            limit = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
            return body, self.chat_prompt(body), limit, "messages"
        body = parse_body(raw, CompletionRequest)
        self.check_model(body.model)
        return body, self.completion_prompt(body), body.max_tokens, "prompt"


async def read_body(http: HttpRequest, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    too_large = ApiError(413, f"request body is larger than this server's limit of {limit} bytes", None,
                         "request_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_json(raw: bytes) -> Any:
    """json.loads, with every way the input can be malformed as a 400 (including NaN/Infinity, which
    Python accepts but JSON does not, and nesting too deep for the parser)."""
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise ApiError(400, f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, bad UTF-8, over-long integers
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    check_json(data)
    return data


def check_json(data: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and text that is not valid Unicode (JSON's `\ud800`
    escapes decode to lone surrogates, which no tokenizer or UTF-8 writer accepts)."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):  # a number, bool or null at the top
            continue
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                           _param(path))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(item, (str, dict, list)):  # numbers are the bulk of a token-id prompt: skip fast
                stack.append((item, depth + 1, path + (key,)))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"invalid text in {_param(path) or 'the request body'}: character {exc.start} is "
                       "a lone UTF-16 surrogate (not valid Unicode)", _param(path)) from None


def _param(path: tuple) -> str | None:
    return ".".join(str(p) for p in path)[:MAX_PARAM_ECHO] or None


def parse_body(raw: bytes, model: type) -> Any:
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # In a union every member reports; a bound that failed says more than "not a string".
        errors = exc.errors()
        err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        loc = [str(x) for x in err["loc"] if not _is_type_tag(str(x))]
        param = ".".join(loc)[:MAX_PARAM_ECHO] or None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field {param!r} (not supported by this server)"
        elif err["type"] == "missing":
            msg = f"missing required field {param!r}"
        else:
            msg = f"invalid value for {param!r}: {msg}"
        extra = len(exc.errors()) - 1
        raise ApiError(400, msg + (f" (and {extra} more problems)" if extra else ""), param) from None


def _is_type_tag(part: str) -> bool:
    """pydantic puts the union member tried (`str`, `list[int]`, `function-after[...]`) into `loc`."""
    return part in ("str", "int", "float", "bool") or "[" in part or part.startswith("constrained-")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ClientWatch:
    """Hands out a request's scheduler events and notices, at least every POLL_S, a client that left."""

    def __init__(self, http: HttpRequest, events: asyncio.Queue):
        self.http, self.events = http, events
        self.checked = time.monotonic()

    async def next(self) -> tuple[int, Event] | None:
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


def create_app(cfg: ServeConfig, rt: Runtime | None = None, draft: Any = None) -> FastAPI:
    """The FastAPI app; builds the runtime from `cfg` unless one is given (tests pass tiny models)."""
    if rt is None:
        rt = Runtime.load(cfg.model, cfg.heads, cfg.dtype, cfg.device)
    if draft is None and cfg.draft:
        draft = load_draft(cfg, rt)
    server = Server(cfg, rt, draft)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        yield
        server.scheduler.stop()

    docs = cfg.docs
    app = FastAPI(title="medusa", lifespan=lifespan, openapi_url="/openapi.json" if docs else None,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    app.state.server = server
    app.add_middleware(Guard, metrics=server.metrics, api_key=server.api_key)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]

    @app.exception_handler(ApiError)
    async def _api_error(http: HttpRequest, exc: ApiError) -> JSONResponse:
        http.state.outcome = outcome_of(exc.status, exc.code)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)

    @app.get("/health", responses={503: {"description": "the decoding engine failed and has not recovered"}})
    async def health() -> Response:
        running, queued = server.scheduler.load
        body = {"status": "ok", "model": server.name, "running": running, "queued": queued,
                "steps": server.scheduler.steps}
        fault = server.scheduler.fault
        if fault is not None:
            return JSONResponse({**body, "status": "unhealthy", "error": fault}, 503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                            "owned_by": "medusa"}]}

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest), responses=ERRORS)
    async def chat(http: HttpRequest) -> Response:
        return await handle(http, chat=True)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest), responses=ERRORS)
    async def completions(http: HttpRequest) -> Response:
        return await handle(http, chat=False)

    async def handle(http: HttpRequest, chat: bool) -> Response:
        raw = await read_body(http, cfg.max_body_bytes)
        body, prompt, limit, param = await anyio.to_thread.run_sync(server.prepare, raw, chat)
        return await run(http, body, prompt, limit, param, chat)

    def overloaded(status: int, message: str, code: str | None, error_type: str) -> ApiError:
        retry = {"Retry-After": str(server.scheduler.retry_after())}
        return ApiError(status, message, None, code, error_type, retry)

    def failed(ev: Event) -> ApiError:
        if ev.status in (429, 503):
            return overloaded(ev.status, ev.text, ev.code, ev.error_type)
        return ApiError(ev.status, ev.text, None, ev.code, ev.error_type)

    async def run(http: HttpRequest, body: Any, prompt: list[int], max_tokens: int | None, param: str,
                  chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def on_event(i: int) -> Any:
            return lambda ev: loop.call_soon_threadsafe(events.put_nowait, (i, ev))

        shape = Shape(server, chat, prompt, http.state.request_id, body)
        reqs = server.make_requests(prompt, body, max_tokens, param, on_event, http.state.request_id)
        try:
            server.scheduler.submit(*reqs)
        except Overloaded:
            raise overloaded(429, "server overloaded: the request queue is full; retry later", "queue_full",
                             "rate_limit_error") from None
        # Wait for the first result before answering, so queue timeouts and errors get a real status.
        watch = ClientWatch(http, events)
        first = await watch.next()
        if first is None:
            cancel_all(reqs)
            return Response(status_code=499)
        if first[1].kind == "error":
            cancel_all(reqs)
            raise failed(first[1])
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(http, watch, reqs, first, shape, usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        choices = [Choice() for _ in reqs]
        item: tuple[int, Event] | None = first
        while True:
            if item is None:
                cancel_all(reqs)
                return Response(status_code=499)
            i, ev = item
            if ev.kind == "error":
                cancel_all(reqs)
                raise failed(ev)
            choices[i].add(ev)
            if all(c.finish_reason for c in choices):
                return JSONResponse(shape.full(choices))
            item = await watch.next()

    def cancel_all(reqs: list[Request]) -> None:
        for r in reqs:
            server.scheduler.cancel(r)  # a no-op once finished; frees the row if the client left

    async def stream(http: HttpRequest, watch: ClientWatch, reqs: list[Request], first: tuple[int, Event],
                     shape: "Shape", usage: bool) -> AsyncIterator[str]:
        http.state.outcome = "cancelled"  # until the stream ends one way or the other
        tokens = [0] * len(reqs)
        finished = 0
        try:
            if shape.chat:
                for i in range(len(reqs)):
                    yield sse(shape.chunk(i, Event("delta"), role=True))
            item: tuple[int, Event] | None = first
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
                            yield sse(shape.usage_chunk(sum(tokens)))
                        yield "data: [DONE]\n\n"
                        http.state.outcome = "ok"
                        break
                item = await watch.next()
        finally:
            cancel_all(reqs)

    return app


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what} for status, what in (
        (400, "invalid request (the field is in `param`)"), (404, "unknown model"),
        (413, "request body too large"), (429, "request queue full (see Retry-After)"),
        (500, "internal error (the message names a request id)"),
        (503, "no batch row within queue_timeout_s (see Retry-After)"))}


def request_body(model: type) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that reads its body itself (to bound its size and parse it in a
    worker thread), so the schema still documents it."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI schema with the request models added under components (served at
    /openapi.json only with `docs: true`; tests and tools can always call `app.openapi()`)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


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

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

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
    def full(self, choices: list[Choice]) -> dict:
        out = []
        for i, c in enumerate(choices):
            lp = self._logprobs(c.logprobs)
            if self.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                          "finish_reason": c.finish_reason}
            else:
                choice = {"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
                if self.token_ids:
                    choice["prompt_token_ids"] = self.prompt
            if self.token_ids:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        body = {**self._head(""), "choices": out, "usage": self.usage(sum(c.tokens for c in choices))}
        if self.token_ids and self.chat:
            body["prompt_token_ids"] = self.prompt
        return body

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

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._head(".chunk" if self.chat else ""), "choices": [], "usage": self.usage(completion_tokens)}


def load_draft(cfg: ServeConfig, rt: Runtime) -> Any:
    """A draft-model proposer for `draft` speculation: `default` (the shipped draft of the embedded
    model), `layers:N` (the target's first N layers), a `medusa train-draft` directory or an HF model
    sharing the target's tokenizer."""
    try:
        from medusa.decoding.draft import DraftProposer, load_draft as load_draft_model
    except ImportError:
        raise MedusaError("--draft: draft-model speculation is not available (medusa.decoding.draft is missing)") from None
    draft = load_draft_model(cfg.draft, rt.hf_model)
    if draft.config.vocab_size != rt.model.config.vocab_size:
        raise MedusaError(f"--draft: {cfg.draft} has a vocabulary of {draft.config.vocab_size}, the target "
                          f"{rt.model.config.vocab_size}; the draft must share the target's tokenizer")
    return DraftProposer(draft, cfg.draft_k)
