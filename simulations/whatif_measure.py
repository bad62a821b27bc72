"""The what-if's measure: one column of the table (`Report`), counted alike on both sides.

A column comes from the requests' outcomes and the lifecycle events, by the same code for the
recorded column (`measure_recorded`) and the simulated ones (`whatif_run.simulate` hands its
outcomes and events to `build_report`), so that a difference between them is one of
behaviour, never of counting.

Its own room because both sides need it and neither owns it: what counts as a cold start,
an eviction, an idle GiB-hour or a request that waited is decided here once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import msgspec

from actors.memory_broker import GIB
from events import model as m
from simulations.fairness import Waits, jain, waits
from simulations.whatif_history import History


class Report(msgspec.Struct, kw_only=True):
    """One column of the table."""

    label: str
    requests: int = 0
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
        idle = sum(b - a for a, b in _clip(spans, since, until)) - _covered(busy[dep], spans)
        idle_bytes_s += max(0.0, idle) * memory.get(dep, 0)
    measured = [o for o in outcomes if o.outcome != "queue_full"]
    per: dict[str, list[float]] = defaultdict(list)
    for o in measured:
        per[names.get(o.deployment_id, o.deployment_id)].append(o.wait)
    per_model = {name: waits(v) for name, v in sorted(per.items())}
    hours = max(until - since, 1.0) / 3600.0
    return Report(
        label=label,
        requests=len(outcomes),
        waited=sum(o.waited for o in outcomes),
        waits=waits([o.wait for o in measured]),
        per_model=per_model,
        cold_starts=cold,
        cold_starts_per_hour=cold / hours,
        evictions=evictions,
        queue_timeouts=max(timeouts, sum(o.outcome == "queue_timeout" for o in outcomes)),
        queue_full=sum(o.outcome == "queue_full" for o in outcomes),
        idle_gib_hours=idle_bytes_s / GIB / 3600.0,
        jain=jain([w.mean for w in per_model.values()]),
        waited_ids=sorted(o.request_id for o in outcomes if o.waited),
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
    outcomes = [
        Outcome(
            request_id=r.request_id,
            deployment_id=r.deployment_id,
            wait=r.wait_s if r.outcome not in ("queue_timeout",) else r.duration_s,
            waited=r.wait_s > 0 or r.outcome == "queue_timeout",
            outcome=r.outcome,
            busy=(r.arrived + r.wait_s, r.arrived + r.duration_s)
            if r.outcome in ("served", "engine_error", "client_gone")
            else None,
        )
        for r in history.traffic
    ]
    return build_report(
        "recorded",
        outcomes,
        history.records,
        history.names,
        deployment_memory(history),
        history.since,
        history.until,
    )
