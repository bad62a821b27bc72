"""How fast the log grows: events per cold cycle, per waiting request, per warm request, and
bytes per event on disk (the figures docs/on-demand-gateway.md states)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections import Counter
from pathlib import Path

from events import model as m
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour
from storage.eventlog import EventStore
from tests.perf.bench_storage import write_log

STARTUP_S = 30.0
BYTES_PER_EVENT_BOUND = 300  # docs: about 277 B, of which 213 B the events and their indexes


def test_a_cold_cycle_records_8_events_a_waiting_request_3_and_a_warm_request_none(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        h = await Harness.create(
            tmp_path / "log.db", behaviour=lambda spec: EngineBehaviour(startup_s=STARTUP_S)
        )
        try:
            a = await h.deploy("alpha", 10)  # a deployment starts when created
            await h.advance(STARTUP_S + 2)
            await h.advance(301 + 15)  # idles out
            assert h.state(a) == "stopped"
            start = len(await h.events())
            first = h.request(a)  # wakes the model: a cold cycle
            await h.advance(1)
            second = h.request(a)  # arrives while it starts: waits as well
            await h.advance(STARTUP_S + 2)
            assert first.outcome == second.outcome == "served"
            ready = len(await h.events())
            warm = h.request(a)  # the model is ready: served at once
            await h.advance(2)
            assert warm.outcome == "served" and warm.waited == 0
            assert len(await h.events()) == ready  # a warm request writes nothing
            await h.advance(301 + 15)
            assert h.state(a) == "stopped"
            recorded = (await h.events())[start:]
            assert h.violations == []
        finally:
            await h.close()
        per_request = Counter(
            ev.request_id
            for ev in (r.event for r in recorded)
            if isinstance(ev, m.RequestQueued | m.RequestAdmitted | m.RequestLeftQueue)
        )
        assert per_request == {first.request_id: 3, second.request_id: 3}
        lifecycle = [r.type for r in recorded if r.stream.startswith("deployment:")]
        assert lifecycle == [
            "StartRequested",
            "EngineStarting",
            "EngineReady",
            "PutToSleep",
            "EngineStopped",
        ]
        assert len(recorded) == 8 + 3  # one cold cycle (5 + its request's 3), one more waiter

    asyncio.run(main())


def test_an_event_costs_under_300_bytes_on_disk_with_its_indexes_and_read_models(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.db"
    count = 50_000
    write_log(str(path), count)  # the bench's incident-like mix of queue and lifecycle events

    async def open_as_serve() -> None:  # builds the read models, as `serve` does
        await (await EventStore.open(path)).close()

    asyncio.run(open_as_serve())
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (used,) = conn.execute("SELECT SUM(pgsize) FROM dbstat").fetchone()
    assert 150 < used / count < BYTES_PER_EVENT_BOUND
