"""HTTP/1.1 client for engines on asyncio streams, with a bounded keep-alive pool per engine.

A connection goes back to its pool only when both sides are DONE, nothing went wrong and the
engine will keep it open: not after `Connection: close` or `Keep-Alive: max=0`, for less
than the idle timeout its `Keep-Alive` announced (a second below it, and never longer than
`idle_expiry_s`), and not after a streamed answer once the engine was seen to end the
connection there (llama.cpp's `llama-server` does, though its head says keep-alive:
`_EnginePool.streams_end`).  After a failed or cancelled write or read a connection is
aborted (RST, so the engine notices at once and stops generating).

A request is sent once more, on a new connection, when it provably never reached the engine
(`UpstreamError.unsent`), and when a reused connection was closed or reset before the first
byte of its answer (`stale`): the keep-alive race, which an engine closing idle connections
makes unavoidable.  Engines keep no state between requests, so the worst a second copy costs
is compute; a request on a new connection that fails so is the request's error, never sent
again (docs/on-demand-gateway.md, "Resending").  The protocol is
`gateway.engine_protocol`'s; `OSError` becomes `gateway.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from gateway.deadlines import Sweeper, sweep_interval
from gateway.engine_protocol import ClientSession, forward_prefix
from gateway.errors import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolExhausted,
    UpstreamTimeout,
)
from gateway.messages import Headers, ResponseHead, Signal
from gateway.transport import ByteStream, Outbox


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Timeouts and bounds of the engine connection pools."""

    connect_timeout_s: float = 10.0
    read_timeout_s: float = 1800.0  # longest silence: a long non-streaming generation
    write_timeout_s: float = 60.0
    idle_expiry_s: float = 4.0  # below the 5 s keep-alive of uvicorn (vLLM, SGLang), llama.cpp
    max_connections_per_engine: int = 1024  # in use at once; more requests wait for a slot
    max_idle_per_engine: int = 256  # idle ones expire after idle_expiry_s anyway
    max_header_bytes: int = 64 * 1024
    read_chunk_bytes: int = 64 * 1024


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """Counters of one engine's pool."""

    active: int
    idle: int
    connected: int
    reused: int
    retried: int
    discarded: int


class EngineHead:
    """What a client's request head becomes for an engine (`ClientSession.forward`): the
    engine's target and the client's headers not forwarded; once sent, the head made of them up
    to its Content-Length value (`forward_prefix`), with the engine Host it was made for.  The
    express lane keeps one with the memo of the client's head, so that the client's next
    requests alike but for their bodies go out as that head, their own length and body
    (`ClientSession.forward_known`)."""

    __slots__ = ("drop", "host", "prefix", "target")

    def __init__(self, target: bytes, drop: frozenset[bytes]) -> None:
        self.target = target  # for the engine: the path after /d/<id>
        self.drop = drop  # `not_forwarded` of the client's headers
        self.host = b""  # the engine Host `prefix` was made for; none yet
        self.prefix = b""


class Outgoing(msgspec.Struct, frozen=True, gc=False):
    """A client's request as the express lane sends it: method and headers from the client
    side's parser (not revalidated), its body, and what its head becomes for the engine.  A
    struct, as `RequestHead`: a named tuple's making and unmaking cost a request 3 % of its
    instructions (callgrind, the micro benchmark); nothing it holds refers back to it, so the
    cycle collector skips it."""

    method: bytes
    headers: Headers
    body: bytes
    head: EngineHead


class _EnginePool:
    """Connections to one (host, port)."""

    __slots__ = (
        "active",
        "busy",
        "connected",
        "discarded",
        "host_header",
        "idle",
        "port",
        "retried",
        "reused",
        "slot_waiters",
        "slots_free",
        "streams_end",
    )

    def __init__(self, host: str, port: int, max_connections: int) -> None:
        self.port = port
        self.host_header = f"{host}:{port}".encode()
        self.idle: deque[_Connection] = deque()
        self.busy: set[_Connection] = set()
        # A semaphore, inlined: taking a free slot is two attribute operations, no coroutine.
        self.slots_free = max_connections
        self.slot_waiters: deque[asyncio.Future[None]] = deque()
        self.active = 0
        self.connected = 0
        self.reused = 0
        self.retried = 0
        self.discarded = 0
        # The engine ends a connection after a streamed answer, whatever its head said: a
        # connection it closed while idle, or that failed on reuse, had carried a stream.
        self.streams_end = False


# An engine's idle timer and ours start a few milliseconds apart: a connection is reused only
# until this long before the end of the idle timeout the engine's Keep-Alive announced.
KEEP_ALIVE_MARGIN_S = 1.0

_UNQUIET = select.POLLIN | select.POLLPRI | select.POLLRDHUP  # POLLERR, POLLHUP: always


class _Expired(Exception):
    """A read of this connection passed its deadline."""


class _Connection:
    """One TCP connection to an engine with its HTTP/1.1 client state."""

    __slots__ = (
        "config",
        "deadline",
        "expired",
        "expires",
        "loop",
        "on_expired",
        "outbox",
        "poller",
        "session",
        "stream",
        "transport",
        "writing",
    )

    def __init__(
        self,
        stream: ByteStream,
        transport: asyncio.Transport,
        config: UpstreamConfig,
        outbox: Outbox,
    ) -> None:
        self.stream = stream
        self.transport = transport
        self.config = config
        self.outbox = outbox  # the pool's: writes of one round go out together
        self.loop = asyncio.get_running_loop()
        self.session = ClientSession(max_header_bytes=config.max_header_bytes)
        self.expires = 0.0  # loop time after which it is not reused (while idle)
        self.deadline = 0.0  # loop time by which the pending read or write must finish
        self.writing = False
        self.expired = False
        self.on_expired: Callable[[], None] | None = None  # an express exchange's answer
        # Asks the kernel whether the idle connection has anything to read (`quiet`).
        self.poller: select.poll | None = None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.poller = select.poll()
            self.poller.register(sock.fileno(), _UNQUIET)

    @property
    def alive(self) -> bool:
        """Not closed by either side (an engine closing an idle connection shows as EOF)."""
        return not self.transport.is_closing() and not self.stream.at_eof()

    def quiet(self) -> bool:
        """An idle connection the kernel has nothing for: no close (FIN), no reset, no stray
        bytes that the event loop has not read yet.  A request written right after this
        was written to an engine that had not closed the connection; one that fails after
        that may have been seen (docs/on-demand-gateway.md, "Resending").  One poll(2)."""
        poller = self.poller
        return poller is None or not poller.poll(0)

    def expire(self) -> None:
        """The sweeper found our deadline passed: fail the pending read or write."""
        self.expired = True
        if self.on_expired is not None:
            self.on_expired()
        elif self.writing:
            self.transport.abort()
        else:
            self.stream.set_exception(_Expired())

    def write(self, data: bytes) -> None:
        """Write a request (see `drain`); on failure the connection is unusable.  A write
        that raises handed nothing to the kernel: the request never reached the engine."""
        try:
            if self.transport.is_closing():
                raise ConnectionResetError("connection is closing")
            self.outbox.write(self.transport, data)
        except (OSError, RuntimeError) as exc:
            self.session.send_failed()
            raise UpstreamClosed(
                f"engine connection failed while sending: {exc!r}",
                before_response=True,
                unsent=True,
            ) from exc

    async def drain(self) -> None:
        """Wait until the engine took what `write` could not send at once (bounded)."""
        self.deadline = self.loop.time() + self.config.write_timeout_s
        self.writing = True
        try:
            await self.stream.drain()
        except (OSError, RuntimeError) as exc:
            self.session.send_failed()
            if self.expired:
                raise UpstreamTimeout("engine did not accept the request in time") from exc
            raise UpstreamClosed(
                f"engine connection failed while sending: {exc!r}", before_response=True
            ) from exc
        except asyncio.CancelledError:
            self.session.send_failed()
            raise
        finally:
            self.deadline = 0.0
            self.writing = False

    async def next_event(self) -> ResponseHead | bytes | Signal:
        """The next part of the answer, reading the socket when needed."""
        session = self.session
        while True:
            event = session.next_event()
            if event is not Signal.NEED_DATA:
                return event
            self.deadline = self.loop.time() + self.config.read_timeout_s
            try:
                data = await self.stream.read(self.config.read_chunk_bytes)
            except _Expired as exc:
                raise UpstreamTimeout(
                    f"engine sent nothing for {self.config.read_timeout_s:g} s"
                ) from exc
            except OSError as exc:
                raise UpstreamClosed(
                    f"engine connection failed: {exc!r}", before_response=not session.received_any
                ) from exc
            finally:
                self.deadline = 0.0
            session.receive(data)

    def abort(self) -> None:
        """Drop the connection at once (RST): the engine sees the client gone."""
        self.transport.abort()

    def close(self) -> None:
        """End the connection cleanly (FIN) once the engine has what we wrote."""
        self.outbox.flush()
        self.transport.close()


Engine = _EnginePool  # what the express lane holds of a pool (`UpstreamPool.send_now`)
EngineConnection = _Connection


class UpstreamResponse:
    """An engine's answer: head now, body streamed by `receive`; always `close()` it."""

    __slots__ = (
        "_conn",
        "_done",
        "_pool",
        "_released",
        "headers",
        "http_version",
        "reason",
        "status",
    )

    def __init__(
        self, pool: UpstreamPool, engine: _EnginePool, conn: _Connection, head: ResponseHead
    ) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self._released: _EnginePool | None = engine
        self._done = False
        self.status = head.status
        self.reason = head.reason
        self.headers = head.headers
        self.http_version = head.http_version

    @property
    def complete(self) -> bool:
        """The whole body has been received."""
        return self._done

    async def receive(self) -> bytes:
        """The next body bytes (all that arrived), b"" at the end; raises `UpstreamError`s."""
        if self._done:
            return b""
        conn = self._conn
        if conn is None:
            raise UpstreamClosed("the answer was closed before its end")
        try:
            while True:
                event = await conn.next_event()
                if type(event) is bytes:
                    if conn.session.complete:  # that was the last piece: reuse at once
                        self._done = True
                        self._finish(reuse=True)
                    return event
                if event is Signal.BODY_END:
                    self._done = True
                    self._finish(reuse=True)
                    return b""
                raise UpstreamClosed("engine answer ended unexpectedly")
        except BaseException:
            self._finish(reuse=False)
            raise

    async def read_all(self, limit: int) -> bytes | None:
        """The rest of the body, or None (leaving the read part lost) when over `limit`."""
        chunks: list[bytes] = []
        size = 0
        while chunk := await self.receive():
            size += len(chunk)
            if size > limit:
                self.close()
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Give the connection back if the answer was complete, else abort it."""
        self._finish(reuse=self._done)

    def abort(self) -> None:
        """Cut the answer now (shutdown): a pending `receive` raises `UpstreamClosed`."""
        if self._conn is not None and not self._done:
            self._conn.abort()

    def _finish(self, *, reuse: bool) -> None:
        conn, self._conn = self._conn, None
        engine, self._released = self._released, None
        if engine is not None:
            self._pool._release(engine, conn, reuse=reuse)


class UpstreamPool:
    """Keep-alive pools of engine connections keyed by (host, port)."""

    def __init__(self, config: UpstreamConfig | None = None) -> None:
        self.config = config or UpstreamConfig()
        self._engines: dict[tuple[str, int], _EnginePool] = {}
        self._closed = False
        self.outbox = Outbox()
        c = self.config
        self._sweeper = Sweeper(
            sweep_interval(c.read_timeout_s, c.write_timeout_s, c.idle_expiry_s),
            self._busy_connections,
            self._expire_idle,
        )

    def _engine(self, host: str, port: int) -> _EnginePool:
        engine = self._engines.get((host, port))
        if engine is None:
            engine = self._engines[(host, port)] = _EnginePool(
                host, port, self.config.max_connections_per_engine
            )
        return engine

    def _busy_connections(self) -> list[_Connection]:
        return [conn for engine in self._engines.values() for conn in engine.busy]

    def _expire_idle(self, now: float) -> None:
        """Close idle connections past their expiry, so engines are not held open."""
        for engine in self._engines.values():
            idle = engine.idle  # oldest first; one engine announces one timeout
            while idle and idle[0].expires <= now:
                idle.popleft().close()
                engine.discarded += 1

    async def request(
        self,
        host: str,
        port: int,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: bytes,
        *,
        drop: frozenset[bytes] = frozenset(),
        checked: bool = False,
    ) -> UpstreamResponse:
        """Send a request (Host and Content-Length are added, the headers named in `drop` are
        not passed on) and return the answer's head.

        `checked`: `headers`, method and target came out of an HTTP parser (not revalidated).
        """
        if self._closed:
            raise UpstreamConnectError("upstream pool is closed", unsent=False)
        self._sweeper.start()
        engine = self._engine(host, port)
        if engine.slots_free and not engine.slot_waiters:
            engine.slots_free -= 1
        else:
            await self._wait_for_slot(engine)
        engine.active += 1
        try:
            for attempt in (0, 1):
                conn, reused = self._checkout(engine) if attempt == 0 else (None, False)
                if conn is None:
                    conn = await self._connect(host, port)
                    engine.connected += 1
                engine.busy.add(conn)
                try:
                    request = conn.session.forward(
                        method, target, engine.host_header, headers, drop, body, checked
                    )
                    conn.write(request)
                    if conn.transport.get_write_buffer_size():
                        await conn.drain()
                    event = await conn.next_event()
                    if not isinstance(event, ResponseHead):
                        raise UpstreamClosed("engine answered without a status line")
                except UpstreamClosed as exc:
                    conn.abort()
                    engine.busy.discard(conn)
                    engine.discarded += 1
                    if attempt == 0 and reused and exc.unsent:
                        engine.retried += 1
                        continue
                    if attempt == 0 and self.stale(engine, conn, reused, exc):
                        continue
                    raise
                except BaseException:
                    conn.abort()
                    engine.busy.discard(conn)
                    engine.discarded += 1
                    raise
                return UpstreamResponse(self, engine, conn, event)
            raise UpstreamClosed("unreachable")  # pragma: no cover - the loop returns or raises
        except BaseException:
            engine.active -= 1
            self._release_slot(engine)
            raise

    @staticmethod
    def stale(engine: _EnginePool, conn: _Connection, reused: bool, exc: UpstreamError) -> bool:
        """Whether a failed request met the keep-alive race: a reused connection closed or
        reset before any byte of the answer (the request goes once more on a new one, and
        counts as retried).  A stream was the connection's last answer: the engine ends
        connections there."""
        if not (reused and isinstance(exc, UpstreamClosed) and exc.before_response):
            return False
        if conn.session.chunked:
            engine.streams_end = True
        engine.retried += 1
        return True

    async def open_idle(self, host: str, port: int) -> None:
        """Open a connection to an engine ahead of any request and keep it idle (so that
        the first request may take the express lane; tests use it for that)."""
        engine = self._engine(host, port)
        self._sweeper.start()
        conn = await self._connect(host, port)
        engine.connected += 1
        conn.expires = conn.loop.time() + self.config.idle_expiry_s
        engine.idle.append(conn)

    def can_send(self, host: str, port: int) -> bool:
        """Whether a request to the engine would get a slot at once: on an idle connection
        (`send_now`) or a new one (`open_now`)."""
        if self._closed:
            return False
        engine = self._engines.get((host, port))
        return engine is None or (bool(engine.slots_free) and not engine.slot_waiters)

    def send_now(
        self, host: str, port: int, request: Outgoing
    ) -> tuple[_EnginePool, _Connection] | None:
        """Send a request at once on an idle connection, for the express lane: the engine
        and the connection, now busy (`finish` them), or None when it would have to wait
        (no free slot or no idle connection) or the write failed: then nothing changed.
        The read deadline starts now.
        """
        engine = self._engines.get((host, port))
        if engine is None or self._closed or not engine.slots_free or engine.slot_waiters:
            return None
        conn, _ = self._checkout(engine)
        if conn is None:
            return None
        if conn.stream.holding:  # bytes nobody asked for: not a connection to use
            conn.abort()
            engine.discarded += 1
            return None
        if not self._send(engine, conn, request):
            conn.abort()
            engine.discarded += 1
            return None
        engine.slots_free -= 1
        engine.active += 1
        engine.busy.add(conn)
        return engine, conn

    def open_now(self, host: str, port: int) -> tuple[_EnginePool, asyncio.Task[_Connection]]:
        """Take a slot (`can_send` said there is one) and start opening a new connection for
        the express lane.  Once the task is done: `send_on` the connection, or `finish` it
        when no longer wanted; `give_up` when the task failed or was cancelled."""
        engine = self._engine(host, port)
        if self._closed or not engine.slots_free or engine.slot_waiters:
            raise UpstreamPoolExhausted("no free slot")  # `can_send` said there was one
        self._sweeper.start()
        engine.slots_free -= 1
        engine.active += 1
        return engine, asyncio.get_running_loop().create_task(self._connect(host, port))

    def send_on(self, engine: _EnginePool, conn: _Connection, request: Outgoing) -> bool:
        """Send a request on the connection `open_now` opened, as `send_now` does; False when
        the write failed or the pool closed meanwhile: then connection and slot are given
        back."""
        engine.connected += 1
        engine.busy.add(conn)
        if self._closed or not self._send(engine, conn, request):
            self._release(engine, conn, reuse=False)
            return False
        return True

    def give_up(self, engine: _EnginePool) -> None:
        """The connection `open_now` started opening failed or is not wanted: its slot back."""
        self._release(engine, None, reuse=False)

    def _send(self, engine: _EnginePool, conn: _Connection, request: Outgoing) -> bool:
        """Write a request of the express lane; the read deadline starts now."""
        host = engine.host_header
        head = request.head
        if head.host != host:  # not sent yet, or sent to another engine
            head.prefix = forward_prefix(
                request.method, head.target, host, request.headers, head.drop
            )
            head.host = host
        data = conn.session.forward_known(head.prefix, request.method, request.body)
        try:
            conn.write(data)
        except UpstreamClosed:
            return False
        conn.deadline = conn.loop.time() + self.config.read_timeout_s
        return True

    def finish(self, engine: _EnginePool, conn: _Connection, *, reuse: bool) -> None:
        """An express exchange is over with the connection from `send_now`."""
        conn.deadline = 0.0
        conn.on_expired = None
        conn.stream.on_data = conn.stream.on_closed = None
        self._release(engine, conn, reuse=reuse)

    async def _wait_for_slot(self, engine: _EnginePool) -> None:
        """Wait (bounded, in order) until a request to the engine ends and hands its slot on."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        engine.slot_waiters.append(waiter)
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release_slot(engine)  # handed to us just as we gave up: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    engine.slot_waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise UpstreamPoolExhausted("every connection to the engine stayed busy") from exc
            raise

    @staticmethod
    def _release_slot(engine: _EnginePool) -> None:
        waiters = engine.slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        engine.slots_free += 1

    def _checkout(self, engine: _EnginePool) -> tuple[_Connection | None, bool]:
        idle = engine.idle
        while idle:
            conn = idle.pop()
            # The connection's loop: `asyncio.get_running_loop()` costs a getpid() syscall.
            if conn.loop.time() < conn.expires:
                if conn.alive and conn.quiet():
                    engine.reused += 1
                    return conn, True
                if conn.session.chunked:  # the engine ended it early, after a stream
                    engine.streams_end = True
            conn.abort()
            engine.discarded += 1
        return None, False

    async def _connect(self, host: str, port: int) -> _Connection:
        limit = self.config.read_chunk_bytes
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                transport, stream = await loop.create_connection(
                    lambda: ByteStream(limit), host, port
                )
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connect to {host}:{port} timed out") from exc
        except OSError as exc:
            reason = exc.strerror or repr(exc)
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {reason}") from exc
        return _Connection(stream, transport, self.config, self.outbox)

    def _release(self, engine: _EnginePool, conn: _Connection | None, *, reuse: bool) -> None:
        engine.active -= 1
        self._release_slot(engine)
        if conn is None:
            return
        engine.busy.discard(conn)
        session = conn.session
        if (
            reuse
            and not self._closed
            and session.reusable
            and session.clean
            and conn.alive
            and len(engine.idle) < self.config.max_idle_per_engine
            and not (session.chunked and engine.streams_end)
        ):
            expiry = self.config.idle_expiry_s
            announced = session.keep_alive_s
            if announced is not None and announced - KEEP_ALIVE_MARGIN_S < expiry:
                expiry = announced - KEEP_ALIVE_MARGIN_S
            if expiry > 0:
                session.start_next_cycle()
                conn.expires = conn.loop.time() + expiry
                engine.idle.append(conn)
                return
        if reuse and session.reusable:
            conn.close()  # a clean end: FIN, not RST
        else:
            conn.abort()
        engine.discarded += 1

    def forget(self, host: str, port: int) -> None:
        """Drop the idle connections to an engine that went away."""
        engine = self._engines.get((host, port))
        if engine is None:
            return
        while engine.idle:
            engine.idle.pop().abort()
        if engine.active == 0 and not engine.busy:
            del self._engines[(host, port)]

    async def close(self) -> None:
        """Close every idle connection; connections in use are aborted when released."""
        self._closed = True
        self._sweeper.stop()
        for key in list(self._engines):
            self.forget(*key)

    def statistics(self) -> dict[str, EngineStatistics]:
        """Per-engine counters, keyed by "host:port"."""
        return {
            f"{host}:{port}": EngineStatistics(
                active=e.active,
                idle=len(e.idle),
                connected=e.connected,
                reused=e.reused,
                retried=e.retried,
                discarded=e.discarded,
            )
            for (host, port), e in self._engines.items()
        }


__all__ = [
    "EngineHead",
    "Outgoing",
    "UpstreamConfig",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
]
