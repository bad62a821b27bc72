"""`dgxmm replay --timeline --out FILE.svg` on a recorded run, with no server running: a valid
SVG whose lanes, marks and waits are the projection's (read back from its data-* attributes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from actors.memory_broker import GIB
from events.state import EMPTY
from events.timeline import project, stack
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour
from storage.eventlog import EventStore

SVG = "{http://www.w3.org/2000/svg}"
ROOT = Path(__file__).resolve().parent.parent


async def record_swap(db: Path) -> tuple[float, float]:
    """A used, B queued, A put to sleep to make room, B started; the run's first and last ts."""
    h = await Harness.create(
        db,
        usable_gib=64,
        behaviour=lambda spec: EngineBehaviour(startup_s=20.0),
        settings={"ondemand_make_room_after_s": 0},
        stop_s=2.0,  # an engine takes 2 s to stop: the stopping stretch shows
    )
    try:
        a = await h.deploy("model-a", 40)
        b = await h.deploy("model-b", 40)
        await h.advance(21)
        h.request(a, hold_s=1.0)
        await h.advance(5)
        h.request(b, hold_s=1.0)
        await h.advance(60)
        assert h.state(b) == "ready" and h.state(a) == "stopped"
        records = await h.events()
    finally:
        await h.close()
    return records[0].ts, records[-1].ts


def dgxmm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        check=False,
    )


def test_the_svg_draws_the_projections_lanes_marks_and_waits(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    first, last = asyncio.run(record_swap(db))
    since, until = first - 10, last + 30
    out = tmp_path / "incident.svg"
    done = dgxmm(
        "replay", "--db", str(db), "--timeline", "--since", str(since), "--until", str(until),
        "--out", str(out), "--usable-gib", "64",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 deployments" in done.stdout

    async def read() -> list[object]:
        store = await EventStore.open(str(db), create=False, readonly=True)
        try:
            return list(await store.read())
        finally:
            await store.close()

    records = asyncio.run(read())
    want = project(EMPTY, records, since, until, 64 * GIB)  # type: ignore[arg-type]
    root = ET.parse(out).getroot()  # a well-formed XML document
    assert root.tag == f"{SVG}svg"
    assert float(root.get("data-usable-bytes") or 0) == 64 * GIB
    pieces = [
        (
            el.get("data-deployment"),
            el.get("data-state"),
            float(el.get("data-start") or "nan"),
            float(el.get("data-end") or "nan"),
            int(el.get("data-low") or -1),
            int(el.get("data-high") or -1),
        )
        for el in root.iter(f"{SVG}rect")
        if el.get("class") == "piece"
    ]
    assert pieces == [
        (p.deployment_id, p.state, p.start, p.end, p.low_bytes, p.high_bytes) for p in stack(want)
    ]
    assert {p[1] for p in pieces} >= {"starting", "ready", "stopping"}
    marks = [
        (g.get("data-kind"), g.get("data-deployment"), float(g.get("data-ts") or "nan"))
        for g in root.iter(f"{SVG}g")
        if g.get("class") == "mark"
    ]
    assert marks == [(k.kind, k.deployment_id, k.ts) for k in want.marks]
    assert "make_room" in [k[0] for k in marks]
    arrows = [el for el in root.iter(f"{SVG}line") if el.get("class") == "arrow"]
    room = next(k for k in want.marks if k.kind == "make_room")
    assert [(el.get("data-source"), el.get("data-target")) for el in arrows] == [
        (room.deployment_id, room.for_deployment)
    ]
    waits = [
        (el.get("data-request"), el.get("data-deployment"), el.get("data-outcome"))
        for el in root.iter(f"{SVG}rect")
        if el.get("class") == "wait"
    ]
    assert waits == [(w.request_id, w.deployment_id, w.outcome) for w in want.waits]
    assert len(waits) == 1


@pytest.mark.parametrize(
    ("out", "message"),
    [("picture.png", "PNG is not offered"), (None, "give --out FILE.svg")],
)
def test_the_timeline_needs_an_svg_file(tmp_path: Path, out: str | None, message: str) -> None:
    db = tmp_path / "run.db"
    asyncio.run(record_swap(db))
    args = ["replay", "--db", str(db), "--timeline", "--usable-gib", "64"]
    if out is not None:
        args += ["--out", str(tmp_path / out)]
    done = dgxmm(*args)
    assert done.returncode == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "picture.png").exists()
