"""A lean byte stream on an asyncio transport, for both ends of the gateway.

It does what the gateway used of `asyncio.StreamReader` / `StreamWriter`, with their
semantics (an error set on the reader stays set; EOF keeps the transport open for our
writes; a lost connection wakes a pending drain), for less per read: received bytes are
kept as they came (no copy into and out of a bytearray), one future per wait, and the peer
closing or resetting is reported at once to `on_closed`.  Every buffer is bounded: above
twice `limit` unread bytes the transport stops reading until the reader catches up.

The gateway's express lane (`gateway.express`) relays in callbacks instead of a task: while
`on_data` is set, received bytes go to it first (it returns False to leave them to `read`),
`hold` keeps bytes for a later `read` without waking it, and `on_drained` hears that the
transport's write buffer went below its low-water mark.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast


class ByteStream(asyncio.Protocol):
    """Bytes in with `read`, out with `transport.write` and `drain`; see the module doc."""

    def __init__(
        self,
        limit: int,
        on_connect: Callable[[ByteStream], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self._limit = limit
        self._on_connect = on_connect  # run as a task once connected (servers)
        self._chunks: list[bytes] = []
        self._size = 0  # bytes in `_chunks`
        self._eof = False
        self._exception: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._lost = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.on_closed: Callable[[], None] | None = None  # EOF or reset from the peer
        self.on_data: Callable[[bytes], bool] | None = None  # True: it took the bytes
        self.on_drained: Callable[[], None] | None = None  # writing may go on

    # --- protocol callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Connected: start the connection's task when there is one."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self._on_connect is not None:
            self.task = self._loop.create_task(self._on_connect(self))

    def data_received(self, data: bytes) -> None:
        """Give the bytes to `on_data`, else keep them for `read`; stop reading while too
        much is unread."""
        on_data = self.on_data
        if on_data is not None and on_data(data):
            return
        self.hold(data)
        self.wake()

    def eof_received(self) -> bool:
        """The peer closed its side; we may still write (True keeps the transport open)."""
        self._eof = True
        self.wake()
        if self.on_closed is not None:
            self.on_closed()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is gone (reset, or closed by us)."""
        self._lost = True
        if exc is None:
            self._eof = True
            self.wake()
        else:
            self.set_exception(exc)
        for waiter in self._drain_waiters:
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)
        if self.on_closed is not None:
            self.on_closed()

    def hold(self, data: bytes) -> None:
        """Keep bytes for a later `read` without waking a pending one (see `wake`)."""
        self._chunks.append(data)
        self._size += len(data)
        if self._size > 2 * self._limit and not self._reading_paused and self.transport:
            self._reading_paused = True
            self.transport.pause_reading()

    @property
    def writing_paused(self) -> bool:
        """The transport asked us to stop writing (until `on_drained`)."""
        return self._writing_paused

    @property
    def holding(self) -> bool:
        """Bytes are kept for `read`."""
        return bool(self._chunks)

    def pause_writing(self) -> None:
        """The transport's write buffer is over its high-water mark."""
        self._writing_paused = True

    def resume_writing(self) -> None:
        """The transport's write buffer drained below its low-water mark."""
        self._writing_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self.on_drained is not None:
            self.on_drained()

    # --- reading -------------------------------------------------------------------------

    def wake(self) -> None:
        """End a pending `read` now: with the bytes held, else as if at EOF (b"")."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def set_exception(self, exc: BaseException) -> None:
        """Make the pending and every later `read` raise `exc`."""
        self._exception = exc
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_exception(exc)

    def at_eof(self) -> bool:
        """The peer closed and every byte was read."""
        return self._eof and not self._chunks

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes as soon as any arrived; b"" at EOF; raises the error set."""
        if self._exception is not None:
            raise self._exception
        if not self._chunks:
            if self._eof:
                return b""
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
            if not self._chunks:
                return b""  # EOF
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if len(data) > n:
            self._chunks = [data[n:]]
            data = data[:n]
        else:
            self._chunks = []
        self._size -= len(data)
        if self._reading_paused and self._size <= self._limit and self.transport:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    # --- writing -------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self._exception is not None:
            raise self._exception
        if self.transport is not None and self.transport.is_closing():
            await asyncio.sleep(0)  # let connection_lost run, as StreamWriter.drain does
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if not self._writing_paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        try:
            await waiter
        finally:
            self._drain_waiters.remove(waiter)

    def peer(self) -> tuple[str, int] | None:
        """The peer's address (IP sockets), or None."""
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
