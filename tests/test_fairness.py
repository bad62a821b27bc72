"""The fairness report: every named scenario runs on the real actors and gives sane numbers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from events import model as m
from simulations.fairness import (
    Report,
    head_episodes,
    jain,
    percentile,
    render,
    render_comparison,
    report,
    run,
)
from simulations.scenarios import SCENARIOS, quiet_logs, scenario

quiet_logs()

ROOT = Path(__file__).resolve().parent.parent
SHORT_S = 900.0  # simulated seconds of traffic per test run (plus the drain)


def arun(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "simulations.fairness", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# --- the numbers --------------------------------------------------------------------------


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([], 50) == 0.0
    assert percentile([7.0], 99) == 7.0


def test_jains_index_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert jain([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain([]) == 1.0
    assert jain([0.0, 0.0]) == 1.0


def _rec(seq: int, ts: float, event: m.AnyEvent) -> m.Recorded:
    return m.Recorded(seq=seq, ts=ts, stream="queue", version=seq, actor="ondemand", event=event)


def test_the_head_of_the_queue_is_read_from_the_queue_events() -> None:
    records = [
        _rec(1, 10, m.RequestQueued(request_id="r1", deployment_id="big", kind="queued",
                                    position=1, arrived_at=10)),
        _rec(2, 12, m.RequestQueued(request_id="r2", deployment_id="small", kind="queued",
                                    position=2, arrived_at=12)),
        _rec(3, 20, m.RequestAdmitted(request_id="r2", deployment_id="small", jumped_ahead=True)),
        _rec(4, 20, m.StartRequested(reason="request", request_id="r2")),
        _rec(5, 50, m.RequestAdmitted(request_id="r1", deployment_id="big")),
        _rec(6, 60, m.RequestLeftQueue(request_id="r1", deployment_id="big", reason="served")),
    ]  # fmt: skip
    episodes = head_episodes(records, wall_offset=0.0)
    assert [(e.request_id, e.start, e.end, e.passed) for e in episodes] == [("r1", 10, 50, 1)]


# --- every scenario, short ------------------------------------------------------------------


def _sane(rep: Report, queue_timeout_s: float) -> None:
    assert rep.violations == []
    assert rep.requests > 0 and rep.served > 0
    for r in rep.models:
        assert r.served + r.timeouts + sum(r.refused.values()) + r.client_gone == r.requests
        for w in (r.waits, r.head_waits):
            assert 0 <= w.p50 <= w.p90 <= w.p99 <= w.max <= queue_timeout_s + 1e-6
        assert r.waits.n == r.served + r.timeouts
        assert r.queued <= r.requests
    n = sum(1 for r in rep.models if r.waits.n)
    assert 1 / max(n, 1) - 1e-9 <= rep.jain <= 1 + 1e-9
    text = "\n".join(render(rep))
    assert rep.scenario in text and "Jain's fairness index" in text
    for r in rep.models:
        assert r.model in text


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_runs_and_gives_sane_numbers(name: str, tmp_path: Path) -> None:
    spec = scenario(name, 7, SHORT_S)
    timeout = float(spec.settings.get("ondemand_queue_timeout_s", 900))
    reports = [
        report([arun(run(name, 7, policy, SHORT_S, tmp_path / f"{policy}.db"))])
        for policy in ("fifo-go-ahead", "fifo")
    ]
    for rep in reports:
        _sane(rep, timeout)
        assert rep.seeds == [7]
    ahead, fifo = reports
    assert ahead.requests >= 1 and fifo.requests >= 1
    assert sum(r.went_ahead for r in fifo.models) == 0  # plain FIFO: nobody starts ahead
    assert "plain FIFO" in "\n".join(render_comparison([(ahead, fifo)]))


def test_there_are_at_least_four_named_scenarios() -> None:
    assert len(SCENARIOS) >= 4


def test_the_same_seed_gives_the_same_numbers(tmp_path: Path) -> None:
    first = report([arun(run("bursts", 3, "fifo-go-ahead", 600.0, tmp_path / "a.db"))])
    second = report([arun(run("bursts", 3, "fifo-go-ahead", 600.0, tmp_path / "b.db"))])
    assert first.models == second.models and first.waits == second.waits


# --- the command line -----------------------------------------------------------------------


def test_the_cli_prints_the_report_of_a_scenario() -> None:
    done = cli("--scenario", "hot-small-cold-large", "--seed", "2", "--duration", "600")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "scenario hot-small-cold-large  seed 2  policy fifo-go-ahead" in out
    assert "wait p50" in out and "p90" in out and "p99" in out and "max" in out
    assert "head of the queue:" in out
    assert "Jain's fairness index over the models' mean waits:" in out
    assert "large-64g" in out


def test_the_cli_compares_the_policies_on_the_same_seeds_and_writes_json() -> None:
    done = cli("--scenario", "bursts", "--seed", "1", "--seeds", "2", "--duration", "600",
               "--compare")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "bursts (seeds 1-2): FIFO with go-ahead | plain FIFO" in done.stdout
    done = cli("--scenario", "bursts", "--seed", "1", "--duration", "600", "--policy", "fifo",
               "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    [rep] = json.loads(done.stdout)
    assert rep["policy"] == "fifo" and rep["seeds"] == [1]
    assert {r["model"] for r in rep["models"]} == {model.name for model in
                                                   scenario("bursts", 1).models}  # fmt: skip


def test_the_cli_lists_scenarios_and_refuses_an_unknown_one() -> None:
    done = cli("--list")
    assert done.returncode == 0
    assert all(name in done.stdout for name in SCENARIOS)
    done = cli("--scenario", "nope")
    assert done.returncode == 2
    assert "unknown scenario 'nope'" in done.stderr


def test_a_kept_log_tells_the_story_of_a_request_with_dgxmm_replay(tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    done = cli("--scenario", "hot-small-cold-large", "--seed", "5", "--duration", "900",
               "--db", str(db))  # fmt: skip
    assert done.returncode == 0, done.stderr

    async def first_queued() -> str:
        from storage.eventlog import EventStore

        store = await EventStore.open(db, create=False, readonly=True)
        try:
            recs = await store.read()
        finally:
            await store.close()
        return next(
            r.event.request_id
            for r in recs
            if isinstance(r.event, m.RequestQueued) and r.event.kind == "queued"
        )

    rid = arun(first_queued())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    story = subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", "replay", "--db", str(db), "--request", rid],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert story.returncode == 0, story.stderr
    assert f"Request {rid} queued at position" in story.stdout
    assert f"Request {rid} left the queue" in story.stdout
