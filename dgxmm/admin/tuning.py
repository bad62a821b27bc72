"""The Settings page's recommendation: `dgxmm tune` over the last 24 hours, run apart.

Thirty what-ifs take seconds to minutes of CPU: run in the API's event loop they would stall
the gateway it shares.  So `TuneRunner` runs `dgxmm tune --json` as a child process on the
log (read-only, beside the writer), one at a time, bounded by a deadline, and keeps the
last answer for a few minutes; a second caller while one runs waits for the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

import msgspec

WINDOW_S = 24 * 3600.0
DEADLINE_S = 15 * 60.0
KEEP_S = 300.0


class TuneFailed(Exception):
    """The tune could not answer (no trace in the window, or it failed)."""


class TuneRunner:
    """Runs and caches the last 24 h's tune."""

    def __init__(self, db_path: str, *, wall: Any = time.time) -> None:
        self.db_path = db_path
        self._wall = wall
        self._running: asyncio.Task[dict[str, Any]] | None = None
        self._last: tuple[float, dict[str, Any]] | None = None

    async def result(self, goal: str, *, fresh: bool = False) -> dict[str, Any]:
        """The recommendation for `goal` (cached for a few minutes unless `fresh`)."""
        now = self._wall()
        if not fresh and self._last is not None:
            at, value = self._last
            if now - at < KEEP_S and value.get("goal_text") == goal:
                return value
        if self._running is None or self._running.done():
            self._running = asyncio.get_running_loop().create_task(self._run(goal, now))
        value = await asyncio.shield(self._running)
        self._last = (now, value)
        return value

    async def _run(self, goal: str, now: float) -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dgxmm", "tune", "--db", self.db_path, "--json",
            "--since", str(now - WINDOW_S), "--goal", goal,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise TuneFailed(f"tune took more than {DEADLINE_S:g} s") from None
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise TuneFailed(lines[-1] if lines else f"tune exited {proc.returncode}")
        value: dict[str, Any] = msgspec.json.decode(out)
        value["goal_text"] = goal
        value["since"] = now - WINDOW_S
        value["until"] = now
        return value
