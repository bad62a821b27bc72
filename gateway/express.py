"""The express lane: a plain request to a ready model, relayed in callbacks.

Nearly all of the gateway's traffic has one shape: a well-formed POST to `/d/<id>/v1/...`
for a model that is ready, its whole body in one or two reads, to an engine with an idle
keep-alive connection.  On the handler's path (`Gateway.handle`) such a request woke the
connection's task twice, through eight levels of coroutines each time, and built a request,
a responder and an answer object around bytes that only pass through: two thirds of the
gateway's CPU per request, against the byte relay that is Python's floor.

The express lane relays exactly that shape without a coroutine.  While a connection's task
waits for the next head, the client's bytes go first to `_Connection._express_data`
(`gateway.server`), which takes a head the fast path accepts and asks `Gateway.express`
whether it is plain; an `Exchange` then waits for the body, takes a lease, sends the request
on an idle engine connection (`UpstreamPool.send_now`), or on a new one it opens when none
is idle (`open_now`, `send_on`), and pumps the engine's answer back from that connection's
`data_received`.  It uses the same protocol objects as the handler's
path (`ServerSession` frames the answer, `ClientSession` parses the engine's), the same
headers, the same errors and the same counters; `tests/test_gateway_express.py` holds both
paths to the same bytes.

Whatever is not plain goes to the handler, which stays the judge of it: a route that is
not inference, a model that is not ready, no free slot for the engine, a client waiting for
100 Continue, and a request that provably never reached the engine (`UpstreamError.unsent`:
the connection was refused, or found closed before the request went out): the handler sends
it again, or has it wait for the engine's restart, as it does its own; so is one closed before
any answer byte whose engine the runtime says had exited before it went out (Docker's port
proxy accepts for a dead container: `_exit_known`).  A request the engine may have seen is
never handed over: it gets its error here, as on the handler's path.  The lane
is bounded like the rest: the engine connection stops reading while the client's write
buffer is over its mark, and both sides keep their deadlines.
"""

from __future__ import annotations

import asyncio
import functools
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import structlog

from actors.admission import Controller, DeploymentView, Lease
from events.traffic import CLIENT_GONE, ENGINE_ERROR, SERVED
from gateway.classify import Endpoint, names_served
from gateway.errors import (
    ClientDisconnected,
    ResponseStateError,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.messages import (
    Headers,
    RequestHead,
    ResponseHead,
    Signal,
    not_forwarded,
    strip_hop_by_hop,
)
from gateway.trace import ROW
from gateway.upstream import EngineHead, Outgoing

if TYPE_CHECKING:
    from gateway.queued import ErrorReply
    from gateway.server import Connection
    from gateway.trace import TrafficTrace
    from gateway.upstream import Engine, EngineConnection, UpstreamPool

log = structlog.get_logger("gateway")

# Larger bodies go the handler's way, which waits (bounded by the write timeout) until the
# engine took them; one this size goes out in a single write to a loopback socket.
MAX_BODY_BYTES = 64 * 1024


class Forwarding(EngineHead):
    """What the express lane made of a client's request head: its route (the deployment, the
    endpoint) and what it becomes for the engine (`EngineHead`).  Kept with the memo of the
    head (`LengthMemo.derived`, see `ServerSession.known`): a head alike but for its length
    has the same of both, so the next request on the connection is routed and sent from it."""

    __slots__ = ("checked", "deployment_id", "endpoint")

    def __init__(
        self, deployment_id: str, target: bytes, endpoint: Endpoint | None, drop: frozenset[bytes]
    ) -> None:
        super().__init__(target, drop)
        self.deployment_id = deployment_id
        self.endpoint = endpoint
        # The gateway keys (`Access.keys`) the head's Authorization passed under, if any.
        self.checked: tuple[bytes, ...] | None = None


class Host(Protocol):
    """What an exchange uses of the gateway that routed it (`gateway.app.Gateway`): its pool,
    controller, clock, counters and trace, and its verdicts on an engine that failed.  Named
    here so that the lane depends on these alone and the handler's module on the lane."""

    controller: Controller
    upstream: UpstreamPool
    clock: Callable[[], float]
    closing: bool  # the gateway is shutting down: cut streams say so
    exchanges: set[Exchange]  # the exchanges under way, for the shutdown's cut
    on_first_byte: Callable[[str, float], None] | None
    trace: TrafficTrace | None
    relayed: int
    relayed_express: int

    def cut_stream_event(
        self,
        headers: Headers,
        last: bytes,
        view: DeploymentView,
        endpoint: Endpoint | None,
    ) -> bytes | None:
        """The error event that ends a stream whose engine failed (None: not a stream)."""

    def engine_unreachable(self, view: DeploymentView, exc: UpstreamError) -> ErrorReply:
        """The reply to a request whose engine did not answer, with the failure counted."""

    def engine_missed(self, view: DeploymentView, exc: UpstreamError) -> None:
        """Count a request that never reached its engine (the handler sends it again)."""

    def engine_failed(self, view: DeploymentView, exc: UpstreamError) -> None:
        """Count an engine that failed while answering."""


_ROW_SIZE = ROW.size  # a traffic trace row's bytes


class Exchange:
    """One request on the express lane, from its head to the end of the engine's answer."""

    __slots__ = (
        "_answer_headers",
        "_arrived",
        "_chunks_through",
        "_conn",
        "_connecting",
        "_ended",
        "_engine",
        "_first",
        "_forwarding",
        "_gateway",
        "_last",
        "_last_byte",
        "_lease",
        "_outcome",
        "_paused",
        "_request",
        "_reused",
        "_sent_at",
        "_started",
        "_upstream",
        "_view",
        "head",
        "reading",
        "request_id",
    )

    def __init__(
        self,
        gateway: Host,
        conn: Connection,
        head: RequestHead,
        request_id: int,
        view: DeploymentView,
        forwarding: Forwarding,
    ) -> None:
        self._gateway = gateway
        self._conn = conn
        self.head = head
        self.request_id = request_id
        self.reading = True  # the body is arriving (`start` not called yet)
        self._view = view
        self._forwarding = forwarding
        self._arrived = time.monotonic()
        self._first = 0.0  # when the answer's first byte went out (the trace's ttfb)
        self._last_byte = 0.0  # when its last did, if known without the clock (the trace's)
        self._outcome = SERVED  # for the trace (`gateway.trace`)
        self._request: Outgoing | None = None  # as sent to the engine, once leased
        self._sent_at = 0.0  # wall clock before the request went out (`_exit_known`)
        self._reused = False  # it went out on an idle keep-alive connection (`send_now`)
        self._lease: Lease | None = None
        self._engine: Engine | None = None
        self._upstream: EngineConnection | None = None
        self._started = False  # the answer's head went to the client
        self._answer_headers: Sequence[tuple[bytes, bytes]] = ()  # the engine's, once started
        self._last = b""  # the last piece of body relayed
        self._paused = False  # the engine connection waits for the client to read
        self._chunks_through = False  # the engine's chunks go to the client as they are
        self._ended = False  # `_end` ran: the connection has been told
        self._connecting: asyncio.Task[EngineConnection] | None = None  # a new connection

    # --- the request -----------------------------------------------------------------------

    def start(self, body: bytes) -> None:
        """The whole body is in: send the request, or hand it to the handler (which also
        judges a model name the lane cannot vouch for: `names_served`)."""
        gateway = self._gateway
        view = self._view
        hint = view.engine_handle  # as the head found it: no lease without a chance
        pool = gateway.upstream
        lease = None
        if (
            hint is not None
            and len(body) <= MAX_BODY_BYTES
            and pool.can_send(hint.host, hint.port)
            and names_served(self._forwarding.endpoint, body, view.served_model)
        ):
            lease = gateway.controller.try_acquire(view.deployment_id)
        if lease is None:
            self._conn.hand_over(self.head, self.request_id, body)
            return
        self._lease = lease
        gateway.exchanges.add(self)
        handle = lease.handle
        head = self.head
        self._request = request = Outgoing(head.method, head.headers, body, self._forwarding)
        self._sent_at = gateway.clock()  # an engine gone before it never saw the request
        sent = pool.send_now(handle.host, handle.port, request)
        if sent is not None:
            self._reused = True
            self._hook(*sent)
            return
        # No idle connection (they expire after a few seconds without requests): a new one,
        # opened without leaving the lane.
        self._engine, self._connecting = pool.open_now(handle.host, handle.port)
        self._connecting.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[EngineConnection]) -> None:
        """The new engine connection is open, or could not be opened, or is not wanted."""
        self._connecting = None
        engine, request = self._engine, self._request
        assert engine is not None and request is not None
        pool = self._gateway.upstream
        wanted = not self._ended and self._lease is not None  # else the client left
        try:
            if task.cancelled():
                pool.give_up(engine)
                return
            error = task.exception()
            if error is not None:
                pool.give_up(engine)
                if not wanted:
                    return
                if not isinstance(error, UpstreamError):
                    raise error  # a bug: `_broken` below
                self._failed(error, [])
                return
            upstream = task.result()
            if not wanted:
                pool.finish(engine, upstream, reuse=False)
            elif pool.send_on(engine, upstream, request):
                self._hook(engine, upstream)
            else:
                # Nothing was handed to the kernel (`send_on` says so): never reached it.
                closed = UpstreamClosed("engine closed the connection at once", unsent=True)
                self._failed(closed, [])
        except Exception as exc:
            self._broken(exc)

    def _hook(self, engine: Engine, upstream: EngineConnection) -> None:
        """The request went out on `upstream`: its answer comes to us."""
        self._engine = engine
        self._upstream = upstream
        upstream.stream.on_data = self._answer_data
        upstream.stream.on_closed = self._engine_closed
        upstream.on_expired = self._expired

    # --- the answer, from the engine connection's callbacks -------------------------------

    def _answer_data(self, data: bytes) -> bool:
        upstream = self._upstream
        if upstream is None:  # pragma: no cover - `finish` unhooks us first
            return False
        upstream.deadline = upstream.loop.time() + upstream.config.read_timeout_s
        try:
            if self._chunks_through:
                # A stream's usual read, one whole event in one plain chunk: the client gets
                # these very bytes, which `_pump` would unframe and frame again.
                start = upstream.session.whole_chunk(data)
                if start:
                    self._last = data[start:-2]
                    self._send(data)
                    return True
            elif not self._started and self._whole_answer(data):
                return True
            upstream.session.receive(data)
            self._pump()
        except Exception as exc:
            self._broken(exc)
        return True

    def _engine_closed(self) -> None:
        upstream = self._upstream
        if upstream is not None:
            try:
                upstream.session.receive(b"")
                self._pump()
            except Exception as exc:
                self._broken(exc)

    def _expired(self) -> None:
        upstream = self._upstream
        if upstream is not None:
            seconds = upstream.config.read_timeout_s
            try:
                self._failed(UpstreamTimeout(f"engine sent nothing for {seconds:g} s"), [])
            except Exception as exc:
                self._broken(exc)

    def _broken(self, exc: Exception) -> None:
        """A bug: this exchange ends (its client's connection closes), the gateway goes on."""
        log.error("express_failed", target=self.head.target, error=repr(exc))
        self._end(keep=False)

    def _pump(self) -> None:
        """Relay what the engine said so far, in one write to the client."""
        upstream = self._upstream
        assert upstream is not None
        session = upstream.session
        client = self._conn.session
        out: list[bytes] = []
        try:
            while True:
                event = session.next_event()
                if type(event) is bytes:
                    self._last = event
                    out.append(client.body(event))
                elif event is Signal.NEED_DATA:
                    break
                elif event is Signal.BODY_END:
                    out.append(client.end())
                    self._completed(b"".join(out))
                    return
                elif type(event) is ResponseHead:
                    out.append(self._answer_head(event))
                else:
                    raise UpstreamClosed("engine answer ended unexpectedly")
        except UpstreamError as exc:
            self._failed(exc, out)
            return
        except ResponseStateError as exc:  # the engine's answer broke our framing
            log.error("express_answer_failed", target=self.head.target, error=repr(exc))
            self._end(keep=False)
            return
        self._write(out)

    def _whole_answer(self, data: bytes) -> bool:
        """Relay `data` when it is one whole answer alike to one relayed before on this engine
        connection but for its length (its memo keeps the client's head made then, see
        `_answer_head`): the client gets that head with this length and the body, in one
        write, and the exchange ends.  False: nothing happened (the usual way then)."""
        upstream = self._upstream
        assert upstream is not None
        session = upstream.session
        alike = session.alike_answer(data)
        if alike is None:
            return False
        template, digits = alike
        body = data[len(data) - int(digits) :]
        out = self._conn.known_answer_head(template, digits, self.request_id, body)
        if out is None:
            return False
        session.take_alike()
        self._first_byte()
        self._last_byte = self._first  # the same write: the trace needs no clock for the end
        self._completed(out)
        return True

    def _first_byte(self) -> None:
        """The answer starts: nothing else can go to the client instead (see `_failed`)."""
        self._started = True
        self._first = first = time.monotonic()
        on_first_byte = self._gateway.on_first_byte
        if on_first_byte is not None:
            on_first_byte(self._view.deployment_id, first - self._arrived)

    def _completed(self, data: bytes) -> None:
        """The last bytes of a whole answer: the exchange ends, its engine connection reused."""
        if self._send(data):
            self._release(reuse=True)
            self._end(keep=True)

    def _answer_head(self, head: ResponseHead) -> bytes:
        self._answer_headers = headers = head.headers  # as the engine sent them (`_failed`)
        self._first_byte()
        conn = self._conn
        upstream = self._upstream
        assert upstream is not None  # the head came from it
        # An answer head alike to one relayed before but for its length (the engine
        # connection's memo took it): its bytes for the client are the ones made then, with
        # its length (see `ServerSession.template_of`).
        memo = upstream.session.known
        if memo is not None:
            digits = headers[memo.index][1]
            template = memo.derived
            if template is not None:
                data = conn.known_answer_head(template, digits, self.request_id)
                if data is not None:
                    self._chunks_through = False
                    return data
        data = conn.answer_head(
            head.status, headers, head.reason, True, self.request_id, not_forwarded(headers)
        )
        if memo is not None and memo.derived is None:
            memo.derived = conn.answer_template(data, digits, self.request_id)
        self._chunks_through = conn.session.chunked_body
        return data

    # --- writing to the client -------------------------------------------------------------

    def _write(self, out: list[bytes]) -> bool:
        """Write to the client; False when it is gone (the exchange is over then)."""
        return self._send(b"".join(out))  # a lone piece comes back as it is, not copied

    def _send(self, data: bytes) -> bool:
        """Write `data` to the client; False when it is gone (the exchange is over then)."""
        if not data:
            return True
        try:
            if self._conn.write_now(data) and not self._paused:
                self._pause()
        except ClientDisconnected:
            self._outcome = CLIENT_GONE
            self._end(keep=False)
            return False
        return True

    def _pause(self) -> None:
        """Stop reading the engine until the client took enough (bounded by the write
        timeout, which ends the connection)."""
        upstream = self._upstream
        if upstream is None or not self._conn.stream.writing_paused:
            return  # under the transport's own mark: it tells us when it is over
        self._paused = True
        upstream.transport.pause_reading()
        conn = self._conn
        conn.stream.on_drained = self._drained
        conn.deadline = conn.server.loop_time() + conn.config.write_timeout_s
        conn.writing = True

    def _drained(self) -> None:
        self._unpause()
        upstream = self._upstream
        if upstream is not None:
            upstream.transport.resume_reading()

    def _unpause(self) -> None:
        if self._paused:
            self._paused = False
            conn = self._conn
            conn.stream.on_drained = None
            conn.deadline = 0.0
            conn.writing = False

    # --- endings ---------------------------------------------------------------------------

    def _failed(self, exc: UpstreamError, out: list[bytes]) -> None:
        """The engine failed: before its answer as the handler's path does after its retry,
        during it (after `out`, what it said last) with a final error event where the answer
        is an event stream."""
        gateway = self._gateway
        if not self._started:
            engine, upstream = self._engine, self._upstream
            if exc.unsent or (
                engine is not None
                and upstream is not None
                and gateway.upstream.stale(engine, upstream, self._reused, exc)
            ):
                # It never reached the engine, or met the keep-alive race (a reused
                # connection closed before any answer byte, `UpstreamPool.stale`): the
                # handler's path sends it again, or has it wait for the engine's restart
                # (`Gateway._relay`).
                self._hand_over()
                return
            lease = self._lease
            if (
                isinstance(exc, UpstreamClosed)
                and exc.before_response
                and lease is not None
                and not gateway.closing
            ):
                # Closed before any answer byte: if the engine had exited before the request
                # went out (Docker's port proxy accepts for a dead container), it never saw
                # it (`Gateway.never_reached`).  The connection waits for the answer.
                handle = lease.handle
                self._release(reuse=False)
                asking = gateway.controller.exited_before(handle, self._sent_at)
                task = asyncio.get_running_loop().create_task(asking)
                task.add_done_callback(functools.partial(self._exit_known, exc))
                return
            self._unreachable(exc)
            return
        gateway.engine_failed(self._view, exc)
        self._outcome = ENGINE_ERROR
        self._release(reuse=False)
        relayed = strip_hop_by_hop(self._answer_headers)  # the headers the client got
        endpoint = self._forwarding.endpoint
        event = gateway.cut_stream_event(relayed, self._last, self._view, endpoint)
        if event is None:  # not an event stream: the client sees the answer incomplete
            if self._write(out):
                self._end(keep=False)
            return
        session = self._conn.session
        if self._write([*out, session.body(event), session.end()]):
            self._end(keep=True)

    def _hand_over(self) -> None:
        """Give the request to the handler's path, which sends it again or has it wait."""
        self._release(reuse=False)
        assert self._request is not None  # sent: `_failed` comes after `start`
        self._conn.hand_over(self.head, self.request_id, self._request.body)

    def _unreachable(self, exc: UpstreamError) -> None:
        """The engine failed before its answer: the error, as the handler's path gives it."""
        reply = self._gateway.engine_unreachable(self._view, exc)
        self._outcome = ENGINE_ERROR
        self._release(reuse=False)
        answer = self._conn.complete_answer(
            reply.status, reply.headers(), reply.body(), self.request_id
        )
        if self._write([answer]):
            self._end(keep=True)

    def _exit_known(self, exc: UpstreamError, task: asyncio.Task[bool]) -> None:
        """The controller said whether the engine had exited before the request went out."""
        if self._ended:  # the client left meanwhile
            return
        try:
            gone = not task.cancelled() and task.exception() is None and task.result()
            if gone:  # as `Gateway._relay` does: the engine checked, the request waits
                self._gateway.engine_missed(self._view, exc)
                self._hand_over()
            else:
                self._unreachable(exc)
        except Exception as exc_:
            self._broken(exc_)

    def _end(self, *, keep: bool) -> None:
        if self._ended:
            return
        self._ended = True
        if self._upstream is not None or self._lease is not None:
            self._release(reuse=False)
        if self._paused:
            self._unpause()
        gateway = self._gateway
        gateway.relayed += 1
        gateway.relayed_express += 1
        trace = gateway.trace
        if trace is not None:  # its row, as `record` packs it, without the call
            off = trace.off
            arrived = self._arrived
            try:
                trace.pack_into(
                    trace.buf, off, trace.index[self._view.deployment_id], self._outcome,
                    self._chunks_through, self.request_id, arrived, arrived, self._first,
                    self._last_byte or time.monotonic(),
                )  # fmt: skip
            except (KeyError, struct.error):  # the batch's first row of the deployment, or
                self._traced()  # the batch is full: `record` sees to both
            else:
                trace.off = off + _ROW_SIZE
        self._conn.express_done(keep)

    def _traced(self) -> None:
        """The exchange's row in the traffic trace (`gateway.trace`), when there is one (its
        end is the last byte's time, when the answer went out whole in one write, else now;
        `_end` packs the same row itself, `tests/test_traffic_trace.py` holds both to
        `record`'s)."""
        trace = self._gateway.trace
        if trace is not None:
            arrived = self._arrived
            trace.record(
                self._view.deployment_id, self.request_id, arrived, arrived, self._first,
                self._last_byte or time.monotonic(), self._outcome, self._chunks_through,
            )  # fmt: skip

    def _release(self, *, reuse: bool) -> None:
        """Give back the engine connection (reused only after a complete answer) and the
        lease; idempotent."""
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            assert self._engine is not None
            self._gateway.upstream.finish(self._engine, upstream, reuse=reuse)
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()
        if self._connecting is not None:
            self._connecting.cancel()  # `_connected` gives the slot (or connection) back
        self._gateway.exchanges.discard(self)

    def abort(self) -> None:
        """The client's connection ends under us: reset the engine's (it stops generating)."""
        if not self._ended:
            self._outcome = CLIENT_GONE
            self._traced()
        self._ended = True  # the connection is told nothing more
        self._unpause()
        self._release(reuse=False)

    def cut(self) -> None:
        """Shutdown, past its grace: end an answer under way as an engine failure would."""
        if self._started and self._upstream is not None:
            self._upstream.abort()
