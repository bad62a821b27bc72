"""The admin API's routes: the table, matching a path to a route, and query parameters.

A route names its handler (`AdminApi._h_<name>`, or `accounts.<name>` / `timeline.<name>`
for the accounts and timeline routes) and who may call it; `match_route` answers 404, or
405 with `Allow`.  HEAD matches the GET routes.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dgxmm.admin.errors import ApiError


class Access(enum.Enum):
    """Who may call a route."""

    PUBLIC = "public"
    VIEWER = "viewer"
    ADMIN = "admin"


@dataclass(frozen=True)
class Route:
    """One API route: method, path pattern (`{id}` is a parameter), handler, access."""

    method: str
    pattern: tuple[str, ...]
    handler: str
    access: Access


ROUTES: tuple[Route, ...] = (
    Route("POST", ("login",), "login", Access.PUBLIC),
    Route("GET", ("openapi.json",), "openapi", Access.PUBLIC),  # dgxmm/admin/openapi.py
    Route("POST", ("logout",), "logout", Access.VIEWER),
    Route("GET", ("session",), "session", Access.VIEWER),
    Route("POST", ("tokens",), "accounts.create_token", Access.ADMIN),
    Route("GET", ("tokens",), "accounts.list_tokens", Access.ADMIN),
    Route("DELETE", ("tokens", "{id}"), "accounts.revoke_token", Access.ADMIN),
    Route("GET", ("users",), "accounts.list_users", Access.ADMIN),
    Route("POST", ("users",), "accounts.add_user", Access.ADMIN),
    Route("PATCH", ("users", "{name}"), "accounts.change_user", Access.ADMIN),
    Route("DELETE", ("users", "{name}"), "accounts.remove_user", Access.ADMIN),
    Route("POST", ("session", "password"), "accounts.change_own_password", Access.VIEWER),
    Route("GET", ("deployments",), "list_deployments", Access.VIEWER),
    Route("POST", ("deployments",), "create_deployment", Access.ADMIN),
    Route("GET", ("deployments", "{id}"), "get_deployment", Access.VIEWER),
    Route("DELETE", ("deployments", "{id}"), "remove_deployment", Access.ADMIN),
    Route("POST", ("deployments", "{id}", "start"), "start_deployment", Access.ADMIN),
    Route("POST", ("deployments", "{id}", "stop"), "stop_deployment", Access.ADMIN),
    Route("POST", ("deployments", "{id}", "switch-model"), "switch_model", Access.ADMIN),
    Route("PATCH", ("deployments", "{id}", "mode"), "change_mode", Access.ADMIN),
    Route("GET", ("deployments", "{id}", "events"), "deployment_events", Access.VIEWER),
    Route("GET", ("audit",), "audit", Access.VIEWER),
    Route("GET", ("memory",), "memory", Access.VIEWER),
    Route("GET", ("settings",), "get_settings", Access.VIEWER),
    Route("PATCH", ("settings",), "change_settings", Access.ADMIN),
    Route("POST", ("settings", "tune"), "tune", Access.ADMIN),
    Route("POST", ("settings", "tune", "apply"), "tune_apply", Access.ADMIN),
    Route("POST", ("settings", "tune", "undo"), "tune_undo", Access.ADMIN),
    Route("GET", ("settings", "tune", "applied"), "tune_applied", Access.ADMIN),
    Route("GET", ("litellm",), "litellm_status", Access.VIEWER),
    Route("PATCH", ("litellm",), "litellm_configure", Access.ADMIN),
    Route("POST", ("litellm", "sync"), "litellm_sync", Access.ADMIN),
    Route("GET", ("events", "stream"), "event_stream", Access.VIEWER),
    Route("GET", ("gateway-key",), "keys.show", Access.ADMIN),
    Route("POST", ("gateway-key", "rotate"), "keys.rotate", Access.ADMIN),
    # Operators' routes (dgxmm/admin/ops.py).
    Route("GET", ("deployments", "{id}", "logs"), "deployment_logs", Access.VIEWER),
    Route("GET", ("deployments", "{id}", "progress"), "deployment_progress", Access.VIEWER),
    Route("GET", ("queue",), "queue", Access.VIEWER),
    # The timeline (dgxmm/admin/timeline.py).
    Route("GET", ("timeline",), "timeline.timeline", Access.VIEWER),
    Route("GET", ("requests", "{id}", "story"), "timeline.story", Access.VIEWER),
)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def match_route(method: str, parts: list[str]) -> tuple[Route, dict[str, str]]:
    """The route for `method` and path `parts`; ApiError 404 or 405 (with Allow) if none."""
    allowed: list[str] = []
    for route in ROUTES:
        if len(route.pattern) != len(parts):
            continue
        params: dict[str, str] = {}
        for want, got in zip(route.pattern, parts, strict=True):
            if want.startswith("{"):
                if not got:
                    break
                params[want[1:-1]] = got
            elif want != got:
                break
        else:
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                return route, params
            allowed.append(route.method)
    if allowed:
        raise ApiError(
            405,
            "method_not_allowed",
            f"{method} is not allowed here (allowed: {', '.join(allowed)})",
            headers=[(b"allow", ", ".join(allowed).encode())],
        )
    raise ApiError(404, "not_found", "no such API route")


# --- queries (pure) ------------------------------------------------------------------------


def iso(ts: float) -> str:
    """Epoch seconds as ISO 8601 with milliseconds, UTC."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds")


def parse_time_query(text: str, key: str) -> float:
    """A time query parameter (ISO 8601 or epoch seconds); ApiError 422 naming it."""
    from dgxmm.replay import parse_time

    try:
        return parse_time(text)
    except ValueError:
        raise ApiError(
            422, "invalid_query", f"{key}: ISO 8601 or epoch seconds", param=key
        ) from None


def int_query(query: Mapping[str, str], key: str, default: int | None, lo: int, hi: int) -> Any:
    """An integer query parameter from `lo` to `hi`, or `default`; ApiError 422 naming it."""
    text = query.get(key)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise ApiError(422, "invalid_query", f"{key}: an integer from {lo} to {hi}", param=key)
    return value
