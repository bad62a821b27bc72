"""Test support for the gateway: a scripted controller, a tiny engine, a raw HTTP client, and
the gateway key of a DGXMM under test (its gateway refuses requests without it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import h11

from actors.admission import DeploymentView, Lease, Refused, Waiter
from actors.ports import EngineHandle
from gateway.app import Gateway, GatewayConfig
from gateway.server import HTTPServer, ServerConfig
from gateway.upstream import UpstreamConfig, UpstreamPool

T = TypeVar("T")
DEADLINE_S = 10.0
KEY_FILE = "gateway.key"  # dgxmm.litellm.gateway_key.KEY_FILE (tests read what DGXMM wrote)


def gateway_key(data_dir: Path) -> str:
    """The gateway key of the DGXMM whose data directory is `data_dir`."""
    return (data_dir / KEY_FILE).read_text().strip()


def gateway_auth(data_dir: Path) -> dict[str, str]:
    """The Authorization header LiteLLM sends that DGXMM's gateway, as a dict."""
    return {"authorization": f"Bearer {gateway_key(data_dir)}"}


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run one test coroutine with an overall deadline."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


# --- scripted controller ----------------------------------------------------------------


class ScriptedLease:
    """A lease that counts itself in and out of flight."""

    def __init__(self, controller: ScriptedController, deployment_id: str, handle: EngineHandle):
        self._controller = controller
        self._deployment_id = deployment_id
        self._handle = handle
        self.released = False

    @property
    def handle(self) -> EngineHandle:
        """Where the engine answers."""
        return self._handle

    def release(self) -> None:
        """Count the request out (idempotent)."""
        if not self.released:
            self.released = True
            self._controller.in_flight[self._deployment_id] -= 1
            self._controller.released += 1
            self._controller.changed()


class ScriptedWaiter:
    """A waiter resolved by the test through the controller."""

    def __init__(self, controller: ScriptedController, deployment_id: str, request_id: str):
        self._controller = controller
        self.deployment_id = deployment_id
        self.request_id = request_id
        self._queued = asyncio.Event()
        self.future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self.cancelled = False

    @property
    def queued(self) -> asyncio.Event:
        """Set when really queued."""
        return self._queued

    async def wait(self) -> Lease:
        """The lease, or `Refused`."""
        return await asyncio.shield(self.future)

    def first_byte(self) -> None:
        """The engine's answer reached the request; the scripted queue records nothing."""

    def cancel(self) -> None:
        """The client left."""
        if not self.cancelled:
            self.cancelled = True
            self._controller.cancelled.append(self.request_id)
            if self.future.done() and not self.future.cancelled() and not self.future.exception():
                self.future.result().release()  # granted but never delivered
            else:
                self.future.cancel()
            self._controller.changed()


@dataclass
class ScriptedDeployment:
    """One deployment as the scripted controller knows it."""

    deployment_id: str
    model_name: str
    served_model: str
    state: str
    handle: EngineHandle | None
    refuse: Refused | None = None
    queue_on_enqueue: bool = False
    mode: str = "on_demand"


@dataclass
class ScriptedController:
    """A Controller whose answers the test scripts: ready, starting, queued, refusing."""

    deployments: dict[str, ScriptedDeployment] = field(default_factory=dict)
    waiters: list[ScriptedWaiter] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    unreachable: list[str] = field(default_factory=list)
    waited_s: list[float] = field(default_factory=list)  # `enqueue`'s, one per call
    engine_exited: bool = False  # `exited_before`'s answer
    exit_questions: list[str] = field(default_factory=list)  # runtime ids asked about
    # A deployment the gateway reports unreachable stops serving (as the real controller's
    # does while it checks the engine): requests then wait for it.
    suspect_on_unreachable: bool = False
    acquired: int = 0
    released: int = 0
    enqueued: int = 0

    def add(
        self,
        deployment_id: str,
        *,
        state: str = "ready",
        handle: EngineHandle | None = None,
        model_name: str | None = None,
        served_model: str | None = None,
        mode: str = "on_demand",
    ) -> ScriptedDeployment:
        """Register a deployment."""
        dep = ScriptedDeployment(
            deployment_id=deployment_id,
            model_name=model_name or f"model-{deployment_id}",
            served_model=served_model or f"served-{deployment_id}",
            state=state,
            handle=handle,
            mode=mode,
        )
        self.deployments[deployment_id] = dep
        self.in_flight.setdefault(deployment_id, 0)
        return dep

    # Controller protocol ----------------------------------------------------------------

    def view(self, deployment_id: str) -> DeploymentView | None:
        """The record."""
        dep = self.deployments.get(deployment_id)
        if dep is None:
            return None
        return DeploymentView(
            deployment_id=dep.deployment_id,
            model_name=dep.model_name,
            served_model=dep.served_model,
            engine="sim",
            state=dep.state,
            mode=dep.mode,
            created_at=1700000000.0,
            engine_handle=dep.handle if dep.state == "ready" else None,
        )

    def try_acquire(self, deployment_id: str) -> Lease | None:
        """A lease when ready."""
        dep = self.deployments[deployment_id]
        if dep.state != "ready" or dep.handle is None:
            return None
        return self._lease(dep)

    def enqueue(self, deployment_id: str, request_id: str, *, waited_s: float = 0.0) -> Waiter:
        """A waiter, or `Refused` at once."""
        self.waited_s.append(waited_s)
        dep = self.deployments[deployment_id]
        if dep.refuse is not None:
            raise dep.refuse
        waiter = ScriptedWaiter(self, deployment_id, request_id)
        if dep.queue_on_enqueue:
            waiter.queued.set()
        self.waiters.append(waiter)
        self.enqueued += 1
        self.changed()
        return waiter

    async def exited_before(self, handle: EngineHandle, wall: float) -> bool:
        """Scripted: `engine_exited` says whether the engine was gone before the request."""
        self.exit_questions.append(handle.runtime_id)
        return self.engine_exited

    def engine_unreachable(self, deployment_id: str) -> None:
        """Counted: the gateway reports an engine it could not reach."""
        self.unreachable.append(deployment_id)
        dep = self.deployments.get(deployment_id)
        if self.suspect_on_unreachable and dep is not None:
            dep.state, dep.handle = "starting", None
            self.changed()

    # scripting --------------------------------------------------------------------------

    def _lease(self, dep: ScriptedDeployment) -> ScriptedLease:
        assert dep.handle is not None
        self.acquired += 1
        self.in_flight[dep.deployment_id] += 1
        self.changed()
        return ScriptedLease(self, dep.deployment_id, dep.handle)

    def pending(self, deployment_id: str) -> list[ScriptedWaiter]:
        """Waiters not yet resolved or cancelled."""
        return [
            w
            for w in self.waiters
            if w.deployment_id == deployment_id and not w.future.done() and not w.cancelled
        ]

    def queue(self, deployment_id: str) -> None:
        """Mark every waiting request of the deployment as really queued."""
        for waiter in self.pending(deployment_id):
            waiter.queued.set()

    def make_ready(self, deployment_id: str, handle: EngineHandle) -> None:
        """The model serves: every waiter gets a lease."""
        dep = self.deployments[deployment_id]
        dep.state, dep.handle = "ready", handle
        for waiter in self.pending(deployment_id):
            waiter.future.set_result(self._lease(dep))

    def refuse_waiters(self, deployment_id: str, refused: Refused) -> None:
        """Every waiter gets `refused`."""
        for waiter in self.pending(deployment_id):
            waiter.future.set_exception(refused)
        self.changed()

    def changed(self) -> None:
        """Hook for state changes (tests poll with `until`)."""

    async def until(self, predicate: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
        """Wait (bounded) until `predicate()` holds."""
        await poll(predicate, timeout)


# --- a tiny engine ------------------------------------------------------------------------


@dataclass
class EngineScript:
    """How the fake engine answers."""

    tokens: int = 5
    crash_after: int | None = None  # streams: abort the connection after this many tokens
    hold: asyncio.Event | None = None  # wait for this before answering
    status: int = 200


@dataclass
class SeenRequest:
    """One request as the fake engine received it."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes


class FakeEngine:
    """An OpenAI-flavoured engine on loopback, written with raw bytes (not our server)."""

    def __init__(self, script: EngineScript | None = None) -> None:
        self.script = script or EngineScript()
        self.seen: list[SeenRequest] = []
        self.connections = 0
        self.disconnects = 0  # connections that ended while an answer was being produced
        self.started = asyncio.Event()  # set when a request arrived (reset by the test)
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FakeEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def handle(self) -> EngineHandle:
        """The engine as a handle for the controller."""
        return EngineHandle(deployment_id="x", host="127.0.0.1", port=self.port, runtime_id="t")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request: h11.Request | None = None
                body = b""
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await reader.read(65536)
                        conn.receive_data(data)
                        continue
                    if isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                assert request is not None
                seen = SeenRequest(
                    request.method.decode(),
                    request.target.decode(),
                    {k.decode(): v.decode() for k, v in request.headers},
                    body,
                )
                self.seen.append(seen)
                self.started.set()
                keep = await self._answer(seen, reader, writer)
                if not keep:
                    return
                leftover = conn.trailing_data[0]  # answers are raw bytes: start a fresh parser
                conn = h11.Connection(h11.SERVER)
                if leftover:
                    conn.receive_data(leftover)
        except (OSError, h11.RemoteProtocolError, asyncio.CancelledError):
            return
        finally:
            writer.transport.abort()

    async def _answer(
        self, seen: SeenRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        script = self.script
        if script.hold is not None and not await held(script.hold, reader):
            self.disconnects += 1
            return False
        try:
            payload = json.loads(seen.body) if seen.body else {}
        except ValueError:
            payload = {}
        path = seen.target.split("?")[0]
        if script.status != 200 and path in ("/v1/chat/completions", "/v1/completions"):
            body = json.dumps({"error": {"message": "bad things", "code": script.status}}).encode()
            writer.write(_json_response(script.status, body))
            return True
        if seen.method == "GET" and path.startswith("/v1/models/"):
            body = json.dumps({"id": path[len("/v1/models/") :], "object": "model"}).encode()
            writer.write(_json_response(200, body))
            return True
        if path == "/v1/chat/completions" and payload.get("stream"):
            return await self._stream(writer, "chat")
        if path == "/v1/completions" and payload.get("stream"):
            return await self._stream(writer, "text")
        if path == "/v1/chat/completions":
            body = json.dumps(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 1,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "Hello world"},
                            "finish_reason": "stop",
                        }
                    ],
                }
            ).encode()
        elif path == "/v1/completions":
            body = json.dumps(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": "Hello world", "finish_reason": "stop"}],
                }
            ).encode()
        elif path == "/v1/responses":
            body = json.dumps(
                {
                    "id": "resp_1",
                    "object": "response",
                    "output": [
                        {"type": "reasoning", "summary": []},
                        {
                            "type": "message",
                            "role": "assistant",
                            "content": [{"type": "output_text", "text": "Hello world"}],
                        },
                    ],
                }
            ).encode()
        elif path == "/v1/embeddings":
            body = json.dumps({"object": "list", "data": [{"embedding": [0.5]}]}).encode()
        else:
            body = json.dumps({"error": {"message": "no such route", "code": 404}}).encode()
            writer.write(_json_response(404, body))
            return True
        writer.write(_json_response(script.status, body))
        return True

    async def _stream(self, writer: asyncio.StreamWriter, kind: str) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"x-engine: fake\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for i in range(self.script.tokens):
            if self.script.crash_after is not None and i >= self.script.crash_after:
                await writer.drain()
                writer.write(_chunk(b'data: {"partial'))
                await writer.drain()
                writer.transport.abort()
                return False
            if kind == "chat":
                event = {
                    "object": "chat.completion.chunk",
                    "choices": [{"delta": {"content": f"t{i} "}}],
                }
            else:
                event = {"object": "text_completion", "choices": [{"text": f"t{i} "}]}
            writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
            try:
                await writer.drain()
            except OSError:
                self.disconnects += 1
                return False
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return True


async def held(until: asyncio.Event, reader: asyncio.StreamReader) -> bool:
    """Wait for `until`; False when the peer went away (or sent more) first."""
    released = asyncio.ensure_future(until.wait())
    gone = asyncio.ensure_future(reader.read(1))
    done, _ = await asyncio.wait((released, gone), return_when=asyncio.FIRST_COMPLETED)
    if gone in done:
        released.cancel()
        return False
    gone.cancel()
    return True


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _json_response(status: int, body: bytes) -> bytes:
    reason = {200: b"OK", 404: b"Not Found", 500: b"Internal Server Error"}.get(status, b"X")
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nx-engine: fake\r\n"
        b"content-length: %d\r\n\r\n" % (status, reason, len(body))
    ) + body


# --- gateway fixture ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_gateway(
    controller: ScriptedController,
    *,
    server_config: ServerConfig | None = None,
    gateway_config: GatewayConfig | None = None,
    upstream_config: UpstreamConfig | None = None,
) -> AsyncIterator[tuple[Gateway, HTTPServer]]:
    """A gateway on a free loopback port, shut down afterwards."""
    gateway = Gateway(
        controller,
        config=gateway_config,
        upstream=UpstreamPool(upstream_config or UpstreamConfig()),
        clock=lambda: 1700000000.0,
    )
    server = await gateway.serve("127.0.0.1", 0, server_config)
    try:
        yield gateway, server
    finally:
        await gateway.shutdown(5.0)


# --- a raw client -------------------------------------------------------------------------


@dataclass
class Reply:
    """A complete response as received."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: str) -> str | None:
        """First value of a header."""
        for n, v in self.headers:
            if n.decode().lower() == name.lower():
                return v.decode()
        return None

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)


class Client:
    """One keep-alive client connection parsed with h11 (independent of the server code)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str | None = None
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = h11.Connection(h11.CLIENT)
        self.key = key  # sent as `Authorization: Bearer` unless a request names its own

    @classmethod
    async def connect(cls, port: int, key: str | None = None) -> Client:
        """Open a connection to 127.0.0.1:port (sending the gateway key `key` if given)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer, key)

    async def send(
        self,
        method: str,
        target: str,
        body: bytes | dict[str, Any] = b"",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        """Send a request (JSON-encoding dict bodies)."""
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        hdrs = [("host", "gw"), *(headers or [])]
        if self.key is not None and not any(n.lower() == "authorization" for n, _ in hdrs):
            hdrs.append(("authorization", f"Bearer {self.key}"))
        if body or method == "POST":
            hdrs.append(("content-length", str(len(body))))
        data = self.conn.send(h11.Request(method=method, target=target, headers=hdrs))
        if body:
            data += self.conn.send(h11.Data(data=body))
        data += self.conn.send(h11.EndOfMessage())
        self.writer.write(data)
        await self.writer.drain()

    async def _event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.reader.read(65536))
                continue
            return event

    async def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        """The response head."""
        event = await self._event()
        assert isinstance(event, h11.Response), event
        return event.status_code, list(event.headers.raw_items())

    async def chunk(self) -> bytes | None:
        """The next body data, None at the end."""
        while True:
            event = await self._event()
            if isinstance(event, h11.Data):
                return bytes(event.data)
            if isinstance(event, h11.EndOfMessage):
                return None
            raise AssertionError(event)

    async def read_until(self, marker: bytes) -> bytes:
        """Body bytes until `marker` was seen (bounded by the test deadline)."""
        got = b""
        while marker not in got:
            data = await self.chunk()
            assert data is not None, got
            got += data
        return got

    async def reply(self) -> Reply:
        """The whole response; the connection is then ready for the next request."""
        status, headers = await self.head()
        body = b""
        while (data := await self.chunk()) is not None:
            body += data
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return Reply(status, headers, body)

    async def request(
        self,
        method: str,
        target: str,
        body: bytes | dict[str, Any] = b"",
        headers: list[tuple[str, str]] | None = None,
    ) -> Reply:
        """Send and receive one request."""
        await self.send(method, target, body, headers)
        return await self.reply()

    def close(self) -> None:
        """Hang up."""
        self.writer.transport.abort()

    async def closed_by_peer(self) -> bool:
        """True when the server closed the connection (reads EOF)."""
        try:
            return await self.reader.read(65536) == b""
        except OSError:
            return True


async def request_once(
    port: int,
    method: str,
    target: str,
    body: bytes | dict[str, Any] = b"",
    headers: list[tuple[str, str]] | None = None,
    key: str | None = None,
) -> Reply:
    """One request on its own connection."""
    client = await Client.connect(port, key)
    try:
        return await client.request(method, target, body, headers)
    finally:
        client.close()


async def raw_exchange(port: int, data: bytes, *, read_limit: int = 1 << 20) -> bytes:
    """Send raw bytes, then read until the server closes (or `read_limit`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        got = b""
        while len(got) < read_limit:
            try:
                chunk = await reader.read(65536)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
        return got
    finally:
        writer.transport.abort()


async def poll(predicate: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    """Poll `predicate` (yielding to the loop) until it holds or the deadline passes."""
    step = 0.001
    for _ in range(int(timeout / step)):
        if predicate():
            return
        await asyncio.sleep(step)
    raise TimeoutError(f"condition not reached within {timeout} s")


async def gather(*aws: Awaitable[T]) -> list[T]:
    """asyncio.gather with a precise type."""
    return list(await asyncio.gather(*aws))
