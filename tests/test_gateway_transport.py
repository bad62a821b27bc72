"""The lean byte stream under both ends of the gateway: reads, EOF, errors, flow control."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.transport import ByteStream, Outbox
from tests.gateway_support import run


@contextlib.asynccontextmanager
async def pair(limit: int = 1024) -> AsyncIterator[tuple[ByteStream, socket.socket]]:
    """A ByteStream connected over loopback to a plain blocking-free socket we drive."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    accepting = loop.create_task(loop.sock_accept(listener))
    _, stream = await loop.create_connection(
        lambda: ByteStream(limit), "127.0.0.1", listener.getsockname()[1]
    )
    peer, _ = await accepting
    listener.close()
    try:
        yield stream, peer
    finally:
        peer.close()
        assert stream.transport is not None
        stream.transport.abort()


def test_reads_return_what_arrived_and_empty_bytes_at_eof() -> None:
    async def main() -> None:
        async with pair() as (stream, peer):
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(peer, b"hello")
            assert await stream.read(100) == b"hello"
            peer.shutdown(socket.SHUT_WR)
            assert await stream.read(4) == b""
            assert stream.at_eof()

    run(main())


def test_eof_keeps_the_stream_writable_and_tells_on_closed() -> None:
    async def main() -> None:
        async with pair() as (stream, peer):
            closed: list[bool] = []
            stream.on_closed = lambda: closed.append(True)
            peer.shutdown(socket.SHUT_WR)
            assert await stream.read(10) == b""
            assert closed == [True]
            assert stream.transport is not None
            stream.transport.write(b"still here")
            got = await asyncio.get_running_loop().sock_recv(peer, 100)
            assert got == b"still here"

    run(main())


def test_an_error_set_fails_the_pending_read_and_every_later_one() -> None:
    async def main() -> None:
        stream = ByteStream(limit=10)
        stream.connection_made(FakeTransport())
        pending = asyncio.get_running_loop().create_task(stream.read(10))
        await asyncio.sleep(0)  # the read is waiting
        stream.set_exception(TimeoutError("late"))
        with pytest.raises(TimeoutError):
            await pending
        stream.data_received(b"data")  # even with bytes to read
        with pytest.raises(TimeoutError):
            await stream.read(10)

    run(main())


def test_a_reset_fails_reads_and_drains_and_tells_on_closed() -> None:
    async def main() -> None:
        async with pair() as (stream, peer):
            closed: list[bool] = []
            stream.on_closed = lambda: closed.append(True)
            peer.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            peer.close()  # RST
            with pytest.raises(OSError):
                await stream.read(10)
            with pytest.raises(OSError):
                await stream.drain()
            assert closed

    run(main())


class FakeTransport(asyncio.Transport):
    """Records flow-control calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def is_closing(self) -> bool:
        return False


def test_a_read_takes_at_most_what_it_asks_for() -> None:
    async def main() -> None:
        stream = ByteStream(limit=10)
        stream.connection_made(FakeTransport())
        stream.data_received(b"abc")
        stream.data_received(b"def")
        assert await stream.read(4) == b"abcd"
        assert await stream.read(4) == b"ef"

    run(main())


def test_unread_bytes_over_twice_the_limit_pause_reading_until_read() -> None:
    async def main() -> None:
        stream = ByteStream(limit=10)
        transport = FakeTransport()
        stream.connection_made(transport)
        stream.data_received(b"x" * 15)
        assert transport.calls == []
        stream.data_received(b"y" * 10)
        assert transport.calls == ["pause"]
        assert await stream.read(10) == b"x" * 10  # 15 left: still over the limit
        assert transport.calls == ["pause"]
        assert await stream.read(10) == b"x" * 5 + b"y" * 5
        assert transport.calls == ["pause", "resume"]

    run(main())


def test_drain_waits_while_writing_is_paused() -> None:
    async def main() -> None:
        stream = ByteStream(limit=10)
        stream.connection_made(FakeTransport())
        await stream.drain()  # not paused: at once
        stream.pause_writing()
        waiting = asyncio.get_running_loop().create_task(stream.drain())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not waiting.done()
        stream.resume_writing()
        await asyncio.wait_for(waiting, 1)
        stream.pause_writing()
        waiting = asyncio.get_running_loop().create_task(stream.drain())
        await asyncio.sleep(0)
        stream.connection_lost(None)  # a clean close wakes it; the next write will fail
        await asyncio.wait_for(waiting, 1)
        with pytest.raises(ConnectionResetError):
            await stream.drain()

    run(main())


class Recorder:
    """A transport that records its writes (the few methods `Outbox` uses)."""

    def __init__(self, log: list[tuple[str, bytes]], name: str) -> None:
        self.log, self.name = log, name
        self.buffered = 0  # what `get_write_buffer_size` says
        self.closing = False
        self.fail = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        if self.fail:
            raise RuntimeError("write failed")
        self.log.append((self.name, data))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.aborted = self.closing = True


def recorders(*names: str) -> tuple[list[tuple[str, bytes]], list[Any]]:
    log: list[tuple[str, bytes]] = []
    return log, [Recorder(log, name) for name in names]


def test_the_first_write_of_a_round_goes_out_at_once_and_the_others_at_its_end() -> None:
    async def main() -> None:
        outbox = Outbox()
        log, (a, b) = recorders("a", "b")
        outbox.write(a, b"1")
        assert log == [("a", b"1")]  # at once: a lone write is not delayed
        outbox.write(b, b"2")
        outbox.write(a, b"3")
        assert log == [("a", b"1")]
        await asyncio.sleep(0)  # the round ends
        assert log == [("a", b"1"), ("b", b"2"), ("a", b"3")]
        outbox.write(b, b"4")  # a new round: at once again
        assert log[-1] == ("b", b"4")

    run(main())


def test_a_large_write_or_a_busy_transport_goes_out_at_once_after_what_waits() -> None:
    async def main() -> None:
        outbox = Outbox(max_write=8)
        log, (a, b) = recorders("a", "b")
        outbox.write(a, b"first")
        outbox.write(b, b"small")
        outbox.write(b, b"larger than 8")  # after b's small one: the order per transport
        assert log == [("a", b"first"), ("b", b"small"), ("b", b"larger than 8")]
        outbox.write(a, b"wait")
        a.buffered = 1  # the transport holds bytes: ours go behind them, now
        outbox.write(a, b"now")
        assert log[-2:] == [("a", b"wait"), ("a", b"now")]

    run(main())


def test_what_waits_is_bounded() -> None:
    async def main() -> None:
        outbox = Outbox(max_write=4, max_bytes=10)
        log, (a,) = recorders("a")
        outbox.write(a, b"go")
        for _ in range(5):
            outbox.write(a, b"abcd")
        # 8 bytes wait; the third 4 would make 12: everything goes, the rest waits again
        assert log == [("a", b"go"), ("a", b"abcd"), ("a", b"abcd"), ("a", b"abcd")]
        await asyncio.sleep(0)
        assert len(log) == 6

    run(main())


def test_a_transport_closed_meanwhile_drops_its_bytes_and_one_that_fails_is_aborted() -> None:
    async def main() -> None:
        outbox = Outbox()
        log, (a, b, c) = recorders("a", "b", "c")
        outbox.write(a, b"1")
        outbox.write(b, b"2")
        outbox.write(c, b"3")
        b.closing = True  # the peer reset it
        c.fail = True
        outbox.flush()
        assert log == [("a", b"1")]
        assert c.aborted and not b.aborted
        outbox.flush()  # nothing waits any more
        assert log == [("a", b"1")]

    run(main())


def test_bytes_that_waited_reach_the_peer_before_the_fin_when_flushed_first() -> None:
    async def main() -> None:
        async with pair() as (stream, peer):
            outbox = Outbox()
            other = Recorder([], "other")
            outbox.write(other, b"the round's first write")
            assert stream.transport is not None
            outbox.write(stream.transport, b"waited")
            outbox.flush()  # what `_Connection.close` and the server's close do
            stream.transport.close()
            loop = asyncio.get_running_loop()
            got = b""
            while chunk := await loop.sock_recv(peer, 100):
                got += chunk
            assert got == b"waited"

    run(main())
