"""Does anticipation pay?  The learned on-demand policy against the best seed-policy setting
`tune` finds, on the three benchmark traces of issue 44 (`simulations.benchmark_traffic`).

    python -m tests.perf.bench_anticipation [--trace a|b|c|all] [--days N] [--seed N]
        [--goal 'p90<=30,cold_starts']

For each trace: the trace is generated from its seed and written as a log the way `dgxmm
serve` writes one (`tests.whatif_support.write_log`, into a temporary directory: generated,
never stored); `simulations.tune.tune` searches its grid for the best seed-policy setting
toward `--goal` (the CLI's default goal unless told); then the what-if of that setting, and
of the same setting plus `ondemand_policy=learned`.  The table gives, for both: the requests
that waited for their model's start, the p50 and p90 of those waits, the cold starts and the
idle GiB-hours (memory held by ready models with no request in flight, as the what-if's
`Report` measures it), and the ratios against the issue's targets:

- (a) and (b): requests that waited for a start at most 0.50 of the seed's;
- every trace: idle GiB-hours at most 1.10 of the seed's;
- (c): requests that waited and cold starts at most 1.05 of the seed's.

Until the learned policy exists (`parse_overrides` refuses `ondemand_policy=learned`) the
learned column says it is pending and only the seed's figures are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import structlog

from events import model as m
from simulations import whatif_run
from simulations.benchmark_traffic import DEFAULT_DAYS, GENERATORS, Trace
from simulations.fairness import waits
from simulations.tune import Goal, Point, Tuning, best_of, bounded, objective, parse_goal, tune
from simulations.whatif import (
    History,
    WhatIfError,
    build_report,
    fate,
    load_history,
    parse_overrides,
    simulate,
)
from tests.whatif_support import T0, Model, write_log

LEARNED = "ondemand_policy=learned"
TITLES = {"a": "office hours", "b": "periodic jobs", "c": "noise"}
IDLE_AT_MOST = 1.10  # every trace: idle GiB-hours, learned over seed


class Targets(msgspec.Struct, frozen=True, kw_only=True):
    """The most each figure of the learned column may be, as a share of the seed's."""

    waited: float  # requests that waited for their model
    idle: float = IDLE_AT_MOST
    cold: float | None = None  # cold starts (None: not a target)


# The targets: on (a) and (b) at least 50 % fewer requests wait for a start; on (c)
# at most 5 % more of them and of cold starts; everywhere at most 10 % more idle GiB-hours.
TARGETS = {
    "a": Targets(waited=0.50),
    "b": Targets(waited=0.50),
    "c": Targets(waited=1.05, cold=1.05),
}
MEASURED = ("served", "timed_out")  # the fates whose waits the what-if measures


class Column(msgspec.Struct, kw_only=True):
    """One policy's figures on one trace."""

    label: str
    requests: int
    waited: int  # requests that waited for their model
    waited_by_model: dict[str, int] = {}  # the same, per model (by its name)
    waited_p50: float  # of those that waited (s)
    waited_p90: float
    timed_out: int  # left the queue at its deadline
    refused: int
    cold_starts: int
    prewarms: int  # starts the learned policy made ahead of a predicted request
    prewarms_unused: int  # of those, put to sleep again before any request came
    prewarms_abandoned: int = 0  # of those, stopped while starting for a waiting request
    idle_gib_hours: float


class Verdict(msgspec.Struct, kw_only=True):
    """One target: the learned figure over the seed's, against its bound."""

    figure: str
    seed: float
    learned: float
    ratio: float | None  # None: the seed's figure is 0
    at_most: float
    met: bool


async def write_trace(trace: Trace, path: str | os.PathLike[str]) -> int:
    """The trace as a log: its box, its deployments (each with its recorded cold start) and
    its requests; returns the requests."""
    models = [Model(d.name, d.gib, 0.0, d.service_s, start_s=d.start_s) for d in trace.deployments]
    return await write_log(
        path, models, hours=(trace.end - T0) / 3600, usable_gib=trace.usable_gib,
        seed=trace.seed, defaults={}, traffic=trace.records,
    )  # fmt: skip


def learned_available(history: History) -> bool:
    """Whether the what-if knows the learned policy yet."""
    try:
        parse_overrides(history, [LEARNED])
    except WhatIfError:
        return False
    return True


async def column(history: History, overrides: dict[str, Any], label: str) -> Column:
    """The what-if of `overrides`.  `Report` gives the waits of every request (most of them
    0) and no pre-warms; the waits of those that waited and the pre-warms are read from the
    outcomes and events `simulate` hands to `build_report`, which is watched, not changed."""
    with mock.patch.object(whatif_run, "build_report", wraps=build_report) as spy:
        report = await simulate(history, overrides, label=label)
    outcomes, records = spy.call_args.args[1], spy.call_args.args[2]
    waited = waits([o.wait for o in outcomes if o.waited and fate(o.outcome) in MEASURED])
    by_model = Counter(
        history.names.get(o.deployment_id, o.deployment_id) for o in outcomes if o.waited
    )
    prewarms = sum(
        isinstance(r.event, m.StartRequested) and r.event.reason == "prewarm" for r in records
    )
    unused = sum(isinstance(r.event, m.PutToSleep) and r.event.prewarm_unused for r in records)
    abandoned = sum(
        isinstance(r.event, m.StopRequested) and r.event.reason == "prewarm_abandoned"
        for r in records
    )
    return Column(
        label=label, requests=report.requests, waited=report.waited,
        waited_by_model=dict(sorted(by_model.items())), waited_p50=waited.p50,
        waited_p90=waited.p90, timed_out=report.fates.timed_out, refused=report.fates.refused,
        cold_starts=report.cold_starts, prewarms=prewarms, prewarms_unused=unused,
        prewarms_abandoned=abandoned, idle_gib_hours=report.idle_gib_hours,
    )  # fmt: skip


def best_seed_point(tuning: Tuning) -> tuple[Point, bool]:
    """The best point of the seed's policy by tune's own rule (`best_of`: feasible, meets
    the bound, least of the objective), leaving out tune's points of the learned policy;
    with none meeting the bound, the feasible one nearest to it.  The point and whether it
    meets the bound."""
    seed = [p for p in tuning.points if p.settings.get("ondemand_policy", "seed") == "seed"]
    best = best_of(seed, tuning.goal)
    if best is not None:
        return best, True
    simulated = [p for p in seed if p.feasible and p.figures is not None]
    goal = tuning.goal
    return min(simulated, key=lambda p: (bounded(p, goal), objective(p, goal))), False


def verdicts(targets: Targets, seed: Column, learned: Column) -> list[Verdict]:
    """Each target met or not, the learned column against the seed's.  A figure the seed
    has none of is met only if the learned policy has none either."""
    wanted: list[tuple[str, Callable[[Column], float], float]] = [
        ("requests that waited", lambda c: c.waited, targets.waited),
        ("idle GiB-hours", lambda c: c.idle_gib_hours, targets.idle),
    ]
    if targets.cold is not None:
        wanted.append(("cold starts", lambda c: c.cold_starts, targets.cold))
    out = []
    for figure, get, at_most in wanted:
        s, v = float(get(seed)), float(get(learned))
        ratio = v / s if s > 0 else None
        met = ratio <= at_most if ratio is not None else v == 0
        out.append(Verdict(figure=figure, seed=s, learned=v, ratio=ratio, at_most=at_most, met=met))
    return out


def _waited_of(model: str) -> Callable[[Column], str]:
    return lambda c: f"{c.waited_by_model.get(model, 0):,}"


def table(seed: Column, learned: Column | None, found: list[Verdict]) -> list[str]:
    """The trace's rows: each figure under both policies, and the targets' ratios."""
    rows: list[tuple[str, Callable[[Column], str]]] = [
        ("requests", lambda c: f"{c.requests:,}"),
        ("requests that waited for a start", lambda c: f"{c.waited:,}"),
        ("  their wait p50 (s)", lambda c: f"{c.waited_p50:.1f}"),
        ("  their wait p90 (s)", lambda c: f"{c.waited_p90:.1f}"),
        ("timed out in the queue", lambda c: f"{c.timed_out:,}"),
        ("refused", lambda c: f"{c.refused:,}"),
        ("cold starts", lambda c: f"{c.cold_starts:,}"),
        ("pre-warms", lambda c: f"{c.prewarms:,}"),
        ("  unused (slept before a request)", lambda c: f"{c.prewarms_unused:,}"),
        ("  abandoned (gave way to a request)", lambda c: f"{c.prewarms_abandoned:,}"),
        ("idle GiB-hours", lambda c: f"{c.idle_gib_hours:.1f}"),
    ]
    for model in reversed(seed.waited_by_model):  # whose waits remain
        rows.insert(2, (f"  of them {model}'s", _waited_of(model)))
    lines = [f"{'':34}{'seed (tuned)':>14}{'learned':>14}"]
    for name, fmt in rows:
        lines.append(f"{name:34}{fmt(seed):>14}{fmt(learned) if learned else 'pending':>14}")
    for v in found:
        ratio = "n/a (seed 0)" if v.ratio is None else f"{v.ratio:.2f}"
        lines.append(
            f"target: {v.figure} learned/seed {ratio} <= {v.at_most:.2f}:"
            f" {'met' if v.met else 'MISSED'}"
        )
    return lines


async def trace_history(trace: Trace) -> History:
    """The trace written as a log in a temporary directory, and read back."""
    with tempfile.TemporaryDirectory(prefix="dgxmm-bench-anticipation-") as tmp:
        path = Path(tmp) / "log.db"
        await write_trace(trace, path)
        return await load_history(path)


class Compared(msgspec.Struct, kw_only=True):
    """One trace's comparison: tune's best seed-policy point and both columns."""

    tuning: Tuning
    best: Point
    meets: bool  # the best point meets the goal's bound
    seed: Column
    learned: Column | None  # None: the what-if does not know the learned policy yet


async def compare(history: History, goal: Goal, workers: int) -> Compared:
    """Tune's best seed-policy setting for the history, then the what-if of it and of the
    same with the learned policy (where the what-if knows it)."""
    tuning = await tune(history, goal, workers=workers)
    best, meets = best_seed_point(tuning)
    seed = await column(history, best.settings, "seed")
    learned = None
    if learned_available(history):
        over = {**best.settings, **parse_overrides(history, [LEARNED])}
        learned = await column(history, over, "learned")
    return Compared(tuning=tuning, best=best, meets=meets, seed=seed, learned=learned)


async def bench(name: str, seed: int, days: float, goal: Goal, workers: int) -> bool:
    """One trace's table, printed; whether every target was met (True while pending)."""
    trace = GENERATORS[name](seed, days=days)
    models = ", ".join(f"{d.name} {d.gib:g} GiB ({d.start_s:g} s start)" for d in trace.deployments)
    print(f"\n## ({name}) {TITLES[name]}: seed {seed}, {days:g} days, {len(trace.records):,}"
          f" requests; {trace.usable_gib:g} GiB box: {models}")  # fmt: skip
    began = time.monotonic()
    history = await trace_history(trace)
    print(f"log written and read in {time.monotonic() - began:.1f} s")
    began = time.monotonic()
    done = await compare(history, goal, workers)
    print(
        f"tune ({done.tuning.searched}) and the what-if of both in"
        f" {time.monotonic() - began:.0f} s; tune's best seed-policy setting:"
        f" {done.best.label} ({' '.join(done.best.changes) or 'no change'})"
        + ("" if done.meets else "; no point meets the goal's bound: the nearest to it")
    )
    print()
    found = verdicts(TARGETS[name], done.seed, done.learned) if done.learned else []
    for line in table(done.seed, done.learned, found):
        print(line)
    if done.learned is None:
        print("learned: pending (`--set ondemand_policy=learned` is not a setting yet)")
    return all(v.met for v in found)


async def main(names: list[str], seed: int, days: float | None, goal: Goal, workers: int) -> int:
    """Every asked trace's table; 1 if a target was missed."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    print("$ " + shlex.join(["python", "-m", "tests.perf.bench_anticipation", *sys.argv[1:]]))
    print(f"seed {seed}; goal {goal.describe()}; load average {os.getloadavg()[0]:.1f}")
    began = time.monotonic()
    met = True
    for name in names:
        met &= await bench(name, seed, days if days is not None else DEFAULT_DAYS[name], goal,
                           workers)  # fmt: skip
    print(f"\nwall time {time.monotonic() - began:.0f} s")
    return 0 if met else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--days", type=float, help="default: 14 for (a), 3 for (b) and (c)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--goal", default="p90<=30,cold_starts", help="tune's goal")
    parser.add_argument("--workers", type=int, default=2, help="tune's processes")
    args = parser.parse_args()
    traces = ["a", "b", "c"] if args.trace == "all" else [args.trace]
    sys.exit(asyncio.run(main(traces, args.seed, args.days, parse_goal(args.goal), args.workers)))
