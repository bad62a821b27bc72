"""The express lane (gateway.express) against the handler's path: the same bytes, every time.

Each scenario runs twice against a raw-bytes engine whose answers are scripted request by
request: once with the express lane and once without it (`GatewayConfig(express=False)`),
both with an idle engine connection ready so that the lane can take the first request.
What the client receives (request ids aside), whether its connection stays open, what the
engine saw and what the controller was told must be equal; and the lane must really have
carried the requests it should.  Both event loops run every scenario: asyncio's and uvloop,
which production uses.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import uvloop

from actors.ports import EngineHandle
from gateway import express
from gateway.access import Access
from gateway.app import Gateway, GatewayConfig
from gateway.engine_protocol import ClientSession
from gateway.server import Connection, HTTPServer, ServerConfig
from gateway.upstream import UpstreamConfig, UpstreamPool
from tests.gateway_support import ScriptedController, held, poll

T = TypeVar("T")
CHAT = b"/d/a/v1/chat/completions"
# Names the model the scripted deployment `a` serves: every request is checked against it,
# and its client name (`Gateway._lease_then_relay`, `ModelNames.named`).
JSON_BODY = b'{"model":"served-a","messages":[{"role":"user","content":"hi"}]}'
SERVED_BODY = JSON_BODY
STREAM_BODY = b'{"model":"served-a","messages":[{"role":"user","content":"hi"}],"stream":true}'
# Another model's name; the client's name, spaced; the served one, escaped and nested.
OTHER_BODY = JSON_BODY.replace(b'"served-a"', b'"g"')
CLIENT_NAME_BODY = b'{"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}'
ESCAPED_BODY = JSON_BODY.replace(b'"served-a"', b'"served\\u002da"')
NESTED_BODY = b'{"model":"g","metadata":{"model":"served-a"},"messages":[]}'
NO_MODEL_BODY = b'{"messages":[{"role":"user","content":"hi"}]}'
NUMBER_MODEL_BODY = b'{"model":5,"messages":[]}'
ANSWER = json.dumps({"id": "chatcmpl-1", "choices": [{"message": {"content": "Hi"}}]}).encode()
EVENT = b'data: {"choices":[{"delta":{"content":"t"}}]}\n\n'
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
RID = re.compile(rb"x-dgxmm-request-id: \d+\r\n")
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def request(body: bytes = JSON_BODY, target: bytes = CHAT, extra: bytes = b"") -> bytes:
    """A POST as a client library writes it."""
    return (
        b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (target, extra, len(body), body)
    )


MODELS_GET = b"GET /d/a/v1/models HTTP/1.1\r\nhost: gw\r\n\r\n"


def padded(size: int) -> bytes:
    """A body naming the served model, `size` bytes long."""
    pad = size - len(JSON_BODY) - len(b',"pad":""')
    return JSON_BODY[:-1] + b',"pad":"' + b"x" * pad + b'"}'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunk_hex(data: bytes) -> bytes:
    """A chunk with an upper-case size, which the gateway frames again."""
    return b"%X\r\n%s\r\n" % (len(data), data)


# --- the engine -------------------------------------------------------------------------------


@dataclass
class Engine:
    """Answers the n-th request with the n-th behaviour (the last one repeats)."""

    behaviours: list[str]
    seen: list[bytes] = field(default_factory=list)  # request bodies
    connections: int = 0
    disconnects: int = 0  # connections lost while an answer was being written or held
    blocked: asyncio.Event = field(default_factory=asyncio.Event)  # a flood's writes stalled
    release: asyncio.Event = field(default_factory=asyncio.Event)  # ends a "hold"
    flooded: int = 0  # bytes of a flood written so far
    paced: bool = False  # "events" wait for `ack` before each event but the first
    ack: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, OSError):
                    return
                length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
                self.seen.append(await reader.readexactly(length))
                n = len(self.seen) - 1
                behaviour = self.behaviours[min(n, len(self.behaviours) - 1)]
                if not await self.answer(behaviour, reader, writer):
                    return
        except OSError:
            self.disconnects += 1
        finally:
            writer.transport.abort()

    async def answer(
        self, behaviour: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Write one answer; False ends the connection."""
        sse = SSE_HEAD
        if behaviour == "ok":
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-engine: raw\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
            )
        elif behaviour == "error":
            body = b'{"error":{"message":"bad request","code":400}}'
            writer.write(
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
        elif behaviour == "stream":
            writer.write(sse + chunk(EVENT) + chunk(EVENT))
            await writer.drain()
            writer.write(chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif behaviour.startswith("events"):  # a write per event; "-cut", "-crash": no end
            frame = chunk_hex if behaviour == "events-hex" else chunk
            last = {"events-cut": b'data: {"part', "events-crash": EVENT}.get(behaviour)
            last = last or b"data: [DONE]\n\n"
            end = b"" if behaviour in ("events-cut", "events-crash") else b"0\r\n\r\n"
            # Sizes 2f, 4a, 2f and c or e: each has a letter, upper-case for "events-hex".
            writes = [sse + frame(EVENT), frame(EVENT + b"x" * 27), frame(EVENT), frame(last) + end]
            for n, data in enumerate(writes):
                if self.paced and n:  # until the client got the previous event
                    await self.ack.wait()
                    self.ack.clear()
                writer.write(data)
                await writer.drain()
            if not end:
                return False
        elif behaviour == "stream-close":  # llama-server: keep-alive said, then closed
            writer.write(sse + chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            writer.transport.close()
            return False
        elif behaviour == "drop":  # a keep-alive connection closed as the request came
            writer.transport.close()
            return False
        elif behaviour == "garbage":
            writer.write(b"HTTP/1.1 2x0 OK\r\n\r\n")
        elif behaviour == "silent":
            await reader.read(1)  # until the gateway gives up on us
            return False
        elif behaviour == "cut-stream":
            writer.write(sse + chunk(EVENT) + chunk(b'data: {"part'))
            await writer.drain()
            return False
        elif behaviour == "cut-length":
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n" + ANSWER[:10]
            )
            await writer.drain()
            return False
        elif behaviour == "hold":  # one event, then wait for `release` or the gateway to go
            writer.write(sse + chunk(EVENT))
            await writer.drain()
            if not await held(self.release, reader):
                self.disconnects += 1
                return False
            writer.write(chunk(EVENT) + b"0\r\n\r\n")
        elif behaviour == "flood":  # 32 MiB of events, noting when the gateway stops reading
            piece = chunk(b"data: " + b"x" * (256 * 1024 - 8) + b"\n\n")
            writer.write(sse)
            while self.flooded < 32 * 1024 * 1024:
                writer.write(piece)
                self.flooded += len(piece)
                try:
                    async with asyncio.timeout(0.5):
                        await writer.drain()
                except TimeoutError:
                    self.blocked.set()
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


# --- the client --------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one scenario produced, in the terms both paths must agree on."""

    answers: list[bytes]
    closed: bool  # the gateway closed the client's connection after the last answer
    seen: list[bytes]
    unreachable: list[str]
    engine_failures: int
    counters: tuple[int, int, int]  # the server's requests, requests active, clients gone
    express: int = 0  # requests the express lane relayed (not compared)

    def comparable(self) -> tuple[object, ...]:
        return (
            self.answers, self.closed, self.seen, self.unreachable, self.engine_failures,
            self.counters,
        )  # fmt: skip


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """One whole answer (head and framed body) as raw bytes, request id removed; what
    arrived when the connection ends in the middle of it."""
    got: list[bytes] = []
    try:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        if got[0].startswith(b"HTTP/1.1 100"):
            got.append(await reader.readuntil(b"\r\n\r\n"))
        head = got[-1].lower()
        if b"transfer-encoding: chunked" in head:
            while True:
                line = await reader.readuntil(b"\r\n")
                got.append(line)
                size = int(line[:-2], 16)
                got.append(await reader.readexactly(size + 2))
                if size == 0:
                    break
        else:
            match = re.search(rb"content-length: (\d+)", head)
            got.append(await reader.readexactly(int(match.group(1)) if match else 0))
    except asyncio.IncompleteReadError as exc:
        got.append(exc.partial)
    except OSError:
        pass
    return RID.sub(b"x-dgxmm-request-id: N\r\n", b"".join(got))


def payload(answer: bytes) -> bytes:
    """The body of a chunked answer without its framing (pieces may be cut anywhere)."""
    rest = answer.partition(b"\r\n\r\n")[2]
    out = []
    while rest:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line, 16)
        out.append(rest[:size])
        rest = rest[size + 2 :]
    return b"".join(out)


async def at_eof(reader: asyncio.StreamReader) -> bool:
    """Whether the gateway closed the connection (waits briefly for a close to show)."""
    try:
        async with asyncio.timeout(0.2):
            return await reader.read(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


Client = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Rig"], Awaitable[list[bytes]]]


@dataclass
class Rig:
    engine: Engine
    controller: ScriptedController
    gateway: Gateway
    http: HTTPServer


def connection(rig: Rig) -> Connection:
    """The gateway's one client connection."""
    (conn,) = rig.http._connections.values()
    return conn


async def scenario(
    behaviours: list[str],
    client: Client,
    *,
    express: bool,
    server: ServerConfig | None = None,
    upstream: UpstreamConfig | None = None,
    grace_s: float = 2.0,
    warm: bool = True,
    engine_down: bool = False,
    access: Access | None = None,
) -> Outcome:
    """Run `client` on one connection to a gateway in front of a scripted engine.

    `warm`: an idle engine connection is ready before the first request; `engine_down`: the
    engine stopped listening before it (connections are refused)."""
    engine = Engine(behaviours)
    listener = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    engine.port = int(listener.sockets[0].getsockname()[1])
    controller = ScriptedController()
    handle = EngineHandle(deployment_id="a", host="127.0.0.1", port=engine.port, runtime_id="t")
    controller.add("a", handle=handle)
    gateway = Gateway(
        controller,
        config=GatewayConfig(express=express),
        upstream=UpstreamPool(upstream or UpstreamConfig()),
        clock=lambda: 1700000000.0,
        access=access,
    )
    http = await gateway.serve("127.0.0.1", 0, server)
    if warm:
        await gateway.upstream.open_idle("127.0.0.1", engine.port)
    if engine_down:
        listener.close()
        await listener.wait_closed()
    reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
    try:
        rig = Rig(engine, controller, gateway, http)
        answers = await client(reader, writer, rig)
        closed = await at_eof(reader)
        await poll(lambda: controller.in_flight["a"] == 0)  # every lease was given back
        await poll(lambda: http.statistics().requests_active == 0)
        stats = http.statistics()
    finally:
        writer.transport.abort()
        await gateway.shutdown(grace_s)
        listener.close()
        for task in list(engine.tasks):
            task.cancel()
        await asyncio.gather(*engine.tasks, return_exceptions=True)
    return Outcome(
        answers,
        closed,
        engine.seen,
        controller.unreachable,
        gateway.engine_failures,
        (stats.requests_total, stats.requests_active, stats.clients_gone),
        gateway.relayed_express,
    )


def both(run: Callable[[bool], Coroutine[Any, Any, T]], loop: str) -> tuple[T, T]:
    """The scenario with the express lane and without, on the named event loop."""
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        fast = runner.run(asyncio.wait_for(run(True), 30))
        slow = runner.run(asyncio.wait_for(run(False), 30))
    return fast, slow


def sequential(*requests: bytes) -> Client:
    """Send each request after the previous answer."""

    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        answers = []
        for data in requests:
            writer.write(data)
            answers.append(await read_answer(reader))
        return answers

    return client


# --- scenarios ---------------------------------------------------------------------------------

SEQUENCES = {
    # behaviours of the engine, requests of the client, requests the lane must carry
    "answers": (["ok"], [request()] * 3, 3),
    "engine errors": (["error", "ok"], [request(), request()], 2),
    "streams": (["stream"], [request(STREAM_BODY)] * 2, 2),
    "events one by one": (["events"], [request(STREAM_BODY)] * 2, 2),
    "events in upper-case hex": (["events-hex"], [request(STREAM_BODY)] * 2, 2),
    "events, then a cut mid-event": (["events-cut", "ok"], [request(STREAM_BODY), request()], 2),
    # The engine read the request and closed unanswered: on a reused connection (warm) the
    # keep-alive race, sent once more on a new one; on a new one (cold) it may have seen it,
    # so its error and never a second copy (docs/on-demand-gateway.md, "Resending").
    "closed after the request, then a new one": (["drop", "ok"], [request(), request()], 1),
    "closed after the request, twice": (["drop", "drop", "ok"], [request(), request()], 1),
    # llama.cpp's llama-server ends the connection after every stream, keep-alive or not.
    "streams from an engine that ends the connection": (
        ["stream-close"],
        [request(STREAM_BODY)] * 3 + [request()],
        4,
    ),
    # Model names: another model's is refused on both paths in every state, and so after a
    # failed request (the engine being checked); what the lane cannot vouch for it hands over.
    "another model's name": (["ok"], [request(OTHER_BODY), request()], 1),
    "another model's name after a failed request": (
        ["drop", "drop", "ok"],
        [request(), request(OTHER_BODY), request()],
        1,
    ),
    # The deployment's name: the handler sends it on as the served one (`with_model`).
    "the client's name, spaced": (["ok"], [request(CLIENT_NAME_BODY)], 0),
    "the served name, escaped": (["ok"], [request(ESCAPED_BODY), request()], 2),
    "another model's name, the served one nested": (["ok"], [request(NESTED_BODY)], 0),
    "no model named": (["ok"], [request(NO_MODEL_BODY), request()], 2),
    "a model that is not a name": (["ok"], [request(NUMBER_MODEL_BODY), request()], 1),
    "not JSON": (["ok"], [request(b'{"model":"served-a",'), request()], 1),
    "garbage head": (["garbage", "ok"], [request(), request()], 2),
    "stream cut mid-event": (["cut-stream", "ok"], [request(STREAM_BODY), request()], 2),
    "connection: close": (["ok"], [request(extra=b"connection: close\r\n")], 1),
    "not inference": (["ok"], [request(target=b"/d/a/v1/models"), request()], 1),
    "unknown deployment": (["ok"], [request(target=b"/d/zz/v1/chat/completions")], 0),
    # The second of two alike is read whole at once (`whole_request`): the handler gets its
    # body with it.
    "unknown deployment, twice": (["ok"], [request(target=b"/d/zz/v1/chat/completions")] * 2, 0),
    "not inference, twice": (["ok"], [request(target=b"/d/a/v1/models")] * 2 + [request()], 1),
    "probe": (["ok"], [request(extra=b"x-dgxmm-health-check: 1\r\n"), request()], 1),
    # The second probe is read whole at once: the handler still answers it, not the engine.
    "probe, twice": (["ok"], [request(extra=b"x-dgxmm-health-check: 1\r\n")] * 2, 0),
    "body too large": (["ok"], [request(b"x" * 2048)], 0),
    "body over the lane's bound": (["ok"], [request(padded(1000)), request(padded(400))], 1),
    "query string": (["ok"], [request(target=CHAT + b"?a=1"), request()], 2),
    # A head without a length between two alike: it has no memo, and the route kept with the
    # last memo is not its route.
    "a head without a length between": (["ok"], [request(), MODELS_GET, request()], 2),
}


# Requests the lane carries from a cold pool where it differs from a warm one.
COLD_CARRIED: dict[str, int] = {
    # the first drop is on a new connection: its 502 from the lane, not handed over
    "closed after the request, then a new one": 2,
    "closed after the request, twice": 2,
    "another model's name after a failed request": 2,
}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("pool", ["warm", "cold"])
@pytest.mark.parametrize("name", SEQUENCES)
def test_the_express_lane_answers_as_the_handler_does(
    name: str, pool: str, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    behaviours, requests, carried = SEQUENCES[name]
    if pool == "cold":
        carried = COLD_CARRIED.get(name, carried)
    config = ServerConfig(max_body_bytes=1024)
    monkeypatch.setattr(express, "MAX_BODY_BYTES", 512)

    async def go(express: bool) -> Outcome:
        return await scenario(
            behaviours, sequential(*requests), express=express, server=config, warm=pool == "warm"
        )

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert (fast.express, slow.express) == (carried, 0)


KEY = "dgxmm-gw-express-test-key"
AUTH = b"authorization: Bearer %s\r\n" % KEY.encode()
# Alike to AUTH but for one byte of the key: the memo of a head must not carry it through.
NEAR = b"authorization: Bearer %s\r\n" % (KEY[:-1] + "X").encode()
KEYED = {
    # requests of the client, requests the lane must carry
    "the key": ([request(extra=AUTH)] * 3, 3),
    "no key": ([request()] * 2, 0),
    "a wrong key, then the key": ([request(extra=NEAR), request(extra=AUTH)], 1),
    "the key, then one byte off": ([request(extra=AUTH), request(extra=NEAR)], 1),
    "the key, then none": ([request(extra=AUTH), request(), request(extra=AUTH)], 2),
    "the scheme in capitals": ([request(extra=AUTH.replace(b"Bearer", b"BEARER"))], 1),
    "another scheme": ([request(extra=AUTH.replace(b"Bearer", b"Basic"))], 0),
    "a probe without the key": ([request(extra=b"x-dgxmm-health-check: 1\r\n")], 0),
    "models without the key": ([MODELS_GET], 0),
    "an unknown deployment without the key": ([request(target=b"/d/zz/v1/chat/completions")], 0),
}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("name", KEYED)
def test_the_gateway_key_is_checked_alike_on_both_paths(name: str, loop: str) -> None:
    requests, carried = KEYED[name]

    async def go(express: bool) -> Outcome:
        access = Access([KEY])
        return await scenario(["ok"], sequential(*requests), express=express, access=access)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert (fast.express, slow.express) == (carried, 0)
    refused = [a for a in fast.answers if a.startswith(b"HTTP/1.1 401 ")]
    assert len(fast.seen) == carried and len(refused) == len(requests) - carried
    assert not any(KEY.encode() in seen for seen in fast.seen)  # the key stops at the gateway
    for answer in refused:
        assert b"www-authenticate: Bearer\r\n" in answer
        assert b'"code":"invalid_api_key"' in answer and KEY.encode() not in answer


@pytest.mark.parametrize("loop", LOOPS)
def test_a_retired_key_is_refused_on_a_connection_that_used_it_before(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        answers = []
        for keys in ([KEY, "the-next-key"], ["the-next-key"]):
            assert rig.gateway.access is not None
            rig.gateway.access.set_keys(keys)  # a rotation: the overlap, then the old one goes
            writer.write(request(extra=AUTH))
            answers.append(await read_answer(reader))
        return answers

    async def go(express: bool) -> Outcome:
        return await scenario(["ok"], client, express=express, access=Access([KEY]))

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert [a[:12] for a in fast.answers] == [b"HTTP/1.1 200", b"HTTP/1.1 401"]
    assert len(fast.seen) == 1 and fast.express == 1


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("pool", ["warm", "cold"])
def test_a_request_that_never_reached_its_engine_waits_for_the_restart_on_both_paths(
    loop: str, pool: str
) -> None:
    """The engine is gone (connections refused; warm: the idle connection to it was seen
    closed first): the request is not an error but waits for the engine like a request to
    a stopped model, from its arrival (`waited_s`), and the new engine answers it, once."""
    restarted: list[Engine] = []

    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        rig.controller.suspect_on_unreachable = True
        for task in rig.engine.tasks:  # killed: its connections go with it
            task.cancel()
        idle = [c for e in rig.gateway.upstream._engines.values() for c in e.idle]
        await poll(lambda: all(not c.quiet() for c in idle))
        writer.write(request())
        await poll(lambda: len(rig.controller.pending("a")) == 1)
        assert rig.controller.deployments["a"].state == "starting"
        engine = Engine(["ok"])
        restarted.append(engine)
        listener = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
        port = int(listener.sockets[0].getsockname()[1])
        handle = EngineHandle(deployment_id="a", host="127.0.0.1", port=port, runtime_id="t2")
        rig.controller.make_ready("a", handle)
        try:
            return [await read_answer(reader)]
        finally:
            listener.close()

    async def go(express: bool) -> Outcome:
        return await scenario(
            ["ok"], client, express=express, warm=pool == "warm", engine_down=True
        )

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.answers[0].startswith(b"HTTP/1.1 200 ") and fast.answers[0].endswith(ANSWER)
    assert fast.unreachable == ["a"] and fast.seen == []
    assert [e.seen for e in restarted] == [[JSON_BODY], [JSON_BODY]]  # once, on each path


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("exited", [True, False])
def test_a_request_closed_unanswered_is_sent_again_only_if_its_engine_had_exited_before(
    loop: str, exited: bool
) -> None:
    """Docker's port proxy accepts a connection for a dead container and then closes it: the
    request was closed before any answer byte, and only the runtime's word that the engine
    had exited before the request went out (`Controller.exited_before`) makes it one that
    never reached the engine.  Scripted here: the same engine answers the second send.  On a
    new connection: a reused one closed so is the keep-alive race, sent once more anyway."""

    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        rig.controller.engine_exited = exited
        rig.controller.suspect_on_unreachable = True
        handle = rig.controller.deployments["a"].handle
        assert handle is not None
        writer.write(request(SERVED_BODY))
        if exited:  # it waits for the engine (here: the same one, ready again)
            await poll(lambda: len(rig.controller.pending("a")) == 1)
            rig.controller.make_ready("a", handle)
        answers = [await read_answer(reader)]
        assert rig.controller.exit_questions == ["t"]
        return answers

    async def go(express: bool) -> Outcome:
        return await scenario(["drop", "ok"], client, express=express, warm=False)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    if exited:
        assert fast.answers[0].startswith(b"HTTP/1.1 200 ") and fast.seen == [SERVED_BODY] * 2
    else:
        assert fast.answers[0].startswith(b"HTTP/1.1 502 ") and fast.seen == [SERVED_BODY]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("behaviour", ["drop", "cut-length", "silent"])
def test_a_request_the_engine_may_have_seen_gets_its_error_and_is_never_sent_twice(
    loop: str, behaviour: str
) -> None:
    """The other side of the moment: the request reached the engine, which then failed
    before answering ("drop"), mid-answer ("cut-length") or by silence ("silent", past the
    read timeout).  The client gets its error; the engine counted one request, the
    controller was asked for no wait, even though it stops serving at once.  On a new
    connection: on a reused one, "drop" is the keep-alive race, sent once more."""

    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        rig.controller.suspect_on_unreachable = True
        writer.write(request())
        return [await read_answer(reader)]

    async def go(express: bool) -> Outcome:
        config = UpstreamConfig(read_timeout_s=0.3)
        return await scenario([behaviour], client, express=express, upstream=config, warm=False)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.seen == [JSON_BODY] and fast.engine_failures == 1
    if behaviour == "cut-length":  # the answer had begun: left incomplete
        assert fast.closed and fast.answers[0].endswith(ANSWER[:10])
    else:
        assert fast.answers[0].startswith(b"HTTP/1.1 502 ")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_leaves_while_the_lane_connects_gives_everything_back_at_once(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opening = asyncio.Event()
    connect = UpstreamPool._connect

    async def slow_connect(self: UpstreamPool, host: str, port: int) -> Any:
        opening.set()
        await asyncio.Event().wait()  # an engine that never accepts: until cancelled
        return await connect(self, host, port)  # pragma: no cover - never gets here

    monkeypatch.setattr(UpstreamPool, "_connect", slow_connect)

    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request())
        await opening.wait()
        assert rig.gateway.exchanges and rig.controller.in_flight["a"] == 1
        writer.transport.abort()
        stats = rig.gateway.upstream.statistics
        # The lease, the exchange and the engine's slot come back at once, not at the
        # connect timeout (10 s).
        await poll(lambda: not rig.gateway.exchanges, timeout=2.0)
        await poll(lambda: all(e.active == 0 for e in stats().values()), timeout=2.0)
        assert rig.controller.in_flight["a"] == 0
        return []

    async def go() -> Outcome:
        return await scenario(["ok"], client, express=True, warm=False)

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        outcome = runner.run(asyncio.wait_for(go(), 30))
    assert outcome.seen == [] and outcome.unreachable == []
    assert outcome.counters == (1, 0, 1)  # one request, none active, its client gone


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stream_cut_with_content_length_closes_the_connection(loop: str) -> None:
    async def go(express: bool) -> Outcome:
        return await scenario(["cut-length"], sequential(request()), express=express)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.closed and fast.answers[0].endswith(ANSWER[:10])
    assert fast.engine_failures == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_silent_past_the_read_timeout_gets_a_502(loop: str) -> None:
    async def go(express: bool) -> Outcome:
        config = UpstreamConfig(read_timeout_s=0.3)
        return await scenario(["silent"], sequential(request()), express=express, upstream=config)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.answers[0].startswith(b"HTTP/1.1 502 ") and b"engine_unreachable" in fast.answers[0]


@pytest.mark.parametrize("loop", LOOPS)
def test_pipelined_requests_are_answered_in_order(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request() + request(STREAM_BODY) + request())
        return [await read_answer(reader) for _ in range(3)]

    async def go(express: bool) -> Outcome:
        return await scenario(["ok", "stream", "ok"], client, express=express)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert len(fast.seen) == 3 and fast.express >= 1


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_that_comes_after_its_head_is_relayed(loop: str) -> None:
    data = request(JSON_BODY)
    head, body = data[: -len(JSON_BODY)], JSON_BODY

    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        answers = []
        stats = rig.http.statistics
        for n in range(1, 3):  # each piece in a read of its own, as a client writing twice
            writer.write(head)
            await poll(functools.partial(lambda k: stats().requests_total == k, n))
            writer.write(body[:5])
            await poll(lambda: connection(rig).session.cycle_bytes == len(head) + 5)
            writer.write(body[5:])
            answers.append(await read_answer(reader))
        return answers

    async def go(express: bool) -> Outcome:
        return await scenario(["ok"], client, express=express)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.express == 2


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_waiting_for_100_continue_gets_it(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        data = request(extra=b"expect: 100-continue\r\n")
        writer.write(data[: -len(JSON_BODY)])
        interim = await reader.readuntil(b"\r\n\r\n")
        writer.write(JSON_BODY)
        return [interim, await read_answer(reader)]

    async def go(express: bool) -> Outcome:
        return await scenario(["ok"], client, express=express)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.answers[0] == b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_hangs_up_mid_stream_stops_the_engine(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request(STREAM_BODY))
        head = await reader.readuntil(b"\r\n\r\n")
        first = await reader.readuntil(b"\n\n")
        writer.transport.abort()
        await poll(lambda: rig.engine.disconnects == 1)
        return [RID.sub(b"", head), first]

    async def go(express: bool) -> Outcome:
        return await scenario(["hold"], client, express=express)

    fast, slow = both(go, loop)
    assert fast.answers == slow.answers and fast.seen == slow.seen
    assert fast.express == 0  # gone, not relayed


@pytest.mark.parametrize("loop", LOOPS)
def test_shutdown_cuts_a_stream_with_an_error_event(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request(STREAM_BODY))
        # The answer's head and first event first: a shutdown begun before the head went
        # out would add `connection: close` to it on one path and not on the other.
        started = await reader.readuntil(b"\n\n\r\n")
        shutdown = asyncio.ensure_future(rig.gateway.shutdown(0.2))
        rest = await reader.readuntil(b"0\r\n\r\n")
        await shutdown
        return [RID.sub(b"x-dgxmm-request-id: N\r\n", started + rest)]

    async def go(express: bool) -> Outcome:
        return await scenario(["hold"], client, express=express, grace_s=0.1)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert b"dgxmm_shutting_down" in fast.answers[0] and fast.answers[0].endswith(b"0\r\n\r\n")
    assert fast.closed  # the server is closing: no next request


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_does_not_read_holds_the_engine_back(loop: str) -> None:
    """Bounded: the gateway stops reading the engine while the client's writes back up;
    the whole answer still arrives once the client reads."""

    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request(STREAM_BODY))
        await rig.engine.blocked.wait()
        held = rig.engine.flooded
        answer = await read_answer(reader)
        return [b"held %d of 32 MiB" % (held // (1024 * 1024)), b"%d" % len(payload(answer))]

    async def go(express: bool) -> Outcome:
        return await scenario(["flood"], client, express=express)

    fast, slow = both(go, loop)
    assert fast.answers[1] == slow.answers[1]
    for outcome in (fast, slow):
        held = int(outcome.answers[0].split()[1])
        assert held < 24, outcome.answers[0]  # at most both sockets' buffers (about 20 MiB)
    assert fast.express == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_never_reads_is_cut_at_the_write_timeout(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request(STREAM_BODY))
        await poll(lambda: rig.engine.disconnects == 1)  # the gateway gave up on us
        while await reader.read(1 << 20):  # what it had sent, then the end
            pass
        return [b"ended"]

    async def go(express: bool) -> Outcome:
        return await scenario(
            ["flood"], client, express=express, server=ServerConfig(write_timeout_s=0.5)
        )

    fast, slow = both(go, loop)
    assert fast.closed and slow.closed


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_not_in_by_its_deadline_gets_a_408(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request()[:-5])  # the head and most of the body, never the rest
        return [await read_answer(reader)]

    async def go(express: bool) -> Outcome:
        config = ServerConfig(body_timeout_s=0.3)
        return await scenario(["ok"], client, express=express, server=config)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.answers[0].startswith(b"HTTP/1.1 408 ") and fast.closed and not fast.seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_leaves_during_its_body_is_not_relayed(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request()[:-5])
        await poll(lambda: rig.http.statistics().requests_total == 1)  # the head is in
        writer.write_eof()
        return [await read_answer(reader)]

    async def go(express: bool) -> Outcome:
        return await scenario(["ok"], client, express=express)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.answers == [b""] and fast.closed and not fast.seen


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_sent_while_an_answer_streams_comes_next(loop: str) -> None:
    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        writer.write(request(STREAM_BODY))
        await poll(lambda: len(rig.engine.seen) == 1)
        writer.write(request())  # pipelined behind a stream still running
        await poll(lambda: connection(rig).stream.holding)
        rig.engine.release.set()
        return [await read_answer(reader), await read_answer(reader)]

    async def go(express: bool) -> Outcome:
        return await scenario(["hold", "ok"], client, express=express)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    assert fast.answers[1].endswith(ANSWER) and fast.express == 1


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    ("behaviour", "through"),
    [
        ("events", 2),  # the events read on their own: not the first nor the last
        ("events-hex", 0),  # framed again
        ("events-cut", 3),  # the last, half an event, too: the error event closes it
        ("events-crash", 3),  # the last whole: the error event follows it
    ],
)
def test_plain_chunks_go_to_the_client_as_the_engine_wrote_them(
    loop: str, behaviour: str, through: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []
    whole_chunk = ClientSession.whole_chunk

    def spy(self: ClientSession, data: bytes) -> int:
        start = whole_chunk(self, data)
        if start:
            taken.append(start)
        return start

    monkeypatch.setattr(ClientSession, "whole_chunk", spy)

    async def client(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rig: Rig
    ) -> list[bytes]:
        rig.engine.paced = True
        writer.write(request(STREAM_BODY))
        got = [await reader.readuntil(b"\r\n\r\n")]
        while True:  # chunk by chunk, telling the engine to write the next one
            got.append(await reader.readuntil(b"\r\n"))
            size = int(got[-1][:-2], 16)
            got.append(await reader.readexactly(size + 2))
            rig.engine.ack.set()
            if size == 0:
                return [RID.sub(b"x-dgxmm-request-id: N\r\n", b"".join(got))]

    async def go(express: bool) -> Outcome:
        return await scenario([behaviour], client, express=express)

    fast, slow = both(go, loop)
    assert fast.comparable() == slow.comparable()
    events = payload(fast.answers[0])
    assert events.count(b"data: ") >= 4
    if behaviour == "events-cut":
        assert b'data: {"part\n\ndata: {"error"' in events
    if behaviour == "events-crash":
        assert EVENT + b'data: {"error"' in events
    assert len(taken) == through
