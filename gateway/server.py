"""A small HTTP/1.1 server on h11 and asyncio streams, shared by the gateway and the admin API.

One task per connection reads request heads and runs each request's handler inline; the
stream protocol reports EOF and resets as they happen (no read pending), and a hang-up while
the handler waits cancels it.  Timeouts come from one sweeper task per server
(`gateway.deadlines`), not from a timer per read.  Protocol decisions live in
`gateway.protocol.ServerSession`; this module only moves bytes, keeps time and decides when
a connection ends.  (It is longer than our usual bound: the handler's `Request` and
`Responder`, the connection task and the accept loop share one connection's state; split,
that state would have to be public.  Descriptor limits are decided in `gateway.limits`.)

Handler contract:

    async def handler(request: Request, responder: Responder) -> None

* `await request.receive()` returns the next body chunk (b"" at the end) and
  `await request.read_body()` all of it; both raise `BodyTooLarge` (the server answers 413),
  `BodyTimeout` (408: the body was not in by `body_timeout_s` after the request's first byte,
  however it trickled in) or `ClientDisconnected`.  Read it from the handler itself, not from
  tasks it spawns; hang-ups are noticed at once only after the body was read to its end.
* `await responder.start(status, headers)`, then `send(data)` any number of times, then
  `end()`; or `respond(status, headers, body)` for the whole answer in one write.  Headers are
  `(lower-case name, value)` byte pairs; without a content-length the body is chunked.
  `start` only buffers the head: it is written with the first `send`, `end` or `flush`.
  `start(..., checked=True)` skips h11's header validation for headers that came out of an
  h11 parser (a relayed answer); never pass it for headers built from untrusted input.
* When the client hangs up before the response has ended, `request.client_gone` is set and
  the handler is cancelled (it runs in the connection's task; let CancelledError through);
  writes to a gone client raise `ClientDisconnected`.
* Exceptions other than `ClientError` become a 500 when nothing was sent yet (logged), else
  the connection is closed.  A handler that returns without `end()` closes the connection.
* A HEAD request is answered with the head of the GET answer: the handler may answer it as
  a GET, the body is dropped (RFC 9110 9.3.2).

Connections beyond the cap (`max_connections`, lowered to fit the descriptor limit, see
`gateway.limits`) get a 503 with Retry-After and are closed; a warning per minute says so.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Protocol

import structlog

from gateway import limits
from gateway.deadlines import Sweeper, sweep_interval
from gateway.errors import (
    BodyTimeout,
    ClientDisconnected,
    ClientError,
    GatewayError,
    MalformedRequest,
    ResponseStateError,
)
from gateway.protocol import (
    REASON_PHRASES,
    Headers,
    RequestHead,
    ServerSession,
    Signal,
    header_value,
)
from gateway.transport import ByteStream, Outbox

log = structlog.get_logger("gateway.server")

ErrorRenderer = Callable[[int, str], tuple[Headers, bytes]]


def plain_error(status: int, message: str) -> tuple[Headers, bytes]:
    """The default error body: the message as plain text."""
    return [(b"content-type", b"text/plain; charset=utf-8")], (message + "\n").encode()


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits and timeouts of one server; every one of them is a bound."""

    max_header_bytes: int = 16 * 1024  # h11's max_incomplete_event_size
    max_body_bytes: int = 16 * 1024 * 1024
    header_timeout_s: float = 10.0  # from the first byte of a request to its complete head
    keepalive_timeout_s: float = 75.0  # idle time between requests (above clients' pools)
    body_timeout_s: float = 120.0  # from a request's first byte until its whole body is read
    write_timeout_s: float = 120.0  # longest time a client may leave our writes unread
    linger_s: float = 2.0  # after an error reply, how long we read and discard before closing
    linger_max_bytes: int = 32 * 1024 * 1024  # ...and how much (an over-cap upload's rest)
    read_chunk_bytes: int = 64 * 1024
    max_connections: int = 8192  # beyond this a 503; lowered to fit the descriptor limit
    backlog: int = 1024
    fast_path: bool = True  # plainly valid request heads skip h11 (`gateway.request_head`)


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    """Counters of one server since it started."""

    connections_open: int
    connections_idle: int
    connections_total: int
    connections_refused: int
    requests_total: int
    requests_active: int
    clients_gone: int
    write_failures: int
    error_replies: dict[int, int]
    closing: bool


class Request:
    """One request as the handler sees it: head, streamed body, and the client-gone signal."""

    __slots__ = (
        "_complete",
        "_conn",
        "_early",
        "_error",
        "_gone",
        "_gone_event",
        "client",
        "headers",
        "http_version",
        "method",
        "request_id",
        "target",
    )

    def __init__(
        self, conn: _Connection, head: RequestHead, request_id: int, body: bytes | None = None
    ) -> None:
        self._conn = conn
        self.method = head.method
        self.target = head.target
        self.headers = head.headers
        self.http_version = head.http_version
        self.request_id = request_id
        self.client = conn.peer
        self._gone = False
        self._gone_event: asyncio.Event | None = None  # made when someone asks for it
        self._complete = not head.has_body or body is not None
        self._error: ClientError | None = None
        self._early = body or b""  # the body, when the express lane had read it already

    @property
    def client_gone(self) -> asyncio.Event:
        """Set when the client hung up before the response ended."""
        event = self._gone_event
        if event is None:
            event = self._gone_event = asyncio.Event()
            if self._gone:
                event.set()
        return event

    def _set_gone(self) -> None:
        self._gone = True
        if self._gone_event is not None:
            self._gone_event.set()

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case), or None."""
        return header_value(self.headers, name)

    @property
    def body_complete(self) -> bool:
        """The whole body has been received."""
        return self._complete

    async def receive(self) -> bytes:
        """The next chunk of the body, b"" once it is complete."""
        if self._complete:
            early, self._early = self._early, b""
            return early
        if self._error is not None:
            raise self._error
        try:
            return await self._conn.receive_body(self)
        except ClientError as exc:
            self._error = exc
            raise

    async def read_body(self) -> bytes:
        """The whole body (bounded by the server's `max_body_bytes`)."""
        chunks: list[bytes] = []
        if self._early:
            chunks.append(self._early)
            self._early = b""
        if not self._complete and self._error is None:
            try:  # what already arrived, without a coroutine per piece
                self._conn.buffered_body(self, chunks)
            except ClientError as exc:
                self._error = exc
                raise
        while not self._complete and (chunk := await self.receive()):
            chunks.append(chunk)
        if len(chunks) == 1:
            return chunks[0]
        return b"".join(chunks)


class Responder:
    """Writes one response; the head is buffered until the first body write."""

    __slots__ = ("_conn", "_pending", "finished", "started")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._pending = b""
        self.started = False
        self.finished = False

    async def start(
        self, status: int, headers: Headers, *, reason: bytes = b"", checked: bool = False
    ) -> None:
        """Begin the response; nothing is written until `send`, `end` or `flush`."""
        if self.started:
            raise ResponseStateError("response already started")
        request = self._conn.request
        rid = request.request_id if request is not None else None
        self._pending = self._conn.answer_head(status, headers, reason, checked, rid)
        self.started = True

    async def send(self, data: bytes) -> None:
        """Write a piece of the body (with the head if it is still pending)."""
        if not self.started or self.finished:
            raise ResponseStateError("send outside of a started response")
        if not data:
            return
        out = self._conn.session.body(data)
        if self._pending:
            out, self._pending = self._pending + out, b""
        if self._conn.write_now(out):
            await self._conn.drain()

    async def flush(self) -> None:
        """Write the pending head now (e.g. before a long wait for the first body bytes)."""
        if self._pending:
            out, self._pending = self._pending, b""
            await self._conn.write(out)

    async def end(self, data: bytes = b"") -> None:
        """End the body and the response, after `data` if given (all in one write)."""
        if not self.started or self.finished:
            raise ResponseStateError("end outside of a started response")
        session = self._conn.session
        out = self._pending + (session.body(data) if data else b"") + session.end()
        self._pending = b""
        self.finished = True
        if out and self._conn.write_now(out):  # a Content-Length body ends without bytes
            await self._conn.drain()

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """A complete response with a Content-Length body, in one write."""
        if self.started:
            raise ResponseStateError("response already started")
        conn = self._conn
        rid = conn.request.request_id if conn.request is not None else None
        out = conn.complete_answer(status, headers, body, rid)
        self.started = self.finished = True
        if conn.write_now(out):
            await conn.drain()


Handler = Callable[[Request, Responder], Coroutine[object, object, None]]


class Exchange(Protocol):
    """A request the express lane (`gateway.express`) relays in callbacks, seen from here."""

    head: RequestHead
    request_id: int
    reading: bool  # its body is still arriving: the task may take the request over

    def start(self, body: bytes) -> None:
        """The whole body is in: relay the request (or hand it over, `Connection.hand_over`)."""

    def abort(self) -> None:
        """The connection ends under it: drop the engine's answer, free what it holds."""


# Given the connection, a head the fast path took and its request id: an exchange, or None
# to leave the request to the handler.
ExpressLane = Callable[["_Connection", RequestHead, int], Exchange | None]
# Why the express lane woke the connection's task.
_HANDOVER = "handover"  # a request for the handler: `_Connection.handover`
_NEXT = "next"  # an exchange ended; bytes of the next request wait (pipelined)
_END = "end"  # an exchange ended the connection


class _Expired(Exception):
    """A read or write of this connection passed its deadline."""


class _Connection:
    """One client connection: reads heads, runs handlers, decides reuse, never leaks errors."""

    __slots__ = (
        "_responder",
        "body_deadline",
        "broken",
        "cancelled_for_gone",
        "config",
        "deadline",
        "exchange",
        "handover",
        "idle",
        "in_handler",
        "peer",
        "reader",
        "request",
        "server",
        "session",
        "stream",
        "task",
        "transport",
        "woke",
        "writing",
    )

    def __init__(
        self, server: HTTPServer, stream: ByteStream, transport: asyncio.Transport
    ) -> None:
        self.server = server
        self.config = server.config
        self.stream = stream
        self.transport = transport
        self.peer = stream.peer()
        self.session = ServerSession(
            max_header_bytes=self.config.max_header_bytes,
            max_body_bytes=self.config.max_body_bytes,
            fast_path=self.config.fast_path,
        )
        self.task: asyncio.Task[None] | None = None
        self.idle = True
        self.broken = False
        self.request: Request | None = None
        self._responder: Responder | None = None
        self.in_handler = False
        self.cancelled_for_gone = False
        self.deadline = 0.0  # loop time by which the pending read or write must finish
        self.body_deadline = 0.0  # loop time by which the current request's body must be in
        self.writing = False
        # The express lane: the request it relays now, why it woke our task, and a request
        # it handed over (head, request id, the body when it was read).
        self.exchange: Exchange | None = None
        self.woke: str | None = None
        self.handover: tuple[RequestHead, int, bytes | None] | None = None
        stream.on_closed = self._peer_closed

    # --- the connection's own task -------------------------------------------------------

    async def run(self) -> None:
        """Serve requests until the connection ends; always closes the socket."""
        try:
            while True:
                head = await self._receive_head()
                if head is None or not await self._serve(head):
                    return
        except (OSError, GatewayError) as exc:  # a policy: the connection just ends
            log.debug("connection_ended", peer=self.peer, error=repr(exc))
        except Exception as exc:  # a bug; the server must keep serving other connections
            log.error("connection_failed", peer=self.peer, error=repr(exc))
        finally:
            self.deadline = 0.0
            self.stream.on_data = None
            self._drop_exchange()
            if self.broken:
                self.transport.abort()
            else:
                self.server.outbox.flush()  # our last writes go before the FIN
                self.transport.close()

    async def _read(self, timeout: float) -> bytes | None:
        """Bytes from the socket; b"" at EOF or on a reset; None on timeout."""
        if timeout <= 0:
            return None
        self.deadline = self.server.loop_time() + timeout
        try:
            return await self.stream.read(self.config.read_chunk_bytes)
        except _Expired:
            return None
        except OSError:
            return b""
        finally:
            self.deadline = 0.0

    def expire(self) -> None:
        """The sweeper found our deadline passed: fail the pending read or write."""
        if self.writing:
            if self.exchange is not None:  # no drain pending: the express lane's write
                self._write_failed()
            self.transport.abort()  # the pending drain fails: `_write_failed` does the rest
        else:
            self.stream.set_exception(_Expired())

    async def _receive_head(self) -> RequestHead | None:
        """The next request head, or None when the connection should end."""
        session = self.session
        started = 0.0  # when the first bytes of the head were seen (0: all came in one read)
        while True:
            try:
                event = session.next_event()
            except ClientError as exc:
                await self._error_and_close(exc.status, str(exc))
                return None
            if isinstance(event, RequestHead):
                self.idle = False
                if event.has_body:  # one deadline for head and body, however they trickle
                    start = started or self.server.loop_time()
                    self.body_deadline = start + self.config.body_timeout_s
                return event
            if event is not Signal.NEED_DATA:
                return None  # CLOSED (clean EOF between requests) or nothing more to do
            if session.cycle_bytes == 0:
                self.idle = True
                if self.server.closing:
                    return None
                timeout = self.config.keepalive_timeout_s
                if self.server.express is not None:  # until the task wakes
                    self.stream.on_data = self._express_data
            else:
                self.idle = False
                now = self.server.loop_time()
                if not started:
                    started = now
                config = self.config
                timeout = started + min(config.header_timeout_s, config.body_timeout_s) - now
            data = await self._read(timeout)
            self.stream.on_data = None  # the task has the connection again
            if self.woke is not None or self.exchange is not None:
                woke, self.woke = self.woke, None
                if woke == _NEXT:
                    if data:
                        session.receive(data)
                    continue
                if woke == _END:
                    return None
                if woke != _HANDOVER:  # the client left, or a deadline passed, mid-exchange
                    exchange = self.exchange
                    assert exchange is not None
                    if not exchange.reading:
                        self._drop_exchange()
                        return None
                    self.exchange = None  # its body was arriving: the handler reads the rest
                    self.server.requests_active -= 1
                    self.handover = (exchange.head, exchange.request_id, None)
                self.idle = False
                assert self.handover is not None
                return self.handover[0]
            if data is None:
                if session.cycle_bytes:
                    await self._error_and_close(408, "request head not received in time")
                return None
            session.receive(data)

    async def _serve(self, head: RequestHead) -> bool:
        """Run the handler for one request; True when the connection may serve another.

        The handler runs inline in the connection task; a client hang-up cancels this task
        (`_client_gone`), and that one cancellation is taken back here with `uncancel()`.
        """
        server = self.server
        handover, self.handover = self.handover, None
        if handover is None:
            request = Request(self, head, next(server.request_ids))
            server.requests_total += 1
        else:  # counted by the express lane
            request = Request(self, head, handover[1], handover[2])
        responder = Responder(self)
        self.request, self._responder = request, responder
        if not head.has_body and (handover is None or handover[2] is None):
            self._pull_body_end(request)
        server.requests_active += 1
        error: BaseException | None = None
        self.in_handler = True
        try:
            await server.handler(request, responder)
        except asyncio.CancelledError as exc:
            if not self.cancelled_for_gone or self._uncancel() > 0:
                raise  # shutdown (as well): the connection ends
            error = exc
        except Exception as exc:  # the policy for each kind is in `_after_handler`
            error = exc
        finally:
            self.in_handler = False
            server.requests_active -= 1
        if self.cancelled_for_gone:  # the handler swallowed our cancellation
            self._uncancel()
        if (  # the usual end, decided without a coroutine: see `_after_handler`
            error is None
            and responder.finished
            and request._complete
            and not (self.broken or request._gone or server.closing)
            and self.session.reusable
        ):
            self.session.start_next_cycle()
            self.request = self._responder = None
            return True
        return await self._after_handler(error, request, responder)

    def _uncancel(self) -> int:
        """Take back the cancellation `_client_gone` asked for; the count still pending."""
        self.cancelled_for_gone = False
        task = self.task
        return task.uncancel() if task is not None else 0

    def _pull_body_end(self, request: Request) -> None:
        """Consume the EndOfMessage of a request without a body (no I/O needed)."""
        event = self.session.next_event()
        if event is not Signal.BODY_END:  # pragma: no cover - h11 gives it at once
            raise MalformedRequest("request without body did not end")
        request._complete = True

    async def _after_handler(
        self, error: BaseException | None, request: Request, responder: Responder
    ) -> bool:
        """Apply the policy for how the handler ended; True to keep the connection."""
        if self.broken or request._gone:
            return False
        if error is not None:
            if isinstance(error, ClientDisconnected | asyncio.CancelledError):
                return False
            if isinstance(error, ClientError):
                status, message = error.status, str(error)
            else:
                log.error("handler_failed", target=request.target, error=repr(error))
                status, message = 500, "internal error"
            if self.session.can_send_error:
                await self._error_and_close(status, message)
            return False
        if not responder.finished:
            if not responder.started:
                log.error("handler_returned_without_response", target=request.target)
                await self._error_and_close(500, "internal error")
            return False
        if not request.body_complete and not await self._discard_body():
            return False
        if self.server.closing or not self.session.reusable:
            return False
        self.session.start_next_cycle()
        self.request = self._responder = None
        return True

    async def _discard_body(self) -> bool:
        """Read and drop what is left of a body the handler did not read; False to close."""
        while True:
            try:
                event = self.session.next_event()
            except ClientError:
                return False
            if event is Signal.BODY_END:
                return True
            if event is Signal.NEED_DATA:
                data = await self._read(self.body_deadline - self.server.loop_time())
                if not data:
                    return False
                self.session.receive(data)
            elif not isinstance(event, bytes):
                return False

    # --- body, called from the handler task ----------------------------------------------

    def buffered_body(self, request: Request, chunks: list[bytes]) -> None:
        """Append the body bytes already received to `chunks` (no I/O; see `receive_body`)."""
        session = self.session
        if session.waiting_for_continue:
            return  # the client waits for our go-ahead: `receive_body` sends it
        while True:
            event = session.next_event()
            if isinstance(event, bytes):
                if event:
                    chunks.append(event)
                continue
            if event is Signal.BODY_END:
                request._complete = True
                if self.stream.at_eof():  # the client closed while we read its body
                    self._peer_closed()
            elif event is not Signal.NEED_DATA:  # pragma: no cover - h11 state forbids it
                raise MalformedRequest("unexpected end of request body")
            return

    async def receive_body(self, request: Request) -> bytes:
        """The next body chunk for `request` (see `Request.receive`)."""
        session = self.session
        if session.waiting_for_continue:
            await self.write(session.continue_bytes())
        while True:
            event = session.next_event()
            if isinstance(event, bytes):
                if event:
                    return event
                continue
            if event is Signal.BODY_END:
                request._complete = True
                if self.stream.at_eof():  # the client closed while we read its body
                    self._peer_closed()
                return b""
            if event is not Signal.NEED_DATA:  # pragma: no cover - h11 state forbids it
                raise MalformedRequest("unexpected end of request body")
            data = await self._read(self.body_deadline - self.server.loop_time())
            if data is None:
                raise BodyTimeout("request body not received in time")
            if not data:
                self._client_gone()
                raise ClientDisconnected("client closed the connection during the body")
            session.receive(data)

    # --- the express lane (`gateway.express`) ---------------------------------------------

    def _express_data(self, data: bytes) -> bool:
        """Bytes from the client while the task waits for a head; False leaves them to it."""
        try:
            return self._express(data)
        except Exception as exc:  # a bug: this connection ends, the server goes on
            log.error("express_failed", peer=self.peer, error=repr(exc))
            self._drop_exchange()
            self.broken = True
            self._wake(_END)
            return True

    def _express(self, data: bytes) -> bool:
        exchange = self.exchange
        session = self.session
        if exchange is None:
            whole = session.whole_request(data)
            if whole is not None:  # the whole request, read at once
                exchange = self._new_exchange(whole[0], whole[1])
                if exchange is not None:
                    self._start_exchange(exchange, whole[1])
                return True
            head = session.express_head(data)
            if head is None:
                return False
            # Its body may still be arriving, for the lane or the handler: by when it must be in.
            self.body_deadline = self.server.loop_time() + self.config.body_timeout_s
            exchange = self._new_exchange(head, None)
            if exchange is None:
                return True
        elif exchange.reading:
            session.receive(data)
        else:
            self.stream.hold(data)  # the next request (pipelined): after this answer
            return True
        if session.body_buffered:
            self._start_exchange(exchange, session.take_body())
        elif session.waiting_for_continue:
            self.hand_over(exchange.head, exchange.request_id, None)  # the handler says 100
        else:
            self.deadline = self.body_deadline
        return True

    def _new_exchange(self, head: RequestHead, body: bytes | None) -> Exchange | None:
        """A request the express lane took the head of (and the `body` of, when read): its
        exchange, or None when the handler has it."""
        server = self.server
        rid = next(server.request_ids)
        server.requests_total += 1
        server.requests_active += 1
        self.idle = False
        assert server.express is not None
        exchange = server.express(self, head, rid)
        if exchange is None:
            self.hand_over(head, rid, body)
            return None
        self.exchange = exchange
        return exchange

    def _start_exchange(self, exchange: Exchange, body: bytes) -> None:
        """The whole body is in: the exchange sends the request."""
        self.deadline = 0.0  # the engine's answer has its own deadlines
        exchange.reading = False
        exchange.start(body)

    def hand_over(self, head: RequestHead, request_id: int, body: bytes | None) -> None:
        """The express lane leaves this request to the handler (run by our task)."""
        self.exchange = None
        self.server.requests_active -= 1  # counted again by `_serve`
        self.handover = (head, request_id, body)
        self._wake(_HANDOVER)

    def express_done(self, keep: bool) -> None:
        """The express lane answered (`keep`: the connection may serve another request)."""
        self.exchange = None
        server = self.server
        server.requests_active -= 1
        session = self.session
        if keep and not self.broken and not server.closing and session.reusable:
            session.start_next_cycle()
            self.idle = True
            if not session.buffered and not self.stream.holding:
                self.deadline = server.loop_time() + self.config.keepalive_timeout_s
                return  # still armed: the next request comes to `_express_data`
            self._wake(_NEXT)
        else:
            self._wake(_END)

    def _wake(self, why: str) -> None:
        self.woke = why
        self.stream.on_data = None
        self.stream.wake()

    def _drop_exchange(self) -> None:
        """The connection ends under an exchange: it drops its engine answer."""
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            self.server.requests_active -= 1
            exchange.abort()

    # --- hang-up detection ---------------------------------------------------------------

    def _peer_closed(self) -> None:
        """EOF or reset from the client: a handler past its body must learn it at once."""
        exchange = self.exchange
        if exchange is not None:
            if not exchange.reading:  # stop the engine now; its task ends the connection
                self.server.clients_gone += 1
                self._drop_exchange()
                self._wake(_END)
            return  # its body was arriving: the handler takes the request over
        request = self.request
        if self.in_handler and request is not None and request.body_complete:
            self._client_gone()

    def _client_gone(self) -> None:
        request, responder, task = self.request, self._responder, self.task
        if request is None or request._gone:
            return
        request._set_gone()
        self.server.clients_gone += 1
        if (
            self.in_handler
            and task is not None
            and task is not asyncio.current_task()
            and not (responder is not None and responder.finished)
            and not self.cancelled_for_gone
        ):
            self.cancelled_for_gone = True
            task.cancel()

    # --- writing -------------------------------------------------------------------------

    def answer_head(
        self,
        status: int,
        headers: Headers,
        reason: bytes = b"",
        checked: bool = False,
        request_id: int | None = None,
        drop: frozenset[bytes] | None = None,
    ) -> bytes:
        """The bytes of a response head (see `Responder.start`) without the headers named in
        `drop`: Connection: close while the server closes, and the request id when the
        server names requests."""
        server = self.server
        if not reason:  # ours, or an engine's without one: the standard phrase
            reason = REASON_PHRASES.get(status, b"")
        if drop is None:
            headers = [*headers]
        else:
            headers = [header for header in headers if header[0] not in drop]
        if server.closing:
            headers.append((b"connection", b"close"))
        if server.request_id_header is not None and request_id is not None:
            headers.append((server.request_id_header, b"%d" % request_id))
        return self.session.response_head(status, headers, reason, checked)

    def known_answer_head(
        self,
        template: tuple[bytes, bytes],
        digits: bytes,
        request_id: int,
        body: bytes | None = None,
    ) -> bytes | None:
        """What `answer_head` makes of a head alike to the one `template` was made of (see
        `answer_template`) but for its Content-Length `digits`; None when this answer is not
        made the plain way (then `answer_head`).  With `body`: the whole answer."""
        if self.server.closing:  # Connection: close goes in
            return None
        return self.session.known_head(template, digits, self._answer_tail(request_id), body)

    def answer_template(
        self, head: bytes, digits: bytes, request_id: int
    ) -> tuple[bytes, bytes] | None:
        """The template of `head`, which `answer_head` just made with `digits` as its length
        and the request id (see `ServerSession.template_of`), or None."""
        if self.server.closing:
            return None
        return self.session.template_of(head, digits, self._answer_tail(request_id))

    def _answer_tail(self, request_id: int) -> bytes:
        """The header line `answer_head` puts last: the request id (when the server names
        requests)."""
        name = self.server.request_id_header
        return b"" if name is None else b"%s: %d\r\n" % (name, request_id)

    def complete_answer(
        self, status: int, headers: Headers, body: bytes, request_id: int | None
    ) -> bytes:
        """The bytes of a whole response with a Content-Length body (`Responder.respond`)."""
        length = (b"content-length", b"%d" % len(body))
        session = self.session
        head = self.answer_head(status, [*headers, length], request_id=request_id)
        return head + (session.body(body) if body else b"") + session.end()

    async def write(self, data: bytes) -> None:
        """Write bytes to the client with backpressure; failures become `ClientDisconnected`."""
        if self.write_now(data):
            await self.drain()

    def write_now(self, data: bytes) -> bool:
        """Hand bytes to the transport; True when the caller must `drain()` before more."""
        if self.broken:
            raise ClientDisconnected("connection already failed")
        transport = self.transport
        try:
            if transport.is_closing():
                raise ConnectionResetError("transport is closing")
            self.server.outbox.write(transport, data)
        except (OSError, RuntimeError) as exc:
            self._write_failed()
            raise ClientDisconnected(f"write to client failed: {exc!r}") from exc
        return transport.get_write_buffer_size() >= self.server.write_high_water

    async def drain(self) -> None:
        """Wait (bounded by the write timeout) until the client took enough of our writes."""
        self.deadline = self.server.loop_time() + self.config.write_timeout_s
        self.writing = True
        try:
            await self.stream.drain()
        except (OSError, RuntimeError) as exc:
            self._write_failed()
            raise ClientDisconnected(f"write to client failed: {exc!r}") from exc
        except asyncio.CancelledError:
            self._write_failed()
            raise
        finally:
            self.deadline = 0.0
            self.writing = False

    def _write_failed(self) -> None:
        if not self.broken:
            self.broken = True
            self.server.write_failures += 1
            self.session.send_failed()
            self._client_gone()

    async def _error_and_close(self, status: int, message: str) -> None:
        """Reply with an error if our state allows it, then close after a short linger."""
        if self.broken:
            return
        if self.session.can_send_error:
            headers, body = self.server.render_error(status, message)
            rid_header = self.server.request_id_header
            if rid_header is not None:  # a head refused before its handler gets an id here
                request = self.request
                number = request.request_id if request else next(self.server.request_ids)
                headers = [*headers, (rid_header, b"%d" % number)]
            try:
                out = self.session.error_reply(status, headers, body)
            except ResponseStateError:
                out = b""
            if out:
                self.server.error_replies[status] = self.server.error_replies.get(status, 0) + 1
                try:
                    await self.write(out)
                except ClientDisconnected:
                    return
        await self._linger()

    async def _linger(self) -> None:
        """Half-close, then read and drop for a moment so the client sees our reply, not RST."""
        if self.transport.is_closing() or not self.transport.can_write_eof():
            return
        self.server.outbox.flush()  # the reply goes before the FIN
        try:
            self.transport.write_eof()
        except OSError:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.linger_s
        budget = self.config.linger_max_bytes
        while budget > 0:
            data = await self._read(deadline - loop.time())
            if not data:
                return
            budget -= len(data)


Connection = _Connection  # what the express lane sees of a connection

_BUSY_MESSAGE = "too many connections; retry shortly"
_BUSY_RETRY_AFTER_S = 1
_MAX_REFUSING = 64  # over-cap connections answered at once; more are dropped unanswered
_REFUSE_LINGER_S = 1.0  # how long an over-cap connection may take to read our 503


class HTTPServer:
    """Accepts connections and serves them with `handler`; see the module docstring."""

    def __init__(
        self,
        handler: Handler,
        config: ServerConfig | None = None,
        *,
        render_error: ErrorRenderer = plain_error,
    ) -> None:
        self.handler = handler
        self.config = config or ServerConfig()
        self.render_error = render_error
        self.closing = False
        self.request_ids = itertools.count(1)
        self.request_id_header: bytes | None = None  # set: every answer names its request id
        self.express: ExpressLane | None = None  # set: plain requests may skip the handler
        self.requests_total = 0
        self.requests_active = 0
        self.clients_gone = 0
        self.write_failures = 0
        self.error_replies: dict[int, int] = {}
        self.write_high_water = 64 * 1024
        self.outbox = Outbox()  # the writes to clients of one round go out together
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._connections_total = 0
        self._connections_refused = 0
        self.max_connections = self.config.max_connections  # see `start`
        self._refusing = 0
        self._busy_reply = b""
        self._cap_warning = limits.Every(limits.WARN_EVERY_S)
        self._fd_check = limits.Every(limits.FD_CHECK_EVERY_S)
        self._fd_warning = limits.Every(limits.WARN_EVERY_S)
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        c = self.config
        self._sweeper = Sweeper(
            sweep_interval(c.header_timeout_s, c.keepalive_timeout_s, c.body_timeout_s,
                           c.write_timeout_s, c.linger_s),
            self._connections.values,
            self._check_fds,
        )  # fmt: skip

    def loop_time(self) -> float:
        """The event loop's clock (deadlines are in this time)."""
        assert self._loop is not None
        return self._loop.time()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listen on host:port (0 picks a free port; see `port`).

        Raises the process's soft limit on open files to the hard one first, and lowers the
        connection cap to what the descriptors allow (`gateway.limits`).
        """
        loop = self._loop = asyncio.get_running_loop()
        limit = self.config.read_chunk_bytes
        fd_limit = limits.raise_fd_limit()
        self.max_connections = limits.connection_cap(self.config.max_connections, fd_limit)
        if self.max_connections < self.config.max_connections:
            lowered = log.warning if self.max_connections < 1024 else log.info
            lowered(
                "connection_cap_lowered", cap=self.max_connections, fd_limit=fd_limit,
                configured=self.config.max_connections,
            )  # fmt: skip
        headers, body = self.render_error(503, _BUSY_MESSAGE)
        headers = [*headers, (b"retry-after", b"%d" % _BUSY_RETRY_AFTER_S)]
        session = ServerSession(max_header_bytes=1024, max_body_bytes=0)
        self._busy_reply = session.error_reply(503, headers, body)

        def protocol() -> ByteStream:
            return ByteStream(limit, self._accept)

        self._server = await loop.create_server(
            protocol, host, port, backlog=self.config.backlog, reuse_address=True
        )
        self._sweeper.start()

    @property
    def port(self) -> int:
        """The port actually bound (useful with port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("server is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, stream: ByteStream) -> None:
        task = asyncio.current_task()
        transport = stream.transport
        assert transport is not None  # the task starts once connected
        if self.closing or task is None:
            self._connections_refused += 1
            transport.abort()
            return
        if len(self._connections) >= self.max_connections:
            await self._refuse(stream, transport)
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(self, stream, transport)
        conn.task = task
        self._connections[task] = conn
        self._connections_total += 1
        try:
            await conn.run()
        except asyncio.CancelledError:
            pass  # the connection task ends here either way
        finally:
            del self._connections[task]

    async def _refuse(self, stream: ByteStream, transport: asyncio.Transport) -> None:
        """Over the cap: a 503 with Retry-After, then close once the client read it."""
        self._connections_refused += 1
        if self._cap_warning.due(self.loop_time()):
            log.warning(
                "connection_cap_reached", cap=self.max_connections,
                refused_total=self._connections_refused,
            )  # fmt: skip
        if self._refusing >= _MAX_REFUSING:
            transport.abort()  # a flood: answering would hold descriptors longer
            return
        self._refusing += 1
        try:
            transport.write(self._busy_reply)
            transport.write_eof()
            # Read and drop until the client closes, so that it sees the 503 and not a reset.
            async with asyncio.timeout(_REFUSE_LINGER_S):
                while await stream.read(self.config.read_chunk_bytes):
                    pass
        except (OSError, RuntimeError, TimeoutError):
            pass  # policy: the client just loses the connection, as it would without the 503
        finally:
            self._refusing -= 1
            transport.close()

    def _check_fds(self, now: float) -> None:
        """Now and then, count open descriptors: running out must never be silent."""
        if not self._fd_check.due(now):
            return
        limit = limits.fd_limit()
        count = limits.open_fds()
        pressure = limits.fd_pressure(count, limit)
        if pressure is not None and self._fd_warning.due(now):
            log.error(
                "file_descriptors_" + pressure, open=count, limit=limit,
                connections=len(self._connections),
            )  # fmt: skip

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, close idle connections, let in-flight responses finish, then cut."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        self._sweeper.start()  # the deadlines of connections still running keep applying
        for task, conn in list(self._connections.items()):
            if conn.idle:
                task.cancel()
        pending = set(self._connections)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        self._sweeper.stop()
        if self._server is not None:
            await self._server.wait_closed()

    def statistics(self) -> ServerStatistics:
        """Counters since start (see `ServerStatistics`)."""
        return ServerStatistics(
            connections_open=len(self._connections),
            connections_idle=sum(1 for c in self._connections.values() if c.idle),
            connections_total=self._connections_total,
            connections_refused=self._connections_refused,
            requests_total=self.requests_total,
            requests_active=self.requests_active,
            clients_gone=self.clients_gone,
            write_failures=self.write_failures,
            error_replies=dict(self.error_replies),
            closing=self.closing,
        )
