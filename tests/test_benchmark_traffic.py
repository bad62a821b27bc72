"""The benchmark traces of issue 44 (`simulations.benchmark_traffic`): the same seed makes the
same requests, and each trace has the shape its documentation says."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import pytest

from simulations import benchmark_traffic as bt
from simulations.whatif import load_history, start_seconds
from tests.gateway_support import run
from tests.perf.bench_anticipation import write_trace
from tests.whatif_support import T0, Model, write_log


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_a_seed_makes_the_same_trace_and_another_seed_another(name: str) -> None:
    make = bt.GENERATORS[name]
    assert make(7, days=2) == make(7, days=2)
    assert make(7, days=2).records != make(8, days=2).records


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_requests_come_in_order_numbered_once_each_within_the_trace(name: str) -> None:
    trace = bt.GENERATORS[name](1)
    arrivals = [r.arrived for r in trace.records]
    assert arrivals == sorted(arrivals)
    assert [r.request_id for r in trace.records] == list(range(1, len(trace.records) + 1))
    assert trace.begin <= arrivals[0] and arrivals[-1] < trace.end
    assert {r.deployment_id for r in trace.records} == {d.deployment_id for d in trace.deployments}
    assert [d.deployment_id for d in trace.deployments] == [
        f"d{i}" for i in range(len(trace.deployments))
    ]


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_every_model_cold_starts_in_30_to_120_seconds(name: str) -> None:
    assert all(30 <= d.start_s <= 120 for d in bt.GENERATORS[name](1).deployments)


def test_the_traces_begin_where_the_bench_logs_begin() -> None:
    assert bt.EPOCH == T0
    assert not bt.is_weekday(T0 + 2 * bt.DAY_S) and bt.is_weekday(T0 + 4 * bt.DAY_S)


def _fit(gibs: list[float], usable: float, k: int) -> list[bool]:
    return [sum(c) <= usable for c in itertools.combinations(gibs, k)]


def test_office_hours_has_5_models_of_which_any_3_fit_and_no_4() -> None:
    trace = bt.office_hours(1)
    gibs = [d.gib for d in trace.deployments]
    assert len(gibs) == 5
    assert all(_fit(gibs, trace.usable_gib, 3)) and not any(_fit(gibs, trace.usable_gib, 4))


def test_office_hours_comes_on_the_ten_weekdays_of_two_weeks_and_never_at_a_weekend() -> None:
    trace = bt.office_hours(1)
    days = {math.floor(r.arrived / bt.DAY_S) for r in trace.records}
    assert all(bt.is_weekday(d * bt.DAY_S) for d in days)
    assert len(days) == 10  # Thursday 1 January to Wednesday 14 January 2026


def test_office_hours_requests_fall_in_their_models_hours_give_or_take_the_jitter() -> None:
    trace = bt.office_hours(1)
    for shape, dep in zip(bt.OFFICE, trace.deployments, strict=True):
        hours = [
            (r.arrived % bt.DAY_S) / 3600
            for r in trace.records
            if r.deployment_id == dep.deployment_id
        ]
        early, late = bt.START_JITTER_S / 3600, bt.END_JITTER_S / 3600
        assert all(any(a - early <= h < b + late for a, b in shape.sessions) for h in hours)
        # Every session of the day is used: its first half hour has requests on most days.
        for a, _ in shape.sessions:
            assert sum(a - early <= h < a + 0.5 for h in hours) >= 10, (shape.name, a)


def test_office_hours_sessions_start_within_a_few_minutes_of_their_hour() -> None:
    trace = bt.office_hours(1)
    dep = trace.deployments[0]  # assistant: 09:00 and 13:30
    by_day: dict[int, list[float]] = {}
    for r in trace.records:
        if r.deployment_id == dep.deployment_id and (r.arrived % bt.DAY_S) < 12.5 * 3600:
            by_day.setdefault(math.floor(r.arrived / bt.DAY_S), []).append(r.arrived % bt.DAY_S)
    firsts = [min(v) for v in by_day.values()]
    assert all(abs(f - 9 * 3600) <= bt.START_JITTER_S for f in firsts)
    assert statistics.pstdev(firsts) > 60  # jittered, not to the second


def test_within_a_session_requests_come_seconds_to_minutes_apart() -> None:
    trace = bt.office_hours(1)
    times = [r.arrived for r in trace.records if r.deployment_id == "d0"]
    gaps = [b - a for a, b in itertools.pairwise(times) if b - a < 3600]
    assert min(gaps) >= bt.GAP_MIN_S and max(gaps) <= bt.GAP_MAX_S
    assert 10 <= statistics.median(gaps) <= 40


def _runs(times: list[float], apart_s: float) -> list[list[float]]:
    """The requests grouped into runs: a gap longer than `apart_s` begins a new one."""
    runs: list[list[float]] = []
    for t in times:
        if runs and t - runs[-1][-1] <= apart_s:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def test_the_periodic_job_runs_2_minutes_every_15_minutes_give_or_take_30_seconds() -> None:
    trace = bt.periodic_jobs(1)
    times = [r.arrived for r in trace.records if r.deployment_id == bt.JOB.deployment_id]
    runs = _runs(times, 300)
    assert len(runs) == 3 * 24 * 4
    for k, run_ in enumerate(runs):
        slot = trace.begin + bt.PERIOD_JITTER_S + k * bt.PERIOD_S
        assert abs(run_[0] - slot) <= bt.PERIOD_JITTER_S
        assert bt.JOB_S - 12 <= run_[-1] - run_[0] < bt.JOB_S
    starts = [r[0] for r in runs]
    apart = [b - a for a, b in itertools.pairwise(starts)]
    assert all(abs(a - bt.PERIOD_S) <= 2 * bt.PERIOD_JITTER_S for a in apart)
    assert max(apart) - min(apart) > bt.PERIOD_JITTER_S  # jittered, not a clock


def test_the_periodic_job_has_two_irregular_chat_models_beside_it_and_the_three_do_not_fit() -> (
    None
):
    trace = bt.periodic_jobs(1)
    gibs = [d.gib for d in trace.deployments]
    assert all(_fit(gibs, trace.usable_gib, 2)) and not any(_fit(gibs, trace.usable_gib, 3))
    for chat in bt.CHATS:
        times = [r.arrived for r in trace.records if r.deployment_id == chat.deployment_id]
        starts = [r[0] for r in _runs(times, 600)]
        apart = [b - a for a, b in itertools.pairwise(starts)]
        assert len(apart) >= 20
        # No period: the gaps between sessions spread as widely as they are long.
        assert statistics.pstdev(apart) > 0.5 * statistics.mean(apart)


def test_noise_arrives_as_poisson_processes() -> None:
    trace = bt.noise(1, days=3)
    for dep, every in bt.NOISE:
        times = [r.arrived for r in trace.records if r.deployment_id == dep.deployment_id]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean = statistics.mean(gaps)
        assert abs(mean - every) <= 0.2 * every, dep.name
        # Exponential gaps: their spread is their mean (a coefficient of variation of 1).
        assert 0.8 <= statistics.pstdev(gaps) / mean <= 1.2, dep.name


def test_a_trace_written_as_a_log_replays_its_requests_and_cold_starts(tmp_path: Path) -> None:
    trace = bt.periodic_jobs(1, days=0.1)

    async def main() -> None:
        await write_trace(trace, tmp_path / "log.db")
        history = await load_history(tmp_path / "log.db")
        assert len(history.traffic) == len(trace.records)
        assert [r.arrived for r in history.traffic] == pytest.approx(
            [r.arrived for r in trace.records], abs=1e-3
        )
        for d in trace.deployments:
            assert start_seconds(history, d.deployment_id) == pytest.approx(d.start_s, abs=1e-3)

    run(main())


def test_write_log_refuses_traffic_from_before_its_deployments_are_made(tmp_path: Path) -> None:
    trace = bt.periodic_jobs(1, days=0.1, start=T0 - bt.LEAD_S)
    with pytest.raises(ValueError, match="outside"):
        run(
            write_log(
                tmp_path / "log.db",
                [Model("batch", 40, 0.0, 3.0, start_s=90)],
                hours=1.0,
                traffic=trace.records,
            )
        )
