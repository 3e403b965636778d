"""Connection deadlines: how long a client may take to send a request's headers, its body, and how long an
idle keep-alive connection stays open. A socket that sends half its headers or half its body is closed
instead of being held open forever (enough of them would exhaust the server's file descriptors).

- headers: uvicorn's h11 protocol with a deadline, armed when a connection opens and when the first byte of
  its next request arrives, disarmed once the request's headers are complete; past it the connection is
  closed (no response: there is no request to answer yet).
- body: `read_body` (medusa.serve.body) answers 408 when the body is not complete in time.
- keep-alive idle: uvicorn's own `timeout_keep_alive`.
- head size: the request line and headers may take `max_header_bytes`, counted the same whether they arrive
  in one write or in many (h11 checks only a head still incomplete, so one large write used to pass): past
  it, 431 and the connection is closed.
- malformed framing (a chunk size that is not one, ...): h11 refuses it and uvicorn answers 400 and closes;
  here the request in progress learns why, so it is counted and logged as malformed, not as a client that
  went away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from medusa.serve.errors import error_body

log = logging.getLogger("medusa.serve.app")
HEAD_END = re.compile(rb"\r?\n\r?\n")


LINGER_S = 2.0  # after an answer that closes the connection, unread request bytes are drained this long


class Lingering:
    """The connection's transport, closed the way RFC 9112 section 9.6 asks: the answer is flushed and the
    write side shut, then what the client still sends (the rest of a refused body or head) is read and
    dropped until it closes its side, for at most LINGER_S. Closing at once, with unread bytes, resets the
    connection, and a reset can destroy the answer before the client reads it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self.lingering = False

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        self.lingering = True
        if not self._transport.can_write_eof():
            self._transport.close()
            return
        self._transport.write_eof()
        self._transport.resume_reading()
        self._loop.call_later(LINGER_S, self._transport.close)

    def abort(self) -> None:
        self._transport.close()


class HeaderDeadline(H11Protocol):
    """H11Protocol that closes a connection whose request headers are not complete within `header_timeout_s`
    of its first byte (or of connecting)."""

    header_timeout_s = 10.0
    max_header_bytes = 16384
    refused: Callable[[str], None] = staticmethod(lambda outcome: None)  # counts a response the app never saw
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(Lingering(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            return  # the answer is out: the rest of what the client sends is dropped
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # still reading headers (of the first or of a next request)
        else:
            self._disarm()  # the headers of the request in progress are in (or the connection is done)

    def _head_too_large(self, data: bytes) -> bool:
        """Refuse a request head over max_header_bytes (431, connection closed); True when refused."""
        head = self.conn.trailing_data[0] + data  # bytes of this head so far (h11 holds them until complete)
        end = HEAD_END.search(head)
        if (end.end() if end else len(head)) <= self.max_header_bytes:
            return False
        message = f"request line and headers exceed this server's limit of {self.max_header_bytes} bytes"
        log.info("refused request from %s: %s", self._peer(), message)
        self._answer(431, "Request Header Fields Too Large", message, "headers_too_large")
        self.refused("headers_too_large")
        return True

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (called while handling h11's error)."""
        exc = sys.exc_info()[1]
        why = str(exc)[:120] if exc is not None else msg
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
        log.info("closing connection from %s: malformed HTTP request (%s)", self._peer(), why)
        if cycle is not None:
            cycle.scope["state"]["malformed"] = why  # the request in progress ends as malformed
            if cycle.response_started:
                self.transport.close()
                return
        else:
            self.refused("malformed")
        self._answer(400, "Bad Request", f"malformed HTTP request: {why}", "malformed_request")

    def _answer(self, status: int, reason: str, message: str, code: str) -> None:
        """Write an error response and close: for requests h11 has no (complete) request event for."""
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body))
        self.transport.close()

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "client"

    def on_response_complete(self) -> None:
        self._disarm()  # idle again: the keep-alive timeout applies
        super().on_response_complete()

    def eof_received(self) -> bool | None:
        if self.transport.lingering:  # the client has read the answer and closed its side
            self.transport.abort()
            return None
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closing connection from %s: request headers not complete within %g s",
                     self._peer(), self.header_timeout_s)
            self.transport.close()


def uvicorn_config(app, cfg, **kwargs):
    """uvicorn.Config for `app` with the server config's connection deadlines (extra uvicorn options in
    kwargs: host, port, log_level, ...)."""
    import uvicorn

    server = getattr(getattr(app, "state", None), "server", None)
    counted = {"refused": staticmethod(lambda outcome: server.metrics.responses.labels(outcome).inc())} if server else {}
    protocol = type("HeaderDeadlineProtocol", (HeaderDeadline,), {
        "header_timeout_s": cfg.header_timeout_s, "max_header_bytes": cfg.max_header_bytes, **counted})
    # h11's own limit (on a head still incomplete) as a backstop: pipelined heads, chunk headers, trailers.
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=cfg.keepalive_timeout_s,
                          h11_max_incomplete_event_size=cfg.max_header_bytes, **kwargs)
