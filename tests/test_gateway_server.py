"""The generic HTTP/1.1 server over real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import BodyTooLarge, ClientDisconnected
from gateway.server import HTTPServer, Request, Responder, ServerConfig
from tests.gateway_support import Client, poll, raw_exchange, run


@dataclass
class Probe:
    """What the test handler saw."""

    calls: int = 0
    chunks: list[int] = field(default_factory=list)
    cancelled: int = 0
    gone_seen: int = 0
    errors: list[str] = field(default_factory=list)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


def make_handler(probe: Probe):  # type: ignore[no-untyped-def]
    """A handler whose behaviour is chosen by the request target."""

    async def handler(request: Request, responder: Responder) -> None:
        probe.calls += 1
        target = request.target
        if target == b"/echo":
            body = await request.read_body()
            await responder.respond(200, [(b"content-type", b"text/plain")], body)
        elif target == b"/chunks":
            try:
                while chunk := await request.receive():
                    probe.chunks.append(len(chunk))
            except BodyTooLarge as exc:
                probe.errors.append(type(exc).__name__)
                raise
            await responder.respond(200, [], str(sum(probe.chunks)).encode())
        elif target == b"/wait":
            try:
                probe.waiting.set()
                await probe.release.wait()
                await responder.respond(200, [], b"released")
            except asyncio.CancelledError:
                probe.cancelled += 1
                if request.client_gone.is_set():
                    probe.gone_seen += 1
                raise
        elif target == b"/raise":
            raise RuntimeError("boom")
        elif target == b"/pieces":  # three writes in one round of the loop (no wait)
            await responder.start(200, [])
            for piece in (b"first ", b"second ", b"third"):
                await responder.send(piece)
            await responder.end()
        elif target == b"/noend":
            await responder.start(200, [])
            await responder.send(b"partial")
        elif target == b"/stream":
            await responder.start(200, [(b"content-type", b"text/event-stream")])
            await responder.flush()
            probe.waiting.set()
            try:
                while True:
                    await responder.send(b"x" * 65536)
            except ClientDisconnected as exc:
                probe.errors.append(type(exc).__name__)
                raise
            except asyncio.CancelledError:
                probe.cancelled += 1
                raise
        else:
            await responder.respond(404, [], b"nope")

    return handler


@contextlib.asynccontextmanager
async def serving(
    config: ServerConfig | None = None,
) -> AsyncIterator[tuple[HTTPServer, Probe]]:
    """A server with the test handler on a free port."""
    probe = Probe()
    server = HTTPServer(make_handler(probe), config or ServerConfig())
    await server.start("127.0.0.1", 0)
    try:
        yield server, probe
    finally:
        probe.release.set()
        await server.shutdown(2.0)


def status_of(raw: bytes) -> int:
    """The status code of the first response in raw bytes (0 when none)."""
    if not raw.startswith(b"HTTP/1.1 "):
        return 0
    return int(raw[9:12])


def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    async def main() -> None:
        async with serving() as (server, _):
            client = await Client.connect(server.port)
            for i in range(3):
                reply = await client.request("POST", "/echo", f"hello {i}".encode())
                assert (reply.status, reply.body) == (200, f"hello {i}".encode())
            stats = server.statistics()
            assert stats.connections_total == 1 and stats.requests_total == 3
            client.close()

    run(main())


def test_chunked_body_reaches_the_handler_in_pieces() -> None:
    async def main() -> None:
        async with serving() as (server, probe):
            body = b"".join(b"%x\r\n%s\r\n" % (1000, b"a" * 1000) for _ in range(50))
            raw = (
                b"POST /chunks HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                b"connection: close\r\n\r\n" + body + b"0\r\n\r\n"
            )
            got = await raw_exchange(server.port, raw)
            assert status_of(got) == 200 and got.endswith(b"50000")
            assert sum(probe.chunks) == 50000

    run(main())


def test_declared_body_over_the_cap_gets_413_without_calling_the_handler() -> None:
    async def main() -> None:
        async with serving(ServerConfig(max_body_bytes=1000)) as (server, probe):
            raw = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1001\r\n\r\n"
            got = await raw_exchange(server.port, raw)
            assert status_of(got) == 413
            assert b"connection: close" in got.lower()
            assert probe.calls == 0

    run(main())


def test_streamed_body_over_the_cap_gets_413_and_is_never_buffered_past_it() -> None:
    async def main() -> None:
        cap = 100_000
        async with serving(ServerConfig(max_body_bytes=cap)) as (server, probe):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /chunks HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
            got = b""
            sent = 0
            # Keep sending until the server answers; it must answer while we still send.
            while not got and sent < 10 * cap:
                writer.write(b"%x\r\n%s\r\n" % (4096, b"b" * 4096))
                sent += 4096
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.01):
                        got = await reader.read(65536)
            writer.transport.abort()
            assert status_of(got) == 413
            assert sum(probe.chunks) <= cap
            assert probe.errors == ["BodyTooLarge"]

    run(main())


def test_malformed_request_line_gets_400_and_close() -> None:
    async def main() -> None:
        async with serving() as (server, probe):
            got = await raw_exchange(server.port, b"GARBAGE\r\n\r\n")
            assert status_of(got) == 400
            assert probe.calls == 0

    run(main())


def test_content_length_with_transfer_encoding_is_refused() -> None:
    async def main() -> None:
        async with serving() as (server, probe):
            raw = (
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                b"transfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /echo HTTP/1.1\r\n\r\n"
            )
            got = await raw_exchange(server.port, raw)
            assert status_of(got) == 400
            assert got.count(b"HTTP/1.1") == 1
            assert probe.calls == 0

    run(main())


def test_conflicting_content_lengths_are_refused() -> None:
    async def main() -> None:
        async with serving() as (server, probe):
            raw = (
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n"
            )
            got = await raw_exchange(server.port, raw)
            assert status_of(got) == 400
            assert probe.calls == 0

    run(main())


def test_unsupported_transfer_encoding_is_refused() -> None:
    async def main() -> None:
        async with serving() as (server, probe):
            raw = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
            got = await raw_exchange(server.port, raw)
            assert status_of(got) == 501
            assert probe.calls == 0

    run(main())


def test_oversized_headers_get_431() -> None:
    async def main() -> None:
        async with serving(ServerConfig(max_header_bytes=4096)) as (server, probe):
            raw = b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 10_000 + b"\r\n\r\n"
            got = await raw_exchange(server.port, raw)
            assert status_of(got) == 431
            assert probe.calls == 0

    run(main())


def test_slow_request_head_gets_408_and_close() -> None:
    async def main() -> None:
        async with serving(ServerConfig(header_timeout_s=0.2)) as (server, _):
            got = await raw_exchange(server.port, b"GET /echo HTTP/1.1\r\nhost: x\r\n")
            assert status_of(got) == 408

    run(main())


def test_idle_keep_alive_connection_is_closed_silently() -> None:
    async def main() -> None:
        async with serving(ServerConfig(keepalive_timeout_s=0.2)) as (server, _):
            client = await Client.connect(server.port)
            reply = await client.request("POST", "/echo", b"x")
            assert reply.status == 200
            assert await client.reader.read(100) == b""  # closed, no 408 on an idle connection

    run(main())


def test_stalled_body_gets_408() -> None:
    async def main() -> None:
        async with serving(ServerConfig(body_timeout_s=0.2)) as (server, _):
            raw = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc"
            got = await raw_exchange(server.port, raw)
            assert status_of(got) == 408

    run(main())


def test_client_hanging_up_cancels_the_waiting_handler() -> None:
    async def main() -> None:
        async with serving() as (server, probe):
            client = await Client.connect(server.port)
            await client.send("GET", "/wait")
            await probe.waiting.wait()
            client.writer.close()
            await poll(lambda: probe.cancelled == 1)
            assert probe.gone_seen == 1
            assert server.statistics().clients_gone == 1
            await poll(lambda: server.statistics().connections_open == 0)

    run(main())


def test_client_gone_during_a_stream_stops_the_writes() -> None:
    async def main() -> None:
        async with serving(ServerConfig(write_timeout_s=5)) as (server, probe):
            client = await Client.connect(server.port)
            await client.send("GET", "/stream")
            await probe.waiting.wait()
            client.close()
            await poll(lambda: server.statistics().connections_open == 0)
            assert server.statistics().requests_active == 0

    run(main())


def test_client_that_stops_reading_is_dropped_after_the_write_timeout() -> None:
    async def main() -> None:
        async with serving(ServerConfig(write_timeout_s=0.2)) as (server, probe):
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            await probe.waiting.wait()
            # We never read: the server's writes stall, then it gives up on us.
            await poll(lambda: server.statistics().connections_open == 0)
            assert server.statistics().write_failures == 1
            assert probe.errors == ["ClientDisconnected"] or probe.cancelled == 1
            writer.transport.abort()

    run(main())


def test_handler_exception_gets_500_and_the_server_keeps_serving() -> None:
    async def main() -> None:
        async with serving() as (server, _):
            got = await raw_exchange(server.port, b"GET /raise HTTP/1.1\r\nhost: x\r\n\r\n")
            assert status_of(got) == 500
            client = await Client.connect(server.port)
            assert (await client.request("POST", "/echo", b"ok")).body == b"ok"
            client.close()

    run(main())


def test_handler_that_does_not_end_its_response_closes_the_connection() -> None:
    async def main() -> None:
        async with serving() as (server, _):
            got = await raw_exchange(server.port, b"GET /noend HTTP/1.1\r\nhost: x\r\n\r\n")
            assert status_of(got) == 200
            assert not got.endswith(b"0\r\n\r\n")  # the chunked body was never terminated

    run(main())


def test_pipelined_requests_are_answered_in_order() -> None:
    async def main() -> None:
        async with serving() as (server, _):
            raw = (
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\none"
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\ntwo"
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                b"connection: close\r\n\r\nthree"
            )
            got = await raw_exchange(server.port, raw)
            assert got.count(b"HTTP/1.1 200") == 3
            assert got.index(b"one") < got.index(b"two") < got.index(b"three")

    run(main())


def test_expect_100_continue_gets_the_go_ahead() -> None:
    async def main() -> None:
        async with serving() as (server, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                b"expect: 100-continue\r\n\r\n"
            )
            interim = await reader.readuntil(b"\r\n\r\n")
            assert interim.startswith(b"HTTP/1.1 100 ")
            writer.write(b"data")
            final = await reader.readuntil(b"\r\n\r\n")
            assert final.startswith(b"HTTP/1.1 200 ")
            assert await reader.readexactly(4) == b"data"
            writer.transport.abort()

    run(main())


def test_writes_that_wait_for_the_end_of_the_round_go_out_before_the_close() -> None:
    # The first write of the loop's round goes out at once, the others wait for its end
    # (`Outbox`); the connection closes within the same round, and must send them first.
    async def main() -> None:
        async with serving() as (server, _):
            got = await raw_exchange(
                server.port, b"GET /pieces HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            )
            assert status_of(got) == 200
            assert got.endswith(b"6\r\nfirst \r\n7\r\nsecond \r\n5\r\nthird\r\n0\r\n\r\n"), got

    run(main())


def test_an_error_reply_waiting_for_the_end_of_the_round_goes_out_before_the_half_close() -> None:
    # Two requests arrive in the same round: the first one's answer is the round's first
    # write, so the second one's 400 waits (`Outbox`) while its connection half-closes.
    async def main() -> None:
        async with serving() as (server, _):
            good = await asyncio.open_connection("127.0.0.1", server.port)
            bad = await asyncio.open_connection("127.0.0.1", server.port)
            await poll(lambda: server.statistics().connections_total == 2)
            good[1].write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
            bad[1].write(b"NOT HTTP AT ALL\r\n\r\n")
            try:
                assert (await good[0].readuntil(b"hi")).startswith(b"HTTP/1.1 200")
                assert status_of(await bad[0].read()) == 400  # all of it, up to the FIN
            finally:
                good[1].transport.abort()
                bad[1].transport.abort()

    run(main())


def test_http_1_0_request_is_answered_and_closed() -> None:
    async def main() -> None:
        async with serving() as (server, _):
            got = await raw_exchange(
                server.port, b"POST /echo HTTP/1.0\r\ncontent-length: 2\r\n\r\nhi"
            )
            assert status_of(got) == 200 and got.endswith(b"hi")

    run(main())


def test_graceful_shutdown_finishes_in_flight_answers_and_closes_idle_connections() -> None:
    async def main() -> None:
        probe = Probe()
        server = HTTPServer(make_handler(probe), ServerConfig())
        await server.start("127.0.0.1", 0)
        port = server.port
        idle = await Client.connect(port)
        assert (await idle.request("POST", "/echo", b"x")).status == 200
        busy = await Client.connect(port)
        await busy.send("GET", "/wait")
        await probe.waiting.wait()
        shutdown = asyncio.create_task(server.shutdown(5.0))
        assert await idle.closed_by_peer()
        try:
            await asyncio.open_connection("127.0.0.1", port)
            raise AssertionError("new connections must be refused")
        except OSError:
            pass
        probe.release.set()
        reply = await busy.reply()
        assert (reply.status, reply.body) == (200, b"released")
        assert reply.header("connection") == "close"
        await shutdown
        assert probe.cancelled == 0

    run(main())


def test_shutdown_cancels_what_does_not_finish_by_the_deadline() -> None:
    async def main() -> None:
        probe = Probe()
        server = HTTPServer(make_handler(probe), ServerConfig())
        await server.start("127.0.0.1", 0)
        busy = await Client.connect(server.port)
        await busy.send("GET", "/wait")
        await probe.waiting.wait()
        await server.shutdown(0.1)
        assert probe.cancelled == 1
        assert await busy.closed_by_peer()

    run(main())


def test_statistics_count_error_replies() -> None:
    async def main() -> None:
        async with serving() as (server, _):
            await raw_exchange(server.port, b"BAD\r\n\r\n")
            stats = server.statistics()
            assert stats.error_replies == {400: 1}
            assert stats.requests_total == 0

    run(main())


# --- adversarial bytes -------------------------------------------------------------------------

_REQUEST_PARTS = st.lists(
    st.sampled_from(
        [
            b"GET / HTTP/1.1\r\n",
            b"POST /echo HTTP/1.1\r\n",
            b"GET /echo HTTP/1.0\r\n",
            b"host: x\r\n",
            b"content-length: 3\r\n",
            b"content-length: -1\r\n",
            b"content-length: 99999999999999999999\r\n",
            b"transfer-encoding: chunked\r\n",
            b"transfer-encoding: identity\r\n",
            b"expect: 100-continue\r\n",
            b"connection: close\r\n",
            b" folded\r\n",
            b"bad header\r\n",
            b"\r\n",
            b"\n",
            b"abc",
            b"3\r\nabc\r\n",
            b"0\r\n\r\n",
            b"ffffffffffffffff\r\n",
            b"\x00\xff",
        ]
    ),
    max_size=12,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(parts=_REQUEST_PARTS, noise=st.binary(max_size=64))
def test_adversarial_bytes_get_a_4xx_or_a_close_and_the_server_keeps_serving(
    parts: list[bytes], noise: bytes
) -> None:
    async def main() -> None:
        config = ServerConfig(header_timeout_s=0.25, body_timeout_s=0.25, keepalive_timeout_s=0.25)
        async with serving(config) as (server, _):
            got = await raw_exchange(server.port, b"".join(parts) + noise)
            position = 0
            while got[position:].startswith(b"HTTP/1."):
                status = int(got[position + 9 : position + 12])
                assert status < 500 or status == 501, got
                if status >= 400:
                    break
                nxt = got.find(b"HTTP/1.", position + 1)
                if nxt < 0:
                    break
                position = nxt
            client = await Client.connect(server.port)
            assert (await client.request("POST", "/echo", b"still")).body == b"still"
            client.close()

    run(main(), timeout=20)


def test_every_status_line_carries_its_reason_phrase() -> None:
    async def main() -> None:
        async with serving(ServerConfig(max_body_bytes=1000)) as (server, _):
            for raw, line in (
                (b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", b"200 OK"),
                (b"GET /nope HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", b"404 Not Found"),
                (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1001\r\n\r\n", b"413 Re"),
                (b"GET / HTTP/1.1\r\n\x00\r\n\r\n", b"400 Bad Request"),
            ):
                got = await raw_exchange(server.port, raw)
                assert got.startswith(b"HTTP/1.1 " + line), got[:40]
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                b"expect: 100-continue\r\n\r\n"
            )
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.transport.abort()

    run(main())
