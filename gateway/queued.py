"""Pure text and bytes the gateway adds to answers: the queued line, its chunk, error bodies.

Error bodies are OpenAI-style `{"error": {"message", "type", "code"}}`; their text must never
contain "rate limit" or "invalid_request_error" (LiteLLM would remap them to 429/400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from actors import admission
from gateway.classify import Endpoint
from gateway.protocol import Headers

QUEUED_LINE = (
    "⏳ Your message is queued — waiting for memory to free up for {model}. "
    "It will start automatically."
)
RETRY_AFTER_S = admission.RETRY_AFTER_S
DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
JSON_HEADERS: Headers = [(b"content-type", b"application/json")]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def queued_text(model: str) -> str:
    """The queued line for `model`, followed by a blank line."""
    return QUEUED_LINE.format(model=model) + "\n\n"


def queued_chunk(endpoint: Endpoint, model: str, served_model: str, rid: str, now: int) -> bytes:
    """The one SSE event a queued streaming chat/completions request gets at once."""
    text = queued_text(model)
    event: dict[str, Any]
    if endpoint is Endpoint.CHAT:
        event = {
            "id": f"chatcmpl-queued-{rid}",
            "object": "chat.completion.chunk",
            "created": now,
            "model": served_model,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
    elif endpoint is Endpoint.COMPLETIONS:
        event = {
            "id": f"cmpl-queued-{rid}",
            "object": "text_completion",
            "created": now,
            "model": served_model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
        }
    else:
        raise ValueError(f"no queued chunk for {endpoint.value}")
    return b"data: " + _encode(event) + b"\n\n"


def _prefix_chat(answer: dict[str, Any], text: str) -> bool:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None:
        message["content"] = text
    elif isinstance(content, str):
        message["content"] = text + content
    else:
        return False
    return True


def _prefix_completion(answer: dict[str, Any], text: str) -> bool:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    current = choices[0].get("text")
    if not isinstance(current, str):
        return False
    choices[0]["text"] = text + current
    return True


def _prefix_response(answer: dict[str, Any], text: str) -> bool:
    output = answer.get("output")
    if not isinstance(output, list):
        return False
    for item in output:
        if not isinstance(item, dict) or not isinstance(item.get("content"), list):
            continue
        for part in item["content"]:
            if isinstance(part, dict) and part.get("type") == "output_text":
                if not isinstance(part.get("text"), str):
                    return False
                part["text"] = text + part["text"]
                return True
    return False


_PREFIXERS = {
    Endpoint.CHAT: _prefix_chat,
    Endpoint.COMPLETIONS: _prefix_completion,
    Endpoint.RESPONSES: _prefix_response,
}


def may_prefix(endpoint: Endpoint | None) -> bool:
    """Whether answers of this endpoint can carry the queued line when not streamed."""
    return endpoint in _PREFIXERS


def prefix_answer(endpoint: Endpoint, body: bytes, model: str) -> bytes | None:
    """The answer with the queued line in front of its text, or None to leave it unchanged."""
    prefixer = _PREFIXERS.get(endpoint)
    if prefixer is None:
        return None
    try:
        answer = _decode(body)
    except msgspec.MsgspecError:
        return None
    if not isinstance(answer, dict) or not prefixer(answer, queued_text(model)):
        return None
    return _encode(answer)


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An OpenAI-style error answer: status, code, message, optional Retry-After."""

    status: int
    code: str
    message: str
    retry_after: int | None = None

    def body(self) -> bytes:
        """The JSON error body, typed by its status: OpenAI's (and LiteLLM's mapping)
        `invalid_request_error` for a 4xx, the seed's `server_error` for the rest."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return error_body(self.code, self.message, kind)

    def headers(self) -> Headers:
        """Content-Type, and Retry-After when set."""
        if self.retry_after is None:
            return list(JSON_HEADERS)
        return [*JSON_HEADERS, (b"retry-after", str(self.retry_after).encode())]

    def sse(self) -> bytes:
        """The error as the final events of a stream whose status line already went out."""
        return sse_error(self.code, self.message)


def error_body(code: str, message: str, kind: str = "server_error") -> bytes:
    """`{"error": {"message", "type": "server_error", "code"}}` (or another type)."""
    return _encode({"error": {"message": message, "type": kind, "code": code}})


def sse_error(code: str, message: str) -> bytes:
    """`data: {"error": ...}` followed by `data: [DONE]`."""
    return b"data: " + error_body(code, message) + b"\n\n" + DONE_EVENT


def stream_error(endpoint: Endpoint | None, code: str, message: str) -> bytes:
    """The final event of a stream that fails after its status line, in the stream's own
    format: the Responses API and Anthropic messages have typed `error` events and no
    `[DONE]`; chat, completions and the rest get `data: {"error": ...}` and `data: [DONE]`."""
    event: dict[str, Any]
    if endpoint is Endpoint.RESPONSES:
        event = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + _encode(event) + b"\n\n"
    if endpoint is Endpoint.MESSAGES:
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + _encode(event) + b"\n\n"
    return sse_error(code, message)


def queue_timeout(model: str) -> ErrorReply:
    """The seed's queue-timeout error (503, Retry-After: 60), as the controller words it."""
    refused = admission.queue_timeout(model)
    return ErrorReply(refused.status, refused.code, refused.message, refused.retry_after)


def not_ready(model: str) -> ErrorReply:
    """GET /v1/models/<id> while the model does not run."""
    return ErrorReply(503, "ondemand_not_ready", f"model {model} is not running right now")


def too_large(limit: int) -> ErrorReply:
    """A request body over the cap (audio uploads included)."""
    return ErrorReply(
        413, "request_too_large", f"request body is larger than {limit // (1024 * 1024)} MiB"
    )


def bad_body(message: str) -> ErrorReply:
    """A request body the gateway cannot read (JSON nested too deeply: `BodyTooDeep`)."""
    return ErrorReply(400, "invalid_json", message)


def deployment_not_found(segment: str) -> ErrorReply:
    """No deployment with this id or name behind the gateway."""
    return ErrorReply(
        404,
        "deployment_not_found",
        f"no deployment {segment}: the path is /d/<deployment id or name>/v1/...",
    )


def model_not_found(named: str, served: str) -> ErrorReply:
    """A request for a model this deployment does not serve (OpenAI's code)."""
    return ErrorReply(
        404,
        "model_not_found",
        f"the model {named} does not exist here; this deployment serves {served}",
    )


def route_not_found(method: str, path: str) -> ErrorReply:
    """An endpoint the gateway does not pass to engines."""
    return ErrorReply(404, "not_found", f"{method} {path} is not served by the on-demand gateway")


def engine_error(status: int, code: str, message: str) -> ErrorReply:
    """The engine could not be reached or failed before its answer began."""
    return ErrorReply(status, code, message)
