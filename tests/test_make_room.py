"""`ondemand_make_room_after_s` and the queue's re-plan, on the real actors and virtual clock.

The pure rule (`effective_make_room_after_s`, `may_make_room`, `MemoryBroker.replan`) is
tested directly; the rest runs the real controller, queue, broker and deployment actors on
the virtual clock (`simulations.harness`) with a real SQLite log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.controller import validate_settings
from actors.deployment import Activity, Refusal, may_make_room
from actors.memory_broker import GIB, Candidate, MemoryBroker
from events import model as m
from events.projections import audit_rows, deployment_events
from events.state import DeploymentState, Lifecycle, fold
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour

STARTUP_S = 10.0


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def dep(idle: int | None = None, room: int | None = None) -> DeploymentState:
    return DeploymentState(
        deployment_id="d",
        name="d",
        engine="sim",
        model="org/d",
        memory_bytes=GIB,
        mode="on_demand",
        idle_timeout_s=idle,
        role="model",
        args=[],
        image=None,
        gpu=False,
        created_at=0.0,
        lifecycle=Lifecycle.READY,
        make_room_after_s=room,
    )


def quiet_since(t: float, in_flight: int = 0) -> Activity:
    act = Activity(t)
    act.in_flight = in_flight
    return act


# --- the rule, pure -------------------------------------------------------------------------


def test_unset_everywhere_the_make_room_threshold_is_the_idle_timeout() -> None:
    assert dep(idle=600).effective_make_room_after_s(300, None) == 600
    assert dep().effective_make_room_after_s(300, None) == 300


def test_the_deployment_override_wins_over_the_default() -> None:
    assert dep(room=30).effective_make_room_after_s(300, 120) == 30
    assert dep(room=None).effective_make_room_after_s(300, 120) == 120
    assert dep(room=0).effective_make_room_after_s(300, 120) == 0


def test_the_threshold_is_never_longer_than_the_idle_timeout() -> None:
    assert dep(idle=60, room=600).effective_make_room_after_s(300, None) == 60


def test_with_zero_a_model_with_nothing_in_flight_may_make_room_at_once() -> None:
    ok, _ = may_make_room(dep(), quiet_since(100.0), 100.0, 300, 0)
    assert ok


def test_a_model_used_more_recently_than_the_setting_may_not_make_room() -> None:
    ok, why = may_make_room(dep(), quiet_since(100.0), 129.0, 300, 30)
    assert not ok and why == "used recently"
    ok, _ = may_make_room(dep(), quiet_since(100.0), 130.0, 300, 30)
    assert ok


def test_a_busy_model_never_makes_room_even_with_zero() -> None:
    ok, why = may_make_room(dep(), quiet_since(0.0, in_flight=1), 1000.0, 300, 0)
    assert not ok and "in flight" in why


def test_an_always_on_model_never_makes_room() -> None:
    always = msgspec.structs.replace(dep(), mode="always_on")
    ok, _ = may_make_room(always, quiet_since(0.0), 1000.0, 300, 0)
    assert not ok


def test_the_setting_accepts_null_and_zero_and_refuses_the_rest() -> None:
    assert validate_settings({"ondemand_make_room_after_s": None}) == {
        "ondemand_make_room_after_s": None
    }
    assert validate_settings({"ondemand_make_room_after_s": 0}) == {"ondemand_make_room_after_s": 0}
    for bad in (-1, 86401, 1.5, "30", True):
        with pytest.raises(Refusal) as caught:
            validate_settings({"ondemand_make_room_after_s": bad})
        assert caught.value.status == 422
    with pytest.raises(Refusal):
        validate_settings({"ondemand_idle_timeout_s": None})  # only this key may be null


def test_replan_covers_the_shortfall_a_refused_victim_left_with_the_lru_candidate() -> None:
    async def main() -> None:
        broker = MemoryBroker(100 * GIB, 100 * GIB)
        for name, size in (("a", 40), ("b", 30), ("c", 20)):
            broker.adopt(name, size * GIB, always_on=False)
        cands = [Candidate("a", 40 * GIB, 1.0), Candidate("b", 30 * GIB, 2.0)]
        cands.append(Candidate("c", 20 * GIB, 3.0))
        assert broker.reserve("h", 45 * GIB, always_on=False, candidates=cands) == ["a"]
        broker.unmark_releasing("a")  # a got a request: it refused
        assert broker.shortfall() == 35 * GIB
        left = cands[1:]  # a is busy now: no longer a candidate
        assert broker.replan("h", left) == ["b", "c"]  # LRU, only as many as needed
        assert broker.shortfall() == 0
        assert broker.replan("h", left) == []

    run(main())


def test_replan_stops_nothing_when_the_candidates_left_are_not_enough() -> None:
    async def main() -> None:
        broker = MemoryBroker(100 * GIB, 100 * GIB)
        broker.adopt("a", 60 * GIB, always_on=False)
        broker.adopt("b", 30 * GIB, always_on=False)
        cands = [Candidate("a", 60 * GIB, 1.0), Candidate("b", 30 * GIB, 2.0)]
        assert broker.reserve("h", 70 * GIB, always_on=False, candidates=cands) == ["a"]
        broker.unmark_releasing("a")
        assert broker.replan("h", [Candidate("b", 30 * GIB, 2.0)]) is None
        assert broker.reserved_for("b") == 30 * GIB  # not marked for stopping

    run(main())


# --- on the real actors, virtual clock -------------------------------------------------------


async def box(tmp_path: Path, **settings: Any) -> Harness:
    return await Harness.create(
        tmp_path / "log.db",
        usable_gib=100,
        behaviour=lambda spec: EngineBehaviour(startup_s=STARTUP_S),
        settings=settings or None,
    )


async def served(h: Harness, deployment_id: str, hold_s: float = 1.0, limit_s: float = 600) -> Any:
    """Send one request and advance virtual time until it was answered (virtual deadline)."""
    r = h.request(deployment_id, hold_s)
    start = h.clock.now()
    while r.outcome == "pending":
        assert h.clock.now() - start < limit_s, "not answered in virtual time"
        await h.advance(0.5)
    assert r.outcome == "served", r.outcome
    return r


async def two_models(h: Harness) -> tuple[str, str]:
    """a and b, 60 GiB each on 100 GiB (they do not fit together), 5 min idle timeout; a ready."""
    a = await h.deploy("a", 60, idle_timeout_s=300)
    b = await h.deploy("b", 60, idle_timeout_s=300)
    await h.advance(20)
    return a, b


def sleeps(records: list[m.Recorded], h: Harness) -> list[tuple[str, str, str | None]]:
    names = {d: a.state.name for d, a in h.controller.actors.items()}
    return [
        (names[r.stream.partition(":")[2]], r.event.reason, names.get(r.event.for_deployment or ""))
        for r in records
        if isinstance(r.event, m.PutToSleep)
    ]


def test_a_victim_that_gets_a_request_between_plan_and_stop_serves_it_and_the_head_replans(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        h = await box(tmp_path)
        try:
            a = await h.deploy("a", 40)
            b = await h.deploy("b", 40)
            head = await h.deploy("head", 60)  # a and b are starting: it does not fit
            assert h.state(head) == "stopped"
            await h.advance(20)
            await served(h, a)  # a is the least recently used
            await served(h, b)
            await h.controller.change_settings({"ondemand_make_room_after_s": 0}, "admin:t")
            t0 = h.clock.now()
            wants_room = h.request(head, hold_s=1)  # plans: a (LRU) sleeps for the head
            races = h.request(a, hold_s=5)  # reaches a before its stop
            await h.clock.settle()
            assert races.admitted_at == t0  # served by the victim, which refused to stop
            assert h.state(a) == "ready"
            await h.advance(STARTUP_S + 2)
            # The head was served by the re-plan (b) after one cold start: no tick, no timer.
            assert wants_room.admitted_at is not None
            assert wants_room.admitted_at - t0 <= STARTUP_S + 1.0
            assert h.state(b) == "stopped"
            records = await h.events()
            assert sleeps(records, h) == [("b", "make_room", "head")]
            assert races.outcome == "pending" or races.outcome == "served"
            await h.advance(10)
            assert races.outcome == "served" and wants_room.outcome == "served"
            assert h.broker.shortfall() == 0
        finally:
            await h.close()

    run(main())


def test_the_head_keeps_waiting_when_no_candidate_is_left_and_replans_once_one_is(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        h = await box(tmp_path, ondemand_make_room_after_s=0)
        try:
            a = await h.deploy("a", 60)
            head = await h.deploy("head", 70)
            await h.advance(20)
            t0 = h.clock.now()
            wants_room = h.request(head, hold_s=1)  # plans: a sleeps
            h.request(a, hold_s=30)  # a refuses: nothing else to stop
            await h.advance(20)
            assert wants_room.admitted_at is None and h.state(a) == "ready"
            # a's request ends at t0+30: with 0 s it is a candidate at once; the queue
            # re-plans on that request's end, without waiting for its 15 s tick.
            await h.advance(11 + STARTUP_S)
            assert wants_room.admitted_at is not None
            assert wants_room.admitted_at - t0 <= 30 + STARTUP_S + 1.0
            assert sleeps(await h.events(), h) == [("a", "make_room", "head")]
        finally:
            await h.close()

    run(main())


def test_with_zero_alternating_requests_each_cost_one_stop_and_one_cold_start(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        h = await box(tmp_path, ondemand_make_room_after_s=0)
        try:
            a, b = await two_models(h)
            for target in (b, a, b, a):
                r = await served(h, target)
                assert r.waited <= STARTUP_S + 1.0, r.waited  # not 300 s of idle timer
            names = [s[:2] for s in sleeps(await h.events(), h)]
            assert names == [
                ("a", "make_room"),
                ("b", "make_room"),
                ("a", "make_room"),
                ("b", "make_room"),
            ]
        finally:
            await h.close()

    run(main())


def test_with_30_s_a_model_used_20_s_ago_is_not_stopped_but_is_at_30_s(tmp_path: Path) -> None:
    async def main() -> None:
        h = await box(tmp_path, ondemand_make_room_after_s=30)
        try:
            a, b = await two_models(h)
            await served(h, a)
            used = h.clock.now()
            await h.advance(20)
            r = h.request(b, hold_s=1)
            await h.advance(5)
            assert r.queued and h.state(a) == "ready"  # used 25 s ago: not a candidate
            await h.advance(5 + STARTUP_S + 1)
            # the queue looked again the moment a became a candidate (t = used + 30)
            assert r.admitted_at is not None
            assert r.admitted_at - (used + 30) <= STARTUP_S + 0.5
        finally:
            await h.close()

    run(main())


def test_a_model_whose_request_ends_while_the_head_waits_makes_room_on_time(tmp_path: Path) -> None:
    """The end of a request does not walk the queue unless it can change it now: the model
    it ended on becomes a candidate 10 s later, and the head's timer must count it from its
    end (the queue's 15 s tick would come up to 5 s late: the request ends just after one)."""

    async def main() -> None:
        h = await box(tmp_path, ondemand_make_room_after_s=10)
        try:
            a, b = await two_models(h)  # the queue ticks every 15 s from 0
            tick = 15.0 * (h.clock.now() // 15.0 + 5)
            await h.advance(tick - 44.0 - h.clock.now())
            h.request(a, hold_s=45)  # ends 1 s after a tick
            await h.advance(5)
            r = h.request(b, hold_s=1)  # a is busy: no candidate, none due
            await h.advance(1)
            assert r.queued
            ended = tick + 1.0
            await h.advance(ended + 9.5 - h.clock.now())
            assert r.admitted_at is None and h.state(a) == "ready"
            await h.advance(1 + STARTUP_S + 1)
            assert r.admitted_at is not None
            assert r.admitted_at - (ended + 10) <= STARTUP_S + 0.5, r.admitted_at - ended
        finally:
            await h.close()

    run(main())


def test_a_deployment_override_keeps_one_model_warm_while_the_default_is_zero(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        h = await box(tmp_path, ondemand_make_room_after_s=0)
        try:
            a = await h.deploy("a", 60, idle_timeout_s=300)
            b = await h.deploy("b", 60, idle_timeout_s=300)
            await h.controller.change_mode(a, "on_demand", None, True, "admin:t", 240)
            assert h.controller.actors[a].state.make_room_after_s == 240
            assert h.controller.actors[a].state.idle_timeout_s == 300  # kept
            await h.advance(20)
            await served(h, a)
            r = h.request(b, hold_s=1)
            await h.advance(60)
            assert r.queued and r.admitted_at is None and h.state(a) == "ready"
            records = await h.events()
            assert fold(records).deployments[a].make_room_after_s == 240  # replays
            mode = [row for row in audit_rows(records) if row.action == "ondemand_mode"]
            assert mode[-1].details["make_room_after_s"] == 240
        finally:
            await h.close()

    run(main())


def test_the_events_tab_of_the_head_names_the_models_stopped_for_it(tmp_path: Path) -> None:
    async def main() -> None:
        h = await box(tmp_path, ondemand_make_room_after_s=0)
        try:
            a = await h.deploy("a", 60)
            b = await h.deploy("b", 60)
            await h.advance(20)
            await served(h, b)
            records = await h.events()
            names = {d: x.state.name for d, x in h.controller.actors.items()}
            b_titles = [row.title for row in deployment_events(records, b, names, made_room=True)]
            assert "Made room: a put to sleep" in b_titles
            a_titles = [row.title for row in deployment_events(records, a, names, made_room=True)]
            assert "Put to sleep to make room for b" in a_titles
            assert not any(t.startswith("Made room") for t in a_titles)
            actions = [
                (row.action, row.details.get("reason"), row.details.get("for"))
                for row in audit_rows(records)
            ]
            assert ("ondemand_sleep", "make_room", "b") in actions
        finally:
            await h.close()

    run(main())


def test_the_fairness_cli_compares_the_seeds_rule_with_0_30_and_120_s() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "simulations.fairness", "--scenario", "three-two-fit",
         "--seed", "1", "--duration", "900", "--compare", "make-room"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| three-two-fit |")]
    assert [row.split("|")[2].strip() for row in rows] == ["seed's rule", "0 s", "30 s", "120 s"]
    mean = {row.split("|")[2].strip(): float(row.split("|")[3]) for row in rows}
    cold = {row.split("|")[2].strip(): float(row.split("|")[6]) for row in rows}
    # swapping at once waits less than waiting out the 5 min idle timer, and starts more
    assert mean["0 s"] < mean["seed's rule"] and cold["0 s"] > cold["seed's rule"]
