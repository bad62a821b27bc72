"""The file back-end: LiteLLM's config file, for a LiteLLM run with `--config FILE --reload`.

Every change of that file restarts LiteLLM's worker (uvicorn's reloader: requests in flight get
30 s, new connections wait, one accepted but unread is reset), so the file is written only when
the desired model list really changes, and the bridge asks for stable entries (see
`entries.desired_entries`), which no state change or mode switch alters.

A sync writes at once, whether LiteLLM is serving or not, and returns: LiteLLM started after
DGXMM reads the file as it is, and a LiteLLM that is down never delays a write.  Whether
LiteLLM loaded what was written is checked in the background (`GET /model/info`, polled with a
growing interval) and shown as a status (`load_status`), never waited for.  Each write is
counted: it is a LiteLLM restart DGXMM caused.

With a reload command configured (`use_reload_command`), each write is followed by that command
instead of relying on `--reload`'s file watcher: `dgxmm.litellm.reload` owns those runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import structlog

from actors.errors import SyncFailed
from actors.ports import ModelEntry
from actors.runtime import Clock
from dgxmm.litellm.backend import Backend, Unreachable
from dgxmm.litellm.entries import differs, id_of, id_prefix, owned_entries, rendered_entries
from dgxmm.litellm.reload import CommandReloader, ReloadStatus, served, stop_task

log = structlog.get_logger("dgxmm.litellm.sync")

CHECK_FIRST_S = 0.5  # the pause after the first look (at once); a reload takes 7-42 s
CHECK_MAX_S = 5.0  # the check backs off to this; LiteLLM started later is seen within it

DEFAULT_CONFIG: dict[str, Any] = {
    "model_list": [],
    "general_settings": {"disable_model_info_refresh": True},
}


def config_document(
    document: Mapping[str, Any], want: Mapping[str, Mapping[str, Any]], box_id: str
) -> dict[str, Any]:
    """The config file with this box's entries replaced by `want`: what `ConfigFileSync` writes.

    Entries other than this box's are kept as they are (and first), as is every non-model
    setting; `general_settings.disable_model_info_refresh` defaults to true.  Any change is this
    one document (each LiteLLM worker reads the whole file, so no worker ever serves a list
    between two writes).
    """
    items = [i for i in document.get("model_list") or [] if isinstance(i, dict)]
    prefix = id_prefix(box_id)
    foreign = [i for i in items if not (id_of(i) or "").startswith(prefix)]
    base = {k: v for k, v in document.items() if k != "model_list"}
    settings = dict(base.get("general_settings") or {})
    settings.setdefault("disable_model_info_refresh", True)
    base["general_settings"] = settings
    return {**base, "model_list": foreign + [dict(d) for d in want.values()]}


def load_verdict(
    want: Mapping[str, Mapping[str, Any]], live: Mapping[str, Mapping[str, Any]]
) -> str | None:
    """None when LiteLLM serves exactly `want` (this box's entries), else what differs."""
    missing = sorted(i for i, w in want.items() if i not in live or differs(w, live[i]))
    extra = sorted(i for i in live if i not in want)
    if not missing and not extra:
        return None
    parts = ([f"missing or older: {', '.join(missing)}"] if missing else []) + (
        [f"not in the file: {', '.join(extra)}"] if extra else []
    )
    return "LiteLLM serves another model list (" + "; ".join(parts) + ")"


class LoadStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What DGXMM wrote and whether LiteLLM serves it, for the Settings page and /metrics."""

    config_writes: int = 0  # writes since DGXMM started: each restarts LiteLLM's worker
    last_write_at: float | None = None  # wall-clock seconds
    loaded: bool | None = None  # None: not known (not checked yet, or no master key)
    loaded_at: float | None = None  # when LiteLLM was last seen serving what was written
    load_error: str | None = None  # why it is not (known to be) loaded


class ConfigFileSync(Backend):
    """Keeps the model list in LiteLLM's config file equal to DGXMM's (LiteLLM runs --reload)."""

    kind = "file"

    def __init__(
        self,
        path: str | os.PathLike[str],
        url: str,
        master_key: str | None,
        *,
        box_id: str = "",
        master_key_env: str = "LITELLM_MASTER_KEY",
        clock: Callable[[], float] = time.time,
        check_first_s: float = CHECK_FIRST_S,
        check_max_s: float = CHECK_MAX_S,
        gateway_key: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(
            url,
            master_key,
            box_id=box_id,
            master_key_env=master_key_env,
            clock=clock,
            gateway_key=gateway_key,
        )
        self.path = Path(path)
        self._clock = clock
        self._check_first_s = check_first_s
        self._check_max_s = check_max_s
        self._load = LoadStatus()
        self._want: dict[str, dict[str, Any]] | None = None  # this box's entries in the file
        self._check: asyncio.Task[None] | None = None
        self._loaded_event = asyncio.Event()
        self._reloader: CommandReloader | None = None
        self._watch_reloads = ReloadStatus(mode="watch")  # --reload: writes LiteLLM was seen load

    def __repr__(self) -> str:
        return f"ConfigFileSync({str(self.path)!r}, box_id={self._box_id!r})"

    def can_check(self) -> bool:
        """Whether the background check can see what LiteLLM serves (it has the master key)."""
        return self._has_key

    def use_reload_command(self, command: str, timeout_s: float, clock: Clock) -> None:
        """Run `command` after each write (a gunicorn reload) instead of relying on --reload."""
        self._reloader = CommandReloader(
            command, timeout_s=timeout_s, serves=self._serves, clock=clock
        )

    def reload_status(self) -> ReloadStatus:
        """How LiteLLM is reloaded after a write and how the reloads went."""
        return self._reloader.status() if self._reloader is not None else self._watch_reloads

    async def _serves(self, wants: Sequence[Mapping[str, Mapping[str, Any]]]) -> bool:
        """Whether LiteLLM serves exactly one of `wants` now, in one look (True without a key:
        nothing to ask with)."""
        if not self._has_key:
            return True
        try:
            live = owned_entries(await self._client.list_entries(), self._box_id)
        except SyncFailed:  # unreachable (booting workers), a wrong key: not served yet
            return False
        return any(load_verdict(want, live) is None for want in wants)

    def load_status(self) -> LoadStatus:
        """Writes so far, the last one, and whether LiteLLM has loaded it."""
        return self._load

    async def wait_until_loaded(self, timeout_s: float) -> None:
        """Wait until the background check saw LiteLLM serve the last write; raises SyncFailed."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._loaded_event.wait()
        except TimeoutError:
            raise SyncFailed(
                f"LiteLLM did not load {self.path} within {timeout_s:.0f} s "
                f"({self._load.load_error or 'not checked yet'})"
            ) from None

    async def sync(self, entries: list[ModelEntry]) -> None:
        """Write the file now if the model list changed; check LiteLLM in the background."""
        async with self._tracker.lock:
            try:
                wrote = await self._write_if_changed(rendered_entries(entries, self._gateway_key()))
            except SyncFailed as exc:
                self._tracker.failed(self.kind, exc)
                raise
            self._tracker.succeeded(self.kind, writes=int(wrote))
            if not wrote and self._reloader is not None and not self._reloader.requested:
                # The file was already as wanted: a reload may have been lost with a DGXMM that
                # stopped between its write and the reload.  Reload if LiteLLM serves another list.
                self._reloader.request(self._want)
        self._start_check(restart=wrote)

    async def close(self) -> None:
        """Stop the background check and the reloads."""
        if self._reloader is not None:
            await self._reloader.close()
        task, self._check = self._check, None
        await stop_task(task)

    async def _write_if_changed(self, want: dict[str, dict[str, Any]]) -> bool:
        document, exists = await asyncio.to_thread(self._read)
        final = config_document(document, want, self._box_id)
        self._want = want
        if exists and final == document:
            return False
        # One write, so one worker restart, whatever changed.
        await asyncio.to_thread(self._write, final)
        self._load = msgspec.structs.replace(
            self._load,
            config_writes=self._load.config_writes + 1,
            last_write_at=self._clock(),
            loaded=False if self._has_key else None,
            load_error="written; LiteLLM has not been seen serving it yet",
        )
        self._loaded_event.clear()
        if self._reloader is not None:
            self._reloader.request(want)
        log.info(
            "litellm_config_written",
            path=str(self.path),
            entries=len(final["model_list"]),
            writes=self._load.config_writes,
        )
        return True

    # --- the background check ------------------------------------------------------------

    def _start_check(self, *, restart: bool) -> None:
        running = self._check is not None and not self._check.done()
        if running and not restart:
            return  # already watching for exactly this list
        if self._check is not None:
            self._check.cancel()
        self._check = asyncio.get_running_loop().create_task(
            self._watch(), name="litellm-load-check"
        )

    async def _watch(self) -> None:
        """Poll LiteLLM until it serves what was written (forever, with a capped interval)."""
        delay = self._check_first_s
        while True:
            if await self._look():
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._check_max_s)

    async def _look(self) -> bool:
        """One look at LiteLLM's list; True when there is nothing more to poll for."""
        want = self._want or {}
        try:
            self._require_key()
        except SyncFailed as exc:
            self._not_loaded(None, f"cannot check whether LiteLLM loaded it: {exc}")
            return True  # nothing to poll for until the key is set (a restart of DGXMM)
        try:
            live = owned_entries(await self._client.list_entries(), self._box_id)
        except Unreachable as exc:
            self._not_loaded(False, f"{exc}; LiteLLM reads the file when it starts")
            return False
        except SyncFailed as exc:  # a wrong master key, an answer that is not a model list
            self._not_loaded(False, str(exc))
            return False
        verdict = load_verdict(want, live)
        if verdict is not None:
            reloader = self._reloader
            how = "--reload" if reloader is None else f"and reloaded by {reloader.command!r}"
            self._not_loaded(False, f"{verdict}; is it running with --config {self.path} {how}?")
            return False
        if self._load.loaded is not True:
            since = self._load.last_write_at
            log.info(
                "litellm_config_loaded",
                path=str(self.path),
                after_s=None if since is None else round(self._clock() - since, 1),
            )
            if since is not None and self._reloader is None:  # --reload restarted its worker
                self._watch_reloads = served(self._watch_reloads, self._clock(), since, 1)
        self._load = msgspec.structs.replace(
            self._load, loaded=True, loaded_at=self._clock(), load_error=None
        )
        self._loaded_event.set()
        return True

    def _not_loaded(self, loaded: bool | None, error: str) -> None:
        if error != self._load.load_error:
            log.warning("litellm_config_not_loaded", path=str(self.path), reason=error)
        self._load = msgspec.structs.replace(self._load, loaded=loaded, load_error=error)
        self._loaded_event.clear()

    # --- the file ------------------------------------------------------------------------

    def _read(self) -> tuple[dict[str, Any], bool]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return copy.deepcopy(DEFAULT_CONFIG), False
        except OSError as exc:
            raise SyncFailed(f"cannot read LiteLLM config {self.path}: {exc.strerror}") from exc
        if not text.strip():
            return {}, True
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise SyncFailed(
                f"LiteLLM config {self.path} is not JSON ({exc}); DGXMM writes this file as JSON, "
                "which LiteLLM reads as YAML: convert it once, or give DGXMM a file of its own"
            ) from exc
        if not isinstance(document, dict):
            raise SyncFailed(f"LiteLLM config {self.path} is not a JSON object")
        return document, True

    def _write(self, document: Mapping[str, Any]) -> None:
        data = (json.dumps(document, indent=2) + "\n").encode()
        tmp = self.path.with_name(f".{self.path.name}.dgxmm-tmp")
        try:
            mode = self.path.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o600  # it holds the gateway key: LiteLLM's user (DGXMM's, or a group) only
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)  # LiteLLM's reloader never sees a half-written file
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise SyncFailed(f"cannot write LiteLLM config {self.path}: {exc.strerror}") from exc
