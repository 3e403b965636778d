"""The ASGI layer in front of the routes: request ids, framing, Host/Origin and API-key checks
(`medusa.serve.edge`), last-resort 500s, response counting."""

from __future__ import annotations

import hmac
import logging
import re
import uuid

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from medusa.serve.edge import HostPolicy, framing_problem, has_body
from medusa.serve.errors import error_body, outcome_of
from medusa.serve.metrics import Metrics

log = logging.getLogger("medusa.serve.app")
UNCOUNTED = ("/health", "/metrics")  # polled by monitors: not requests whose outcome is of interest
# A client's X-Request-Id is echoed (and used in response ids and the log) when it is this plain; anything
# else is replaced by a generated id, so a header cannot inject text into logs or other headers.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
PROTECTED = "/v1/"  # paths that need the API key when one is configured


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

    def __init__(self, app: ASGIApp, metrics: Metrics, api_key: str | None = None,
                 hosts: HostPolicy | None = None):
        self.app, self.metrics, self.api_key = app, metrics, api_key
        self.hosts = hosts or HostPolicy("0.0.0.0", api_key, [], [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        rid = state["request_id"] = request_id_of(scope)
        status = 0
        body_read = not has_body(scope)

        async def watched() -> Message:
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_read = True
            return message

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.setdefault("headers", [])
                headers.append((b"x-request-id", rid.encode()))
                if not body_read and (b"connection", b"close") not in headers:
                    # Answered before the body was read (413, 415, 403, ...): the rest of it would be read
                    # as the next request's bytes, so the connection closes with the response.
                    headers.append((b"connection", b"close"))
            await send(message)

        try:
            await self.guarded(scope, watched, tracked)
        except Exception:
            log.exception("request %s failed", rid)
            state["outcome"] = "server_error"
            if not status:  # nothing sent yet: the client still gets a proper answer
                body = error_body(f"internal server error (request id {rid})", "server_error")
                await JSONResponse(body, 500)(scope, receive, tracked)
        if scope["path"] not in UNCOUNTED:
            self.metrics.responses.labels(state.get("outcome") or outcome_of(status)).inc()

    async def guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, behind unambiguous framing, the Host/Origin allow-list and the API key where one is
        needed."""
        state = scope["state"]
        framing = framing_problem(scope)
        if framing is not None:
            log.info("request %s refused: %s", state["request_id"], framing)
            state["outcome"] = "malformed"
            body = error_body(framing, "invalid_request_error", None, "malformed_request")
            await JSONResponse(body, 400, headers={"Connection": "close"})(scope, receive, send)
            return
        refused = self.hosts.problem(scope)
        if refused is not None:
            log.info("request %s refused: %s", state["request_id"], refused[0])
            body = error_body(refused[0], "invalid_request_error", None, refused[1])
            await JSONResponse(body, 403)(scope, receive, send)
            return
        if self.api_key and scope["path"].startswith(PROTECTED) and not bearer_ok(scope, self.api_key):
            body = error_body("missing or incorrect API key: send `Authorization: Bearer <key>`",
                              "invalid_request_error", None, "invalid_api_key")
            await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        else:
            await self.app(scope, receive, send)
