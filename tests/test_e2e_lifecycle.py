"""Issue 7's acceptance, end to end through the real Controller.

With each runtime (a real Docker engine running the `dgxmm-sim:local` image, and local
processes): a real event log, the real engine probe over HTTP, the real launch specs of
`dgxmm.engines.adapters` for the simulated engine.  An always-on deployment is created, runs
labelled, becomes ready and answers a chat completion, stops and is gone; a restarted
DGXMM adopts a running engine instead of restarting it; an engine killed behind DGXMM's
back is recorded as lost and restarted after the 60 s backoff; a start that fails carries
the engine's log line in its reason.

Then, over the real actors on a virtual clock with simulated engines (hypothesis):
concurrent starts, stops, requests, direct calls and crashes never put more engines in
memory than the budget, a start is refused exactly when it cannot fit, and a refused start
is a 409 `insufficient_memory` that changed nothing.  Two regression tests at the end
pin what this property found in the broker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actors.controller import Controller
from actors.deployment import Refusal
from actors.memory_broker import GIB, MemoryBroker
from actors.ports import EngineHandle, LaunchSpec
from actors.runtime import SystemClock, VirtualClock
from events import model as m
from events.state import Lifecycle, fold
from simulations.harness import Harness, sim_launch_spec
from simulations.runtime import EngineBehaviour, SimProbe, SimRuntime
from storage.eventlog import EventStore
from tests.e2e_support import (
    Box,
    RuntimeKind,
    chat_completion,
    docker_inspect,
    require_docker,
)

FAILURE = "CUDA out of memory (simulated)"
LIFECYCLE = [
    "DeploymentCreated",
    "StartRequested",
    "EngineStarting",
    "EngineReady",
    "StopRequested",
    "EngineStopped",
]


@pytest.fixture(params=[pytest.param("docker", marks=pytest.mark.docker), "process"])
def kind(request: pytest.FixtureRequest) -> RuntimeKind:
    """Each runtime in turn; docker skips without an engine (fails under CI=true)."""
    if request.param == "docker":
        require_docker()
        return "docker"
    return "process"


def on_box(
    root: Path, kind: RuntimeKind, scenario: Callable[[Box], Awaitable[None]], *, virtual: bool
) -> None:
    """Run `scenario` against a fresh DGXMM; remove its engines afterwards."""

    async def main() -> None:
        clock = VirtualClock(wall_start=time.time()) if virtual else SystemClock()
        box = await Box.open(root, kind, clock)
        try:
            await scenario(box)
        finally:
            await box.close()

    asyncio.run(main())


def ready_handle(box: Box, deployment_id: str) -> EngineHandle:
    """The handle of a ready deployment's engine."""
    handle = box.actor(deployment_id).engine_handle
    assert handle is not None, f"{deployment_id} has no engine handle"
    return handle


async def answers_chat(handle: EngineHandle, model: str) -> None:
    """The engine answers an OpenAI chat completion for `model`."""
    answer = await chat_completion(handle, model)
    assert answer["object"] == "chat.completion"
    assert answer["model"] == model
    assert answer["choices"][0]["message"]["content"]


# --- the lifecycle with each real runtime ------------------------------------------------


def test_an_always_on_deployment_runs_labelled_answers_a_chat_and_is_gone_after_stop(
    tmp_path: Path, kind: RuntimeKind
) -> None:
    async def scenario(box: Box) -> None:
        dep = await box.create("e2e-life", args=["--startup-delay", "1"])
        _, starting = await box.wait_for_event(dep, m.EngineStarting)
        runtime_id = starting.runtime_id
        if kind == "docker":
            info = docker_inspect(runtime_id)
            assert info is not None and info["State"]["Running"]
            assert info["Config"]["Labels"]["dgxmm.deployment"] == dep
            assert info["Config"]["Labels"]["dgxmm.managed"] == "1"
        else:
            running = await box.runtime.list_engines()
            assert [h.runtime_id for h in running if h.deployment_id == dep] == [runtime_id]
        await box.wait_for_state(dep, "ready")
        handle = ready_handle(box, dep)
        assert handle.runtime_id == runtime_id
        assert box.controller.record(box.actor(dep)).engine_url == handle.base_url
        assert box.broker.launched_total() == 1 * GIB
        await answers_chat(handle, "sim/e2e-life")

        await box.controller.stop(dep, "admin:test")
        await box.wait_for_state(dep, "stopped")
        assert not box.engine_exists(runtime_id)
        assert box.broker.held_total() == 0
        assert box.actor(dep).engine_handle is None
        events = await box.events(dep)
        assert [type(r.event).__name__ for r in events] == LIFECYCLE
        assert [r.actor for r in events] == [
            "admin:test",
            "admin:test",
            "system",
            "system",
            "admin:test",
            "system",
        ]

    on_box(tmp_path, kind, scenario, virtual=False)


def test_a_restarted_dgxmm_adopts_the_running_engine_instead_of_restarting_it(
    tmp_path: Path, kind: RuntimeKind
) -> None:
    async def scenario(box: Box) -> None:
        dep = await box.create("e2e-adopt")
        await box.wait_for_state(dep, "ready")
        handle = ready_handle(box, dep)
        identity = box.engine_identity(handle)
        assert identity is not None
        before = await box.event_names(dep)

        await box.restart()
        assert box.state(dep) == "ready"  # load() returns once reconciled
        assert ready_handle(box, dep) == handle
        assert box.engine_identity(handle) == identity  # the same run: not restarted
        events = await box.events(dep)
        assert [type(r.event).__name__ for r in events] == [*before, "EngineAdopted"]
        adopted = events[-1].event
        assert isinstance(adopted, m.EngineAdopted)
        assert (adopted.runtime_id, adopted.host, adopted.port) == (
            handle.runtime_id,
            handle.host,
            handle.port,
        )
        assert box.broker.launched_total() == 1 * GIB
        await answers_chat(handle, "sim/e2e-adopt")

        # The adopted engine is DGXMM's again: Stop reaches it.
        await box.controller.stop(dep, "admin:test")
        await box.wait_for_state(dep, "stopped")
        assert not box.engine_exists(handle.runtime_id)

    on_box(tmp_path, kind, scenario, virtual=False)


def test_an_engine_killed_behind_dgxmms_back_is_lost_and_restarted_at_once(
    tmp_path: Path, kind: RuntimeKind
) -> None:
    # The actors run on a virtual clock (metrics every 5 s); the engines, Docker and the
    # probes run in real time.  An always-on engine that died after running is restarted at
    # once: the 60 s backoff is for engines that fail to start.
    async def scenario(box: Box) -> None:
        dep = await box.create("e2e-lost")
        await box.wait_for_state(dep, "ready")
        first = ready_handle(box, dep)

        box.kill_behind_the_back(first)
        lost_rec, lost = await box.wait_for_event(dep, m.EngineLost)
        assert lost.reason.startswith("the engine exited")
        await box.wait_for_state(dep, "ready")
        second = ready_handle(box, dep)
        assert second.runtime_id != first.runtime_id
        assert not box.engine_exists(first.runtime_id)
        after = [r for r in await box.events(dep) if r.seq > lost_rec.seq]
        assert [type(r.event).__name__ for r in after] == [
            "StartRequested",
            "EngineStarting",
            "EngineReady",
        ]
        restart = after[0].event
        assert isinstance(restart, m.StartRequested)
        assert (restart.reason, after[0].actor) == ("restart", "system")
        assert after[0].ts - lost_rec.ts < 1.0  # no backoff before the first restart
        assert box.controller.record(box.actor(dep)).failures == 0
        assert box.broker.launched_total() == 1 * GIB
        await answers_chat(second, "sim/e2e-lost")

    on_box(tmp_path, kind, scenario, virtual=True)


def test_an_engine_gone_while_dgxmm_was_down_is_recorded_lost_and_always_on_restarted(
    tmp_path: Path, kind: RuntimeKind
) -> None:
    async def scenario(box: Box) -> None:
        dep = await box.create("e2e-gone")
        await box.wait_for_state(dep, "ready")
        first = ready_handle(box, dep)
        await box.stop()
        box.kill_behind_the_back(first)
        await box.start()
        names = await box.event_names(dep)
        assert names[-3:] == ["EngineReady", "EngineLost", "StartRequested"]
        await box.wait_for_state(dep, "ready")
        second = ready_handle(box, dep)
        assert second.runtime_id != first.runtime_id
        await answers_chat(second, "sim/e2e-gone")

    on_box(tmp_path, kind, scenario, virtual=False)


def test_a_start_that_fails_is_failed_with_the_engines_log_line_in_its_reason(
    tmp_path: Path, kind: RuntimeKind
) -> None:
    async def scenario(box: Box) -> None:
        dep = await box.create("e2e-fail", args=["--fail-at-start", FAILURE])
        await box.wait_for_state(dep, "failed")
        events = await box.events(dep)
        assert [type(r.event).__name__ for r in events] == [
            "DeploymentCreated",
            "StartRequested",
            "EngineStarting",
            "EngineStartFailed",
        ]
        starting, failed = events[2].event, events[3].event
        assert isinstance(starting, m.EngineStarting)
        assert isinstance(failed, m.EngineStartFailed)
        assert failed.reason.startswith("the engine exited")
        assert FAILURE in failed.reason
        assert failed.failures == 1
        assert failed.retry_at == pytest.approx(events[3].ts + 60, abs=1)  # always on: retried
        record = box.controller.record(box.actor(dep))
        assert record.state == "failed"
        assert record.last_error is not None and FAILURE in record.last_error
        assert record.engine_url is None
        # Always on: the engine is gone, its memory is kept for the restart.
        assert (box.broker.launched_total(), box.broker.held_total()) == (0, 1 * GIB)
        await box.until(
            lambda: not box.engine_exists(starting.runtime_id), "the failed engine removed"
        )

    on_box(tmp_path, kind, scenario, virtual=False)


# --- concurrent starts never over-commit memory (hypothesis, real actors) ----------------

BUDGET_GIB = 8


@dataclasses.dataclass(frozen=True)
class Model:
    """A deployment to create: size, mode, start-up time, whether its start fails."""

    gib: int
    on_demand: bool
    startup_s: float
    fails: bool
    idle_timeout_s: int | None


@dataclasses.dataclass(frozen=True)
class Create:
    model: int


@dataclasses.dataclass(frozen=True)
class Start:
    model: int


@dataclasses.dataclass(frozen=True)
class StartTogether:
    models: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Stop:
    model: int


@dataclasses.dataclass(frozen=True)
class Request:
    model: int
    hold_s: float


@dataclasses.dataclass(frozen=True)
class DirectCall:
    """A call straight to the engine's port: its metrics show it busy, the gateway not."""

    model: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Linger:
    """Keep ready on-demand models busy (direct calls) past their idle timeout, move time
    on to just after the calls ended (idle by the rules, not put to sleep yet: that is
    checked every 15 s, so make-room candidates), and then start something."""

    then: Start | StartTogether | Request


@dataclasses.dataclass(frozen=True)
class Crash:
    model: int


@dataclasses.dataclass(frozen=True)
class Advance:
    seconds: float


Step = Create | Start | StartTogether | Stop | Request | DirectCall | Linger | Crash | Advance

MODELS = st.lists(
    st.builds(
        Model,
        gib=st.integers(1, 6),
        on_demand=st.integers(0, 2).map(bool),
        startup_s=st.sampled_from([0.0, 2.0, 20.0]),
        fails=st.integers(0, 5).map(lambda n: n == 0),
        idle_timeout_s=st.sampled_from([None, 60]),
    ),
    min_size=3,
    max_size=6,
)


def steps(n_models: int) -> st.SearchStrategy[list[Step]]:
    """Every model created (in any order, each creation a start), then a random program."""
    index = st.integers(0, n_models - 1)
    together = st.lists(index, min_size=2, max_size=4, unique=True).map(tuple)
    starts: st.SearchStrategy[Start | StartTogether | Request] = st.one_of(
        st.builds(Start, index),
        st.builds(StartTogether, together),
        st.builds(Request, index, st.sampled_from([1.0, 40.0])),
    )
    step: st.SearchStrategy[Step] = st.one_of(
        st.builds(Start, index),
        st.builds(StartTogether, together),
        st.builds(Stop, index),
        st.builds(StartTogether, together),
        st.builds(Stop, index),
        st.builds(Advance, st.sampled_from([1.0, 3.0, 5.0, 10.0, 21.0, 61.0, 301.0])),
        st.builds(Request, index, st.sampled_from([1.0, 40.0])),
        st.builds(Request, index, st.sampled_from([1.0, 40.0])),
        st.builds(DirectCall, index, st.sampled_from([8.0, 65.0, 310.0])),
        st.builds(Linger, starts),
        st.builds(Linger, starts),
        st.builds(Crash, index),
    )
    creates = st.permutations(range(n_models)).map(lambda order: [Create(i) for i in order])
    return st.tuples(creates, st.lists(step, min_size=5, max_size=40)).map(lambda t: [*t[0], *t[1]])


class Program:
    """Plays steps against one simulated box and checks the books after each."""

    def __init__(self, h: Harness, models: list[Model]) -> None:
        self.h = h
        self.models = models
        self.ids: dict[int, str] = {}
        self.refused = 0
        self.made_room = 0
        self.problems: list[str] = []
        h.controller.add_listener(self._on_change)

    # --- the budget, at every change and after every step --------------------------------

    def engines_in_memory(self) -> int:
        """What the simulated engines that exist right now hold (the runtime's truth)."""
        now = self.h.clock.now()
        return sum(e.spec.memory_bytes for e in self.h.runtime.engines.values() if e.alive(now))

    def _on_change(self, deployment_id: str, what: str) -> None:
        self._check_budget(f"on change of {deployment_id} ({what})")

    def _check_budget(self, where: str) -> None:
        usable = self.h.broker.usable_bytes
        launched = self.h.broker.launched_total()
        real = self.engines_in_memory()
        if launched > usable or real > usable or self.h.broker.peak_launched > usable:
            self.problems.append(
                f"over budget {where}: broker {launched}, engines {real}, "
                f"peak {self.h.broker.peak_launched} > usable {usable}"
            )

    def room_for(self, need: int, deployment_id: str) -> bool:
        """Whether `need` fits in free memory, plus what the stops under way give back, plus
        what idle on-demand models could free."""
        broker = self.h.broker
        freeable = sum(
            c.memory_bytes
            for c in self.h.controller.candidates(deployment_id)
            if broker.holds(c.deployment_id)
        )
        # A failed always-on deployment still holds its memory for its restart.
        own = broker.reserved_for(deployment_id)
        return need <= broker.free() + broker.releasing_total() + freeable + own

    def snapshot(self, deployment_id: str) -> tuple[Any, ...]:
        """What a refused start must leave as it was."""
        broker = self.h.broker
        return (
            self.h.controller.actors[deployment_id].state,
            broker.holds(deployment_id),
            broker.held_total(),
            broker.launched_total(),
            len(self.h.runtime.launches),
        )

    # --- steps ---------------------------------------------------------------------------

    async def play(self, step: Step) -> None:
        """Apply one step, let the actors react, check the budget."""
        match step:
            case Create(i):
                await self.create(i)
            case Start(i):
                await self.start(i)
            case StartTogether(models):
                await self.start_together(models)
            case Stop(i):
                if i in self.ids:
                    await self.h.controller.stop(self.ids[i], "admin:test")
            case Request(i, hold_s):
                if i in self.ids:
                    self.h.request(self.ids[i], hold_s)
            case DirectCall(i, seconds):
                if i in self.ids:
                    self.direct_call(self.ids[i], seconds)
            case Linger(then):
                await self.linger()
                await self.play(then)
            case Crash(i):
                if i in self.ids:
                    self.h.runtime.kill(self.ids[i])
            case Advance(seconds):
                await self.h.advance(seconds)
        await self.h.clock.settle()
        self._check_budget(f"after {step}")

    def direct_call(self, deployment_id: str, seconds: float) -> None:
        """A call straight to the engine for `seconds`: its metrics show it busy meanwhile."""
        engine = self.h.runtime.engine_of(deployment_id)
        if engine is None:
            return
        engine.running_requests += 1

        def done() -> None:
            engine.running_requests -= 1

        self.h.clock.call_later(seconds, done)

    async def linger(self) -> None:
        """Leave the ready on-demand models idle by the rules but not yet asleep."""
        await self.h.advance(21)  # starts under way finish (start-up takes up to 20 s)
        now = self.h.clock.now()
        default_idle = int(self.h.controller.setting("ondemand_idle_timeout_s"))
        checks: dict[str, float] = {}
        for dep_id, actor in self.h.controller.actors.items():
            dep = actor.state
            if dep.on_demand and dep.lifecycle is Lifecycle.READY:
                timeout = dep.effective_idle_timeout_s(default_idle)
                checks[dep_id] = actor.activity.last_used + timeout - now
        # Time moves to `first` + 10 s.  A model whose idle check falls before `first` + 5
        # gets a call that ends just after its check: a scrape (every 5 s) sees it end, and
        # its next check (15 s later) comes after `first` + 10.  The metrics must show the
        # call before the check, so the check must be at least 6 s away.
        first = min(checks.values(), default=0.0)
        if first < 6:
            return
        for dep_id, until_check in checks.items():
            if until_check < first + 4.5:
                self.direct_call(dep_id, until_check + 0.5)
        await self.h.advance(first + 10)

    def behaviour(self, spec: LaunchSpec) -> EngineBehaviour:
        """How the engine of model `m<i>` behaves."""
        model = self.models[int(spec.name.removeprefix("m"))]
        return EngineBehaviour(
            startup_s=model.startup_s, fail_at_start=FAILURE if model.fails else None
        )

    async def create(self, i: int) -> None:
        if i in self.ids:
            return
        model = self.models[i]
        fits = self.room_for(model.gib * GIB, "")
        seq = await self.h.store.last_seq()
        dep = await self.h.deploy(
            f"m{i}",
            model.gib,
            mode="on_demand" if model.on_demand else "always_on",
            idle_timeout_s=model.idle_timeout_s,
        )
        self.ids[i] = dep
        stream = m.deployment_stream(dep)
        recs = await self.h.store.read(since_seq=seq, stream=stream)
        started = any(isinstance(r.event, m.StartRequested) for r in recs)
        if started != fits:
            self.problems.append(f"create m{i} ({model.gib} GiB): fits={fits}, started={started}")

    async def start(self, i: int) -> None:
        if i not in self.ids:
            return
        dep = self.ids[i]
        actor = self.h.controller.actors[dep]
        needs_memory = actor.state.lifecycle in (Lifecycle.STOPPED, Lifecycle.FAILED)
        fits = self.room_for(actor.state.memory_bytes, dep)
        before = (await self.h.store.last_seq(), self.snapshot(dep))
        stopping = actor.state.lifecycle is Lifecycle.STOPPING
        try:
            await self.h.controller.start(dep, "admin:test")
        except Refusal as exc:
            if stopping:  # a stop under way (engines take time to stop) is its own answer
                if (exc.status, exc.code) != (409, "stopping"):
                    self.problems.append(f"start of stopping m{i}: {exc.status} {exc.code}")
            else:
                self.refused += 1
                self.check_refusal(exc, f"start of m{i}")
                if needs_memory and fits:
                    self.problems.append(f"start of m{i} refused although it fits")
            await self.h.clock.settle()
            after = (await self.h.store.last_seq(), self.snapshot(dep))
            if after != before:
                self.problems.append(f"refused start of m{i} changed {before} into {after}")
            return
        if needs_memory and not fits:
            self.problems.append(f"start of m{i} accepted although it does not fit")

    async def start_together(self, models: tuple[int, ...]) -> None:
        # Only deployments nothing else may start meanwhile: stopped or failed, with no
        # request waiting for them (the queue could start them) and no restart due.
        chosen = []
        for i in models:
            dep = self.ids.get(i)
            if dep is None:
                continue
            actor = self.h.controller.actors[dep]
            if actor.state.lifecycle not in (Lifecycle.STOPPED, Lifecycle.FAILED):
                continue
            if self.h.controller.queue.counts(dep) != (0, 0):
                continue
            chosen.append((i, dep))
        before = {dep: self.snapshot(dep)[:2] for _, dep in chosen}
        launches = {dep: self.h.runtime.launches.count(dep) for _, dep in chosen}
        outcomes = await asyncio.gather(
            *(self.h.controller.start(dep, "admin:test") for _, dep in chosen),
            return_exceptions=True,
        )
        await self.h.clock.settle()
        for (i, dep), outcome in zip(chosen, outcomes, strict=True):
            if isinstance(outcome, Refusal):
                self.refused += 1
                self.check_refusal(outcome, f"concurrent start of m{i}")
                if self.snapshot(dep)[:2] != before[dep]:
                    self.problems.append(f"refused concurrent start of m{i} changed its state")
                if self.h.runtime.launches.count(dep) != launches[dep]:
                    self.problems.append(f"refused concurrent start of m{i} launched an engine")
            elif isinstance(outcome, BaseException):
                self.problems.append(f"concurrent start of m{i} raised {outcome!r}")

    def check_refusal(self, exc: Refusal, what: str) -> None:
        if (exc.status, exc.code) != (409, "insufficient_memory"):
            self.problems.append(f"{what} refused with {exc.status} {exc.code}: {exc.message}")

    async def finish(self) -> None:
        """Let every start, backoff and idle timeout play out; the log folds to the actors."""
        await self.h.advance(2000)
        self._check_budget("at the end")
        recs = await self.h.events()
        self.made_room = sum(
            isinstance(r.event, m.PutToSleep) and r.event.reason == "make_room" for r in recs
        )
        folded = fold(recs)
        for dep_id, actor in self.h.controller.actors.items():
            if folded.deployments[dep_id] != actor.state:
                self.problems.append(f"replay of {dep_id} differs from its actor")


class SlowStopRuntime(SimRuntime):
    """Simulated engines that take `stop_s` to stop, as real ones do (docker stop, vLLM)."""

    def __init__(self, clock: VirtualClock, program: Program | None, stop_s: float) -> None:
        super().__init__(clock, self._behaviour_of)
        self.program = program
        self.stop_s = stop_s

    def _behaviour_of(self, spec: LaunchSpec) -> EngineBehaviour:
        assert self.program is not None
        return self.program.behaviour(spec)

    async def stop(self, handle: EngineHandle, timeout_s: float = 30.0) -> None:
        """Stop it, `stop_s` later."""
        engine = self.engines.get(handle.runtime_id)
        if engine is not None and engine.alive(self.clock.now()) and self.stop_s > 0:
            await self.clock.sleep(self.stop_s)
        await super().stop(handle, timeout_s)


async def run_program(
    models: list[Model], program: list[Step], max_starts: int, stop_s: float = 0.0
) -> Program:
    """Play a program on a fresh box (virtual clock, simulated engines, a real log)."""
    with tempfile.TemporaryDirectory(prefix="dgxmm-e2e-") as tmp:
        clock = VirtualClock()
        store = await EventStore.open(Path(tmp) / "log.db", wall=clock.wall)
        clock.add_busy_check(store.busy)
        runtime = SlowStopRuntime(clock, None, stop_s)
        usable = BUDGET_GIB * GIB
        broker = MemoryBroker(usable, usable, max_concurrent_starts=max_starts)
        controller = Controller(
            store=store,
            clock=clock,
            runtime=runtime,
            probe=SimProbe(runtime),
            broker=broker,
            launch_spec=sim_launch_spec,
        )
        await controller.load()
        h = Harness(clock, store, runtime, broker, controller)
        try:
            played = runtime.program = Program(h, models)
            for step in program:
                await played.play(step)
            await played.finish()
        finally:
            await h.close()
    return played


# Engines launched at once by the start-up queue (`memory.max_concurrent_starts`, default 1).
LAUNCH_SLOTS = st.integers(1, 3)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    data=st.data(),
    models=MODELS,
    max_starts=LAUNCH_SLOTS,
    stop_s=st.sampled_from([0.0, 3.0, 20.0]),
)
def test_concurrent_starts_never_over_commit_memory_and_a_refused_start_changes_nothing(
    data: st.DataObject, models: list[Model], max_starts: int, stop_s: float
) -> None:
    program = data.draw(steps(len(models)), label="program")
    played = asyncio.run(run_program(models, program, max_starts, stop_s))
    event(f"refused starts: {min(played.refused, 3)}{'+' if played.refused >= 3 else ''}")
    event(f"made room: {played.made_room > 0}")
    broker = played.h.broker
    event(f"peak memory in use: {broker.peak_launched * 100 // broker.usable_bytes}%")
    assert played.problems == []


def test_a_manual_start_that_does_not_fit_is_refused_with_409_and_changes_nothing() -> None:
    # The example the property generalises, written out: 5 GiB always on, then 4 GiB.
    models = [Model(5, False, 0.0, False, None), Model(4, False, 0.0, False, None)]
    program: list[Step] = [Create(0), Advance(1), Create(1), Start(1), StartTogether((1,))]
    played = asyncio.run(run_program(models, program, 1))
    assert played.problems == []
    assert played.refused == 2  # alone, and through the concurrent path


@pytest.mark.parametrize("launch_slots", [1, 2])
def test_two_starts_launching_together_wait_until_the_model_put_to_sleep_for_them_is_gone(
    launch_slots: int,
) -> None:
    # 8 GiB: od (1, on demand, idle) + always (4) + x (3) + y (1, did not fit at creation).
    # x is stopped; then x and y start together: x fits in the 3 GiB free, y makes room by
    # putting od to sleep, which takes 20 s.  Until od is gone only x may launch.
    models = [
        Model(1, True, 0.0, False, 60),
        Model(4, False, 0.0, False, None),
        Model(3, False, 0.0, False, None),
        Model(1, False, 0.0, False, None),
    ]
    program: list[Step] = [
        *(Create(i) for i in range(4)),
        Advance(1),
        Stop(2),
        Linger(StartTogether((2, 3))),
    ]
    played = asyncio.run(run_program(models, program, launch_slots, stop_s=20.0))
    assert played.made_room == 1
    assert played.problems == []


def test_a_manual_start_gets_the_same_answer_whether_or_not_an_unrelated_model_is_idle() -> None:
    # 8 GiB, full: a (4, always on) is being stopped (it takes 20 s), then d (2 GiB) is
    # started by hand.  Beside them either b (3) and an idle on-demand c (1), or b (4).
    # c is not needed (a gives back 4 GiB): d is accepted either way, and waits for a.
    a, d = Model(4, False, 0.0, False, None), Model(2, False, 0.0, False, None)
    idle_c = Model(1, True, 0.0, False, 60)
    with_idle = [a, Model(3, False, 0.0, False, None), idle_c, d]
    without = [a, Model(4, False, 0.0, False, None), d]
    answers = []
    for models in (with_idle, without):
        last = len(models) - 1
        program: list[Step] = [
            *(Create(i) for i in range(len(models))),
            Advance(1),
            Linger(Start(0)),
            Stop(0),
            Start(last),
        ]
        played = asyncio.run(run_program(models, program, 1, stop_s=20.0))
        assert played.problems == []
        answers.append(played.refused)
    assert answers == [0, 0], f"refused with an idle model: {answers[0]}, without: {answers[1]}"
