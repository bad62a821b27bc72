"""The learned policy (issue 44): what a model's own traffic says, and the controller acting on
it over the real actors on the virtual clock."""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from actors.anticipation import (
    BETWEEN_REASON,
    KEEP_FLOOR_S,
    Anticipator,
    Gaps,
    KeepWarm,
    Learned,
    Prediction,
    between_sessions,
    daily,
    keep_warm,
    lead_s,
    next_arrival,
    periodic,
    session_starts,
)
from actors.deployment import Refusal
from events import model as m
from events.projections import audit_rows, deployment_events
from events.traffic import TrafficRecord, encode_batch
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC, a Thursday
DAY = 86_400.0
START_S = 60.0


# --- keep-warm ---------------------------------------------------------------------------------


def test_keep_warm_covers_the_gaps_a_model_usually_has_and_no_more() -> None:
    rng = random.Random(1)
    # Sessions of requests 20-50 s apart, sessions hours apart.
    gaps = [rng.uniform(20, 50) for _ in range(300)] + [rng.uniform(3600, 7200) for _ in range(30)]
    keep = keep_warm(gaps, 900)
    assert keep.seconds is not None
    assert max(g for g in gaps if g < 900) < keep.seconds <= math.ceil(1.25 * 50)
    assert keep.reason == "its usual gaps"


def test_a_model_whose_next_request_is_always_far_away_sleeps_soon_after_its_last() -> None:
    keep = keep_warm([3600.0 * (1 + i % 3) for i in range(20)], 900)
    assert keep.seconds == KEEP_FLOOR_S
    assert keep.reason == "its next request is usually far away"


def test_a_periodic_model_keeps_warm_through_its_sessions_gaps_only() -> None:
    rng = random.Random(3)
    # Runs of requests 10-30 s apart, 13 minutes between the runs; a pre-warm 170 s ahead.
    within = [rng.uniform(10, 30) for _ in range(200)]
    pauses = [rng.uniform(760, 800) for _ in range(20)]
    ordered = sorted(within + pauses)
    seed = KeepWarm(seconds=None, reason="its gaps need its whole idle timeout")
    keep = between_sessions(ordered, 300, 170, seed)
    assert keep.reason == BETWEEN_REASON
    assert keep.seconds is not None and 30 < keep.seconds <= math.ceil(1.25 * 30)
    # A run whose requests never pause sleeps soon after its last.
    assert between_sessions(sorted(pauses), 300, 170, seed).seconds == KEEP_FLOOR_S
    # Not where the pause would leave it asleep for less than the pre-warm's lead, nor where
    # the keep-warm it has is already as short, nor without a pause between sessions.
    assert between_sessions(ordered, 300, 380, seed) is seed
    short = KeepWarm(seconds=20.0, reason="its usual gaps")
    assert between_sessions(ordered, 300, 170, short) is short
    assert between_sessions(sorted(within), 300, 170, seed) is seed


def test_a_pre_warm_leads_by_a_fifth_more_than_the_start_and_at_least_two_seconds_more() -> None:
    assert lead_s(90.0) == pytest.approx(108.0)  # a large model: a fifth of its start
    assert lead_s(90.0, early_s=30.0) == pytest.approx(138.0)  # ... and the sessions' spread
    # A small model's start of about a second took two on a busy box (the real llama.cpp's
    # pre-warm test, in the suite's side lane): a fifth of it would have been 0.2 s.
    assert lead_s(1.1) == pytest.approx(3.1)
    assert lead_s(None) == pytest.approx(36.0)  # never timed: 30 s assumed


def test_steady_traffic_and_too_little_history_keep_the_seeds_idle_timeout() -> None:
    rng = random.Random(2)
    poisson = [rng.expovariate(1 / 30) for _ in range(5000)]  # never idle for 300 s
    assert keep_warm(poisson, 300).seconds is None
    assert keep_warm([40.0, 4000.0, 50.0], 300).seconds is None  # fewer than MIN_GAPS


def test_gaps_spread_up_to_the_idle_timeout_keep_it_whole() -> None:
    rng = random.Random(3)
    gaps = [rng.expovariate(1 / 400) for _ in range(5000)]  # noise: as many just under 300
    assert keep_warm(gaps, 300).seconds is None


def test_the_gaps_kept_in_order_decide_as_the_gaps_themselves(monkeypatch: Any) -> None:
    """`Gaps` keeps its finite gaps sorted and its session beginnings per pause as gaps come
    and go (the oldest forgotten, the full history's oldest dropped): what they say is what
    the pure rules say of its gaps, after every step."""
    import actors.anticipation

    monkeypatch.setattr(actors.anticipation, "MAX_GAPS", 40)
    rng = random.Random(5)
    gaps, t = Gaps(), T0
    for step in range(600):
        t += rng.choice([rng.uniform(0, 30), rng.uniform(10, 400), rng.uniform(300, 4000)])
        gaps.observe(t, t + rng.uniform(0, 20))
        if step % 97 == 0:
            gaps.forget_before(t - rng.uniform(600, 6000))
        assert len(gaps.items) <= 40
        pause = rng.choice([15.0, 60.0, 300.0, 301.0])
        for idle in (60.0, 300.0, 900.0):
            assert gaps.keep_warm(idle) == keep_warm((g for _, g in gaps.items), idle)
        assert gaps.starts(pause) == session_starts(gaps.items, pause)
        copy = gaps.copy()
        assert copy.items == gaps.items and copy.starts(pause) == gaps.starts(pause)


def test_a_session_begins_at_its_first_arrival_whichever_request_is_heard_first() -> None:
    """A box hears its requests as they end: a session's first request, waiting out a cold
    start beside the next one, may be heard after it; its beginning is still its first."""
    gaps = Gaps()
    gaps.observe(T0, T0 + 5)
    gaps.observe(T0 + 600, T0 + 700)  # the second request, heard first (ended first)
    assert gaps.observe(T0 + 597, T0 + 701)  # the first: it began the session
    assert list(gaps.items) == [(T0, math.inf), (T0 + 597, 592.0)]
    assert gaps.starts(300.0) == [T0, T0 + 597]
    # A long stream heard last takes its span out of every gap it covered.
    gaps.observe(T0 + 1100, T0 + 1101)
    gaps.observe(T0 + 1500, T0 + 1501)
    assert gaps.starts(300.0) == [T0, T0 + 597, T0 + 1100, T0 + 1500]
    gaps.observe(T0 + 705, T0 + 1495)
    assert list(gaps.items) == [(T0, math.inf), (T0 + 597, 592.0)]
    assert gaps.starts(300.0) == [T0, T0 + 597] and gaps.busy_until == T0 + 1501


def test_the_gaps_are_the_same_whatever_order_the_requests_are_heard_in() -> None:
    """Arrival order (the what-if), end order (the box's traffic batches) or any order: the
    same gaps, beginnings and keep-warm, checked after every request against the pure
    rules as above."""
    rng = random.Random(11)
    for trial in range(200):
        t, spans = T0, []
        for _ in range(rng.randint(1, 40)):
            t += rng.choice([rng.uniform(0, 15), rng.uniform(5, 120), rng.uniform(200, 2000)])
            spans.append((t, t + rng.choice([rng.uniform(0, 5), rng.uniform(5, 90), 1500.0])))
        shuffled = spans[:]
        rng.shuffle(shuffled)
        heard = {}
        for name, order in (
            ("arrival", spans),
            ("end", sorted(spans, key=lambda s: s[1])),
            ("any", shuffled),
        ):
            gaps = Gaps()
            gaps.starts(300.0)  # kept as they come from here on
            for arrived, ended in order:
                gaps.observe(arrived, ended)
                assert gaps.starts(300.0) == session_starts(gaps.items, 300.0)
                assert gaps.keep_warm(900.0) == keep_warm((g for _, g in gaps.items), 900.0)
            heard[name] = (list(gaps.items), gaps.busy_until, gaps.first_seen)
        assert heard["end"] == heard["arrival"] == heard["any"], (trial, spans)


# --- prediction --------------------------------------------------------------------------------


def fifteen_minute_job(runs: int, seed: int = 4) -> list[float]:
    rng = random.Random(seed)
    return [T0 + i * 900 + rng.uniform(-30, 30) for i in range(runs)]


def test_a_job_every_15_minutes_is_predicted_from_its_fifth_run_in_its_second_hour() -> None:
    starts = fifteen_minute_job(5)
    assert periodic(starts[:4], starts[3] + 60) is None  # three gaps: not yet
    pred = periodic(starts, starts[4] + 60)
    assert pred is not None
    assert abs(pred.at - (T0 + 5 * 900)) < 60
    assert pred.pattern == "used every 15 min for 60 min"
    assert starts[4] - T0 < 2 * 3600  # in its second hour


def test_gaps_that_disagree_by_more_than_10_percent_are_no_period() -> None:
    starts = [T0, T0 + 900, T0 + 1800, T0 + 2700, T0 + 3700]  # the last gap 11 % longer
    assert periodic(starts, T0 + 3800) is None


def test_a_period_that_did_not_come_is_no_longer_predicted() -> None:
    starts = fifteen_minute_job(6)
    assert periodic(starts, starts[-1] + 900 + 200) is None


def test_a_run_that_waited_long_for_memory_still_leaves_the_next_run_its_beginning() -> None:
    """A job of two requests every 15 minutes.  Its fifth run's requests wait ten minutes
    for memory, so the box serves them until five minutes before the sixth run: as served,
    the job was idle less than `SESSION_PAUSE_S` before it.  Its sessions are where its
    demand begins, the waits left out, so the sixth run begins one and the period holds."""
    a = Anticipator(tz_offset_s=0.0)
    for run in range(6):
        t = T0 + run * 900
        wait = 600.0 if run == 4 else 0.0
        a.observe("job", t, t + wait + 2, wait)
        a.observe("job", t + 30, t + wait + 4, max(0.0, wait - 28))
    learned = a.learned("job", 900, T0 + 5 * 900 + 120)
    assert learned.prediction is not None
    assert learned.prediction.at == pytest.approx(T0 + 6 * 900)
    # The keep-warm is still learned from the gaps as served (the ten minutes were busy).
    idle = dict(a._traffic["job"].idle.items)
    assert idle[T0 + 5 * 900] == pytest.approx(900 - 604)


def weekday_mornings(days: int, at_h: float = 9.0, seed: int = 5) -> list[float]:
    """A session at about `at_h` on every weekday (2026-01-01 is a Thursday)."""
    rng = random.Random(seed)
    out = []
    for d in range(days):
        if (d + 3) % 7 < 5:
            out.append(T0 + d * DAY + at_h * 3600 + rng.uniform(-300, 300))
    return out


def test_a_weekday_morning_habit_is_predicted_for_the_next_weekday_and_not_the_weekend() -> None:
    starts = weekday_mornings(7)  # Thu .. Wed: Thu Fri, Mon Tue Wed
    now = T0 + 7 * DAY  # Thursday 00:00
    pred = daily(starts, now, 0.0)
    assert pred is not None
    assert abs(pred.at - (now + 9 * 3600)) < 600
    assert re.fullmatch(r"used around (08:55|09:00|09:05) on weekdays", pred.pattern)
    friday_night = T0 + 8 * DAY + 20 * 3600
    starts = weekday_mornings(9)
    pred = daily(starts, friday_night, 0.0)
    assert pred is None or pred.at > T0 + 10 * DAY  # nothing on Saturday or Sunday


def test_noise_is_never_predicted() -> None:
    rng = random.Random(6)
    t, starts = T0, []
    for _ in range(400):
        t += rng.expovariate(1 / 3000)
        starts.append(t)
    predicted = sum(
        next_arrival(starts[:i], starts[i - 1] + 1, 0.0) is not None for i in range(5, 400)
    )
    assert predicted < 400 * 0.05


def test_the_anticipator_learns_sessions_from_requests_and_forgets_removed_models() -> None:
    a = Anticipator(tz_offset_s=0)
    for start in fifteen_minute_job(6):
        for k in range(8):  # 2 minutes of requests every 15 s
            a.observe("job", start + 15 * k, start + 15 * k + 3)
    learned = a.learned("job", 300, T0 + 5 * 900 + 200)
    assert learned.keep.seconds is not None and learned.keep.seconds <= 1.25 * 12
    assert learned.prediction is not None
    assert abs(learned.prediction.at - (T0 + 6 * 900)) < 60
    a.forget("job")
    assert not a.has_data("job")


# --- the controller acting on it --------------------------------------------------------------


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def box(tmp_path: Path, test: Callable[[Harness], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        h = await Harness.create(
            tmp_path / "log.db",
            behaviour=lambda spec: EngineBehaviour(startup_s=START_S),
            **kwargs,
        )
        h.controller.prewarmer.anticipator.tz_offset_s = 0.0
        try:
            await test(h)
            assert h.violations == []
        finally:
            await h.close()

    run(main())


def titles(recs: list[m.Recorded], dep_id: str) -> list[str]:
    return [row.title for row in deployment_events(recs, dep_id)]


async def until(h: Harness, wall: float) -> None:
    await h.advance(max(0.0, wall - h.clock.wall()))


async def job_runs(h: Harness, dep: str, runs: int, period: float = 900.0) -> list[Any]:
    """`runs` sessions of two requests every `period`, from the next period's edge."""
    first = h.clock.wall() + period
    results = []
    for i in range(runs):
        await until(h, first + i * period)
        results.append(h.request(dep, hold_s=2))
        await h.advance(30)
        results.append(h.request(dep, hold_s=2))
    await h.advance(START_S + 10)
    return results


async def learned_job(h: Harness, **others: float) -> tuple[str, dict[str, str], float]:
    """A 10 GiB job of five runs every 15 minutes, beside `others` (name: GiB, stopped):
    its id, theirs, and when its sixth run is expected."""
    job = await h.deploy("job", 10, idle_timeout_s=300)
    ids = {name: await h.deploy(name, gib, idle_timeout_s=300) for name, gib in others.items()}
    await h.advance(START_S + 5)
    for dep in ids.values():
        await h.controller.stop(dep, "admin:test")
    await job_runs(h, job, 5)
    learned = h.controller.prewarmer.learned(h.controller.actors[job].state)
    assert learned is not None and learned.prediction is not None
    return job, ids, learned.prediction.at


async def abandon_a_starting_pre_warm(h: Harness, ahead_s: float = 40) -> tuple[str, Any]:
    """The job's pre-warm is still starting, `ahead_s` before its expected request, when
    `other`'s request needs its memory (in a 15 GiB box) or its start slot: the job, and that
    request once served."""
    job, ids, expected = await learned_job(h, other=10)
    await until(h, expected - ahead_s)
    assert h.state(job) == "starting"
    r = h.request(ids["other"], hold_s=1)
    await h.advance(START_S + 10)
    assert r.outcome == "served"
    return job, r


def test_a_periodic_model_is_pre_warmed_and_its_next_request_waits_for_nothing(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        job = await h.deploy("job", 10, idle_timeout_s=300)
        await h.advance(START_S + 5)
        results = await job_runs(h, job, 7)
        waited = [r.admitted_at is not None and r.admitted_at - r.arrived > 1 for r in results]
        # Each run's first request found it asleep (a cold start) until the pattern showed.
        assert waited[0:10:2] == [True] * 5
        assert waited[10] is False and waited[12] is False  # runs 6 and 7: pre-warmed
        recs = await h.events()
        pre = [t for t in titles(recs, job) if t.startswith("Pre-warmed")]
        assert pre and pre[0] == (
            "Pre-warmed (next request expected in ~72 s: used every 15 min for 60 min)"
        ), pre
        audit = [r for r in audit_rows(recs) if r.action == "ondemand_prewarm"]
        assert audit and audit[0].actor == "ondemand"
        assert h.controller.prewarmer.counts["used"] >= 2
        record = h.controller.record(h.controller.actors[job])
        assert record.effective_ondemand_policy == "learned"
        assert record.learned is not None and "next expected around" in record.learned

    box(tmp_path, t, settings={"ondemand_policy": "learned"})


def test_a_periodic_model_alone_stays_warm_between_its_runs_and_lends_its_memory(
    tmp_path: Path,
) -> None:
    """Its idle timeout (15 min) keeps it warm from one run to the next. Once its period is
    known it lends its memory between its runs; with no other model to take it, it stays
    warm, as under the seed, and no run waits."""
    slept: dict[str, list[m.PutToSleep]] = {}

    async def t(h: Harness) -> None:
        job = await h.deploy("job", 10, idle_timeout_s=900)
        await h.advance(START_S + 5)
        results = await job_runs(h, job, 9)
        recs = await h.events()
        policy = h.controller.setting("ondemand_policy")
        slept[policy] = [
            r.event for r in recs
            if isinstance(r.event, m.PutToSleep) and r.stream.endswith(job)
        ]  # fmt: skip
        if policy == "learned":
            waited = [r.admitted_at - r.arrived > 1 for r in results]  # type: ignore[operator]
            assert not any(waited[2:]), waited  # warm from its first run on
            actor = h.controller.actors[job]
            assert actor.keep_reason == BETWEEN_REASON and actor.lends_for is not None
            record = h.controller.record(actor)
            assert record.learned is not None and "then lends its memory" in record.learned

    for policy in ("learned", "seed"):
        (tmp_path / policy).mkdir()
        box(tmp_path / policy, t, settings={"ondemand_policy": policy})
    # Both: once, idle from its creation until the first run; then warm to the end.
    for policy in ("learned", "seed"):
        assert [e.idle_for_s >= 900 for e in slept[policy]] == [True], policy


def test_between_its_runs_a_periodic_model_gives_its_memory_to_a_request_and_is_pre_warmed(
    tmp_path: Path,
) -> None:
    """In a 20 GiB box, a minute after the job's run, another model's request needs the
    job's memory. The job is used too recently to make room under the seed's rule (its idle
    timeout), but it lends its memory between its runs: it is put to sleep for the request
    at once, and pre-warmed again before its next run, which waits for nothing."""

    async def t(h: Harness) -> None:
        job, ids, expected = await learned_job(h, other=15)
        await until(h, expected)
        runs = [h.request(job, hold_s=2)]
        await h.advance(30)
        runs.append(h.request(job, hold_s=2))
        await h.advance(60)
        r = h.request(ids["other"], hold_s=1)
        await h.advance(START_S + 5)
        assert r.outcome == "served" and r.waited <= START_S + 1, r.waited
        recs = await h.events()
        # The seed's title, exactly; why it went so soon is in its audit row and timeline mark.
        assert "Put to sleep to make room for other" in titles(recs, job)
        lent = [r for r in audit_rows(recs) if r.action == "ondemand_sleep"][-1]
        assert lent.details["reason"] == "make_room"
        assert lent.details["kept_warm_reason"] == BETWEEN_REASON
        await until(h, expected + 900)
        runs.append(h.request(job, hold_s=2))
        await h.advance(30)
        runs.append(h.request(job, hold_s=2))
        await h.advance(START_S + 5)
        waits = [x.waited for x in runs]
        assert all(x.outcome == "served" for x in runs) and max(waits) < 1, waits
        recs = await h.events()
        assert sum(t.startswith("Pre-warmed") for t in titles(recs, job)) == 2  # runs 6, 7

    box(tmp_path, t, usable_gib=20, settings={"ondemand_policy": "learned"})


def test_a_model_lending_its_memory_is_a_candidate_for_a_request_but_not_yet_for_a_pre_warm(
    tmp_path: Path,
) -> None:
    """A minute after its run the job lends its memory: another model's request may take it
    at once, but a pre-warm takes only what the seed's making-room rule (here its idle
    timeout, 15 min) makes a candidate, whatever its next session."""

    async def t(h: Harness) -> None:
        job = await h.deploy("job", 10, idle_timeout_s=300)
        other = await h.deploy("other", 10, idle_timeout_s=300)
        await h.advance(START_S + 5)
        await h.controller.stop(other, "admin:test")
        await h.controller.change_mode(job, "on_demand", 900, False, "admin:test")
        await job_runs(h, job, 5)  # ends 70 s after its fifth run
        actor = h.controller.actors[job]
        assert actor.lends_for is not None and actor.lends_only()
        assert [c.deployment_id for c in h.controller.candidates(other)] == [job]
        # A pre-warm expected before the job's next session may not take its memory yet.
        assert h.controller.prewarmer._later_candidates(other, actor.lends_for - 60) == []

    box(tmp_path, t, usable_gib=25, settings={"ondemand_policy": "learned"})


def test_under_the_seed_policy_the_same_model_cold_starts_every_run(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        job = await h.deploy("job", 10, idle_timeout_s=300)
        await h.advance(START_S + 5)
        results = await job_runs(h, job, 7)
        assert all(r.admitted_at - r.arrived > 1 for r in results[0::2])  # type: ignore[operator]
        recs = await h.events()
        assert not [t for t in titles(recs, job) if t.startswith("Pre-warmed")]

    box(tmp_path, t)


def test_a_model_kept_warm_by_its_gaps_sleeps_after_them_not_after_its_idle_timeout(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        chat = await h.deploy("chat", 10, idle_timeout_s=1800)
        await h.advance(START_S + 5)
        rng = random.Random(7)
        for _session in range(12):
            for _ in range(6):
                h.request(chat, hold_s=1)
                await h.advance(rng.uniform(20, 40))
            await h.advance(3 * 3600)
        recs = await h.events()
        kept = [t for t in titles(recs, chat) if t.startswith("Kept warm")]
        # Its gaps (20 to 40 s between requests of 1 s) and a quarter more; not 30 min.
        assert kept and re.fullmatch(r"Kept warm 4\d s \(its usual gaps\)", kept[-1]), kept
        sleeps = [r for r in audit_rows(recs) if r.action == "ondemand_sleep"]
        assert 40 <= sleeps[-1].details["kept_warm_s"] <= 50

    box(tmp_path, t, settings={"ondemand_policy": "learned"})


def test_the_box_hears_each_request_of_its_trace_with_its_wait(tmp_path: Path) -> None:
    """The gateway's trace writes a wait of 0 for a request that never had its model (timed
    out in the queue): it waited all its time, which its demand leaves out."""

    async def t(h: Harness) -> None:
        job = await h.deploy("job", 10, idle_timeout_s=300)
        await h.advance(START_S + 5)
        heard: list[tuple[Any, ...]] = []
        h.controller.prewarmer.anticipator.observe = lambda *a: heard.append(a)  # type: ignore[method-assign]
        at = h.clock.wall()
        rows = [
            TrafficRecord(
                request_id=1, deployment_id=job, arrived=at, wait_s=30.0, ttfb_s=30.5,
                duration_s=32.0, outcome="served", streamed=False,
            ),
            TrafficRecord(
                request_id=2, deployment_id=job, arrived=at + 1, wait_s=0.0, ttfb_s=None,
                duration_s=120.0, outcome="queue_timeout", streamed=False,
            ),
        ]  # fmt: skip
        await h.store.append(m.STREAM_TRAFFIC, [encode_batch(rows)], actor="system")
        await h.advance(1)
        assert heard == [(job, at, at + 32.0, 30.0), (job, at + 1, at + 121.0, 120.0)]

    box(tmp_path, t, settings={"ondemand_policy": "learned"})


def test_a_pre_warm_still_starting_is_abandoned_for_a_queued_request(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        job, _ = await abandon_a_starting_pre_warm(h)
        recs = await h.events()
        assert "Pre-warm abandoned for a queued request" in titles(recs, job)
        assert h.controller.prewarmer.counts["abandoned"] == 1

    box(tmp_path, t, usable_gib=15, settings={"ondemand_policy": "learned"})


def test_a_pre_warm_gives_its_start_slot_to_a_request_and_begins_again_after_it(
    tmp_path: Path,
) -> None:
    """One start at a time (the default), and memory for all: the job's pre-warm holds the
    start slot when another model's request needs a start. It is abandoned at once, so the
    request waits for its own start only; once no request waits, and while the job's session
    may still come, the job is pre-warmed again."""

    async def t(h: Harness) -> None:
        job, r = await abandon_a_starting_pre_warm(h, ahead_s=60)
        assert r.waited <= START_S + 1, r.waited  # not also the rest of the job's start
        mine = h.request(job, hold_s=2)
        await h.advance(START_S + 10)
        assert mine.outcome == "served"
        assert mine.waited < START_S - 1, mine.waited  # the second pre-warm was under way
        recs = await h.events()
        job_titles = titles(recs, job)
        assert "Pre-warm abandoned for a queued request" in job_titles
        assert sum(t.startswith("Pre-warmed") for t in job_titles) == 2, job_titles
        counts = h.controller.prewarmer.counts
        assert (counts["abandoned"], counts["used"]) == (1, 1), counts

    box(tmp_path, t, usable_gib=40, settings={"ondemand_policy": "learned"})


def test_no_pre_warm_starts_while_a_request_is_queued(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        job, ids, expected = await learned_job(h, busy=30, big=30)
        # `busy` holds 30 of 40 GiB with a long request; `big` waits in the queue for it,
        # while the 10 GiB free would fit the pre-warm of `job`.
        h.request(ids["busy"], hold_s=3000)
        await h.advance(1)
        waiting = h.request(ids["big"], hold_s=1)
        await until(h, expected + 60)
        assert waiting.outcome == "pending" and len(h.controller.queue) == 1
        assert h.state(job) == "stopped"
        recs = await h.events()
        assert not [t for t in titles(recs, job) if t.startswith("Pre-warmed")]
        await h.advance(3000 + 300 + START_S)
        assert waiting.outcome == "served"

    settings = {"ondemand_policy": "learned", "ondemand_queue_timeout_s": 3600}
    box(tmp_path, t, usable_gib=40, settings=settings)


@pytest.mark.parametrize("chat_first", [False, True], ids=["chat_later", "chat_first"])
def test_a_ready_pre_warm_keeps_its_memory_while_an_idle_model_expected_later_can_make_room(
    tmp_path: Path, chat_first: bool
) -> None:
    """`other`'s request needs 10 GiB of a 25 GiB box where the job's pre-warm (10) and an
    idle chat model (10) hold 20: the chat model, expected later than the job (or never),
    makes the room and the job's run finds it warm; a chat model expected first is spared,
    and the unused pre-warm makes the room, as it would alone."""

    async def t(h: Harness) -> None:
        job, ids, expected = await learned_job(h, chat=10, other=10)
        chat, prewarmer = ids["chat"], h.controller.prewarmer
        await until(h, expected - 200)  # ready before the pre-warm is due, warm after it
        h.request(chat, hold_s=1)
        await until(h, expected - 5)
        assert (h.state(job), h.state(chat)) == ("ready", "ready")
        if chat_first:
            soon = Prediction(at=expected - 1, tolerance_s=60.0, pattern="its own")
            told = Learned(keep=KeepWarm(seconds=None, reason=""), prediction=soon)
            learned = prewarmer.learned
            prewarmer.learned = lambda dep: told if dep.deployment_id == chat else learned(dep)  # type: ignore[method-assign]
        r = h.request(ids["other"], hold_s=1)
        await h.advance(1)
        stopped, kept = (job, chat) if chat_first else (chat, job)
        assert h.state(stopped) in ("stopping", "stopped") and h.state(kept) == "ready"
        await until(h, expected)
        run = h.request(job, hold_s=1)
        await h.advance(2 * START_S)
        assert r.outcome == "served" and run.outcome == "served"
        assert (run.admitted_at - run.arrived > 1) is chat_first  # type: ignore[operator]
        recs = await h.events()
        assert "Put to sleep to make room for other" in titles(recs, stopped)
        assert "Put to sleep to make room for other" not in titles(recs, kept)
        assert prewarmer.counts["wasted" if chat_first else "used"] == 1

    settings = {"ondemand_policy": "learned", "ondemand_make_room_after_s": 0}
    box(tmp_path, t, usable_gib=25, settings=settings)


def test_an_unused_pre_warm_makes_room_when_no_idle_model_can_and_delays_no_request(
    tmp_path: Path,
) -> None:
    async def t(h: Harness) -> None:
        job, ids, expected = await learned_job(h, other=10)
        await until(h, expected - 5)
        assert h.state(job) == "ready"  # pre-warmed, waiting for its request
        r = h.request(ids["other"], hold_s=1)
        await h.advance(1)
        assert h.state(job) in ("stopping", "stopped")  # made room at once
        await h.advance(START_S + 5)
        assert r.outcome == "served" and r.admitted_at - r.arrived < START_S + 5  # type: ignore[operator]
        recs = await h.events()
        assert "Put to sleep to make room for other" in titles(recs, job)
        assert h.controller.prewarmer.counts["wasted"] == 1

    box(tmp_path, t, usable_gib=15, settings={"ondemand_policy": "learned"})


def test_an_unknown_policy_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        dep = await h.deploy("x", 1)
        before = len(await h.events())
        with pytest.raises(Refusal) as exc:
            await h.controller.change_settings({"ondemand_policy": "clever"}, "admin:test")
        assert (exc.value.status, exc.value.code) == (422, "invalid_policy")
        with pytest.raises(Refusal):
            await h.controller.change_mode(
                dep,
                "on_demand",
                None,
                True,
                "admin:test",
                ondemand_policy="clever",  # type: ignore[arg-type]
            )
        assert len(await h.events()) == before
        record = await h.controller.change_mode(
            dep, "on_demand", None, True, "admin:test", ondemand_policy="learned"
        )
        assert record.effective_ondemand_policy == "learned"
        assert record.learned == "no traffic recorded yet: the seed's rules apply"

    box(tmp_path, t)


def test_a_policy_change_is_audited_and_titled(tmp_path: Path) -> None:
    async def t(h: Harness) -> None:
        dep = await h.deploy("x", 1)
        await h.controller.change_mode(
            dep, "on_demand", None, True, "admin:alice", ondemand_policy="learned"
        )
        recs = await h.events()
        rows = [r for r in audit_rows(recs) if r.action == "ondemand_mode"]
        assert rows[-1].details["ondemand_policy"] == "learned"
        assert rows[-1].actor == "admin:alice"
        assert (
            titles(recs, dep)[-1]
            == "Mode changed to on demand (default idle timeout; learned policy)"
        )

    box(tmp_path, t)
