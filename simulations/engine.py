"""A simulated OpenAI-compatible inference engine, faithful to vLLM, llama.cpp and SGLang.

Run it as `python -m simulations.engine --flavour vllm --model m --port 8000`, or in-process
with `await serve(SimOptions(...))`.  It mimics each engine where DGXMM can tell the
difference (see notes/engines.md): how it starts (connection refused, 503 while loading or
warming up), its `/health`, `/metrics` and 404 bodies, vLLM's sleep endpoints, and the
streaming formats of chat/completions, completions, the Responses API and Anthropic
messages.  Answers are deterministic for a given request body, so a test can compare the
bytes seen through a proxy with the bytes seen directly.

The rendering functions are pure and build the whole answer before a byte is written; the
connection task only parses (h11), routes, waits for a slot and writes.  It is used in
benchmarks, so the hot path decodes the body once, renders from pre-encoded pieces and
writes one buffer per chunk followed by `drain()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import os
import re
import signal
import socket
import sys
import zlib
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import h11
import msgspec

Flavour = Literal["vllm", "llamacpp", "sglang"]
FLAVOURS: tuple[Flavour, ...] = ("vllm", "llamacpp", "sglang")

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
READ_SIZE = 64 * 1024
MAX_TOKENS_CAP = 100_000
CREATED = 1735000000  # fixed, so that answers are byte-for-byte deterministic
MAX_MODEL_LEN = 8192
EMBEDDING_DIMS = 8

_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_encode = msgspec.json.encode
_decode = msgspec.json.decode


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """How one simulated engine behaves; the CLI flags map one to one."""

    flavour: Flavour = "vllm"
    model: str = "sim-model"
    host: str = "127.0.0.1"
    port: int = 0
    startup_delay_s: float = 0.0
    warmup_delay_s: float | None = None  # sglang's 503 warm-up; None: 10% of the start-up
    fail_at_start: str | None = None
    crash_after: int | None = None
    token_delay_s: float = 0.0
    tokens: int = 16
    max_running: int = 256
    audio: bool = True
    embeddings: bool = True
    metrics: bool = False  # llama.cpp --metrics / SGLang --enable-metrics (vLLM: always on)
    data_parallel_size: int = 1  # vLLM `engine` / SGLang `dp_rank` label values
    tp_size: int = 1  # SGLang repeats its gauges per `tp_rank`

    @property
    def warmup_s(self) -> float:
        """SGLang's warm-up: explicit, or a tenth of the start-up delay."""
        if self.warmup_delay_s is not None:
            return self.warmup_delay_s
        return 0.1 * self.startup_delay_s


class Phase(enum.Enum):
    """Where the simulated engine is in its life."""

    LOADING = "loading"  # vLLM/SGLang: not listening; llama.cpp: 503 "Loading model"
    WARMING = "warming"  # SGLang: listening, /health 503
    READY = "ready"
    FAILED = "failed"  # --fail-at-start
    CRASHED = "crashed"  # --crash-after
    CLOSED = "closed"


@dataclass(frozen=True)
class SimStatistics:
    """A snapshot of what the engine is doing, for tests and benchmarks."""

    phase: Phase
    running: int
    waiting: int
    inference_requests: int
    connections: int
    sleeping: bool


# --------------------------------------------------------------------------- answers


_SSE_UTF8 = b"text/event-stream; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Full:
    """A complete answer with a content length."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"


@dataclass(frozen=True, slots=True)
class Stream:
    """A server-sent event stream; each frame is written and drained on its own."""

    frames: list[bytes]
    content_type: bytes = _SSE_UTF8


Answer = Full | Stream


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with one inference request."""

    answer: Answer
    generates: bool  # runs under a load slot, counts as a request, may crash
    pause_s: float = 0.0  # non-streaming: generation time before the answer is written


_JSON_UTF8 = b"application/json; charset=utf-8"
_NOT_FOUND_DETAIL = Full(404, b'{"detail":"Not Found"}')
_NOT_ALLOWED_DETAIL = Full(405, b'{"detail":"Method Not Allowed"}')
_LLAMA_NOT_FOUND = Full(
    404,
    b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}',
    _JSON_UTF8,
)
_LLAMA_LOADING = Full(
    503,
    b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}',
    _JSON_UTF8,
)
_LLAMA_OK = Full(200, b'{"status":"ok"}', _JSON_UTF8)
_EMPTY_OK = Full(200, b"", b"application/json")
_SGLANG_UNHEALTHY = Full(503, b"", b"application/json")


def not_found(flavour: Flavour) -> Full:
    """The flavour's answer to an unknown path."""
    return _LLAMA_NOT_FOUND if flavour == "llamacpp" else _NOT_FOUND_DETAIL


def error(flavour: Flavour, status: int, message: str, kind: str | None = None) -> Full:
    """An error body in the flavour's own format."""
    if flavour == "llamacpp":
        err_type = kind or {
            400: "invalid_request_error",
            404: "not_found_error",
            501: "not_supported_error",
            503: "unavailable_error",
        }.get(status, "server_error")
        body = {"error": {"message": message, "type": err_type, "code": status}}
        return Full(status, _encode(body), _JSON_UTF8)
    err_type = kind or {
        400: "BadRequestError",
        404: "NotFoundError",
        413: "BadRequestError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError")
    if flavour == "sglang":
        flat = {"object": "error", "message": message, "type": err_type, "param": None}
        return Full(status, _encode({**flat, "code": status}))
    nested = {"message": message, "type": err_type, "param": None, "code": status}
    return Full(status, _encode({"error": nested}))


# --------------------------------------------------------------------------- generation

_TEXT = (
    "Hello from the simulated engine. Every answer is made of these same words, picked by"
    " a checksum of the prompt, so the same request always gets the same bytes!"
)
_WORDS = tuple(re.findall(r" ?\w+|[.,!]", _TEXT))  # "Hello", " from", ..., "."
_WORDS_JSON = tuple(_encode(w) for w in _WORDS)


@dataclass(frozen=True, slots=True)
class Generation:
    """The deterministic output for one request."""

    seed: int
    words: tuple[int, ...]  # indexes into _WORDS
    finish_length: bool  # cut by max_tokens
    prompt_tokens: int

    @property
    def text(self) -> str:
        """The whole generated text."""
        return "".join(_WORDS[i] for i in self.words)

    @property
    def completion_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.words)

    def usage(self) -> dict[str, int]:
        """OpenAI-style usage counts."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
        }


def generate(prompt: bytes, limit: object, tokens: int) -> Generation:
    """The tokens answering `prompt`: `tokens` of them, fewer when `limit` (max_tokens) says so.

    Like greedy decoding, the same prompt always gives the same text, streamed or not, and
    a smaller limit gives a prefix of it.
    """
    seed = zlib.crc32(prompt)
    n = min(tokens, MAX_TOKENS_CAP)
    cut = False
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit < n:
        n, cut = limit, True
    start = seed % len(_WORDS)
    words = tuple((start + i) % len(_WORDS) for i in range(n))
    return Generation(seed, words, cut, 1 + len(prompt) // 8)


def _sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _timings(g: Generation, token_delay_s: float) -> dict[str, float | int]:
    predicted_ms = max(g.completion_tokens * token_delay_s * 1000.0, 0.001)
    return {
        "prompt_n": g.prompt_tokens,
        "prompt_ms": 1.0,
        "prompt_per_token_ms": 1.0 / g.prompt_tokens,
        "prompt_per_second": 1000.0 * g.prompt_tokens,
        "predicted_n": g.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(g.completion_tokens, 1),
        "predicted_per_second": 1000.0 * g.completion_tokens / predicted_ms,
    }


def chat_answer(
    flavour: Flavour, model: str, g: Generation, stream: bool, usage_chunk: bool, delay: float
) -> Answer:
    """chat/completions: a chat.completion object, or its chunk stream ending in [DONE]."""
    cid = f"chatcmpl-{g.seed:08x}"
    finish = "length" if g.finish_length else "stop"
    if flavour == "llamacpp":
        return _llama_chat(model, cid, g, stream, usage_chunk, finish, delay)
    if not stream:
        message = {"role": "assistant", "content": g.text, "tool_calls": []}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None}
        choice["finish_reason"] = finish
        choice["stop_reason" if flavour == "vllm" else "matched_stop"] = None
        body = {
            "id": cid,
            "object": "chat.completion",
            "created": CREATED,
            "model": model,
            "choices": [choice],
            "usage": g.usage(),
        }
        return Full(200, _encode(body))
    head = (
        b'data: {"id":"'
        + cid.encode()
        + b'","object":"chat.completion.chunk","created":'
        + str(CREATED).encode()
        + b',"model":'
        + _encode(model)
        + b',"choices":[{"index":0,"delta":'
    )
    open_tail = b',"logprobs":null,"finish_reason":null}]}\n\n'
    last_tail = b',"logprobs":null,"finish_reason":"' + finish.encode() + b'"}]}\n\n'
    frames = [head + b'{"role":"assistant","content":""}' + open_tail]
    count = len(g.words)
    for pos, index in enumerate(g.words):
        delta = b'{"content":' + _WORDS_JSON[index] + b"}"
        tail = last_tail if pos == count - 1 and flavour == "vllm" else open_tail
        frames.append(head + delta + tail)
    if flavour == "sglang" or count == 0:
        frames.append(head + b"{}" + last_tail)
    if usage_chunk:
        chunk = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "choices": [],
            "usage": g.usage(),
        }
        frames.append(_sse(_encode(chunk)))
    frames.append(_DONE)
    return Stream(frames)


def _llama_chat(
    model: str,
    cid: str,
    g: Generation,
    stream: bool,
    usage_chunk: bool,
    finish: str,
    delay: float,
) -> Answer:
    tail_fields: dict[str, Any] = {
        "created": CREATED,
        "id": cid,
        "model": model,
        "system_fingerprint": "b6500-sim",
    }
    if not stream:
        choice = {
            "finish_reason": finish,
            "index": 0,
            "message": {"role": "assistant", "content": g.text},
        }
        body = {
            "choices": [choice],
            **tail_fields,
            "object": "chat.completion",
            "usage": g.usage(),
            "timings": _timings(g, delay),
        }
        return Full(200, _encode(body), _JSON_UTF8)
    head = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":'
    tail = (
        b'}],"created":'
        + str(CREATED).encode()
        + b',"id":"'
        + cid.encode()
        + b'","model":'
        + _encode(model)
        + b',"system_fingerprint":"b6500-sim","object":"chat.completion.chunk"}\n\n'
    )
    frames = [head + b'{"role":"assistant","content":null}' + tail]
    frames.extend(head + b'{"content":' + _WORDS_JSON[i] + b"}" + tail for i in g.words)
    last: dict[str, Any] = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": {}}],
        **tail_fields,
        "object": "chat.completion.chunk",
    }
    if usage_chunk:
        last["usage"] = g.usage()
    last["timings"] = _timings(g, delay)
    frames.append(_sse(_encode(last)))
    frames.append(_DONE)
    return Stream(frames, b"text/event-stream")


def completion_answer(
    flavour: Flavour, model: str, g: Generation, stream: bool, usage_chunk: bool, delay: float
) -> Answer:
    """completions: a text_completion object, or its chunk stream ending in [DONE]."""
    cid = f"cmpl-{g.seed:08x}"
    finish = "length" if g.finish_length else "stop"
    ctype = _JSON_UTF8 if flavour == "llamacpp" else b"application/json"
    if not stream:
        choice = {"index": 0, "text": g.text, "logprobs": None, "finish_reason": finish}
        body: dict[str, Any] = {
            "id": cid,
            "object": "text_completion",
            "created": CREATED,
            "model": model,
            "choices": [choice],
            "usage": g.usage(),
        }
        if flavour == "llamacpp":
            body["timings"] = _timings(g, delay)
        return Full(200, _encode(body), ctype)
    head = (
        b'data: {"id":"'
        + cid.encode()
        + b'","object":"text_completion","created":'
        + str(CREATED).encode()
        + b',"model":'
        + _encode(model)
        + b',"choices":[{"index":0,"text":'
    )
    open_tail = b',"logprobs":null,"finish_reason":null}]}\n\n'
    frames = [head + _WORDS_JSON[i] + open_tail for i in g.words]
    last: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": CREATED,
        "model": model,
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish}],
    }
    if flavour == "llamacpp":
        last["timings"] = _timings(g, delay)
    frames.append(_sse(_encode(last)))
    if usage_chunk:
        usage = {**last, "choices": [], "usage": g.usage()}
        usage.pop("timings", None)
        frames.append(_sse(_encode(usage)))
    frames.append(_DONE)
    return Stream(frames, b"text/event-stream" if flavour == "llamacpp" else _SSE_UTF8)


def responses_answer(model: str, g: Generation, stream: bool, max_output_tokens: object) -> Answer:
    """Responses API: a response object, or its event stream (no [DONE])."""
    rid = f"resp_{g.seed:08x}"
    mid = f"msg_{g.seed:08x}"
    text = g.text
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {
        "id": mid,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [part],
    }
    usage = {
        "input_tokens": g.prompt_tokens,
        "output_tokens": g.completion_tokens,
        "total_tokens": g.prompt_tokens + g.completion_tokens,
    }

    def response(status: str, output: list[Any], use: dict[str, int] | None) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "response",
            "created_at": CREATED,
            "status": status,
            "model": model,
            "output": output,
            "max_output_tokens": max_output_tokens,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "usage": use,
        }

    if not stream:
        return Full(200, _encode(response("completed", [item], usage)))
    seq = 0
    frames: list[bytes] = []

    def add(name: str, **fields: Any) -> None:
        nonlocal seq
        frames.append(_event(name, {"type": name, "sequence_number": seq, **fields}))
        seq += 1

    where: dict[str, Any] = {"item_id": mid, "output_index": 0, "content_index": 0}
    add("response.created", response=response("in_progress", [], None))
    add("response.in_progress", response=response("in_progress", [], None))
    add(
        "response.output_item.added",
        output_index=0,
        item={**item, "status": "in_progress", "content": []},
    )
    add("response.content_part.added", **where, part={**part, "text": ""})
    for i in g.words:
        add("response.output_text.delta", **where, delta=_WORDS[i], logprobs=[])
    add("response.output_text.done", **where, text=text, logprobs=[])
    add("response.content_part.done", **where, part=part)
    add("response.output_item.done", output_index=0, item=item)
    add("response.completed", response=response("completed", [item], usage))
    return Stream(frames)


def messages_answer(flavour: Flavour, model: str, g: Generation, stream: bool) -> Answer:
    """Anthropic messages: a message object, or message_start … message_stop."""
    mid = f"msg_{g.seed:08x}"
    stop_reason = "max_tokens" if g.finish_length else "end_turn"
    if not stream:
        body = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": g.text}],
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": g.prompt_tokens, "output_tokens": g.completion_tokens},
        }
        return Full(200, _encode(body))
    start: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": g.prompt_tokens, "output_tokens": 0},
    }
    frames = [
        _event("message_start", {"type": "message_start", "message": start}),
        _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
    ]
    delta_head = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":'
    )
    frames.extend(delta_head + _WORDS_JSON[i] + b"}}\n\n" for i in g.words)
    frames.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
    frames.append(
        _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": g.completion_tokens},
            },
        )
    )
    frames.append(_event("message_stop", {"type": "message_stop"}))
    if flavour == "vllm":
        frames.append(_DONE)
    return Stream(frames)


def _unit(seed: int, salt: int) -> float:
    return (zlib.crc32(salt.to_bytes(4, "little"), seed) & 0xFFFF) / 65535.0


def embeddings_answer(flavour: Flavour, model: str, body: dict[str, Any]) -> Full:
    """embeddings: one deterministic vector per input."""
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        inputs: list[Any] = [raw]
    elif isinstance(raw, list) and raw:
        inputs = raw
    else:
        return error(flavour, 400, "input must be a string or a non-empty list")
    data = []
    for index, item in enumerate(inputs):
        seed = zlib.crc32(_encode(item))
        vector = [round(_unit(seed, d) - 0.5, 6) for d in range(EMBEDDING_DIMS)]
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = sum(1 + len(_encode(i)) // 8 for i in inputs)
    answer = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return Full(200, _encode(answer), _JSON_UTF8 if flavour == "llamacpp" else b"application/json")


def _score(a: str, b: str) -> float:
    return round(_unit(zlib.crc32(a.encode()), zlib.crc32(b.encode())), 6)


def _doc_text(doc: object) -> str | None:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        return str(doc["text"])
    return None


def rerank_answer(flavour: Flavour, model: str, body: dict[str, Any]) -> Full:
    """rerank: documents ordered by a deterministic relevance score."""
    query, docs = body.get("query"), body.get("documents")
    texts = [_doc_text(d) for d in docs] if isinstance(docs, list) else []
    if not isinstance(query, str) or not texts or any(t is None for t in texts):
        return error(flavour, 400, "rerank needs a query and a list of documents")
    scored = sorted(
        ((i, str(t), _score(query, str(t))) for i, t in enumerate(texts)), key=lambda r: -r[2]
    )
    top_n = body.get("top_n")
    if isinstance(top_n, int) and top_n > 0:
        scored = scored[:top_n]
    tokens = 1 + (len(query) + sum(len(str(t)) for t in texts)) // 4
    if flavour == "llamacpp":
        results: list[dict[str, Any]] = [{"index": i, "relevance_score": s} for i, _, s in scored]
        llama = {
            "model": model,
            "object": "list",
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }
        return Full(200, _encode(llama), _JSON_UTF8)
    results = [{"index": i, "document": {"text": t}, "relevance_score": s} for i, t, s in scored]
    answer = {
        "id": f"rerank-{zlib.crc32(query.encode()):08x}",
        "model": model,
        "usage": {"total_tokens": tokens},
        "results": results,
    }
    return Full(200, _encode(answer))


def score_answer(flavour: Flavour, model: str, body: dict[str, Any]) -> Full:
    """score: one deterministic score per (text_1, text_2) pair."""
    left, right = body.get("text_1"), body.get("text_2")
    lefts = [left] if isinstance(left, str) else left
    rights = [right] if isinstance(right, str) else right
    if not isinstance(lefts, list) or not isinstance(rights, list) or not rights:
        return error(flavour, 400, "score needs text_1 and text_2")
    if len(lefts) == 1:
        lefts = lefts * len(rights)
    if len(lefts) != len(rights) or not all(isinstance(t, str) for t in lefts + rights):
        return error(flavour, 400, "text_1 and text_2 must be strings or lists of equal length")
    data = [
        {"index": i, "object": "score", "score": _score(a, b)}
        for i, (a, b) in enumerate(zip(lefts, rights, strict=True))
    ]
    tokens = 1 + sum(len(a) + len(b) for a, b in zip(lefts, rights, strict=True)) // 4
    answer = {
        "id": f"score-{zlib.crc32(_encode(body)):08x}",
        "object": "list",
        "created": CREATED,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return Full(200, _encode(answer))


def batch_answer(model: str, body: bytes, convs: list[Any], tokens: int) -> Full:
    """chat/completions/batch: one choice per conversation in `messages`."""
    choices = []
    usage = {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0}
    for index, conv in enumerate(convs):
        g = generate(_encode(conv), None, tokens)
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": g.text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
            }
        )
        for key, value in g.usage().items():
            usage[key] += value
    answer = {
        "id": f"chatcmpl-{zlib.crc32(body):08x}",
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    return Full(200, _encode(answer))


def transcription_answer(flavour: Flavour, body: bytes, content_type: bytes, tokens: int) -> Full:
    """audio/transcriptions and translations: {"text": ...} for a multipart upload."""
    if not content_type.lower().startswith(b"multipart/form-data"):
        return error(flavour, 400, "audio requests must be multipart/form-data")
    return Full(200, _encode({"text": generate(body, None, tokens).text}))


def tokenize_answer(flavour: Flavour, body: dict[str, Any]) -> Full:
    """tokenize: deterministic token ids for the prompt (vLLM) or content (llama.cpp)."""
    source = body.get("content" if flavour == "llamacpp" else "prompt")
    if source is None and "messages" in body:
        source = _encode(body["messages"]).decode()
    if not isinstance(source, str):
        return error(flavour, 400, "nothing to tokenize")
    ids = [zlib.crc32(w.encode()) % 32000 for w in source.split()]
    if flavour == "llamacpp":
        return Full(200, _encode({"tokens": ids}), _JSON_UTF8)
    vllm = {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    return Full(200, _encode(vllm))


def model_card(flavour: Flavour, model: str) -> dict[str, Any]:
    """One entry of /v1/models."""
    owner = {"vllm": "vllm", "llamacpp": "llamacpp", "sglang": "sglang"}[flavour]
    card: dict[str, Any] = {"id": model, "object": "model", "created": CREATED, "owned_by": owner}
    if flavour == "vllm":
        card.update(root=model, parent=None, max_model_len=MAX_MODEL_LEN)
    elif flavour == "sglang":
        card["max_model_len"] = MAX_MODEL_LEN
    else:
        card["meta"] = {"n_ctx_train": MAX_MODEL_LEN, "n_params": 1_000_000}
    return card


def models_answer(flavour: Flavour, model: str) -> Full:
    """GET /v1/models."""
    body = {"object": "list", "data": [model_card(flavour, model)]}
    return Full(200, _encode(body), _JSON_UTF8 if flavour == "llamacpp" else b"application/json")


def metrics_text(
    flavour: Flavour, model: str, load: Sequence[tuple[int, int]], tp_size: int
) -> bytes:
    """/metrics in the flavour's Prometheus exposition; `load` is (running, waiting) per rank."""
    lines: list[str] = []
    if flavour == "vllm":

        def family(name: str, help_text: str, kind: str) -> None:
            lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"))

        family(
            "vllm:num_requests_running", "Number of requests in model execution batches.", "gauge"
        )
        for rank, (running, _) in enumerate(load):
            labels = f'engine="{rank}",model_name="{model}"'
            lines.append(f"vllm:num_requests_running{{{labels}}} {float(running)}")
        family(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting to be processed, by reason.",
            "gauge",
        )
        for rank, (_, waiting) in enumerate(load):
            labels = f'engine="{rank}",model_name="{model}"'
            by_reason = f"vllm:num_requests_waiting_by_reason{{{labels},reason="
            lines.append(f'{by_reason}"capacity"}} {float(waiting)}')
            lines.append(f'{by_reason}"deferred"}} 0.0')
        family("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "gauge")
        for rank, (_, waiting) in enumerate(load):
            labels = f'engine="{rank}",model_name="{model}"'
            lines.append(f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}")
        family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge")
        for rank, (running, _) in enumerate(load):
            usage = min(1.0, running / 64)
            lines.append(
                f'vllm:kv_cache_usage_perc{{engine="{rank}",model_name="{model}"}} {usage}'
            )
    elif flavour == "llamacpp":
        running = sum(r for r, _ in load)
        waiting = sum(w for _, w in load)
        for name, help_text, kind, value in (
            ("prompt_tokens_total", "Number of prompt tokens processed.", "counter", 0),
            ("tokens_predicted_total", "Number of generation tokens processed.", "counter", 0),
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", "gauge", 0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", "gauge", 0),
            ("requests_processing", "Number of requests processing.", "gauge", running),
            ("requests_deferred", "Number of requests deferred.", "gauge", waiting),
        ):
            lines.extend(
                (
                    f"# HELP llamacpp:{name} {help_text}",
                    f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {value}",
                )
            )
    else:
        for name, help_text, pick in (
            ("sglang:num_running_reqs", "The number of running requests.", 0),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", 1),
        ):
            lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} gauge"))
            for dp, counts in enumerate(load):
                for tp in range(tp_size):
                    dp_label = f'dp_rank="{dp}",' if len(load) > 1 else ""
                    labels = (
                        f'{dp_label}engine_type="unified",model_name="{model}",'
                        f'pp_rank="0",tp_rank="{tp}"'
                    )
                    lines.append(f"{name}{{{labels}}} {float(counts[pick])}")
    return ("\n".join(lines) + "\n").encode()


# --------------------------------------------------------------------------- load


class LoadTracker:
    """Running/waiting requests per data-parallel rank; past `max_running` they wait (FIFO)."""

    def __init__(self, ranks: int, max_running: int) -> None:
        self._max = max(1, max_running)
        self._running = [0] * max(1, ranks)
        self._queues: list[deque[asyncio.Future[None]]] = [deque() for _ in self._running]
        self._next = 0

    def snapshot(self) -> list[tuple[int, int]]:
        """(running, waiting) per rank."""
        return [(r, len(q)) for r, q in zip(self._running, self._queues, strict=True)]

    async def acquire(self) -> int:
        """Wait for a slot on the next rank (round robin); returns the rank to release."""
        rank = self._next
        self._next = (self._next + 1) % len(self._running)
        queue = self._queues[rank]
        if self._running[rank] < self._max and not queue:
            self._running[rank] += 1
            return rank
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(rank)  # the slot was handed to us just before the cancel
            else:
                queue.remove(waiter)
            raise
        return rank

    def release(self, rank: int) -> None:
        """Give the slot to the next waiter, or free it."""
        queue = self._queues[rank]
        while queue:
            waiter = queue.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; running stays the same
                return
        self._running[rank] -= 1


# --------------------------------------------------------------------------- server


class _Crashed(Exception):
    """Unwinds a connection task after an in-process simulated crash."""


_INFERENCE = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/chat/completions/batch",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/rerank",
        "/v1/score",
        # Aliases the engines also serve (not traffic through the gateway, but real routes).
        "/rerank",
        "/v2/rerank",
        "/score",
        "/embeddings",
        "/completions",
        "/chat/completions",
    }
)
_STREAMABLE = frozenset({"chat", "completions", "responses", "messages"})


def inference_kind(flavour: Flavour, path: str, options: SimOptions) -> str | None:
    """Which inference endpoint `path` is on this engine, or None when it does not serve it."""
    base = path.removeprefix("/v1") if path.startswith("/v1/") else path
    kind = {
        "/chat/completions": "chat",
        "/completions": "completions",
        "/responses": "responses",
        "/messages": "messages",
        "/embeddings": "embeddings",
        "/chat/completions/batch": "batch",
        "/audio/transcriptions": "audio",
        "/audio/translations": "audio",
        "/rerank": "rerank",
        "/v2/rerank": "rerank",
        "/score": "score",
    }.get(base)
    if kind is None or path not in _INFERENCE:
        return None
    if flavour == "llamacpp":
        if kind in ("audio", "score", "batch") or path == "/v2/rerank":
            return None
        return None if kind == "embeddings" and not options.embeddings else kind
    if path in ("/embeddings", "/completions", "/chat/completions"):
        return None
    if kind == "audio" and not options.audio:
        return None
    if kind == "embeddings" and not options.embeddings:
        return None
    if flavour == "sglang" and path in ("/rerank", "/v2/rerank", "/score"):
        return None
    return kind


class SimServer:
    """One simulated engine listening on a loopback (or any) socket."""

    def __init__(self, options: SimOptions, on_crash: Callable[[], None] | None) -> None:
        self.options = options
        self.host = options.host
        self.port = 0
        self.failure: str | None = None
        self._flavour: Flavour = options.flavour
        self._server_header = b"llama.cpp" if options.flavour == "llamacpp" else b"uvicorn"
        self._phase = Phase.LOADING
        self._sleeping = False
        self._requests = 0
        self._load = LoadTracker(options.data_parallel_size, options.max_running)
        self._on_crash = on_crash
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._startup: set[asyncio.Task[None]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._ready = asyncio.Event()

    @property
    def phase(self) -> Phase:
        """Where the engine is in its life."""
        return self._phase

    @property
    def url(self) -> str:
        """`http://host:port`."""
        return f"http://{self.host}:{self.port}"

    def statistics(self) -> SimStatistics:
        """A snapshot of load and lifecycle."""
        snap = self._load.snapshot()
        return SimStatistics(
            phase=self._phase,
            running=sum(r for r, _ in snap),
            waiting=sum(w for _, w in snap),
            inference_requests=self._requests,
            connections=len(self._writers),
            sleeping=self._sleeping,
        )

    async def wait_ready(self) -> None:
        """Wait until the engine serves (pair it with `wait_done` when it may fail)."""
        await self._ready.wait()

    async def wait_done(self) -> int:
        """Wait until the engine ends; its exit code (0 closed, 1 failed at start or crashed)."""
        return await asyncio.shield(self._done)

    async def close(self) -> None:
        """Stop listening, drop every connection and end; idempotent."""
        for task in list(self._startup):
            if task is not asyncio.current_task():
                task.cancel()
        await self._shutdown(Phase.CLOSED, 0)

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.options.port))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        # Bound but not listening: connections are refused, as with vLLM/SGLang while loading.
        self._sock = sock
        self.port = sock.getsockname()[1]
        if self._flavour == "llamacpp":
            await self._listen()
        if self.options.startup_delay_s > 0:
            self._background(self._after_delay())
        else:
            await self._loaded()  # serve() returns listening: what tests and benchmarks want

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name="sim-engine-startup")
        self._startup.add(task)
        task.add_done_callback(self._startup.discard)

    async def _listen(self) -> None:
        assert self._sock is not None
        self._server = await asyncio.start_server(
            self._connection, sock=self._sock, limit=READ_SIZE, backlog=1024
        )

    async def _after_delay(self) -> None:
        await asyncio.sleep(self.options.startup_delay_s)
        await self._loaded()

    async def _loaded(self) -> None:
        if self.options.fail_at_start is not None:
            self.failure = self.options.fail_at_start
            await self._shutdown(Phase.FAILED, 1)
            return
        if self._server is None:
            await self._listen()
        if self._flavour == "sglang" and self.options.warmup_s > 0:
            self._phase = Phase.WARMING
            self._background(self._warm_up())
        else:
            self._become_ready()

    async def _warm_up(self) -> None:
        await asyncio.sleep(self.options.warmup_s)
        self._become_ready()

    def _become_ready(self) -> None:
        self._phase = Phase.READY
        self._ready.set()

    async def _shutdown(self, phase: Phase, code: int) -> None:
        if self._done.done():
            return
        self._phase = phase
        self._abort_all()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if not self._done.done():
            self._done.set_result(code)

    def _abort_all(self) -> None:
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        for writer in list(self._writers):
            writer.transport.abort()

    def _crash(self) -> None:
        if self._on_crash is not None:
            self._on_crash()  # the CLI: os._exit, never returns
        self.failure = f"simulated crash on inference request {self._requests}"
        self._phase = Phase.CRASHED
        self._abort_all()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if not self._done.done():
            self._done.set_result(1)

    # ------------------------------------------------------------------ connections

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        clean = False
        try:
            while True:
                request = await self._read_request(conn, reader, writer)
                if request is None:
                    clean = True
                    break
                await self._respond(conn, writer, *request)
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
                else:
                    clean = conn.our_state is h11.MUST_CLOSE or conn.our_state is h11.DONE
                    break
        except h11.RemoteProtocolError as exc:
            # The client's fault: tell it when a status line can still go out, then close.
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                answer = error(self._flavour, exc.error_status_hint, f"bad request: {exc}")
                with contextlib.suppress(ConnectionError, h11.LocalProtocolError):
                    await self._write_full(conn, writer, answer)
                    clean = True
        except (_Crashed, ConnectionError):
            pass  # the peer went away, or we crashed on purpose: drop the connection
        except asyncio.CancelledError:
            # Only close()/_crash() cancel connection tasks; ending quietly keeps Python
            # 3.11's start_server callback (task.exception() on a cancelled task) from
            # logging a spurious traceback.  Nothing awaits this task's result.
            pass
        except Exception as exc:
            # A bug in the simulator: answer 500 like an engine would, keep serving others.
            _log(f"ERROR:    sim-engine request failed: {exc!r}")
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with contextlib.suppress(ConnectionError, h11.LocalProtocolError):
                    await self._write_full(conn, writer, error(self._flavour, 500, repr(exc)))
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            if clean:
                writer.close()
            else:
                writer.transport.abort()

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[h11.Request, bytes] | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if conn.they_are_waiting_for_100_continue:
                    writer.write(
                        _send(conn, h11.InformationalResponse(status_code=100, headers=[]))
                    )
                conn.receive_data(await reader.read(READ_SIZE))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                if len(body) + len(event.data) > MAX_BODY_BYTES:
                    too_large = error(self._flavour, 413, "request body too large")
                    await self._write_full(conn, writer, too_large, close=True)
                    return None
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, bytes(body)
            else:  # ConnectionClosed, or PAUSED (cannot happen before start_next_cycle)
                return None

    async def _write_full(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, answer: Full, close: bool = False
    ) -> None:
        headers = [
            (b"content-type", answer.content_type),
            (b"content-length", str(len(answer.body)).encode()),
            (b"server", self._server_header),
        ]
        if close:
            headers.append((b"connection", b"close"))
        out = _send(
            conn,
            h11.Response(
                status_code=answer.status, headers=headers, reason=_REASONS.get(answer.status, b"")
            ),
        )
        if answer.body:
            out += _send(conn, h11.Data(data=answer.body))
        writer.write(out + _send(conn, h11.EndOfMessage()))
        await writer.drain()

    async def _respond(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request, body: bytes
    ) -> None:
        target = request.target.decode("latin-1")
        path = target.partition("?")[0]
        method = request.method.decode("ascii", "replace")
        if self._flavour == "llamacpp" and self._phase is Phase.LOADING:
            await self._write_full(conn, writer, _LLAMA_LOADING)
            return
        kind = inference_kind(self._flavour, path, self.options)
        if kind is None:
            await self._write_full(conn, writer, self._control(method, path, body))
            return
        if method != "POST":
            refusal = _LLAMA_NOT_FOUND if self._flavour == "llamacpp" else _NOT_ALLOWED_DETAIL
            await self._write_full(conn, writer, refusal)
            return
        ctype = b""
        for key, value in request.headers:
            if key == b"content-type":
                ctype = value
        plan = self._infer(kind, body, ctype)
        if not plan.generates:
            assert isinstance(plan.answer, Full)
            await self._write_full(conn, writer, plan.answer)
            return
        rank = await self._load.acquire()
        try:
            self._requests += 1
            crash = self._requests == self.options.crash_after
            await self._write_answer(conn, writer, plan, crash)
        finally:
            self._load.release(rank)

    def _control(self, method: str, path: str, body: bytes) -> Full:
        flavour = self._flavour
        if method == "GET" and path == "/health":
            if flavour == "llamacpp":
                return _LLAMA_OK
            if flavour == "sglang" and self._phase is Phase.WARMING:
                return _SGLANG_UNHEALTHY
            return _EMPTY_OK
        if method == "GET" and path == "/metrics":
            if flavour == "llamacpp" and not self.options.metrics:
                return error(
                    flavour,
                    501,
                    "This server does not support metrics endpoint. Start it with `--metrics`",
                )
            if flavour == "sglang" and not self.options.metrics:
                return _NOT_FOUND_DETAIL
            text = metrics_text(
                flavour, self.options.model, self._load.snapshot(), self.options.tp_size
            )
            ctype = b"text/plain; version=0.0.4" + (
                b"" if flavour == "llamacpp" else b"; charset=utf-8"
            )
            return Full(200, text, ctype)
        if method == "GET" and path == "/v1/models":
            return models_answer(flavour, self.options.model)
        if method == "GET" and path.startswith("/v1/models/"):
            wanted = path.removeprefix("/v1/models/")
            if wanted == self.options.model:
                ctype = _JSON_UTF8 if flavour == "llamacpp" else b"application/json"
                return Full(200, _encode(model_card(flavour, self.options.model)), ctype)
            if flavour == "llamacpp":
                return _LLAMA_NOT_FOUND
            return error(flavour, 404, f"The model `{wanted}` does not exist.")
        if path == "/tokenize" and method == "POST" and flavour != "sglang":
            parsed = _parse_object(body)
            if parsed is None:
                return error(flavour, 400, "malformed JSON body")
            return tokenize_answer(flavour, parsed)
        if flavour == "vllm":
            if method == "POST" and path == "/sleep":
                self._sleeping = True
                return _EMPTY_OK
            if method == "POST" and path == "/wake_up":
                self._sleeping = False
                return _EMPTY_OK
            if method == "GET" and path == "/is_sleeping":
                return Full(200, _encode({"is_sleeping": self._sleeping}))
            if method == "GET" and path == "/version":
                return Full(200, b'{"version":"0.11.0+sim"}')
        if flavour == "llamacpp":
            if path in ("/embeddings", "/v1/embeddings") and not self.options.embeddings:
                return error(
                    flavour,
                    501,
                    "This server does not support embeddings. Start it with `--embeddings`",
                )
            return _LLAMA_NOT_FOUND
        return _NOT_FOUND_DETAIL

    def _infer(self, kind: str, body: bytes, ctype: bytes) -> Plan:
        """Decide the answer to one inference request (pure apart from reading state)."""
        flavour, model, opts = self._flavour, self.options.model, self.options
        if self._sleeping:
            return Plan(error(flavour, 503, "The engine is sleeping; POST /wake_up first"), False)
        if kind == "audio":
            audio = transcription_answer(flavour, body, ctype, opts.tokens)
            return Plan(audio, audio.status == 200)
        parsed = _parse_object(body)
        if parsed is None:
            return Plan(error(flavour, 400, "malformed JSON body: expected a JSON object"), False)
        requested = parsed.get("model")
        if flavour == "vllm" and isinstance(requested, str) and requested != model:
            return Plan(error(flavour, 404, f"The model `{requested}` does not exist."), False)
        stream = parsed.get("stream") is True and kind in _STREAMABLE
        stream_options = parsed.get("stream_options")
        usage = isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        delay = opts.token_delay_s
        g: Generation | None = None
        answer: Answer
        match kind:
            case "chat" | "batch" | "messages":
                messages = parsed.get("messages")
                if not isinstance(messages, list) or not messages:
                    return Plan(error(flavour, 400, "messages must be a non-empty list"), False)
                if kind == "batch":
                    return Plan(batch_answer(model, body, messages, opts.tokens), True)
                limit = parsed.get("max_tokens", parsed.get("max_completion_tokens"))
                g = generate(_encode(messages), limit, opts.tokens)
                if kind == "messages":
                    answer = messages_answer(flavour, model, g, stream)
                else:
                    answer = chat_answer(flavour, model, g, stream, usage, delay)
            case "completions":
                if "prompt" not in parsed:
                    return Plan(error(flavour, 400, "prompt is required"), False)
                g = generate(_encode(parsed["prompt"]), parsed.get("max_tokens"), opts.tokens)
                answer = completion_answer(flavour, model, g, stream, usage, delay)
            case "responses":
                if "input" not in parsed:
                    return Plan(error(flavour, 400, "input is required"), False)
                limit = parsed.get("max_output_tokens")
                g = generate(_encode(parsed["input"]), limit, opts.tokens)
                answer = responses_answer(model, g, stream, limit)
            case "embeddings":
                answer = embeddings_answer(flavour, model, parsed)
            case "rerank":
                answer = rerank_answer(flavour, model, parsed)
            case _:
                answer = score_answer(flavour, model, parsed)
        if isinstance(answer, Full) and answer.status != 200:
            return Plan(answer, False)
        pause = delay * g.completion_tokens if g is not None and isinstance(answer, Full) else 0.0
        return Plan(answer, True, pause)

    async def _write_answer(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, plan: Plan, crash: bool
    ) -> None:
        answer = plan.answer
        if isinstance(answer, Full):
            if plan.pause_s > 0:
                await asyncio.sleep(plan.pause_s)
            if not crash:
                await self._write_full(conn, writer, answer)
                return
            head = [
                (b"content-type", answer.content_type),
                (b"content-length", str(len(answer.body)).encode()),
                (b"server", self._server_header),
            ]
            out = _send(conn, h11.Response(status_code=answer.status, headers=head, reason=b"OK"))
            writer.write(out + _send(conn, h11.Data(data=answer.body[: len(answer.body) // 2])))
            await self._flush_and_crash(writer)
            return
        delay = self.options.token_delay_s
        headers = [
            (b"content-type", answer.content_type),
            (b"cache-control", b"no-cache"),
            (b"server", self._server_header),
        ]
        writer.write(_send(conn, h11.Response(status_code=200, headers=headers, reason=b"OK")))
        frames = answer.frames
        cut = max(1, len(frames) // 2) if crash else len(frames)
        for index in range(cut):
            writer.write(_send(conn, h11.Data(data=frames[index])))
            await writer.drain()
            if delay > 0 and index < cut - 1:
                await asyncio.sleep(delay)
        if crash:
            await self._flush_and_crash(writer)
            return
        writer.write(_send(conn, h11.EndOfMessage()))
        await writer.drain()

    async def _flush_and_crash(self, writer: asyncio.StreamWriter) -> None:
        # drain() waits only below the high-water mark; with a mark of 0 it waits until the
        # transport is empty, so the crash cannot eat bytes the client should have seen.
        writer.transport.set_write_buffer_limits(high=0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(writer.drain(), 1.0)
        self._crash()
        raise _Crashed


def _parse_object(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = _decode(body)
    except msgspec.DecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _send(conn: h11.Connection, event: h11.Event) -> bytes:
    data = conn.send(event)
    assert data is not None  # only ConnectionClosed yields None, and we never send it
    return data


async def serve(options: SimOptions, *, on_crash: Callable[[], None] | None = None) -> SimServer:
    """Bind at once and start the simulated engine; it listens when its start-up says so.

    `on_crash` runs when `--crash-after` triggers (the CLI passes `os._exit`); in-process,
    the default drops every connection, stops listening and ends `wait_done()` with 1.
    """
    server = SimServer(options, on_crash)
    await server._start()
    return server


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> SimOptions:
    """The CLI flags as `SimOptions`."""
    parser = argparse.ArgumentParser(prog="python -m simulations.engine", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--flavour", "--flavor", choices=FLAVOURS, default="vllm")
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--startup-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--warmup-delay", type=float, default=None, metavar="S")
    parser.add_argument("--fail-at-start", default=None, metavar="MESSAGE")
    parser.add_argument("--crash-after", type=int, default=None, metavar="N")
    parser.add_argument("--token-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--tokens", type=int, default=16, metavar="N")
    parser.add_argument("--max-running", type=int, default=256, metavar="N")
    parser.add_argument("--no-audio", action="store_true")
    parser.add_argument("--no-embeddings", action="store_true")
    parser.add_argument("--metrics", "--enable-metrics", action="store_true")
    parser.add_argument("--data-parallel-size", type=int, default=1, metavar="N")
    parser.add_argument("--tp-size", type=int, default=1, metavar="N")
    ns = parser.parse_args(argv)
    return SimOptions(
        flavour=ns.flavour,
        model=ns.model,
        host=ns.host,
        port=ns.port,
        startup_delay_s=ns.startup_delay,
        warmup_delay_s=ns.warmup_delay,
        fail_at_start=ns.fail_at_start,
        crash_after=ns.crash_after,
        token_delay_s=ns.token_delay,
        tokens=ns.tokens,
        max_running=ns.max_running,
        audio=not ns.no_audio,
        embeddings=not ns.no_embeddings,
        metrics=ns.metrics,
        data_parallel_size=ns.data_parallel_size,
        tp_size=ns.tp_size,
    )


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _die_now() -> None:
    _log("ERROR:    simulated engine crash (--crash-after): EngineDeadError")
    os._exit(1)


async def _amain(options: SimOptions) -> int:
    loop = asyncio.get_running_loop()
    server = await serve(options, on_crash=_die_now)
    _log(f"INFO:     sim-engine {options.flavour} {options.model} bound to {server.url}")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    done = asyncio.create_task(server.wait_done())
    ready = asyncio.create_task(server.wait_ready())
    await asyncio.wait({stopper, done, ready}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and not stop.is_set():
        _log(f"INFO:     Application startup complete; serving on {server.url}")
        await asyncio.wait({stopper, done}, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    if stop.is_set():
        await server.close()
        _log("INFO:     Shutting down (signal)")
        return 0
    code = await done
    if server.failure:
        _log(server.failure)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m simulations.engine`; returns the exit code."""
    options = parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.run(_amain(options))
    return int(uvloop.run(_amain(options)))


if __name__ == "__main__":
    sys.exit(main())
