"""The what-if's history: what an event log says about one window of the box, and the overrides.

The overrides are the settings an alternative may change (`parse_overrides`).

`load_history` reads an event log: the box as it was at `since` (its memory budget and
configured defaults from `TraceStarted`, its deployments, modes and settings), the
administrators' changes after it (deployments created and removed, mode and settings
changes), every request of the traffic trace in the window (`events.traffic`), and each
model's recorded launches, starts and stops, whose medians (`start_seconds`,
`launch_seconds`, `stop_seconds`) the simulated engines take.  `parse_overrides` checks an
alternative's `key=value` settings against the log's deployments and the settings' ranges.

Its own room because it is the one part that reads the log: the run (`whatif_run`) and the
measure (`whatif_measure`) take a `History` and never open a store of the box's.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from actors.anticipation import HISTORY_S, Traffic, traced
from actors.controller import DEFAULT_SETTINGS, validate_settings
from actors.deployment import Refusal
from events import model as m
from events.state import EMPTY, DeploymentState, evolve
from events.traffic import TrafficRecord, decode_batch
from storage.errors import StorageError
from storage.eventlog import EventStore

DEFAULT_START_S = 30.0  # a model with no recorded start, on a box with none at all
DEPLOYMENT_KEYS = {"idle_timeout_s", "mode", "make_room_after_s", "ondemand_policy"}
_POLICIES = ("seed", "learned")
_MODES = ("on_demand", "always_on")


class WhatIfError(Exception):
    """The log cannot answer (empty, foreign, no trace), or a setting is wrong."""


@dataclass(frozen=True)
class Change:
    """An administrator's change after `since`, replayed at its time."""

    at: float  # epoch seconds
    event: m.AnyEvent
    deployment_id: str | None


@dataclass
class History:
    """What the log says, for one window."""

    since: float
    until: float
    usable_bytes: int
    max_concurrent_starts: int
    defaults: dict[str, Any]
    settings: dict[str, Any]  # recorded overrides at `since`
    deployments: dict[str, DeploymentState]  # at `since`
    changes: list[Change]
    traffic: list[TrafficRecord]  # by arrival
    starts: dict[str, list[float]]  # recorded cold start durations per deployment
    launches: dict[str, list[float]]  # recorded launches (process or container made)
    stops: dict[str, list[float]]  # recorded stops (decision to memory free)
    names: dict[str, str]  # deployment id -> name (all, removed ones too)
    records: list[m.Recorded]  # the window's events (for the recorded column)
    dropped_requests: int = 0
    # What the recorded box's learned policy knew at `since`: each deployment's traffic
    # over the trace's last two weeks before it (`actors.anticipation.Traffic`).
    prior: dict[str, Traffic] = field(default_factory=dict)
    # ... and the cold starts it had timed then (its pre-warms' lead).
    prior_starts: dict[str, list[float]] = field(default_factory=dict)


async def load_history(
    path: str | os.PathLike[str],
    *,
    since: float | None = None,
    until: float | None = None,
    deployment: str | None = None,
) -> History:
    """The log's box, changes and traffic between `since` and `until` (epoch seconds)."""
    try:
        store = await EventStore.open(path, create=False, readonly=True)
    except StorageError as exc:
        raise WhatIfError(str(exc)) from exc
    try:
        records = await store.read()
    finally:
        await store.close()
    if not records:
        raise WhatIfError(f"{os.fspath(path)}: the event log is empty")
    started = [r for r in records if isinstance(r.event, m.TraceStarted)]
    batches = [r for r in records if isinstance(r.event, m.TrafficRecorded)]
    if not started or not batches:
        raise WhatIfError(
            f"{os.fspath(path)}: no traffic trace in this log (written by a DGXMM before"
            " the trace, or no request came through the gateway)"
        )
    traffic: list[TrafficRecord] = []
    dropped = 0
    for rec in batches:
        assert isinstance(rec.event, m.TrafficRecorded)
        traffic.extend(decode_batch(rec.event))
        dropped += rec.event.dropped_requests
    traffic.sort(key=lambda r: r.arrived)
    first_arrival = traffic[0].arrived if traffic else records[0].ts
    lo = since if since is not None else min(first_arrival, started[0].ts)
    hi = until if until is not None else max(records[-1].ts, traffic[-1].arrived if traffic else 0)
    if hi <= lo:
        raise WhatIfError("--until must be after --since")
    box = [r for r in started if r.ts <= max(lo, started[0].ts)][-1].event
    assert isinstance(box, m.TraceStarted)
    state = EMPTY
    changes: list[Change] = []
    names: dict[str, str] = {}
    for rec in records:
        ev = rec.event
        if isinstance(ev, m.DeploymentCreated):
            names[ev.deployment_id] = ev.name
        if rec.ts < lo:
            state = evolve(state, rec)
        elif rec.ts <= hi and _is_change(rec):
            dep_id = rec.stream.partition(":")[2] if rec.stream.startswith("deployment:") else None
            changes.append(Change(rec.ts, ev, dep_id))
    window = [r for r in records if lo <= r.ts <= hi]
    starts = _recorded_starts(records)
    prior_starts = _recorded_starts(r for r in records if r.ts < lo)
    launches, stops = _recorded_launches_and_stops(records)
    prior: dict[str, Traffic] = {}
    for r in traffic:
        if r.arrived >= lo:
            break
        if r.arrived >= lo - HISTORY_S:
            known = prior.get(r.deployment_id)
            if known is None:
                known = prior[r.deployment_id] = Traffic()
            known.observe(*traced(r))
    traffic = [r for r in traffic if lo <= r.arrived <= hi]
    if deployment is not None:
        wanted = {i for i, n in names.items() if deployment in (i, n)}
        if not wanted:
            raise WhatIfError(f"--deployment {deployment}: no such deployment in the log")
        traffic = [r for r in traffic if r.deployment_id in wanted]
    if not traffic:
        raise WhatIfError("no traced request in the window")
    return History(
        since=lo,
        until=hi,
        usable_bytes=box.usable_bytes,
        max_concurrent_starts=box.max_concurrent_starts,
        defaults={**DEFAULT_SETTINGS, **box.defaults},
        settings=dict(state.settings),
        deployments=dict(state.deployments),
        changes=changes,
        traffic=traffic,
        starts=starts,
        launches=launches,
        stops=stops,
        names=names,
        records=window,
        dropped_requests=dropped,
        prior=prior,
        prior_starts=prior_starts,
    )


def _is_change(rec: m.Recorded) -> bool:
    ev = rec.event
    if isinstance(ev, m.DeploymentCreated | m.DeploymentRemoved | m.SettingsChanged):
        return True
    return isinstance(ev, m.ModeChanged) and rec.actor.startswith("admin:")


def _recorded_starts(records: Iterable[m.Recorded]) -> dict[str, list[float]]:
    """Seconds from each engine's launch (`EngineStarting`: the memory granted, so a start
    that waited for another's is not counted longer) to its readiness, per deployment."""
    asked: dict[str, float] = {}
    starts: dict[str, list[float]] = defaultdict(list)
    for rec in records:
        ev = rec.event
        dep = rec.stream.partition(":")[2]
        if isinstance(ev, m.EngineStarting):
            asked[dep] = rec.ts
        elif isinstance(ev, m.EngineReady) and dep in asked:
            starts[dep].append(rec.ts - asked.pop(dep))
        elif isinstance(ev, m.EngineStartFailed | m.EngineLost | m.StopRequested):
            asked.pop(dep, None)
    return dict(starts)


def _recorded_launches_and_stops(
    records: Iterable[m.Recorded],
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per deployment, the seconds each launch took (the runtime's launch call, which begins
    once the memory is free, to `EngineStarting`: the process or container made) and each
    stop (`PutToSleep` or `StopRequested` to `EngineStopped`: the memory free again; not the
    box's own shutdown, which stops every engine at once)."""
    launches: dict[str, list[float]] = defaultdict(list)
    stops: dict[str, list[float]] = defaultdict(list)
    asked: dict[str, float] = {}
    for rec in records:
        ev = rec.event
        dep = rec.stream.partition(":")[2]
        if isinstance(ev, m.EngineStarting) and ev.launch_began_at is not None:
            launches[dep].append(max(0.0, rec.ts - ev.launch_began_at))
        elif isinstance(ev, m.PutToSleep) or (
            isinstance(ev, m.StopRequested) and ev.reason != "shutdown"
        ):
            asked.setdefault(dep, rec.ts)
        elif isinstance(ev, m.StopRequested):
            asked.pop(dep, None)
        elif isinstance(ev, m.EngineStopped) and dep in asked:
            stops[dep].append(rec.ts - asked.pop(dep))
        elif isinstance(ev, m.EngineLost | m.EngineStartFailed):
            asked.pop(dep, None)
    return dict(launches), dict(stops)


def _median(per_deployment: dict[str, list[float]], deployment_id: str, default: float) -> float:
    """The median of the deployment's own figures, else of all, else `default`."""
    own = per_deployment.get(deployment_id)
    if own:
        return statistics.median(own)
    every = [s for v in per_deployment.values() for s in v]
    return statistics.median(every) if every else default


def start_seconds(history: History, deployment_id: str) -> float:
    """A model's simulated cold start: the median of its recorded starts (else of all)."""
    return _median(history.starts, deployment_id, DEFAULT_START_S)


def launch_seconds(history: History, deployment_id: str) -> float:
    """A model's simulated launch: the median of its recorded launches (else of all, else 0)."""
    return _median(history.launches, deployment_id, 0.0)


def stop_seconds(history: History, deployment_id: str) -> float:
    """A model's simulated stop: the median of its recorded stops (else of all, else 0)."""
    return _median(history.stops, deployment_id, 0.0)


# --- settings ------------------------------------------------------------------------------


def parse_overrides(history: History, pairs: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings checked against the log's deployments and the settings' ranges;
    raises WhatIfError naming the bad one."""
    by_name = {n: i for i, n in history.names.items()}
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key:
            raise WhatIfError(f"--set {pair}: expected key=value")
        value: Any = None if raw in ("null", "none", "") else raw
        if "." not in key:
            if key not in DEFAULT_SETTINGS:
                raise WhatIfError(f"--set {key}: not a setting")
            if key == "ondemand_policy":
                if value not in _POLICIES:
                    raise WhatIfError(f"--set {key}: seed or learned")
                out[key] = value
                continue
            try:
                checked = validate_settings({key: _int(key, value)})
            except Refusal as exc:
                raise WhatIfError(f"--set {exc.message}") from exc
            out[key] = checked[key]
            continue
        name, _, sub = key.rpartition(".")
        dep_id = by_name.get(name, name if name in history.names else None)
        if dep_id is None:
            raise WhatIfError(f"--set {key}: no deployment {name} in the log")
        if sub not in DEPLOYMENT_KEYS:
            raise WhatIfError(
                f"--set {key}: not a deployment setting ({', '.join(DEPLOYMENT_KEYS)})"
            )
        if sub == "mode":
            if value not in _MODES:
                raise WhatIfError(f"--set {key}: on_demand or always_on")
        elif sub == "ondemand_policy":
            if value is not None and value not in _POLICIES:
                raise WhatIfError(f"--set {key}: seed, learned or null (the default)")
        elif sub == "idle_timeout_s":
            value = _int(key, value)
            if value is not None and not 60 <= value <= 86400:
                raise WhatIfError(f"--set {key}: null or 60 to 86400 seconds")
        else:
            value = _int(key, value)
            if value is not None and not 0 <= value <= 86400:
                raise WhatIfError(f"--set {key}: null or 0 to 86400 seconds")
        out[f"{dep_id}.{sub}"] = value
    return out


def _int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise WhatIfError(f"--set {key}: an integer, not {value!r}") from None
