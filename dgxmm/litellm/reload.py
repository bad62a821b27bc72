"""Reloading LiteLLM after a write of its config file (the file back-end's reload path).

Two modes.  `watch` (no command configured): LiteLLM runs with `--reload`, whose file watcher
restarts its worker on every change; nothing is run, the new list is served 7-42 s later and
LiteLLM is unreachable meanwhile.  `command`: the operator's `reload_command` (for example
`systemctl reload litellm`, or `kill -HUP <gunicorn master>`) tells a gunicorn-managed LiteLLM
to start new workers on the new file while the old ones finish (see `docs/litellm.md`).

`CommandReloader` owns the command's runs:
- **Coalesced.** A write asks for a reload and returns at once.  Writes that arrive while a
  reload runs are covered by the next one (each reload makes LiteLLM read the whole file).
- **Serialised.** A reload is done when LiteLLM serves the list that was in the file when the
  command ran (polled with the master key); only then may the next one start, so a reload never
  starts while the previous one's workers are still booting.
- **Bounded.** The command gets `timeout_s` (then its process group is killed), and LiteLLM gets
  `timeout_s` after it to serve the new list.  A failure is retried after a backoff (1 s,
  doubling up to 60 s); before a retry DGXMM looks whether LiteLLM already serves the list (it
  may have been restarted another way) and then runs nothing.  Writes never wait for any of this.
- **Measured.** Each reload's time runs from the first write it covers to LiteLLM serving it;
  the status (`ReloadStatus`) is on the Settings page and in `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import msgspec
import structlog

from actors.runtime import Clock

log = structlog.get_logger("dgxmm.litellm.sync")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
POLL_S = 0.25  # how often LiteLLM is asked whether it serves the new list yet
# The new list must be seen on every look for this long before the next reload may start: the
# workers of one reload finish booting one by one (within a second or so here), and a booting
# worker takes no connection, so one look cannot tell that all of them have booted.
SETTLE_S = 1.5
RECENT = 10  # reloads kept in the status


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` and wait until it has ended (its own failure is not ours to raise)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


class ReloadFailed(Exception):
    """The reload command failed or hung, or LiteLLM did not serve the new list in time."""


class ReloadRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished reload."""

    at: float  # wall-clock seconds: when LiteLLM was seen serving the new list
    duration_s: float  # from the first write it covered to LiteLLM serving it
    attempts: int  # command runs it took (1 unless one failed)


class ReloadStatus(msgspec.Struct, frozen=True, kw_only=True):
    """How LiteLLM is reloaded after a write, and how the reloads went."""

    mode: Literal["command", "watch"] = "watch"
    reloads: int = 0  # reloads done (LiteLLM served the new list) since DGXMM started
    failures: int = 0  # command runs that failed, hung or were not followed by the new list
    pending: bool = False  # a write is waiting for its reload (or the reload is running)
    last_duration_s: float | None = None
    durations_sum_s: float = 0.0  # of every reload done: /metrics' _sum, with `reloads`
    failing: bool = False  # the last run failed and no reload has succeeded since
    last_error: str | None = None  # the last failure (kept after a later success)
    last_error_at: float | None = None
    recent: tuple[ReloadRecord, ...] = ()  # newest last


async def run_shell(command: str, timeout_s: float) -> None:
    """Run `command` with /bin/sh; raises ReloadFailed when it fails or outlives `timeout_s`."""
    spawning = asyncio.ensure_future(
        asyncio.create_subprocess_shell(
            command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group: a hung command is killed whole
        )
    )
    try:
        # Shielded: the command may already run before its pipes are connected, and a stop
        # that arrives then must still find it to kill it.
        process = await asyncio.shield(spawning)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            spawned = await asyncio.wait_for(spawning, 5.0)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(spawned.pid, signal.SIGKILL)
            await asyncio.wait_for(spawned.wait(), 5.0)
        raise
    try:
        async with asyncio.timeout(timeout_s):
            output, _ = await process.communicate()
    except asyncio.CancelledError:  # DGXMM stops: the command does not outlive it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(process.wait(), 5.0)  # reaped: no zombie, no stray pipe
        raise
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await process.wait()
        raise ReloadFailed(
            f"the reload command did not finish within {timeout_s:g} s (killed): {command}"
        ) from None
    if process.returncode != 0:
        said = output.decode(errors="replace").strip().splitlines()[-3:]
        raise ReloadFailed(
            f"the reload command exited with {process.returncode}: {command}"
            + (f" ({' / '.join(said)})" if said else "")
        )


class CommandReloader:
    """Runs the reload command after writes: coalesced, serialised, bounded, retried."""

    def __init__(
        self,
        command: str,
        *,
        timeout_s: float,
        serves: Callable[[Sequence[Any]], Awaitable[bool]],
        clock: Clock,
        run: Callable[[str, float], Awaitable[None]] = run_shell,
        backoff_first_s: float = BACKOFF_FIRST_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        poll_s: float = POLL_S,
        settle_s: float = SETTLE_S,
    ) -> None:
        self.command = command
        self._timeout_s = timeout_s
        self._serves = serves  # does LiteLLM serve one of these written lists? (one look)
        self._clock = clock
        self._run = run
        self._backoff_first_s = backoff_first_s
        self._backoff_max_s = backoff_max_s
        self._poll_s = poll_s
        self._settle_s = settle_s
        self._status = ReloadStatus(mode="command")
        self._latest: Any = None  # the list last written
        self._since: float | None = None  # wall time of the first write not yet served
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.requested = False  # a reload was asked for since DGXMM started

    def status(self) -> ReloadStatus:
        """Reloads so far, the last one's time, and the last failure."""
        return self._status

    def request(self, written: Any) -> None:
        """A write of `written` (this box's entries) happened: reload soon; never waits.

        The command runs only if LiteLLM does not serve `written` already (so a file written
        before DGXMM started costs a look, and a reload only if one was lost).
        """
        self.requested = True
        self._latest = written
        if self._since is None:
            self._since = self._clock.wall()
        self._status = msgspec.structs.replace(self._status, pending=True)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="litellm-reload")

    async def close(self) -> None:
        """Stop reloading (a command running now is killed)."""
        task, self._task = self._task, None
        await stop_task(task)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._reload()

    async def _reload(self) -> None:
        """Reload until LiteLLM serves the latest write, retrying with backoff."""
        delay = self._backoff_first_s
        attempts = 0
        since: float | None = None  # the first write this reload covers
        must_run = False  # a write came while the last run's workers booted: run again
        served_at = self._clock.wall()  # when LiteLLM was first seen serving the list
        while True:
            target = self._latest
            self._wake.clear()  # this run covers every write so far
            since = since if since is not None else self._since
            self._since = None
            try:
                served_at = self._clock.wall()
                if not must_run and await self._serves([target]):
                    # Served already: read by workers that booted after the write, LiteLLM
                    # restarted another way, or a write that left this box's entries as they
                    # were (a file written before DGXMM started, say).  Nothing to run.
                    if not attempts:
                        self._status = msgspec.structs.replace(self._status, pending=False)
                        if self._latest is target:
                            self._wake.clear()
                            return
                        continue
                else:
                    attempts += 1
                    await self._run(self.command, self._timeout_s)
                    served_at = await self._until_served(target)
                    # Workers boot one by one: with a write in between, some may have read the
                    # older file and others the newer one.  One more reload makes them agree.
                    must_run = self._latest is not target
            except ReloadFailed as exc:
                self._failed(str(exc))
                await self._clock.sleep(delay)
                delay = min(delay * 2, self._backoff_max_s)
                continue
            self._done(since, attempts, served_at, pending=self._latest is not target)
            if self._latest is target:
                self._wake.clear()
                return
            delay, attempts, since = self._backoff_first_s, 0, None  # a newer write: again now

    async def _until_served(self, target: Any) -> float:
        """Wait until LiteLLM serves `target` or a later write (its new workers may have read a
        file written after the command ran), seen on every look for `settle_s` (workers finish
        booting one by one); returns the wall time it was first seen served."""
        deadline = self._clock.now() + self._timeout_s
        first_seen: tuple[float, float] | None = None  # (monotonic, wall)
        while True:
            served = await self._serves([target, self._latest])
            now = self._clock.now()
            if not served:
                first_seen = None
            elif first_seen is None:
                first_seen = (now, self._clock.wall())
            if first_seen is not None and now - first_seen[0] >= self._settle_s:
                return first_seen[1]
            if now >= deadline:
                raise ReloadFailed(
                    f"LiteLLM did not serve the new model list within {self._timeout_s:g} s "
                    f"of the reload command ({self.command})"
                )
            await self._clock.sleep(self._poll_s)

    def _failed(self, error: str) -> None:
        log.warning("litellm_reload_failed", error=error)
        self._status = msgspec.structs.replace(
            self._status,
            failures=self._status.failures + 1,
            failing=True,
            last_error=error,
            last_error_at=self._clock.wall(),
        )

    def _done(self, since: float | None, attempts: int, at: float, *, pending: bool) -> None:
        self._status = served(self._status, at, at if since is None else since, attempts)
        self._status = msgspec.structs.replace(self._status, pending=pending)


def served(status: ReloadStatus, now: float, since: float, attempts: int) -> ReloadStatus:
    """`status` with one more reload done: LiteLLM served at `now` what was written at `since`."""
    record = ReloadRecord(at=now, duration_s=round(max(0.0, now - since), 3), attempts=attempts)
    log.info("litellm_reloaded", mode=status.mode, after_s=record.duration_s, attempts=attempts)
    return msgspec.structs.replace(
        status,
        reloads=status.reloads + 1,
        pending=False,
        last_duration_s=record.duration_s,
        durations_sum_s=status.durations_sum_s + record.duration_s,
        failing=False,
        recent=(*status.recent, record)[-RECENT:],
    )
