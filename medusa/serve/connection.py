"""Connection deadlines: how long a client may take to send a request's headers, its body, and how long an
idle keep-alive connection stays open. A socket that sends half its headers or half its body is closed
instead of being held open forever (enough of them would exhaust the server's file descriptors).

- headers: uvicorn's h11 protocol with a deadline, armed when a connection opens and when the first byte of
  its next request arrives, disarmed once the request's headers are complete; past it the connection is
  closed (no response: there is no request to answer yet).
- body: `read_body` (medusa.serve.body) answers 408 when the body is not complete in time.
- keep-alive idle: uvicorn's own `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("medusa.serve.app")


class HeaderDeadline(H11Protocol):
    """H11Protocol that closes a connection whose request headers are not complete within `header_timeout_s`
    of its first byte (or of connecting)."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers of the request in progress are in
        else:
            self._arm()  # still reading headers (of the first or of a next request)

    def on_response_complete(self) -> None:
        self._disarm()  # idle again: the keep-alive timeout applies
        super().on_response_complete()

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
            log.info("closing connection from %s: request headers not complete within %.0f s",
                     "%s:%d" % self.client if self.client else "client", self.header_timeout_s)
            self.transport.close()


def uvicorn_config(app, cfg, **kwargs):
    """uvicorn.Config for `app` with the server config's connection deadlines (extra uvicorn options in
    kwargs: host, port, log_level, ...)."""
    import uvicorn

    protocol = type("HeaderDeadlineProtocol", (HeaderDeadline,), {"header_timeout_s": cfg.header_timeout_s})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=cfg.keepalive_timeout_s, **kwargs)
