"""The Settings page's recommendation: `dgxmm tune` over the last 24 hours, run apart.

Applying it (`POST /settings/tune/apply`) and checking it afterwards ("since applied":
`measure_since`, `dgxmm whatif --recorded-only` on the traffic since) live here too.

About 25 what-ifs take seconds to minutes of CPU: run in the API's event loop they would stall
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

from actors.controller import validate_settings
from actors.deployment import Refusal
from events import model as m

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


class TuneFates(msgspec.Struct, kw_only=True):
    """How many requests were served, refused, timed out in the queue, stopped."""

    served: int
    refused: int
    timed_out: int
    stopped: int


class TuneFigures(msgspec.Struct, kw_only=True):
    """A column's figures, one unit each: waits in seconds, counts per hour of traffic."""

    hours: float
    requests: int
    p50: float
    p90: float
    p99: float
    worst_model: str
    worst_p90: float
    cold_starts_per_hour: float
    evictions_per_hour: float
    idle_gib_hours_per_hour: float
    fates: TuneFates
    fates_per_model: dict[str, TuneFates] = {}
    fails_served: int
    fails_served_models: list[str]


class TunePoint(msgspec.Struct, kw_only=True):
    """One point of the search (its settings, by id and as the operator writes them), its
    simulated figures (None: not simulated, it cannot be safe), and whether it is safe."""

    settings: dict[str, Any]
    changes: list[str]
    label: str
    stage: str
    figures: TuneFigures | None
    feasible: bool
    infeasible: str
    meets: bool
    pareto: bool


class Tuned(msgspec.Struct, kw_only=True):
    """`POST /settings/tune`: every point of the search, the recommended one (None: no
    safe point meets the goal), the settings as they are (`baseline`), for `goal_text` over
    `since` to `until` (epoch seconds)."""

    goal: TuneGoal
    points: list[TunePoint]
    recommended: TunePoint | None
    baseline: TunePoint
    hours: float
    requests: int
    searched: str
    goal_text: str
    since: float
    until: float


class ApplyBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /settings/tune/apply`: the recommendation's settings and its prediction."""

    settings: dict[str, Any]
    changes: list[str] = []
    label: str = ""
    goal: str = ""
    prediction: TuneFigures
    baseline: TuneFigures | None = None


class TuneApplication(msgspec.Struct, kw_only=True):
    """`GET /settings/tune/applied`: the last application of a recommendation (None: none),
    whether it was undone, and what happened since: measured as the recorded column is
    (`since`: None when no traced request came yet, `since_error` says so)."""

    seq: int
    at: float
    by: str
    settings: dict[str, Any]
    changes: list[str]
    previous: dict[str, Any]
    label: str
    goal: str
    prediction: TuneFigures
    baseline: TuneFigures | None
    undone_at: float | None = None
    undone_by: str | None = None
    since: TuneFigures | None = None
    since_error: str | None = None


class Applied(msgspec.Struct, kw_only=True):
    """The answer of the application's routes."""

    applied: TuneApplication | None


async def _dgxmm(args: list[str], doing: str) -> tuple[int, bytes, bytes]:
    """`dgxmm ARGS` run apart, within `DEADLINE_S`: its exit code, stdout and stderr;
    TuneFailed ("DOING took more than ...") when it does not end in time."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dgxmm", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise TuneFailed(f"{doing} took more than {DEADLINE_S:g} s") from None
    return proc.returncode or 0, out, err


def _last_line(err: bytes) -> str | None:
    lines = err.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else None


async def measure_since(db_path: str, since: float) -> TuneFigures:
    """What really happened since `since`: `dgxmm whatif --recorded-only` run apart, the
    code that measures the recorded column; TuneFailed when it cannot answer."""
    code, out, err = await _dgxmm(
        ["whatif", "--db", db_path, "--json", "--recorded-only", "--since", str(since)],
        "measuring",
    )
    if code != 0:
        line = _last_line(err)
        raise TuneFailed(line.removeprefix("dgxmm: ") if line else "it failed")
    try:
        return msgspec.convert(msgspec.json.decode(out)["figures"][0], TuneFigures)
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError, IndexError) as exc:
        raise TuneFailed(f"whatif answered what the API does not know: {exc}") from None


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
        args = ["tune", "--db", self.db_path, "--json", "--since", str(now - WINDOW_S)]
        code, out, err = await _dgxmm([*args, "--goal", goal], "tune")
        if code != 0:
            raise TuneFailed(_last_line(err) or f"tune exited {code}")
        extra = {"goal_text": goal, "since": now - WINDOW_S, "until": now}
        try:
            return msgspec.convert({**msgspec.json.decode(out), **extra}, Tuned)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
            raise TuneFailed(f"tune answered what the API does not know: {exc}") from None


DEPLOYMENT_KEYS = ("mode", "idle_timeout_s", "make_room_after_s")


class TuneApplier:
    """Applies a recommendation through the controller's own calls (those of `PATCH
    /settings` and `PATCH /deployments/{id}/mode`), records it as one `TuneApplied`, and
    undoes the last one in one step (`TuneUndone`)."""

    def __init__(self, controller: Any, store: Any) -> None:
        self.controller = controller
        self.store = store

    async def apply(self, body: ApplyBody, actor: str) -> int:
        """Change the settings; the audited event's seq."""
        glob, per = _split(body.settings)
        actors = self.controller.actors
        for dep, subs in per.items():
            if dep not in actors:
                raise Refusal(404, "not_found", f"no deployment {dep}")
            bad = sorted(set(subs) - set(DEPLOYMENT_KEYS))
            if bad:
                raise Refusal(422, "invalid_setting", f"{dep}.{bad[0]}: not a deployment setting")
        validate_settings(glob)
        current = self.controller.settings()
        previous: dict[str, Any] = {k: current.get(k) for k in glob}
        for dep in per:
            state = actors[dep].state
            for key in DEPLOYMENT_KEYS:
                previous[f"{dep}.{key}"] = getattr(state, key)
        await self._set(glob, per, actor)
        event = m.TuneApplied(
            settings=dict(body.settings), changes=list(body.changes), previous=previous,
            label=body.label, goal=body.goal, prediction=msgspec.to_builtins(body.prediction),
            baseline=msgspec.to_builtins(body.baseline) if body.baseline is not None else {},
        )  # fmt: skip
        recs = await self.store.append(m.STREAM_SETTINGS, [event], actor=actor)
        return int(recs[0].seq)

    async def undo(self, actor: str) -> int:
        """Put back what the last application changed; the audited event's seq."""
        last, undone = await self._last()
        if last is None or undone is not None:
            raise Refusal(409, "nothing_to_undo", "no applied recommendation to undo")
        assert isinstance(last.event, m.TuneApplied)
        restored = dict(last.event.previous)
        glob, per = _split(restored)
        per = {d: s for d, s in per.items() if d in self.controller.actors}
        await self._set(glob, per, actor)
        event = m.TuneUndone(applied_seq=last.seq, restored=restored)
        recs = await self.store.append(m.STREAM_SETTINGS, [event], actor=actor)
        return int(recs[0].seq)

    async def applied(self) -> TuneApplication | None:
        """The last application, and its undo if any (without what happened since)."""
        last, undone = await self._last()
        if last is None:
            return None
        ev = last.event
        assert isinstance(ev, m.TuneApplied)
        return TuneApplication(
            seq=last.seq, at=last.ts, by=last.actor, settings=dict(ev.settings),
            changes=list(ev.changes), previous=dict(ev.previous), label=ev.label, goal=ev.goal,
            prediction=msgspec.convert(ev.prediction, TuneFigures),
            baseline=msgspec.convert(ev.baseline, TuneFigures) if ev.baseline else None,
            undone_at=undone.ts if undone is not None else None,
            undone_by=undone.actor if undone is not None else None,
        )  # fmt: skip

    async def _last(self) -> tuple[m.Recorded | None, m.Recorded | None]:
        recs = await self.store.read(stream=m.STREAM_SETTINGS, types=("TuneApplied", "TuneUndone"))
        applied = [r for r in recs if isinstance(r.event, m.TuneApplied)]
        if not applied:
            return None, None
        last = applied[-1]
        undone = next(
            (
                r
                for r in recs
                if isinstance(r.event, m.TuneUndone) and r.event.applied_seq == last.seq
            ),
            None,
        )
        return last, undone

    async def _set(self, glob: dict[str, Any], per: dict[str, dict[str, Any]], actor: str) -> None:
        if glob:
            await self.controller.change_settings(glob, actor)
        for dep, subs in per.items():
            state = self.controller.actors[dep].state
            await self.controller.change_mode(
                dep,
                subs.get("mode", state.mode),
                subs.get("idle_timeout_s", state.idle_timeout_s),
                False,
                actor,
                make_room_after_s=subs.get("make_room_after_s", state.make_room_after_s),
            )


def _split(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Global settings, and each deployment's own (`id.key`)."""
    glob: dict[str, Any] = {}
    per: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        dep, dot, sub = key.rpartition(".")
        if dot:
            per.setdefault(dep, {})[sub] = value
        else:
            glob[key] = value
    return glob, per
