"""An engine lost behind DGXMM's back, on the virtual clock with the real actors (issue 34).

The gateway's side of it (a request that provably never reached its engine waits for it;
one the engine may have seen gets its error, never a second copy) is in
`tests/test_gateway_express.py` and `tests/test_gateway_app.py`; here is what the actors do
with such a request, done as the gateway does it (`lost_request`): the engine is checked,
recorded lost, started again through the memory check, and the request is served, from its
arrival for the queue's deadline and with the queued line only when it really waits for
memory.  And an always-on engine that hangs: requests that come while DGXMM replaces it wait
for the restart instead of being told to start it by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.admission import Refused
from actors.queue import WaiterImpl
from events import model as m
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour
from tests.gateway_support import run

STARTUP_S = 30.0


def lost_request(h: Harness, dep: str, rid: str, waited_s: float = 0.0) -> WaiterImpl:
    """What the gateway does with a request whose engine refused its connection: the lease
    it got (the engine looked ready) back, the controller told, then a wait."""
    lease = h.controller.try_acquire(dep)
    assert lease is not None, "the engine looked ready"
    lease.release()
    h.controller.engine_unreachable(dep)
    assert h.controller.try_acquire(dep) is None  # no second send before it is checked
    return h.controller.enqueue(dep, rid, waited_s=waited_s)


async def served_at(h: Harness, waiter: WaiterImpl, within_s: float) -> float:
    """Advance until the waiter has its lease (released at once); the virtual time."""
    end = h.clock.now() + within_s
    while not waiter.future.done():
        assert h.clock.now() < end, "not served in time"
        await h.advance(0.5)
    waiter.future.result().release()
    return h.clock.now()


def kinds(records: list[m.Recorded], dep: str) -> list[str]:
    return [
        type(r.event).__name__
        + (f":{r.event.reason}" if isinstance(r.event, m.StartRequested) else "")
        for r in records
        if r.stream == m.deployment_stream(dep)
    ]


def test_an_idle_on_demand_engine_killed_then_a_request_20_rounds_0_failures(
    tmp_path: Path,
) -> None:
    """The acceptance's rounds on the virtual clock: each request is served after exactly
    one cold start, never queued, and the log has the loss and the start for a request."""

    async def main() -> None:
        h = await Harness.create(
            tmp_path / "log.db", behaviour=lambda spec: EngineBehaviour(startup_s=STARTUP_S)
        )
        try:
            dep = await h.deploy("od", 10)
            await h.advance(STARTUP_S + 1)
            assert h.state(dep) == "ready"
            waits = []
            for n in range(20):
                h.runtime.kill(dep)  # SIGKILL while idle; the 5 s monitor has not looked
                sent = h.clock.now()
                waiter = lost_request(h, dep, f"r{n}")
                assert not waiter.queued.is_set()
                waits.append(await served_at(h, waiter, 3 * STARTUP_S) - sent)
                assert not waiter.queued.is_set()  # it waited for a start, not for memory
                await h.advance(1)
            assert all(STARTUP_S <= w <= STARTUP_S + 1 for w in waits), waits
            records = await h.events()
            got = kinds(records, dep)
            assert got.count("EngineLost") == 20
            assert got.count("StartRequested:request") == 20  # one cold start per round
            assert got.count("EngineStartFailed") == 0
            loss = got.index("EngineLost")
            assert got[loss : loss + 4] == [
                "EngineLost", "StartRequested:request", "EngineStarting", "EngineReady",
            ]  # fmt: skip
            left = [r.event for r in records if isinstance(r.event, m.RequestLeftQueue)]
            assert [e.reason for e in left] == ["served"] * 20
            assert h.violations == []
        finally:
            await h.close()

    run(main())


@pytest.mark.parametrize("waited_s", [0.0, 100.0])
def test_a_lost_request_keeps_its_arrival_for_the_queue_deadline(
    tmp_path: Path, waited_s: float
) -> None:
    """Both sides of the deadline: a start of 850 s fits in 900 s from now, not in 900 s from
    an arrival 100 s ago (the request spent them before its engine was found gone)."""

    async def main() -> None:
        h = await Harness.create(
            tmp_path / "log.db",
            behaviour=lambda spec: EngineBehaviour(startup_s=850 if spec.name else 0),
        )
        try:
            dep = await h.deploy("slow", 10)
            await h.advance(851)
            h.runtime.kill(dep)
            waiter = lost_request(h, dep, "r1", waited_s=waited_s)
            for _ in range(1800):
                if waiter.future.done():
                    break
                await h.advance(0.5)
            if waited_s:
                with pytest.raises(Refused) as refused:
                    waiter.future.result()
                assert refused.value.code == "ondemand_queue_timeout"
            else:
                waiter.future.result().release()
            records = await h.events()
            queued = [r for r in records if isinstance(r.event, m.RequestQueued)]
            assert queued[0].ts - queued[0].event.arrived_at == pytest.approx(waited_s, abs=0.01)
        finally:
            await h.close()

    run(main())


def test_a_lost_engine_that_does_not_fit_now_queues_its_request_with_the_line(
    tmp_path: Path,
) -> None:
    """The queue's rules after a loss: `big`, waiting for memory first, is the head and gets
    the memory the lost engine freed; the lost model's request is then really queued."""

    async def main() -> None:
        h = await Harness.create(
            tmp_path / "log.db",
            usable_gib=100,
            behaviour=lambda spec: EngineBehaviour(startup_s=10),
        )
        try:
            od = await h.deploy("od", 60, idle_timeout_s=3600)
            await h.advance(11)
            big = await h.deploy("big", 60, idle_timeout_s=3600)  # does not fit: not started
            await h.advance(1)
            head = h.request(big, hold_s=100)
            await h.advance(1)
            assert h.controller.queue.counts(big) == (1, 0)  # queued for memory
            h.runtime.kill(od)
            waiter = lost_request(h, od, "lost")
            assert not waiter.queued.is_set()  # waits for the check first
            await h.advance(2)
            assert waiter.queued.is_set() and not waiter.future.done()
            assert h.state(big) in ("starting", "ready") and head.outcome == "pending"
        finally:
            await h.close()

    run(main())


def test_a_hung_always_on_engine_is_restarted_and_requests_meanwhile_wait_for_it(
    tmp_path: Path,
) -> None:
    """SIGSTOP beyond the health window: the engine is lost and replaced; a request that
    comes while the old one is being stopped is neither refused ("start it from its page")
    nor queued: it waits for the restart and is served.  The view names the loss while the
    restart runs (the gateway's error for the request the hung engine had)."""

    async def main() -> None:
        h = await Harness.create(
            tmp_path / "log.db",
            behaviour=lambda spec: EngineBehaviour(startup_s=STARTUP_S),
            stop_s=5.0,  # the hung engine takes a while to go (SIGTERM, then SIGKILL)
        )
        try:
            dep = await h.deploy("ao", 10, mode="always_on")
            await h.advance(STARTUP_S + 1)
            h.runtime.hang(dep)
            for _ in range(200):
                view = h.controller.view(dep)
                assert view is not None
                if view.lost is not None:
                    break
                await h.advance(0.5)
            assert view.lost is not None and "health check for 30 s" in view.lost
            assert h.state(dep) == "stopped"  # the hung engine is being stopped
            waiter = h.controller.enqueue(dep, "meanwhile")  # not refused
            served = await served_at(h, waiter, 3 * STARTUP_S)
            assert not waiter.queued.is_set()
            view = h.controller.view(dep)
            assert view is not None and view.lost is None and view.state == "ready"
            records = await h.events()
            got = kinds(records, dep)
            assert got[-4:] == [
                "EngineLost", "StartRequested:restart", "EngineStarting", "EngineReady",
            ]  # fmt: skip
            assert served > 0
        finally:
            await h.close()

    run(main())
