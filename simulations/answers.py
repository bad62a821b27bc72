"""What the simulated engine answers: each engine's bodies, errors and streaming formats.

Pure functions of the request: every answer is built whole before a byte is written, from
pre-encoded pieces, and is deterministic for a given body (so a test can compare the bytes
seen through a proxy with the bytes seen directly).  The server (`simulations.engine`)
parses, routes, waits for a load slot and writes what these return.  About 700 lines: one
renderer per endpoint family and flavour, sharing the generation and the pre-encoded pieces.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

Flavour = Literal["vllm", "llamacpp", "sglang"]
FLAVOURS: tuple[Flavour, ...] = ("vllm", "llamacpp", "sglang")

MAX_TOKENS_CAP = 100_000
CREATED = 1735000000  # fixed, so that answers are byte-for-byte deterministic
MAX_MODEL_LEN = 8192
EMBEDDING_DIMS = 8

_encode = msgspec.json.encode
_decode = msgspec.json.decode

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


JSON_UTF8 = b"application/json; charset=utf-8"
NOT_FOUND_DETAIL = Full(404, b'{"detail":"Not Found"}')
NOT_ALLOWED_DETAIL = Full(405, b'{"detail":"Method Not Allowed"}')
LLAMA_NOT_FOUND = Full(
    404,
    b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}',
    JSON_UTF8,
)
LLAMA_LOADING = Full(
    503,
    b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}',
    JSON_UTF8,
)
LLAMA_OK = Full(200, b'{"status":"ok"}', JSON_UTF8)
EMPTY_OK = Full(200, b"", b"application/json")
SGLANG_UNHEALTHY = Full(503, b"", b"application/json")


def error(
    flavour: Flavour, status: int, message: str, kind: str | None = None, param: str | None = None
) -> Full:
    """An error body in the flavour's own format (`param`: the field at fault, where the
    format has one)."""
    if flavour == "llamacpp":
        err_type = kind or {
            400: "invalid_request_error",
            404: "not_found_error",
            501: "not_supported_error",
            503: "unavailable_error",
        }.get(status, "server_error")
        body = {"error": {"message": message, "type": err_type, "code": status}}
        return Full(status, _encode(body), JSON_UTF8)
    err_type = kind or {
        400: "BadRequestError",
        404: "NotFoundError",
        413: "BadRequestError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError")
    if flavour == "sglang":
        flat = {"object": "error", "message": message, "type": err_type, "param": param}
        return Full(status, _encode({**flat, "code": status}))
    nested = {"message": message, "type": err_type, "param": param, "code": status}
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
        return Full(200, _encode(body), JSON_UTF8)
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
    ctype = JSON_UTF8 if flavour == "llamacpp" else b"application/json"
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
    return Full(200, _encode(answer), JSON_UTF8 if flavour == "llamacpp" else b"application/json")


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
        return Full(200, _encode(llama), JSON_UTF8)
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
        return Full(200, _encode({"tokens": ids}), JSON_UTF8)
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
    return Full(200, _encode(body), JSON_UTF8 if flavour == "llamacpp" else b"application/json")


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
