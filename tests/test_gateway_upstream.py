"""The engine connection pool over loopback, against raw scripted servers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from gateway.engine_protocol import ClientSession
from gateway.errors import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamPoolExhausted,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.messages import NOT_FORWARDED, not_forwarded
from gateway.protocol import RequestHead, ServerSession, Signal
from gateway.upstream import EngineHead, Outgoing, UpstreamConfig, UpstreamPool
from tests.gateway_support import poll, run

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Raw"], Awaitable[None]]


@dataclass
class Raw:
    """A loopback server whose every connection runs `script`."""

    script: Script
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    eofs: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request (head and Content-Length body)."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length) if length else b""
        self.requests.append(head + body)
        return head + body

    async def wait_eof(self, reader: asyncio.StreamReader) -> None:
        """Until the client closes; counts it."""
        with contextlib.suppress(OSError):
            await reader.read()
        self.eofs += 1


@contextlib.asynccontextmanager
async def raw_server(script: Script) -> AsyncIterator[Raw]:
    """Start a raw server running `script` per connection."""
    raw = Raw(script)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw.connections += 1
        try:
            await script(reader, writer, raw)
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    raw.port = int(server.sockets[0].getsockname()[1])
    try:
        yield raw
    finally:
        server.close()


async def keep_alive_ok(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
    """Answer `ok` to every request on the connection."""
    while True:
        await raw.read_request(r)
        w.write(OK)


async def get(pool: UpstreamPool, port: int, body: bytes = b"") -> tuple[int, bytes]:
    """One request through the pool; status and whole body."""
    answer = await pool.request("127.0.0.1", port, b"POST", b"/x", [], body)
    try:
        data = await answer.read_all(1 << 20)
        assert data is not None
        return answer.status, data
    finally:
        answer.close()


def test_connections_are_reused_when_both_sides_are_done() -> None:
    async def main() -> None:
        async with raw_server(keep_alive_ok) as raw:
            pool = UpstreamPool()
            for _ in range(5):
                assert await get(pool, raw.port, b"hello") == (200, b"ok")
            assert raw.connections == 1
            stats = pool.statistics()[f"127.0.0.1:{raw.port}"]
            assert (stats.connected, stats.reused, stats.idle, stats.active) == (1, 4, 1, 0)
            assert raw.requests[0].endswith(b"content-length: 5\r\n\r\nhello")
            assert f"host: 127.0.0.1:{raw.port}".encode() in raw.requests[0]
            await pool.close()

    run(main())


def test_an_answer_not_read_to_the_end_is_never_reused() -> None:
    async def main() -> None:
        async def big(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            while True:
                await raw.read_request(r)
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"a" * 100000)

        async with raw_server(big) as raw:
            pool = UpstreamPool()
            answer = await pool.request("127.0.0.1", raw.port, b"GET", b"/", [], b"")
            await answer.receive()
            answer.close()
            assert (await get(pool, raw.port))[0] == 200
            assert raw.connections == 2
            await pool.close()

    run(main())


def test_answer_asking_to_close_is_not_reused() -> None:
    async def main() -> None:
        async def closing(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            await raw.wait_eof(r)

        async with raw_server(closing) as raw:
            pool = UpstreamPool()
            assert await get(pool, raw.port) == (200, b"ok")
            assert await get(pool, raw.port) == (200, b"ok")
            assert raw.connections == 2
            await pool.close()

    run(main())


def test_refused_connection_is_a_connect_error() -> None:
    async def main() -> None:
        async with raw_server(keep_alive_ok) as raw:
            port = raw.port
        pool = UpstreamPool()
        with pytest.raises(UpstreamConnectError):
            await pool.request("127.0.0.1", port, b"GET", b"/", [], b"")
        assert pool.statistics()[f"127.0.0.1:{port}"].active == 0

    run(main())


def test_silent_engine_is_a_read_timeout_and_its_connection_is_dropped() -> None:
    async def main() -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            await raw.wait_eof(r)

        async with raw_server(silent) as raw:
            pool = UpstreamPool(UpstreamConfig(read_timeout_s=0.2))
            with pytest.raises(UpstreamTimeout):
                await pool.request("127.0.0.1", raw.port, b"GET", b"/", [], b"")
            await poll(lambda: raw.eofs == 1)
            await pool.close()

    run(main())


def test_engine_closing_an_idle_connection_is_retried_on_a_new_one() -> None:
    async def main() -> None:
        async def once(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            w.write(OK)  # keep-alive in words, but the engine's keep-alive timer closes it

        async with raw_server(once) as raw:
            pool = UpstreamPool()
            assert await get(pool, raw.port) == (200, b"ok")
            # Depending on timing the pool sees the close before reuse, or retries after.
            assert await get(pool, raw.port) == (200, b"ok")
            assert raw.connections == 2
            await pool.close()

    run(main())


def test_a_reused_connection_closed_before_any_answer_byte_is_sent_once_more_on_a_new_one() -> None:
    """The keep-alive race (docs/on-demand-gateway.md, "Resending"): the request went out on
    a quiet keep-alive connection, which the engine closed without a byte of answer.  It goes
    once more on a new connection, and the client gets the answer."""

    async def main() -> None:
        async def drop_second(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            if raw.connections == 1:
                w.write(OK)
                await raw.read_request(r)  # read, then the connection closes unanswered
            else:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nnew")
                await raw.wait_eof(r)

        async with raw_server(drop_second) as raw:
            pool = UpstreamPool()
            assert await get(pool, raw.port) == (200, b"ok")
            assert await get(pool, raw.port, b"second") == (200, b"new")
            stats = pool.statistics()[f"127.0.0.1:{raw.port}"]
            assert stats.retried == 1 and raw.connections == 2
            assert [r.endswith(b"second") for r in raw.requests] == [False, True, True]
            await pool.close()

    run(main())


def test_a_request_a_new_connection_closes_unanswered_is_never_sent_again() -> None:
    """The other side: on a connection opened for it, a request the engine read and closed
    without a byte of answer may have been acted on; the error, not a second copy."""

    async def main() -> None:
        async def drop(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)  # read, then the connection closes unanswered

        async with raw_server(drop) as raw:
            pool = UpstreamPool()
            with pytest.raises(UpstreamClosed) as info:
                await get(pool, raw.port, b"only")
            assert info.value.before_response and not info.value.unsent
            stats = pool.statistics()[f"127.0.0.1:{raw.port}"]
            assert stats.retried == 0 and raw.connections == 1 and len(raw.requests) == 1
            await pool.close()

    run(main())


def test_a_reused_connection_cut_mid_answer_is_never_sent_again() -> None:
    """An answer begun is the engine's: a byte of it, and the request is not resent."""

    async def main() -> None:
        async def cut_second(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            w.write(OK)
            await raw.read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-")
            await w.drain()

        async with raw_server(cut_second) as raw:
            pool = UpstreamPool()
            assert await get(pool, raw.port) == (200, b"ok")
            with pytest.raises(UpstreamClosed) as info:
                await get(pool, raw.port, b"second")
            assert not info.value.before_response
            assert pool.statistics()[f"127.0.0.1:{raw.port}"].retried == 0
            assert raw.connections == 1
            await pool.close()

    run(main())


STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"keep-alive: timeout=5, max=100\r\n\r\n"
    b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
)


def test_an_engine_that_ends_the_connection_after_a_stream_is_learned() -> None:
    """llama.cpp's llama-server says keep-alive on a streamed answer, then closes the
    connection without reading the next request.  The request that met it goes once more on
    a new connection; from then on a stream's connection is not kept (no second retry)."""

    async def main() -> None:
        async def stream_then_close(
            r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw
        ) -> None:
            while True:
                request = await raw.read_request(r)
                if not request.endswith(b"stream"):
                    w.write(OK)
                    continue
                w.write(STREAM)
                await w.drain()
                await raw.release.wait()  # closes (unread) once the next request was sent
                return

        async with raw_server(stream_then_close) as raw:
            pool = UpstreamPool()
            assert await get(pool, raw.port, b"stream") == (200, b"data: [DONE]\n\n")
            (engine,) = pool._engines.values()
            assert not engine.streams_end and len(engine.idle) == 1

            async def release_once_sent() -> None:
                # Taken from the pool: written in the same step, before the engine closes.
                await poll(lambda: not engine.idle)
                raw.release.set()

            releasing = asyncio.create_task(release_once_sent())
            assert await get(pool, raw.port, b"plain") == (200, b"ok")
            await releasing
            assert engine.streams_end
            stats = pool.statistics()[f"127.0.0.1:{raw.port}"]
            assert stats.retried == 1 and raw.connections == 2
            # The next stream's connection is closed by us, not offered to the next request.
            raw.release = asyncio.Event()
            assert await get(pool, raw.port, b"stream") == (200, b"data: [DONE]\n\n")
            assert len(engine.idle) == 0
            raw.release.set()
            assert await get(pool, raw.port, b"plain") == (200, b"ok")
            stats = pool.statistics()[f"127.0.0.1:{raw.port}"]
            assert stats.retried == 1 and raw.connections == 3
            await pool.close()

    run(main())


def test_keep_alive_timeout_and_max_are_honoured() -> None:
    """An engine announcing a 1 s idle timeout is not reused (our margin is 1 s); one
    announcing `max=0` allows no further request; `timeout=3` is reused for 2 s."""

    async def main() -> None:
        def answering(keep_alive: bytes) -> Script:
            async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
                while True:
                    await raw.read_request(r)
                    w.write(
                        b"HTTP/1.1 200 OK\r\nkeep-alive: " + keep_alive
                        + b"\r\ncontent-length: 2\r\n\r\nok"
                    )  # fmt: skip

            return script

        cases = ((b"timeout=1", 2), (b"timeout=5, max=0", 2), (b"timeout=3", 1))
        for announced, connections in cases:
            async with raw_server(answering(announced)) as raw:
                pool = UpstreamPool()
                assert await get(pool, raw.port) == (200, b"ok")
                (engine,) = pool._engines.values()
                if engine.idle:
                    (conn,) = engine.idle
                    assert conn.expires - conn.loop.time() == pytest.approx(2.0, abs=0.1)
                assert await get(pool, raw.port) == (200, b"ok")
                assert raw.connections == connections, announced
                await pool.close()

    run(main())


def test_an_idle_connection_the_engine_closed_before_the_request_is_not_used() -> None:
    """This side of the moment: the engine's close reached our kernel before the request
    went out (the event loop had not read it yet); the kernel says so (`quiet`), the request
    goes on a new connection, and the engine sees it once."""

    async def main() -> None:
        closed = asyncio.Event()

        async def close_after(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            w.write(OK)
            await w.drain()
            w.transport.close()  # FIN, as a killed engine's kernel sends
            closed.set()

        async with raw_server(close_after) as raw:
            pool = UpstreamPool()
            assert await get(pool, raw.port) == (200, b"ok")
            await closed.wait()
            (engine,) = pool._engines.values()
            (conn,) = engine.idle
            conn.transport.pause_reading()  # the event loop does not see the close ...
            await poll(lambda: not conn.quiet())  # ... the kernel has it
            assert conn.alive
            assert await get(pool, raw.port, b"second") == (200, b"ok")
            stats = pool.statistics()[f"127.0.0.1:{raw.port}"]
            assert stats.retried == 0 and raw.connections == 2
            assert sum(r.endswith(b"second") for r in raw.requests) == 1
            await pool.close()

    run(main())


def test_a_refused_connection_never_reached_the_engine() -> None:
    async def main() -> None:
        async with raw_server(keep_alive_ok) as raw:
            port = raw.port
        pool = UpstreamPool()
        with pytest.raises(UpstreamConnectError) as info:
            await pool.request("127.0.0.1", port, b"POST", b"/", [], b"x")
        assert info.value.unsent
        await pool.close()
        with pytest.raises(UpstreamConnectError) as closed:
            await pool.request("127.0.0.1", port, b"POST", b"/", [], b"x")
        assert not closed.value.unsent  # shutting down: nothing to wait for

    run(main())


def test_engine_closing_mid_body_is_upstream_closed() -> None:
    async def main() -> None:
        async def cut(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
            await w.drain()

        async with raw_server(cut) as raw:
            pool = UpstreamPool()
            answer = await pool.request("127.0.0.1", raw.port, b"GET", b"/", [], b"")
            with pytest.raises(UpstreamClosed):
                while await answer.receive():
                    pass
            answer.close()
            assert pool.statistics()[f"127.0.0.1:{raw.port}"].active == 0

    run(main())


def test_garbage_from_the_engine_is_a_protocol_error() -> None:
    async def main() -> None:
        async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            w.write(b"NOT HTTP AT ALL\r\n\r\n")
            await raw.wait_eof(r)

        async with raw_server(garbage) as raw:
            pool = UpstreamPool()
            with pytest.raises(UpstreamProtocolError):
                await pool.request("127.0.0.1", raw.port, b"GET", b"/", [], b"")

    run(main())


def test_cancelling_a_request_aborts_its_connection() -> None:
    async def main() -> None:
        async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            raw.release.set()
            await raw.wait_eof(r)

        async with raw_server(hold) as raw:
            pool = UpstreamPool()
            task = asyncio.create_task(pool.request("127.0.0.1", raw.port, b"GET", b"/", [], b""))
            await raw.release.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await poll(lambda: raw.eofs == 1)
            stats = pool.statistics()[f"127.0.0.1:{raw.port}"]
            assert (stats.active, stats.idle) == (0, 0)

    run(main())


def test_busy_engine_slots_bound_the_connections() -> None:
    async def main() -> None:
        async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            await raw.release.wait()
            w.write(OK)
            await raw.wait_eof(r)

        async with raw_server(hold) as raw:
            config = UpstreamConfig(max_connections_per_engine=2, connect_timeout_s=0.2)
            pool = UpstreamPool(config)
            first = [asyncio.create_task(get(pool, raw.port)) for _ in range(2)]
            await poll(lambda: len(raw.requests) == 2)
            with pytest.raises(UpstreamPoolExhausted):
                await get(pool, raw.port)
            raw.release.set()
            assert [await t for t in first] == [(200, b"ok"), (200, b"ok")]
            assert raw.connections == 2
            await pool.close()

    run(main())


def test_a_slot_goes_to_the_request_waiting_for_it_and_then_back_to_the_pool() -> None:
    async def main() -> None:
        async def gated(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            while True:
                await raw.read_request(r)
                await raw.release.wait()
                w.write(OK)

        async with raw_server(gated) as raw:
            # Bounded, for a failure only: a slot never given back shows as exhausted.
            config = UpstreamConfig(max_connections_per_engine=1, connect_timeout_s=2.0)
            pool = UpstreamPool(config)
            first = asyncio.create_task(get(pool, raw.port))
            await poll(lambda: len(raw.requests) == 1)
            second = asyncio.create_task(get(pool, raw.port))  # waits for the one slot
            await poll(lambda: bool(pool._engines[("127.0.0.1", raw.port)].slot_waiters))
            raw.release.set()
            assert await first == (200, b"ok")
            assert await second == (200, b"ok")  # the slot was handed on
            for _ in range(3):  # then given back: nobody waits for it
                assert await get(pool, raw.port) == (200, b"ok")
            stats = pool.statistics()[f"127.0.0.1:{raw.port}"]
            assert (raw.connections, stats.active, stats.idle) == (1, 0, 1)
            await pool.close()

    run(main())


def test_idle_connections_expire() -> None:
    async def main() -> None:
        async with raw_server(keep_alive_ok) as raw:
            pool = UpstreamPool(UpstreamConfig(idle_expiry_s=0.1))
            assert await get(pool, raw.port) == (200, b"ok")
            key = f"127.0.0.1:{raw.port}"
            await poll(lambda: pool.statistics()[key].idle == 0)
            assert pool.statistics()[key].discarded == 1
            await pool.close()

    run(main())


def test_chunked_answer_body_arrives_whole() -> None:
    async def main() -> None:
        async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter, raw: Raw) -> None:
            await raw.read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
                w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            w.write(b"0\r\n\r\n")
            await raw.wait_eof(r)

        async with raw_server(chunked) as raw:
            pool = UpstreamPool()
            assert await get(pool, raw.port) == (200, b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n")
            await pool.close()

    run(main())


def test_a_request_alike_to_one_before_goes_out_as_forward_makes_it() -> None:
    """The express lane's requests carry what was sent for a request alike, kept with the
    memo of the client's head: the next one, to this engine or another, is sent as `forward`
    makes it (its own Host, its own body)."""

    async def body() -> None:
        client = ServerSession(max_header_bytes=4096, max_body_bytes=4096)
        async with raw_server(keep_alive_ok) as a, raw_server(keep_alive_ok) as b:
            pool = UpstreamPool(UpstreamConfig())
            for raw, payload in [(a, b"{}"), (a, b'{"x":1}'), (b, b"{}")]:
                client.receive(
                    b"POST /d/a/v1/x HTTP/1.1\r\nhost: gw\r\nx-k: v\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
                )
                head = client.next_event()
                assert isinstance(head, RequestHead)
                memo = client.known
                assert memo is not None  # made of this head, or this head is its
                drop = not_forwarded(head.headers, NOT_FORWARDED)
                if memo.derived is None:
                    memo.derived = EngineHead(b"/v1/x", drop)
                assert client.next_event() == payload
                assert client.next_event() is Signal.BODY_END
                request = Outgoing(head.method, head.headers, payload, memo.derived)
                await pool.open_idle("127.0.0.1", raw.port)
                count = len(raw.requests)
                sent = pool.send_now("127.0.0.1", raw.port, request)
                assert sent is not None
                await poll(lambda raw=raw, count=count: len(raw.requests) > count)  # type: ignore[misc]
                host = b"127.0.0.1:%d" % raw.port
                fresh = ClientSession(max_header_bytes=4096)
                forwarded = fresh.forward(head.method, b"/v1/x", host, head.headers, drop, payload)
                assert raw.requests[-1] == forwarded
                pool.finish(*sent, reuse=False)
                client.response_head(200, [(b"content-length", b"0")])
                client.end()
                client.start_next_cycle()
            await pool.close()

    run(body())
