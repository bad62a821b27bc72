"""Test support for LiteLLM: the pinned proxy as a subprocess on loopback, and a recording upstream.

`LiteLLMProxy` runs the real `litellm` binary (found through `LITELLM_BIN`) with a config file in
its own working directory (with `--reload`, LiteLLM also restarts when a `*.py` file under its
working directory changes, so it never runs from the repository).  `RecordingUpstream` is a small
OpenAI-compatible upstream that records every request it receives (path, headers, body) and can be
told to fail, so tests can assert on what LiteLLM really sent.  The gateway and end-to-end tests
reuse both through the `litellm_proxy_factory` and `recording_upstream` fixtures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dgxmm.engines.runtimes.process import ProcessRuntime

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0  # ~13 s on an idle machine; generous for a loaded CI box
STOP_TIMEOUT_S = 15.0
GATE_TIMEOUT_S = 120.0  # a scripted stream never waits longer than this for its gate


def litellm_bin() -> Path:
    """Where the pinned LiteLLM proxy binary is expected (`LITELLM_BIN`, else `.venv-litellm`)."""
    configured = os.environ.get("LITELLM_BIN")
    return Path(configured) if configured else REPO / ".venv-litellm" / "bin" / "litellm"


def require_litellm() -> Path:
    """The LiteLLM binary; skips the test when it is missing, fails instead under CI."""
    path = litellm_bin()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    reason = (
        f"LiteLLM proxy not found at {path}: run scripts/bootstrap "
        "(creates .venv-litellm) or set LITELLM_BIN"
    )
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so a missing LiteLLM is a failure)")
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def poll_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.1
) -> None:
    """Call `predicate` until it is true; fail the test with `what` when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)  # poll interval; the deadline above bounds the wait


# --------------------------------------------------------------------------------------------
# HTTP helpers (blocking; tests run them in the test thread)


@dataclass
class Response:
    """A complete HTTP response as a test sees it."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


def http_request(
    url: str,
    method: str = "GET",
    path: str = "/",
    body: object | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> Response:
    """One HTTP/1.1 request to `url` + `path` on a fresh connection; reads the whole answer."""
    host_port = url.removeprefix("http://").split("/", 1)[0]
    host, _, port = host_port.partition(":")
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout_s)
    try:
        payload = None if body is None else json.dumps(body).encode()
        all_headers = {"content-type": "application/json"} if payload is not None else {}
        all_headers.update(headers or {})
        conn.request(method, path, body=payload, headers=all_headers)
        answer = conn.getresponse()
        data = answer.read()
        return Response(answer.status, {k.lower(): v for k, v in answer.getheaders()}, data)
    finally:
        conn.close()


def sse_data(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    lines = body.decode().splitlines()
    return [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]


# --------------------------------------------------------------------------------------------
# The recording upstream


@dataclass(frozen=True)
class Recorded:
    """One request as the upstream received it."""

    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: Any  # parsed JSON, or None


@dataclass(frozen=True)
class Reply:
    """A canned answer the upstream sends instead of its normal one."""

    status: int
    body: object = None
    headers: dict[str, str] = field(default_factory=dict)
    sse: tuple[str, ...] = ()  # when set: an event stream of these `data:` payloads instead of body
    gate: threading.Event | None = None  # when set: wait for it after the first `gate_after` events
    gate_after: int = 1


class RecordingUpstream:
    """An OpenAI-compatible upstream on 127.0.0.1 that records requests and can fail on demand."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._requests: list[Recorded] = []
        self._failures: dict[str, list[Reply]] = {}
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return

            def do_GET(self) -> None:
                upstream._handle(self, "GET")

            def do_POST(self) -> None:
                upstream._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> RecordingUpstream:
        """Start serving in a background thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()

    def fail_next(self, endpoint: str, reply: Reply, times: int = 1) -> None:
        """Answer the next `times` requests whose path ends with `endpoint` with `reply`."""
        with self._lock:
            self._failures.setdefault(endpoint, []).extend([reply] * times)

    def requests(self, path_suffix: str = "") -> list[Recorded]:
        """Requests received so far whose path ends with `path_suffix`."""
        with self._lock:
            return [r for r in self._requests if r.path.endswith(path_suffix)]

    def clear(self) -> None:
        """Forget recorded requests and pending failures."""
        with self._lock:
            self._requests.clear()
            self._failures.clear()

    def wait_for(
        self, predicate: Callable[[list[Recorded]], bool], timeout_s: float = 30.0
    ) -> list[Recorded]:
        """Wait until `predicate(all requests)` holds; returns the requests."""
        with self._lock:
            if not self._lock.wait_for(lambda: predicate(self._requests), timeout=timeout_s):
                pytest.fail(f"upstream did not receive the expected requests: {self._requests}")
            return list(self._requests)

    # -- serving

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("content-length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        path = handler.path.split("?", 1)[0]
        record = Recorded(method, path, {k.lower(): v for k, v in handler.headers.items()}, body)
        with self._lock:
            self._requests.append(record)
            failure = None
            for endpoint, replies in self._failures.items():
                if path.endswith(endpoint) and replies:
                    failure = replies.pop(0)
                    break
            self._lock.notify_all()
        if failure is not None and failure.sse:
            self._send_scripted_stream(handler, failure)
            return
        if failure is not None:
            self._send_json(handler, failure.status, failure.body, failure.headers)
            return
        model = body.get("model", "m") if isinstance(body, dict) else "m"
        if method == "GET" and path.endswith("/v1/models"):
            self._send_json(
                handler, 200, {"object": "list", "data": [{"id": "m", "object": "model"}]}
            )
        elif path.endswith("/chat/completions"):
            if isinstance(body, dict) and body.get("stream"):
                self._send_chat_stream(handler, model)
            else:
                self._send_json(handler, 200, chat_completion(model, "hello from upstream"))
        elif path.endswith("/responses"):
            self._send_json(handler, 200, response_object(model, "hello from upstream"))
        else:
            error = {"message": f"no route {path}", "type": "not_found_error", "code": 404}
            self._send_json(handler, 404, {"error": error})

    @staticmethod
    def _send_json(
        handler: BaseHTTPRequestHandler,
        status: int,
        body: object,
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    @staticmethod
    def _send_scripted_stream(handler: BaseHTTPRequestHandler, reply: Reply) -> None:
        handler.send_response(reply.status)
        handler.send_header("content-type", "text/event-stream")
        handler.send_header("connection", "close")
        for name, value in reply.headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.close_connection = True
        try:
            for index, payload in enumerate(reply.sse):
                if reply.gate is not None and index == reply.gate_after:
                    reply.gate.wait(GATE_TIMEOUT_S)
                handler.wfile.write(f"data: {payload}\n\n".encode())
                handler.wfile.flush()
        except OSError:
            return  # the client (LiteLLM) hung up; that is what some tests look at

    @staticmethod
    def _send_chat_stream(handler: BaseHTTPRequestHandler, model: str) -> None:
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.send_header("connection", "close")
        handler.end_headers()
        for index, text in enumerate(["hello", " from", " upstream"]):
            chunk = chat_chunk(model, text, role=index == 0)
            handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            handler.wfile.flush()
        handler.wfile.write(
            f"data: {json.dumps(chat_chunk(model, None, finish=True))}\n\n".encode()
        )
        handler.wfile.write(b"data: [DONE]\n\n")
        handler.wfile.flush()
        handler.close_connection = True


def chat_completion(model: str, text: str) -> dict[str, Any]:
    """A minimal non-streaming chat completion."""
    return {
        "id": "chatcmpl-up1",
        "object": "chat.completion",
        "created": 1735000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }


def chat_chunk(
    model: str, text: str | None, role: bool = False, finish: bool = False
) -> dict[str, Any]:
    """One streaming chat chunk."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    return {
        "id": "chatcmpl-up1",
        "object": "chat.completion.chunk",
        "created": 1735000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "finish_reason": "stop" if finish else None,
                "logprobs": None,
            }
        ],
    }


def response_object(model: str, text: str) -> dict[str, Any]:
    """A minimal completed Responses API object."""
    return {
        "id": "resp_up1",
        "object": "response",
        "created_at": 1735000000,
        "status": "completed",
        "model": model,
        "output": [
            {
                "type": "message",
                "id": "msg_up1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": 3,
            "output_tokens": 3,
            "total_tokens": 6,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "temperature": 1.0,
        "top_p": 1.0,
        "text": {"format": {"type": "text"}},
    }


# --------------------------------------------------------------------------------------------
# The LiteLLM proxy process


class LiteLLMProxy:
    """One `litellm` proxy process on 127.0.0.1 with its own working directory and master key."""

    def __init__(self, binary: Path, config_path: Path, workdir: Path, reload: bool = True) -> None:
        self.binary = binary
        self.config_path = config_path
        self.workdir = workdir
        self.reload = reload
        self.port = free_port()
        self.master_key = "sk-" + secrets.token_hex(16)
        self.log_path = workdir / "litellm.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        """The master key as an Authorization header."""
        return {"authorization": f"Bearer {self.master_key}"}

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> LiteLLMProxy:
        """Start the proxy and wait (with a deadline) until `/health/liveliness` answers 200."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k.upper() not in {"DATABASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"}
        }
        env.update(
            LITELLM_MASTER_KEY=self.master_key,
            LITELLM_LOCAL_MODEL_COST_MAP="True",
            NO_PROXY="127.0.0.1,localhost",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env())
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.argv(),
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches the reload workers
            )
        deadline = time.monotonic() + ready_timeout_s
        while not self._is_live():
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"litellm exited with {self._process.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"litellm not live after {ready_timeout_s} s:\n{self.log_tail()}"
                )
            time.sleep(0.2)  # poll interval; the deadline above bounds the wait
        return self

    def argv(self) -> list[str]:
        """The command line (`litellm --config FILE`, with `--reload` unless told otherwise)."""
        argv = [str(self.binary), "--config", str(self.config_path)]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.reload:
            argv.append("--reload")
        return argv

    def extra_env(self) -> dict[str, str]:
        """Environment variables the command line needs besides the master key."""
        return {}

    @property
    def pid(self) -> int | None:
        """The proxy's main process (with --reload: uvicorn's reloader, parent of the worker)."""
        return None if self._process is None else self._process.pid

    def child_pids(self) -> set[int]:
        """The main process's children right now (with --reload: the worker; a new pid after
        every worker restart)."""
        pid = self.pid
        if pid is None:
            return set()
        try:
            text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        except OSError:
            return set()
        return {int(child) for child in text.split()}

    def _is_live(self) -> bool:
        try:
            return http_request(self.url, path="/health/liveliness", timeout_s=2).status == 200
        except OSError:
            return False

    def serves(self, model_id: str) -> bool:
        """Whether LiteLLM's router has an entry with this `model_info.id` right now."""
        try:
            answer = http_request(
                self.url, path=f"/model/info?litellm_model_id={model_id}", headers=self.auth
            )
        except OSError:
            return False
        return answer.status == 200

    def stop(self) -> None:
        """Stop the proxy (SIGTERM to its process group, SIGKILL after a deadline)."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the proxy's output, for failure messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class SimEngineProcess:
    """`python -m simulations.engine` as a subprocess on 127.0.0.1, ready when started."""

    def __init__(self, model: str, flavour: str = "vllm", workdir: Path | None = None) -> None:
        self.model = model
        self.port = free_port()
        self.log_path = (workdir or Path(os.environ.get("TMPDIR", "/tmp"))) / f"sim-{self.port}.log"
        argv = [sys.executable, "-m", "simulations.engine", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--flavour", flavour, "--model", model]
        self._argv = argv
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 30.0) -> SimEngineProcess:
        """Start the engine and wait (with a deadline) until `/health` answers 200."""
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        deadline = time.monotonic() + ready_timeout_s
        while True:
            with contextlib.suppress(OSError):
                if http_request(self.url, path="/health", timeout_s=2).status == 200:
                    return self
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"simulated engine did not start: {self.log_path.read_text()}")
            time.sleep(0.05)  # poll interval; the deadline above bounds the wait

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a deadline."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def recording_upstream() -> Iterator[RecordingUpstream]:
    """A recording OpenAI-compatible upstream for the whole test module."""
    upstream = RecordingUpstream().start()
    yield upstream
    upstream.close()


@pytest.fixture(scope="module")
def litellm_proxy_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[Path], LiteLLMProxy]]:
    """Starts LiteLLM proxies for a test module (one start costs ~13 s); stops them all at its end.

    Call it with a config file path; the proxy runs with `--reload` in a fresh directory.
    """
    binary = require_litellm()
    started: list[LiteLLMProxy] = []

    def start(config_path: Path) -> LiteLLMProxy:
        proxy = LiteLLMProxy(binary, config_path, tmp_path_factory.mktemp("litellm-run"))
        started.append(proxy)
        return proxy.start()

    yield start
    for proxy in started:
        proxy.stop()


# --------------------------------------------------------------------------------------------
# DGXMM in-process, on its own event loop


T = TypeVar("T")


class AppInThread:
    """A DGXMM `App` running on an event loop in a background thread.

    Blocking tests (and their LiteLLM clients) run in the test thread; everything that touches
    the App (the controller, the gateway's counters) goes through `run`/`read`, which execute
    on the App's loop and wait for the result with a deadline.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dgxmm-app", daemon=True)

    def start(self, timeout_s: float = 60.0) -> AppInThread:
        """Start the loop, then `await app.start()` on it."""
        self._thread.start()
        self.run(self.app.start(), timeout_s)
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run `coro` on the App's loop and return its result (fails the test at the deadline)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            pytest.fail(f"the App did not finish {coro!r} within {timeout_s:.0f} s")

    def read(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Call `fn` on the App's loop (state is only consistent there) and return its result."""

        async def call() -> T:
            return fn()

        return self.run(call(), timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """`await app.stop()`, then end the loop and the thread."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.run(self.app.stop(), timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


def stop_leftover_engines(data_dir: Path) -> None:
    """`App.stop` leaves engines running (they are adopted at the next start): stop them."""

    async def stop_all() -> None:
        runtime = ProcessRuntime(data_dir / "engines", cwd=REPO)
        for handle in await runtime.list_engines():
            with contextlib.suppress(Exception):
                await runtime.stop(handle, 5.0)
        await runtime.close()

    asyncio.run(stop_all())
