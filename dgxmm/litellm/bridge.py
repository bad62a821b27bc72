"""The LiteLLM bridge: keeps LiteLLM's model list following the controller's deployments.

Every change that matters to LiteLLM (a deployment created, ready, failed, removed, or its
mode switched) schedules one sync; changes that arrive within `COALESCE_S` (0.2 s) of the
first share it, and a sync writes LiteLLM's file at most once.  Traffic (requests starting and
ending, the queue) never does.  With the file back-end the entries are stable
(`desired_entries(stable=True)`): a state change or mode switch leaves them equal, so the sync
writes nothing and LiteLLM is not restarted; the first sync at start-up writes the file even
with no deployments, so LiteLLM can be started on it right away.  With `reload_command` set,
each write is followed by that command, run in the background by `dgxmm.litellm.reload`
(writes during a reload share the next one); syncs never wait for it.  Each sync's outcome is
recorded as a `LiteLLMSynced` event when it differs from the previous one, so the log shows when
LiteLLM fell out of step and when it came back, without an event per sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from actors.controller import Controller
from actors.errors import SyncFailed
from actors.ports import ModelEntry
from actors.runtime import Clock, TimerHandle
from dgxmm.config import Config
from dgxmm.litellm.entries import Registration, desired_entries
from dgxmm.litellm.filesync import ConfigFileSync, LoadStatus
from dgxmm.litellm.reload import ReloadStatus
from dgxmm.litellm.sync import HINT, ApiSync, DisabledSync, LiteLLMSettings, make_sync
from events import model as m
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.litellm.sync")

COALESCE_S = 0.2
RETRY_S = 30.0
RESYNC_S = 60.0  # a forced sync now and then: LiteLLM may have lost its entries (a restart)
_QUIET = frozenset({"activity", "queue"})
_SETTING_KEYS = ("enabled", "url", "backend", "config_path", "master_key_env")


class LiteLLMBridge:
    """Owns the sync back-end and its status."""

    def __init__(
        self,
        config: Config,
        controller: Controller,
        store: EventStore,
        clock: Clock,
        gateway_key: Callable[[], str] | None = None,
    ):
        self._config = config
        self._gateway_key = gateway_key  # the gateway entries' api_key, read at every sync
        self._controller = controller
        self._store = store
        self._clock = clock
        self._settings = self._initial_settings()
        self._backend: ApiSync | ConfigFileSync | DisabledSync | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_synced: list[ModelEntry] | None = None
        self._last_ok: bool | None = None
        self._last_error: str | None = None
        self._last_sync_at: float | None = None
        self._force = False
        self._resync_timer: TimerHandle | None = None

    def _initial_settings(self) -> dict[str, Any]:
        lite = self._config.litellm
        settings: dict[str, Any] = {
            "enabled": lite.enabled,
            "url": lite.url,
            "backend": lite.backend,
            "config_path": lite.config_path
            or str(self._config.server.db_path.parent / "litellm.yaml"),
            "master_key_env": lite.master_key_env,
        }
        recorded = self._controller.system.settings
        for key in _SETTING_KEYS:
            if f"litellm.{key}" in recorded:
                settings[key] = recorded[f"litellm.{key}"]
        status = self._controller.system.litellm
        self._last_ok, self._last_error = status.ok, status.error
        self._last_sync_at = status.last_sync_at
        return settings

    def _build_backend(self) -> ApiSync | ConfigFileSync | DisabledSync:
        backend = self._make_sync()
        lite = self._config.litellm
        if isinstance(backend, ConfigFileSync) and lite.reload_command:
            backend.use_reload_command(lite.reload_command, lite.reload_timeout_s, self._clock)
        return backend

    def _make_sync(self) -> ApiSync | ConfigFileSync | DisabledSync:
        s = self._settings
        return make_sync(
            LiteLLMSettings(
                enabled=s["enabled"],
                url=s["url"],
                master_key_env=s["master_key_env"],
                backend=s["backend"],
                config_path=s["config_path"],
                box_id=self._config.server.box_id,
            ),
            gateway_key=self._gateway_key,
        )

    # --- running -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start following the controller."""
        self._backend = self._build_backend()
        self._controller.add_listener(self._on_change)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="litellm-sync")
        self._wake.set()
        self._schedule_resync()

    def _schedule_resync(self) -> None:
        def resync() -> None:
            self._force = True
            self._wake.set()
            self._schedule_resync()

        self._resync_timer = self._clock.call_later(RESYNC_S, resync)

    async def stop(self) -> None:
        """Stop syncing."""
        if self._resync_timer is not None:
            self._resync_timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._backend is not None:
            await self._backend.close()

    def _on_change(self, deployment_id: str, what: str) -> None:
        if what not in _QUIET:
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(COALESCE_S)  # let changes that arrive together share a sync
            self._wake.clear()
            force, self._force = self._force, False
            try:
                await self._sync(force=force)
            except SyncFailed:
                # Try again later even if nothing changes: LiteLLM may come back.
                self._clock.call_later(RETRY_S, self._wake.set)

    def entries(self) -> list[ModelEntry]:
        """What LiteLLM should list right now."""
        regs = [
            Registration(
                deployment_id=rec.id,
                model_name=rec.name,
                served_model=rec.model,
                mode="on_demand" if rec.mode == "on_demand" else "always_on",
                state=rec.state,
                engine_url=rec.engine_url,
                box_id=self._config.server.box_id,
            )
            for rec in self._controller.records()
        ]
        queue_limit = float(self._controller.setting("ondemand_queue_timeout_s"))
        stable = self._settings["backend"] == "file"  # each write restarts LiteLLM's worker
        return desired_entries(
            regs, self._config.server.public_gateway_url, queue_limit, stable=stable
        )

    async def _sync(self, *, force: bool) -> None:
        backend = self._backend
        if backend is None or not self._settings["enabled"]:
            return
        entries = self.entries()
        if not force and entries == self._last_synced and self._last_ok:
            return
        try:
            await backend.sync(entries)
        except SyncFailed as exc:
            await self._record(ok=False, error=str(exc), count=len(entries))
            log.warning("litellm_sync_failed", error=str(exc))
            raise
        self._last_synced = entries
        await self._record(ok=True, error=None, count=len(entries))

    async def _record(self, *, ok: bool, error: str | None, count: int) -> None:
        self._last_sync_at = self._clock.wall()
        changed = (ok, error) != (self._last_ok, self._last_error)
        self._last_ok, self._last_error = ok, error
        if changed:
            await self._store.append(
                m.STREAM_LITELLM,
                [m.LiteLLMSynced(ok=ok, error=error, entries=count)],
                actor="litellm",
            )

    # --- the API's side ------------------------------------------------------------------

    def load_status(self) -> LoadStatus:
        """File back-end: writes (LiteLLM restarts DGXMM caused) and whether LiteLLM loaded them."""
        backend = self._backend
        return backend.load_status() if isinstance(backend, ConfigFileSync) else LoadStatus()

    def reload_status(self) -> ReloadStatus | None:
        """File back-end: how LiteLLM is reloaded after a write, and each reload's time."""
        backend = self._backend
        return backend.reload_status() if isinstance(backend, ConfigFileSync) else None

    def status(self) -> dict[str, Any]:
        """Enabled, last sync, ok or the error, the file back-end's load, the wizard's default."""
        s = self._settings
        synced = bool(s["enabled"] and self._last_ok)
        load = self.load_status()
        reload = self.reload_status()
        return {
            "enabled": s["enabled"],
            "url": s["url"],
            "backend": s["backend"],
            "config_path": s["config_path"],
            "master_key_env": s["master_key_env"],
            "master_key_set": bool(os.environ.get(s["master_key_env"])),
            "last_sync_at": self._last_sync_at,
            "ok": self._last_ok,
            "error": self._last_error,
            "entries": len(self._last_synced or []),
            "default_mode": "on_demand" if synced else "always_on",
            "hint": None if synced else HINT,
            "config_writes": load.config_writes,
            "last_write_at": load.last_write_at,
            "loaded": load.loaded,
            "loaded_at": load.loaded_at,
            "load_error": load.load_error,
            "reload": None if reload is None else msgspec.to_builtins(reload),
        }

    async def register_key(self, timeout_s: float) -> bool:
        """Re-register every entry with the current gateway key (a rotation); True once
        LiteLLM is seen serving them (file back-end: after its worker restarted; api back-end:
        when its API took them).  Raises SyncFailed when they could not be written; False
        when the integration is off or the load was not confirmed within `timeout_s`."""
        if not self._settings["enabled"]:
            return False
        await self._sync(force=True)
        backend = self._backend
        if isinstance(backend, ConfigFileSync):
            if not backend.can_check():
                return False  # without the master key DGXMM cannot see what LiteLLM serves
            try:
                await backend.wait_until_loaded(timeout_s)
            except SyncFailed as exc:
                log.warning("gateway_key_load_unconfirmed", error=str(exc))
                return False
        return True

    async def sync_now(self) -> dict[str, Any]:
        """Sync at once (the UI's "Sync now"); returns the status."""
        with contextlib.suppress(SyncFailed):
            await self._sync(force=True)
        return self.status()

    async def configure(self, changes: dict[str, Any], actor: str) -> dict[str, Any]:
        """Change the integration's settings (never the key itself), then sync."""
        checked: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in _SETTING_KEYS:
                raise ValueError(f"{key}: not a LiteLLM setting")
            if key == "enabled" and not isinstance(value, bool):
                raise ValueError("enabled: true or false")
            if key == "backend" and value not in ("api", "file"):
                raise ValueError('backend: "api" or "file"')
            if key in ("url", "config_path", "master_key_env") and (
                not isinstance(value, str) or not value.strip()
            ):
                raise ValueError(f"{key}: a non-empty string")
            checked[key] = value
        if checked:
            await self._store.append(
                m.STREAM_LITELLM,
                [m.SettingsChanged(changes={f"litellm.{k}": v for k, v in checked.items()})],
                actor=actor,
            )
            self._settings.update(checked)
            if self._backend is not None:
                await self._backend.close()
            self._backend = self._build_backend()
            self._last_synced = None
            if not self._settings["enabled"]:
                self._last_ok, self._last_error = None, None
        return await self.sync_now()
