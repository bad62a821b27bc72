"""The on-demand gateway: `/d/<deployment_id>/v1/...` relayed to engines, started on demand.

A request for a ready model is relayed at once (no JSON parsing, no logging); one for a model
that is not ready waits on the controller, holding its body, and may get the queued line.
The engine's answer goes through byte for byte except for a queued non-streaming answer, whose
text gets the queued line in front.

A request on this path is one `_InFlight`, which each step of its walk takes: `_inference`,
`_lease_then_relay`, `_wait_then_relay` and `_wait_once`, `_relay`, and one of the three ways
an answer goes out (`_pass`, `_continue_sse`, `_rewrite`).  The module is long because that
walk, with the error each step can end in, is one story best read in the order a request
lives it; what is not the walk has rooms of its own: the express lane
(`gateway.express`), the gateway's own answers and texts (`gateway.queued`), probes
(`gateway.health`), routing and body reading (`gateway.classify`), the engine connections
(`gateway.upstream`).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import structlog

from actors.admission import Controller, DeploymentView, Lease, Refused, Waiter
from actors.ports import EngineHandle
from events.traffic import (
    CLIENT_GONE,
    ENGINE_ERROR,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    REFUSED,
    SERVED,
)
from gateway import health, queued
from gateway.access import Access
from gateway.classify import (
    Endpoint,
    Route,
    RouteKind,
    body_model,
    body_traits,
    classify_route,
    with_model,
)
from gateway.errors import BodyTooDeep, ClientDisconnected, UpstreamClosed, UpstreamError
from gateway.express import Exchange, Forwarding
from gateway.messages import (
    NOT_FORWARDED,
    Headers,
    RequestHead,
    header_value,
    not_forwarded,
    strip_hop_by_hop,
)
from gateway.queued import ErrorReply
from gateway.server import Connection, HTTPServer, Request, Responder, ServerConfig
from gateway.trace import TrafficTrace
from gateway.upstream import UpstreamConfig, UpstreamPool, UpstreamResponse

log = structlog.get_logger("gateway")

STATE_HEADER = b"x-dgxmm-ondemand-state"
# Every answer names its request: the id queue events record, so `dgxmm replay --request`
# finds a complaint's story.  Ids start at the wall clock's microsecond count, so they stay
# unique across restarts (unless a run averaged a million requests a second).
REQUEST_ID_HEADER = b"x-dgxmm-request-id"
_STATUS_CODES = {
    400: "bad_request",
    404: "not_found",
    408: "request_timeout",
    413: "request_too_large",
    431: "headers_too_large",
    500: "internal_error",
    501: "not_implemented",
}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Limits of the gateway proper (the HTTP server and pool have their own)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_rewrite_bytes: int = 32 * 1024 * 1024  # largest answer buffered to add the queued line
    wait_deadline_s: float = 1800.0  # safety net above the controller's own queue timeout
    max_engine_error_bytes: int = 64 * 1024  # engine error body turned into a stream event
    express: bool = True  # plain requests to ready models take the express lane (see there)


_MAX_TARGETS = 1024  # split targets kept (then they are forgotten all at once)
CUT_SLACK_S = 5.0  # after the grace, how long cut streams get to write their error event
# Times a request that never reached its engine is sent (each after waiting for the engine):
# one engine lost under it, then a second one, is DGXMM's to recover from; a third is not.
MAX_SENDS = 3


class _Mode(enum.Enum):
    """How an engine's answer goes to the client."""

    PASS = "pass"  # status, headers and body as they arrive
    REWRITE = "rewrite"  # queued, not streamed: the line in front of the text
    CONTINUE_SSE = "continue_sse"  # the 200 head and queued chunk went out; body only


class _InFlight:
    """A request on the handler's path, from its whole body to the end of its answer: what
    each step of its walk reads (lease or wait, relay, answer), and what the traffic trace
    records of it (`gateway.trace`).  The express lane's `Exchange` is this for its path.
    Lookups and probes that go to an engine without a lease are one too, untraced."""

    __slots__ = (
        "admitted",
        "arrived",
        "body",
        "chunk_sent",
        "endpoint",
        "first",
        "outcome",
        "request",
        "responder",
        "streamed",
        "target",
        "view",
    )

    def __init__(
        self,
        request: Request,
        responder: Responder,
        view: DeploymentView,
        target: bytes,
        body: bytes = b"",
        endpoint: Endpoint | None = None,
        arrived: float = 0.0,
    ) -> None:
        self.request = request
        self.responder = responder
        self.view = view
        self.target = target  # for the engine: the path after /d/<id>
        self.body = body
        self.endpoint = endpoint
        self.arrived = arrived  # monotonic; 0: not an inference request (no first byte timed)
        self.admitted = 0.0  # when it got its lease (0: never)
        self.first = 0.0  # when the engine's answer head came (0: none)
        self.outcome = ENGINE_ERROR  # set as the request goes on
        self.streamed = False
        self.chunk_sent = False  # the queued line's 200 head and chunk went out


class _WaitDeadline(Exception):
    """The gateway's own deadline for a waiting request ran out."""


class Gateway:
    """The gateway handler; `serve` runs it on an `HTTPServer`."""

    def __init__(
        self,
        controller: Controller,
        *,
        config: GatewayConfig | None = None,
        upstream: UpstreamPool | None = None,
        clock: Callable[[], float] = time.time,
        access: Access | None = None,
        named: Callable[[str], str | None] | None = None,
    ) -> None:
        self.controller = controller
        # The gateway key check (`gateway.access`); None: no check (a gateway built alone, as
        # in tests of the relay; DGXMM always passes one).
        self.access = access
        # A deployment's id by its name, for `/d/<name>/...` (names are unique per box); None:
        # ids only.  LiteLLM's entries use ids, which always win and never ask for a name.
        self.named = named
        self.config = config or GatewayConfig()
        self.upstream = upstream or UpstreamPool(UpstreamConfig())
        self.clock = clock
        self.server: HTTPServer | None = None
        self.relayed = 0
        self.relayed_express = 0  # of them, on the express lane
        self.waited = 0
        self.queued_lines = 0
        self.health_checks = 0
        self.health_checks_relayed = 0  # always-on probes passed to the engine
        self.refused = 0
        self.unauthorized = 0  # 401: no gateway key, or a wrong one
        self.engine_failures = 0
        self.resent = 0  # requests that never reached their engine, sent again after a wait
        self.closing = False  # set by `shutdown`: cut streams say why
        self._answers: set[UpstreamResponse] = set()  # engines' answers being relayed
        self.exchanges: set[Exchange] = set()  # ... and those on the express lane
        # The express lane's split targets: a few deployments and endpoints take nearly all
        # requests, and splitting and decoding one cost as much as the rest of its routing.
        self._targets: dict[bytes, tuple[str, bytes, str]] = {}
        # Called with (deployment id, seconds from arrival to the engine's answer head).
        self.on_first_byte: Callable[[str, float], None] | None = None
        # Every inference request's row, both lanes (`gateway.trace`); None: not traced.
        self.trace: TrafficTrace | None = None

    # --- serving -------------------------------------------------------------------------

    async def serve(
        self, host: str = "127.0.0.1", port: int = 8401, config: ServerConfig | None = None
    ) -> HTTPServer:
        """Start an HTTP server for the gateway; returns it (see `HTTPServer.port`)."""
        server_config = config or ServerConfig(max_body_bytes=self.config.max_body_bytes)
        server = HTTPServer(self.handle, server_config, render_error=self.render_error)
        server.request_id_header = REQUEST_ID_HEADER
        server.request_ids = itertools.count(int(time.time()) * 1_000_000)
        if self.config.express and server_config.fast_path:
            server.express = self.express
        await server.start(host, port)
        self.server = server
        return server

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting; answers in flight may finish within `timeout_s` (the grace), then
        the engines' answers still running are cut, so that each stream ends with an error
        event and a proper terminator instead of a dropped connection; then the pool."""
        self.closing = True
        if self.server is not None:
            cut = asyncio.get_running_loop().call_later(timeout_s, self._cut_answers)
            try:
                await self.server.shutdown(timeout_s + CUT_SLACK_S)
            finally:
                cut.cancel()
        await self.upstream.close()

    def _cut_answers(self) -> None:
        for answer in list(self._answers):
            answer.abort()
        for exchange in list(self.exchanges):
            exchange.cut()

    def render_error(self, status: int, message: str) -> tuple[Headers, bytes]:
        """Errors produced by the HTTP server itself, in the gateway's OpenAI style."""
        if status == 413:
            reply = queued.too_large(self.config.max_body_bytes)
        else:
            reply = ErrorReply(status, _STATUS_CODES.get(status, "http_error"), message)
        return reply.headers(), reply.body()

    def statistics(self) -> dict[str, object]:
        """Counters of the gateway, its server and its engine pools."""
        return {
            "relayed": self.relayed,
            "relayed_express": self.relayed_express,
            "waited": self.waited,
            "queued_lines": self.queued_lines,
            "health_checks": self.health_checks,
            "health_checks_relayed": self.health_checks_relayed,
            "refused": self.refused,
            "unauthorized": self.unauthorized,
            "engine_failures": self.engine_failures,
            "resent": self.resent,
            "server": self.server.statistics() if self.server else None,
            "engines": self.upstream.statistics(),
        }

    # --- routing -------------------------------------------------------------------------

    def express(self, conn: Connection, head: RequestHead, request_id: int) -> Exchange | None:
        """The express lane's routing (`gateway.express`): an exchange for an inference
        request to a deployment that exists and is not a probe; None leaves it to `handle`.
        A head alike to the connection's last but for its length (its memo, `known`, took it)
        is routed as that one was."""
        memo = conn.session.known
        forwarding: Forwarding | None = None if memo is None else memo.derived
        if forwarding is None:
            forwarding = self._forwarding(head)
            if forwarding is None:
                return None
            if memo is not None:
                memo.derived = forwarding
        access = self.access
        # A head alike to one that passed under the same keys carries the same Authorization.
        if access is not None and forwarding.checked is not access.keys:
            if not access.allows(head.headers, conn.peer):
                return None  # the handler answers 401
            forwarding.checked = access.keys
        view = self.controller.view(forwarding.deployment_id)
        if view is None:
            return None
        return Exchange(self, conn, head, request_id, view, forwarding)

    def _forwarding(self, head: RequestHead) -> Forwarding | None:
        """The route of an inference request that is not a probe, for the express lane."""
        target = head.target
        parts = self._targets.get(target)
        if parts is None:
            parts = _split_target(target)
            if parts is None:
                return None
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            self._targets[target] = parts
        deployment_id, upstream_target, path = parts
        route = classify_route(head.method, path, head.headers)
        if route.kind is not RouteKind.INFERENCE or route.health_check:
            return None
        drop = not_forwarded(head.headers, NOT_FORWARDED)
        return Forwarding(deployment_id, upstream_target, route.endpoint, drop)

    async def handle(self, request: Request, responder: Responder) -> None:
        """Answer one request (the `HTTPServer` handler)."""
        access = self.access
        if access is not None and not access.allows(request.headers, request.client):
            self.unauthorized += 1
            status, headers, body = access.refusal(request.headers)
            await responder.respond(status, headers, body)
            return
        target = request.target
        parts = _split_target(target)
        if parts is None:
            await _reply(responder, queued.route_not_found(_text(request.method), _text(target)))
            return
        deployment_id, upstream_target, path = parts
        view = self.controller.view(deployment_id)
        if view is None:
            view = self._view_named(deployment_id)
        if view is None:
            await _reply(responder, queued.deployment_not_found(deployment_id))
            return
        route = classify_route(request.method, path, request.headers)
        kind = route.kind
        if kind is RouteKind.INFERENCE:
            await self._inference(request, responder, view, route, upstream_target)
        elif kind is RouteKind.MODELS_LIST:
            await self._models_list(responder, view)
        elif kind is RouteKind.MODEL_GET:
            await self._model_get(request, responder, view, route, upstream_target)
        else:
            await _reply(responder, queued.route_not_found(_text(request.method), path))

    def _view_named(self, segment: str) -> DeploymentView | None:
        """The deployment `/d/<segment>/` names by its name (percent-decoded: a name may hold
        "/").  Only here, after the id missed: the express lane, which requests by id take,
        never looks a name up."""
        if self.named is None:
            return None
        deployment_id = self.named(urllib.parse.unquote(segment))
        return None if deployment_id is None else self.controller.view(deployment_id)

    async def _models_list(self, responder: Responder, view: DeploymentView) -> None:
        body = msgspec.json.encode({"object": "list", "data": [_model_object(view)]})
        await responder.respond(200, list(queued.JSON_HEADERS), body)

    async def _model_get(
        self,
        request: Request,
        responder: Responder,
        view: DeploymentView,
        route: Route,
        target: bytes,
    ) -> None:
        if route.health_check:
            body = msgspec.json.encode(_model_object(view))
            headers = [*queued.JSON_HEADERS, (STATE_HEADER, view.state.encode())]
            await responder.respond(200, headers, body)
            return
        engine = view.engine_handle if view.state == "ready" else None
        if engine is None:
            await _reply(responder, queued.not_ready(view.model_name))
            return
        # Not a lease: looking a model up is not traffic and must not keep it awake.
        await self._relay(_InFlight(request, responder, view, target), engine)

    # --- inference -----------------------------------------------------------------------

    async def _inference(
        self,
        request: Request,
        responder: Responder,
        view: DeploymentView,
        route: Route,
        target: bytes,
    ) -> None:
        arrived = time.monotonic()
        body = await request.read_body()
        if route.health_check:
            if view.mode == "always_on" and view.state != "failed":
                await self._health_from_engine(request, responder, view, body, target)
                return
            await self._health(responder, view, route, body)
            return
        ex = _InFlight(request, responder, view, target, body, route.endpoint, arrived)
        try:
            await self._lease_then_relay(ex)
        except BodyTooDeep as exc:  # found decoding the body, before anything was sent
            ex.outcome = REFUSED
            await _reply(responder, queued.bad_body(str(exc)))
        except ClientDisconnected:
            ex.outcome = CLIENT_GONE
            raise
        finally:
            if self.trace is not None:
                self.trace.record(
                    view.deployment_id, request.request_id, arrived, ex.admitted or arrived,
                    ex.first, time.monotonic(), ex.outcome, ex.streamed,
                )  # fmt: skip

    async def _lease_then_relay(self, ex: _InFlight) -> None:
        """Relay at once to a ready model, else (or when it never reached the engine) wait.
        A request naming a model the deployment does not serve gets 404 in every state, and
        starts nothing; one naming the deployment's own name goes to the engine naming the
        model it serves (the express lane leaves every other name to this check)."""
        view = ex.view
        named = body_model(ex.endpoint, ex.body)
        if named is not None and named != view.served_model:
            if named != view.model_name:
                ex.outcome = REFUSED
                await _reply(ex.responder, queued.model_not_found(named, view.served_model))
                return
            ex.body = with_model(ex.body, view.served_model)
        lease = self.controller.try_acquire(view.deployment_id)
        if lease is not None:
            ex.admitted = ex.arrived
            try:
                sent = await self._relay(ex, lease.handle, resend=True)
            finally:
                lease.release()
            if sent:
                self.relayed += 1
                return
            # It never reached the engine, which is being checked (and restarted if lost):
            # the request waits for it like one for a stopped model, from its arrival.
            await self._wait_then_relay(ex, missed=True)
            return
        await self._wait_then_relay(ex)

    async def _health(
        self, responder: Responder, view: DeploymentView, route: Route, body: bytes
    ) -> None:
        self.health_checks += 1
        state = (STATE_HEADER, view.state.encode())
        if view.state == "failed":
            reply = ErrorReply(
                503, "deployment_failed", f"{view.model_name} failed; start it again from its page"
            )
            await responder.respond(reply.status, [*reply.headers(), state], reply.body())
            return
        endpoint = route.endpoint or Endpoint.CHAT
        now = int(self.clock())
        if body_traits(endpoint, body).stream and health.is_streamable(endpoint):
            answer = health.empty_stream(endpoint, view.served_model, now)
            await responder.respond(200, [*queued.SSE_HEADERS, state], answer)
        else:
            answer = health.empty_answer(endpoint, view.served_model, now)
            await responder.respond(200, [*queued.JSON_HEADERS, state], answer)

    async def _health_from_engine(
        self,
        request: Request,
        responder: Responder,
        view: DeploymentView,
        body: bytes,
        target: bytes,
    ) -> None:
        """An always-on model's probe goes to its engine, so LiteLLM's /health tests the engine.

        Without a lease: a probe is not traffic.  Not ready (stopped, starting, stopping): 503,
        a status that puts no LiteLLM entry into a cooldown.
        """
        self.health_checks += 1
        engine = view.engine_handle if view.state == "ready" else None
        if engine is None:
            reply = ErrorReply(
                503,
                "engine_not_ready",
                f"{view.model_name} is {view.state}: its engine is not serving",
            )
            state = (STATE_HEADER, view.state.encode())
            await responder.respond(reply.status, [*reply.headers(), state], reply.body())
            return
        self.health_checks_relayed += 1
        await self._relay(_InFlight(request, responder, view, target, body), engine)

    async def _wait_then_relay(self, ex: _InFlight, *, missed: bool = False) -> None:
        """Wait for the model, then relay.  `missed`: the request was sent to its engine
        and never reached it; it waits from its arrival, for the queue's deadline."""
        arrived = ex.arrived
        endpoint = ex.endpoint
        responder = ex.responder
        traits = body_traits(endpoint, ex.body)
        line_in_stream = (
            traits.stream
            and not traits.structured
            and endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)
        )
        line_in_answer = not traits.stream and not traits.structured and queued.may_prefix(endpoint)
        rid = str(ex.request.request_id)
        for attempt in range(1 if missed else 0, MAX_SENDS):  # `attempt` sends went before
            waited_s = time.monotonic() - arrived if attempt and arrived else 0.0
            try:
                waiter = self.controller.enqueue(ex.view.deployment_id, rid, waited_s=waited_s)
            except Refused as refused:
                self.refused += 1
                ex.outcome = QUEUE_FULL if refused.code == "ondemand_queue_full" else REFUSED
                reply = _from_refused(refused)
                if ex.chunk_sent:
                    await responder.send(reply.sse())
                    await responder.end()
                else:
                    await _reply(responder, reply)
                return
            self.waited += 1
            sent = await self._wait_once(
                ex, waiter,
                line_in_stream=line_in_stream and not ex.chunk_sent,
                line_in_answer=line_in_answer,
                resend=attempt + 1 < MAX_SENDS,
            )  # fmt: skip
            if sent:
                return

    async def _wait_once(
        self,
        ex: _InFlight,
        waiter: Waiter,
        *,
        line_in_stream: bool,
        line_in_answer: bool,
        resend: bool,
    ) -> bool:
        """Wait with `waiter`, then relay: whether it was answered; not when the request
        never reached the engine and may be sent again."""
        view, responder = ex.view, ex.responder

        async def send_queued_chunk() -> None:
            assert ex.endpoint is not None
            chunk = queued.queued_chunk(
                ex.endpoint, view.model_name, view.served_model, str(ex.request.request_id),
                int(self.clock()),
            )  # fmt: skip
            await responder.start(200, list(queued.SSE_HEADERS))
            ex.chunk_sent = True
            self.queued_lines += 1
            await responder.send(chunk)

        try:
            lease = await self._wait(waiter, send_queued_chunk if line_in_stream else None)
        except (Refused, _WaitDeadline) as exc:
            self.refused += 1
            timed_out = isinstance(exc, _WaitDeadline) or exc.code == "ondemand_queue_timeout"
            ex.outcome = QUEUE_TIMEOUT if timed_out else REFUSED
            reply = (
                _from_refused(exc)
                if isinstance(exc, Refused)
                else queued.queue_timeout(view.model_name)
            )
            if ex.chunk_sent:
                await responder.send(reply.sse())
                await responder.end()
            else:
                await _reply(responder, reply)
            return True
        ex.admitted = time.monotonic()
        try:
            if ex.chunk_sent:
                mode = _Mode.CONTINUE_SSE
            elif line_in_answer and waiter.queued.is_set():
                mode = _Mode.REWRITE
            else:
                mode = _Mode.PASS
            return await self._relay(
                ex, lease.handle, mode, on_head=waiter.first_byte, resend=resend
            )
        finally:
            lease.release()

    async def _wait(self, waiter: Waiter, on_queued: Callable[[], Awaitable[None]] | None) -> Lease:
        """The lease once the model serves; cancels the waiter if we stop waiting first."""
        loop = asyncio.get_running_loop()
        wait_task = loop.create_task(waiter.wait())
        queued_task: asyncio.Task[bool] | None = None
        deadline = asyncio.timeout(self.config.wait_deadline_s)
        try:
            async with deadline:
                if on_queued is not None:
                    if not waiter.queued.is_set():
                        queued_task = loop.create_task(waiter.queued.wait())
                        await asyncio.wait(
                            (wait_task, queued_task), return_when=asyncio.FIRST_COMPLETED
                        )
                    if waiter.queued.is_set():
                        await on_queued()
                return await wait_task
        except BaseException as exc:
            if not wait_task.done():
                wait_task.cancel()
                waiter.cancel()
            elif wait_task.cancelled():
                waiter.cancel()
            elif wait_task.exception() is None:
                wait_task.result().release()
            if deadline.expired():
                raise _WaitDeadline() from exc
            raise
        finally:
            if queued_task is not None:
                queued_task.cancel()

    # --- relaying ------------------------------------------------------------------------

    async def _relay(
        self,
        ex: _InFlight,
        engine: EngineHandle,
        mode: _Mode = _Mode.PASS,
        *,
        on_head: Callable[[], None] | None = None,
        resend: bool = False,
    ) -> bool:
        """Relay the request to `engine` and its answer to the client; False (nothing said
        to the client) when `resend` allows it and the request provably never reached the
        engine (`UpstreamError.unsent`, or the engine had exited before it was sent): the
        engine is being checked, and the caller has the request wait for it
        (`_wait_then_relay`)."""
        request, responder, view = ex.request, ex.responder, ex.view
        headers = request.headers
        sent_at = self.clock()  # before connecting: an engine gone before it never saw it
        try:
            # Method, target and headers came out of an HTTP parser: no need to validate again.
            answer = await self.upstream.request(
                engine.host, engine.port, request.method, ex.target, headers, ex.body,
                drop=not_forwarded(headers, NOT_FORWARDED), checked=True,
            )  # fmt: skip
        except UpstreamError as exc:
            if resend and not self.closing and await self.never_reached(exc, engine, sent_at):
                self.engine_missed(view, exc)
                return False
            reply = self.engine_unreachable(view, exc)
            ex.outcome = ENGINE_ERROR
            if mode is _Mode.CONTINUE_SSE:
                await responder.send(reply.sse())
                await responder.end()
            else:
                await _reply(responder, reply)
            return True
        self._answers.add(answer)
        ex.first = time.monotonic()
        ex.streamed = mode is _Mode.CONTINUE_SSE or (
            header_value(answer.headers, b"content-length") is None
        )
        ex.outcome = ENGINE_ERROR  # until the answer is through
        if ex.arrived and self.on_first_byte is not None:
            self.on_first_byte(view.deployment_id, ex.first - ex.arrived)
        if on_head is not None:
            on_head()
        try:
            if mode is _Mode.PASS:
                await self._pass(answer, responder, view, ex.endpoint)
            elif mode is _Mode.CONTINUE_SSE:
                await self._continue_sse(answer, responder, view)
            else:
                assert ex.endpoint is not None
                await self._rewrite(answer, responder, view, ex.endpoint)
            ex.outcome = SERVED
        finally:
            self._answers.discard(answer)
            answer.close()
        return True

    async def _pass(
        self,
        answer: UpstreamResponse,
        responder: Responder,
        view: DeploymentView,
        endpoint: Endpoint | None = None,
    ) -> None:
        headers = strip_hop_by_hop(answer.headers)
        await responder.start(answer.status, headers, reason=answer.reason, checked=True)
        streamed = header_value(headers, b"content-length") is None
        if streamed:
            await responder.flush()  # a stream: the client gets the head before the first token
        chunk = b""  # on an error: the last piece sent
        try:
            while True:
                chunk = await answer.receive()
                if answer.complete:
                    break
                await responder.send(chunk)
        except UpstreamError as exc:
            self.engine_failed(view, exc)
            await self._end_cut_stream(responder, headers, chunk, view, endpoint)
            return
        await responder.end(chunk)  # the last piece and the end in one write

    async def _end_cut_stream(
        self,
        responder: Responder,
        headers: Headers,
        last: bytes,
        view: DeploymentView,
        endpoint: Endpoint | None,
    ) -> None:
        """The engine failed mid-answer: never a silent clean end (see `cut_stream_event`);
        any answer but an event stream is left incomplete (the server closes the
        connection), which the client sees as an error."""
        event = self.cut_stream_event(headers, last, view, endpoint)
        if event is not None:
            await responder.send(event)
            await responder.end()

    def cut_stream_event(
        self, headers: Headers, last: bytes, view: DeploymentView, endpoint: Endpoint | None
    ) -> bytes | None:
        """The end of an event stream whose engine failed after `last`: a final error event
        in the stream's own format (and `[DONE]` where it has one), to be followed by the
        chunked terminator; None when the answer (`headers`) is not an event stream."""
        content_type = header_value(headers, b"content-type") or b""
        if header_value(headers, b"content-length") is not None:
            return None
        if not content_type.lower().startswith(b"text/event-stream"):
            return None
        event = queued.stream_error(endpoint, *self._cut_reason(view))
        if last and not last.endswith((b"\n\n", b"\r\n\r\n")):
            event = b"\n\n" + event  # close the engine's last, partial event first
        return event

    async def _continue_sse(
        self, answer: UpstreamResponse, responder: Responder, view: DeploymentView
    ) -> None:
        if answer.status != 200:
            try:
                error = await answer.read_all(self.config.max_engine_error_bytes)
            except UpstreamError:
                error = None
            await responder.send(_engine_error_event(answer.status, error, view.model_name))
            await responder.end()
            return
        # Only whole events go out, so that a crash cannot leave half an event before ours.
        tail = b""
        try:
            while chunk := await answer.receive():
                data = tail + chunk
                cut = _events_end(data)
                if not cut and len(data) < self.config.max_engine_error_bytes:
                    tail = data
                    continue
                cut = cut or len(data)
                tail = data[cut:]
                await responder.send(data[:cut])
        except UpstreamError as exc:
            self.engine_failed(view, exc)
            await responder.send(queued.sse_error(*self._cut_reason(view)))
            await responder.end()
            return
        if tail:
            await responder.send(tail)
        await responder.end()

    async def _rewrite(
        self,
        answer: UpstreamResponse,
        responder: Responder,
        view: DeploymentView,
        endpoint: Endpoint,
    ) -> None:
        if answer.status != 200:
            await self._pass(answer, responder, view)
            return
        headers = strip_hop_by_hop(answer.headers)
        chunks: list[bytes] = []
        size = 0
        try:
            while size <= self.config.max_rewrite_bytes and (chunk := await answer.receive()):
                chunks.append(chunk)
                size += len(chunk)
        except UpstreamError as exc:
            self.engine_failed(view, exc)
            await _reply(
                responder,
                queued.engine_error(
                    502, "engine_failed", f"the engine of {view.model_name} failed while answering"
                ),
            )
            return
        body = b"".join(chunks)
        if answer.complete:
            rewritten = queued.prefix_answer(endpoint, body, view.model_name)
            if rewritten is not None:
                self.queued_lines += 1
                body = rewritten
            # `respond` sets the (corrected) Content-Length; every other header is the engine's.
            headers = [(n, v) for n, v in headers if n != b"content-length"]
            await responder.respond(200, headers, body)
            return
        # Too large to rewrite: pass it on unchanged.
        await responder.start(answer.status, headers, reason=answer.reason)
        await responder.send(body)
        try:
            while chunk := await answer.receive():
                await responder.send(chunk)
        except UpstreamError as exc:
            self.engine_failed(view, exc)
            return
        await responder.end()

    def _cut_reason(self, view: DeploymentView) -> tuple[str, str]:
        """Code and message of the error event that ends a stream cut short."""
        if self.closing:
            return "dgxmm_shutting_down", "DGXMM is shutting down; the answer was cut short"
        lost = self._lost(view)
        if lost is not None:
            return lost.code, lost.message
        return "engine_failed", f"the engine of {view.model_name} failed while answering"

    def _lost(self, view: DeploymentView) -> ErrorReply | None:
        """The answer for a request its engine failed when DGXMM has found the engine lost
        (it died or hung) and restarts it: 503 `engine_lost` naming the cause and the
        restart, so that the client retries instead of acting; None when nothing is known."""
        now = self.controller.view(view.deployment_id)
        if now is None or now.lost is None:
            return None
        name = view.model_name
        then = (
            "DGXMM is restarting it; try again"
            if now.mode == "always_on"
            else "the next request starts it again"
        )
        return queued.engine_error(
            503, "engine_lost", f"the engine of {name} was lost ({now.lost}); {then}"
        )

    def engine_unreachable(self, view: DeploymentView, exc: UpstreamError) -> ErrorReply:
        """The engine did not answer: counted, logged, the controller told; the 502, or the
        503 naming the loss when DGXMM already found the engine lost (`_lost`)."""
        self.engine_failures += 1
        log.warning("engine_request_failed", deployment=view.deployment_id, error=exc.detail)
        self.controller.engine_unreachable(view.deployment_id)
        lost = self._lost(view)
        if lost is not None:
            return lost
        return queued.engine_error(
            502, "engine_unreachable", f"the engine of {view.model_name} did not answer"
        )

    async def never_reached(
        self, exc: UpstreamError, engine: EngineHandle | None, sent_at: float
    ) -> bool:
        """Whether the failed request provably never reached the engine: it failed before
        the moment (`UpstreamError.unsent`), or it was closed before any answer byte and the
        engine's process had exited before the request was sent (through Docker's port
        proxy a dead container's connection is accepted, then closed)."""
        if exc.unsent:
            return True
        if engine is None or not (isinstance(exc, UpstreamClosed) and exc.before_response):
            return False
        return await self.controller.exited_before(engine, sent_at)

    def engine_missed(self, view: DeploymentView, exc: UpstreamError) -> None:
        """The request never reached the engine (refused, or closed before it went out):
        counted, logged, the controller told, which checks the engine and has requests wait
        for it meanwhile; the request is sent again once it serves."""
        self.engine_failures += 1
        self.resent += 1
        log.warning("engine_request_unsent", deployment=view.deployment_id, error=exc.detail)
        self.controller.engine_unreachable(view.deployment_id)

    def engine_failed(self, view: DeploymentView, exc: UpstreamError) -> None:
        """The engine failed while answering: counted, logged, the controller told."""
        self.engine_failures += 1
        log.warning("engine_failed_mid_answer", deployment=view.deployment_id, error=exc.detail)
        if not self.closing:
            self.controller.engine_unreachable(view.deployment_id)


async def _reply(responder: Responder, reply: ErrorReply) -> None:
    await responder.respond(reply.status, reply.headers(), reply.body())


def _from_refused(refused: Refused) -> ErrorReply:
    return ErrorReply(refused.status, refused.code, refused.message, refused.retry_after)


def _model_object(view: DeploymentView) -> dict[str, object]:
    return {
        "id": view.served_model,
        "object": "model",
        "created": int(view.created_at),
        "owned_by": "dgxmm",
    }


def _engine_error_event(status: int, body: bytes | None, model: str) -> bytes:
    """The engine's own error body as a stream event when it is one, else ours."""
    if body:
        try:
            value = msgspec.json.decode(body)
        except msgspec.MsgspecError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("error"), dict):
            return b"data: " + msgspec.json.encode(value) + b"\n\n" + queued.DONE_EVENT
    return queued.sse_error("engine_error", f"the engine of {model} answered HTTP {status}")


def _events_end(data: bytes) -> int:
    """Where the last complete SSE event in `data` ends (0: none is complete)."""
    end = 0
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        at = data.rfind(sep)
        if at >= 0:
            end = max(end, at + len(sep))
    return end


def _split_target(target: bytes) -> tuple[str, bytes, str] | None:
    """`/d/<deployment id>/<rest>`: the id, the target for the engine (the rest, from its
    slash, query included) and its path; None for any other target."""
    if not target.startswith(b"/d/"):
        return None
    slash = target.find(b"/", 3)
    query = target.find(b"?")
    if slash < 0 or (0 <= query < slash):
        return None
    upstream_target = target[slash:]
    path = upstream_target if query < 0 else target[slash:query]
    return _text(target[3:slash]), upstream_target, _text(path)


def _text(raw: bytes) -> str:
    return raw.decode("latin-1")
