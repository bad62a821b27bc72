"""Snapshots and read models: derived data that always equals what the log says."""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
from pathlib import Path

import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events import model as m
from events.projections import AuditRow, EventRow, audit_rows, deployment_events
from events.state import EMPTY, SystemState, fold
from storage import snapshots
from storage.eventlog import EventStore
from storage.readmodels import AuditFilter
from storage.snapshot_format import decode_snapshot, encode_snapshot
from storage.snapshots import load_state
from tests.test_events import T0, ScriptedWall, histories, write_history

DEPLOYMENTS = [f"d{i}" for i in range(8)]
BIG = 1 << 40


async def tables(
    store: EventStore, dep_ids: list[str]
) -> tuple[list[AuditRow], dict[tuple[str, bool], list[EventRow]]]:
    """Everything the audit and Events-tab tables hold, oldest first."""
    audit = list(reversed(await store.audit_page(before=None, limit=BIG)))
    tabs = {
        (dep, made_room): list(
            reversed(await store.timeline_page(dep, before=None, limit=BIG, made_room=made_room))
        )
        for dep in dep_ids
        for made_room in (False, True)
    }
    return audit, tabs


def from_scratch(
    records: list[m.Recorded], dep_ids: list[str]
) -> tuple[list[AuditRow], dict[tuple[str, bool], list[EventRow]]]:
    """The same projections computed over the whole prefix."""
    tabs = {
        (d, made_room): deployment_events(records, d, made_room=made_room)
        for d in dep_ids
        for made_room in (False, True)
    }
    return list(audit_rows(records)), tabs


def known_deployments(records: list[m.Recorded]) -> list[str]:
    """Every deployment id that appears, and one that never does."""
    found = {r.stream.partition(":")[2] for r in records if r.stream.startswith("deployment:")}
    return sorted(found | {"never"})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(max_steps=80))
def test_every_read_model_equals_its_projection_from_scratch_at_every_prefix(
    records: list[m.Recorded],
) -> None:
    dep_ids = known_deployments(records)

    async def check(store: EventStore, n: int) -> None:
        assert await tables(store, dep_ids) == from_scratch(records[:n], dep_ids)
        assert store.readmodels_current()

    async def scenario(path: Path) -> None:
        await (await write_history(path, records, check)).close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp) / "log.db"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(max_steps=80), st.data())
def test_a_snapshot_plus_the_tail_equals_the_full_fold_at_every_prefix(
    records: list[m.Recorded], data: st.DataObject
) -> None:
    for end in range(len(records) + 1):
        cut = data.draw(st.integers(0, end), label=f"cut of {end}")
        snapshot = decode_snapshot(encode_snapshot(fold(records[:cut])))
        assert snapshot is not None
        assert fold(records[cut:end], snapshot) == fold(records[:end])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(max_steps=60), st.data())
def test_start_up_folds_the_newest_snapshot_plus_the_tail_of_a_real_log(
    records: list[m.Recorded], data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(records)), max_size=3), label="cuts"))

    async def scenario(path: Path) -> SystemState:
        store = await write_history(path, records)
        for cut in cuts:
            await store.save_snapshot(fold(records[:cut]))
        await store.close()
        store = await EventStore.open(path)
        try:
            return await load_state(store)
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as tmp:
        assert asyncio.run(scenario(Path(tmp) / "log.db")) == fold(records)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(max_steps=80))
def test_read_models_written_by_older_code_are_rebuilt_from_the_log(
    records: list[m.Recorded],
) -> None:
    dep_ids = known_deployments(records)

    async def scenario(path: Path) -> None:
        await (await write_history(path, records)).close()
        with sqlite3.connect(path) as conn:  # as if written by another version
            conn.execute("UPDATE meta SET value = '0' WHERE key = 'readmodel_version'")
            conn.execute("DELETE FROM audit WHERE seq % 2 = 0")
            conn.execute("INSERT INTO timeline VALUES ('d1', 999999, 0, 'x', 'bogus', 'X', 0)")
        store = await EventStore.open(path)
        try:
            assert await tables(store, dep_ids) == from_scratch(records, dep_ids)
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp) / "log.db"))


def created(dep: str) -> m.DeploymentCreated:
    """A deployment with a name."""
    return m.DeploymentCreated(
        deployment_id=dep, name=f"model-{dep}", engine="vllm", model="m", memory_bytes=1 << 30
    )


def test_a_snapshot_that_does_not_decode_is_ignored_with_a_warning_and_the_log_folded(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.db"

    async def scenario() -> tuple[SystemState, SystemState]:
        store = await EventStore.open(path)
        for dep in ("d1", "d2"):
            await store.append(m.deployment_stream(dep), [created(dep)], actor="admin:a")
        await store.save_snapshot(fold(await store.read()))
        await store.close()
        with sqlite3.connect(path) as conn:  # a schema that grew, or a damaged blob
            conn.execute("UPDATE snapshots SET state = CAST('dgxmm-state/0/old\n{}' AS BLOB)")
        store = await EventStore.open(path)
        try:
            with structlog.testing.capture_logs() as logs:
                state = await load_state(store)
            assert [e["event"] for e in logs] == ["snapshot_ignored"]
            return state, fold(await store.read())
        finally:
            await store.close()

    state, expected = asyncio.run(scenario())
    assert state == expected and set(state.deployments) == {"d1", "d2"}


def test_deleting_the_snapshots_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "log.db"

    async def scenario() -> tuple[SystemState, SystemState]:
        store = await EventStore.open(path)
        await store.append(m.deployment_stream("d1"), [created("d1")], actor="admin:a")
        await store.save_snapshot(fold(await store.read()))
        await store.append(m.deployment_stream("d2"), [created("d2")], actor="admin:a")
        await store.close()
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM snapshots")
        store = await EventStore.open(path)
        try:
            return await load_state(store), fold(await store.read())
        finally:
            await store.close()

    state, expected = asyncio.run(scenario())
    assert state == expected and state != EMPTY


def test_a_page_of_the_audit_trail_goes_back_with_before(tmp_path: Path) -> None:
    async def scenario() -> None:
        wall = ScriptedWall()
        store = await EventStore.open(tmp_path / "log.db", wall=wall)
        try:
            for i in range(10):
                wall.now = T0 + i
                await store.append(m.STREAM_USERS, [m.UserLoggedIn(name=f"u{i}")], actor="system")
            first = await store.audit_page(before=None, limit=4)
            assert [r.details["name"] for r in first] == ["u9", "u8", "u7", "u6"]
            second = await store.audit_page(before=first[-1].seq, limit=4)
            assert [r.details["name"] for r in second] == ["u5", "u4", "u3", "u2"]
            since = await store.audit_page(
                before=None, limit=100, where=AuditFilter(since_ts=T0 + 8)
            )
            assert [r.details["name"] for r in since] == ["u9", "u8"]
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_long_fold_at_start_up_writes_snapshots_along_the_log_again(tmp_path: Path) -> None:
    """After the state's schema changed, every snapshot is of another format: the first
    start-up folds the whole log and snapshots it again every SNAPSHOT_EVERY events, so that
    a past window (the timeline, replay) starts near its time, not at the log's beginning."""
    path = tmp_path / "log.db"
    every = snapshots.SNAPSHOT_EVERY
    wall = ScriptedWall()

    async def scenario() -> list[int | None]:
        store = await EventStore.open(path, wall=wall)
        for chunk in range(0, every * 2 + 500, 500):  # a second per 500 events
            wall.now = T0 + chunk / 500
            batch = [m.SettingsChanged(changes={"n": n}) for n in range(chunk, chunk + 500)]
            await store.append("settings", batch, actor="admin:a")
            if chunk + 500 == every:
                await store.save_snapshot(fold(await store.read()))
        await store.close()
        with sqlite3.connect(path) as conn:  # written by code with another schema
            conn.execute("UPDATE snapshots SET state = CAST('dgxmm-state/0/old\n{}' AS BLOB)")
        store = await EventStore.open(path, wall=wall)
        try:
            assert await store.latest_snapshot() is None
            with structlog.testing.capture_logs() as logs:
                state = await load_state(store)
            assert [e["event"] for e in logs] == ["snapshot_ignored"]
            assert state == fold(await store.read())
            assert await store.foreign_snapshots() == 0  # the old one was rewritten in place
            found = [await store.latest_snapshot(until_ts=T0 + s) for s in (18, 19, 39, 99)]
            return [None if f is None else f.last_seq for f in found]
        finally:
            await store.close()

    assert asyncio.run(scenario()) == [None, every, every * 2, every * 2]
