"""The on-demand controller's rules, on the virtual clock, driving the real actors."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from actors.deployment import IdleCheck, Refusal, direct_calls, may_make_room
from actors.errors import MailboxFull
from actors.ports import EngineLoad
from events import model as m
from events.projections import audit_rows, deployment_events
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour

STARTUP_S = 30.0


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def box(tmp_path: Path, test: Callable[[Harness], Awaitable[None]], **kwargs: Any) -> None:
    behaviour = kwargs.pop("behaviour", None) or (lambda spec: EngineBehaviour(startup_s=STARTUP_S))

    async def main() -> None:
        h = await Harness.create(tmp_path / "log.db", behaviour=behaviour, **kwargs)
        try:
            await test(h)
            assert h.violations == []
        finally:
            await h.close()

    run(main())


async def settle_ready(h: Harness, *ids: str) -> None:
    await h.advance(STARTUP_S + 2)
    for dep_id in ids:
        assert h.state(dep_id) == "ready"


async def put_to_sleep(h: Harness, dep_id: str) -> None:
    """Let it idle out (default 300 s)."""
    await h.advance(301 + 15)
    assert h.state(dep_id) == "stopped"


def titles(recs: list[m.Recorded], dep_id: str) -> list[str]:
    return [row.title for row in deployment_events(recs, dep_id)]


# --- idle sleep ------------------------------------------------------------------------------


def test_an_on_demand_deployment_starts_at_once_and_sleeps_only_after_a_full_idle_timeout(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)
        assert h.state(a) == "starting"
        await settle_ready(h, a)
        await h.advance(290)
        assert h.state(a) == "ready"
        await h.advance(20)
        assert h.state(a) == "stopped"
        recs = await h.events()
        assert "Put to sleep after 5 min idle" in titles(recs, a)
        sleeps = [r for r in audit_rows(recs) if r.action == "ondemand_sleep"]
        assert [(r.actor, r.details["reason"]) for r in sleeps] == [("ondemand", "idle")]

    box(tmp_path, t)


def test_a_request_in_flight_keeps_the_model_awake_and_its_end_restarts_the_timer(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)
        await settle_ready(h, a)
        h.request(a, hold_s=600)
        await h.advance(650)
        assert h.state(a) == "ready"  # in flight for 600 s, then 50 s idle
        await h.advance(240)
        assert h.state(a) == "ready"
        await h.advance(30)
        assert h.state(a) == "stopped"

    box(tmp_path, t)


def lease_once(h: Harness, dep_id: str) -> None:
    """A request as the gateway's hot path makes it: a lease taken and given back."""
    lease = h.controller.try_acquire(dep_id)
    assert lease is not None
    lease.release()


async def sleeps_for_idle_after(h: Harness, dep_id: str, timeout_s: int) -> None:
    """Still ready a moment before `timeout_s` from now, asleep for "idle" right after it."""
    await h.advance(timeout_s - 0.1)
    assert h.state(dep_id) == "ready"
    await h.advance(0.2)
    assert h.state(dep_id) == "stopped"
    [ev] = [r.event for r in await h.events() if isinstance(r.event, m.PutToSleep)]
    assert (ev.reason, ev.idle_timeout_s, ev.idle_for_s) == ("idle", timeout_s, timeout_s)


def test_the_idle_timer_runs_from_the_last_requests_end_however_many_came_before(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, idle_timeout_s=60)
        await settle_ready(h, a)
        # A request every 8 s for 400 s: the timer armed after the first one fires early
        # again and again (lazily kept, not re-armed per request) and must re-arm each time.
        for _ in range(50):
            await h.advance(7)
            lease = h.controller.try_acquire(a)
            assert lease is not None
            await h.advance(1)
            lease.release()
        await sleeps_for_idle_after(h, a, 60)

    box(tmp_path, t)


def test_requests_leave_one_idle_timer_armed_not_one_per_request(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, idle_timeout_s=60)
        await settle_ready(h, a)
        scheduled: list[float] = []
        schedule = h.clock.call_later

        def counted(delay: float, callback: Callable[[], None]) -> Any:
            scheduled.append(delay)
            return schedule(delay, callback)

        h.clock.call_later = counted  # type: ignore[method-assign]
        for _ in range(1000):
            lease_once(h, a)
        assert scheduled == []  # the idle timer armed when it became ready still stands
        await sleeps_for_idle_after(h, a, 60)

    box(tmp_path, t)


def test_an_idle_timer_that_fires_a_moment_early_still_puts_the_model_to_sleep(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, idle_timeout_s=60)
        await settle_ready(h, a)
        schedule = h.clock.call_later

        def early(delay: float, callback: Callable[[], None]) -> Any:
            # As uvloop's timers can (millisecond resolution): never more than half early.
            return schedule(delay - min(1e-3, delay / 2), callback)

        h.clock.call_later = early  # type: ignore[method-assign]
        lease_once(h, a)
        await sleeps_for_idle_after(h, a, 60)

    box(tmp_path, t)


def test_a_default_timeout_shortened_during_a_request_counts_from_its_end(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)  # the default: 300 s, armed when it became ready
        await settle_ready(h, a)
        h.request(a, hold_s=100)
        await h.advance(50)
        await h.controller.change_settings({"ondemand_idle_timeout_s": 60}, "admin:test")
        await h.advance(50)  # the request ended: 60 s from now, not the timer armed for 300
        await sleeps_for_idle_after(h, a, 60)

    box(tmp_path, t)


def test_an_idle_check_lost_to_a_full_mailbox_is_armed_again_by_the_next_request(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, idle_timeout_s=60)
        await settle_ready(h, a)
        actor = h.controller.actors[a]
        tell = actor.tell

        def full(message: Any) -> None:
            if isinstance(message, IdleCheck):
                raise MailboxFull("full")  # dropped with a warning, as `_ScheduledMessage` does
            tell(message)

        actor.tell = full  # type: ignore[method-assign]
        await h.advance(61)
        assert h.state(a) == "ready"  # its check was lost
        actor.tell = tell  # type: ignore[method-assign]
        lease_once(h, a)
        await sleeps_for_idle_after(h, a, 60)

    box(tmp_path, t)


def test_engine_metrics_showing_work_keep_it_awake_but_do_not_restart_the_timer(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)
        await settle_ready(h, a)
        engine = h.runtime.engine_of(a)
        assert engine is not None
        engine.running_requests = 1  # a direct call to the engine port
        await h.advance(400)
        assert h.state(a) == "ready"
        engine.running_requests = 0
        await h.advance(20)  # the timer had already run out: sleeps at the next check
        assert h.state(a) == "stopped"

    box(tmp_path, t)


def test_a_reading_that_counted_the_gateways_own_request_does_not_outlive_it(
    tmp_path: Path,
) -> None:
    """The engine's metrics count the gateway's requests too: once they have ended, only the
    reading's requests beyond them (direct calls) keep the model from making room, wherever
    the request fell between two scrapes."""

    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)
        await settle_ready(h, a)
        actor = h.controller.actors[a]
        engine = h.runtime.engine_of(a)
        assert engine is not None

        def make_room_now() -> tuple[bool, str]:
            return may_make_room(actor.state, actor.activity, h.clock.now(), 300, 0)

        lease = h.controller.try_acquire(a)
        assert lease is not None
        engine.running_requests = 1  # the engine answers the gateway's request
        await h.advance(6)  # a scrape sees it
        assert actor.activity.load is not None and actor.activity.load.running == 1
        assert actor.activity.direct == 0
        engine.running_requests = 0
        lease.release()
        assert make_room_now() == (True, "idle")  # before the next scrape

        lease = h.controller.try_acquire(a)
        assert lease is not None
        engine.running_requests = 2  # the gateway's request and a direct call
        await h.advance(6)
        assert actor.activity.direct == 1
        engine.running_requests = 1
        lease.release()
        assert make_room_now() == (False, "the engine reports requests")
        engine.running_requests = 0
        await h.advance(6)  # the next scrape sees the direct call ended
        assert make_room_now() == (True, "idle")

    box(tmp_path, t)


def test_direct_calls_are_the_readings_requests_beyond_the_gateways_own() -> None:
    assert direct_calls(None, 0, 0) == 0
    assert direct_calls(EngineLoad(running=1, waiting=0), 0, 0) == 1  # a direct call
    assert direct_calls(EngineLoad(running=1, waiting=0), 1, 0) == 0  # the gateway's own
    assert direct_calls(EngineLoad(running=1, waiting=0), 0, 1) == 0  # ... ended since
    assert direct_calls(EngineLoad(running=2, waiting=1), 1, 1) == 1
    assert direct_calls(EngineLoad(running=0, waiting=0), 2, 0) == 0  # not there yet


def test_a_vllm_engine_put_into_sleep_mode_by_hand_counts_as_idle(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, engine="vllm")
        await settle_ready(h, a)
        engine = h.runtime.engine_of(a)
        assert engine is not None
        engine.running_requests = 1
        engine.sleeping = True
        await h.advance(10)
        assert h.state(a) == "asleep"
        await h.advance(310)
        assert h.state(a) == "stopped"

    box(tmp_path, t)


# --- starting for requests -------------------------------------------------------------------


def test_requests_for_a_stopped_model_that_fits_wait_for_one_start_and_are_not_queued(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)
        await settle_ready(h, a)
        await put_to_sleep(h, a)
        launches = len(h.runtime.launches)
        r1 = h.request(a)
        await h.advance(5)
        r2 = h.request(a)
        await h.advance(STARTUP_S + 2)
        assert (r1.outcome, r2.outcome) == ("served", "served")
        assert not r1.queued and not r2.queued
        assert len(h.runtime.launches) == launches + 1
        recs = await h.events()
        assert titles(recs, a).count("Started for a request") == 1
        assert [r.action for r in audit_rows(recs)].count("ondemand_start") == 1

    box(tmp_path, t)


# --- making room -----------------------------------------------------------------------------


def test_the_head_makes_room_with_the_least_recently_used_idle_model_even_a_larger_one(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        big = await h.deploy("big", 60, idle_timeout_s=60)
        small = await h.deploy("small", 20, idle_timeout_s=60)
        await h.advance(STARTUP_S * 2 + 4)
        h.request(big)  # big is used first: it is the least recently used
        await h.advance(5)
        h.request(small)
        await h.advance(2)
        engines = [h.runtime.engine_of(big), h.runtime.engine_of(small)]
        for engine in engines:
            assert engine is not None
            engine.running_requests = 1  # direct calls keep both awake past their timeout
        await h.advance(120)
        assert (h.state(big), h.state(small)) == ("ready", "ready")
        c = await h.deploy("c", 30, idle_timeout_s=60)
        assert h.state(c) == "stopped"  # 20 GiB free: it does not fit yet
        r = h.request(c)
        await h.advance(0.5)
        assert r.queued  # neither is idle yet: their engines report work
        for engine in engines:
            assert engine is not None
            engine.running_requests = 0
        await h.advance(5)  # the next scrape shows them quiet: both idle now
        await h.advance(STARTUP_S + 2)
        assert r.outcome == "served"
        assert h.state(big) == "stopped"  # the LRU one, though larger than needed
        recs = await h.events()
        assert "Put to sleep to make room for c" in titles(recs, big)
        sleeps = [x for x in audit_rows(recs) if x.action == "ondemand_sleep"]
        # Only as many as needed: small was not stopped for c (it may idle out on its own).
        made_room = [x.target for x in sleeps if x.details["reason"] == "make_room"]
        assert made_room == [m.deployment_stream(big)]
        assert {x.details["reason"] for x in sleeps if x.target == m.deployment_stream(small)} <= {
            "idle"
        }

    box(tmp_path, t, usable_gib=100)


def test_no_model_is_stopped_when_all_idle_candidates_together_would_not_free_enough(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        keep = await h.deploy("keep", 50, mode="always_on")
        idle = await h.deploy("idle", 20, idle_timeout_s=60)
        busy = await h.deploy("busy", 20, idle_timeout_s=60)
        await h.advance(STARTUP_S * 3 + 6)
        h.request(busy, hold_s=1000)
        engine = h.runtime.engine_of(idle)
        assert engine is not None
        engine.running_requests = 1
        await h.advance(100)
        engine.running_requests = 0
        huge = await h.deploy("huge", 45, idle_timeout_s=60)
        r = h.request(huge)  # 10 free + 20 idle = 30 < 45: nothing is stopped for it
        await h.advance(6)
        assert r.queued
        recs = await h.events()
        assert not any(
            isinstance(x.event, m.PutToSleep) and x.event.reason == "make_room" for x in recs
        )
        assert h.state(keep) == "ready"

    box(tmp_path, t, usable_gib=100)


def test_plan_make_room_is_lru_only_as_many_as_needed_and_none_if_not_enough() -> None:
    from actors.memory_broker import Candidate, plan_make_room

    cands = [Candidate("big", 60, 1.0), Candidate("small", 20, 5.0), Candidate("mid", 30, 3.0)]
    assert plan_make_room(10, 20, cands) == []
    assert plan_make_room(30, 10, cands) == ["big"]  # LRU, though larger than needed
    assert plan_make_room(100, 10, cands) == ["big", "mid"]
    assert plan_make_room(200, 10, cands) is None


def test_plan_make_room_leaves_the_spared_while_the_others_alone_can_make_it() -> None:
    """A ready pre-warm (spared, as if used longest ago) stays while the other idle models
    can free enough; else it goes first, and again only as many as needed."""
    from actors.memory_broker import Candidate, plan_make_room

    pre = Candidate("pre", 40, -math.inf, expected_at=1000.0)
    cands = [pre, Candidate("chat", 30, 2.0), Candidate("writer", 36, 1.0)]
    assert plan_make_room(30, 0, cands) == ["writer"]
    assert plan_make_room(60, 0, cands) == ["writer", "chat"]
    assert plan_make_room(40, 0, cands) == ["writer", "chat"]  # the others can: it stays
    assert plan_make_room(70, 0, cands) == ["pre", "writer"]  # they cannot: it goes first
    assert plan_make_room(40, 0, [pre, Candidate("chat", 30, 2.0)]) == ["pre"]
    assert plan_make_room(110, 0, cands) is None
    # Of the spared, the one expected latest goes first, whatever their names or last use.
    soon = Candidate("a-soon", 40, -math.inf, expected_at=900.0)
    assert plan_make_room(40, 0, [soon, pre]) == ["pre"]
    assert plan_make_room(70, 0, [soon, pre]) == ["pre", "a-soon"]


def test_an_always_on_deployment_and_the_decision_model_are_never_put_to_sleep(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        keep = await h.deploy("keep", 40, mode="always_on")
        decide = await h.deploy("decide", 20, mode="always_on", role="decision")
        await h.advance(STARTUP_S * 2 + 4)
        od = await h.deploy("od", 50, idle_timeout_s=60)
        assert h.state(od) == "stopped"
        r = h.request(od)
        await h.advance(1000)
        assert r.outcome == "does_not_fit"
        assert h.state(keep) == "ready" and h.state(decide) == "ready"
        with pytest.raises(Refusal) as err:
            await h.controller.change_mode(decide, "on_demand", None, True, "admin:test")
        assert err.value.status == 409

    box(tmp_path, t, usable_gib=100)


# --- the failure bullets ---------------------------------------------------------------------


def test_a_model_that_can_never_fit_fails_at_once_with_does_not_fit(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        await h.deploy("keep", 60, mode="always_on")
        await h.advance(STARTUP_S + 2)
        od = await h.deploy("huge", 50)
        r = h.request(od)
        await h.advance(0.1)
        assert r.outcome == "does_not_fit"
        assert r.message == "huge needs 50 GiB but at most 40 GiB can be freed for on-demand models"
        assert r.waited == 0

    box(tmp_path, t, usable_gib=100)


def test_the_65th_waiting_request_is_refused_with_queue_full(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("a", 10)
        await settle_ready(h, a)
        await put_to_sleep(h, a)
        rs = [h.request(a) for _ in range(3)]
        extra = h.request(a)
        await h.advance(0.1)
        assert extra.outcome == "ondemand_queue_full"
        assert extra.retry_after == 60
        await h.advance(STARTUP_S + 2)
        assert [r.outcome for r in rs] == ["served"] * 3

    box(tmp_path, t, settings={"ondemand_max_queued": 3})


def test_requests_for_a_ready_model_are_never_refused_even_with_a_full_queue(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("a", 10, idle_timeout_s=3600)
        b = await h.deploy("b", 10)
        await h.advance(STARTUP_S * 2 + 4)
        await put_to_sleep(h, b)
        waiting = [h.request(b) for _ in range(2)]
        ready = h.request(a, hold_s=0.1)
        await h.advance(0.5)
        assert ready.outcome == "served"
        await h.advance(STARTUP_S + 2)
        assert [w.outcome for w in waiting] == ["served", "served"]

    box(tmp_path, t, settings={"ondemand_max_queued": 2})


def test_a_request_still_not_served_at_its_deadline_gets_queue_timeout(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("slow", 10)
        await h.advance(1)
        await h.controller.stop(a, "admin:test")
        await h.advance(1)
        rs = [h.request(a) for _ in range(3)]
        await h.advance(21)
        assert [r.outcome for r in rs] == ["ondemand_queue_timeout"] * 3
        assert rs[0].message == "model slow is busy; try again later"
        assert rs[0].retry_after == 60
        await h.advance(200)  # the start that began still finishes
        assert h.state(a) == "ready"
        recs = await h.events()
        timeouts = [r for r in audit_rows(recs) if r.action == "ondemand_queue_timeout"]
        assert len(timeouts) == 1  # at most once a minute per deployment
        assert titles(recs, a).count("Queued request timed out") == 1

    box(
        tmp_path,
        t,
        settings={"ondemand_queue_timeout_s": 20},
        behaviour=lambda spec: EngineBehaviour(startup_s=120),
    )


def test_a_failed_start_fails_every_waiter_and_backs_off_60_s_then_doubles(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("broken", 10)
        await h.advance(STARTUP_S + 2)
        assert h.state(a) == "failed"
        h.runtime._behaviour = lambda spec: EngineBehaviour(
            startup_s=5, fail_at_start="CUDA out of memory"
        )
        await h.advance(60)  # the first failure's backoff is over
        r1, r2 = h.request(a), h.request(a)
        await h.advance(10)
        assert (r1.outcome, r2.outcome) == ("start_failed", "start_failed")
        assert r1.message.startswith("broken could not start: the engine exited")
        assert "CUDA out of memory" in r1.message
        early = h.request(a)
        await h.advance(0.1)
        assert early.outcome == "start_failed"  # within 120 s: no new start
        launches = len(h.runtime.launches)
        await h.advance(120)
        h.request(a)
        await h.advance(1)
        assert len(h.runtime.launches) == launches + 1
        dep = h.controller.actors[a].state
        assert dep.failures == 2

    box(
        tmp_path,
        t,
        behaviour=lambda spec: EngineBehaviour(startup_s=STARTUP_S, fail_at_start="boom"),
    )


def test_a_successful_start_resets_the_backoff(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("flaky", 10)
        await h.advance(STARTUP_S + 2)
        assert h.controller.actors[a].state.failures == 1
        h.runtime._behaviour = lambda spec: EngineBehaviour(startup_s=STARTUP_S)
        await h.controller.start(a, "admin:test")  # an admin Start is allowed at once
        await h.advance(STARTUP_S + 2)
        assert h.state(a) == "ready"
        assert h.controller.actors[a].state.failures == 0

    box(tmp_path, t, behaviour=lambda spec: EngineBehaviour(startup_s=STARTUP_S, fail_at_start="x"))


def test_an_admin_stop_while_starting_for_requests_fails_them_with_ondemand_stopped(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)
        await settle_ready(h, a)
        await put_to_sleep(h, a)
        r = h.request(a)
        await h.advance(5)
        await h.controller.stop(a, "admin:alice")
        await h.advance(1)
        assert r.outcome == "ondemand_stopped"
        assert r.message == (
            "alpha was stopped by an administrator (admin:alice) while it was starting for "
            "this request"
        )
        r2 = h.request(a)  # not a start failure: the next request starts it at once
        await h.advance(STARTUP_S + 2)
        assert r2.outcome == "served"

    box(tmp_path, t)


def test_a_client_that_hangs_up_while_queued_leaves_and_nothing_starts_for_it(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("a", 60, idle_timeout_s=600)
        await settle_ready(h, a)
        h.request(a)
        await h.advance(2)
        b = await h.deploy("b", 60)
        await h.advance(1)
        r = h.request(b, hang_up_after_s=30)
        await h.advance(1)
        assert r.queued
        await h.advance(40)
        assert r.outcome == "client_gone"
        assert len(h.controller.queue) == 0
        await h.advance(700)  # a idles out; nothing starts b
        assert h.state(b) == "stopped"
        recs = await h.events()
        left = [x.event for x in recs if isinstance(x.event, m.RequestLeftQueue)]
        assert [e.reason for e in left] == ["client_gone"]

    box(tmp_path, t, usable_gib=100)


# --- the queue -------------------------------------------------------------------------------


def test_queued_requests_are_served_first_come_first_served(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        hog = await h.deploy("hog", 80, idle_timeout_s=60)
        await settle_ready(h, hog)
        h.request(hog, hold_s=100)
        x = await h.deploy("x", 50, idle_timeout_s=60)
        y = await h.deploy("y", 50, idle_timeout_s=60)
        await h.advance(1)
        rx = h.request(x)
        await h.advance(1)
        ry = h.request(y)
        await h.advance(1)
        assert rx.queued and ry.queued
        await h.advance(1000)
        assert rx.outcome == "served" and ry.outcome == "served"
        assert rx.admitted_at is not None and ry.admitted_at is not None
        assert rx.admitted_at < ry.admitted_at

    box(tmp_path, t, usable_gib=100)


def test_a_later_request_goes_ahead_only_when_it_fits_in_free_memory(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        hog = await h.deploy("hog", 70, idle_timeout_s=60)
        await settle_ready(h, hog)
        h.request(hog, hold_s=500)
        large = await h.deploy("large", 60, idle_timeout_s=60)
        small = await h.deploy("small", 20, idle_timeout_s=60)
        await h.advance(1)
        await h.controller.stop(small, "admin:test")
        await h.controller.stop(large, "admin:test")
        await h.advance(1)
        r_large = h.request(large)
        await h.advance(1)
        r_small = h.request(small)
        await h.advance(STARTUP_S + 5)
        assert r_large.queued
        assert r_small.outcome == "served"  # fits in the 30 GiB free: goes ahead
        recs = await h.events()
        admitted = [x.event for x in recs if isinstance(x.event, m.RequestAdmitted)]
        assert any(e.jumped_ahead and e.request_id == r_small.request_id for e in admitted)
        await h.advance(1200)
        assert r_large.outcome == "served"

    box(tmp_path, t, usable_gib=100)


# --- modes -----------------------------------------------------------------------------------


def test_switching_a_stopped_on_demand_deployment_to_always_on_starts_it_first(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)
        await settle_ready(h, a)
        await put_to_sleep(h, a)
        rec = await h.controller.change_mode(a, "always_on", None, True, "admin:test")
        assert rec.mode == "on_demand" and rec.pending_mode == "always_on"
        assert rec.badge == "Loading"  # for the switch: no request waits for it
        r = h.request(a)  # requests meanwhile wait for the start like any on-demand one
        await h.advance(STARTUP_S + 2)
        rec = h.controller.record(h.controller.actors[a])
        assert rec.mode == "always_on" and rec.pending_mode is None
        assert r.outcome == "served"
        await h.advance(3600)
        assert h.state(a) == "ready"
        recs = await h.events()
        assert "ondemand_mode" in [r.action for r in audit_rows(recs)]

    box(tmp_path, t)


def test_switching_to_always_on_is_refused_when_it_does_not_fit(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        keep = await h.deploy("keep", 80, mode="always_on")
        await settle_ready(h, keep)
        a = await h.deploy("alpha", 30)
        with pytest.raises(Refusal) as err:
            await h.controller.change_mode(a, "always_on", None, True, "admin:test")
        assert err.value.code == "insufficient_memory"
        assert h.controller.actors[a].state.mode == "on_demand"

    box(tmp_path, t, usable_gib=100)


def test_always_on_to_on_demand_starts_the_idle_timer_at_the_switch(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, mode="always_on")
        await settle_ready(h, a)
        await h.advance(1000)
        await h.controller.change_mode(a, "on_demand", 120, False, "admin:test")
        await h.advance(100)
        assert h.state(a) == "ready"
        await h.advance(40)
        assert h.state(a) == "stopped"
        recs = await h.events()
        assert "Put to sleep after 2 min idle" in titles(recs, a)

    box(tmp_path, t)


def test_a_deployment_at_the_default_idle_timeout_follows_later_changes_of_the_default(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10)
        await settle_ready(h, a)
        await h.controller.change_settings({"ondemand_idle_timeout_s": 60}, "admin:test")
        await h.advance(75)
        assert h.state(a) == "stopped"

    box(tmp_path, t)


# --- always on -------------------------------------------------------------------------------


def test_an_always_on_engine_that_dies_after_running_is_recorded_and_restarted_at_once(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, mode="always_on")
        await settle_ready(h, a)
        h.runtime.kill(a)
        await h.advance(6)
        assert h.state(a) == "starting"  # no 60-s backoff: the engine ran before it died
        recs = await h.events()
        assert any(isinstance(r.event, m.EngineLost) for r in recs)
        assert not any(isinstance(r.event, m.EngineStartFailed) for r in recs)
        await h.advance(STARTUP_S + 2)
        assert h.state(a) == "ready"

    box(tmp_path, t)


def test_an_always_on_restart_that_fails_to_start_waits_out_the_backoff(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, mode="always_on")
        await settle_ready(h, a)
        h.runtime.fail_next_launch = "no GPU left"
        h.runtime.kill(a)
        await h.advance(6)
        assert h.state(a) == "failed"
        await h.advance(30)
        assert h.state(a) == "failed"  # the backoff applies to failures to start
        await h.advance(30 + STARTUP_S + 2)
        assert h.state(a) == "ready"

    box(tmp_path, t)


def test_concurrent_admin_starts_never_over_commit_memory(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        ids = [await h.deploy(f"m{i}", 30, mode="always_on") for i in range(5)]
        await h.advance(STARTUP_S * 5 + 10)
        ready = [i for i in ids if h.state(i) == "ready"]
        assert len(ready) == 3
        assert h.broker.launched_total() <= h.broker.usable_bytes

    box(tmp_path, t, usable_gib=100)


def test_a_request_wakes_a_vllm_engine_put_to_sleep_by_hand(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        a = await h.deploy("alpha", 10, engine="vllm")
        await settle_ready(h, a)
        engine = h.runtime.engine_of(a)
        assert engine is not None
        engine.sleeping = True
        await h.advance(6)
        assert h.state(a) == "asleep"
        r = h.request(a, hold_s=0.1)
        await h.advance(1)
        assert r.outcome == "served" and not r.queued
        assert engine.sleeping is False  # POST /wake_up reached the engine
        assert h.state(a) == "ready"
        recs = await h.events()
        assert "Started for a request" in titles(recs, a)

    box(tmp_path, t)
