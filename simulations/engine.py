"""A simulated OpenAI-compatible inference engine, faithful to vLLM, llama.cpp and SGLang.

Run it as `python -m simulations.engine --flavour vllm --model m --port 8000`, or in-process
with `await serve(SimOptions(...))`.  It mimics each engine where DGXMM can tell the
difference (see notes/engines.md): how it starts (connection refused, 503 while loading or
warming up), its `/health`, `/metrics` and 404 bodies, vLLM's sleep endpoints, and the
streaming formats of chat/completions, completions, the Responses API and Anthropic
messages, and its 400 for a body that is not a valid request (`simulations.refusals`), on a
connection that stays open.  Answers are deterministic for a given request body, so a test
can compare the bytes seen through a proxy with the bytes seen directly.

The rendering functions (`simulations.answers`) are pure and build the whole answer before a
byte is written; the connection task here only parses (h11), routes, waits for a slot and
writes. This module is the server (about 800 lines: one connection state machine with the
lifecycle, sleep mode and load slots it routes through, kept together because they share it). It
is used in benchmarks, so the hot path decodes the body once, renders from pre-encoded pieces
and writes one buffer per chunk followed by `drain()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
import msgspec

from simulations.answers import (
    EMPTY_OK,
    FLAVOURS,
    JSON_UTF8,
    LLAMA_LOADING,
    LLAMA_NOT_FOUND,
    LLAMA_OK,
    NOT_ALLOWED_DETAIL,
    NOT_FOUND_DETAIL,
    SGLANG_UNHEALTHY,
    Answer,
    Flavour,
    Full,
    Generation,
    Plan,
    batch_answer,
    chat_answer,
    completion_answer,
    embeddings_answer,
    error,
    generate,
    messages_answer,
    metrics_text,
    model_card,
    models_answer,
    rerank_answer,
    responses_answer,
    score_answer,
    tokenize_answer,
    transcription_answer,
)
from simulations.refusals import refusal

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
READ_SIZE = 64 * 1024

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
    # Print vLLM's loading milestones to stderr while starting (the CLI turns it on), so
    # DGXMM's cold-start phases can be read from a simulated engine's log end to end.
    log_milestones: bool = False

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
        if self.options.log_milestones and self._flavour == "vllm":
            await self._vllm_milestones(self.options.startup_delay_s)
        else:
            await asyncio.sleep(self.options.startup_delay_s)
        await self._loaded()

    async def _vllm_milestones(self, delay_s: float) -> None:
        """vLLM's start-up lines, spread over the delay as a real start spreads them."""
        began = time.monotonic()
        for share, line in VLLM_MILESTONES:
            await asyncio.sleep(max(0.0, began + share * delay_s - time.monotonic()))
            text = line.format(took=share * delay_s, url=f"http://{self.host}:{self.port}")
            _log(f"{vllm_prefix(time.time())} {text}")

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
            await self._write_full(conn, writer, LLAMA_LOADING)
            return
        kind = inference_kind(self._flavour, path, self.options)
        if kind is None:
            await self._write_full(conn, writer, self._control(method, path, body))
            return
        if method != "POST":
            refusal = LLAMA_NOT_FOUND if self._flavour == "llamacpp" else NOT_ALLOWED_DETAIL
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
                return LLAMA_OK
            if flavour == "sglang" and self._phase is Phase.WARMING:
                return SGLANG_UNHEALTHY
            return EMPTY_OK
        if method == "GET" and path == "/metrics":
            if flavour == "llamacpp" and not self.options.metrics:
                return error(
                    flavour,
                    501,
                    "This server does not support metrics endpoint. Start it with `--metrics`",
                )
            if flavour == "sglang" and not self.options.metrics:
                return NOT_FOUND_DETAIL
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
                ctype = JSON_UTF8 if flavour == "llamacpp" else b"application/json"
                return Full(200, _encode(model_card(flavour, self.options.model)), ctype)
            if flavour == "llamacpp":
                return LLAMA_NOT_FOUND
            return error(flavour, 404, f"The model `{wanted}` does not exist.")
        if path == "/tokenize" and method == "POST" and flavour != "sglang":
            parsed = _parse_object(body)
            if parsed is None:
                return error(flavour, 400, "malformed JSON body")
            return tokenize_answer(flavour, parsed)
        if flavour == "vllm":
            if method == "POST" and path == "/sleep":
                self._sleeping = True
                return EMPTY_OK
            if method == "POST" and path == "/wake_up":
                self._sleeping = False
                return EMPTY_OK
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
            return LLAMA_NOT_FOUND
        return NOT_FOUND_DETAIL

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
        refused = refusal(flavour, kind, parsed)  # checked before the model, as vLLM does
        if refused is not None:
            return Plan(refused, False)
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
                g = generate(_encode(parsed["prompt"]), parsed.get("max_tokens"), opts.tokens)
                answer = completion_answer(flavour, model, g, stream, usage, delay)
            case "responses":
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
        log_milestones=True,
    )


# (share of the start-up delay, line): the lines DGXMM reads milestones from, worded as vLLM,
# each after vLLM's prefix (`vllm_prefix`: the level and the local time the line was written).
VLLM_MILESTONES = (
    (0.4, "[default_loader.py:262] Loading weights took {took:.2f} seconds"),
    (0.45, "[gpu_model_runner.py:2021] Model loading took 0.51 GiB and {took:.6f} seconds"),
    (0.9, "[core.py:214] init engine (profile, create kv cache, warmup model) took {took:.2f} "
     "seconds"),
    (1.0, "[api_server.py:1885] Starting vLLM API server 0 on {url}"),
)  # fmt: skip


def vllm_prefix(now: float) -> str:
    """vLLM's prefix of a log line written at `now` (epoch seconds): "INFO 12-06 21:58:43"."""
    return "INFO " + time.strftime("%m-%d %H:%M:%S", time.localtime(now))


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
