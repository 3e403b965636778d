"""What a request must be before any route sees it: unambiguous framing, addressed to this server, from no
foreign web page, and (for a body) JSON.

- Framing: `Transfer-Encoding` together with `Content-Length` is refused (400, connection closed): a proxy
  and this server could disagree on where the request ends (request smuggling, RFC 9112 section 6.3).
- Host and Origin: bound to a loopback address without an API key, the server is reachable only from this
  machine, but a web page the user visits runs on this machine too. A page's cross-origin request carries an
  `Origin` that is not the server's own; a page on a DNS name rebound to 127.0.0.1 sends that name as `Host`.
  Both are refused (403) unless listed (`allowed_hosts`, `cors_origins`).
- Content type: a body must be `application/json` (charset, if given, UTF-8): browsers send `text/plain`,
  form encodings and no type at all without a CORS preflight, so any other type is refused (415).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import Scope

LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lower case), or None."""
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """`Host` without its port, lower case (`[::1]:8000` -> `[::1]`, `LocalHost:80` -> `localhost`)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    name, sep, port = value.rpartition(":")
    return name if sep and port.isdigit() else value


def framing_problem(scope: Scope) -> str | None:
    """Why the request's framing is ambiguous, or None."""
    if header(scope, b"transfer-encoding") is not None and header(scope, b"content-length") is not None:
        return ("request has both Transfer-Encoding and Content-Length; send one (RFC 9112 section 6.3: the "
                "two may frame different requests)")
    return None


def has_body(scope: Scope) -> bool:
    length = header(scope, b"content-length")
    return header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() != "0")


class HostPolicy:
    """The Host/Origin allow-list of a server bound to `bind_host`; active only on loopback without a key."""

    def __init__(self, bind_host: str, api_key: str | None, allowed_hosts: list[str], cors_origins: list[str]):
        self.active = is_loopback(bind_host) and not api_key
        self.hosts = {host_name(h) for h in (*LOCAL_NAMES, bind_host, *allowed_hosts)}
        self.hosts |= {f"[{h}]" for h in self.hosts if ":" in h and not h.startswith("[")}  # bare IPv6 spelling
        self.origins = {o.rstrip("/").lower() for o in cors_origins}

    def problem(self, scope: Scope) -> tuple[str, str] | None:
        """(message, code) when the request must be refused, else None."""
        if not self.active:
            return None
        host = header(scope, b"host")
        if host is not None and host_name(host) not in self.hosts:
            return (f"Host {host[:64]!r} is not this server's name; a server on a loopback address without an "
                    "API key answers only localhost, 127.0.0.1, [::1] and the names given with --allow-host",
                    "host_not_allowed")
        origin = header(scope, b"origin")
        if origin is not None and not self.origin_ok(origin.strip().lower(), (host or "").strip().lower()):
            return (f"requests from the web page at {origin[:64]!r} are not allowed: it is not this server's "
                    "origin and not one given with --cors-origin", "origin_not_allowed")
        return None

    def origin_ok(self, origin: str, host: str) -> bool:
        if origin.rstrip("/") in self.origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed frames, file: and data: pages) and anything odd
        default = {"http": ":80", "https": ":443"}[parts.scheme]
        netloc = parts.netloc if parts.port else parts.netloc + default
        return netloc == (host if host_name(host) != host else host + default)  # same origin as the server


def content_type_problem(value: str | None) -> str | None:
    """Why a request body's `Content-Type` is refused (415), or None for JSON in UTF-8."""
    if value is None:
        return "request has no Content-Type; send the body as JSON with `Content-Type: application/json`"
    media, *params = [p.strip() for p in value.split(";")]
    if media.lower() != "application/json":
        return (f"Content-Type {value[:64]!r} is not supported; send the body as JSON with "
                "`Content-Type: application/json`")
    for param in params:
        name, _, arg = param.partition("=")
        if name.strip().lower() == "charset" and arg.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return f"charset {arg.strip()[:32]!r} is not supported; JSON bodies must be UTF-8"
    return None
