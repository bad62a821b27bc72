"""Errors of the admin API: an `ApiError` is an answer, `{"error": {"message", "type", "code"}}`.

One place maps the layers' refusals to answers (`from_refusal`); `error_body` renders them
as an `Error` (the type the OpenAPI document gives every error answer of both listeners).
"""

from __future__ import annotations

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


class ErrorDetail(msgspec.Struct, kw_only=True):
    """What went wrong: `code` is for programs, `message` for people; `param` names the
    field at fault, when one is."""

    message: str
    type: str
    code: str
    param: str | msgspec.UnsetType | None = msgspec.UNSET


class Error(msgspec.Struct, kw_only=True):
    """Every error answer of both listeners, OpenAI style."""

    error: ErrorDetail


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
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "api_error")
    detail = ErrorDetail(message=message, type=kind, code=code)
    if param is not None:
        detail.param = param
    return _encoder.encode(Error(error=detail))


def _field_of(message: str) -> str | None:
    head, sep, _ = message.partition(":")
    return head if sep and head.isidentifier() else None


def from_refusal(exc: Refusal) -> ApiError:
    """The controller's refusal as an answer (a 422 names its field)."""
    param = _field_of(exc.message) if exc.status == 422 else None
    return ApiError(exc.status, exc.code, exc.message, param=param)


# --- routes ---------------------------------------------------------------------------------
