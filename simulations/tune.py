"""Tune: search a small stated grid of settings with the what-if, toward an operator's goal.

The grid (`grid`): the global `ondemand_make_room_after_s` (the seed's rule, 0, 30, 120 and
300 s), the on-demand models' idle timeouts (each model's as recorded, 120 s or 900 s, the
same for every model), and always-on for none or for the `k` most used models (by
requests), at most `k` of them: 5 x 3 x 2 = 30 points with k = 1.  Each point is one
`simulate` of the same recorded traffic.  The goal is a bound and an objective: "p90 wait
<= 30 s with the fewest cold starts" is `Goal(bound="p90", limit_s=30,
minimise="cold_starts")`.  The recommendation is the point that meets the bound with the
least of the objective (ties: the smaller p90 wait); the curve is every point's
(objective, bound figure), and its Pareto front.  It recommends; it changes nothing.

The points are independent: `workers` processes simulate them side by side (2 by default,
the box's other work keeps the rest).  The workers are forked after the history is loaded,
so they share it as it is in memory; handing it to fresh processes would cost more than a
point (a week's history pickles to about 100 MB in 5 s and loads in 4 s).  Where fork is
not available the points run one after the other.
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

from simulations.whatif import History, Report, simulate

MAKE_ROOM = (None, 0, 30, 120, 300)
IDLE = (None, 120, 900)  # None: each model's as recorded
OBJECTIVES = ("cold_starts", "idle_gib_hours", "evictions", "p90", "p99")
WORKERS = 2
BOUNDS = ("p50", "p90", "p99")


class Goal(msgspec.Struct, frozen=True, kw_only=True):
    """A bound on a wait percentile, and what to make least under it."""

    bound: str = "p90"
    limit_s: float = 30.0
    minimise: str = "cold_starts"

    def describe(self) -> str:
        """The goal in words."""
        return f"{self.bound} wait <= {self.limit_s:g} s with the fewest {self.minimise}"


class Point(msgspec.Struct, kw_only=True):
    """One grid point and its simulated figures."""

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
    meets: bool = False
    pareto: bool = False


class Tuning(msgspec.Struct, kw_only=True):
    """The search's outcome."""

    goal: Goal
    points: list[Point]
    recommended: Point | None


def most_used(history: History, k: int) -> list[str]:
    """The `k` deployments with the most requests (ids)."""
    counts = Counter(r.deployment_id for r in history.traffic)
    return [dep for dep, _ in counts.most_common(k)]


def grid(history: History, k: int = 1) -> list[tuple[str, dict[str, Any]]]:
    """The stated grid as (label, overrides) pairs."""
    on_demand = {d for d, s in history.deployments.items() if s.mode == "on_demand"}
    for change in history.changes:
        ev = change.event
        if getattr(ev, "mode", None) == "on_demand" and hasattr(ev, "deployment_id"):
            on_demand.add(ev.deployment_id)
    pinned_sets: list[list[str]] = [[], most_used(history, k)] if k > 0 else [[]]
    points = []
    for room, idle, pinned in itertools.product(MAKE_ROOM, IDLE, pinned_sets):
        over: dict[str, Any] = {}
        parts = []
        if room is not None:
            over["ondemand_make_room_after_s"] = room
            parts.append(f"room {room}s")
        else:
            parts.append("room seed")
        if idle is not None:
            for dep in sorted(on_demand):
                over[f"{dep}.idle_timeout_s"] = idle
            parts.append(f"idle {idle}s")
        else:
            parts.append("idle as is")
        for dep in pinned:
            over[f"{dep}.mode"] = "always_on"
        if pinned:
            parts.append("always on: " + ",".join(history.names.get(d, d) for d in pinned))
        points.append((", ".join(parts), over))
    return points


def _point(label: str, over: dict[str, Any], report: Report) -> Point:
    return Point(
        settings=over,
        label=label,
        p50=report.waits.p50,
        p90=report.waits.p90,
        p99=report.waits.p99,
        cold_starts=report.cold_starts,
        cold_starts_per_hour=report.cold_starts_per_hour,
        evictions=report.evictions,
        idle_gib_hours=report.idle_gib_hours,
        queue_timeouts=report.queue_timeouts,
    )


def objective(point: Point, goal: Goal) -> float:
    """The figure the goal makes least."""
    return float(getattr(point, goal.minimise))


async def tune(
    history: History,
    goal: Goal,
    *,
    k: int = 1,
    progress: Callable[[float], None] | None = None,
    workers: int = WORKERS,
) -> Tuning:
    """Every grid point simulated (`workers` at a time); the recommendation and the curve."""
    candidates = grid(history, k)
    reports = await _simulate_all(history, candidates, workers, progress)
    points = [_point(label, over, r) for (label, over), r in zip(candidates, reports, strict=True)]
    for p in points:
        p.meets = getattr(p, goal.bound) <= goal.limit_s
        p.pareto = not any(
            objective(q, goal) <= objective(p, goal)
            and getattr(q, goal.bound) <= getattr(p, goal.bound)
            and (objective(q, goal), getattr(q, goal.bound))
            != (objective(p, goal), getattr(p, goal.bound))
            for q in points
        )
    meeting = [p for p in points if p.meets]
    best = min(meeting, key=lambda p: (objective(p, goal), p.p90), default=None)
    return Tuning(goal=goal, points=points, recommended=best)


# The history the forked workers simulate (set in the parent just before they fork).
_HISTORY: History | None = None


def _simulate_point(label: str, over: dict[str, Any]) -> Report:
    """One grid point, in a worker."""
    assert _HISTORY is not None, "a worker forked without the history"
    return asyncio.run(simulate(_HISTORY, over, label=label))


async def _simulate_all(
    history: History,
    candidates: list[tuple[str, dict[str, Any]]],
    workers: int,
    progress: Callable[[float], None] | None,
) -> list[Report]:
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
