"""Request bodies checked at the edge, before anything reaches the engine: content type (415), size (413),
UTF-8 without a byte order mark, JSON syntax, duplicate keys, nesting depth and text encoding, then the
request model's types and bounds (400)."""

from __future__ import annotations

import codecs
import json
import logging
from typing import Any

import anyio
from fastapi import Request as HttpRequest
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from medusa.io import problem
from medusa.serve.edge import content_type_problem
from medusa.serve.errors import ApiError

MAX_JSON_DEPTH = 16  # the deepest valid body is 5 levels (messages -> message -> content -> part)
log = logging.getLogger("medusa.serve.app")
MAX_PARAM_ECHO = 64  # characters of a client-chosen field name quoted back in an error


async def read_body(http: HttpRequest, limit: int, timeout_s: float) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes, with 408 when it
    is not complete within `timeout_s`; a client that disconnects before sending it all has cancelled its
    request (499: counted as cancelled, logged as one line, never a server error)."""
    media = content_type_problem(http.headers.get("content-type"))
    if media is not None:
        raise ApiError(415, media, None, "unsupported_media_type")
    too_large = ApiError(413, f"request body is larger than this server's limit of {limit} bytes", None,
                         "request_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in http.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body not complete within {timeout_s:g} s", None, "body_timeout") from None
    except ClientDisconnect:
        malformed = http.scope.get("state", {}).get("malformed")
        if malformed:  # h11 refused the framing (uvicorn answered 400 and closed): not the client leaving
            raise ApiError(400, f"malformed HTTP request: {malformed}", None, "malformed_request") from None
        log.info("request %s cancelled: the client disconnected after %d body bytes",
                 http.scope.get("state", {}).get("request_id", "?"), size)
        raise ApiError(499, "client disconnected before the request body was complete", None,
                       "client_disconnected") from None
    return b"".join(chunks)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refusing a key given twice (json keeps the last; another parser the first)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ApiError(400, f"duplicate key {key[:MAX_PARAM_ECHO]!r} in the request body: each key may appear "
                       "once per object", key[:MAX_PARAM_ECHO] or None)
    return obj


def decode_utf8(raw: bytes) -> str:
    """The body as text: UTF-8 without a byte order mark (json.loads would guess UTF-16/32 and skip a BOM)."""
    if raw.startswith((codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise ApiError(400, "request body starts with a byte order mark; send JSON as UTF-8 without one")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                       "(JSON bodies must be UTF-8)") from None


def load_json(raw: bytes) -> Any:
    """json.loads, with every way the input can be malformed as a 400 (including NaN/Infinity, which
    Python accepts but JSON does not, duplicate keys, text that is not UTF-8, and nesting too deep for the
    parser)."""
    text = decode_utf8(raw)
    try:
        data = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ApiError(400, f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, bad UTF-8, over-long integers
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    check_json(data)
    return data


def check_json(data: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and text that is not valid Unicode (JSON's `\\ud800`
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
        raise invalid_request(exc) from None


def invalid_request(exc: ValidationError) -> ApiError:
    """A 400 naming the first problem's field (in `param`) and how many more there are."""
    # In a union every member reports; a bound that failed says more than "not a string".
    errors = exc.errors()
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    key, msg = problem(err, drop=_is_type_tag)
    param = key[:MAX_PARAM_ECHO] or None
    if err["type"] == "extra_forbidden":
        msg = f"unknown field {param!r} (not supported by this server)"
    elif err["type"] == "missing":
        msg = f"missing required field {param!r}"
    else:
        msg = f"invalid value for {param!r}: {msg}"
    extra = len(errors) - 1
    return ApiError(400, msg + (f" (and {extra} more problems)" if extra else ""), param)


def _is_type_tag(part: str) -> bool:
    """pydantic puts the union member tried (`str`, `list[int]`, `function-after[...]`) into `loc`."""
    return part in ("str", "int", "float", "bool") or "[" in part or part.startswith("constrained-")
