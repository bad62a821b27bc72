"""Restarts, removal and the memory watchdog, on the virtual clock with the real actors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from actors.controller import Controller
from actors.memory_broker import GIB, MemoryBroker
from actors.watchdog import Victim, WatchdogActor, watchdog_order
from events import model as m
from events.projections import audit_rows
from events.state import fold
from simulations.harness import Harness, sim_launch_spec
from simulations.runtime import EngineBehaviour, SimProbe

STARTUP_S = 30.0


def box(tmp_path: Path, test: Callable[[Harness], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        h = await Harness.create(
            tmp_path / "log.db",
            behaviour=lambda spec: EngineBehaviour(startup_s=STARTUP_S),
            **kwargs,
        )
        try:
            await test(h)
            assert h.violations == []
        finally:
            await h.close()

    asyncio.run(main())


async def restart(h: Harness) -> Controller:
    """Stop the controller (engines keep running) and start a new one on the same log."""
    await h.controller.close()
    broker = MemoryBroker(h.broker.usable_bytes, h.broker.total_bytes)
    controller = Controller(
        store=h.store,
        clock=h.clock,
        runtime=h.runtime,
        probe=SimProbe(h.runtime),
        broker=broker,
        launch_spec=sim_launch_spec,
    )
    await controller.load()
    h.controller, h.broker = controller, broker
    await h.clock.settle()
    return controller


def test_a_restart_adopts_running_engines_instead_of_restarting_them(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("keep", 10, mode="always_on")
        b = await h.deploy("od", 10)
        await h.advance(STARTUP_S * 2 + 4)
        launches = list(h.runtime.launches)
        c = await restart(h)
        assert c.actors[a].state.lifecycle.value == "ready"
        assert c.actors[b].state.lifecycle.value == "ready"
        assert h.runtime.launches == launches  # adopted, not restarted
        assert h.broker.launched_total() == 20 * GIB
        recs = await h.events()
        assert sum(isinstance(r.event, m.EngineAdopted) for r in recs) == 2
        # A restart restarts the idle timer.
        await h.advance(290)
        assert c.actors[b].state.lifecycle.value == "ready"
        await h.advance(20)
        assert c.actors[b].state.lifecycle.value == "stopped"

    box(tmp_path, t)


def test_an_engine_that_vanished_while_dgxmm_was_down_is_recorded_and_always_on_restarted(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("keep", 10, mode="always_on")
        b = await h.deploy("od", 10)
        await h.advance(STARTUP_S * 2 + 4)
        h.runtime.kill(a)
        h.runtime.kill(b)
        c = await restart(h)
        recs = await h.events()
        lost = [r.stream for r in recs if isinstance(r.event, m.EngineLost)]
        assert sorted(lost) == sorted([m.deployment_stream(a), m.deployment_stream(b)])
        assert c.actors[b].state.lifecycle.value == "stopped"  # on demand: next request
        await h.advance(STARTUP_S + 2)
        assert c.actors[a].state.lifecycle.value == "ready"

    box(tmp_path, t)


def test_orphan_engines_dgxmm_does_not_know_are_stopped_at_start_up(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("gone", 10, mode="always_on")
        await h.advance(STARTUP_S + 2)
        await h.controller.remove(a, "admin:test")
        engine = h.runtime.engine_of(a)
        assert engine is None  # removal waits until the engine is gone
        # An engine labelled for a deployment nobody knows:
        from actors.ports import LaunchSpec

        await h.runtime.launch(
            LaunchSpec(deployment_id="stranger", name="x", engine="sim", image="", argv=[], port=1)
        )
        assert "stranger" in h.runtime.running()
        await restart(h)
        assert "stranger" not in h.runtime.running()

    box(tmp_path, t)


def test_replaying_the_log_gives_the_state_the_actors_hold(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("a", 40, idle_timeout_s=60)
        b = await h.deploy("b", 50, idle_timeout_s=60)
        await h.advance(STARTUP_S * 2 + 4)
        c = await h.deploy("c", 40, idle_timeout_s=60)
        for _ in range(3):
            h.request(c)
            h.request(a)
            await h.advance(200)
        await h.controller.change_mode(b, "always_on", None, True, "admin:test")
        await h.advance(100)
        recs = await h.events()
        folded = fold(recs)
        for dep_id, actor in h.controller.actors.items():
            assert folded.deployments[dep_id] == actor.state

    box(tmp_path, t, usable_gib=100)


def test_removing_a_deployment_that_starts_for_requests_fails_them_with_ondemand_stopped(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("a", 10)
        await h.advance(1)
        await h.controller.stop(a, "admin:test")
        await h.advance(1)
        r = h.request(a)
        await h.advance(5)
        await h.controller.remove(a, "admin:bob")
        await h.advance(1)
        assert r.outcome == "ondemand_stopped"
        assert "was stopped by an administrator" in r.message
        assert a not in h.controller.actors
        assert h.broker.held_total() == 0

    box(tmp_path, t)


# --- the memory watchdog ---------------------------------------------------------------------


def test_watchdog_order_is_idle_first_then_least_recently_used() -> None:
    victims = [
        Victim("busy-old", False, 1.0),
        Victim("idle-new", True, 9.0),
        Victim("idle-old", True, 2.0),
        Victim("busy-new", False, 8.0),
    ]
    assert watchdog_order(victims) == ["idle-old", "idle-new", "busy-old", "busy-new"]


class ScriptedMemory:
    """A memory source the test sets."""

    def __init__(self, free: int) -> None:
        self.free = free

    async def free_bytes(self) -> int:
        return self.free


def test_the_watchdog_stops_on_demand_models_idle_first_and_never_always_on(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        keep = await h.deploy("keep", 10, mode="always_on")
        idle = await h.deploy("idle", 10, idle_timeout_s=3600)
        busy = await h.deploy("busy", 10, idle_timeout_s=60)
        await h.advance(STARTUP_S * 3 + 6)
        h.request(busy, hold_s=10_000)  # a request being answered
        await h.advance(1)
        memory = ScriptedMemory(free=1 * GIB)
        dog = WatchdogActor(
            clock=h.clock,
            source=memory,
            actors=lambda: list(h.controller.actors.values()),
            threshold_bytes=2 * GIB,
            every_s=5,
        )
        dog.start()
        await h.advance(6)
        assert h.state(idle) == "stopped"  # the idle one first (its timeout is long: not idle
        assert h.state(busy) == "ready"  # by the seed's rules, but idle for the watchdog)
        await h.advance(5)
        assert h.state(busy) == "stopped"  # still short: now the busy one, cut off
        await h.advance(30)
        assert h.state(keep) == "ready"  # never an always-on deployment
        memory.free = 50 * GIB
        await h.advance(30)
        await dog.stop()
        recs = await h.events()
        sleeps = [r.event for r in recs if isinstance(r.event, m.PutToSleep)]
        assert [e.reason for e in sleeps] == ["watchdog", "watchdog"]
        assert [r.action for r in audit_rows(recs)].count("watchdog_stop") == 2

    box(tmp_path, t, usable_gib=100)


def test_a_failed_always_on_deployment_keeps_its_memory_for_its_restart(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        keep = await h.deploy("keep", 60, mode="always_on")
        busy = await h.deploy("busy", 30, idle_timeout_s=3600)
        await h.advance(STARTUP_S * 2 + 4)
        h.request(busy, hold_s=10_000)
        od = await h.deploy("od", 30, idle_timeout_s=60)
        assert h.state(od) == "stopped"  # 10 GiB free: it does not fit
        h.runtime.fail_next_launch = "no GPU left"  # its immediate restart fails to start
        h.runtime.kill(keep)
        await h.advance(6)
        assert h.state(keep) == "failed"
        r = h.request(od)  # the 60 GiB are kept for keep's restart, not given to od
        await h.advance(10)
        assert r.queued and h.state(od) == "stopped"
        await h.advance(60 + STARTUP_S)
        assert h.state(keep) == "ready"  # restarted after the 60 s backoff
        await h.controller.stop(keep, "admin:test")
        await h.advance(STARTUP_S + 2)  # stopped by an administrator: od gets the memory
        assert r.outcome == "served"

    box(tmp_path, t, usable_gib=100)
