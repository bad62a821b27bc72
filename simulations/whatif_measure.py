"""The what-if's measure: one column of the table (`Report`), counted alike on both sides.

A column comes from the requests' outcomes and the lifecycle events, by the same code for the
recorded column (`measure_recorded`) and the simulated ones (`whatif_run.simulate` hands its
outcomes and events to `build_report`), so that a difference between them is one of
behaviour, never of counting.

Its own room because both sides need it and neither owns it: what counts as a cold start,
an eviction, an idle GiB-hour or a request that waited is decided here once.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

import msgspec

from actors.memory_broker import GIB
from events import model as m
from simulations.fairness import Waits, jain, waits
from simulations.whatif_history import History

# What became of a request, in every column (`fate`): it was served (with its wait), refused
# (`refused_by` says why), it timed out in the queue (DGXMM's queue timeout, or its client
# went away while it waited), or an administrator stopped its model while it waited.
FATES = ("served", "refused", "timed_out", "stopped")
# The outcome codes of a request (`Outcome.outcome`) that are not a refusal's code.
_NOT_REFUSED = {
    "served": "served",
    "queue_timeout": "timed_out",
    "gave_up": "timed_out",
    "stopped": "stopped",
}


# A traced request the recorded box served (reached its engine, answered or not).
SERVED_TRACED = ("served", "engine_error")


def fate(outcome: str) -> str:
    """The fate of an outcome code: a refusal's code (`does_not_fit`, `ondemand_queue_full`,
    `start_failed`, ...) is `refused`."""
    return _NOT_REFUSED.get(outcome, "refused")


class Fates(msgspec.Struct, kw_only=True):
    """How many requests met each fate; they add up to the requests."""

    served: int = 0
    refused: int = 0
    timed_out: int = 0
    stopped: int = 0

    def total(self) -> int:
        """Every request counted."""
        return self.served + self.refused + self.timed_out + self.stopped


class Report(msgspec.Struct, kw_only=True):
    """One column of the table."""

    label: str
    requests: int = 0
    fates: Fates = msgspec.field(default_factory=Fates)
    fates_per_model: dict[str, Fates] = {}
    refused_by: dict[str, int] = {}  # a refusal's code -> requests
    # Requests the recorded box served that this column refuses or times out, and their models:
    # a column with any is one the operator must not take.
    fails_served: int = 0
    fails_served_models: list[str] = []
    waited: int = 0  # requests that waited at all
    waits: Waits = Waits()
    per_model: dict[str, Waits] = {}
    cold_starts: int = 0
    cold_starts_per_hour: float = 0.0
    evictions: int = 0
    queue_timeouts: int = 0
    queue_full: int = 0
    idle_gib_hours: float = 0.0
    jain: float = 1.0
    waited_ids: list[int] = []  # the requests that waited (for the agreement figure)
    hours: float = 0.0  # the window's length


class Figures(msgspec.Struct, kw_only=True):
    """A column's figures in one unit each, per hour of traffic where they count something:
    what `tune` predicts and what the box did since (measured alike)."""

    hours: float
    requests: int
    p50: float
    p90: float
    p99: float
    worst_model: str  # the model with the longest p90 wait ("" with none)
    worst_p90: float
    cold_starts_per_hour: float
    evictions_per_hour: float
    idle_gib_hours_per_hour: float  # GiB held by idle models, on average
    fates: Fates
    fates_per_model: dict[str, Fates]
    fails_served: int
    fails_served_models: list[str]


def figures(report: Report) -> Figures:
    """The column's `Figures`."""
    hours = max(report.hours, 1 / 3600)
    worst = max(report.per_model.items(), key=lambda kv: kv[1].p90, default=("", Waits()))
    return Figures(
        hours=report.hours,
        requests=report.requests,
        p50=report.waits.p50,
        p90=report.waits.p90,
        p99=report.waits.p99,
        worst_model=worst[0],
        worst_p90=worst[1].p90,
        cold_starts_per_hour=report.cold_starts / hours,
        evictions_per_hour=report.evictions / hours,
        idle_gib_hours_per_hour=report.idle_gib_hours / hours,
        fates=report.fates,
        fates_per_model=report.fates_per_model,
        fails_served=report.fails_served,
        fails_served_models=report.fails_served_models,
    )


class Outcome(msgspec.Struct, gc=False):
    """What one request met, recorded or simulated.  Never tracked by the garbage collector
    (it refers to no container that could make a cycle): a week holds a million, which each
    full collection scanned, a sixth of the simulation's time."""

    request_id: int
    deployment_id: str
    wait: float
    waited: bool
    outcome: str
    busy: tuple[float, float] | None  # (admitted, end) on its model, epoch seconds
    recorded_served: bool = False  # the recorded box served it


def build_report(
    label: str,
    outcomes: list[Outcome],
    records: Iterable[m.Recorded],
    names: dict[str, str],
    memory: dict[str, int],
    since: float,
    until: float,
) -> Report:
    """The column's figures from the requests' outcomes and the lifecycle events."""
    cold = evictions = timeouts = 0
    ready_since: dict[str, float] = {}
    held: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for rec in records:
        ev, dep = rec.event, rec.stream.partition(":")[2]
        if isinstance(ev, m.StartRequested) and ev.reason == "request":
            cold += 1
        elif isinstance(ev, m.PutToSleep) and ev.reason == "make_room":
            evictions += 1
        elif isinstance(ev, m.RequestLeftQueue) and ev.reason == "timeout":
            timeouts += 1
        if isinstance(ev, m.EngineReady | m.EngineAwake | m.EngineAdopted):
            ready_since.setdefault(dep, rec.ts)
        elif isinstance(ev, m.PutToSleep | m.StopRequested | m.EngineLost | m.EngineStopped):
            at = ready_since.pop(dep, None)
            if at is not None:
                held[dep].append((at, rec.ts))
    for dep, at in ready_since.items():
        held[dep].append((at, until))
    busy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for o in outcomes:
        if o.busy is not None:
            busy[o.deployment_id].append(o.busy)
    idle_bytes_s = 0.0
    for dep, spans in held.items():
        clipped = _clip(spans, since, until)
        idle = sum(b - a for a, b in clipped) - _covered(busy[dep], clipped)
        idle_bytes_s += max(0.0, idle) * memory.get(dep, 0)
    # The waits: of the requests served and of those that timed out (with their wait); a
    # refused or stopped request has no wait, it has its fate.  Counted by (model, outcome)
    # first: a week's million outcomes are mostly served at once.
    counted = Counter((o.deployment_id, o.outcome) for o in outcomes)
    fates = Fates()
    per_fates: dict[str, Fates] = defaultdict(Fates)
    refused_by: dict[str, int] = defaultdict(int)
    for (dep, code), n in counted.items():
        what = fate(code)
        mine = per_fates[names.get(dep, dep)]
        setattr(fates, what, getattr(fates, what) + n)
        setattr(mine, what, getattr(mine, what) + n)
        if what == "refused":
            refused_by[code] += n
    measured = []
    per: dict[str, list[float]] = defaultdict(list)
    failed: dict[str, int] = defaultdict(int)
    for o in outcomes:
        what = fate(o.outcome)
        if what in ("served", "timed_out"):
            measured.append(o.wait)
            per[names.get(o.deployment_id, o.deployment_id)].append(o.wait)
        if what in ("refused", "timed_out") and o.recorded_served:
            failed[names.get(o.deployment_id, o.deployment_id)] += 1
    per_model = {name: waits(v) for name, v in sorted(per.items())}
    hours = max(until - since, 1.0) / 3600.0
    return Report(
        label=label,
        requests=len(outcomes),
        fates=fates,
        fates_per_model=dict(sorted(per_fates.items())),
        refused_by=dict(sorted(refused_by.items())),
        fails_served=sum(failed.values()),
        fails_served_models=sorted(failed),
        waited=sum(o.waited for o in outcomes),
        waits=waits(measured),
        per_model=per_model,
        cold_starts=cold,
        cold_starts_per_hour=cold / hours,
        evictions=evictions,
        queue_timeouts=max(timeouts, sum(o.outcome == "queue_timeout" for o in outcomes)),
        queue_full=refused_by.get("ondemand_queue_full", 0),
        idle_gib_hours=idle_bytes_s / GIB / 3600.0,
        jain=jain([w.mean for w in per_model.values()]),
        waited_ids=sorted(o.request_id for o in outcomes if o.waited),
        hours=max(until - since, 1.0) / 3600.0,
    )


def _clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]


def _merged(busy: list[tuple[float, float]]) -> list[list[float]]:
    """The stretches of time covered by `busy`, overlapping ones joined, in time order."""
    merged: list[list[float]] = []
    for a, b in sorted(busy):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _covered(busy: list[tuple[float, float]], spans: list[tuple[float, float]]) -> float:
    """Seconds of `spans` during which at least one request was in flight."""
    merged = _merged(busy)
    # Both in time order: each busy stretch meets a run of the spans, and a span that ended
    # before one stretch ends before all the later ones.  The overlaps add up in the order
    # of a loop over every pair (the pairs that do not overlap add nothing).
    spans = sorted(spans)
    total = 0.0
    first = 0
    for a, b in merged:
        while first < len(spans) and spans[first][1] <= a:
            first += 1
        for k in range(first, len(spans)):
            s, e = spans[k]
            if s >= b:
                break
            total += max(0.0, min(b, e) - max(a, s))
    return total


def deployment_memory(history: History) -> dict[str, int]:
    """Each deployment's memory, those created in the window too (for idle GiB-hours)."""
    mem = {d: s.memory_bytes for d, s in history.deployments.items()}
    for change in history.changes:
        if isinstance(change.event, m.DeploymentCreated):
            mem[change.event.deployment_id] = change.event.memory_bytes
    return mem


def measure_recorded(history: History) -> Report:
    """What really happened, measured as the simulations are."""
    left = _left_queue(history.records)
    outcomes = []
    for r in history.traffic:
        code = recorded_outcome(r.outcome, left.get(str(r.request_id)))
        gone = code in ("queue_timeout", "gave_up")
        outcomes.append(
            Outcome(
                request_id=r.request_id,
                deployment_id=r.deployment_id,
                wait=r.duration_s if gone else r.wait_s,
                waited=r.wait_s > 0 or gone,
                outcome=code,
                busy=(r.arrived + r.wait_s, r.arrived + r.duration_s) if code == "served" else None,
                recorded_served=r.outcome in SERVED_TRACED,
            )
        )
    return build_report(
        "recorded",
        outcomes,
        history.records,
        history.names,
        deployment_memory(history),
        history.since,
        history.until,
    )


def _left_queue(records: Iterable[m.Recorded]) -> dict[str, str]:
    """Why each request that waited left the queue (by its id)."""
    return {
        rec.event.request_id: rec.event.reason
        for rec in records
        if isinstance(rec.event, m.RequestLeftQueue)
    }


def recorded_outcome(traced: str, left: str | None) -> str:
    """A traced request's outcome code, its fate told apart by why it left the queue: the
    trace says `refused` for a refusal, a start that failed and a model an administrator
    stopped alike, and `client_gone` for a client that went away while it waited too."""
    if traced in ("served", "engine_error"):
        return "served"
    if traced == "client_gone":
        return "gave_up" if left == "client_gone" else "served"
    if traced == "queue_full":
        return "ondemand_queue_full"
    if traced == "queue_timeout":
        return "queue_timeout"
    if left in ("stopped", "removed"):
        return "stopped"
    if left in ("start_failed", "does_not_fit"):
        return left
    return "refused"
