"""Errors of the admin API: an `ApiError` is an answer, `{"error": {"message", "type", "code"}}`.

One place maps the layers' refusals to answers (`from_refusal`); `error_body` renders them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.deployment import Refusal
from gateway.protocol import Headers

_encoder = msgspec.json.Encoder()

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error answer: status, code, message, and the field at fault if one is."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: Headers | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers: Headers = headers or []


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "code"}}`, OpenAI style."""
    err: dict[str, Any] = {
        "message": message,
        "type": _ERROR_TYPES.get(status, "server_error" if status >= 500 else "api_error"),
        "code": code,
    }
    if param is not None:
        err["param"] = param
    return _encoder.encode({"error": err})


def _field_of(message: str) -> str | None:
    head, sep, _ = message.partition(":")
    return head if sep and head.isidentifier() else None


def from_refusal(exc: Refusal) -> ApiError:
    """The controller's refusal as an answer (a 422 names its field)."""
    param = _field_of(exc.message) if exc.status == 422 else None
    return ApiError(exc.status, exc.code, exc.message, param=param)


# --- routes ---------------------------------------------------------------------------------
