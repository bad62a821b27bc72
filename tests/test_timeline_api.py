"""GET /api/timeline and GET /api/requests/{id}/story on a simulated box (real actors on the
virtual clock, real SQLite, real sockets; see tests/api_support.py): a scripted swap, read
back through `storage.windows` and checked against the projection of the whole log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.memory_broker import GIB
from events.state import EMPTY
from events.timeline import project, stack
from tests.api_support import STARTUP_S, Box, error_of, run_box

API = "/dgxmm/api"


async def swap(box: Box) -> tuple[str, str, str]:
    """A used, then B queued, A put to sleep to make room, B started; (a, b, request id)."""
    h = box.harness
    a = await h.deploy("model-a", 40)
    b = await h.deploy("model-b", 40)  # 40 + 40 > 64: B cannot start beside A
    await box.advance(STARTUP_S + 1)
    assert h.state(a) == "ready" and h.state(b) == "stopped"
    used = h.request(a, hold_s=1.0)
    await box.advance(2)
    assert used.outcome == "served"
    waiter = h.request(b, hold_s=1.0)
    await box.advance(2 * STARTUP_S)
    assert waiter.outcome == "served" and h.state(b) == "ready" and h.state(a) == "stopped"
    return a, b, waiter.request_id


def _window(box: Box) -> dict[str, Any]:
    return {"since": box.harness.clock.wall() - 3600, "until": box.harness.clock.wall() + 1}


def test_the_window_shows_the_swap_as_the_projection_does(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        a, b, rid = await swap(box)
        victor = await box.login("victor")  # viewers read the timeline
        w = _window(box)
        got = await victor.ok("GET", f"{API}/timeline?since={w['since']}&until={w['until']}")
        records = await box.events()
        want = project(EMPTY, records, w["since"], w["until"], 64 * GIB)
        assert got["usable_bytes"] == 64 * GIB
        assert [x["name"] for x in got["lanes"]] == ["model-a", "model-b"]
        fields = ("deployment_id", "state", "start", "end", "memory_bytes")
        assert [tuple(s[k] for k in fields) for s in got["segments"]] == [
            tuple(getattr(s, k) for k in fields) for s in want.segments
        ]
        assert len(got["pieces"]) == len(stack(want))
        kinds = [(k["kind"], k["deployment_id"]) for k in got["marks"]]
        assert kinds == [("cold_start", a), ("cold_start", b), ("make_room", a)] or kinds == [
            ("cold_start", a),
            ("make_room", a),
            ("cold_start", b),
        ], kinds
        room = next(k for k in got["marks"] if k["kind"] == "make_room")
        assert room["for_deployment"] == b and room["for_name"] == "model-b"
        assert room["event"]["type"] == "PutToSleep" and room["event"]["reason"] == "make_room"
        starts = [k for k in got["marks"] if k["kind"] == "cold_start"]
        start_b = next(k for k in starts if k["deployment_id"] == b)
        assert start_b["duration_s"] is not None and start_b["duration_s"] >= STARTUP_S
        [wait] = got["waits"]
        assert (wait["request_id"], wait["deployment_id"], wait["outcome"]) == (rid, b, "served")
        assert wait["start"] <= room["ts"] <= wait["end"]
        assert got["since_time"].endswith("+00:00")
        alias = await victor.ok("GET", f"{API}/timeline?from={w['since']}&to={w['until']}")
        assert alias["segments"] == got["segments"] and alias["since"] == w["since"]

    run_box(tmp_path, t, usable_gib=64, settings={"ondemand_make_room_after_s": 0})


def test_a_request_story_and_the_default_window(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        _, _, rid = await swap(box)
        alice = await box.login()
        story = await alice.ok("GET", f"{API}/requests/{rid}/story")
        assert story["request_id"] == rid and story["deployment"] == "model-b"
        assert story["text"].startswith(f"request {rid} for model-b: left the queue")
        assert "make room" in story["text"] or "made room" in story["text"], story["text"]
        missing = await alice.call("GET", f"{API}/requests/nope/story")
        assert missing.status == 404 and "not in the log" in error_of(missing)["message"]
        got = await alice.ok("GET", f"{API}/timeline")  # up to now, from the log's start
        assert got["since"] == (await box.events())[0].ts  # the box is younger than an hour
        assert abs(got["until"] - box.harness.clock.wall()) < 1
        assert len(got["waits"]) == 1

    run_box(tmp_path, t, usable_gib=64, settings={"ondemand_make_room_after_s": 0})


def test_bad_windows_are_refused_and_strangers_too(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        for query, param in (
            ("since=10&until=5", "since"),
            ("since=0&until=99999999", "since"),  # more than 31 days
            ("since=yesterday", "since"),
            ("until=soon", "until"),
        ):
            reply = await alice.call("GET", f"{API}/timeline?{query}")
            assert reply.status == 422, query
            assert error_of(reply)["param"] == param, query
        stranger = await box.login("victor")
        stranger.cookie = None
        assert (await stranger.call("GET", f"{API}/timeline")).status == 401
        assert (await stranger.call("GET", f"{API}/requests/1/story")).status == 401

    run_box(tmp_path, t)
