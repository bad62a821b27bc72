"""Queue fairness report: run a named scenario on the real actors and measure who waited.

    python -m simulations.fairness --scenario hot-small-cold-large --seed 1
    python -m simulations.fairness --scenario all --seed 1 --compare
    python -m simulations.fairness --scenario all --seed 1 --compare make-room
    python -m simulations.fairness --list

Per model it prints the waits (arrival to serving; a request that timed out counts with
the time it waited), their p50/p90/p99/max, the waits of requests while they were the head
of the queue and how many later requests went ahead of them meanwhile, evictions, cold
starts, timeouts and refusals; then Jain's fairness index over the models' mean waits.
`--policy fifo` runs the same arrivals and engines with the go-ahead rule turned off
(plain first come, first served) for comparison.  `--make-room-after N` runs it with
`ondemand_make_room_after_s = N`, and `--compare make-room` runs the seed's rule, 0 s, 30 s
and 120 s on the same arrivals and engines and prints mean and p90 wait, the head's longest
wait, cold starts per hour and Jain's index side by side.  The numbers come from the event
log and the simulated clients, not from the actors' own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import get_args

import msgspec

from events import model as m
from simulations.scenarios import (
    POLICIES,
    SCENARIOS,
    ModelSpec,
    Outcome,
    Policy,
    Scenario,
    describe,
    quiet_logs,
    scenario,
    simulate,
)

REFUSALS = ("ondemand_queue_full", "does_not_fit", "start_failed", "ondemand_stopped")


class Waits(msgspec.Struct, frozen=True, kw_only=True):
    """A distribution of waits in seconds (nearest-rank percentiles)."""

    n: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0


class ModelReport(msgspec.Struct, frozen=True, kw_only=True):
    """One model's numbers."""

    model: str
    gib: float
    mode: str
    requests: int
    served: int
    queued: int  # got the queued line: really waited for memory
    timeouts: int
    refused: dict[str, int]
    client_gone: int
    waits: Waits  # served and timed-out requests: arrival -> serving (or -> the 503)
    head_waits: Waits  # time spent at the head of the queue, per request that got there
    passed_while_head: int  # other models started ahead while one of its requests was head
    went_ahead: int  # its starts under the go-ahead rule (ahead of an earlier request)
    cold_starts: int  # launches during the run
    failed_starts: int
    evicted: int  # put to sleep to make room for another model
    evictions_for_it: int  # models put to sleep to make room for it
    idle_sleeps: int


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """The fairness report of runs of one scenario with one policy (pooled over seeds)."""

    scenario: str
    description: str
    seeds: list[int]
    policy: str
    simulated_s: float
    wall_s: float
    requests: int
    served: int
    timeouts: int
    waits: Waits
    head_waits: Waits
    jain: float  # over the models' mean waits; 1.0 = every model waited as long on average
    models: list[ModelReport]
    violations: list[str]
    make_room_after_s: int | None = None  # None: the seed's rule (the full idle timeout)
    cold_starts_per_hour: float = 0.0  # launches per simulated hour of traffic: swapping's cost


# --- numbers --------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `values`; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def waits(values: Sequence[float]) -> Waits:
    """The distribution of `values`."""
    if not values:
        return Waits()
    return Waits(
        n=len(values),
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
        max=max(values),
    )


def jain(values: Iterable[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all equal, 1/n at worst."""
    xs = list(values)
    square_sum = sum(x * x for x in xs)
    if not xs or square_sum == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * square_sum)


class HeadEpisode(msgspec.Struct, kw_only=True):
    """A request at the head of the queue (the oldest one waiting for memory)."""

    request_id: str
    deployment_id: str
    start: float
    end: float | None = None
    passed: int = 0  # later requests admitted under the go-ahead rule meanwhile


def go_ahead_starts(records: Iterable[m.Recorded]) -> set[str]:
    """Requests admitted under the go-ahead rule whose model had to start for them.

    (A request that joins a start already under way is flagged as going ahead too, but
    it takes no memory from anyone.)
    """
    records = list(records)
    jumped = {
        rec.event.request_id
        for rec in records
        if isinstance(rec.event, m.RequestAdmitted) and rec.event.jumped_ahead
    }
    return {
        rec.event.request_id
        for rec in records
        if isinstance(rec.event, m.StartRequested)
        and rec.event.reason == "request"
        and rec.event.request_id in jumped
    }


def head_episodes(records: Iterable[m.Recorded], wall_offset: float) -> list[HeadEpisode]:
    """Who was the head of the queue and for how long, from the queue events of the log."""
    records = list(records)
    starts = go_ahead_starts(records)
    waiting: dict[str, tuple[str, str]] = {}  # request -> (deployment, kind), arrival order
    episodes: list[HeadEpisode] = []
    current: HeadEpisode | None = None
    for rec in records:
        ev = rec.event
        now = rec.ts - wall_offset
        match ev:
            case m.RequestQueued():
                waiting[ev.request_id] = (ev.deployment_id, ev.kind)
            case m.RequestAdmitted():
                if ev.request_id in waiting:
                    waiting[ev.request_id] = (ev.deployment_id, "waiting_start")
                if (
                    ev.request_id in starts
                    and current is not None
                    and current.deployment_id != ev.deployment_id
                ):
                    current.passed += 1
            case m.RequestLeftQueue():
                waiting.pop(ev.request_id, None)
            case _:
                continue
        head = next((rid for rid, (_, kind) in waiting.items() if kind == "queued"), None)
        if current is not None and current.request_id != head:
            current.end = now
            current = None
        if head is not None and current is None:
            current = HeadEpisode(request_id=head, deployment_id=waiting[head][0], start=now)
            episodes.append(current)
    return episodes


class _Tally:
    """One model's raw numbers, added up over runs."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model
        self.counts: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.waits: list[float] = []
        self.head_waits: list[float] = []

    def add(self, key: str, n: int | bool) -> None:
        self.counts[key] = self.counts.get(key, 0) + int(n)

    def report(self) -> ModelReport:
        c = self.counts.get
        return ModelReport(
            model=self.model.name,
            gib=self.model.gib,
            mode=self.model.mode,
            requests=c("requests", 0),
            served=c("served", 0),
            queued=c("queued", 0),
            timeouts=c("timeouts", 0),
            refused={k: n for k, n in self.refused.items() if n},
            client_gone=c("client_gone", 0),
            waits=waits(self.waits),
            head_waits=waits(self.head_waits),
            passed_while_head=c("passed_while_head", 0),
            went_ahead=c("went_ahead", 0),
            cold_starts=c("cold_starts", 0),
            failed_starts=c("failed_starts", 0),
            evicted=c("evicted", 0),
            evictions_for_it=c("evictions_for_it", 0),
            idle_sleeps=c("idle_sleeps", 0),
        )


def _count(out: Outcome, tallies: dict[str, _Tally]) -> list[float]:
    """Add one run to the tallies; returns the head-of-queue waits of every model."""
    t0 = out.traffic_start
    episodes = head_episodes(out.records, out.wall_offset)
    ahead = go_ahead_starts(out.records)
    for model in out.scenario.models:
        t = tallies[model.name]
        dep_id = out.ids[model.name]
        mine = [r for r in out.results if r.deployment_id == dep_id]
        t.add("requests", len(mine))
        t.add("served", sum(r.outcome == "served" for r in mine))
        t.add("queued", sum(r.queued for r in mine))
        t.add("timeouts", sum(r.outcome == "ondemand_queue_timeout" for r in mine))
        t.add("client_gone", sum(r.outcome == "client_gone" for r in mine))
        for code in REFUSALS:
            t.refused[code] = t.refused.get(code, 0) + sum(r.outcome == code for r in mine)
        t.waits += [r.waited for r in mine if r.outcome in ("served", "ondemand_queue_timeout")]
        heads = [e for e in episodes if e.deployment_id == dep_id]
        t.head_waits += [(e.end or out.end) - e.start for e in heads]
        t.add("passed_while_head", sum(e.passed for e in heads))
        for rec in out.records:
            ev = rec.event
            if isinstance(ev, m.RequestAdmitted):
                t.add("went_ahead", ev.deployment_id == dep_id and ev.request_id in ahead)
            elif isinstance(ev, m.PutToSleep) and ev.reason == "make_room":
                t.add("evictions_for_it", ev.for_deployment == dep_id)
            if rec.stream != m.deployment_stream(dep_id) or out.at(rec) < t0:
                continue
            t.add("cold_starts", isinstance(ev, m.EngineStarting))
            t.add("failed_starts", isinstance(ev, m.EngineStartFailed))
            if isinstance(ev, m.PutToSleep):
                t.add("evicted" if ev.reason == "make_room" else "idle_sleeps", True)
    return [(e.end or out.end) - e.start for e in episodes]


def report(outs: Sequence[Outcome], violations: Sequence[str] = ()) -> Report:
    """Measure runs of one scenario with one policy (seeds pooled)."""
    spec = outs[0].scenario
    tallies = {model.name: _Tally(model) for model in spec.models}
    head: list[float] = []
    for out in outs:
        head += _count(out, tallies)
    models = [t.report() for t in tallies.values()]
    every = [w for t in tallies.values() for w in t.waits]
    simulated = sum(out.end - out.traffic_start for out in outs)
    room = spec.settings.get("ondemand_make_room_after_s")
    return Report(
        scenario=spec.name,
        description=spec.description,
        seeds=[out.seed for out in outs],
        policy=outs[0].policy,
        simulated_s=simulated,
        wall_s=sum(out.wall_s for out in outs),
        requests=sum(r.requests for r in models),
        served=sum(r.served for r in models),
        timeouts=sum(r.timeouts for r in models),
        waits=waits(every),
        head_waits=waits(head),
        jain=jain(r.waits.mean for r in models if r.waits.n),
        models=models,
        violations=[v for out in outs for v in out.harness_violations] + list(violations),
        make_room_after_s=None if room is None else int(room),
        cold_starts_per_hour=(
            sum(r.cold_starts for r in models) * 3600.0 / simulated if simulated > 0 else 0.0
        ),
    )


# --- running --------------------------------------------------------------------------------


MAKE_ROOM_RULES: tuple[int | None, ...] = (None, 0, 30, 120)  # None: the seed's rule


def with_make_room_after(spec: Scenario, after_s: int | None) -> Scenario:
    """The scenario with `ondemand_make_room_after_s` set (None: left to the seed's rule)."""
    if after_s is None:
        return spec
    settings = {**spec.settings, "ondemand_make_room_after_s": after_s}
    return msgspec.structs.replace(spec, settings=settings)


async def run(
    name: str,
    seed: int,
    policy: Policy,
    duration_s: float = 3600.0,
    db: Path | None = None,
    make_room_after_s: int | None = None,
) -> Outcome:
    """Simulate scenario `name` (the log goes to `db` or a temporary file)."""
    spec = with_make_room_after(scenario(name, seed, duration_s), make_room_after_s)
    if db is not None:
        return await simulate(spec, db, seed=seed, policy=policy)
    with tempfile.TemporaryDirectory(prefix="dgxmm-fairness-") as tmp:
        return await simulate(spec, Path(tmp) / "log.db", seed=seed, policy=policy)


def measure(
    name: str,
    seeds: Iterable[int],
    policy: Policy,
    duration_s: float = 3600.0,
    make_room_after_s: int | None = None,
) -> Report:
    """Run scenario `name` once per seed with `policy` and report them pooled."""
    return report(
        [
            asyncio.run(run(name, seed, policy, duration_s, make_room_after_s=make_room_after_s))
            for seed in seeds
        ]
    )


# --- text -----------------------------------------------------------------------------------


def _s(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _seeds(seeds: Sequence[int]) -> str:
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {seeds[0]}-{seeds[-1]}"


def rule_label(after_s: int | None) -> str:
    """How a make-room rule reads in the reports."""
    return "seed's rule" if after_s is None else f"{after_s} s"


def render(rep: Report) -> list[str]:
    """The report as text lines."""
    lines = [
        f"scenario {rep.scenario}  {_seeds(rep.seeds)}  policy {rep.policy}"
        f"  make room after: {rule_label(rep.make_room_after_s)}",
        f"  {rep.description}",
        f"  {rep.simulated_s:.0f} s simulated in {rep.wall_s:.2f} s; {rep.requests} requests, "
        f"{rep.served} served, {rep.timeouts} timed out",
        "",
        "  waits in seconds from arrival to serving (timed-out requests count with their wait);",
        "  head: time at the head of the queue; passed: models started ahead of it meanwhile;",
        "  ahead: its own starts ahead of an earlier request (the go-ahead rule)",
        "",
        f"  {'model':<14}{'GiB':>4} {'reqs':>5}{'served':>7}{'queued':>7}{'t/o':>5}"
        f"{'refused':>8}{'gone':>5}  {'wait p50':>8}{'p90':>6}{'p99':>6}{'max':>6}"
        f"  {'head n':>6}{'p50':>6}{'max':>6}{'passed':>7}{'ahead':>6}"
        f"  {'cold':>5}{'fail':>5}{'evicted':>8}{'for it':>7}{'idle':>5}",
    ]
    for r in rep.models:
        w, hw = r.waits, r.head_waits
        lines.append(
            f"  {r.model:<14}{r.gib:>4g} {r.requests:>5}{r.served:>7}{r.queued:>7}"
            f"{r.timeouts:>5}{sum(r.refused.values()):>8}{r.client_gone:>5}"
            f"  {_s(w.p50):>8}{_s(w.p90):>6}{_s(w.p99):>6}{_s(w.max):>6}"
            f"  {hw.n:>6}{_s(hw.p50):>6}{_s(hw.max):>6}{r.passed_while_head:>7}"
            f"{r.went_ahead:>6}  {r.cold_starts:>5}{r.failed_starts:>5}{r.evicted:>8}"
            f"{r.evictions_for_it:>7}{r.idle_sleeps:>5}"
        )
    w, hw = rep.waits, rep.head_waits
    lines += [
        "",
        f"  all waits: p50 {_s(w.p50)} s, p90 {_s(w.p90)} s, p99 {_s(w.p99)} s, "
        f"max {_s(w.max)} s, mean {_s(w.mean)} s (n={w.n})",
        f"  head of the queue: {hw.n} requests, p50 {_s(hw.p50)} s, p90 {_s(hw.p90)} s, "
        f"max {_s(hw.max)} s",
        f"  Jain's fairness index over the models' mean waits: {rep.jain:.3f}",
        f"  cold starts per hour: {rep.cold_starts_per_hour:.1f}",
    ]
    refused = {k: sum(r.refused.get(k, 0) for r in rep.models) for k in REFUSALS}
    if any(refused.values()):
        lines.append("  refused: " + ", ".join(f"{k} {n}" for k, n in refused.items() if n))
    if rep.violations:
        lines.append(f"  VIOLATIONS ({len(rep.violations)}):")
        lines += [f"    {v}" for v in rep.violations[:20]]
    return lines


def render_comparison(pairs: Sequence[tuple[Report, Report]]) -> list[str]:
    """FIFO with go-ahead against plain FIFO on the same arrivals, per scenario."""
    lines: list[str] = []
    for ahead, fifo in pairs:
        lines += [
            f"{ahead.scenario} ({_seeds(ahead.seeds)}): FIFO with go-ahead | plain FIFO",
            f"  {'model':<14}{'GiB':>4}  {'p50':>5}{'p90':>6}{'max':>6}{'t/o':>5}{'head max':>9}"
            f"{'ahead':>6}  | {'p50':>5}{'p90':>6}{'max':>6}{'t/o':>5}{'head max':>9}",
        ]
        for a, f in zip(ahead.models, fifo.models, strict=True):
            lines.append(
                f"  {a.model:<14}{a.gib:>4g}  {_s(a.waits.p50):>5}{_s(a.waits.p90):>6}"
                f"{_s(a.waits.max):>6}{a.timeouts:>5}{_s(a.head_waits.max):>9}{a.went_ahead:>6}"
                f"  | {_s(f.waits.p50):>5}{_s(f.waits.p90):>6}{_s(f.waits.max):>6}"
                f"{f.timeouts:>5}{_s(f.head_waits.max):>9}"
            )
        lines += [
            f"  {'all':<14}{'':>4}  {_s(ahead.waits.p50):>5}{_s(ahead.waits.p90):>6}"
            f"{_s(ahead.waits.max):>6}{ahead.timeouts:>5}{_s(ahead.head_waits.max):>9}{'':>6}"
            f"  | {_s(fifo.waits.p50):>5}{_s(fifo.waits.p90):>6}{_s(fifo.waits.max):>6}"
            f"{fifo.timeouts:>5}{_s(fifo.head_waits.max):>9}",
            f"  mean wait {_s(ahead.waits.mean)} s, Jain {ahead.jain:.3f}"
            f"  |  mean wait {_s(fifo.waits.mean)} s, Jain {fifo.jain:.3f}",
            "",
        ]
    return lines


def render_make_room(groups: Sequence[Sequence[Report]]) -> list[str]:
    """The make-room rules side by side per scenario, as a Markdown table."""
    lines = [
        "| scenario | make room after | mean wait (s) | p90 wait (s) | head's longest wait (s) "
        "| cold starts / h | Jain | timed out |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for group in groups:
        for rep in group:
            lines.append(
                f"| {rep.scenario} | {rule_label(rep.make_room_after_s)} | {_s(rep.waits.mean)} "
                f"| {_s(rep.waits.p90)} | {_s(rep.head_waits.max)} "
                f"| {rep.cold_starts_per_hour:.1f} | {rep.jain:.3f} | {rep.timeouts} |"
            )
    return lines


# --- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m simulations.fairness",
        description="Queue fairness of the real on-demand actors on a simulated box.",
    )
    parser.add_argument(
        "--scenario", default="hot-small-cold-large", help="a scenario name, or all"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--seeds", type=int, default=1, metavar="N", help="pool seeds SEED .. SEED+N-1"
    )
    parser.add_argument("--policy", choices=list(get_args(Policy)), default="fifo-go-ahead")
    parser.add_argument(
        "--compare",
        nargs="?",
        const="policy",
        choices=("policy", "make-room"),
        help="run both policies (or, with make-room, the seed's rule and 0, 30 and 120 s of "
        "ondemand_make_room_after_s) and print them side by side",
    )
    parser.add_argument(
        "--make-room-after",
        type=_make_room_arg,
        default=None,
        metavar="SECONDS",
        help="ondemand_make_room_after_s for the runs (default: unset, the seed's rule)",
    )
    parser.add_argument(
        "--duration", type=float, default=3600.0, help="simulated seconds of traffic per run"
    )
    parser.add_argument("--db", type=Path, help="keep the event log here (one run only)")
    parser.add_argument("--json", action="store_true", help="JSON instead of text")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    return parser


def _make_room_arg(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError("0 to 86400 seconds")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = build_parser().parse_args(argv)
    quiet_logs()
    if args.list:
        for name in SCENARIOS:
            print(f"{name:22} {describe(scenario(name, args.seed, args.duration))['description']}")
        return 0
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if any(name not in SCENARIOS for name in names):
        sys.stderr.write(f"unknown scenario {args.scenario!r}; known: {', '.join(SCENARIOS)}\n")
        return 2
    seeds = list(range(args.seed, args.seed + max(1, args.seeds)))
    policies: tuple[Policy, ...] = POLICIES if args.compare == "policy" else (args.policy,)
    rules = MAKE_ROOM_RULES if args.compare == "make-room" else (args.make_room_after,)
    if args.db is not None and len(names) * len(seeds) * len(policies) * len(rules) > 1:
        sys.stderr.write("--db keeps one run's log: use it with one scenario, seed and policy\n")
        return 2
    reports: list[Report] = []
    for name in names:
        for policy in policies:
            for rule in rules:
                if args.db is not None:
                    out = asyncio.run(run(name, seeds[0], policy, args.duration, args.db, rule))
                    reports.append(report([out]))
                else:
                    reports.append(measure(name, seeds, policy, args.duration, rule))
    if args.json:
        sys.stdout.write(msgspec.json.encode(reports).decode() + "\n")
    else:
        text: list[str] = []
        for rep in reports:
            text += [*render(rep), ""]
        if args.compare == "policy":
            text += render_comparison(list(zip(reports[::2], reports[1::2], strict=True)))
        elif args.compare == "make-room":
            n = len(rules)
            text += render_make_room([reports[i : i + n] for i in range(0, len(reports), n)])
        sys.stdout.write("\n".join(text).rstrip() + "\n")
    return 1 if any(rep.violations for rep in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
