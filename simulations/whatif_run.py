"""The what-if's run: a `History`'s traffic replayed on the virtual clock under other settings.

It runs through the real controller (deployment actors, queue, broker) with simulated engines.

`simulate` replays the same arrivals, each holding its model for its recorded service time
(arrival to end less its wait), and each model's swaps taking the medians of its own
recorded launches, starts (`EngineStarting` to `EngineReady`) and stops (a model with none
takes the median of all), probed on the box's schedule (`tenths_then_seconds`).  The
administrators' recorded changes are replayed at their times, as the alternative's
`overrides` leave them.  The outcomes and events go to `whatif_measure.build_report`.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from actors.admission import Refused
from actors.controller import Controller, DeploymentSpec
from actors.memory_broker import MemoryBroker
from actors.ports import EngineHandle, LaunchSpec
from actors.readiness import whole_seconds
from actors.runtime import VirtualClock
from events import model as m
from events.state import DeploymentState, Lifecycle
from events.traffic import FLUSH_EVERY_S, TrafficRecord
from simulations.harness import sim_launch_spec
from simulations.runtime import EngineBehaviour, SimProbe, SimRuntime
from simulations.whatif_history import (
    Change,
    History,
    WhatIfError,
    launch_seconds,
    start_seconds,
    stop_seconds,
)
from simulations.whatif_measure import (
    SERVED_TRACED,
    Outcome,
    Report,
    build_report,
    deployment_memory,
)
from storage.eventlog import EventStore

# Before the window: the deployments of `since` are created and warmed up this long.
WARM_UP_S = 3600.0
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the simulation's log: no fsync


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
    # Requests ended and not yet heard by the learned policy: (end, seq, deployment,
    # arrival, end as epoch seconds, wait), end in virtual seconds (`_heard`).
    unheard: list[tuple[float, int, str, float, float, float]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
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
            if dep not in history.names:  # `parse_overrides` names them by id
                raise WhatIfError(f"{key}: no deployment {dep!r} in the log (by id)")
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
        label, sim.outcomes, recs, dict(history.names), deployment_memory(history),
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
        ondemand_policy=own.get("ondemand_policy", dep.ondemand_policy),
    )


async def _seed(
    sim: _Sim, history: History, per_dep: dict[str, dict[str, Any]], ids: dict[str, str]
) -> None:
    """The deployments of `since`, warmed up: those ready then are ready at the window's
    start, the others stopped.  Fills `ids`: recorded id -> simulated id."""
    for dep_id, dep in sorted(history.deployments.items(), key=lambda kv: kv[1].created_at):
        rec = await sim.controller.create(_spec(dep, per_dep.get(dep_id, {})), actor="admin:whatif")
        ids[dep_id] = rec.id
        if dep_id in history.prior:  # what its learned policy knew of it then
            sim.controller.prewarmer.adopt(rec.id, history.prior[dep_id])
    await sim.clock.advance(WARM_UP_S / 2)
    for dep_id, sim_id in ids.items():
        # The warm-up's starts are not the recorded box's: its starts then are.
        sim.controller.start_history.reset(sim_id, history.prior_starts.get(dep_id, []))
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
        served_before = rec.outcome in SERVED_TRACED
        if dep is None:  # its deployment does not exist here (its creation was refused)
            sim.outcomes.append(
                Outcome(rec.request_id, rec.deployment_id, 0.0, True, "model_not_found", None,
                        served_before)
            )  # fmt: skip
            continue
        hold = (
            rec.service_s
            if rec.outcome in ("served", "engine_error", "client_gone")
            else (service.get(rec.deployment_id, 1.0))
        )
        lease = sim.controller.try_acquire(dep)
        if lease is not None:
            _hold(sim, lease, hold, dep, rec.arrived)
            sim.outcomes.append(
                Outcome(
                    rec.request_id, dep, 0.0, False, "served", (rec.arrived, rec.arrived + hold),
                    served_before,
                )
            )  # fmt: skip
        else:
            task = asyncio.get_running_loop().create_task(_wait(sim, dep, rec, hold))
            sim.tasks.add(task)
            task.add_done_callback(sim.tasks.discard)
            await sim.clock.settle()
        if progress is not None and n % step == 0:
            progress(n / total)
    await _changes_until(sim, changes, ci, math.inf, ids, per_dep, own)
    await _advance(sim, history.until - sim.origin)
    # Requests still waiting at the window's end wait on until they meet their fate: served,
    # or their queue deadline at the latest (what happens after the window is not measured).
    deadline = float(sim.controller.settings()["ondemand_queue_timeout_s"])
    if sim.tasks:
        await _advance(sim, history.until - sim.origin + deadline + 1.0)
    # One still waiting then (none should) counts as timed out, with its wait so far.
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


def _hold(sim: _Sim, lease: Any, hold: float, dep: str, arrived: float) -> None:
    sim.seq += 1
    heapq.heappush(sim.releases, (sim.clock.now() + hold, sim.seq, lease))
    _heard(sim, dep, arrived, hold)


def _heard(sim: _Sim, dep: str, arrived: float, left_s: float = 0.0) -> None:
    """A request leased now (or never: refused, timed out) that ends `left_s` from now, as
    the simulated box's traffic trace will record it: its learned policy hears it when the
    box's would, at the trace's first flush after its end (`_flush_at`; the flushes' phase
    is the what-if's own), with its simulated span and wait (here, not on the recorded
    box; one never leased waited all its time, as `Prewarmer._feed` reads the box's)."""
    sim.seq += 1
    now = sim.clock.wall()
    end = sim.clock.now() + left_s
    heapq.heappush(sim.unheard, (end, sim.seq, dep, arrived, now + left_s, now - arrived))


def _flush_at(sim: _Sim) -> float:
    """When the trace next tells the learned policy what ended (virtual), or inf."""
    if not sim.unheard:
        return math.inf
    return math.ceil(sim.unheard[0][0] / FLUSH_EVERY_S) * FLUSH_EVERY_S


def _flush(sim: _Sim, at: float) -> None:
    observe = sim.controller.prewarmer.observe
    unheard = sim.unheard
    while unheard and unheard[0][0] <= at:
        _, _, dep, arrived, ended, wait = heapq.heappop(unheard)
        observe(dep, arrived, ended, wait)


async def _advance(sim: _Sim, target: float) -> None:
    """Time to `target`: our releases, the trace's flushes and the actors' timers in their
    order; the loop runs only when a timer falls due or something waits."""
    clock, releases, controller = sim.clock, sim.releases, sim.controller
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    while True:
        nxt = releases[0][0] if releases else math.inf
        timer = clock.next_deadline()
        timer = math.inf if timer is None else timer
        heard = _flush_at(sim)
        if min(nxt, timer, heard) > target:
            break
        if heard < nxt and heard <= timer:  # a release at the flush's instant is in it
            clock.jump_to(heard)
            _flush(sim, heard)
        elif nxt <= timer:
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


def _refusal(exc: Refused) -> str:
    """The outcome code of a refusal: an administrator's stop is a fate of its own (an
    always-on model that could not start is refused, not stopped)."""
    if exc.code == "ondemand_stopped" or (
        exc.code == "deployment_stopped" and "administrator" in exc.message
    ):
        return "stopped"
    return exc.code


async def _wait(sim: _Sim, dep: str, rec: TrafficRecord, hold: float) -> None:
    arrived = rec.arrived
    before = rec.outcome in SERVED_TRACED
    try:
        waiter = sim.controller.enqueue(dep, str(rec.request_id))
    except Refused as exc:
        _heard(sim, dep, arrived)
        sim.outcomes.append(Outcome(rec.request_id, dep, 0.0, True, _refusal(exc), None, before))
        return
    try:
        lease = await waiter.wait()
    except Refused as exc:
        now = sim.clock.wall()
        timed_out = exc.code == "ondemand_queue_timeout"
        outcome = "queue_timeout" if timed_out else _refusal(exc)
        _heard(sim, dep, arrived)
        sim.outcomes.append(
            Outcome(rec.request_id, dep, now - arrived, True, outcome, None, before)
        )
        return
    except asyncio.CancelledError:  # still waiting when the run ended
        waiter.cancel()
        now = sim.clock.wall()
        sim.outcomes.append(
            Outcome(rec.request_id, dep, now - arrived, True, "queue_timeout", None, before)
        )
        raise
    now = sim.clock.wall()
    _hold(sim, lease, hold, dep, arrived)
    sim.outcomes.append(
        Outcome(rec.request_id, dep, now - arrived, True, "served", (now, now + hold), before)
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
                    ondemand_policy=fixed.get("ondemand_policy", ev.ondemand_policy),
                )
    except Exception:  # policy: a change the simulated box refuses is skipped, as it was not made
        return
    await sim.clock.settle()
