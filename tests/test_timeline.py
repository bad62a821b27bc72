"""The timeline projection (events/timeline.py): lanes, marks, waits, stacking.

Property tests run real actors (`simulations.properties.run_program`, the same generated
programs as tests/test_properties.py, models competing for memory) and project their logs:
the lanes never hold more than the usable memory, a deployment's lane is its lifecycle
state at every instant (folded independently with `events.state.evolve`), and a window
projected from the state at its start equals the whole run's projection cut to it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events import model as m
from events.state import EMPTY, SystemState, evolve, fold
from events.timeline import (
    HOLDING,
    Segment,
    Timeline,
    catch_up,
    held_at,
    lane_at,
    project,
    stack,
)
from simulations.properties import Program, run_program
from simulations.scenarios import quiet_logs
from tests.test_properties import programs

quiet_logs()

GIB = 1 << 30
EXAMPLES = int(os.environ.get("DGXMM_TIMELINE_EXAMPLES", "50"))


def _run(program: Program) -> list[m.Recorded]:
    shm = Path("/dev/shm")
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="dgxmm-timeline-", dir=where) as tmp:
        checked = asyncio.run(run_program(program, Path(tmp) / "log.db"))
    return checked.outcome.records


def _instants(records: list[m.Recorded]) -> list[tuple[float, SystemState]]:
    """Between every two distinct event times: the midpoint and the state folded until then."""
    out: list[tuple[float, SystemState]] = []
    state = EMPTY
    for i, rec in enumerate(records):
        state = evolve(state, rec)
        nxt = records[i + 1].ts if i + 1 < len(records) else rec.ts + 1.0
        if nxt > rec.ts:
            out.append(((rec.ts + nxt) / 2, state))
    return out


def _whole(records: list[m.Recorded], usable: int) -> Timeline:
    return project(EMPTY, records, records[0].ts - 1.0, records[-1].ts + 1.0, usable)


PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@PROPERTY_SETTINGS
@given(program=programs(contended=True))
def test_lanes_never_exceed_the_usable_line_and_match_the_state(program: Program) -> None:
    records = _run(program)
    usable = program.usable_gib * GIB
    timeline = _whole(records, usable)
    for at, state in _instants(records):
        assert held_at(timeline, at) <= usable, at
        for dep_id, dep in state.deployments.items():
            seg = lane_at(timeline, dep_id, at)
            if dep.lifecycle in HOLDING:
                assert seg is not None, (dep.name, dep.lifecycle, at)
                assert seg.state == dep.lifecycle.value, (dep.name, seg, at)
            else:
                assert seg is None, (dep.name, dep.lifecycle, seg, at)
        for dep_id in state.removed:
            if dep_id not in state.deployments:
                assert lane_at(timeline, dep_id, at) is None
    pieces = stack(timeline)
    for piece in pieces:
        assert 0 <= piece.low_bytes < piece.high_bytes <= usable, piece
    for at, _ in _instants(records):  # the stack draws exactly the memory the lanes hold
        covering = [p for p in pieces if p.start <= at < p.end]
        assert sum(p.high_bytes - p.low_bytes for p in covering) == held_at(timeline, at)
        spans = sorted((p.low_bytes, p.high_bytes) for p in covering)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    # Every wait the log records is a bar under its model, from its queueing to its leaving.
    queued = {r.event.request_id for r in records if isinstance(r.event, m.RequestQueued)}
    assert {w.request_id for w in timeline.waits} == queued
    for wait in timeline.waits:
        assert wait.start <= wait.end


def _cut(segments: list[Segment], since: float, until: float) -> list[tuple[object, ...]]:
    out = []
    for s in segments:
        start, end = max(s.start, since), min(s.end, until)
        if end > start:
            out.append((s.deployment_id, s.state, s.memory_bytes, start, end))
    return sorted(out, key=lambda t: (t[0], t[3]))


@PROPERTY_SETTINGS
@given(
    program=programs(contended=True),
    cut=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)).map(sorted),
)
def test_a_window_from_its_start_state_is_the_whole_run_cut_to_it(
    program: Program, cut: list[float]
) -> None:
    records = _run(program)
    usable = program.usable_gib * GIB
    whole = _whole(records, usable)
    first, last = records[0].ts, records[-1].ts
    since = first + (last - first) * cut[0]
    until = first + (last - first) * cut[1]
    times = [r.ts for r in records]
    at = bisect.bisect_right(times, since)
    start = fold(records[:at])
    cheap = catch_up(EMPTY, records[:at])  # what storage.windows folds up to the window
    assert cheap.deployments == start.deployments and cheap.queue == start.queue
    window = project(cheap, records[at:], since, until, usable)
    assert _cut(window.segments, since, until) == _cut(whole.segments, since, until)
    inside = [
        (k.kind, k.ts, k.deployment_id, k.for_deployment)
        for k in whole.marks
        if since < k.ts <= until and k.kind != "cold_start"
    ]
    assert [
        (k.kind, k.ts, k.deployment_id, k.for_deployment)
        for k in window.marks
        if k.kind != "cold_start"
    ] == inside
    ended = {(w.request_id, w.end) for w in whole.waits if since < w.end <= until}
    assert {(w.request_id, w.end) for w in window.waits if w.outcome != "waiting"} == ended


# --- the scripted swap, by hand ---------------------------------------------------------------


def _rec(seq: int, ts: float, stream: str, event: m.AnyEvent) -> m.Recorded:
    return m.Recorded(seq=seq, ts=ts, stream=stream, version=seq, actor="ondemand", event=event)


def swap_records() -> list[m.Recorded]:
    """A used, then B queued, A put to sleep to make room, B started (40 GiB each, 64 usable)."""
    a, b = m.deployment_stream("a"), m.deployment_stream("b")
    q = m.STREAM_QUEUE
    created = [
        m.DeploymentCreated(
            deployment_id=d, name=n, engine="sim", model=n, memory_bytes=40 * GIB, mode="on_demand"
        )
        for d, n in (("a", "model-a"), ("b", "model-b"))
    ]
    events: list[tuple[float, str, m.AnyEvent]] = [
        (0.0, a, created[0]),
        (0.0, b, created[1]),
        (10.0, a, m.StartRequested(reason="request", request_id="1")),
        (10.0, a, m.EngineStarting(runtime_id="ra", host="h", port=1)),
        (40.0, a, m.EngineReady()),
        (
            100.0,
            q,
            m.RequestQueued(
                request_id="2", deployment_id="b", kind="queued", position=1, arrived_at=100.0
            ),
        ),
        (160.0, a, m.PutToSleep(reason="make_room", for_deployment="b", for_name="model-b")),
        (162.0, a, m.EngineStopped()),
        (162.0, q, m.RequestAdmitted(request_id="2", deployment_id="b")),
        (162.0, b, m.StartRequested(reason="request", request_id="2")),
        (162.0, b, m.EngineStarting(runtime_id="rb", host="h", port=2)),
        (192.5, b, m.EngineReady()),
        (
            192.5,
            q,
            m.RequestLeftQueue(request_id="2", deployment_id="b", reason="served", waited_s=92.5),
        ),
    ]
    return [_rec(i + 1, ts, s, ev) for i, (ts, s, ev) in enumerate(events)]


def test_the_scripted_swap_projects_in_order() -> None:
    timeline = project(EMPTY, swap_records(), 0.0, 300.0, 64 * GIB)
    assert [(x.deployment_id, x.name) for x in timeline.lanes] == [
        ("a", "model-a"),
        ("b", "model-b"),
    ]
    lanes = [(s.deployment_id, s.state, s.start, s.end) for s in timeline.segments]
    assert lanes == [
        ("a", "starting", 10.0, 40.0),
        ("a", "ready", 40.0, 160.0),
        ("a", "stopping", 160.0, 162.0),
        ("b", "starting", 162.0, 192.5),
        ("b", "ready", 192.5, 300.0),
    ]
    kinds = [(k.kind, k.deployment_id, k.ts) for k in timeline.marks]
    assert kinds == [
        ("cold_start", "a", 10.0),
        ("make_room", "a", 160.0),
        ("cold_start", "b", 162.0),
    ]
    room = timeline.marks[1]
    assert (room.for_deployment, room.for_name) == ("b", "model-b")
    assert isinstance(room.event, m.PutToSleep) and room.seq == 7
    b_start = timeline.marks[2]
    assert b_start.duration_s == 30.5 and b_start.request_id == "2"
    [wait] = timeline.waits
    assert (wait.request_id, wait.deployment_id, wait.start, wait.end, wait.outcome) == (
        "2",
        "b",
        100.0,
        192.5,
        "served",
    )
    # Stacked: A below B; never both (40 + 40 > 64).
    assert all(p.high_bytes <= 40 * GIB for p in stack(timeline))


def test_a_window_opening_mid_start_and_mid_wait() -> None:
    records = swap_records()
    start = fold([r for r in records if r.ts <= 170.0])
    window = project(start, [r for r in records if r.ts > 170.0], 170.0, 180.0, 64 * GIB)
    assert [(s.deployment_id, s.state, s.start, s.end) for s in window.segments] == [
        ("b", "starting", 170.0, 180.0)
    ]
    [mark] = window.marks
    assert (mark.kind, mark.ts, mark.duration_s) == ("cold_start", 162.0, None)
    [wait] = window.waits
    assert (wait.start, wait.end, wait.outcome) == (170.0, 180.0, "waiting")


def test_failures_and_idle_sleeps_are_marked() -> None:
    a = m.deployment_stream("a")
    created = m.DeploymentCreated(
        deployment_id="a", name="model-a", engine="sim", model="x", memory_bytes=GIB
    )
    events: list[tuple[float, m.AnyEvent]] = [
        (0.0, created),
        (1.0, m.StartRequested(reason="admin")),
        (2.0, m.EngineStartFailed(reason="boom", failures=1)),
        (3.0, m.StartRequested(reason="admin")),
        (5.0, m.EngineReady()),
        (400.0, m.PutToSleep(reason="idle", idle_timeout_s=300)),
        (401.0, m.EngineStopped()),
        (402.0, m.StartRequested(reason="admin")),
        (403.0, m.EngineStarting(runtime_id="r", host="h", port=1)),
        (404.0, m.EngineLost(reason="oom")),
    ]
    recs = [_rec(i + 1, ts, a, ev) for i, (ts, ev) in enumerate(events)]
    timeline = project(EMPTY, recs, 0.0, 500.0, 8 * GIB)
    # A start that failed or lost its engine is a failure mark, not a cold start.
    assert [(k.kind, k.ts) for k in timeline.marks] == [
        ("failure", 2.0),
        ("cold_start", 3.0),
        ("idle_sleep", 400.0),
        ("failure", 404.0),
    ]
    assert timeline.marks[1].duration_s == 2.0 and timeline.marks[1].end == 5.0
    assert "boom" in timeline.marks[0].title and "oom" in timeline.marks[3].title
    assert isinstance(timeline.marks[3].event, m.EngineLost)
    assert timeline.marks[3].event.reason == "oom"
    states = [(s.state, s.start, s.end, s.memory_bytes) for s in timeline.segments]
    assert states == [
        ("starting", 1.0, 2.0, 0),  # requested, no engine yet: holds nothing
        ("starting", 3.0, 5.0, 0),
        ("ready", 5.0, 400.0, GIB),
        ("stopping", 400.0, 401.0, GIB),
        ("starting", 402.0, 403.0, 0),
        ("starting", 403.0, 404.0, GIB),
    ]
