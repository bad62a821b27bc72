"""The lean byte stream under both ends of the gateway: reads, EOF, errors, flow control."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from gateway.transport import ByteStream
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
