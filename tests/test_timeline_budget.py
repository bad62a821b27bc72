"""`dgxmm replay --timeline`'s defaults (issue 46, stumble 3): the usable memory the box recorded
in its log, not the memory of the machine that draws it, and a window fitted to a young log."""

from __future__ import annotations

import argparse
import asyncio
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from actors.memory_broker import GIB
from dgxmm.replay.timeline_svg import DEFAULT_WINDOW_S, default_window, timeline_command
from events import model as m
from events.timeline import MIN_FITTED_S
from storage.eventlog import EventStore

LAPTOP_BYTES = 16 * GIB  # the machine the command runs on


async def write_log(path: Path, t0: float, minutes: float, budgets_gib: list[float]) -> None:
    """A box that recorded its budget (one `TraceStarted` per start, a minute apart), started a
    40 GiB model, and stopped it `minutes` after the first record."""
    now = [t0]
    store = await EventStore.open(path, wall=lambda: now[0])
    try:
        for gib in budgets_gib:
            box = m.TraceStarted(usable_bytes=int(gib * GIB), total_bytes=int((gib + 8) * GIB))
            await store.append(m.STREAM_TRAFFIC, [box], actor="system")
            now[0] += 60
        stream = m.deployment_stream("d1")
        created = m.DeploymentCreated(
            deployment_id="d1", name="big", engine="sim", model="org/big", memory_bytes=40 * GIB
        )
        await store.append(stream, [created], actor="admin:test")
        await store.append(stream, [m.StartRequested(reason="admin")], actor="admin:test")
        starting = m.EngineStarting(runtime_id="sim:d1", host="127.0.0.1", port=20001)
        await store.append(stream, [starting], actor="ondemand")
        now[0] += 20
        await store.append(stream, [m.EngineReady()], actor="ondemand")
        now[0] = t0 + minutes * 60
        await store.append(stream, [m.StopRequested()], actor="admin:test")
        await store.append(stream, [m.EngineStopped()], actor="ondemand")
    finally:
        await store.close()


def draw(db: Path, out: Path, **given: object) -> ET.Element:
    """`replay --timeline` in process, on a machine with 16 GiB and no memory configured."""

    async def detect_total() -> tuple[int, str]:
        return LAPTOP_BYTES, "test"

    args = argparse.Namespace(
        db=str(db), out=str(out), since=None, until=None, usable_gib=None,
        loaded_config=None, detect_total=detect_total,
    )  # fmt: skip
    vars(args).update(given)
    assert asyncio.run(timeline_command(args)) == 0
    return ET.parse(out).getroot()


def test_the_svg_draws_the_budget_the_log_recorded_not_this_machines(tmp_path: Path) -> None:
    db = tmp_path / "box.db"
    asyncio.run(write_log(db, 1_767_225_600.0, 30, [48]))
    root = draw(db, tmp_path / "t.svg")
    assert float(root.get("data-usable-bytes") or 0) == 48 * GIB
    assert root.get("data-usable-source") == "recorded in the log"


def test_the_budget_in_force_at_the_windows_end_is_drawn(tmp_path: Path) -> None:
    db = tmp_path / "box.db"
    t0 = 1_767_225_600.0
    asyncio.run(write_log(db, t0, 30, [40, 48]))  # restarted with more memory a minute later
    assert float(draw(db, tmp_path / "a.svg").get("data-usable-bytes") or 0) == 48 * GIB
    early = draw(db, tmp_path / "b.svg", since=t0 - 10, until=t0 + 30)
    assert float(early.get("data-usable-bytes") or 0) == 40 * GIB


def test_usable_gib_and_a_log_without_a_budget_still_decide(tmp_path: Path) -> None:
    db = tmp_path / "box.db"
    asyncio.run(write_log(db, 1_767_225_600.0, 30, []))
    machine = draw(db, tmp_path / "a.svg")
    assert float(machine.get("data-usable-bytes") or 0) == LAPTOP_BYTES - 8 * GIB
    given = draw(db, tmp_path / "b.svg", usable_gib=100.0)
    assert float(given.get("data-usable-bytes") or 0) == 100 * GIB


def test_the_default_window_fits_an_old_log_shorter_than_an_hour(tmp_path: Path) -> None:
    db = tmp_path / "box.db"
    t0 = 1_767_225_600.0  # long before now
    asyncio.run(write_log(db, t0, 20, [48]))
    root = draw(db, tmp_path / "t.svg")
    assert float(root.get("data-since") or 0) == t0
    assert float(root.get("data-until") or 0) == t0 + 20 * 60


def test_the_default_window_of_a_young_live_log_runs_from_its_first_record_to_now(
    tmp_path: Path,
) -> None:
    db = tmp_path / "box.db"
    t0 = time.time() - 10 * 60
    asyncio.run(write_log(db, t0, 5, [48]))
    before = time.time()
    root = draw(db, tmp_path / "t.svg")
    assert float(root.get("data-since") or 0) == t0
    assert before <= float(root.get("data-until") or 0) <= time.time()
    # The ready stretch fills a third of the width (220 s of 600), not a sliver at the right.
    rects = root.iter("{http://www.w3.org/2000/svg}rect")
    ready = [p for p in rects if p.get("class") == "piece" and p.get("data-state") == "ready"]
    assert ready and float(ready[0].get("width") or 0) > 300


def test_the_default_window_keeps_what_is_given_and_the_last_hour_of_a_long_log() -> None:
    now = 10_000.0
    long_log = (0.0, now - 5)
    assert default_window(None, None, long_log, now) == (now - DEFAULT_WINDOW_S, now)
    assert default_window(100.0, 200.0, long_log, now) == (100.0, 200.0)
    assert default_window(None, 5000.0, long_log, now) == (5000.0 - DEFAULT_WINDOW_S, 5000.0)
    assert default_window(None, None, None, now) == (now - DEFAULT_WINDOW_S, now)
    # A log of one instant still gets a window of its own.
    assert default_window(None, None, (now - 2, now - 2), now) == (now - MIN_FITTED_S, now)
