"""What both LiteLLM back-ends share: the model-management API's client, and their base class.

The base class holds the client, with the master-key check and the outcome of the last sync.

The api back-end (`dgxmm.litellm.sync.ApiSync`) writes through this client; the file back-end
(`dgxmm.litellm.filesync.ConfigFileSync`) only reads with it, to see whether LiteLLM loaded its
file.  Every failure is an `actors.errors.SyncFailed` with a sentence an operator can act on;
`Unreachable` says LiteLLM did not answer at all.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec
import structlog

from actors.errors import SyncFailed
from actors.ports import ModelEntry
from dgxmm.litellm.entries import id_of
from gateway import client

log = structlog.get_logger("dgxmm.litellm.sync")

REQUEST_TIMEOUT_S = 10.0  # one HTTP exchange with LiteLLM
MAX_ANSWER_BYTES = 16 * 1024 * 1024  # /model/info lists every entry with its cost map fields


class SyncStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of the last sync, for the UI and the deploy wizard's default."""

    enabled: bool
    last_sync_at: float | None = None  # wall-clock seconds since the epoch
    ok: bool = False
    error: str | None = None

    @property
    def synced(self) -> bool:
        """Enabled and the last sync succeeded (the wizard then preselects On demand)."""
        return self.enabled and self.ok


class Unreachable(SyncFailed):
    """A sync failed because LiteLLM did not answer (down, or restarting)."""


def error_text(answer: client.Response) -> str:
    """LiteLLM's error message out of its several error shapes, shortened for the UI."""
    body = answer.json()
    text: object = None
    if isinstance(body, dict):
        error, detail = body.get("error"), body.get("detail")
        if isinstance(error, dict):
            text = error.get("message")
        elif isinstance(error, str):
            text = error
        elif isinstance(detail, dict):
            text = detail.get("error") or detail
        elif detail is not None:
            text = detail
    if text is None:
        text = answer.body.decode(errors="replace").strip() or "(empty body)"
    message = str(text)
    return message if len(message) <= 300 else message[:297] + "..."


def refusal_kind(answer: client.Response) -> Literal["auth", "no_db", "other"]:
    """What a refusal means: a wrong key, a LiteLLM without database, or anything else."""
    reason = error_text(answer)
    # Without a database LiteLLM looks any key but its master key up there: HTTP 400.
    if answer.status in (401, 403) or (answer.status == 400 and "No connected db" in reason):
        return "auth"
    if "No DB Connected" in reason or "STORE_MODEL_IN_DB" in reason:
        return "no_db"
    return "other"


def refusal(what: str, answer: client.Response) -> SyncFailed:
    """The `SyncFailed` for LiteLLM's refusal of `what`, in words an operator can act on."""
    reason = error_text(answer)
    status = f"{what}: HTTP {answer.status}"
    match refusal_kind(answer):
        case "auth":
            return SyncFailed(f"LiteLLM refused the master key ({status}): {reason}")
        case "no_db":
            return SyncFailed(
                f"LiteLLM cannot store models ({status}): {reason}. The api back-end needs "
                "LiteLLM with DATABASE_URL and STORE_MODEL_IN_DB=True; without a database use "
                "the file back-end"
            )
        case _:
            return SyncFailed(f"LiteLLM answered HTTP {answer.status} to {what}: {reason}")


class LiteLLMClient:
    """LiteLLM's model-management endpoints, authenticated with the master key."""

    def __init__(self, url: str, master_key: str, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self._auth = [("authorization", f"Bearer {master_key}")]
        self._timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"LiteLLMClient({self.url!r})"  # never the key

    async def _call(self, method: str, target: str, body: object = None) -> client.Response:
        try:
            origin = client.Origin.parse(self.url)
        except ValueError as exc:
            raise SyncFailed(f"LiteLLM URL: {exc}") from exc
        headers = self._auth
        payload = b""
        if body is not None:
            payload = json.dumps(body).encode()
            headers = [*headers, ("content-type", "application/json")]
        try:
            return await client.request_url(
                origin,
                method,
                target,
                body=payload,
                headers=headers,
                timeout_s=self._timeout_s,
                max_body_bytes=MAX_ANSWER_BYTES,
            )
        except client.ConnectionRefused as exc:
            raise Unreachable(
                f"cannot reach LiteLLM at {self.url}: connection refused (is LiteLLM running?)"
            ) from exc
        except client.HttpClientError as exc:
            raise Unreachable(f"cannot reach LiteLLM at {self.url}: {exc}") from exc

    async def list_entries(self) -> list[dict[str, Any]]:
        """Every entry LiteLLM's router serves (`GET /model/info`)."""
        answer = await self._call("GET", "/model/info")
        body = answer.json()
        if answer.status != 200:
            raise refusal("GET /model/info", answer)
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise SyncFailed(f"LiteLLM's /model/info at {self.url} did not return a model list")
        return [item for item in body["data"] if isinstance(item, dict)]

    async def add(self, deployment: Mapping[str, Any]) -> client.Response:
        """`POST /model/new`; returns LiteLLM's answer, whatever its status."""
        return await self._call("POST", "/model/new", deployment)

    async def update(self, deployment: Mapping[str, Any]) -> None:
        """`PATCH /model/{id}/update` with the whole rendered entry."""
        model_id = id_of(deployment) or ""
        target = f"/model/{urllib.parse.quote(model_id, safe='')}/update"
        answer = await self._call("PATCH", target, deployment)
        if answer.status != 200:
            raise refusal(f"updating {model_id}", answer)

    async def delete(self, model_id: str) -> client.Response:
        """`POST /model/delete`; returns LiteLLM's answer, whatever its status."""
        return await self._call("POST", "/model/delete", {"id": model_id})


class Tracker:
    """Serialises syncs and remembers the outcome of the last one."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.lock = asyncio.Lock()
        self.clock = clock
        self.status = SyncStatus(enabled=True)

    def succeeded(self, backend: str, **counts: int) -> None:
        """Record (and log) a sync that went through, with what it changed."""
        self.status = SyncStatus(enabled=True, last_sync_at=self.clock(), ok=True)
        log.info("litellm_synced", backend=backend, **counts)

    def failed(self, backend: str, error: SyncFailed) -> None:
        """Record (and log) a sync that failed, with the operator's sentence."""
        self.status = SyncStatus(
            enabled=True, last_sync_at=self.clock(), ok=False, error=str(error)
        )
        log.warning("litellm_sync_failed", backend=backend, error=str(error))


class Backend:
    """What both back-ends share: the LiteLLM client, the key check and the sync status."""

    kind = ""

    def __init__(
        self,
        url: str,
        master_key: str | None,
        *,
        box_id: str = "",
        master_key_env: str = "LITELLM_MASTER_KEY",
        clock: Callable[[], float] = time.time,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        gateway_key: Callable[[], str] | None = None,
    ) -> None:
        self._client = LiteLLMClient(url, master_key or "", request_timeout_s)
        self._gateway_key = gateway_key or str  # str() is "": entries keep UPSTREAM_API_KEY
        self._has_key = bool(master_key)
        self._key_env = master_key_env
        self._box_id = box_id
        self._tracker = Tracker(clock)

    def status(self) -> SyncStatus:
        """The outcome of the last sync."""
        return self._tracker.status

    def _require_key(self) -> None:
        if not self._has_key:
            raise SyncFailed(f"LiteLLM master key: environment variable {self._key_env} is not set")

    async def close(self) -> None:
        """Stop background work (none here)."""

    async def sync(self, entries: list[ModelEntry]) -> None:
        """Make LiteLLM's owned entries equal to `entries`; raises SyncFailed."""
        async with self._tracker.lock:
            try:
                self._require_key()
                counts = await self._sync(entries)
            except SyncFailed as exc:
                self._tracker.failed(self.kind, exc)
                raise
            self._tracker.succeeded(self.kind, **counts)

    async def _sync(self, entries: list[ModelEntry]) -> dict[str, int]:
        raise NotImplementedError
