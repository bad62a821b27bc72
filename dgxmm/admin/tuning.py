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


# What `dgxmm tune --json` prints (`simulations.tune.Tuning`, which this room may not import;
# tests/test_api_docs.py holds the two to the same fields), and what the route adds.


class TuneGoal(msgspec.Struct, frozen=True, kw_only=True):
    """A bound on a wait percentile, and what to make least under it."""

    bound: str
    limit_s: float
    minimise: str


class TunePoint(msgspec.Struct, kw_only=True):
    """One grid point (its settings) and its simulated figures."""

    settings: dict[str, Any]
    label: str
    p50: float
    p90: float
    p99: float
    cold_starts: int
    cold_starts_per_hour: float
    evictions: int
    idle_gib_hours: float
    queue_timeouts: int
    meets: bool
    pareto: bool


class Tuned(msgspec.Struct, kw_only=True):
    """`POST /settings/tune`: every point of the grid, the recommended one (None: no point
    meets the goal), for `goal_text` over `since` to `until` (epoch seconds)."""

    goal: TuneGoal
    points: list[TunePoint]
    recommended: TunePoint | None
    goal_text: str
    since: float
    until: float


class TuneRunner:
    """Runs and caches the last 24 h's tune."""

    def __init__(self, db_path: str, *, wall: Any = time.time) -> None:
        self.db_path = db_path
        self._wall = wall
        self._running: asyncio.Task[Tuned] | None = None
        self._last: tuple[float, Tuned] | None = None

    async def result(self, goal: str, *, fresh: bool = False) -> Tuned:
        """The recommendation for `goal` (cached for a few minutes unless `fresh`)."""
        now = self._wall()
        if not fresh and self._last is not None:
            at, value = self._last
            if now - at < KEEP_S and value.goal_text == goal:
                return value
        if self._running is None or self._running.done():
            self._running = asyncio.get_running_loop().create_task(self._run(goal, now))
        value = await asyncio.shield(self._running)
        self._last = (now, value)
        return value

    async def _run(self, goal: str, now: float) -> Tuned:
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
        extra = {"goal_text": goal, "since": now - WINDOW_S, "until": now}
        try:
            return msgspec.convert({**msgspec.json.decode(out), **extra}, Tuned)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
            raise TuneFailed(f"tune answered what the API does not know: {exc}") from None
