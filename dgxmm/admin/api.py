"""The admin API (JSON) and the web UI's files, served by the shared h11 `HTTPServer`.

Routes live under `/dgxmm/api/...`, with `/api/...` as an alias; the UI's static files under
`/dgxmm/`; Prometheus text at `/metrics`.  Every call but login needs a session cookie or a
Bearer API token; viewers read, admins write; a cookie session's mutating call must carry
its CSRF token in `x-csrf-token`.  Errors are `{"error": {"message", "type", "code"}}`
(plus `param` when one field is at fault).  Mutations go through the controller with the
actor `admin:<user>`, so the event log, and with it the audit trail, records who did what.

`/metrics` needs a viewer (a session, or better a Bearer token in the scraper's
`authorization` setting) unless the API is built with `metrics_public=True`: deployment
names and memory figures are not for anyone who can reach the port.

About 700 lines: the request cycle (route, authorize, read the body, answer) and one thin
handler per route, which share that cycle's helpers.  What stands on its own lives beside
it: `routes` (the table), `bodies` (request bodies), `errors`, `static` (the UI's files),
`accounts` (users and tokens), `ops` (logs, progress, queue, health), `metrics`.
"""

from __future__ import annotations

import collections
import math
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import msgspec
import structlog

from actors.controller import Controller, DeploymentRecord, DeploymentSpec
from actors.deployment import DeploymentActor, Refusal
from actors.errors import ActorCrashed, ActorError, ActorStopped, AskTimeout, MailboxFull
from actors.memory_broker import GIB
from actors.runtime import Clock
from dgxmm.admin import bodies, metrics, static, vendor
from dgxmm.admin.accounts import AccountRoutes
from dgxmm.admin.auth import Auth, AuthError, Principal
from dgxmm.admin.errors import ApiError, error_body, from_refusal
from dgxmm.admin.gateway_key_api import NoKeyRoutes
from dgxmm.admin.guards import MAX_JSON_DEPTH, json_too_deep, memory_problem
from dgxmm.admin.histograms import Latencies
from dgxmm.admin.ops import LOG_TAIL_DEFAULT, LOG_TAIL_MAX, LogTail, OpsApi, Progress, Queue
from dgxmm.admin.routes import (
    SAFE_METHODS,
    Access,
    Route,
    int_query,
    iso,
    match_route,
    parse_time_query,
)
from dgxmm.admin.sse import (
    Deployment,
    EventHub,
    HubConfig,
    MemoryBudget,
    Settings,
    TooManyStreams,
    deployment,
    memory_json,
)
from dgxmm.admin.timeline import TimelineRoutes
from dgxmm.admin.tuning import (
    Applied,
    ApplyBody,
    TuneApplier,
    Tuned,
    TuneFailed,
    TuneRunner,
    measure_since,
)
from dgxmm.config import http_url_problem
from dgxmm.litellm.reload import ReloadStatus
from dgxmm.litellm.sync import HINT
from events import model as m
from gateway.errors import BodyTooLarge
from gateway.protocol import Headers
from gateway.server import HTTPServer, Request, Responder, ServerConfig
from storage.errors import StorageError
from storage.eventlog import EventStore
from storage.readmodels import AuditFilter

log = structlog.get_logger("dgxmm.admin.api")

MAX_BODY_BYTES = 1024 * 1024

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()

_SERVER_CODES = {
    400: "bad_request",
    408: "request_timeout",
    413: "request_too_large",
    501: "not_implemented",
}


def _plain(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.asdict(value)
    return value


def _object(body: Any) -> dict[str, Any]:
    """A body that must be a JSON object (settings, LiteLLM): validated by the controller."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ApiError(422, "invalid_body", "the body must be a JSON object")
    return body


def deployment_spec(body: bodies.DeploymentBody) -> DeploymentSpec:
    """A decoded POST /deployments body as the controller's spec."""
    return DeploymentSpec(
        name=body.name,
        engine=body.engine,
        model=body.model,
        memory_bytes=round(body.memory_gib * GIB),
        mode=body.mode,
        idle_timeout_s=bodies.idle_timeout(body.idle_timeout_s),
        role=body.role,
        args=list(body.args),
        image=body.image,
        gpu=body.gpu,
        make_room_after_s=bodies.make_room_after(body.make_room_after_s),
        ondemand_policy=body.ondemand_policy,
    )


# --- what the handlers answer -----------------------------------------------------------
# Each handler's return annotation names its answer's type; `dgxmm.admin.openapi` derives
# the documented schema from it.  Every field is written, null included, as the dicts were.


class LoginAnswer(msgspec.Struct, kw_only=True):
    """`POST /login`: the session cookie comes in `set-cookie`; send `csrf_token` back as
    `x-csrf-token` on every call that changes something."""

    user: str
    role: str  # admin or viewer
    csrf_token: str
    session_idle_s: float


class SessionAnswer(msgspec.Struct, kw_only=True):
    """`GET /session`: who is calling, and how (`session` or `token`); `csrf_token` only
    for a session."""

    user: str
    role: str
    via: str
    csrf_token: str | msgspec.UnsetType = msgspec.UNSET


class LogoutAnswer(msgspec.Struct, kw_only=True):
    """`POST /logout`."""

    logged_out: bool


class DeploymentList(msgspec.Struct, kw_only=True):
    """`GET /deployments`."""

    deployments: list[Deployment]


class Removed(msgspec.Struct, kw_only=True):
    """`DELETE /deployments/{id}`."""

    id: str
    name: str
    removed: bool


class EventLine(msgspec.Struct, kw_only=True):
    """One line of a deployment's Events tab."""

    seq: int
    ts: float
    time: str
    actor: str
    title: str
    type: str


class DeploymentEvents(msgspec.Struct, kw_only=True):
    """`GET /deployments/{id}/events`: a page, newest first; `next_before` pages on."""

    deployment_id: str
    events: list[EventLine]
    next_before: int | None


class AuditLine(msgspec.Struct, kw_only=True):
    """One line of the audit trail (`deployment`: its name, removed ones too)."""

    seq: int
    ts: float
    time: str
    actor: str
    action: str
    target: str
    deployment_id: str | None
    deployment: str | None
    details: dict[str, Any]


class AuditPage(msgspec.Struct, kw_only=True):
    """`GET /audit`: a page, newest first; `next_before` pages on."""

    rows: list[AuditLine]
    next_before: int | None


class Memory(MemoryBudget, kw_only=True):
    """`GET /memory`: the budget in bytes and GiB; `gpu`: nvidia-smi listed a GPU."""

    gpu: bool


Unset = msgspec.UnsetType


class LiteLLMIntegration(msgspec.Struct, kw_only=True):
    """The LiteLLM integration: its settings (never the key), the last sync, the file
    back-end's load and reloads, and the deploy wizard's default mode.  A field is left out
    when the integration does not give it (none is set up: `enabled`, `ok` and the
    wizard's fields only); `synced` comes with `GET /litellm` only."""

    enabled: bool | Unset = msgspec.UNSET
    url: str | Unset = msgspec.UNSET
    backend: str | Unset = msgspec.UNSET
    config_path: str | Unset = msgspec.UNSET
    master_key_env: str | Unset = msgspec.UNSET
    master_key_set: bool | Unset = msgspec.UNSET
    last_sync_at: float | Unset | None = msgspec.UNSET
    ok: bool | Unset | None = msgspec.UNSET
    error: str | Unset | None = msgspec.UNSET
    entries: int | Unset = msgspec.UNSET
    default_mode: str | Unset = msgspec.UNSET
    hint: str | Unset | None = msgspec.UNSET
    config_writes: int | Unset = msgspec.UNSET
    last_write_at: float | Unset | None = msgspec.UNSET
    loaded: bool | Unset | None = msgspec.UNSET
    loaded_at: float | Unset | None = msgspec.UNSET
    load_error: str | Unset | None = msgspec.UNSET
    reload: ReloadStatus | Unset | None = msgspec.UNSET
    synced: bool | Unset = msgspec.UNSET


# --- the API --------------------------------------------------------------------------------


@dataclass
class _Call:
    request: Request
    responder: Responder
    principal: Principal | None
    params: dict[str, str]
    query: dict[str, str]
    body: Any = None
    headers: Headers = field(default_factory=list)


Reply = tuple[int, Any]


async def _no_sync() -> dict[str, Any]:
    raise Refusal(409, "litellm_disabled", "the LiteLLM integration is not set up")


async def _no_configure(settings: dict[str, Any], actor: str) -> dict[str, Any]:
    raise Refusal(409, "litellm_disabled", "the LiteLLM integration is not set up")


class AdminApi:
    """The admin API handler for `gateway.server.HTTPServer`."""

    def __init__(
        self,
        controller: Controller,
        store: EventStore,
        auth: Auth,
        clock: Clock,
        *,
        litellm_status: Callable[[], Any] | None = None,
        litellm_sync_now: Callable[[], Awaitable[Any]] | None = None,
        litellm_configure: Callable[[dict[str, Any], str], Awaitable[Any]] | None = None,
        web_root: Path | None = None,
        gateway_statistics: Callable[[], Mapping[str, Any]] | None = None,
        metrics_public: bool = False,
        max_body_bytes: int = MAX_BODY_BYTES,
        hub_config: HubConfig | None = None,
        ops: OpsApi | None = None,
        latencies: Latencies | None = None,
        gateway_keys: Any = None,
        vendor_root: Path | None = None,
        gpu: bool = False,
        openapi_document: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.controller = controller
        self.store = store
        self.tuning: Any = None  # the Settings page's tune runner, made on first use
        self.auth = auth
        self.clock = clock
        self._litellm_status = litellm_status or (lambda: {"enabled": False, "ok": False})
        self._litellm_sync_now = litellm_sync_now or _no_sync
        self._litellm_configure = litellm_configure or _no_configure
        self.web_root = web_root.resolve() if web_root is not None else None
        self.vendor_root = vendor_root  # the chart library's files (dgxmm/admin/vendor.py)
        self.gpu = gpu  # nvidia-smi listed a GPU at start (the wizard's default engine)
        # `dgxmm.admin.openapi.document`, passed in: that module reads this one's handlers, so
        # importing it here would make the two import each other.
        self._openapi_document = openapi_document
        self.gateway_statistics = gateway_statistics
        self.metrics_public = metrics_public
        self.ops = ops or OpsApi(controller, store, clock, None, admin_server=lambda: self.server)
        self.latencies = latencies
        self.max_body_bytes = max_body_bytes
        self.hub = EventHub(controller, clock, hub_config)
        self.accounts = AccountRoutes(auth, store)
        self.keys = gateway_keys or NoKeyRoutes()  # the gateway-key routes
        self.timeline = TimelineRoutes(
            store, clock.wall, lambda: int(controller.memory()["usable_bytes"])
        )
        auth.on_session_end.append(self.hub.drop_session)  # a removed user's streams end too
        self.server: HTTPServer | None = None
        self.replies: collections.Counter[int] = collections.Counter()

    # --- serving -------------------------------------------------------------------------

    async def serve(
        self, host: str = "127.0.0.1", port: int = 8400, config: ServerConfig | None = None
    ) -> HTTPServer:
        """Start an `HTTPServer` for the API (errors of the server itself in JSON too)."""
        server_config = config or ServerConfig(max_body_bytes=self.max_body_bytes)
        server = HTTPServer(self.handle, server_config, render_error=self.render_error)
        await server.start(host, port)
        self.server = server
        return server

    async def close(self, timeout_s: float = 5.0) -> None:
        """End the event streams, then stop the server if `serve` started it."""
        self.hub.close()
        self.ops.close()
        if self.server is not None:
            await self.server.shutdown(timeout_s)

    def render_error(self, status: int, message: str) -> tuple[Headers, bytes]:
        """Errors the HTTP server produces itself (malformed request, timeouts, 500)."""
        code = _SERVER_CODES.get(status, "internal_error" if status >= 500 else "http_error")
        return [(b"content-type", b"application/json")], error_body(status, code, message)

    # --- one request ---------------------------------------------------------------------

    async def handle(self, request: Request, responder: Responder) -> None:
        """Answer one request."""
        try:
            await self._route(request, responder)
        except ApiError as exc:
            if responder.started:
                raise
            await self._error(responder, exc)

    async def _route(self, request: Request, responder: Responder) -> None:
        raw_path, _, raw_query = request.target.partition(b"?")
        path = raw_path.decode("latin-1")
        if path.startswith("/dgxmm/api/") or path == "/dgxmm/api":
            rest = path[len("/dgxmm/api") :]
        elif path.startswith("/api/") or path == "/api":
            rest = path[len("/api") :]
        elif path == "/metrics":
            await self._metrics(request, responder)
            return
        elif path == "/healthz":
            await self._healthz(request, responder)
            return
        elif path in ("/", "/dgxmm"):
            await self._send(responder, 308, b"", [(b"location", b"/dgxmm/")])
            return
        elif path.startswith("/dgxmm/" + vendor.PREFIX):
            await self._vendor(request, responder, path[len("/dgxmm/" + vendor.PREFIX) :])
            return
        elif path.startswith("/dgxmm/"):
            await self._static(request, responder, path[len("/dgxmm/") :])
            return
        else:
            raise ApiError(404, "not_found", "not found")
        try:
            parts = [urllib.parse.unquote(p, errors="strict") for p in rest.strip("/").split("/")]
            query = {
                k: v[0]
                for k, v in urllib.parse.parse_qs(
                    raw_query.decode("latin-1"), keep_blank_values=True, errors="strict"
                ).items()
            }
        except (UnicodeDecodeError, ValueError):
            raise ApiError(400, "bad_request", "the path or query is not valid UTF-8") from None
        route, params = match_route(request.method.decode("latin-1").upper(), parts)
        principal = await self._authorize(request, route)
        call = _Call(request, responder, principal, params, query)
        if route.method not in SAFE_METHODS:
            call.body = await self._read_json(request)
        owner, _, name = route.handler.rpartition(".")
        # `owner.name`: a method of self.accounts or self.timeline; else AdminApi._h_<name>.
        handler = getattr(getattr(self, owner), name) if owner else getattr(self, "_h_" + name)
        try:
            reply = await handler(call)
        except Refusal as exc:
            raise from_refusal(exc) from None
        except AuthError as exc:
            raise _from_auth(exc) from None
        except (AskTimeout, MailboxFull) as exc:
            raise ApiError(
                503, "controller_busy", f"the controller is busy: {exc}",
                headers=[(b"retry-after", b"5")],
            ) from None  # fmt: skip
        except ActorStopped as exc:
            raise ApiError(409, "deployment_gone", f"the deployment went away: {exc}") from None
        except ActorCrashed as exc:
            log.error("api_command_crashed", route=route.handler, error=str(exc))
            raise ApiError(500, "internal_error", "the command failed; see the log") from None
        except StorageError as exc:
            log.error("api_storage_failed", route=route.handler, error=str(exc))
            raise ApiError(503, "storage_unavailable", "the event log cannot be written") from None
        if reply is not None:
            status, data = reply
            await self._send_json(responder, status, data, call.headers)

    async def _authorize(self, request: Request, route: Route) -> Principal | None:
        if route.access is Access.PUBLIC:
            return None
        try:
            principal = await self.auth.authenticate(request.headers)
            if request.method.decode("latin-1").upper() not in SAFE_METHODS:
                self.auth.check_csrf(principal, request.headers)
        except AuthError as exc:
            raise _from_auth(exc) from None
        if principal.is_metrics_only:
            raise ApiError(403, "forbidden", "a metrics token reads /metrics and nothing else")
        if route.access is Access.ADMIN and not principal.is_admin:
            raise ApiError(403, "forbidden", f"{principal.user} is a viewer; this needs an admin")
        return principal

    async def _read_json(self, request: Request) -> Any:
        length = request.header(b"content-length")
        too_large = ApiError(
            413, "request_too_large", f"the body is larger than {self.max_body_bytes} bytes",
            headers=[(b"connection", b"close")],
        )  # fmt: skip
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := await request.receive():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_large
                chunks.append(chunk)
        except BodyTooLarge:
            raise too_large from None
        raw = b"".join(chunks)
        if not raw.strip():
            return None
        if json_too_deep(raw):
            raise ApiError(
                400, "invalid_json", f"the body nests deeper than {MAX_JSON_DEPTH} levels"
            )
        try:
            return _decoder.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            raise ApiError(400, "invalid_json", "the body is not valid JSON") from None

    # --- answering -----------------------------------------------------------------------

    async def _send(
        self, responder: Responder, status: int, body: bytes, headers: Headers | None = None
    ) -> None:
        self.replies[status] += 1
        base: Headers = [(b"x-content-type-options", b"nosniff")]
        await responder.respond(status, [*base, *(headers or [])], body)

    async def _send_json(
        self, responder: Responder, status: int, data: Any, headers: Headers | None = None
    ) -> None:
        await self._send(
            responder,
            status,
            _encoder.encode(data),
            [
                (b"content-type", b"application/json"),
                (b"cache-control", b"no-store"),
                *(headers or []),
            ],
        )

    async def _error(self, responder: Responder, exc: ApiError) -> None:
        headers: Headers = [(b"content-type", b"application/json"), *exc.headers]
        if exc.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="dgxmm"'))
        await self._send(
            responder, exc.status, error_body(exc.status, exc.code, exc.message, exc.param), headers
        )

    # --- sessions and tokens -------------------------------------------------------------

    async def _h_login(self, call: _Call) -> tuple[int, LoginAnswer]:
        req = call.request
        origin, host = req.header(b"origin"), req.header(b"host")
        if (
            origin is not None
            and host is not None
            and urllib.parse.urlsplit(origin.decode("latin-1")).netloc.encode() != host
        ):
            raise ApiError(403, "cross_origin", "login from another origin is refused")
        body = bodies.decode(call.body, bodies.LoginBody, bodies.LOGIN_RULES)
        client_ip = req.client[0] if req.client else None
        known = self.auth.known_client(req.headers, body.name)
        session = await self.auth.login(body.name, body.password, client_ip, known=known)
        user = await self.auth.user(session.user)
        assert user is not None  # it just logged in
        call.headers.append((b"set-cookie", self.auth.session_cookie(session)))
        call.headers.append((b"set-cookie", self.auth.known_cookie(user.name)))
        return 200, LoginAnswer(
            user=user.name,
            role=user.role,
            csrf_token=session.csrf,
            session_idle_s=self.auth.config.session_idle_s,
        )

    async def _h_openapi(self, call: _Call) -> tuple[int, dict[str, Any]]:
        if self._openapi_document is None:
            raise ApiError(404, "not_found", "this API was started without its OpenAPI document")
        return 200, self._openapi_document()

    async def _h_logout(self, call: _Call) -> tuple[int, LogoutAnswer]:
        principal = call.principal
        assert principal is not None
        if principal.session is not None:
            self.auth.logout(principal.session)
            self.hub.drop_session(principal.session.token)
            call.headers.append((b"set-cookie", self.auth.clear_cookie()))
        return 200, LogoutAnswer(logged_out=principal.session is not None)

    async def _h_session(self, call: _Call) -> tuple[int, SessionAnswer]:
        p = call.principal
        assert p is not None
        csrf = p.session.csrf if p.session is not None else msgspec.UNSET
        return 200, SessionAnswer(user=p.user, role=p.role, via=p.via, csrf_token=csrf)

    # --- deployments ---------------------------------------------------------------------

    def _actor(self, call: _Call) -> DeploymentActor:
        key = call.params["id"]
        actor = self.controller.find(key)
        if actor is None:
            raise ApiError(404, "not_found", f"no deployment {key}")
        return actor

    def _who(self, call: _Call) -> str:
        assert call.principal is not None
        return call.principal.actor

    def _shown(self, call: _Call, record: DeploymentRecord) -> Deployment:
        """A record as the caller may see it: secrets in args only for admins."""
        p = call.principal
        return deployment(record, reveal=p is not None and p.is_admin)

    def _fits(self, memory_bytes: int | None) -> None:
        mem = self.controller.memory()
        problem = memory_problem(memory_bytes, mem["usable_bytes"], mem["total_bytes"])
        if problem is not None:
            raise ApiError(422, "memory_too_large", problem, param="memory_gib")

    async def _h_list_deployments(self, call: _Call) -> tuple[int, DeploymentList]:
        records = [self._shown(call, r) for r in self.controller.records()]
        return 200, DeploymentList(deployments=records)

    async def _h_create_deployment(self, call: _Call) -> tuple[int, Deployment]:
        spec = deployment_spec(bodies.decode(call.body, bodies.DeploymentBody))
        self._fits(spec.memory_bytes)
        record = await self.controller.create(spec, self._who(call))
        return 201, deployment(record)

    async def _h_get_deployment(self, call: _Call) -> tuple[int, Deployment]:
        return 200, self._shown(call, self.controller.record(self._actor(call)))

    async def _h_remove_deployment(self, call: _Call) -> tuple[int, Removed]:
        actor = self._actor(call)
        await self.controller.remove(actor.deployment_id, self._who(call))
        return 200, Removed(id=actor.deployment_id, name=actor.state.name, removed=True)

    async def _h_start_deployment(self, call: _Call) -> tuple[int, Deployment]:
        actor = self._actor(call)
        return 200, deployment(await self.controller.start(actor.deployment_id, self._who(call)))

    async def _h_stop_deployment(self, call: _Call) -> tuple[int, Deployment]:
        actor = self._actor(call)
        return 200, deployment(await self.controller.stop(actor.deployment_id, self._who(call)))

    async def _h_switch_model(self, call: _Call) -> tuple[int, Deployment]:
        actor = self._actor(call)
        body = bodies.decode(call.body, bodies.SwitchModelBody)
        memory = None if body.memory_gib is None else round(body.memory_gib * GIB)
        self._fits(memory)
        record = await self.controller.reconfigure(
            actor.deployment_id, self._who(call), model=body.model, memory_bytes=memory
        )
        return 200, deployment(record)

    async def _h_change_mode(self, call: _Call) -> tuple[int, Deployment]:
        actor = self._actor(call)
        body = bodies.decode(call.body, bodies.ModeBody)
        keep = body.idle_timeout_s is msgspec.UNSET
        idle = None if keep else bodies.idle_timeout(cast(float | None, body.idle_timeout_s))
        room: int | msgspec.UnsetType | None = msgspec.UNSET  # left out: kept
        if not isinstance(body.make_room_after_s, msgspec.UnsetType):
            room = bodies.make_room_after(body.make_room_after_s)
        record = await self.controller.change_mode(
            actor.deployment_id,
            body.mode,
            idle,
            keep,
            self._who(call),
            make_room_after_s=room,
            ondemand_policy=body.ondemand_policy,  # left out (UNSET): kept
        )
        return 200, deployment(record)

    def _names(self) -> dict[str, str]:
        system = self.controller.system
        names = {d: s.name for d, s in system.removed.items()}
        names.update({d: s.name for d, s in system.deployments.items()})
        names.update({d: a.state.name for d, a in self.controller.actors.items()})
        return names

    def _deployment_id(self, key: str) -> str:
        """A live or removed deployment's id, by id or name."""
        actor = self.controller.find(key)
        if actor is not None:
            return actor.deployment_id
        removed = self.controller.system.removed
        if key in removed:
            return key
        found = next((d for d, s in removed.items() if s.name == key), None)
        if found is None:
            raise ApiError(404, "not_found", f"no deployment {key}")
        return found

    async def _h_deployment_events(self, call: _Call) -> tuple[int, DeploymentEvents]:
        dep_id = self._deployment_id(call.params["id"])
        limit = int_query(call.query, "limit", 200, 1, 5000)
        before = int_query(call.query, "before", None, 1, 2**62)
        # The Events tab's read model: an indexed page, never a scan of the log.  The API
        # shows the models put to sleep to make room for this one on its tab too.
        rows = await self.store.timeline_page(
            dep_id, before=before, limit=limit + 1, made_room=True
        )
        page = rows[:limit]
        return 200, DeploymentEvents(
            deployment_id=dep_id,
            events=[
                EventLine(
                    seq=r.seq, ts=r.ts, time=iso(r.ts), actor=r.actor, title=r.title, type=r.type
                )
                for r in page
            ],
            next_before=page[-1].seq if len(rows) > limit else None,
        )

    # --- audit, memory, settings ---------------------------------------------------------

    async def _h_audit(self, call: _Call) -> tuple[int, AuditPage]:
        q = call.query
        limit = int_query(q, "limit", 100, 1, 1000)
        before = int_query(q, "before", None, 1, 2**62)
        since = parse_time_query(q["since"], "since") if q.get("since") else None
        until = parse_time_query(q["until"], "until") if q.get("until") else None
        target = None
        if q.get("deployment"):
            target = m.deployment_stream(self._deployment_id(q["deployment"]))
        # The audit trail's read model: an indexed page, never a scan of the log.
        where = AuditFilter(
            since_ts=since,
            until_ts=until,
            actor=q.get("actor") or None,
            action=q.get("action") or None,
            target=target,
        )
        found = await self.store.audit_page(before=before, limit=limit + 1, where=where)
        page = found[:limit]
        names = self._names()
        rows = []
        for row in page:
            dep_id = row.target.partition(":")[2] if row.target.startswith("deployment:") else None
            rows.append(
                AuditLine(
                    seq=row.seq,
                    ts=row.ts,
                    time=iso(row.ts),
                    actor=row.actor,
                    action=row.action,
                    target=row.target,
                    deployment_id=dep_id,
                    deployment=names.get(dep_id) if dep_id else None,
                    details=row.details,
                )
            )
        next_before = page[-1].seq if len(found) > limit else None
        return 200, AuditPage(rows=rows, next_before=next_before)

    async def _h_memory(self, call: _Call) -> tuple[int, Memory]:
        return 200, msgspec.convert(
            {**memory_json(self.controller.memory()), "gpu": self.gpu}, Memory
        )

    async def _h_get_settings(self, call: _Call) -> tuple[int, Settings]:
        return 200, msgspec.convert(self.controller.settings(), Settings)

    async def _h_change_settings(self, call: _Call) -> tuple[int, Settings]:
        changed = await self.controller.change_settings(_object(call.body), self._who(call))
        return 200, msgspec.convert(changed, Settings)

    async def _h_tune(self, call: _Call) -> tuple[int, Tuned]:
        """`dgxmm tune` on the last 24 h (`dgxmm.admin.tuning`); it recommends only."""
        body = _object(call.body)
        goal = body.get("goal", "p90<=30,cold_starts")
        if not isinstance(goal, str) or not 0 < len(goal) <= 100:
            raise ApiError(422, "invalid_goal", "goal: text such as p90<=30,cold_starts")
        if self.tuning is None:
            self.tuning = TuneRunner(self.store.path)
        try:
            return 200, await self.tuning.result(goal, fresh=bool(body.get("fresh")))
        except TuneFailed as exc:
            raise ApiError(409, "tune_unavailable", str(exc)) from None

    async def _h_tune_apply(self, call: _Call) -> tuple[int, Applied]:
        """Apply a recommendation: the settings changed, one audited `TuneApplied`."""
        body = bodies.decode(call.body, ApplyBody)
        await TuneApplier(self.controller, self.store).apply(body, self._who(call))
        return 200, await self._applied()

    async def _h_tune_undo(self, call: _Call) -> tuple[int, Applied]:
        """Undo the last application in one step: one audited `TuneUndone`."""
        await TuneApplier(self.controller, self.store).undo(self._who(call))
        return 200, await self._applied()

    async def _h_tune_applied(self, call: _Call) -> tuple[int, Applied]:
        """The last application, its prediction beside what happened since."""
        return 200, await self._applied()

    async def _applied(self) -> Applied:
        applied = await TuneApplier(self.controller, self.store).applied()
        if applied is not None and applied.undone_at is None:
            try:
                applied.since = await measure_since(self.store.path, applied.at)
            except TuneFailed as exc:
                applied.since_error = str(exc)
        return Applied(applied=applied)

    # --- LiteLLM -------------------------------------------------------------------------

    async def _h_litellm_status(self, call: _Call) -> tuple[int, LiteLLMIntegration]:
        raw = self._litellm_status()
        status = _plain(raw)
        data: dict[str, Any] = dict(status) if isinstance(status, Mapping) else {}
        synced = getattr(raw, "synced", None)  # e.g. a SyncStatus struct's property
        if synced is None:
            synced = data.get("synced")
        if synced is None:
            synced = bool(data.get("enabled")) and bool(data.get("ok"))
        data["synced"] = bool(synced)
        data["default_mode"] = "on_demand" if synced else "always_on"
        data["hint"] = None if synced else HINT
        return 200, msgspec.convert(data, LiteLLMIntegration)

    async def _litellm_call(self, work: Awaitable[Any]) -> tuple[int, LiteLLMIntegration]:
        try:
            result = await work
        except ValueError as exc:
            raise ApiError(422, "invalid_litellm_settings", str(exc)) from None
        except ActorError as exc:
            if isinstance(exc, Refusal):
                raise
            raise ApiError(502, "litellm_sync_failed", str(exc)) from None
        return 200, msgspec.convert(
            _plain(result) if result is not None else {}, LiteLLMIntegration
        )

    async def _h_litellm_sync(self, call: _Call) -> tuple[int, LiteLLMIntegration]:
        return await self._litellm_call(self._litellm_sync_now())

    async def _h_litellm_configure(self, call: _Call) -> tuple[int, LiteLLMIntegration]:
        body = _object(call.body)
        problem = http_url_problem(body["url"]) if "url" in body else None
        if problem is not None:
            raise ApiError(422, "invalid_litellm_settings", f"url: {problem}", param="url")
        return await self._litellm_call(self._litellm_configure(body, self._who(call)))

    # --- the UI's event stream and metrics -----------------------------------------------

    async def _h_event_stream(self, call: _Call) -> None:
        p = call.principal
        assert p is not None
        try:
            self.replies[200] += 1
            await self.hub.stream(
                call.request, call.responder, p.session.token if p.session else None,
                reveal=p.is_admin,
            )  # fmt: skip
        except TooManyStreams:
            self.replies[200] -= 1
            raise ApiError(
                503, "too_many_streams", "too many event streams are open",
                headers=[(b"retry-after", b"10")],
            ) from None  # fmt: skip

    def statistics(self) -> dict[str, Any]:
        """Counters of the API: replies by status, streams, sessions, logins."""
        return {
            "replies": dict(self.replies),
            "streams_open": self.hub.client_count,
            "stream": dict(self.hub.stats),
            "sessions": self.auth.session_count(),
            "auth": dict(self.auth.stats),
        }

    def _api_families(self) -> list[metrics.Family]:
        replies = metrics.Family("dgxmm_api_replies_total", "counter", "Admin API replies.")
        for status, n in sorted(self.replies.items()):
            replies.add(n, status=str(status))
        streams = metrics.Family("dgxmm_api_event_streams", "gauge", "Open UI event streams.")
        streams.add(self.hub.client_count)
        dropped = metrics.Family(
            "dgxmm_api_event_streams_dropped_total", "counter", "Slow event-stream clients dropped."
        )
        dropped.add(self.hub.stats["dropped_clients"])
        sessions = metrics.Family("dgxmm_api_sessions", "gauge", "Open login sessions.")
        sessions.add(self.auth.session_count())
        failures = metrics.Family(
            "dgxmm_api_login_failures_total", "counter", "Failed logins since start."
        )
        failures.add(self.auth.stats["login_failures"])
        return [replies, streams, dropped, sessions, failures]

    def _litellm_families(self) -> list[metrics.Family]:
        status = _plain(self._litellm_status())
        return metrics.litellm_families(status) if isinstance(status, Mapping) else []

    async def _metrics(self, request: Request, responder: Responder) -> None:
        if request.method not in (b"GET", b"HEAD"):
            raise ApiError(405, "method_not_allowed", "GET only", headers=[(b"allow", b"GET")])
        if not (self.metrics_public and _loopback(request.client)):
            try:
                await self.auth.authenticate(request.headers)
            except AuthError as exc:
                raise _from_auth(exc) from None
        text = metrics.exposition(
            self.controller,
            gateway_statistics=self.gateway_statistics,
            extra=[*self._api_families(), *self._litellm_families()],
        )
        if self.latencies is not None:
            names = self._names()
            text += self.latencies.render(lambda dep_id: names.get(dep_id, dep_id))
        await self._send(
            responder,
            200,
            text.encode(),
            [(b"content-type", metrics.CONTENT_TYPE), (b"cache-control", b"no-store")],
        )

    # --- operators' routes (dgxmm/admin/ops.py) ----------------------------------------

    async def _h_deployment_logs(self, call: _Call) -> tuple[int, LogTail] | None:
        actor = self._actor(call)
        tail = int_query(call.query, "tail", LOG_TAIL_DEFAULT, 0, LOG_TAIL_MAX)
        if call.query.get("follow") in ("1", "true", "yes"):
            self.replies[200] += 1
            await self.ops.log_follow(actor, tail, call.request, call.responder)
            return None
        return 200, await self.ops.log_tail(actor, tail)

    async def _h_deployment_progress(self, call: _Call) -> tuple[int, Progress]:
        return 200, await self.ops.progress(self._actor(call))

    async def _h_queue(self, call: _Call) -> tuple[int, Queue]:
        return 200, self.ops.queue()

    async def _healthz(self, request: Request, responder: Responder) -> None:
        if request.method not in (b"GET", b"HEAD"):
            raise ApiError(405, "method_not_allowed", "GET only", headers=[(b"allow", b"GET")])
        status, data = await self.ops.health()
        await self._send_json(responder, status, data)

    # --- static files --------------------------------------------------------------------

    async def _static(self, request: Request, responder: Responder, rel: str) -> None:
        if request.method not in (b"GET", b"HEAD"):
            raise ApiError(405, "method_not_allowed", "GET only", headers=[(b"allow", b"GET")])
        if self.web_root is None:
            raise ApiError(404, "not_found", "the web UI is not installed")
        body, headers = await static.read(self.web_root, rel)
        await self._send(responder, 200, body, headers)

    async def _vendor(self, request: Request, responder: Responder, name: str) -> None:
        if request.method not in (b"GET", b"HEAD"):
            raise ApiError(405, "method_not_allowed", "GET only", headers=[(b"allow", b"GET")])
        body, headers = await vendor.read(self.vendor_root, name)
        await self._send(responder, 200, body, headers)


def _loopback(client: tuple[str, int] | None) -> bool:
    """Whether the peer address is on this host (127.0.0.0/8 or ::1)."""
    if client is None:
        return False
    host = client[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


def _from_auth(exc: AuthError) -> ApiError:
    headers: Headers = []
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(math.ceil(exc.retry_after)).encode()))
    return ApiError(exc.status, exc.code, exc.message, headers=headers)
