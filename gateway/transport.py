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

`Outbox` carries both ends' writes: the first of a round of the event loop at once, the
others back to back at the round's end, so that the peers the gateway writes to are woken
once per round rather than once per write.
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


class Outbox:
    """Writes of one round of the event loop: the first goes out at once, the others
    together at the round's end.

    A write to a socket whose reader sleeps in `epoll_wait` wakes that reader, and on a
    virtual machine waking an idle CPU costs the writer microseconds in the kernel (an
    interprocessor interrupt).  Under load the gateway is the slowest process of its chain:
    a client or an engine handles each answer or request before the next one comes and
    sleeps again, so the gateway paid a wake-up on nearly every write (perf at concurrency
    64: `_raw_spin_unlock_irqrestore` 13-14 % of its samples, 6.5-7.5 % of the bare relay's).
    Written back to back at the end of the round, the first wakes the peer and the others
    find it awake.  The first write of a round is not held: at concurrency 1 a round has
    one write, and holding it cost a tenth of the requests per second (measured, with
    `tests/perf/bench_gateway.py`; see docs/on-demand-gateway.md).

    The same bytes go out in the same order per transport.  A write waits only when it is
    small (`max_write`), its transport's buffer is empty and less than `max_bytes` waits;
    otherwise what waits goes out first and the write at once, so backpressure stays the
    transport's.  The round ends with a callback the round's first write schedules
    (`call_soon`): it runs before the loop polls again.  Whoever closes or half-closes a
    transport calls `flush` first; a transport that closed meanwhile (its peer reset it)
    drops what waited for it, as its own buffer would, and one whose write fails is
    aborted (its `connection_lost` tells its owner).
    """

    __slots__ = ("_loop", "_pending", "_scheduled", "_size", "max_bytes", "max_write")

    def __init__(self, max_write: int = 16 * 1024, max_bytes: int = 256 * 1024) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None  # the first write's
        self._pending: list[tuple[asyncio.Transport, bytes]] = []
        self._size = 0
        self._scheduled = False
        self.max_write = max_write  # larger writes go out at once
        self.max_bytes = max_bytes  # at most this much waits

    def write(self, transport: asyncio.Transport, data: bytes) -> None:
        """`transport.write(data)` now or at the end of the round; raises as it does."""
        if not self._scheduled:  # the round's first write (nothing waits): at once
            transport.write(data)
            self._scheduled = True
            loop = self._loop
            if loop is None:  # get_running_loop() makes a system call (getpid) each time
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._end_round)
            return
        size = len(data)
        if (
            size <= self.max_write
            and self._size + size <= self.max_bytes
            and not transport.get_write_buffer_size()
        ):
            self._pending.append((transport, data))
            self._size += size
            return
        self.flush()  # what waits goes first: the order per transport holds
        transport.write(data)

    def _end_round(self) -> None:
        """The round is over: what waits goes out, and the next write starts a round."""
        self._scheduled = False
        if self._pending:  # a round with one write (concurrency 1) has nothing waiting
            self.flush()

    def flush(self) -> None:
        """Write what waits, in order."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        self._size = 0
        for transport, data in pending:
            if transport.is_closing():
                continue
            try:
                transport.write(data)
            except (OSError, RuntimeError):
                transport.abort()  # its connection_lost tells the owner
