"""Engine logs for the admin API and `dgxmm logs`: the last lines, and a live follow.

- Docker: the container's log stream through aiodocker (`DockerRuntime.logs_follow`).  The
  stream ends when the container stops; the follower then waits for the deployment's next
  container (a restart makes a new one under the same name) and goes on.
- Process runtime: the engine's log file, read from where the last read ended.  A launch
  truncates the file; a file that got shorter is read again from its start.

Either way a restart shows as one `[dgxmm] ...` line and the follow goes on.  Every line
goes through a `Redactor`: the values of `engines.extra_env` (API keys, tokens) never
leave DGXMM, whatever the engine prints.  Lines are capped at `MAX_LINE_CHARS`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from actors.errors import RuntimeFailure
from actors.ports import EngineHandle

REDACTED = "[redacted]"
MIN_SECRET_CHARS = 4  # shorter values ("1", "on") would blank out ordinary text
MAX_LINE_CHARS = 8192
MAX_TAIL_LINES = 10_000
RESTARTED = "[dgxmm] the engine was restarted; following its new log"
WAITING = "[dgxmm] the engine is not running; waiting for it to start"
_READ_BYTES = 256 * 1024


class Redactor:
    """Replaces secret values in log lines with `[redacted]`."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first, so a secret that contains another is replaced whole.
        self.secrets = sorted(
            {s for s in secrets if len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True
        )

    def __call__(self, line: str) -> str:
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + " [dgxmm: line cut]"
        for secret in self.secrets:
            if secret in line:
                line = line.replace(secret, REDACTED)
        return line


def split_lines(pending: str, piece: str) -> tuple[list[str], str]:
    """Whole lines of `pending + piece`, and the unfinished rest (pure)."""
    text = pending + piece
    if "\n" not in text:
        if len(text) > MAX_LINE_CHARS:  # an endless line still comes out, in parts
            return [text], ""
        return [], text
    *lines, rest = text.split("\n")
    return [line.rstrip("\r") for line in lines], rest


class _FileLogs(Protocol):
    def log_path(self, deployment_id: str) -> Path: ...

    async def logs_tail(self, handle: EngineHandle, lines: int = 20) -> str: ...


class _StreamLogs(Protocol):
    def logs_follow(self, deployment_id: str, lines: int) -> AsyncIterator[str]: ...

    async def logs_tail(self, handle: EngineHandle, lines: int = 20) -> str: ...


class EngineLogs:
    """Reads the logs of deployments' engines, whichever runtime runs them."""

    def __init__(
        self,
        runtime: Any,
        redactor: Redactor,
        *,
        handle_of: Callable[[str], EngineHandle | None],
        poll_s: float = 0.25,
    ) -> None:
        self.runtime = runtime
        self.redact = redactor
        self.handle_of = handle_of
        self.poll_s = poll_s

    def _handle(self, deployment_id: str) -> EngineHandle:
        handle = self.handle_of(deployment_id)
        if handle is not None:
            return handle
        # Not running: the process runtime's file and a stopped container keep their logs.
        from dgxmm.engines.runtimes.docker import container_name

        runtime_id = "" if hasattr(self.runtime, "log_path") else container_name(deployment_id)
        return EngineHandle(deployment_id=deployment_id, host="", port=0, runtime_id=runtime_id)

    async def tail(self, deployment_id: str, lines: int) -> list[str]:
        """The last `lines` lines (fewer when the engine wrote fewer; none if it never ran)."""
        text = await self.runtime.logs_tail(self._handle(deployment_id), min(lines, MAX_TAIL_LINES))
        return [self.redact(line) for line in text.splitlines()]

    async def last_line(self, deployment_id: str) -> str | None:
        """The engine's last non-empty line, or None; never raises."""
        try:
            found = await self.tail(deployment_id, 5)
        except RuntimeFailure:
            return None
        found = [line for line in found if line.strip()]
        return found[-1] if found else None

    def follow(self, deployment_id: str, lines: int) -> AsyncIterator[str]:
        """The last `lines` lines, then every new one, across restarts, until cancelled."""
        lines = max(0, min(lines, MAX_TAIL_LINES))
        if hasattr(self.runtime, "log_path"):
            return self._follow_file(self.runtime, deployment_id, lines)
        return self._follow_stream(self.runtime, deployment_id, lines)

    async def _follow_file(
        self, runtime: _FileLogs, deployment_id: str, lines: int
    ) -> AsyncIterator[str]:
        path = runtime.log_path(deployment_id)
        seen = self._runtime_id(deployment_id)
        offset = await asyncio.to_thread(_size, path)
        for line in await self.tail(deployment_id, lines) if lines else []:
            yield line
        pending = ""
        restart_seen = False  # the file shrank before the new engine's handle was known
        while True:
            current = self._runtime_id(deployment_id)
            if current is not None and current != seen:
                # A relaunch truncates the file; a quick engine may have written more than
                # we had read before we look, so the new process is the surer sign.
                seen = current
                if not restart_seen:
                    offset, pending = 0, ""
                    yield RESTARTED
                restart_seen = False
            data, offset, truncated = await asyncio.to_thread(_read_from, path, offset)
            if truncated:
                pending, restart_seen = "", True
                yield RESTARTED
            if data:
                found, pending = split_lines(pending, data.decode("utf-8", errors="replace"))
                for line in found:
                    yield self.redact(line)
                continue
            await asyncio.sleep(self.poll_s)  # a file has no push; a quiet engine costs a stat

    def _runtime_id(self, deployment_id: str) -> str | None:
        handle = self.handle_of(deployment_id)
        return handle.runtime_id if handle is not None else None

    async def _follow_stream(
        self, runtime: _StreamLogs, deployment_id: str, lines: int
    ) -> AsyncIterator[str]:
        followed: str | None = None  # the container whose stream was read last
        said_waiting = False
        while True:
            handle = self.handle_of(deployment_id)
            current = handle.runtime_id if handle is not None else None
            if current is None or current == followed:
                # Not running, or this container's stream already ended (it is stopping):
                # look again shortly for the next one.
                if current is None and not said_waiting:
                    said_waiting = True
                    yield WAITING
                await asyncio.sleep(self.poll_s)
                continue
            if followed is not None:
                yield RESTARTED
                lines = MAX_TAIL_LINES  # a new container: all it wrote so far
            followed, said_waiting = current, False
            pending = ""
            try:
                async for piece in runtime.logs_follow(deployment_id, lines):
                    found, pending = split_lines(pending, piece)
                    for line in found:
                        yield self.redact(line)
            except RuntimeFailure:
                pass  # policy: the container went away under us; the loop looks for the next
            if pending:
                yield self.redact(pending)


def launch_lines(runtime: Any, poll_s: float = 0.1) -> Callable[[EngineHandle], AsyncIterator[str]]:
    """What an engine writes from its launch on, unredacted (start milestones are parsed
    from it and never stored): the process runtime's file from its start, polled every
    `poll_s`; a container's log stream from its first line.  Ends when cancelled."""

    async def from_file(handle: EngineHandle) -> AsyncIterator[str]:
        path = runtime.log_path(handle.deployment_id)
        offset, pending = 0, ""
        while True:
            data, offset, _ = await asyncio.to_thread(_read_from, path, offset)
            if not data:
                await asyncio.sleep(poll_s)  # a file has no push
                continue
            found, pending = split_lines(pending, data.decode("utf-8", errors="replace"))
            for line in found:
                yield line

    async def from_stream(handle: EngineHandle) -> AsyncIterator[str]:
        pending = ""
        async for piece in runtime.logs_follow(handle.deployment_id, MAX_TAIL_LINES):
            found, pending = split_lines(pending, piece)
            for line in found:
                yield line

    return from_file if hasattr(runtime, "log_path") else from_stream


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> tuple[bytes, int, bool]:
    """What the file has after `offset` (at most _READ_BYTES), the new offset, and whether
    the file was truncated (a relaunch) so that reading started again at 0."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            truncated = size < offset
            if truncated:
                offset = 0
            if size == offset:
                return b"", offset, truncated
            f.seek(offset)
            data = f.read(_READ_BYTES)
    except FileNotFoundError:
        return b"", 0, offset > 0
    except OSError as exc:
        raise RuntimeFailure(f"cannot read engine log {path}: {exc.strerror}") from exc
    if data.startswith(b"\0"):  # a trimmed (hole-punched) head: skip the zeros
        stripped = data.lstrip(b"\0")
        offset += len(data) - len(stripped)
        data = stripped
    return data, offset + len(data), truncated
