"""The HTTP layer: OpenAI-shaped endpoints over the scheduler.

POST /v1/chat/completions, /v1/completions (JSON or SSE streaming), GET /v1/models, /health, /metrics.
Every failure is answered as {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status. With
an API key configured, /v1/* needs `Authorization: Bearer <key>` (401 otherwise); /health and /metrics stay
open for monitors.

Input is checked at the edge, before anything reaches the engine: framing, Host and Origin
(`medusa.serve.edge`: 400, 403), content type (415), body size (413), UTF-8, JSON syntax, duplicate keys,
nesting depth and text encoding, then the request model's types and bounds (400). Parsing, tokenisation and chat
template rendering run in a worker thread, so a large prompt never holds up the event loop that writes
every stream. An unexpected exception becomes a 500 that names a request id (the log has the traceback);
exception text never reaches the client.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request as HttpRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from medusa.runtime import Runtime
from medusa.serve.body import read_body
from medusa.serve.config import ServeConfig
from medusa.serve.edge import HostPolicy
from medusa.serve.errors import ApiError, error_body, error_response, outcome_of
from medusa.serve.guard import Guard
from medusa.serve.proposers import load_draft
from medusa.serve.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from medusa.serve.server import Server
from medusa.serve.stream import respond

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what} for status, what in (
        (400, "invalid request (the field is in `param`)"), (403, "Host or Origin not allowed"),
        (404, "unknown model"), (413, "request body too large"), (415, "body not sent as application/json"), (429, "request queue full (see Retry-After)"),
        (500, "internal error (the message names a request id)"),
        (503, "no batch row within queue_timeout_s (see Retry-After)"))}


class App(FastAPI):
    """The server's FastAPI app: its OpenAPI schema also documents the request bodies routes read themselves."""

    def openapi(self) -> dict[str, Any]:
        return openapi_schema(self)


def create_app(cfg: ServeConfig, rt: Runtime | None = None, draft: Any = None) -> FastAPI:
    """The FastAPI app; builds the runtime from `cfg` unless one is given (tests pass tiny models)."""
    if rt is None:
        rt = Runtime.load(cfg.model, cfg.heads, cfg.dtype, cfg.device, cfg.retrieval, cfg.datastore,
                          batch_invariant=cfg.batch_invariant)
    if draft is None and cfg.draft:
        draft = load_draft(cfg, rt)
    server = Server(cfg, rt, draft)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        yield
        server.scheduler.stop()

    docs = cfg.docs
    app = App(title="medusa", lifespan=lifespan, openapi_url="/openapi.json" if docs else None,
              docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    app.state.server = server
    hosts = HostPolicy(cfg.host, server.api_key, cfg.allowed_hosts, cfg.cors_origins)
    app.add_middleware(Guard, metrics=server.metrics, api_key=server.api_key, hosts=hosts)
    if cfg.cors_origins:  # outermost: preflights are answered before the key check (they carry no key)
        app.add_middleware(CORSMiddleware, allow_origins=cfg.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-request-id"],
                           expose_headers=["x-request-id", "retry-after"])
    add_error_handlers(app)
    add_routes(app, server)
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(http: HttpRequest, exc: ApiError) -> JSONResponse:
        http.state.outcome = outcome_of(exc.status, exc.code)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)


def add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health", responses={503: {"description": "the decoding engine failed and has not recovered"}})
    async def health() -> Response:
        running, queued = server.scheduler.load
        body = {"status": "ok", "model": server.name, "running": running, "queued": queued,
                "steps": server.scheduler.steps}
        fault = server.scheduler.fault
        if fault is not None:
            return JSONResponse({**body, "status": "unhealthy", "error": fault}, 503)
        return JSONResponse(body)

    # HEAD answers as GET does, without the body (monitors that probe with HEAD); not in the schema.
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                            "owned_by": "medusa"}]}

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest), responses=ERRORS)
    async def chat(http: HttpRequest) -> Response:
        return await handle(server, http, chat=True)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest), responses=ERRORS)
    async def completions(http: HttpRequest) -> Response:
        return await handle(server, http, chat=False)


async def handle(server: Server, http: HttpRequest, chat: bool) -> Response:
    """A completion route: the body read within its size limit, prepared in a worker thread, answered."""
    raw = await read_body(http, server.cfg.max_body_bytes, server.cfg.body_timeout_s)
    body, prompt, limit, param = await anyio.to_thread.run_sync(server.prepare, raw, chat)
    return await respond(server, http, body, prompt, limit, param, chat)


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
