"""Tune: search the settings an operator would set with the what-if, and recommend only safe ones.

The search (`tune`) runs in stages, each one `simulate` of the same recorded traffic per
point, the stage's points side by side:

1. the global `ondemand_make_room_after_s` (as now, 0, 30, 120, 300 s) against the on-demand
   models' idle timeouts (as now, 120 s or 900 s for every model): 15 points, of which those
   that make room only after the longest idle timeout in force are one simulation (12 on a
   box on the defaults);
2. on the best of those, always-on for the most used on-demand models (each set of at most
   `k` of the `TOP` most used): a set whose memory leaves another model unable to start is
   not simulated, it is shown infeasible with the reason;
3. on the best so far, each of the `TOP` most used on-demand models' own idle timeout
   (120 s, 900 s);
4. on the best so far, the learned policy of starting models ahead (`ondemand_policy`),
   where the what-if knows it;

about 22 simulations with k = 1 (12 + 3 + 6 + 1; fewer where a point repeats one already
simulated), fewer than the single grid of 30 it replaces: the bench's week (a million
requests) in 12.4 minutes on two cores (`python -m tests.perf.bench_whatif --tune`).  The
goal is a bound and an objective: "p90 wait <= 30 s with the fewest cold starts" is
`Goal(bound="p90", limit_s=30, minimise="cold_starts")`.

Safe first: a point is infeasible when it makes a model unable to start (its memory beside
the always-on models' is more than the box has) or when it refuses or times out a request
the recorded box served (`Report.fails_served`); an infeasible point is never recommended,
and says why.  The recommendation is the feasible point that meets the bound with the least
of the objective (ties: the smaller p90 wait), shown beside the settings as they are (the
first point: no change) with what it saves and what it costs.  Every figure is in one unit:
waits in seconds, counts per hour of traffic, idle memory in GiB-hours per hour.  Settings
are named as the operator writes them (`chat.mode=always_on`).  It recommends; it changes
nothing (`dgxmm tune --apply` does, through the admin API).

The points of a stage are independent: `workers` processes simulate them side by side (2 by
default, the box's other work keeps the rest).  The workers are forked after the history is
loaded, so they share it as it is in memory; handing it to fresh processes would cost more
than a point (a week's history pickles to about 100 MB in 5 s and loads in 4 s).  Where fork
is not available the points run one after the other.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgspec

from actors.memory_broker import GIB
from events import model as m
from simulations.whatif import (
    Figures,
    History,
    Report,
    WhatIfError,
    figures,
    parse_overrides,
    simulate,
)

MAKE_ROOM = (None, 0, 30, 120, 300)
IDLE = (None, 120, 900)  # None: each model's as now
OWN_IDLE = (120, 900)  # a model's own idle timeout, on the best point
TOP = 3  # the most used on-demand models the later stages try one by one
# The goal's objectives and the figure each makes least (one unit each: per hour of traffic).
OBJECTIVES = {
    "cold_starts": "cold_starts_per_hour",
    "idle_gib_hours": "idle_gib_hours_per_hour",
    "evictions": "evictions_per_hour",
    "p90": "p90",
    "p99": "p99",
}
OBJECTIVE_WORDS = {
    "cold_starts": "cold starts per hour",
    "idle_gib_hours": "idle GiB-hours per hour",
    "evictions": "evictions per hour",
    "p90": "p90 wait (s)",
    "p99": "p99 wait (s)",
}
WORKERS = 2
BOUNDS = ("p50", "p90", "p99")


class Goal(msgspec.Struct, frozen=True, kw_only=True):
    """A bound on a wait percentile, and what to make least under it."""

    bound: str = "p90"
    limit_s: float = 30.0
    minimise: str = "cold_starts"

    def describe(self) -> str:
        """The goal in words."""
        fewest = OBJECTIVE_WORDS[self.minimise]
        return f"{self.bound} wait <= {self.limit_s:g} s with the fewest {fewest}"


class Point(msgspec.Struct, kw_only=True):
    """One point of the search: its settings (by deployment id, for the API), the same as
    the operator writes them (`changes`), in words (`label`), and its simulated figures
    (None: not simulated, it cannot be safe)."""

    settings: dict[str, Any]
    changes: list[str]
    label: str
    stage: str
    figures: Figures | None = None
    feasible: bool = True
    infeasible: str = ""  # why not, in words
    meets: bool = False
    pareto: bool = False


class Tuning(msgspec.Struct, kw_only=True):
    """The search's outcome: every point, the recommended one (None: no feasible point
    meets the goal), and the settings as they are (`baseline`, the first point)."""

    goal: Goal
    points: list[Point]
    recommended: Point | None
    baseline: Point
    hours: float
    requests: int
    searched: str  # the search's size, in words


def _deployments(history: History) -> dict[str, tuple[str, int, str]]:
    """Every deployment of the window: id -> (name, memory, mode as now)."""
    out: dict[str, tuple[str, int, str]] = {
        d: (s.name, s.memory_bytes, s.mode) for d, s in history.deployments.items()
    }
    for change in history.changes:
        ev = change.event
        dep = getattr(ev, "deployment_id", None) or change.deployment_id
        if dep is None:
            continue
        name, memory, mode = out.get(dep, (history.names.get(dep, dep), 0, "on_demand"))
        out[dep] = (
            str(getattr(ev, "name", name)),
            int(getattr(ev, "memory_bytes", memory) or 0),
            str(getattr(ev, "mode", mode)),
        )
    return out


def unable_to_start(history: History, settings: dict[str, Any]) -> str:
    """Why a model could never start under `settings` ("" when each can): the always-on
    models' memory beside it is more than the box has."""
    deps = _deployments(history)
    mode = {d: settings.get(f"{d}.mode", m) for d, (_, _, m) in deps.items()}
    pinned = sum(memory for d, (_, memory, _) in deps.items() if mode[d] == "always_on")
    usable = history.usable_bytes
    if pinned > usable:
        return f"the always-on models need {_gib(pinned)} GiB of {_gib(usable)}"
    used = {r.deployment_id for r in history.traffic}
    stuck = [
        f"{name} ({_gib(memory)} GiB)"
        for d, (name, memory, _) in sorted(deps.items(), key=lambda kv: kv[1][0])
        if mode[d] == "on_demand" and d in used and memory > usable - pinned
    ]
    if not stuck:
        return ""
    return (
        f"{', '.join(stuck)} could never start: the always-on models hold {_gib(pinned)}"
        f" of {_gib(usable)} GiB"
    )


def _gib(n: int) -> str:
    return f"{n / GIB:g}"


def _value(value: Any) -> str:
    return "null" if value is None else str(value)


def _named(history: History, settings: dict[str, Any]) -> list[str]:
    """The settings as the operator writes them: `chat.idle_timeout_s=900`."""
    out = []
    for key, value in sorted(settings.items()):
        dep, dot, sub = key.rpartition(".")
        name = history.names.get(dep, dep) if dot else ""
        out.append(f"{name}.{sub}={_value(value)}" if dot else f"{key}={_value(value)}")
    return out


def _words(history: History, settings: dict[str, Any]) -> str:
    """The settings in words, for the curve and the recommendation."""
    parts = []
    room = settings.get("ondemand_make_room_after_s", "as now")
    if "ondemand_make_room_after_s" in settings:
        parts.append(f"make room after {room} s")
    per_idle: dict[Any, list[str]] = {}
    pinned, own_room = [], []
    for key, value in sorted(settings.items()):
        dep, dot, sub = key.rpartition(".")
        if not dot:
            continue
        name = history.names.get(dep, dep)
        if sub == "idle_timeout_s":
            per_idle.setdefault(value, []).append(name)
        elif sub == "mode" and value == "always_on":
            pinned.append(name)
        elif sub == "make_room_after_s":
            own_room.append(f"{name} makes room after {_value(value)} s")
    for value, names in per_idle.items():
        parts.append(f"idle timeout {value} s for {', '.join(names)}")
    if pinned:
        parts.append("always on: " + ", ".join(pinned))
    parts.extend(own_room)
    for key, value in sorted(settings.items()):
        if "." not in key and key != "ondemand_make_room_after_s":
            parts.append(f"{key}={_value(value)}")
    return "; ".join(parts) or "as now (no change)"


def _on_demand(history: History) -> list[str]:
    """The on-demand deployments of the window, most used first."""
    deps = _deployments(history)
    counts = Counter(r.deployment_id for r in history.traffic)
    found = [d for d, (_, _, mode) in deps.items() if mode == "on_demand"]
    return sorted(found, key=lambda d: (-counts[d], deps[d][0]))


def _recorded_make_room(history: History) -> set[int | None]:
    """The global make-room-after values the recorded box had in force over the window."""
    key = "ondemand_make_room_after_s"
    found = {history.settings.get(key, history.defaults.get(key))}
    for change in history.changes:
        if isinstance(change.event, m.SettingsChanged) and key in change.event.changes:
            found.add(change.event.changes[key])
    return found


def _recorded_idle(history: History) -> set[int]:
    """The idle timeouts the recorded box's models had in force over the window."""
    key = "ondemand_idle_timeout_s"
    default = {history.settings.get(key, history.defaults.get(key))}
    found: set[Any] = {s.idle_timeout_s for s in history.deployments.values()}
    for change in history.changes:
        ev = change.event
        if isinstance(ev, m.SettingsChanged) and key in ev.changes:
            default.add(ev.changes[key])
        elif isinstance(ev, m.ModeChanged | m.DeploymentCreated):
            found.add(ev.idle_timeout_s)
    return {int(v) for v in (found | default) if v is not None}


def _ever_on_demand(history: History) -> set[str]:
    """The deployments on demand at any time of the window."""
    found = {d for d, s in history.deployments.items() if s.mode == "on_demand"}
    for change in history.changes:
        ev = change.event
        if isinstance(ev, m.DeploymentCreated) and ev.mode == "on_demand":
            found.add(ev.deployment_id)
        elif isinstance(ev, m.ModeChanged) and ev.mode == "on_demand" and change.deployment_id:
            found.add(change.deployment_id)
    return found


def first_stage(history: History) -> list[dict[str, Any]]:
    """Make-room-after against the idle timeouts of every on-demand model.

    A model makes room after min(make-room-after, its idle timeout), so making room after the
    longest idle timeout in force or later is the seed's rule: those points are one
    simulation, the first of them.  ("As now", the recorded make-room-after, is one of them
    only when the recorded box never made room sooner than that.)"""
    on_demand = sorted(_on_demand(history))
    recorded, recorded_idle = _recorded_make_room(history), _recorded_idle(history)
    # ... and only when the idle timeout is every on-demand model's: none of the window is
    # on demand for a while only (its own idle timeout would meet the make-room-after).
    whole = _ever_on_demand(history) <= set(on_demand)
    out: list[dict[str, Any]] = []
    seen: set[tuple[int | str | None, int | None]] = set()
    for room, idle in itertools.product(MAKE_ROOM, IDLE):
        rooms = recorded if room is None else {room}
        longest = idle if idle is not None else max(recorded_idle, default=None)
        same = whole and longest is not None and all(r is None or r >= longest for r in rooms)
        key = ("the idle timeout" if same else room, idle)
        if key in seen:
            continue
        seen.add(key)
        over: dict[str, Any] = {}
        if room is not None:
            over["ondemand_make_room_after_s"] = room
        if idle is not None:
            for dep in on_demand:
                over[f"{dep}.idle_timeout_s"] = idle
        out.append(over)
    return out


def pinned_stage(history: History, best: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """Always-on sets of at most `k` of the most used on-demand models, on `best`."""
    top = _on_demand(history)[:TOP]
    out = []
    for size in range(1, k + 1):
        for chosen in itertools.combinations(top, size):
            over = {key: v for key, v in best.items() if key.rpartition(".")[0] not in chosen}
            for dep in chosen:
                over[f"{dep}.mode"] = "always_on"
            out.append(over)
    return out


def own_stage(history: History, best: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of the most used on-demand models' own idle timeout, on `best` (one model's
    change at a time; make-room-after is searched for all in the first stage)."""
    out = []
    for dep in _on_demand(history)[:TOP]:
        if best.get(f"{dep}.mode") == "always_on":
            continue
        for idle in OWN_IDLE:
            if best.get(f"{dep}.idle_timeout_s") != idle:
                out.append({**best, f"{dep}.idle_timeout_s": idle})
    return out


def learned_stage(history: History, best: dict[str, Any]) -> list[dict[str, Any]]:
    """The learned policy of starting models ahead, on `best`, where the what-if knows it."""
    try:
        return [{**best, **parse_overrides(history, ["ondemand_policy=learned"])}]
    except WhatIfError:
        return []


def objective(point: Point, goal: Goal) -> float:
    """The figure the goal makes least."""
    assert point.figures is not None
    return float(getattr(point.figures, OBJECTIVES[goal.minimise]))


def bounded(point: Point, goal: Goal) -> float:
    """The figure the goal bounds."""
    assert point.figures is not None
    return float(getattr(point.figures, goal.bound))


def best_of(points: list[Point], goal: Goal) -> Point | None:
    """The feasible point that meets the goal with the least objective (None: none does)."""
    meeting = [p for p in points if p.feasible and p.meets]
    return min(meeting, key=lambda p: (objective(p, goal), bounded(p, goal)), default=None)


def _nearest(points: list[Point], goal: Goal) -> Point | None:
    """The stage's base when no point meets the goal: the feasible one nearest it."""
    feasible = [p for p in points if p.feasible and p.figures is not None]
    return min(feasible, key=lambda p: (bounded(p, goal), objective(p, goal)), default=None)


async def tune(
    history: History,
    goal: Goal,
    *,
    k: int = 1,
    progress: Callable[[float], None] | None = None,
    workers: int = WORKERS,
) -> Tuning:
    """The staged search (`workers` points at a time); the recommendation and the curve."""
    points: list[Point] = []
    seen: set[str] = set()
    stages = 4
    done = [0]

    def tick(fraction: float) -> None:
        if progress is not None:
            progress((done[0] + fraction) / stages)

    async def stage(name: str, candidates: list[dict[str, Any]]) -> None:
        fresh = []
        for over in candidates:
            key = msgspec.json.encode(dict(sorted(over.items()))).decode()
            if key not in seen:
                seen.add(key)
                fresh.append(over)
        made = [
            Point(
                settings=over,
                changes=_named(history, over),
                label=_words(history, over),
                stage=name,
                infeasible=unable_to_start(history, over),
            )
            for over in fresh
        ]
        runnable = [p for p in made if not p.infeasible]
        reports = await _simulate_all(
            history, [(p.label, p.settings) for p in runnable], workers, tick
        )
        for p, report in zip(runnable, reports, strict=True):
            p.figures = figures(report)
            if report.fails_served:
                p.infeasible = (
                    f"{report.fails_served} requests the recorded box served would be refused"
                    f" or time out ({', '.join(report.fails_served_models)})"
                )
        for p in made:
            p.feasible = not p.infeasible
            p.meets = p.figures is not None and bounded(p, goal) <= goal.limit_s
        points.extend(made)
        done[0] += 1
        tick(0.0)

    await stage("make room and idle timeouts", first_stage(history))
    base = (best_of(points, goal) or _nearest(points, goal) or points[0]).settings
    await stage("always on", pinned_stage(history, base, k))
    base = (best_of(points, goal) or _nearest(points, goal) or points[0]).settings
    await stage("per model", own_stage(history, base))
    base = (best_of(points, goal) or _nearest(points, goal) or points[0]).settings
    await stage("learned policy", learned_stage(history, base))
    simulated = [p for p in points if p.figures is not None]
    for p in simulated:
        p.pareto = p.feasible and not any(
            q.feasible
            and objective(q, goal) <= objective(p, goal)
            and bounded(q, goal) <= bounded(p, goal)
            and (objective(q, goal), bounded(q, goal)) != (objective(p, goal), bounded(p, goal))
            for q in simulated
        )
    infeasible = sum(not p.feasible for p in points)
    by_stage = Counter(p.stage for p in points)
    searched = (
        f"{len(points)} points ({', '.join(f'{n} {s}' for s, n in by_stage.items())}),"
        f" {len(simulated)} simulated, {infeasible} infeasible"
    )
    return Tuning(
        goal=goal,
        points=points,
        recommended=best_of(points, goal),
        baseline=points[0],
        hours=points[0].figures.hours if points[0].figures else 0.0,
        requests=len(history.traffic),
        searched=searched,
    )


# The history the forked workers simulate (set in the parent just before they fork).
_HISTORY: History | None = None


def _simulate_point(label: str, over: dict[str, Any]) -> Report:
    """One point, in a worker."""
    assert _HISTORY is not None, "a worker forked without the history"
    return asyncio.run(simulate(_HISTORY, over, label=label))


async def _simulate_all(
    history: History,
    candidates: list[tuple[str, dict[str, Any]]],
    workers: int,
    progress: Callable[[float], None] | None,
) -> list[Report]:
    if not candidates:
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(workers, len(candidates), cores or 1)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        reports = []
        for i, (label, over) in enumerate(candidates):
            reports.append(await simulate(history, over, label=label))
            if progress is not None:
                progress((i + 1) / len(candidates))
        return reports
    global _HISTORY
    _HISTORY = history
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    try:
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(pool, _simulate_point, *c) for c in candidates]
        for done, future in enumerate(asyncio.as_completed(futures), 1):
            await future
            if progress is not None:
                progress(done / len(candidates))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        _HISTORY = None
    pool.shutdown()
    return [f.result() for f in futures]


def parse_goal(text: str) -> Goal:
    """`p90<=30,cold_starts`: a bound and an objective; raises ValueError naming the fault."""
    bound_part, _, minimise = text.partition(",")
    minimise = minimise.strip() or "cold_starts"
    name, sep, limit = bound_part.partition("<=")
    name = name.strip()
    if not sep or name not in BOUNDS:
        raise ValueError(f"--goal {text}: expected p50|p90|p99<=SECONDS[,objective]")
    try:
        limit_s = float(limit)
    except ValueError:
        raise ValueError(f"--goal {text}: {limit.strip()!r} is not a number of seconds") from None
    if limit_s < 0:
        raise ValueError(f"--goal {text}: the bound must be 0 or more seconds")
    if minimise not in OBJECTIVES:
        raise ValueError(f"--goal {text}: the objective is one of {', '.join(OBJECTIVES)}")
    return Goal(bound=name, limit_s=limit_s, minimise=minimise)
