"""storage.windows reads a window of a real SQLite log (snapshots, the events after one, the
queue's events read apart from the deployments') and gives what the projection of the whole
log cut at the window's start gives."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from events import model as m
from events.state import EMPTY, evolve, fold
from events.timeline import project
from storage.errors import LogCorrupt
from storage.eventlog import EventStore
from storage.windows import timeline_window
from tests.perf.bench_storage import T0, write_log

GIB = 1 << 30
EVENTS = 6_000
SNAPSHOTS_AT = (1_500, 3_000, 4_500)  # sequence numbers


def _log(path: Path) -> list[m.Recorded]:
    """The benchmark's synthetic history (starts, sleeps, a wait per request), several events
    at each instant (so that a window can open on a shared timestamp), with snapshots."""
    write_log(str(path), EVENTS, spacing_s=1.0)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE events SET ts = ? + 4 * CAST((ts - ?) / 4 AS INTEGER)", (T0, T0))

    async def snapshots() -> list[m.Recorded]:
        store = await EventStore.open(path)
        records = await store.read()
        state = EMPTY
        for rec in records:
            state = evolve(state, rec)
            if rec.seq in SNAPSHOTS_AT:
                await store.save_snapshot(state)
        await store.close()
        return records

    return asyncio.run(snapshots())


def test_a_window_read_from_the_log_is_the_whole_log_projected_and_cut(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    records = _log(path)
    ts = {rec.seq: rec.ts for rec in records}
    first, last = records[0].ts, records[-1].ts
    windows = [
        (first - 1.0, first + 900.0),  # from the beginning: no snapshot before it
        (ts[1_500], ts[1_500] + 3_600.0),  # opens on a snapshot's (shared) timestamp
        (ts[1_500] + 1.0, ts[4_500] + 2.0),  # across two snapshots
        (ts[3_000] + 777.0, ts[3_000] + 2_000.5),  # the events after a snapshot first
        (ts[2_222], ts[2_222] + 0.5),  # between two instants: no events in it
        (ts[5_000], last + 600.0),  # past the end of the log
    ]

    async def check() -> None:
        store = await EventStore.open(path, readonly=True)
        try:
            assert await store.latest_snapshot(until_ts=ts[3_000] + 777.0) is not None
            for since, until in windows:
                got = await timeline_window(store, since, until, 64 * GIB)
                before = [rec for rec in records if rec.ts <= since]
                after = records[len(before) :]
                want = project(fold(before), after, since, until, 64 * GIB)
                assert got == want, (since, until)
                assert got.segments or got.waits or since == ts[2_222]
        finally:
            await store.close()

    asyncio.run(check())


def test_a_queue_event_that_does_not_decode_is_a_corrupt_log(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    records = _log(path)
    queued = next(rec for rec in records if isinstance(rec.event, m.RequestQueued))
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE events SET data = ? WHERE seq = ?", (b'{"type": "NoSuchEvent"}', queued.seq)
        )

    async def check() -> None:
        store = await EventStore.open(path, readonly=True)
        try:
            with pytest.raises(LogCorrupt):
                await timeline_window(store, queued.ts - 10.0, queued.ts + 10.0, 64 * GIB)
        finally:
            await store.close()

    asyncio.run(check())
