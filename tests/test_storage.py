"""The SQLite event log, on real files: appends, reads, concurrency, group commit, errors."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from events import model as m
from events.state import EMPTY, fold
from storage.errors import (
    ConcurrencyError,
    LogCorrupt,
    LogLocked,
    LogNotFound,
    NotAnEventLog,
    StorageError,
    StoreClosed,
)
from storage.eventlog import MAX_PENDING_APPENDS, EventStore

T = TypeVar("T")
T0 = 1_767_225_600.0
DEADLINE_S = 10.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one test coroutine on a fresh loop."""
    return asyncio.run(coro)


class FakeWall:
    """A wall clock the test moves by hand."""

    def __init__(self, start: float = T0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def settings(n: int) -> m.SettingsChanged:
    """A small event to append."""
    return m.SettingsChanged(changes={"n": n})


def created(dep_id: str) -> m.DeploymentCreated:
    """A deployment's first event."""
    return m.DeploymentCreated(
        deployment_id=dep_id, name=f"name-{dep_id}", engine="sim", model="m", memory_bytes=1 << 30
    )


async def open_store(
    path: Path, wall: Callable[[], float] | None = None, *, scratch: bool = False
) -> EventStore:
    """Open (creating) a log at `path` (`scratch`: a simulation's, `EventStore.open`)."""
    if wall is None:
        return await EventStore.open(path, scratch=scratch)
    return await EventStore.open(path, wall=wall, scratch=scratch)


# The behaviours a simulation's scratch log keeps: the tests below marked with it run on both.
BOTH = pytest.mark.parametrize("scratch", [False, True], ids=["log", "scratch"])


@BOTH
def test_appended_events_are_read_back_in_order_with_seq_ts_stream_version_and_actor(
    tmp_path: Path, scratch: bool
) -> None:
    async def scenario() -> None:
        wall = FakeWall()
        store = await open_store(tmp_path / "log.db", wall, scratch=scratch)
        first = await store.append("settings", [settings(1), settings(2)], actor="admin:alice")
        wall.now += 5
        second = await store.append(m.deployment_stream("d1"), [created("d1")], actor="admin:bob")
        assert [(r.seq, r.version, r.ts) for r in first] == [(1, 1, T0), (2, 2, T0)]
        assert [(r.seq, r.version, r.stream, r.actor) for r in second] == [
            (3, 1, "deployment:d1", "admin:bob")
        ]
        back = await store.read()
        assert back == first + second
        await store.close()

    run(scenario())


def test_records_survive_closing_and_reopening_the_file(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db")
        written = await store.append("settings", [settings(i) for i in range(5)], actor="system")
        await store.close()
        again = await EventStore.open(tmp_path / "log.db", create=False)
        assert await again.read() == written
        assert await again.version("settings") == 5
        more = await again.append("settings", [settings(9)], actor="system")
        assert (more[0].seq, more[0].version) == (6, 6)
        await again.close()

    run(scenario())


@BOTH
def test_stream_versions_count_per_stream_and_start_at_zero(tmp_path: Path, scratch: bool) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db", scratch=scratch)
        assert await store.version("deployment:d1") == 0
        await store.append("deployment:d1", [created("d1")], actor="admin:a")
        await store.append("settings", [settings(1)], actor="admin:a")
        await store.append("deployment:d1", [m.StartRequested(reason="admin")], actor="admin:a")
        assert await store.version("deployment:d1") == 2
        assert await store.version("settings") == 1
        await store.close()

    run(scenario())


@BOTH
def test_append_with_a_stale_expected_version_raises_our_concurrency_error(
    tmp_path: Path, scratch: bool
) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db", scratch=scratch)
        await store.append("settings", [settings(1), settings(2)], actor="system")
        with pytest.raises(ConcurrencyError) as caught:
            await store.append("settings", [settings(3)], actor="system", expected_version=1)
        assert not isinstance(caught.value, sqlite3.Error)
        assert (caught.value.expected, caught.value.actual) == (1, 2)
        ok = await store.append("settings", [settings(3)], actor="system", expected_version=2)
        assert ok[0].version == 3
        assert len(await store.read()) == 3
        await store.close()

    run(scenario())


@BOTH
def test_a_conflict_fails_only_its_own_append_in_a_shared_batch(
    tmp_path: Path, scratch: bool
) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db", scratch=scratch)
        await store.append("settings", [settings(0)], actor="system")
        results = await asyncio.gather(
            store.append("a", [settings(1)], actor="system"),
            store.append("settings", [settings(2)], actor="system", expected_version=0),
            store.append("b", [settings(3)], actor="system"),
            return_exceptions=True,
        )
        assert isinstance(results[1], ConcurrencyError)
        assert not isinstance(results[0], BaseException)
        assert not isinstance(results[2], BaseException)
        assert [r.seq for r in await store.read()] == [1, 2, 3]
        await store.close()

    run(scenario())


def test_a_second_writer_on_the_same_file_gets_our_concurrency_error_not_sqlite3s(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        path = tmp_path / "log.db"
        one = await open_store(path)
        two = await EventStore.open(path, create=False)
        assert await two.version("settings") == 0  # `two` now caches version 0
        await one.append("settings", [settings(1)], actor="system")
        with pytest.raises(ConcurrencyError):
            await two.append("settings", [settings(2)], actor="system", expected_version=0)
        # Without an expectation the second writer catches up and appends after the first.
        late = await two.append("settings", [settings(3)], actor="system")
        assert (late[0].seq, late[0].version) == (2, 2)
        assert [(r.seq, r.version) for r in await one.read()] == [(1, 1), (2, 2)]
        await one.close()
        await two.close()

    run(scenario())


def test_many_concurrent_appends_share_few_transactions(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db")
        appends = [
            store.append(f"deployment:d{i % 7}", [settings(i)], actor="ondemand")
            for i in range(500)
        ]
        recorded = await asyncio.gather(*appends)
        stats = store.statistics()
        assert stats["appends"] == 500
        assert stats["events"] == 500
        assert stats["transactions"] <= 5
        seqs = sorted(r[0].seq for r in recorded)
        assert seqs == list(range(1, 501))
        for i in range(7):
            versions = [r.version for r in await store.read(stream=f"deployment:d{i}")]
            assert versions == list(range(1, len(versions) + 1))
        await store.close()

    run(scenario())


def test_appenders_beyond_the_writers_inbox_wait_and_all_get_written(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db")
        many = MAX_PENDING_APPENDS + 2_000
        results = await asyncio.gather(
            *(store.append("queue", [settings(i)], actor="ondemand") for i in range(many))
        )
        assert sorted(r[0].seq for r in results) == list(range(1, many + 1))
        assert await store.version("queue") == many
        await store.close()

    run(scenario())


def test_each_appender_learns_its_own_records(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db")
        results = await asyncio.gather(
            *(store.append("settings", [settings(i)], actor="system") for i in range(50))
        )
        for i, recs in enumerate(results):
            assert recs[0].event == settings(i)
        await store.close()

    run(scenario())


def test_read_since_seq_one_stream_until_ts_and_limit(tmp_path: Path) -> None:
    async def scenario() -> None:
        wall = FakeWall()
        store = await open_store(tmp_path / "log.db", wall)
        for i in range(10):
            wall.now = T0 + i
            stream = "settings" if i % 2 else "deployment:d1"
            await store.append(stream, [settings(i)], actor="system")
        assert [r.seq for r in await store.read(since_seq=7)] == [8, 9, 10]
        assert [r.seq for r in await store.read(stream="settings")] == [2, 4, 6, 8, 10]
        assert [r.seq for r in await store.read(until_ts=T0 + 3)] == [1, 2, 3, 4]
        assert [r.seq for r in await store.read(since_seq=2, limit=3)] == [3, 4, 5]
        assert [
            r.seq for r in await store.read(since_seq=3, stream="settings", until_ts=T0 + 7)
        ] == [4, 6, 8]
        assert await store.last_seq() == 10
        await store.close()

    run(scenario())


def test_follow_yields_the_past_then_wakes_on_new_appends(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db")
        await store.append("settings", [settings(0)], actor="system")
        seen: list[int] = []
        got_three = asyncio.Event()

        async def follower() -> None:
            # A long poll interval: only the in-process wake-up can deliver in time.
            async for rec in store.follow(poll_s=3600):
                seen.append(rec.seq)
                if len(seen) == 3:
                    got_three.set()

        task = asyncio.create_task(follower())
        await store.append("settings", [settings(1)], actor="system")
        await store.append("settings", [settings(2)], actor="system")
        await asyncio.wait_for(got_three.wait(), DEADLINE_S)
        assert seen == [1, 2, 3]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()

    run(scenario())


def test_a_reader_in_read_only_mode_sees_appends_of_the_writer(tmp_path: Path) -> None:
    async def scenario() -> None:
        path = tmp_path / "log.db"
        writer = await open_store(path)
        await writer.append("settings", [settings(0)], actor="system")
        reader = await EventStore.open(path, create=False, readonly=True)
        seen: list[int] = []
        got_two = asyncio.Event()

        async def follower() -> None:
            async for rec in reader.follow(poll_s=0.01):
                seen.append(rec.seq)
                if len(seen) == 2:
                    got_two.set()

        task = asyncio.create_task(follower())
        await writer.append("settings", [settings(1)], actor="system")
        await asyncio.wait_for(got_two.wait(), DEADLINE_S)
        assert seen == [1, 2]
        with pytest.raises(StoreClosed):
            await reader.append("settings", [settings(2)], actor="system")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await reader.close()
        await writer.close()

    run(scenario())


@BOTH
def test_listeners_get_each_durable_batch(tmp_path: Path, scratch: bool) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db", scratch=scratch)
        batches: list[list[int]] = []
        store.add_listener(lambda recs: batches.append([r.seq for r in recs]))

        def broken(recs: list[m.Recorded]) -> None:
            raise RuntimeError("a broken listener must not break the log")

        store.add_listener(broken)
        await store.append("settings", [settings(1), settings(2)], actor="system")
        assert batches == [[1, 2]]
        await store.close()

    run(scenario())


def test_snapshots_store_the_folded_state_and_pick_the_newest_before_a_time(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        wall = FakeWall()
        store = await open_store(tmp_path / "log.db", wall)
        assert await store.latest_snapshot() is None
        await store.append(m.deployment_stream("d1"), [created("d1")], actor="admin:a")
        early = fold(await store.read())
        await store.save_snapshot(early)
        wall.now += 100
        await store.append("settings", [settings(1)], actor="admin:a")
        late = fold(await store.read())
        await store.save_snapshot(late)
        assert await store.latest_snapshot() == late
        assert await store.latest_snapshot(until_ts=T0 + 50) == early
        assert await store.latest_snapshot(until_ts=T0 - 1) is None
        assert late != EMPTY
        await store.close()

    run(scenario())


def test_appending_after_close_raises_store_closed(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db")
        await store.close()
        with pytest.raises(StoreClosed):
            await store.append("settings", [settings(1)], actor="system")

    run(scenario())


@BOTH
def test_close_finishes_the_appends_already_queued(tmp_path: Path, scratch: bool) -> None:
    async def scenario() -> None:
        path = tmp_path / "log.db"
        store = await open_store(path, scratch=scratch)
        pending = [
            asyncio.create_task(store.append("settings", [settings(i)], actor="system"))
            for i in range(20)
        ]
        await asyncio.sleep(0)  # let them enqueue; close must not drop them
        await store.close()
        results = [await t for t in pending]
        assert sorted(r[0].seq for r in results) == list(range(1, 21))
        again = await EventStore.open(path, create=False, readonly=True)
        assert len(await again.read()) == 20
        await again.close()

    run(scenario())


def test_a_cancelled_appender_does_not_break_the_writer_or_the_numbering(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db")
        await store.append("settings", [settings(0)], actor="system")
        doomed = asyncio.create_task(
            store.append("settings", [settings(1)], actor="system", expected_version=5)
        )
        await asyncio.sleep(0)  # enqueued, not yet written
        doomed.cancel()
        after = await store.append("settings", [settings(2)], actor="system")
        assert (after[0].seq, after[0].version) == (2, 2)
        await asyncio.gather(doomed, return_exceptions=True)
        await store.close()

    run(scenario())


# --- opening files that are not (readable) DGXMM logs -------------------------------------


def test_opening_a_missing_file_without_create_raises_log_not_found(tmp_path: Path) -> None:
    async def scenario() -> None:
        with pytest.raises(LogNotFound):
            await EventStore.open(tmp_path / "nope.db", create=False, readonly=True)
        with pytest.raises(LogNotFound):
            await EventStore.open(tmp_path / "nope.db", create=False)

    run(scenario())
    assert not (tmp_path / "nope.db").exists()


def test_opening_random_bytes_raises_log_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(os.urandom(8192))

    async def scenario() -> None:
        with pytest.raises(LogCorrupt):
            await EventStore.open(path, create=False, readonly=True)
        with pytest.raises(LogCorrupt):
            await EventStore.open(path)

    run(scenario())


def test_opening_another_applications_sqlite_file_raises_not_an_event_log(
    tmp_path: Path,
) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    before = path.read_bytes()

    async def scenario() -> None:
        with pytest.raises(NotAnEventLog):
            await EventStore.open(path, create=False, readonly=True)
        with pytest.raises(NotAnEventLog):
            await EventStore.open(path)

    run(scenario())
    assert path.read_bytes() == before  # not even switched to WAL


def test_an_sqlite_file_with_an_events_table_of_someone_else_is_not_ours(
    tmp_path: Path,
) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE events (id INTEGER PRIMARY KEY)")
        conn.execute("CREATE TABLE meta (key TEXT, value TEXT)")
        conn.execute("INSERT INTO meta VALUES ('application', 'something-else')")

    async def scenario() -> None:
        with pytest.raises(NotAnEventLog):
            await EventStore.open(path, create=False, readonly=True)

    run(scenario())


def test_opening_a_file_locked_by_another_connection_raises_log_locked(tmp_path: Path) -> None:
    path = tmp_path / "log.db"

    async def make() -> None:
        store = await open_store(path)
        await store.append("settings", [settings(1)], actor="system")
        await store.close()

    run(make())
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode=EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("INSERT INTO meta VALUES ('lock', 'held')")

        async def scenario() -> None:
            with pytest.raises(LogLocked) as caught:
                await EventStore.open(path, create=False, readonly=True)
            assert isinstance(caught.value, StorageError)
            assert not isinstance(caught.value, sqlite3.Error)

        run(scenario())
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_undecodable_event_data_raises_log_corrupt_not_a_msgspec_error(tmp_path: Path) -> None:
    path = tmp_path / "log.db"

    async def make() -> None:
        store = await open_store(path)
        await store.append("settings", [settings(1)], actor="system")
        await store.close()

    run(make())
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE events SET data = ? WHERE seq = 1", (b'{"type": "NoSuchEvent"}',))

    async def scenario() -> None:
        store = await EventStore.open(path, create=False, readonly=True)
        with pytest.raises(LogCorrupt):
            await store.read()
        await store.close()

    run(scenario())


def test_a_scratch_log_keeps_no_read_models(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path / "log.db", scratch=True)
        await store.append(m.deployment_stream("d1"), [created("d1")], actor="admin:a")
        assert not store.readmodels_current()
        await store.close()
        with sqlite3.connect(tmp_path / "log.db") as db:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
        assert "events" in tables and "audit" not in tables

    run(scenario())
