"""What if: the box's own recorded traffic through the real actors, under other settings.

`load_history` reads an event log: the box as it was at `since` (its memory budget and
configured defaults from `TraceStarted`, its deployments, modes and settings), the
administrators' changes after it (deployments created and removed, mode and settings
changes), every request of the traffic trace in the window (`events.traffic`), and each
model's recorded launches, starts and stops.  `simulate` replays that history on the virtual
clock through the real controller (deployment actors, queue, broker) with simulated engines:
the same arrivals, each holding its model for its recorded service time (arrival to end less
its wait), and each model's swaps taking the medians of its own recorded launches, starts
(`EngineStarting` to `EngineReady`) and stops (a model with none takes the median of all),
its engine's metrics reporting the requests in flight, scraped as on the box.
`overrides` change settings: global keys (`ondemand_make_room_after_s=30`) or a deployment's
own (`coder.idle_timeout_s=600`, `chat.mode=always_on`, `chat.make_room_after_s=0`).
`measure_recorded` and `simulate` both yield a `Report`, so the recorded column and the
simulated ones are measured by the same code.

Cheap where the traffic is: a request to a ready model takes its lease synchronously and its
release is a timer of our own, so time moves on without running the event loop; the loop
runs (the actors react) only when something waits or a timer of the actors falls due.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from actors.admission import Refused
from actors.controller import DEFAULT_SETTINGS, Controller, DeploymentSpec, validate_settings
from actors.deployment import Refusal
from actors.memory_broker import GIB, MemoryBroker
from actors.ports import EngineHandle, LaunchSpec
from actors.readiness import whole_seconds
from actors.runtime import VirtualClock
from events import model as m
from events.state import EMPTY, DeploymentState, Lifecycle, evolve
from events.traffic import TrafficRecord, decode_batch
from simulations.fairness import Waits, jain, waits
from simulations.harness import sim_launch_spec
from simulations.runtime import EngineBehaviour, SimProbe, SimRuntime
from storage.errors import StorageError
from storage.eventlog import EventStore

DEFAULT_START_S = 30.0  # a model with no recorded start, on a box with none at all
DEPLOYMENT_KEYS = {"idle_timeout_s", "mode", "make_room_after_s"}
_MODES = ("on_demand", "always_on")
# Before the window: the deployments of `since` are created and warmed up this long.
WARM_UP_S = 3600.0
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the simulation's log: no fsync


class WhatIfError(Exception):
    """The log cannot answer (empty, foreign, no trace), or a setting is wrong."""


# --- the history ---------------------------------------------------------------------------


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
    launches, stops = _recorded_launches_and_stops(records)
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


# --- the report ----------------------------------------------------------------------------


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


class _Outcome(msgspec.Struct, gc=False):
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
    outcomes: list[_Outcome],
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


def _memory(history: History) -> dict[str, int]:
    mem = {d: s.memory_bytes for d, s in history.deployments.items()}
    for change in history.changes:
        if isinstance(change.event, m.DeploymentCreated):
            mem[change.event.deployment_id] = change.event.memory_bytes
    return mem


def measure_recorded(history: History) -> Report:
    """What really happened, measured as the simulations are."""
    outcomes = [
        _Outcome(
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
        _memory(history),
        history.since,
        history.until,
    )


# --- the simulation ------------------------------------------------------------------------


def tenths_then_seconds(age_s: float) -> float:
    """The probe schedule of the what-if's engines: every 0.1 s for 10 s, then every second.
    Recorded starts already hold the real probe's small delay (`actors.readiness`); the
    simulated harness's whole seconds would add up to one more second to each cold start."""
    if age_s < 10.0:
        return (math.floor(age_s * 10 + 1e-6) + 1) / 10
    return whole_seconds(age_s)


def on_probe_grid(seconds: float) -> float:
    """The last age `tenths_then_seconds` probes at that is not after `seconds`."""
    if seconds < 10.0:
        return math.floor(seconds * 10 + 1e-6) / 10
    return float(math.floor(seconds + 1e-9))


class _QuickClock(VirtualClock):
    """The virtual clock, settling in one quiet round of the loop instead of three where the
    loop shows its ready queue (asyncio's own loop): a timer of an actor costs the week's
    simulation one loop round, not three."""

    async def settle(self) -> None:
        """Let the loop run until nothing is ready and no busy check holds."""
        loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)
        if ready is None:
            await super().settle()
            return
        while True:
            await asyncio.sleep(0)
            if ready:
                continue
            if not any(check() for check in self.busy_checks):
                return
            await asyncio.sleep(0.0002)  # work runs in a thread: give it real time


class _RecordedRuntime(SimRuntime):
    """Simulated engines that take their model's recorded times (medians): a launch (the
    process made, once the memory is free), a start (launch to ready) and a stop (decision
    to memory free).  A swap on the box is the victim's stop, then the launch, then the
    start; the next model waits for all three, and so does a request for a model being
    stopped, which must stop before it can start again."""

    def __init__(self, clock: VirtualClock, history: History, recorded: Callable[..., str]) -> None:
        super().__init__(clock, self._behaviour)
        self.history = history
        self.recorded = recorded  # simulated id (and name) -> recorded id

    def _behaviour(self, spec: LaunchSpec) -> EngineBehaviour:
        dep = self.recorded(spec.deployment_id, spec.name)
        return EngineBehaviour(startup_s=on_probe_grid(start_seconds(self.history, dep)))

    async def launch(self, spec: LaunchSpec) -> EngineHandle:
        """Make the engine after the model's recorded launch time.  The simulated probe asks
        every 0.1 s (`tenths_then_seconds`), so the engine's start is put on its grid and
        the rest of the recorded start is spent here: the engine is seen ready exactly the
        recorded launch and start after the launch began, not up to a probe period later."""
        dep = self.recorded(spec.deployment_id, spec.name)
        start = start_seconds(self.history, dep)
        took = launch_seconds(self.history, dep) + start - on_probe_grid(start)
        if took > 0:
            await self.clock.sleep(took)
        return await super().launch(spec)

    async def stop(self, handle: EngineHandle, timeout_s: float = 30.0) -> None:
        """Stop it after the model's recorded stop time."""
        engine = self.engines.get(handle.runtime_id)
        took = stop_seconds(self.history, self.recorded(handle.deployment_id))
        if took > 0 and engine is not None and engine.alive(self.clock.now()):
            await self.clock.sleep(took)
        await super().stop(handle, timeout_s)


class _FineProbe(SimProbe):
    """The simulated engines' probe, on the box's schedule of readiness probes.  It has no
    metrics to tell: the replay's engines answer only the replay's requests, and the idle
    rules count only the requests an engine reports beyond the gateway's own
    (`actors.deployment.direct_calls`), so the box's scrapes of the same traffic decide
    nothing either (and the simulation runs no monitor: `watch_engines=False`)."""

    probe_schedule = staticmethod(tenths_then_seconds)


@dataclass
class _Sim:
    clock: VirtualClock
    store: EventStore
    controller: Controller
    origin: float  # virtual now = epoch - origin
    releases: list[tuple[float, int, Any]] = field(default_factory=list)
    outcomes: list[_Outcome] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    seq: int = 0


async def simulate(
    history: History,
    overrides: dict[str, Any] | None = None,
    *,
    label: str = "simulated",
    progress: Callable[[float], None] | None = None,
    db_dir: str | None = None,
) -> Report:
    """The window's traffic through the real actors under `overrides`."""
    overrides = overrides or {}
    own = {k: v for k, v in overrides.items() if "." not in k}
    per_dep: dict[str, dict[str, Any]] = defaultdict(dict)
    for key, value in overrides.items():
        if "." in key:
            dep, _, sub = key.rpartition(".")
            per_dep[dep][sub] = value
    folder = db_dir or _SHM
    with tempfile.TemporaryDirectory(prefix="dgxmm-whatif-", dir=folder) as tmp:
        origin = history.since - WARM_UP_S
        clock = _QuickClock(start=0.0, wall_start=origin)
        store = await EventStore.open(Path(tmp) / "sim.db", wall=clock.wall, scratch=True)
        clock.add_busy_check(store.busy)

        # The simulated box names its deployments anew: an engine finds its model's own
        # recorded times through the recorded id (`ids`: recorded -> simulated, filled as
        # the deployments are created), or through its name when its creation launched it
        # before the id was known (the latest deployment of that name: the one created).
        ids: dict[str, str] = {}
        by_name = {name: dep_id for dep_id, name in history.names.items()}

        def recorded(sim_id: str, name: str = "") -> str:
            found = next((r for r, s in ids.items() if s == sim_id), None)
            return found if found is not None else by_name.get(name, sim_id)

        runtime = _RecordedRuntime(clock, history, recorded)
        probe = _FineProbe(runtime)
        broker = MemoryBroker(
            history.usable_bytes,
            history.usable_bytes,
            max_concurrent_starts=history.max_concurrent_starts,
        )
        controller = Controller(
            store=store,
            clock=clock,
            runtime=runtime,
            probe=probe,
            broker=broker,
            launch_spec=sim_launch_spec,
            defaults={**history.defaults, **history.settings, **own},
            watch_engines=False,  # its engines cannot exit, hang or carry direct calls
        )
        await controller.load()
        sim = _Sim(clock, store, controller, origin)
        try:
            await _seed(sim, history, per_dep, ids)
            await _run(sim, history, ids, per_dep, own, progress)
            records = await store.read()
        finally:
            for task in list(sim.tasks):
                task.cancel()
            await asyncio.gather(*sim.tasks, return_exceptions=True)
            await controller.close()
            await store.close()
    sim_ids = {v: k for k, v in ids.items()}  # simulated id -> recorded id
    for o in sim.outcomes:
        o.deployment_id = sim_ids.get(o.deployment_id, o.deployment_id)
    recs = [
        msgspec.structs.replace(r, stream=_restream(r.stream, sim_ids))
        for r in records
        if history.since <= r.ts <= history.until
    ]
    return build_report(
        label, sim.outcomes, recs, dict(history.names), _memory(history),
        history.since, history.until,
    )  # fmt: skip


def _restream(stream: str, sim_ids: dict[str, str]) -> str:
    if stream.startswith("deployment:"):
        dep = stream.partition(":")[2]
        return f"deployment:{sim_ids.get(dep, dep)}"
    return stream


def _spec(dep: DeploymentState | m.DeploymentCreated, own: dict[str, Any]) -> DeploymentSpec:
    mode = own.get("mode", dep.mode)
    return DeploymentSpec(
        name=dep.name,
        engine="sim",
        model=dep.model,
        memory_bytes=dep.memory_bytes,
        mode=mode,
        idle_timeout_s=own.get("idle_timeout_s", dep.idle_timeout_s),
        role=dep.role,
        make_room_after_s=own.get("make_room_after_s", dep.make_room_after_s),
    )


async def _seed(
    sim: _Sim, history: History, per_dep: dict[str, dict[str, Any]], ids: dict[str, str]
) -> None:
    """The deployments of `since`, warmed up: those ready then are ready at the window's
    start, the others stopped.  Fills `ids`: recorded id -> simulated id."""
    for dep_id, dep in sorted(history.deployments.items(), key=lambda kv: kv[1].created_at):
        rec = await sim.controller.create(_spec(dep, per_dep.get(dep_id, {})), actor="admin:whatif")
        ids[dep_id] = rec.id
    await sim.clock.advance(WARM_UP_S / 2)
    for dep_id, dep in history.deployments.items():
        if dep.lifecycle is not Lifecycle.READY and dep.mode == "on_demand":
            actor = sim.controller.actors.get(ids[dep_id])
            if actor is not None and actor.state.lifecycle is not Lifecycle.STOPPED:
                await sim.controller.stop(ids[dep_id], actor="admin:whatif")
    await sim.clock.advance_to(history.since - sim.origin)


async def _run(
    sim: _Sim,
    history: History,
    ids: dict[str, str],
    per_dep: dict[str, dict[str, Any]],
    own: dict[str, Any],
    progress: Callable[[float], None] | None,
) -> None:
    changes = sorted(history.changes, key=lambda c: c.at)
    ci = 0
    service = _services(history)
    total = len(history.traffic)
    step = max(1, total // 200)
    for n, rec in enumerate(history.traffic):
        t = rec.arrived - sim.origin
        if ci < len(changes) and changes[ci].at - sim.origin <= t:
            ci = await _changes_until(sim, changes, ci, t, ids, per_dep, own)
        await _advance(sim, t)
        dep = ids.get(rec.deployment_id)
        if dep is None:
            continue
        hold = (
            rec.service_s
            if rec.outcome in ("served", "engine_error", "client_gone")
            else (service.get(rec.deployment_id, 1.0))
        )
        lease = sim.controller.try_acquire(dep)
        if lease is not None:
            _hold(sim, lease, hold)
            sim.outcomes.append(
                _Outcome(
                    rec.request_id, dep, 0.0, False, "served", (rec.arrived, rec.arrived + hold)
                )
            )
        else:
            task = asyncio.get_running_loop().create_task(_wait(sim, dep, rec, hold))
            sim.tasks.add(task)
            task.add_done_callback(sim.tasks.discard)
            await sim.clock.settle()
        if progress is not None and n % step == 0:
            progress(n / total)
    await _changes_until(sim, changes, ci, math.inf, ids, per_dep, own)
    await _advance(sim, history.until - sim.origin)
    # Requests still waiting at the window's end count with their wait so far.
    for task in list(sim.tasks):
        task.cancel()
    await asyncio.gather(*sim.tasks, return_exceptions=True)
    await sim.clock.settle()
    if progress is not None:
        progress(1.0)


async def _changes_until(
    sim: _Sim,
    changes: list[Change],
    ci: int,
    t: float,
    ids: dict[str, str],
    per_dep: dict[str, dict[str, Any]],
    own: dict[str, Any],
) -> int:
    """Apply the changes from index `ci` up to virtual time `t`; the next index."""
    while ci < len(changes) and changes[ci].at - sim.origin <= t:
        await _advance(sim, changes[ci].at - sim.origin)
        await _apply(sim, changes[ci], ids, per_dep, own)
        ci += 1
    return ci


def _services(history: History) -> dict[str, float]:
    by: dict[str, list[float]] = defaultdict(list)
    for r in history.traffic:
        if r.outcome == "served":
            by[r.deployment_id].append(r.service_s)
    return {d: statistics.median(v) for d, v in by.items()}


def _hold(sim: _Sim, lease: Any, hold: float) -> None:
    sim.seq += 1
    heapq.heappush(sim.releases, (sim.clock.now() + hold, sim.seq, lease))


async def _advance(sim: _Sim, target: float) -> None:
    """Time to `target`: our releases and the actors' timers in their order; the loop runs
    only when a timer falls due or something waits."""
    clock, releases, controller = sim.clock, sim.releases, sim.controller
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    while True:
        nxt = releases[0][0] if releases else math.inf
        timer = clock.next_deadline()
        timer = math.inf if timer is None else timer
        if min(nxt, timer) > target:
            break
        if nxt <= timer:
            _, _, lease = heapq.heappop(releases)
            clock.jump_to(nxt)
            lease.release()
            # The release may have told an actor something (the queue re-checks): run the
            # loop then, and only then (asyncio's loop shows its ready queue; uvloop not).
            if ready or (ready is None and (sim.tasks or len(controller.queue))):
                await clock.settle()
        else:
            await clock.step()
    clock.jump_to(target)


async def _wait(sim: _Sim, dep: str, rec: TrafficRecord, hold: float) -> None:
    arrived = rec.arrived
    try:
        waiter = sim.controller.enqueue(dep, str(rec.request_id))
    except Refused as exc:
        outcome = "queue_full" if exc.code == "ondemand_queue_full" else "refused"
        sim.outcomes.append(_Outcome(rec.request_id, dep, 0.0, True, outcome, None))
        return
    try:
        lease = await waiter.wait()
    except Refused as exc:
        now = sim.clock.wall()
        timed_out = exc.code == "ondemand_queue_timeout"
        outcome = "queue_timeout" if timed_out else "refused"
        sim.outcomes.append(_Outcome(rec.request_id, dep, now - arrived, True, outcome, None))
        return
    except asyncio.CancelledError:  # still waiting when the window closed
        waiter.cancel()
        now = sim.clock.wall()
        sim.outcomes.append(_Outcome(rec.request_id, dep, now - arrived, True, "waiting", None))
        raise
    now = sim.clock.wall()
    _hold(sim, lease, hold)
    sim.outcomes.append(
        _Outcome(rec.request_id, dep, now - arrived, True, "served", (now, now + hold))
    )


async def _apply(
    sim: _Sim,
    change: Change,
    ids: dict[str, str],
    per_dep: dict[str, dict[str, Any]],
    own: dict[str, Any],
) -> None:
    """An administrator's recorded change, as the alternative's overrides leave it."""
    ev, c = change.event, sim.controller
    try:
        if isinstance(ev, m.DeploymentCreated):
            rec = await c.create(_spec(ev, per_dep.get(ev.deployment_id, {})), actor="admin:whatif")
            ids[ev.deployment_id] = rec.id
        elif isinstance(ev, m.DeploymentRemoved) and change.deployment_id in ids:
            await c.remove(ids[change.deployment_id], actor="admin:whatif")
        elif isinstance(ev, m.SettingsChanged):
            changes = {k: v for k, v in ev.changes.items() if k not in own}
            if changes:
                await c.change_settings(changes, actor="admin:whatif")
        elif isinstance(ev, m.ModeChanged) and change.deployment_id in ids:
            fixed = per_dep.get(change.deployment_id, {})
            if "mode" not in fixed:
                await c.change_mode(
                    ids[change.deployment_id],
                    ev.mode,
                    fixed.get("idle_timeout_s", ev.idle_timeout_s),
                    False,
                    actor="admin:whatif",
                )
    except Exception:  # policy: a change the simulated box refuses is skipped, as it was not made
        return
    await sim.clock.settle()
