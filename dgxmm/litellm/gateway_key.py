"""The gateway key: the secret only LiteLLM holds, which the gateway requires.

DGXMM creates it at first start (`<data_dir>/gateway.key`, 0600, one line), registers it as
the `api_key` of every gateway entry in LiteLLM (both back-ends, `dgxmm.litellm.sync`), and
gives it to the gateway's door (`gateway.access.Access`).  Whoever reaches the gateway's port
without it gets 401: LiteLLM's keys, budgets and logs cannot be bypassed.

A rotation (`dgxmm gateway-key rotate`, through the admin API) never fails a request:

1. a new key is made; the gateway accepts the new and the old one;
2. the new key is written to `gateway.key`, the old one to `gateway.key.previous` with the
   moment it stops being accepted (so a restart during the overlap keeps the overlap);
3. LiteLLM's entries are re-registered with the new key; with the file back-end that rewrite
   restarts LiteLLM's worker, and DGXMM waits until LiteLLM is seen serving the new entries
   (each entry carries a fingerprint of its key, `model_info.dgxmm_key_id`, never the key);
4. after a grace (`GRACE_S`, for other LiteLLM workers and requests already on their way) the
   old key is dropped.  Should LiteLLM not confirm, the old key stays until the overlap's end
   (`[server] gateway_key_overlap_s`), then goes anyway.

The key is never logged, never in an API answer, the UI or the event log: only its
fingerprint (`key_id`, 12 hex digits of a SHA-256) is shown, so an operator can tell keys apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import structlog

from actors.errors import SyncFailed
from gateway.access import Access

log = structlog.get_logger("dgxmm.litellm.gateway_key")

KEY_FILE = "gateway.key"
PREVIOUS_FILE = "gateway.key.previous"
KEY_PREFIX = "dgxmm-gw-"  # recognisable in a leaked file or a secret scanner's report
GRACE_S = 30.0  # after LiteLLM confirmed the new key: other workers, requests on their way
DEFAULT_OVERLAP_S = 600.0


def new_key() -> str:
    """A fresh gateway key (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_id(key: str) -> str:
    """A key's fingerprint: safe to show, to log and to store in LiteLLM's `model_info`."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` 0600, atomically (a crash leaves the old file or the new)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older tmp file may have had another mode
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class Rotation(msgspec.Struct, frozen=True, kw_only=True):
    """What a rotation answers (no key in it, only fingerprints)."""

    key_id: str
    previous_key_id: str | None
    registered: bool  # LiteLLM serves the new key (or the integration is off)
    previous_until: float | None  # wall clock: the old key is refused from then at the latest
    error: str | None = None


class GatewayKeys:
    """The key file, the keys the gateway accepts, and rotation."""

    def __init__(
        self,
        data_dir: Path,
        access: Access,
        *,
        overlap_s: float = DEFAULT_OVERLAP_S,
        grace_s: float = GRACE_S,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.data_dir = data_dir
        self.access = access
        self.overlap_s = overlap_s
        self.grace_s = grace_s
        self.wall = wall
        self._key = ""
        self._previous: tuple[str, float] | None = None  # (key, refused from)
        self._lock = asyncio.Lock()
        self._retire: asyncio.Task[None] | None = None

    @property
    def path(self) -> Path:
        """`<data_dir>/gateway.key`."""
        return self.data_dir / KEY_FILE

    def current(self) -> str:
        """The key LiteLLM is given (the newest)."""
        return self._key

    def key_id(self) -> str:
        """The current key's fingerprint."""
        return key_id(self._key)

    # --- the files -------------------------------------------------------------------------

    def load(self) -> None:
        """Read the key (creating it 0600 at first start) and an overlapping old key; blocking."""
        try:
            key = self.path.read_text().strip()
        except FileNotFoundError:
            key = ""
        if not key:
            key = new_key()
            _write_private(self.path, key + "\n")
            log.info("gateway_key_created", path=str(self.path), key_id=key_id(key))
        self._key = key
        self._previous = None
        with contextlib.suppress(FileNotFoundError, ValueError):
            old, until = (self.data_dir / PREVIOUS_FILE).read_text().split()
            if float(until) > self.wall() and old != key:
                self._previous = (old, float(until))
        if self._previous is None:
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / PREVIOUS_FILE).unlink()
        self._apply()

    def _apply(self) -> None:
        keys = [self._key] if self._previous is None else [self._key, self._previous[0]]
        self.access.set_keys(keys)

    def start(self) -> None:
        """Retire an old key left overlapping by a rotation before a restart, at its time."""
        if self._previous is not None:
            until = self._previous[1]
            self._retire = asyncio.get_running_loop().create_task(
                self._retire_at(self._previous[0], until), name="gateway-key-retire"
            )

    async def close(self) -> None:
        """Stop waiting to retire an old key (it stays in its file until the next start)."""
        task, self._retire = self._retire, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- rotation --------------------------------------------------------------------------

    async def rotate(self, register: Callable[[float], Awaitable[bool]] | None) -> Rotation:
        """Make a new key, register it in LiteLLM, then retire the old one (in the background).

        `register(timeout_s)` re-registers LiteLLM's entries with `current()` and returns
        whether LiteLLM was seen serving them; it raises SyncFailed when it could not write
        them.  None: no LiteLLM integration (the old key then overlaps for the whole window).
        """
        async with self._lock:
            await self.close()  # a rotation during an overlap: the older key goes now
            old, new = self._key, new_key()
            until = self.wall() + self.overlap_s
            self._key, self._previous = new, (old, until)
            self._apply()  # both accepted before LiteLLM may send the new one
            await asyncio.to_thread(self._persist, old, new, until)
            log.info("gateway_key_rotated", key_id=key_id(new), previous_key_id=key_id(old))
            registered, error = False, None
            if register is not None:
                try:
                    registered = await register(self.overlap_s)
                except SyncFailed as exc:
                    error = str(exc)
                    log.warning("gateway_key_not_registered", error=error)
            retire_at = self.wall() + self.grace_s if registered else until
            self._retire = asyncio.get_running_loop().create_task(
                self._retire_at(old, min(retire_at, until)), name="gateway-key-retire"
            )
            return Rotation(
                key_id=key_id(new),
                previous_key_id=key_id(old),
                registered=registered or register is None,
                previous_until=min(retire_at, until),
                error=error,
            )

    def _persist(self, old: str, new: str, until: float) -> None:
        _write_private(self.data_dir / PREVIOUS_FILE, f"{old} {until}\n")
        _write_private(self.path, new + "\n")

    async def _retire_at(self, old: str, until: float) -> None:
        delay = until - self.wall()
        if delay > 0:
            await asyncio.sleep(delay)  # the I/O shell's timer; `until` was decided above
        if self._previous is None or self._previous[0] != old:
            return
        self._previous = None
        self._apply()
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread((self.data_dir / PREVIOUS_FILE).unlink)
        log.info("gateway_key_retired", key_id=key_id(old))

    def statistics(self) -> dict[str, object]:
        """Fingerprints and the overlap, for the API (never a key)."""
        previous = self._previous
        return {
            "key_id": self.key_id(),
            "previous_key_id": None if previous is None else key_id(previous[0]),
            "previous_until": None if previous is None else previous[1],
            "loopback_open": self.access.loopback_open,
        }
