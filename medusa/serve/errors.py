"""Failures as the client sees them: OpenAI's {"error": {"message", "type", "param", "code"}} body with a
4xx/5xx status, and the outcome label each response is counted under."""

from __future__ import annotations

from fastapi.responses import JSONResponse

OUTCOME = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
           408: "client_timeout", 413: "too_large", 415: "unsupported_media_type", 429: "queue_full",
           431: "headers_too_large", 499: "cancelled", 503: "unavailable"}
# Responses counted by their code rather than their status: HTTP framing a proxy could read otherwise
# (Transfer-Encoding with Content-Length, a bad chunk), and waiting too long for a row.
BY_CODE = {(400, "malformed_request"): "malformed", (503, "queue_timeout"): "queue_timeout"}
# Every label `outcome_of` can give (the metrics create them all up front, so each series starts at 0).
OUTCOMES = ("ok", *OUTCOME.values(), *BY_CODE.values(), "server_error", "client_error")


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
    if (status, code) in BY_CODE:
        return BY_CODE[status, code]
    return OUTCOME.get(status, "server_error" if status >= 500 else "client_error")
