"""LiteLLM sync: which model entries DGXMM wants in LiteLLM, and two ways to put them there.

`desired_entries` is the pure decision.  For the api back-end (a change costs LiteLLM nothing)
it follows the seed: always-on deployments that are ready point at their engine, on-demand ones
(in any state but failed) at the gateway, failed ones are absent; each path has its own stable
`model_info.id`, so a mode switch replaces one entry by another.  For the file back-end, where
every write restarts LiteLLM's worker, the entries are *stable*: every deployment, whatever its
mode and state, has its gateway entry, so only creating, removing or reconfiguring a deployment
changes the file.  `litellm_deployment` renders an entry the way LiteLLM 1.108.7 reads it.

Two back-ends implement `actors.ports.LiteLLMSync`:

- `ApiSync` (here) talks to LiteLLM's model-management API (`/model/info`, `/model/new`,
  `PATCH /model/{id}/update`, `/model/delete`; LiteLLM needs its database for the writes).  It
  reads LiteLLM's live list on every sync, so it converges after either side restarts.  It adds
  before it removes: one LiteLLM process serves both lists in turn, so a mode switch never
  leaves the model name without an entry.
- `dgxmm.litellm.filesync.ConfigFileSync` rewrites LiteLLM's config file for a LiteLLM run with
  `--config FILE --reload`, at once, and checks in the background that LiteLLM loaded it.

Both only touch entries they own (ids with this box's prefix); every failure becomes
`actors.errors.SyncFailed` with a sentence an operator can act on.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import structlog

from actors.errors import SyncFailed
from actors.ports import ModelEntry
from dgxmm.litellm.gateway_key import key_id
from gateway import client

if TYPE_CHECKING:
    from dgxmm.litellm.filesync import ConfigFileSync

log = structlog.get_logger(__name__)

READY = "ready"  # Registration.state of a deployment whose engine serves
FAILED = "failed"  # a deployment whose start failed: removed from LiteLLM (api back-end)
GATEWAY_TIMEOUT_MARGIN_S = 600.0  # LiteLLM's timeout = queue limit + this (cold start, answer)
HEALTH_CHECK_HEADER = "x-dgxmm-health-check"
# The deploy wizard's hint when it preselects Always on (the seed's words).
HINT = "On demand needs LiteLLM (it starts models on requests that come through it)"
# Engine entries: LiteLLM's openai client insists on a key, and engines check none.  Gateway
# entries carry the gateway key (`dgxmm.litellm.gateway_key`), which the gateway requires.
UPSTREAM_API_KEY = "dgxmm-no-key"
KEY_ID_FIELD = "dgxmm_key_id"  # model_info: the gateway key's fingerprint (never the key)
ID_STEM = "dgxmm-"
GATEWAY_ID_SUFFIX = "-gw"

REQUEST_TIMEOUT_S = 10.0  # one HTTP exchange with LiteLLM
MAX_ANSWER_BYTES = 16 * 1024 * 1024  # /model/info lists every entry with its cost map fields


# --------------------------------------------------------------------------------------------
# What DGXMM wants


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """What the sync needs to know about one deployment."""

    deployment_id: str
    model_name: str  # the name clients use in LiteLLM
    served_model: str  # the model name the engine serves
    mode: Literal["on_demand", "always_on"]
    state: str  # the deployment's lifecycle state; READY and FAILED matter here
    engine_url: str | None = None  # `http://host:port` of the running engine
    box_id: str = ""  # prefix that keeps model_info.id unique when boxes share one LiteLLM


def id_prefix(box_id: str) -> str:
    """The prefix of every `model_info.id` this box owns."""
    return f"{box_id}-{ID_STEM}" if box_id else ID_STEM


def entry_id(box_id: str, deployment_id: str, via_gateway: bool) -> str:
    """The stable `model_info.id` of a deployment's engine entry or gateway entry."""
    suffix = GATEWAY_ID_SUFFIX if via_gateway else ""
    return f"{id_prefix(box_id)}{deployment_id}{suffix}"


def gateway_timeout_s(queue_timeout_s: float) -> float:
    """LiteLLM's timeout for gateway entries: the queue limit plus a margin (1500 s by default)."""
    return queue_timeout_s + GATEWAY_TIMEOUT_MARGIN_S


def desired_entries(
    regs: Iterable[Registration],
    gateway_url: str,
    queue_timeout_s: float,
    *,
    stable: bool = False,
) -> list[ModelEntry]:
    """The LiteLLM entries DGXMM wants for these deployments, sorted by `model_id`.

    `stable` (the file back-end): every deployment gets its gateway entry, whatever its mode and
    state, so that nothing but creating, removing or reconfiguring a deployment changes the list.
    """
    gateway = gateway_url.rstrip("/")
    entries: list[ModelEntry] = []
    for reg in regs:
        if stable or (reg.mode == "on_demand" and reg.state != FAILED):
            entries.append(
                ModelEntry(
                    model_id=entry_id(reg.box_id, reg.deployment_id, via_gateway=True),
                    model_name=reg.model_name,
                    api_base=f"{gateway}/d/{reg.deployment_id}/v1",
                    upstream_model=reg.served_model,
                    via_gateway=True,
                    timeout_s=gateway_timeout_s(queue_timeout_s),
                    deployment_id=reg.deployment_id,
                )
            )
        elif reg.mode == "always_on" and reg.state == READY and reg.engine_url:
            entries.append(
                ModelEntry(
                    model_id=entry_id(reg.box_id, reg.deployment_id, via_gateway=False),
                    model_name=reg.model_name,
                    api_base=f"{reg.engine_url.rstrip('/')}/v1",
                    upstream_model=reg.served_model,
                    via_gateway=False,
                    deployment_id=reg.deployment_id,
                )
            )
    return sorted(entries, key=lambda e: e.model_id)


def litellm_deployment(entry: ModelEntry, gateway_key: str = "") -> dict[str, Any]:
    """One entry as LiteLLM's `model_list` item and `/model/new` body.

    A gateway entry's `api_key` is `gateway_key`, and its `model_info` names the key's
    fingerprint: LiteLLM's `/model/info` hides keys, the fingerprint shows which one it holds.

    `openai/` makes LiteLLM strip the prefix, send `"model": upstream_model`, forward the
    Responses API natively and translate Anthropic `/v1/messages` to the Responses API.  Gateway
    entries turn LiteLLM's retries off (`num_retries`, which the router reads per entry; the
    gateway already waits) and mark health probes with a header the gateway answers itself.
    """
    params: dict[str, Any] = {
        "model": f"openai/{entry.upstream_model}",
        "api_base": entry.api_base,
        "api_key": UPSTREAM_API_KEY,
    }
    info: dict[str, Any] = {"id": entry.model_id, "dgxmm_deployment_id": entry.deployment_id}
    if entry.via_gateway and gateway_key:
        params["api_key"] = gateway_key
        info[KEY_ID_FIELD] = key_id(gateway_key)
    if entry.timeout_s is not None:
        params["timeout"] = entry.timeout_s
        params["stream_timeout"] = entry.timeout_s
    if entry.via_gateway:
        params["num_retries"] = 0
        info["health_check_params"] = {"extra_headers": {HEALTH_CHECK_HEADER: "1"}}
    return {"model_name": entry.model_name, "litellm_params": params, "model_info": info}


def _model_id(item: Mapping[str, Any]) -> str | None:
    info = item.get("model_info")
    model_id = info.get("id") if isinstance(info, Mapping) else None
    return model_id if isinstance(model_id, str) else None


def _same_value(want: object, have: object) -> bool:
    if isinstance(want, int | float) and isinstance(have, int | float):
        return float(want) == float(have)
    return want == have


def differs(want: Mapping[str, Any], have: Mapping[str, Any]) -> bool:
    """Whether LiteLLM's entry `have` lacks something of the rendered entry `want`."""
    if want.get("model_name") != have.get("model_name"):
        return True
    want_params, have_params = want["litellm_params"], have.get("litellm_params") or {}
    for key, value in want_params.items():
        if key != "api_key" and not _same_value(value, have_params.get(key)):
            return True
    have_info = have.get("model_info") or {}
    if want["model_info"].get(KEY_ID_FIELD) != have_info.get(KEY_ID_FIELD):
        return True  # registered with another gateway key (a rotation)
    want_hc = want["model_info"].get("health_check_params") or None
    have_hc = have_info.get("health_check_params") or None
    return bool(want_hc != have_hc)


# --------------------------------------------------------------------------------------------
# Settings and status


class LiteLLMSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How DGXMM reaches LiteLLM; the master key is read from an environment variable."""

    enabled: bool = False
    url: str = "http://127.0.0.1:4000"
    master_key_env: str = "LITELLM_MASTER_KEY"
    backend: Literal["api", "file"] = "api"
    config_path: str = ""  # backend "file": the file LiteLLM runs with (--config FILE --reload)
    box_id: str = ""


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


class _Unreachable(SyncFailed):
    """A sync failed because LiteLLM did not answer (down, or restarting)."""


def _error_text(answer: client.Response) -> str:
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


def _kind(answer: client.Response) -> Literal["auth", "no_db", "other"]:
    """What a refusal means: a wrong key, a LiteLLM without database, or anything else."""
    reason = _error_text(answer)
    # Without a database LiteLLM looks any key but its master key up there: HTTP 400.
    if answer.status in (401, 403) or (answer.status == 400 and "No connected db" in reason):
        return "auth"
    if "No DB Connected" in reason or "STORE_MODEL_IN_DB" in reason:
        return "no_db"
    return "other"


def _failure(what: str, answer: client.Response) -> SyncFailed:
    reason = _error_text(answer)
    status = f"{what}: HTTP {answer.status}"
    match _kind(answer):
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
            raise _Unreachable(
                f"cannot reach LiteLLM at {self.url}: connection refused (is LiteLLM running?)"
            ) from exc
        except client.HttpClientError as exc:
            raise _Unreachable(f"cannot reach LiteLLM at {self.url}: {exc}") from exc

    async def list_entries(self) -> list[dict[str, Any]]:
        """Every entry LiteLLM's router serves (`GET /model/info`)."""
        answer = await self._call("GET", "/model/info")
        body = answer.json()
        if answer.status != 200:
            raise _failure("GET /model/info", answer)
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise SyncFailed(f"LiteLLM's /model/info at {self.url} did not return a model list")
        return [item for item in body["data"] if isinstance(item, dict)]

    async def add(self, deployment: Mapping[str, Any]) -> client.Response:
        """`POST /model/new`; returns LiteLLM's answer, whatever its status."""
        return await self._call("POST", "/model/new", deployment)

    async def update(self, deployment: Mapping[str, Any]) -> None:
        """`PATCH /model/{id}/update` with the whole rendered entry."""
        model_id = _model_id(deployment) or ""
        target = f"/model/{urllib.parse.quote(model_id, safe='')}/update"
        answer = await self._call("PATCH", target, deployment)
        if answer.status != 200:
            raise _failure(f"updating {model_id}", answer)

    async def delete(self, model_id: str) -> client.Response:
        """`POST /model/delete`; returns LiteLLM's answer, whatever its status."""
        return await self._call("POST", "/model/delete", {"id": model_id})


# --------------------------------------------------------------------------------------------
# Shared by both back-ends


class _Tracker:
    """Serialises syncs and remembers the outcome of the last one."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.lock = asyncio.Lock()
        self.clock = clock
        self.status = SyncStatus(enabled=True)

    def succeeded(self, backend: str, **counts: int) -> None:
        self.status = SyncStatus(enabled=True, last_sync_at=self.clock(), ok=True)
        log.info("litellm_synced", backend=backend, **counts)

    def failed(self, backend: str, error: SyncFailed) -> None:
        self.status = SyncStatus(
            enabled=True, last_sync_at=self.clock(), ok=False, error=str(error)
        )
        log.warning("litellm_sync_failed", backend=backend, error=str(error))


def _owned(items: Iterable[Mapping[str, Any]], box_id: str) -> dict[str, Mapping[str, Any]]:
    prefix = id_prefix(box_id)
    owned: dict[str, Mapping[str, Any]] = {}
    for item in items:
        model_id = _model_id(item)
        if model_id is not None and model_id.startswith(prefix):
            owned[model_id] = item
    return owned


def _rendered(entries: Iterable[ModelEntry], gateway_key: str = "") -> dict[str, dict[str, Any]]:
    ordered = sorted(entries, key=lambda e: e.model_id)
    return {e.model_id: litellm_deployment(e, gateway_key) for e in ordered}


# --------------------------------------------------------------------------------------------
# Back-end (a): the model-management API


class _Backend:
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
        self._tracker = _Tracker(clock)

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


class ApiSync(_Backend):
    """Keeps LiteLLM's database-backed model list equal to DGXMM's, through its API.

    A sync adds, then updates, then removes, so a mode switch never leaves a model name
    without an entry in the one LiteLLM process that serves both.
    """

    kind = "api"

    def __repr__(self) -> str:
        return f"ApiSync({self._client.url!r}, box_id={self._box_id!r})"

    async def _sync(self, entries: list[ModelEntry]) -> dict[str, int]:
        want = _rendered(entries, self._gateway_key())
        live = _owned(await self._client.list_entries(), self._box_id)
        added = [i for i in want if i not in live]
        changed = [i for i in want if i in live and differs(want[i], live[i])]
        removed = [i for i in live if i not in want]
        for model_id in [*changed, *removed]:
            if (live[model_id].get("model_info") or {}).get("db_model") is False:
                raise SyncFailed(
                    f"LiteLLM entry {model_id} comes from LiteLLM's config file, which the api "
                    "back-end cannot change; remove it from that file"
                )
        for model_id in added:
            await self._add(want[model_id])
        for model_id in changed:
            await self._client.update(want[model_id])
            log.info("litellm_entry_updated", model_id=model_id)
        for model_id in removed:
            await self._remove(model_id)
        return {"added": len(added), "updated": len(changed), "removed": len(removed)}

    async def _add(self, deployment: Mapping[str, Any]) -> None:
        model_id = _model_id(deployment) or ""
        answer = await self._client.add(deployment)
        if answer.status == 200:
            log.info("litellm_entry_added", model_id=model_id)
            return
        failure = _failure(f"adding {model_id}", answer)
        if _kind(answer) != "other":
            raise failure
        # The id may already be in LiteLLM's database (another LiteLLM worker had it, or an
        # earlier answer was lost): writing it in place makes the add idempotent.
        try:
            await self._client.update(deployment)
        except SyncFailed:
            raise failure from None
        log.info("litellm_entry_updated", model_id=model_id, after="add_refused")

    async def _remove(self, model_id: str) -> None:
        answer = await self._client.delete(model_id)
        if answer.status == 200:
            log.info("litellm_entry_removed", model_id=model_id)
        elif answer.status in (400, 404) and "not found" in _error_text(answer).lower():
            log.info("litellm_entry_already_gone", model_id=model_id)
        else:
            raise _failure(f"removing {model_id}", answer)


# --------------------------------------------------------------------------------------------
# Choosing a back-end


class DisabledSync:
    """The LiteLLM integration is off: syncing does nothing."""

    def status(self) -> SyncStatus:
        """Always disabled."""
        return SyncStatus(enabled=False)

    async def sync(self, entries: list[ModelEntry]) -> None:
        """Do nothing."""

    async def close(self) -> None:
        """Nothing to stop."""


def make_sync(
    settings: LiteLLMSettings,
    environ: Mapping[str, str] | None = None,
    gateway_key: Callable[[], str] | None = None,
) -> ApiSync | ConfigFileSync | DisabledSync:
    """The back-end these settings ask for; the master key comes from `settings.master_key_env`,
    the gateway key (the gateway entries' `api_key`) from `gateway_key()` at every sync."""
    from dgxmm.litellm.filesync import ConfigFileSync  # the file back-end builds on this module

    if not settings.enabled:
        return DisabledSync()
    env = os.environ if environ is None else environ
    key = env.get(settings.master_key_env) or None
    if settings.backend == "file":
        if not settings.config_path:
            raise SyncFailed("LiteLLM file back-end: no config_path set")
        return ConfigFileSync(
            settings.config_path,
            settings.url,
            key,
            box_id=settings.box_id,
            master_key_env=settings.master_key_env,
            gateway_key=gateway_key,
        )
    return ApiSync(
        settings.url,
        key,
        box_id=settings.box_id,
        master_key_env=settings.master_key_env,
        gateway_key=gateway_key,
    )
