"""Failures as the client sees them: OpenAI's {"error": {"message", "type", "param", "code"}} body with a
4xx/5xx status, and the outcome label each response is counted under."""

from __future__ import annotations

from fastapi.responses import JSONResponse

OUTCOME = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
           408: "client_timeout", 413: "too_large", 429: "queue_full", 499: "cancelled", 503: "unavailable"}
# Every label `outcome_of` can give (the metrics create them all up front, so each series starts at 0).
OUTCOMES = ("ok", *OUTCOME.values(), "queue_timeout", "server_error", "client_error")


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
