"""The OpenAPI 3.1 document of DGXMM's two listeners: the admin API and the on-demand gateway.

The admin API is `/dgxmm/api/...`; the gateway is `/d/{deployment}/v1/...`.

It owns the document only.  Request bodies are the msgspec types the API validates with
(`dgxmm.admin.bodies`); each answer is the type its handler returns, read from the
handler's return annotation (`tuple[int, T]`: `_answer`), so the document cannot drift from
what is sent: their JSON Schemas come from `msgspec.json.schema_components`.  So do the
error answers (`errors.Error`) and the UI stream's events (`sse.EVENTS`).  Declared here are
only the gateway's answers (the engine answers there; `gateway` is not ours to type here)
and the engine log stream's lines.  The admin API serves it at
`GET /dgxmm/api/openapi.json`; `scripts/gen-api-docs` renders it as `docs/api.md` (a test
keeps that file current).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from dgxmm.admin import bodies
from dgxmm.admin.accounts import AccountRoutes
from dgxmm.admin.api import AdminApi
from dgxmm.admin.errors import Error, ErrorDetail
from dgxmm.admin.gateway_key_api import KeyRoutes
from dgxmm.admin.routes import ROUTES, Access, Route
from dgxmm.admin.sse import EVENTS
from dgxmm.admin.timeline import TimelineRoutes

SCHEMA_REF = "#/components/schemas/{name}"
JSON = "application/json"


# --- answers no handler of ours returns ---------------------------------------------------


class EngineErrorDetail(ErrorDetail, kw_only=True):
    """An engine's own error, relayed as it came (vLLM and llama.cpp number their codes)."""

    type: str | None = None  # type: ignore[assignment]
    code: str | int | None = None  # type: ignore[assignment]


class EngineError(Error, kw_only=True):
    """An error answer of the engine, relayed by the gateway."""

    error: EngineErrorDetail


class ModelObject(msgspec.Struct, kw_only=True):
    """One model as the gateway lists it."""

    id: str
    object: str
    created: int
    owned_by: str


class ModelList(msgspec.Struct, kw_only=True):
    """`GET /d/{deployment}/v1/models`: the deployment's model, answered from its record."""

    object: str
    data: list[ModelObject]


class InferenceBody(msgspec.Struct, kw_only=True):
    """An inference request: passed to the engine as it is.  `model` is the model the engine
    serves (what LiteLLM sends) or the deployment's name, which the engine is sent as the
    model it serves; another name gets 404 `model_not_found` in every state, and starts
    nothing."""

    model: str | None = None
    stream: bool | None = None


# --- what each admin route takes and gives -------------------------------------------------

# handler -> (summary, request body type or None, success status); the answer's type is the
# handler's return annotation (`_answer`).
_ADMIN: dict[str, tuple[str, Any, int]] = {
    "login": ("Log in: a session cookie and its CSRF token", bodies.LoginBody, 200),
    "logout": ("Log out (ends the session)", None, 200),
    "session": ("Who is calling", None, 200),
    "accounts.create_token": ("Create an API token (shown once)", bodies.TokenBody, 201),
    "accounts.list_tokens": ("List API tokens", None, 200),
    "accounts.revoke_token": ("Revoke an API token", None, 200),
    "accounts.list_users": ("List users", None, 200),
    "accounts.add_user": ("Add a user", bodies.UserBody, 201),
    "accounts.change_user": ("Change a user's role or password", bodies.UserChangeBody, 200),
    "accounts.remove_user": ("Remove a user", None, 200),
    "accounts.change_own_password": ("Change one's own password", bodies.PasswordBody, 200),
    "list_deployments": ("List deployments", None, 200),
    "create_deployment": ("Create a deployment", bodies.DeploymentBody, 201),
    "get_deployment": ("One deployment (by id or name)", None, 200),
    "remove_deployment": ("Remove a deployment", None, 200),
    "start_deployment": ("Start a deployment", None, 200),
    "stop_deployment": ("Stop a deployment (on demand: put it to sleep)", None, 200),
    "switch_model": ("Switch a deployment's model", bodies.SwitchModelBody, 200),
    "change_mode": ("Change the mode (on demand or always on)", bodies.ModeBody, 200),
    "deployment_events": ("A deployment's Events tab, newest first", None, 200),
    "audit": ("The audit trail, newest first", None, 200),
    "memory": ("The memory budget", None, 200),
    "get_settings": ("The settings in force", None, 200),
    "change_settings": ("Change settings (the on-demand defaults)", "object", 200),
    "tune": ("Recommend on-demand settings from the last 24 h (changes nothing)", "object", 200),
    "tune_apply": ("Apply a recommendation: one audited event holding its prediction",
                   "object", 200),
    "tune_undo": ("Undo the last applied recommendation (one audited event)", None, 200),
    "tune_applied": ("The last applied recommendation: its prediction beside what happened"
                     " since", None, 200),
    "litellm_status": ("The LiteLLM integration's status", None, 200),
    "litellm_configure": ("Configure the LiteLLM integration", "object", 200),
    "litellm_sync": ("Sync LiteLLM now", None, 200),
    "event_stream": ("The UI's live stream (server-sent events)", None, 200),
    "deployment_logs": ("A deployment's engine log (follow=1: a stream)", None, 200),
    "deployment_progress": ("A deployment's start progress", None, 200),
    "queue": ("The requests waiting, with what each waits for", None, 200),
    "openapi": ("This document", None, 200),
    "keys.show": ("The gateway key's fingerprints, overlap and mode (never the key)", None, 200),
    "keys.rotate": ("Rotate the gateway key (LiteLLM re-registered before the old one goes)",
                    None, 200),
    "timeline.timeline": ("The memory and residency timeline of a window", None, 200),
    "timeline.story": ("One request's story (the replay --request text)", None, 200),
}  # fmt: skip

# The routes that answer with server-sent events: event name -> the type of its `data` (one
# line of JSON).  Heartbeats are SSE comments, and `retry:` comes alone first.
_STREAMS: dict[str, dict[str, Any]] = {
    "event_stream": EVENTS,  # the UI's stream sends each type under its name only
    "deployment_logs": {"line": str},
}

_QUERIES: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "deployment_events": [
        ("limit", "rows (1 to 1000, default 100)", {"type": "integer"}),
        ("before", "rows before this sequence number", {"type": "integer"}),
    ],
    "audit": [
        ("limit", "rows (1 to 1000, default 100)", {"type": "integer"}),
        ("before", "rows before this sequence number", {"type": "integer"}),
        ("since", "ISO 8601 or epoch seconds", {"type": "string"}),
        ("until", "ISO 8601 or epoch seconds", {"type": "string"}),
        ("deployment", "a deployment's name or id", {"type": "string"}),
        ("actor", "who, such as admin:alice or ondemand", {"type": "string"}),
        ("action", "an audit action, such as ondemand_mode", {"type": "string"}),
    ],
    "timeline.timeline": [
        (
            "since",
            "from (ISO 8601 or epoch seconds; default an hour before until, or the log's"
            " first record if it is younger)",
            {"type": "string"},
        ),
        ("until", "to (ISO 8601 or epoch seconds; default now)", {"type": "string"}),
        ("from", "an alias of since", {"type": "string"}),
        ("to", "an alias of until", {"type": "string"}),
    ],
    "deployment_logs": [
        (
            "tail",
            "the last N lines (default 200)",
            {"type": "integer", "minimum": 0, "maximum": 10_000},
        ),
        (
            "follow",
            "1, true or yes: keep sending new lines (server-sent events); else the tail only",
            {"anyOf": [{"enum": ["1", "true", "yes"]}, {"type": "string"}]},
        ),
    ],
}

# Gateway routes: (method, path after /d/{deployment}, summary).
_GATEWAY = (
    ("POST", "/v1/chat/completions", "A chat completion (OpenAI); starts the model if asleep"),
    ("POST", "/v1/completions", "A completion (OpenAI); starts the model if asleep"),
    ("POST", "/v1/embeddings", "Embeddings (OpenAI); starts the model if asleep"),
    ("POST", "/v1/responses", "The Responses API (OpenAI); starts the model if asleep"),
    ("POST", "/v1/messages", "Anthropic messages; starts the model if asleep"),
    ("GET", "/v1/models", "The deployment's model, from its record (never starts it)"),
    ("GET", "/v1/models/{model}", "The engine's answer while ready; else 503 ondemand_not_ready"),
)

_ERRORS = (
    'An error: `{"error": {"message", "type", "code"}}` (`param` names a field at '
    "fault). 4xx are `invalid_request_error` on the gateway; 401 `unauthenticated`, 403 "
    "`forbidden` or `csrf_failed`, 404 `not_found`, 409 a conflict with the current state, "
    "413 a body over the cap, 422 a field at fault (`missing_field`, `unknown_field`, ...), "
    "429 too many failed logins, 503 `controller_busy` with Retry-After."
)
_GATEWAY_ERRORS = (
    "An error, OpenAI style. 401 `invalid_api_key` without the gateway key (`Authorization: "
    "Bearer <key>`, the key DGXMM gives LiteLLM; docs/security.md); 404 `not_found` (a "
    "route not passed to engines), "
    "`deployment_not_found`, `model_not_found`; 413 `request_too_large`; 503 with the "
    "seed's codes (`ondemand_queue_timeout` with Retry-After: 60, `ondemand_queue_full`, "
    "`does_not_fit`, `start_failed`, `ondemand_stopped`, `ondemand_not_ready`); 502 "
    "`engine_unreachable` or `engine_failed`. Any answer of the engine itself is relayed."
)


# Where a route's handler lives: `owner.name` is a method of these; `name` is `AdminApi._h_<name>`.
_OWNERS: dict[str, type] = {
    "": AdminApi,
    "accounts": AccountRoutes,
    "keys": KeyRoutes,
    "timeline": TimelineRoutes,
}


def _handler(name: str) -> Callable[..., Any]:
    owner, _, method = name.rpartition(".")
    found: Callable[..., Any] = getattr(_OWNERS[owner], method if owner else "_h_" + method)
    return found


def _answer(name: str) -> Any:
    """The type a route's handler answers with, from its return annotation: `T` of
    `tuple[int, T]` (or of `tuple[int, T] | None`, a route that may stream instead); None
    when it only streams."""
    returns = typing.get_type_hints(_handler(name))["return"]
    if typing.get_origin(returns) in (typing.Union, types.UnionType):
        replies = [a for a in typing.get_args(returns) if typing.get_origin(a) is tuple]
        returns = replies[0] if replies else None
    if returns is None or returns is type(None):
        return None
    _status, answer = typing.get_args(returns)
    return answer


def _ref(kind: Any) -> dict[str, Any]:
    return {"$ref": SCHEMA_REF.format(name=kind.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {JSON: {"schema": schema}}}


def _events(events: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A stream of server-sent events: the schema of each event (OpenAPI 3.1 describes an
    event stream event by event), its `data` one line of JSON of the schema its name says."""
    data = {"type": "string", "contentMediaType": JSON}
    return {
        "schema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {"event": {"enum": list(events)}, "data": data},
            "oneOf": [
                {
                    "properties": {
                        "event": {"const": name},
                        "data": {**data, "contentSchema": schema},
                    }
                }
                for name, schema in events.items()
            ],
        }
    }


# An engine's stream, relayed as it comes (OpenAI's chunks are `data:` lines without a name).
_ENGINE_EVENTS = {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}


def _admin_operation(route: Route, schemas: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    summary, body, status = _ADMIN[route.handler]
    answer = _answer(route.handler)
    op: dict[str, Any] = {
        "operationId": route.handler.rpartition(".")[2],
        "summary": summary,
        "tags": ["admin"],
    }
    params = [
        {"name": part[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
        for part in route.pattern
        if part.startswith("{")
    ]
    params += [
        {"name": name, "in": "query", "required": False, "description": text, "schema": schema}
        for name, text, schema in _QUERIES.get(route.handler, [])
    ]
    if params:
        op["parameters"] = params
    if body is not None:
        schema = {"type": "object"} if body == "object" else _ref(body)
        op["requestBody"] = {"required": True, **_json(schema)}
    ok: dict[str, Any] = {"content": {}}
    if answer is not None:
        ok = _json(schemas[answer])
    if route.handler in _STREAMS:
        events = {name: schemas[kind] for name, kind in _STREAMS[route.handler].items()}
        ok["content"]["text/event-stream"] = _events(events)
    op["responses"] = {
        str(status): {"description": "Done", **ok},
        "default": {"description": _ERRORS, **_json(_ref(Error))},
    }
    if route.access is Access.PUBLIC:
        op["security"] = []
    else:
        who = "an administrator" if route.access is Access.ADMIN else "a viewer or administrator"
        op["description"] = f"For {who}."
    return op


DEPLOYMENT_SEGMENT = (
    "The deployment's id (what LiteLLM's entries use), or its name: names are unique per box, "
    "an id always wins over a name that looks like one, and a name holding `/` is written "
    "`%2F`. Neither gives 404 `deployment_not_found`."
)


def _gateway_operation(method: str, path: str, summary: str) -> dict[str, Any]:
    params = [
        {
            "name": "deployment",
            "in": "path",
            "required": True,
            "description": DEPLOYMENT_SEGMENT,
            "schema": {"type": "string"},
        }
    ]
    if "{model}" in path:
        params.append(
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
        )
    name = path.strip("/").replace("/", "_").replace("{", "").replace("}", "")
    op: dict[str, Any] = {
        "operationId": f"gateway_{method.lower()}_{name}",
        "summary": summary,
        "tags": ["gateway"],
        "parameters": params,
        "security": [{"gateway_key": []}],
        "servers": [{"url": "http://127.0.0.1:8401", "description": "the on-demand gateway"}],
    }
    if method == "POST":
        op["requestBody"] = {"required": True, **_json(_ref(InferenceBody))}
        ok: dict[str, Any] = {
            "content": {
                JSON: {"schema": {"type": "object"}},
                "text/event-stream": _ENGINE_EVENTS,
            }
        }
    elif path == "/v1/models":
        ok = _json(_ref(ModelList))
    else:
        ok = _json({"type": "object"})
    op["responses"] = {
        "200": {"description": "The engine's answer (a queued request's text may start with "
                "the seed's queued line)", **ok},
        "default": {
            "description": _GATEWAY_ERRORS,
            **_json({"anyOf": [_ref(Error), _ref(EngineError)]}),
        },
    }  # fmt: skip
    return op


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of both listeners."""
    # Every type the document names, once each, in an order that does not vary between runs.
    named = {_answer(r.handler) for r in ROUTES} - {None, Any}
    named |= {kind for events in _STREAMS.values() for kind in events.values()}
    named |= {b for _, b, _ in _ADMIN.values() if isinstance(b, type)}
    named |= {Error, ModelList, InferenceBody, EngineError}
    kinds = sorted(named, key=repr)
    found, components = msgspec.json.schema_components(kinds, ref_template=SCHEMA_REF)
    schemas: dict[Any, dict[str, Any]] = {
        Any: {"type": "object"},
        **dict(zip(kinds, found, strict=True)),
    }
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        path = "/dgxmm/api/" + "/".join(route.pattern)
        paths.setdefault(path, {})[route.method.lower()] = _admin_operation(route, schemas)
    for method, path, summary in _GATEWAY:
        full = "/d/{deployment}" + path
        paths.setdefault(full, {})[method.lower()] = _gateway_operation(method, path, summary)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "DGXMM",
            "version": "1",
            "description": (
                "The admin API (default http://127.0.0.1:8400) and the on-demand gateway "
                "(default http://127.0.0.1:8401). Log in with POST /dgxmm/api/login: the "
                "answer sets a session cookie and gives a csrf_token; send it as x-csrf-token "
                "on every POST, PATCH and DELETE of that session. Or send an API token "
                "(POST /dgxmm/api/tokens, or `dgxmm token create`) as `Authorization: Bearer "
                "<token>`: no CSRF token then."
            ),
        },
        "servers": [{"url": "http://127.0.0.1:8400", "description": "the admin API"}],
        "security": [{"session": [], "csrf": []}, {"token": []}],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "session": {"type": "apiKey", "in": "cookie", "name": "dgxmm_session"},
                "csrf": {"type": "apiKey", "in": "header", "name": "x-csrf-token"},
                "token": {"type": "http", "scheme": "bearer"},
                "gateway_key": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The gateway key (<data_dir>/gateway.key); gateway only",
                },
            },
        },
    }
