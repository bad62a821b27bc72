"""Pure empty answers for LiteLLM health probes, shaped like each endpoint's real answer."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.classify import Endpoint

_encode = msgspec.json.Encoder().encode


def _chat(model: str, now: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-dgxmm-health",
        "object": "chat.completion",
        "created": now,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def _completion(model: str, now: int) -> dict[str, Any]:
    return {
        "id": "cmpl-dgxmm-health",
        "object": "text_completion",
        "created": now,
        "model": model,
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def _response(model: str, now: int) -> dict[str, Any]:
    return {
        "id": "resp_dgxmm_health",
        "object": "response",
        "created_at": now,
        "status": "completed",
        "model": model,
        "output": [],
        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
    }


def _message(model: str, now: int) -> dict[str, Any]:
    return {
        "id": "msg_dgxmm_health",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


def _embedding(model: str, now: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [],
        "model": model,
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }


def _audio(model: str, now: int) -> dict[str, Any]:
    return {"text": ""}


def _rerank(model: str, now: int) -> dict[str, Any]:
    return {
        "id": "rerank-dgxmm-health",
        "model": model,
        "results": [],
        "usage": {"total_tokens": 0},
    }


def _score(model: str, now: int) -> dict[str, Any]:
    return {
        "id": "score-dgxmm-health",
        "object": "list",
        "created": now,
        "model": model,
        "data": [],
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }


_BODIES = {
    Endpoint.CHAT: _chat,
    Endpoint.CHAT_BATCH: _chat,
    Endpoint.COMPLETIONS: _completion,
    Endpoint.RESPONSES: _response,
    Endpoint.MESSAGES: _message,
    Endpoint.EMBEDDINGS: _embedding,
    Endpoint.TRANSCRIPTIONS: _audio,
    Endpoint.TRANSLATIONS: _audio,
    Endpoint.RERANK: _rerank,
    Endpoint.SCORE: _score,
}


def _sse(event: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + _encode(data) + b"\n\n"


def empty_stream(endpoint: Endpoint, model: str, now: int) -> bytes:
    """An empty streamed answer (complete SSE body) for chat, completions, responses, messages."""
    if endpoint is Endpoint.CHAT or endpoint is Endpoint.COMPLETIONS:
        answer = _BODIES[endpoint](model, now)
        choice = answer["choices"][0]
        if endpoint is Endpoint.CHAT:
            answer["object"] = "chat.completion.chunk"
            choice["delta"] = choice.pop("message")
        del answer["usage"]
        return _sse(None, answer) + b"data: [DONE]\n\n"
    if endpoint is Endpoint.RESPONSES:
        done = _response(model, now)
        started = dict(done, status="in_progress")
        return _sse("response.created", {"type": "response.created", "response": started}) + _sse(
            "response.completed", {"type": "response.completed", "response": done}
        )
    if endpoint is Endpoint.MESSAGES:
        message = _message(model, now)
        start = dict(message, stop_reason=None)
        return (
            _sse("message_start", {"type": "message_start", "message": start})
            + _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": 0},
                },
            )
            + _sse("message_stop", {"type": "message_stop"})
        )
    return empty_answer(endpoint, model, now)


def empty_answer(endpoint: Endpoint, model: str, now: int) -> bytes:
    """An empty non-streamed answer of the endpoint's shape (JSON)."""
    return _encode(_BODIES[endpoint](model, now))


def is_streamable(endpoint: Endpoint) -> bool:
    """Whether `empty_stream` gives an event stream (else it is plain JSON)."""
    return endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES)
