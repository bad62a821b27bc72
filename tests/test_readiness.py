"""Readiness at engine speed: the probe schedule, and waiting for an engine that loads or dies.

The schedule is a pure function, tested directly.  `wait_until_ready` runs on a virtual clock
that the tests move by hand: a wait that ends while the clock stands still can only have been
ended by the runtime's exit watch, never by a probe.  The exit watch itself is tested on the
real process runtime and on real Docker.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import uuid
from pathlib import Path

import pytest

from actors.errors import RuntimeFailure
from actors.ports import EngineHandle, LaunchSpec, Readiness
from actors.readiness import (
    FAST_PROBE_S,
    REFUSED_PROBE_S,
    SLOW_PROBE_S,
    YOUNG_S,
    BootOutcome,
    next_probe_age,
    probe_interval_s,
    wait_until_ready,
    whole_seconds,
)
from actors.runtime import VirtualClock
from dgxmm.engines.adapters import HttpEngineProbe
from dgxmm.engines.runtimes.docker import SIM_IMAGE, DockerRuntime
from dgxmm.engines.runtimes.process import ProcessRuntime
from simulations.runtime import EngineBehaviour, SimProbe, SimRuntime
from simulations.whatif import tenths_then_seconds
from tests.e2e_support import require_docker
from tests.runtime_support import run

# --- the schedule ------------------------------------------------------------------------------


def test_a_young_engine_is_probed_every_25_ms_for_its_first_five_seconds_then_less_often() -> None:
    age, probes = 0.0, []
    while age < 6.0:
        age = next_probe_age(age)
        probes.append(age)
    young = [p for p in probes if p <= 5.0 + 1e-9]
    assert len(young) == 200 and young[-1] == pytest.approx(5.0)
    assert [b - a for a, b in itertools.pairwise([0.0, *young])] == pytest.approx([0.025] * 200)
    assert all(b - a > 0.025 + 1e-9 for a, b in itertools.pairwise(probes[199:]))


def test_the_probe_period_grows_with_age_and_never_exceeds_one_second() -> None:
    ages = [i * 0.5 for i in range(0, 400)]
    periods = [probe_interval_s(age) for age in ages]
    assert periods == sorted(periods)
    assert periods[0] == FAST_PROBE_S and periods[-1] == SLOW_PROBE_S == 1.0
    assert probe_interval_s(YOUNG_S) > FAST_PROBE_S


def test_the_detection_delay_stays_under_three_percent_of_the_age_after_the_first_seconds() -> None:
    for tenth in range(50, 6000):
        age = tenth / 10
        assert probe_interval_s(age) <= max(FAST_PROBE_S, 0.025 * age), age


def test_probes_fall_on_a_grid_of_the_age_so_a_long_start_is_probed_at_whole_seconds() -> None:
    age, probes = 0.0, []
    while age < 62.0:
        age = next_probe_age(age)
        probes.append(age)
    assert probes[0] == pytest.approx(FAST_PROBE_S)
    assert all(b > a for a, b in itertools.pairwise(probes))
    late = [p for p in probes if p > 40.0]
    assert late == pytest.approx([41.0 + i for i in range(len(late))])
    assert 30.0 in [round(p, 9) for p in probes]


def test_the_simulated_probe_asks_on_whole_seconds_to_keep_simulations_cheap() -> None:
    assert SimProbe.probe_schedule(0.0) == 1.0
    assert SimProbe.probe_schedule(29.000001) == 30.0
    assert whole_seconds(30.0) == 31.0


def test_the_next_probe_is_strictly_later_even_on_a_grid_point() -> None:
    for age in (0.0, 0.025, 5.0, 10.0, 40.0, 41.0, 1000.0):
        assert age < next_probe_age(age) <= age + probe_interval_s(age) + 1e-9


# --- waiting on the virtual clock -------------------------------------------------------------


def _spec(deployment_id: str = "d1", engine: str = "llamacpp") -> LaunchSpec:
    return LaunchSpec(
        deployment_id=deployment_id, name="m", engine=engine, image="x", argv=["x"], port=1
    )


async def _started(
    behaviour: EngineBehaviour, engine: str = "llamacpp"
) -> tuple[VirtualClock, SimRuntime, EngineHandle]:
    clock = VirtualClock()
    runtime = SimRuntime(clock, lambda spec: behaviour)
    handle = await runtime.launch(_spec(engine=engine))
    return clock, runtime, handle


def _wait(
    clock: VirtualClock, runtime: SimRuntime, handle: EngineHandle, deadline: float = 600.0
) -> asyncio.Task[BootOutcome]:
    return asyncio.ensure_future(
        wait_until_ready(
            runtime=runtime,
            probe=SimProbe(runtime),
            clock=clock,
            engine="llamacpp",
            handle=handle,
            launched_at=clock.now(),
            deadline=clock.now() + deadline,
            schedule=next_probe_age,  # the real schedule, not the simulated probe's own
        )
    )


def test_an_engine_healthy_after_1_6_s_is_seen_ready_within_25_ms() -> None:
    async def scenario() -> None:
        clock, runtime, handle = await _started(EngineBehaviour(startup_s=1.6))
        waiting = _wait(clock, runtime, handle)
        await clock.advance(1.6 - 0.001)
        assert not waiting.done()
        await clock.advance(FAST_PROBE_S + 0.001)
        assert waiting.done() and waiting.result() is BootOutcome.READY

    run(scenario())


class _ProbeOfItsOwn:
    """The simulated probe's answers without its whole-seconds schedule: the default one."""

    def __init__(self, runtime: SimRuntime) -> None:
        self._sim = SimProbe(runtime)
        self.probes = 0

    async def readiness(self, engine: str, handle: EngineHandle) -> Readiness:
        self.probes += 1
        return await self._sim.readiness(engine, handle)


def _wait_default(
    clock: VirtualClock,
    runtime: SimRuntime,
    handle: EngineHandle,
    probe: _ProbeOfItsOwn,
    engine: str,
) -> asyncio.Task[BootOutcome]:
    """Wait with the default schedule (the probe has none of its own)."""
    return asyncio.ensure_future(
        wait_until_ready(
            runtime=runtime,
            probe=probe,  # type: ignore[arg-type]
            clock=clock,
            engine=engine,
            handle=handle,
            launched_at=clock.now(),
            deadline=clock.now() + 600.0,
        )
    )


@pytest.mark.parametrize("age_s", [1.6, 61.3, 95.01])
def test_an_engine_that_refuses_connections_until_ready_is_seen_within_20_ms_at_any_age(
    age_s: float,
) -> None:
    async def scenario() -> None:
        clock, runtime, handle = await _started(EngineBehaviour(startup_s=age_s), engine="vllm")
        probe = _ProbeOfItsOwn(runtime)
        waiting = _wait_default(clock, runtime, handle, probe, "vllm")
        await clock.advance(age_s - 0.001)
        assert not waiting.done()
        assert probe.probes <= age_s / REFUSED_PROBE_S + 2  # no faster than the period
        await clock.advance(REFUSED_PROBE_S + 0.001)
        assert waiting.done() and waiting.result() is BootOutcome.READY

    run(scenario())


def test_an_engine_answering_loading_keeps_the_growing_schedule() -> None:
    async def scenario() -> None:
        clock, runtime, handle = await _started(EngineBehaviour(startup_s=60.5))
        probe = _ProbeOfItsOwn(runtime)
        # llama.cpp: HTTP up at once, 503 "Loading model" meanwhile.
        waiting = _wait_default(clock, runtime, handle, probe, "llamacpp")
        await clock.advance(60.6)
        assert not waiting.done()  # probed at whole seconds by now
        await clock.advance(SLOW_PROBE_S)
        assert waiting.done() and waiting.result() is BootOutcome.READY
        assert probe.probes < 400

    run(scenario())


def test_an_engine_that_exits_while_loading_is_noticed_at_once_not_at_the_next_probe() -> None:
    async def scenario() -> None:
        clock, runtime, handle = await _started(EngineBehaviour(startup_s=300.0))
        waiting = _wait(clock, runtime, handle)
        await clock.advance(100.0)  # old: probed once a second now
        assert not waiting.done()
        runtime.kill("d1")
        for _ in range(100):  # let the event loop run (bounded); the clock does not move
            if waiting.done():
                break
            await asyncio.sleep(0)
        assert waiting.done() and waiting.result() is BootOutcome.EXITED

    run(scenario())


def test_a_start_that_fails_with_a_log_line_ends_the_wait_at_its_exit() -> None:
    async def scenario() -> None:
        clock, runtime, handle = await _started(
            EngineBehaviour(startup_s=12.3, fail_at_start="CUDA out of memory")
        )
        waiting = _wait(clock, runtime, handle)
        await clock.advance(12.3 + 0.001)
        assert waiting.done() and waiting.result() is BootOutcome.EXITED

    run(scenario())


def test_an_engine_that_never_gets_ready_times_out_at_the_deadline() -> None:
    async def scenario() -> None:
        clock, runtime, handle = await _started(EngineBehaviour(startup_s=1e9))
        waiting = _wait(clock, runtime, handle, deadline=30.0)
        await clock.advance(29.9)
        assert not waiting.done()
        await clock.advance(0.2)
        assert waiting.done() and waiting.result() is BootOutcome.TIMED_OUT

    run(scenario())


class _CountingSimProbe(SimProbe):
    """The simulated probe, counting its probes; `knows` False hides `ready_at`."""

    def __init__(self, runtime: SimRuntime, *, knows: bool) -> None:
        super().__init__(runtime)
        self.probes = 0
        if not knows:
            self.ready_at = None  # type: ignore[assignment]

    async def readiness(self, engine: str, handle: EngineHandle) -> Readiness:
        self.probes += 1
        return await super().readiness(engine, handle)


async def _ends_at(
    startup_s: float, deadline_s: float, knows: bool
) -> tuple[BootOutcome, float, int]:
    clock, runtime, handle = await _started(EngineBehaviour(startup_s=startup_s))
    await clock.advance(0.37)  # launched at an instant off the probes' grid
    probe = _CountingSimProbe(runtime, knows=knows)
    launched = clock.now()

    async def wait() -> tuple[BootOutcome, float]:
        outcome = await wait_until_ready(
            runtime=runtime, probe=probe, clock=clock, engine="llamacpp", handle=handle,
            launched_at=launched, deadline=launched + deadline_s, schedule=tenths_then_seconds,
        )  # fmt: skip
        return outcome, clock.now()

    waiting = asyncio.ensure_future(wait())
    await clock.advance(deadline_s + 5.0)
    outcome, at = waiting.result()
    return outcome, at, probe.probes


@pytest.mark.parametrize(
    ("startup_s", "deadline_s"), [(0.05, 60), (3.33, 60), (20.0, 60), (47.1, 30)]
)
def test_a_probe_that_knows_when_its_engine_is_ready_skips_the_probes_before_it(
    startup_s: float, deadline_s: float
) -> None:
    async def scenario() -> None:
        probed = await _ends_at(startup_s, deadline_s, knows=False)
        skipped = await _ends_at(startup_s, deadline_s, knows=True)
        assert skipped[:2] == probed[:2]  # the same outcome at the very same instant
        assert skipped[2] <= 2 < probed[2] or probed[2] <= 2

    run(scenario())


def test_when_the_exit_watch_fails_the_wait_asks_the_runtime_before_each_probe() -> None:
    class BlindRuntime(SimRuntime):
        async def wait_exited(self, handle: EngineHandle) -> None:
            raise RuntimeFailure("docker: the Docker engine did not answer")

    async def scenario() -> None:
        clock = VirtualClock()
        runtime = BlindRuntime(clock, lambda spec: EngineBehaviour(startup_s=300.0))
        handle = await runtime.launch(_spec())
        waiting = _wait(clock, runtime, handle)
        await clock.advance(10.0)
        assert not waiting.done()
        runtime.kill("d1")
        await clock.advance(probe_interval_s(10.0) + 0.01)
        assert waiting.done() and waiting.result() is BootOutcome.EXITED

    run(scenario())


# --- the exit watch of the real runtimes --------------------------------------------------------


def _exiting_spec(engine: str = "sim", image: str = "ignored") -> LaunchSpec:
    """An 'engine' that listens nowhere and exits after 0.3 s."""
    return LaunchSpec(
        deployment_id=f"t-{uuid.uuid4().hex[:8]}",
        name="exits",
        engine=engine,
        image=image,
        argv=[sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(3)"],
        port=8000,
    )


async def _wait_on_a_frozen_clock(
    runtime: ProcessRuntime | DockerRuntime, spec: LaunchSpec
) -> None:
    clock = VirtualClock()
    handle = await runtime.launch(spec)
    try:
        outcome = await asyncio.wait_for(
            wait_until_ready(
                runtime=runtime,
                probe=HttpEngineProbe(),
                clock=clock,
                engine="sim",
                handle=handle,
                launched_at=clock.now() - 100.0,  # old: the next probe is a second away
                deadline=clock.now() + 600.0,
            ),
            timeout=60.0,
        )
        assert outcome is BootOutcome.EXITED
        assert clock.now() == 0.0  # only the exit watch could end it
        assert not await runtime.is_running(handle)
    finally:
        await runtime.stop(handle, 5.0)
        await runtime.close()


def test_the_process_runtime_reports_an_engine_exit_at_once(tmp_path: Path) -> None:
    run(_wait_on_a_frozen_clock(ProcessRuntime(str(tmp_path)), _exiting_spec()))


@pytest.mark.docker
def test_the_docker_runtime_reports_a_container_exit_at_once() -> None:
    require_docker()
    run(_wait_on_a_frozen_clock(DockerRuntime(), _exiting_spec(image=SIM_IMAGE)))
