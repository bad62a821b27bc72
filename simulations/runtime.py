"""A simulated runtime and engine probe on an injected clock, for tests and simulations.

They follow the real engines' documented behaviour: an engine exists once launched, answers
its readiness probe only after its start-up time (vLLM/SGLang refuse connections until then,
llama.cpp answers "loading"), can fail at start with a log line, can die later, and reports
running/waiting requests in its metrics.  Nothing here touches a socket.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import msgspec

from actors.errors import EngineUnreachable, RuntimeFailure
from actors.ports import EngineHandle, EngineLoad, LaunchSpec, Readiness
from actors.readiness import whole_seconds
from actors.runtime import Clock


class EngineBehaviour(msgspec.Struct, kw_only=True):
    """How one simulated engine behaves when launched."""

    startup_s: float = 30.0
    fail_at_start: str | None = None  # exits with this log line after startup_s
    die_after_s: float | None = None  # exits this long after becoming ready


class SimEngine:
    """One launched simulated engine."""

    def __init__(self, spec: LaunchSpec, handle: EngineHandle, started: float, b: EngineBehaviour):
        self.spec = spec
        self.handle = handle
        self.started = started
        self.behaviour = b
        self.stopped = False
        self.killed = False
        self.running_requests = 0  # requests it answers: the gateway's and direct calls
        self.waiting_requests = 0
        self.sleeping = False
        self.hung = False  # alive but answering nothing (SIGSTOP, a deadlock)
        self.logs: list[str] = [f"starting {spec.engine} for {spec.name}"]
        self.ended = asyncio.Event()  # set when stopped or killed

    def time_left(self, now: float) -> float:
        """Seconds until its scripted exit (a failed start or a death); a day if none."""
        b = self.behaviour
        if b.fail_at_start is not None:
            end = self.started + b.startup_s
        elif b.die_after_s is not None:
            end = self.started + b.startup_s + b.die_after_s
        else:
            return 86400.0
        return max(0.0, end - now)

    def alive(self, now: float) -> bool:
        """Whether the process still exists at `now`."""
        if self.stopped or self.killed:
            return False
        b = self.behaviour
        if b.fail_at_start is not None and now >= self.started + b.startup_s:
            if b.fail_at_start not in self.logs:
                self.logs.append(b.fail_at_start)
            return False
        return not (b.die_after_s is not None and now >= self.started + b.startup_s + b.die_after_s)

    def ready(self, now: float) -> bool:
        """Whether it answers its health endpoint with 200."""
        return self.alive(now) and not self.hung and now >= self.started + self.behaviour.startup_s


class SimRuntime:
    """`actors.ports.Runtime` over simulated engines; behaviour chosen per deployment name."""

    def __init__(
        self,
        clock: Clock,
        behaviour: Callable[[LaunchSpec], EngineBehaviour] | None = None,
        *,
        launch_s: float = 0.0,
    ) -> None:
        self.clock = clock
        self._behaviour = behaviour or (lambda spec: EngineBehaviour())
        self.launch_s = launch_s
        self.engines: dict[str, SimEngine] = {}
        self.launches: list[str] = []  # deployment ids in launch order
        self._ports = itertools.count(20000)
        self.fail_next_launch: str | None = None

    async def launch(self, spec: LaunchSpec) -> EngineHandle:
        """Create the engine (after `launch_s`)."""
        if self.launch_s:
            await self.clock.sleep(self.launch_s)
        if self.fail_next_launch is not None:
            reason, self.fail_next_launch = self.fail_next_launch, None
            raise RuntimeFailure(reason)
        port = next(self._ports)
        handle = EngineHandle(
            deployment_id=spec.deployment_id, host="127.0.0.1", port=port, runtime_id=f"sim:{port}"
        )
        self.engines[handle.runtime_id] = SimEngine(
            spec, handle, self.clock.now(), self._behaviour(spec)
        )
        self.launches.append(spec.deployment_id)
        return handle

    async def stop(self, handle: EngineHandle, timeout_s: float = 30.0) -> None:
        """Stop it (idempotent)."""
        engine = self.engines.get(handle.runtime_id)
        if engine is not None:
            engine.stopped = True
            engine.ended.set()

    async def is_running(self, handle: EngineHandle) -> bool:
        """Whether it still runs."""
        engine = self.engines.get(handle.runtime_id)
        return engine is not None and engine.alive(self.clock.now())

    async def wait_exited(self, handle: EngineHandle) -> None:
        """Return once it has exited: at its scripted end, or when stopped or killed."""
        engine = self.engines.get(handle.runtime_id)
        if engine is None:
            return
        while engine.alive(self.clock.now()):
            waits = {
                asyncio.ensure_future(engine.ended.wait()),
                asyncio.ensure_future(self.clock.sleep(engine.time_left(self.clock.now()))),
            }
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()

    async def list_engines(self) -> list[EngineHandle]:
        """Engines still running."""
        now = self.clock.now()
        return [e.handle for e in self.engines.values() if e.alive(now)]

    async def logs_tail(self, handle: EngineHandle, lines: int = 20) -> str:
        """Its last log lines."""
        engine = self.engines.get(handle.runtime_id)
        return "" if engine is None else "\n".join(engine.logs[-lines:])

    async def close(self) -> None:
        """Nothing to release."""

    # --- what tests do behind DGXMM's back -----------------------------------------------

    def engine_of(self, deployment_id: str) -> SimEngine | None:
        """The live engine of a deployment."""
        now = self.clock.now()
        for engine in self.engines.values():
            if engine.handle.deployment_id == deployment_id and engine.alive(now):
                return engine
        return None

    def kill(self, deployment_id: str) -> None:
        """Kill the engine behind DGXMM's back."""
        engine = self.engine_of(deployment_id)
        if engine is not None:
            engine.killed = True
            engine.ended.set()

    def hang(self, deployment_id: str) -> None:
        """Make the engine stop answering (its process stays) behind DGXMM's back."""
        engine = self.engine_of(deployment_id)
        if engine is not None:
            engine.hung = True

    def running(self) -> list[str]:
        """Deployment ids with a live engine."""
        now = self.clock.now()
        return [e.handle.deployment_id for e in self.engines.values() if e.alive(now)]


class SimProbe:
    """`actors.ports.EngineProbe` reading the simulated engines."""

    # Simulated engines are ready at known virtual instants: ask on whole seconds of age, so
    # simulated hours stay cheap (actors.readiness; real engines are probed every 25 ms).
    probe_schedule = staticmethod(whole_seconds)

    def __init__(self, runtime: SimRuntime) -> None:
        self.runtime = runtime

    def _engine(self, handle: EngineHandle) -> SimEngine:
        engine = self.runtime.engines.get(handle.runtime_id)
        if engine is None or not engine.alive(self.runtime.clock.now()):
            raise EngineUnreachable(f"{handle.base_url}: connection refused")
        return engine

    def ready_at(self, handle: EngineHandle) -> float | None:
        """When the engine will first answer its probe (`actors.readiness`), None when it
        will not as things stand (gone, hung, failing at start, dying as it becomes ready)."""
        sim = self.runtime.engines.get(handle.runtime_id)
        if sim is None or sim.hung or not sim.alive(self.runtime.clock.now()):
            return None
        b = sim.behaviour
        if b.fail_at_start is not None or (b.die_after_s is not None and b.die_after_s <= 0):
            return None
        return sim.started + b.startup_s

    async def readiness(self, engine: str, handle: EngineHandle) -> Readiness:
        """READY once started; LOADING (llama.cpp) or DOWN before."""
        try:
            sim = self._engine(handle)
        except EngineUnreachable:
            return Readiness.DOWN
        if sim.ready(self.runtime.clock.now()):
            return Readiness.READY
        return Readiness.LOADING if engine == "llamacpp" else Readiness.DOWN

    async def load(self, engine: str, handle: EngineHandle) -> EngineLoad | None:
        """Running and waiting requests the engine reports."""
        sim = self._engine(handle)
        return EngineLoad(running=sim.running_requests, waiting=sim.waiting_requests)

    async def is_sleeping(self, engine: str, handle: EngineHandle) -> bool:
        """vLLM sleep mode."""
        return self._engine(handle).sleeping

    async def wake_up(self, engine: str, handle: EngineHandle) -> None:
        """vLLM POST /wake_up."""
        self._engine(handle).sleeping = False
