"""Operators' routes: the queue with its reasons, start progress, not-started, /healthz, /metrics.

A simulated box on the virtual clock behind the real admin API on loopback (tests/api_support).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dgxmm.admin.histograms import Histogram, last_cold_start
from dgxmm.admin.ops import Holder, health_problems, human_duration, wait_reason
from events import model as m
from events.cold_start import ColdStarts
from tests.api_support import STARTUP_S, Box, api_box, error_of, run_box

API = "/dgxmm/api"


# --- pure parts -----------------------------------------------------------------------------


def test_the_wait_reason_names_need_free_candidates_and_what_holds_the_memory() -> None:
    reason = wait_reason(
        kind="queued",
        need=40 * 1024**3,
        free=8 * 1024**3,
        candidates=[],
        holders=[Holder(name="demo-large", in_flight=0, starting=False, idle_for_s=61)],
        ahead=0,
    )
    assert reason == (
        "needs 40 GiB; 8 GiB free; idle candidates: none; waiting for demo-large (used 61 s ago)"
    )


def test_the_wait_reason_says_never_used_of_a_model_no_request_has_used() -> None:
    reason = wait_reason(
        kind="queued", need=40 * 1024**3, free=8 * 1024**3, candidates=[],
        holders=[Holder(name="demo-large", in_flight=0, starting=False, idle_for_s=4, used=False)],
        ahead=0,
    )  # fmt: skip
    assert reason.endswith("waiting for demo-large (ready 4 s, never used)")


def test_the_wait_reason_of_a_request_behind_others_says_how_many() -> None:
    reason = wait_reason(
        kind="queued", need=1024**3, free=0, candidates=["a"],
        holders=[Holder(name="b", in_flight=2, starting=False, idle_for_s=0)], ahead=2,
    )  # fmt: skip
    assert reason == (
        "needs 1 GiB; 0 GiB free; idle candidates: a; waiting for b (2 in flight); "
        "behind 2 earlier requests"
    )
    assert wait_reason(
        kind="waiting_start", need=1, free=0, candidates=[], holders=[], ahead=0
    ) == ("its model is starting")


def test_durations_read_as_seconds_minutes_hours_and_days() -> None:
    assert [human_duration(s) for s in (0, 45, 120, 5400, 7200, 3 * 86400)] == [
        "0 s", "45 s", "2 min", "2 h", "2 h", "3 d",
    ]  # fmt: skip


def _rec(seq: int, ts: float, stream: str, event: m.AnyEvent) -> m.Recorded:
    return m.Recorded(seq=seq, ts=ts, stream=stream, version=seq, actor="system", event=event)


def test_a_cold_start_counts_from_the_start_request_to_ready_and_a_failed_one_not_at_all() -> None:
    s = "deployment:d1"
    records = [
        _rec(1, 10.0, s, m.StartRequested(reason="admin")),
        _rec(2, 16.5, s, m.EngineReady()),
        _rec(3, 20.0, s, m.StartRequested(reason="request")),
        _rec(4, 25.0, s, m.EngineStartFailed(reason="boom", failures=1)),
        _rec(5, 30.0, s, m.EngineReady()),  # no start pending: an adoption, not a cold start
    ]
    pairing = ColdStarts()
    assert [pairing.feed(r) for r in records] == [None, ("d1", 6.5), None, None, None]
    assert last_cold_start(records) == 6.5
    assert last_cold_start(records[2:]) is None


def test_a_histogram_renders_cumulative_buckets_sum_and_count_per_deployment() -> None:
    hist = Histogram("x_seconds", "X.", (1.0, 5.0))
    for value in (0.5, 2.0, 9.0):
        hist.observe("d1", value)
    lines = hist.render(lambda d: "chat")
    assert lines == [
        "# HELP x_seconds X.",
        "# TYPE x_seconds histogram",
        'x_seconds_bucket{deployment="chat",id="d1",le="1"} 1',
        'x_seconds_bucket{deployment="chat",id="d1",le="5"} 2',
        'x_seconds_bucket{deployment="chat",id="d1",le="+Inf"} 3',
        'x_seconds_sum{deployment="chat",id="d1"} 11.5',
        'x_seconds_count{deployment="chat",id="d1"} 3',
    ]


def test_health_names_a_read_only_event_log_and_a_listener_that_does_not_serve(
    tmp_path: Path,
) -> None:
    db = tmp_path / "log.db"
    db.write_bytes(b"")
    assert health_problems(db, storage_closed=False, listeners={"gateway": True}) == []
    db.chmod(0o444)
    problems = health_problems(db, storage_closed=False, listeners={"gateway": False})
    assert problems == [
        f"the event log {db} is not writable",
        "the gateway listener is not serving",
    ]


# --- through the API ------------------------------------------------------------------------


async def _queued_behind_a_busy_model(box: Box) -> tuple[str, str]:
    """`big` (60 GiB) is busy with a request; `other` (60 GiB) gets one and must queue."""
    h = box.harness
    big = await h.deploy("big", 60, idle_timeout_s=60)
    other = await h.deploy("other", 60)
    await box.advance(STARTUP_S + 1)
    h.request(big, hold_s=600)
    await box.advance(1)
    h.request(other, hold_s=1)
    await box.clock.settle()
    return big, other


def test_the_queue_lists_a_waiting_request_with_its_reason_and_clears_when_it_is_served(
    tmp_path: Path,
) -> None:
    async def scenario(box: Box) -> None:
        await _queued_behind_a_busy_model(box)
        viewer = await box.login("victor")
        await box.advance(30)
        data = await viewer.ok("GET", f"{API}/queue")
        assert data["count"] == 1
        (row,) = data["requests"]
        assert row["deployment"] == "other" and row["model"] == "org/other"
        assert row["kind"] == "queued" and row["position"] == 1
        assert row["age_s"] == pytest.approx(30, abs=1)
        assert row["deadline_in_s"] == pytest.approx(900 - 30, abs=1)
        assert row["reason"] == (
            "needs 60 GiB; 40 GiB free; idle candidates: none; waiting for big (1 in flight)"
        )
        assert row["waiting_for"] == ["big"]
        await box.advance(600 + 60 + 15 + STARTUP_S + 5)  # big ends, idles, sleeps; other starts
        assert (await viewer.ok("GET", f"{API}/queue"))["requests"] == []

    run_box(tmp_path, scenario, usable_gib=100)


def test_progress_shows_elapsed_time_against_the_last_cold_start(tmp_path: Path) -> None:
    async def scenario(box: Box) -> None:
        h = box.harness
        dep = await h.deploy("chat", 10, mode="always_on")
        alice = await box.login()
        await box.advance(STARTUP_S + 1)
        first = await alice.ok("GET", f"{API}/deployments/chat/progress")
        assert first["starting"] is False and first["last_cold_start_s"] == pytest.approx(
            STARTUP_S, abs=1
        )
        await alice.ok("POST", f"{API}/deployments/{dep}/stop")
        await box.advance(5)
        await alice.ok("POST", f"{API}/deployments/{dep}/start")
        await box.advance(12)
        now = await alice.ok("GET", f"{API}/deployments/chat/progress")
        assert now["starting"] is True and now["state"] == "starting"
        assert now["elapsed_s"] == pytest.approx(12, abs=1)
        assert now["last_cold_start_s"] == pytest.approx(STARTUP_S, abs=1)

    run_box(tmp_path, scenario)


def test_a_deployment_created_without_room_says_why_in_the_api(tmp_path: Path) -> None:
    async def scenario(box: Box) -> None:
        h = box.harness
        await h.deploy("first", 80, mode="always_on")
        alice = await box.login()
        body = {"name": "no-room", "engine": "sim", "model": "m", "memory_gib": 40}
        created = await alice.ok("POST", f"{API}/deployments", body, status=201)
        assert created["state"] == "stopped"
        assert created["not_started"] == (
            "no-room needs 40 GiB but only 20 GiB are free and no idle on-demand model "
            "can make room"
        )
        again = await alice.ok("GET", f"{API}/deployments/no-room")
        assert again["not_started"] == created["not_started"]
        listed = (await alice.ok("GET", f"{API}/deployments"))["deployments"]
        assert [d["not_started"] for d in listed if d["name"] == "no-room"] == [
            created["not_started"]
        ]

    run_box(tmp_path, scenario, usable_gib=100)


def test_healthz_needs_no_login_and_answers_503_with_the_reason_for_a_read_only_log(
    tmp_path: Path,
) -> None:
    async def scenario(box: Box) -> None:
        from tests.api_support import ApiClient

        anonymous = ApiClient(box.port)
        ok = await anonymous.get("/healthz")
        # No gateway in this box: the listener check says so; the log is fine.
        assert ok.status == 503
        assert ok.json() == {
            "status": "unavailable",
            "reasons": ["the gateway listener is not serving"],
        }
        box.api.ops.gateway_address = lambda: ("127.0.0.1", box.port)  # a listener that serves
        assert (await anonymous.get("/healthz")).json() == {"status": "ok"}
        db = Path(box.harness.store.path)
        mode = os.stat(db).st_mode
        os.chmod(db, 0o444)
        try:
            bad = await anonymous.get("/healthz")
        finally:
            os.chmod(db, mode)
        assert bad.status == 503
        assert bad.json()["reasons"] == [f"the event log {db} is not writable"]
        assert (await anonymous.get("/healthz")).status == 200

    run_box(tmp_path, scenario)


def test_metrics_public_opens_metrics_to_loopback_clients_only(tmp_path: Path) -> None:
    import asyncio

    from dgxmm.admin.api import _loopback
    from tests.api_support import ApiClient

    assert _loopback(("127.0.0.1", 1)) and _loopback(("::1", 1))
    assert not _loopback(("10.0.0.5", 1)) and not _loopback(None)

    async def main() -> None:
        async with asyncio.timeout(60), api_box(tmp_path, metrics_public=True) as box:
            reply = await ApiClient(box.port).get("/metrics")
            assert reply.status == 200
            assert b"dgxmm_deployments" in reply.body

    asyncio.run(main())


def test_metrics_stay_closed_without_metrics_public(tmp_path: Path) -> None:
    async def scenario(box: Box) -> None:
        from tests.api_support import ApiClient

        reply = await ApiClient(box.port).get("/metrics")
        assert reply.status == 401, error_of(reply)

    run_box(tmp_path, scenario)


def test_logs_of_a_box_without_an_engine_runtime_say_so(tmp_path: Path) -> None:
    async def scenario(box: Box) -> None:
        await box.harness.deploy("chat", 10)
        viewer = await box.login("victor")
        reply = await viewer.get(f"{API}/deployments/chat/logs?tail=5")
        assert reply.status == 404 and error_of(reply)["code"] == "logs_unavailable"
        bad = await viewer.get(f"{API}/deployments/chat/logs?tail=-1")
        assert bad.status == 422 and error_of(bad)["param"] == "tail"

    run_box(tmp_path, scenario)


def test_the_log_stream_sends_the_tail_then_new_lines_and_ends_when_the_api_closes(
    tmp_path: Path,
) -> None:
    from dgxmm.engines.logs import EngineLogs, Redactor
    from dgxmm.engines.runtimes.process import ProcessRuntime
    from tests.api_support import SseReader

    async def scenario(box: Box) -> None:
        dep = await box.harness.deploy("chat", 10)
        runtime = ProcessRuntime(tmp_path / "engines")
        box.api.ops.logs = EngineLogs(
            runtime, Redactor(["sk-hidden-value"]), handle_of=lambda _: None, poll_s=0.02
        )
        path = runtime.log_path(dep)
        path.parent.mkdir(parents=True)
        path.write_text("one\ntwo key=sk-hidden-value\n")
        viewer = await box.login("victor")
        plain = await viewer.ok("GET", f"{API}/deployments/chat/logs?tail=1")
        assert plain == {"deployment_id": dep, "name": "chat", "lines": ["two key=[redacted]"]}
        stream = await SseReader.open(viewer, f"{API}/deployments/{dep}/logs?tail=5&follow=1")
        try:
            assert await stream.next() == ("retry", 2000)
            assert [await stream.next() for _ in range(2)] == [
                ("line", "one"),
                ("line", "two key=[redacted]"),
            ]
            with path.open("a") as f:
                f.write("three\n")
            assert await stream.next() == ("line", "three")
            box.api.ops.close()
            assert await stream.ended()
        finally:
            stream.close()
            await runtime.close()

    run_box(tmp_path, scenario)
