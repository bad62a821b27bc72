"""Runs the real controller (deployment actors, queue, broker) on the virtual clock.

The event log is a real SQLite file; engines are simulated (`simulations.runtime`).  Tests
and the fairness simulations drive it: deploy models, send requests that hold the model for
a while, advance time, and read what happened from the log.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from typing import Any

import msgspec

from actors.admission import Refused
from actors.controller import Controller, DeploymentSpec
from actors.deployment import LeaseImpl
from actors.memory_broker import GIB, MemoryBroker
from actors.ports import EngineHandle, LaunchSpec
from actors.runtime import VirtualClock
from events import model as m
from events.state import DeploymentState
from simulations.runtime import EngineBehaviour, SimProbe, SimRuntime
from storage.eventlog import EventStore


def sim_launch_spec(dep: DeploymentState) -> LaunchSpec:
    """The launch spec of a simulated deployment."""
    return LaunchSpec(
        deployment_id=dep.deployment_id,
        name=dep.name,
        engine=dep.engine,
        image="dgxmm-sim:local",
        argv=["sim", dep.model],
        port=8000,
        memory_bytes=dep.memory_bytes,
    )


class RequestResult(msgspec.Struct, kw_only=True):
    """What one simulated client saw."""

    request_id: str
    deployment_id: str
    arrived: float
    outcome: str = "pending"  # "served" | an error code | "client_gone"
    queued: bool = False  # got the queued line (really queued for memory)
    admitted_at: float | None = None
    finished_at: float | None = None
    message: str = ""
    retry_after: int | None = None
    waiting_before: int | None = None  # requests already waiting when it tried to wait

    @property
    def waited(self) -> float:
        """Seconds from arrival to admission (or to the end when refused)."""
        end = self.admitted_at if self.admitted_at is not None else self.finished_at
        return 0.0 if end is None else end - self.arrived


class DirectCall(msgspec.Struct, kw_only=True):
    """A call straight to an engine's port: the engine's metrics show it, the gateway not."""

    deployment_id: str
    runtime_id: str
    start: float
    end: float


class _SlowStopRuntime(SimRuntime):
    """A simulated runtime whose engines take `stop_s` to go away (and free their memory)."""

    def __init__(
        self,
        clock: VirtualClock,
        behaviour: Callable[[LaunchSpec], EngineBehaviour] | None,
        stop_s: float,
    ) -> None:
        super().__init__(clock, behaviour)
        self.stop_s = stop_s

    async def stop(self, handle: EngineHandle, timeout_s: float = 30.0) -> None:
        """Stop it after `stop_s` of virtual time (idempotent)."""
        await self.clock.sleep(self.stop_s)
        await super().stop(handle, timeout_s)


class Harness:
    """One simulated box."""

    def __init__(
        self,
        clock: VirtualClock,
        store: EventStore,
        runtime: SimRuntime,
        broker: MemoryBroker,
        controller: Controller,
    ) -> None:
        self.clock = clock
        self.store = store
        self.runtime = runtime
        self.broker = broker
        self.controller = controller
        self.results: list[RequestResult] = []
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.max_launched = 0
        self.violations: list[str] = []
        self.in_flight: dict[str, int] = {}  # leases the simulated clients hold, per deployment
        self.direct_calls: list[DirectCall] = []

    @classmethod
    async def create(
        cls,
        db_path: str | os.PathLike[str],
        *,
        usable_gib: float = 100,
        behaviour: Callable[[LaunchSpec], EngineBehaviour] | None = None,
        settings: dict[str, Any] | None = None,
        max_concurrent_starts: int = 1,
        broker_cls: type[MemoryBroker] = MemoryBroker,
        plain_fifo: bool = False,
        stop_s: float = 0.0,
    ) -> Harness:
        """A fresh box with an empty log at `db_path`.

        `broker_cls` lets property tests watch the real broker through a subclass;
        `plain_fifo` turns the queue's go-ahead rule off (for fairness comparisons);
        `stop_s` is how long an engine takes to stop (memory is freed only then).
        """
        clock = VirtualClock()
        store = await EventStore.open(db_path, wall=clock.wall)
        clock.add_busy_check(store.busy)
        runtime = (
            SimRuntime(clock, behaviour)
            if stop_s <= 0
            else _SlowStopRuntime(clock, behaviour, stop_s)
        )
        usable = int(usable_gib * GIB)
        broker = broker_cls(usable, usable, max_concurrent_starts=max_concurrent_starts)
        controller = Controller(
            store=store,
            clock=clock,
            runtime=runtime,
            probe=SimProbe(runtime),
            broker=broker,
            launch_spec=sim_launch_spec,
            defaults=settings,
        )
        controller.queue.plain_fifo = plain_fifo
        await controller.load()
        harness = cls(clock, store, runtime, broker, controller)
        controller.add_listener(harness._check_invariants)
        return harness

    def _check_invariants(self, deployment_id: str, what: str) -> None:
        launched = self.broker.launched_total()
        self.max_launched = max(self.max_launched, launched)
        if launched > self.broker.usable_bytes:
            self.violations.append(
                f"memory over budget at {self.clock.now():.1f}: {launched} > "
                f"{self.broker.usable_bytes}"
            )
        if len(self.controller.queue) > int(self.controller.setting("ondemand_max_queued")):
            self.violations.append(f"queue over its cap at {self.clock.now():.1f}")

    async def deploy(
        self,
        name: str,
        gib: float,
        *,
        mode: m.Mode = "on_demand",
        idle_timeout_s: int | None = None,
        role: m.Role = "model",
        engine: str = "sim",
    ) -> str:
        """Create a deployment (it starts right away, like any deployment)."""
        rec = await self.controller.create(
            DeploymentSpec(
                name=name,
                engine=engine,
                model=f"org/{name}",
                memory_bytes=int(gib * GIB),
                mode=mode,
                idle_timeout_s=idle_timeout_s,
                role=role,
            ),
            actor="admin:test",
        )
        await self.clock.settle()
        return rec.id

    def request(
        self, deployment_id: str, hold_s: float = 1.0, *, hang_up_after_s: float | None = None
    ) -> RequestResult:
        """Send a request now; it holds the model for `hold_s` once admitted."""
        rid = f"r{next(self._ids)}"
        result = RequestResult(
            request_id=rid, deployment_id=deployment_id, arrived=self.clock.now()
        )
        self.results.append(result)
        task = asyncio.get_running_loop().create_task(self._client(result, hold_s, hang_up_after_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return result

    async def call(
        self, deployment_id: str, hold_s: float = 1.0, *, hang_up_after_s: float | None = None
    ) -> RequestResult:
        """Send a request now and wait until it ended (closed-loop clients, like agents)."""
        rid = f"r{next(self._ids)}"
        result = RequestResult(
            request_id=rid, deployment_id=deployment_id, arrived=self.clock.now()
        )
        self.results.append(result)
        await self._client(result, hold_s, hang_up_after_s)
        return result

    def direct_call(self, deployment_id: str, duration_s: float) -> DirectCall | None:
        """A call straight to the engine's port for `duration_s`; None when no engine runs."""
        engine = self.runtime.engine_of(deployment_id)
        if engine is None:
            return None
        now = self.clock.now()
        call = DirectCall(
            deployment_id=deployment_id,
            runtime_id=engine.handle.runtime_id,
            start=now,
            end=now + duration_s,
        )
        self.direct_calls.append(call)
        engine.running_requests += 1

        def done() -> None:
            engine.running_requests = max(0, engine.running_requests - 1)

        self.clock.call_later(duration_s, done)
        return call

    async def _client(self, result: RequestResult, hold_s: float, hang_up: float | None) -> None:
        arrived = self.clock.wall()
        try:
            await self._exchange(result, hold_s, hang_up)
        finally:
            # What the gateway's traffic trace records of it (at its end, as a flush would).
            self.controller.prewarmer.observe(
                result.deployment_id, arrived, self.clock.wall(), result.waited
            )

    async def _exchange(self, result: RequestResult, hold_s: float, hang_up: float | None) -> None:
        c = self.controller
        lease: LeaseImpl | None = c.try_acquire(result.deployment_id)
        try:
            if lease is None:
                result.waiting_before = len(c.queue)
                waiter = c.enqueue(result.deployment_id, result.request_id)
                result.queued = waiter.queued.is_set()
                if hang_up is None:
                    lease = await waiter.wait()
                else:
                    lease = await self._wait_virtual(waiter, hang_up)
                result.queued = result.queued or waiter.queued.is_set()
                if lease is None:
                    waiter.cancel()
                    result.outcome = "client_gone"
                    result.finished_at = self.clock.now()
                    return
        except Refused as exc:
            result.outcome = exc.code
            result.message = exc.message
            result.retry_after = exc.retry_after
            result.finished_at = self.clock.now()
            return
        result.admitted_at = self.clock.now()
        dep_id = result.deployment_id
        self.in_flight[dep_id] = self.in_flight.get(dep_id, 0) + 1
        # The engine answers it, and its metrics count it, as a real engine's do.
        engine = self.runtime.engines.get(lease.handle.runtime_id)
        if engine is not None:
            engine.running_requests += 1
        try:
            await self.clock.sleep(hold_s)
        finally:
            self.in_flight[dep_id] -= 1
            if engine is not None:
                engine.running_requests = max(0, engine.running_requests - 1)
            lease.release()
        result.outcome = "served"
        result.finished_at = self.clock.now()

    async def _wait_virtual(self, waiter: Any, hang_up_s: float) -> LeaseImpl | None:
        wait = asyncio.ensure_future(waiter.wait())
        timer = asyncio.ensure_future(self.clock.sleep(hang_up_s))
        done, _ = await asyncio.wait({wait, timer}, return_when=asyncio.FIRST_COMPLETED)
        if wait in done:
            timer.cancel()
            lease: LeaseImpl = wait.result()
            return lease
        wait.cancel()
        return None

    async def advance(self, seconds: float) -> None:
        """Move virtual time forward."""
        await self.clock.advance(seconds)

    def state(self, deployment_id: str) -> str:
        """A deployment's lifecycle state value."""
        return self.controller.actors[deployment_id].state.lifecycle.value

    async def events(self) -> list[m.Recorded]:
        """The whole log."""
        await self.clock.settle()
        return await self.store.read()

    async def close(self) -> None:
        """Stop everything."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.controller.close()
        await self.store.close()
