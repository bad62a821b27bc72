"""The append-only event log: one SQLite file (WAL), group commit, optimistic concurrency.

One writer task owns all writes.  Appends that arrive together share one transaction and
one fsync (`synchronous=FULL`); each caller's future resolves only after that commit, so an
acknowledged append is on disk.  Stream versions and the sequence counter are cached by the
writer, so conflicts are found before any SQL runs; the UNIQUE(stream, version) constraint
still guards against a second writer, and a batch that trips it is retried append by
append so one bad append never fails its neighbours.

The read models (`storage.readmodels`) are written in the same transactions as the events;
snapshots (`storage.snapshots`) go through the same writer, between two transactions.  The
module is longer than most because writing, reading, snapshots and read-model
pages share one connection, its writer task and its error mapping; a split would have to
hand the connection around.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import aiosqlite
import msgspec
import structlog

from events import model as m
from events.projections import AuditRow, EventRow, Projector
from events.state import SystemState
from storage import readmodels
from storage.errors import (
    ConcurrencyError,
    LogCorrupt,
    LogLocked,
    LogNotFound,
    NotAnEventLog,
    StorageError,
    StoreClosed,
)
from storage.inline import connect_inline
from storage.readmodels import ANY_AUDIT, AuditFilter
from storage.snapshot_format import SNAPSHOT_PREFIX, decode_snapshot, encode_snapshot

log = structlog.get_logger("dgxmm.storage")

APPLICATION = "dgxmm"
SCHEMA_VERSION = 1
MAX_PENDING_APPENDS = 10_000  # the writer's inbox; appenders wait (backpressure) beyond it
MAX_BATCH = 2_000  # appends per transaction
SCRATCH_BEHIND = 4_096  # a scratch log's rows held back at most (`EventStore._write_behind`)
_INSERT_EVENTS = (
    "INSERT INTO events (seq, ts, stream, version, type, actor, data) VALUES (?, ?, ?, ?, ?, ?, ?)"
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    stream TEXT NOT NULL,
    version INTEGER NOT NULL,
    type TEXT NOT NULL,
    actor TEXT NOT NULL,
    data BLOB NOT NULL,
    UNIQUE (stream, version)
);
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
CREATE TABLE IF NOT EXISTS snapshots (
    seq INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    state BLOB NOT NULL
);
"""

_ROW_COLUMNS = "seq, ts, stream, version, actor, data"
_state_encoder = msgspec.json.Encoder()
_state_decoder = msgspec.json.Decoder(SystemState)

Row = tuple[int, float, str, int, str, bytes]


def record_from_row(row: Row) -> m.Recorded:
    """Decode one `events` row."""
    seq, ts, stream, version, actor, data = row
    return m.Recorded(
        seq=seq, ts=ts, stream=stream, version=version, actor=actor, event=m.decode_event(data)
    )


def _map_error(exc: Exception, path: str) -> StorageError:
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and "locked" in text:
        return LogLocked(f"{path}: the database is locked by another process")
    if isinstance(exc, sqlite3.DatabaseError) and (
        "not a database" in text or "malformed" in text or "disk image" in text
    ):
        return LogCorrupt(f"{path}: not a readable SQLite database ({text})")
    if isinstance(exc, sqlite3.OperationalError) and "unable to open" in text:
        return LogNotFound(f"{path}: cannot open the file ({text})")
    return StorageError(f"{path}: {text}")


@dataclass
class _Append:
    stream: str
    events: Sequence[m.AnyEvent]
    actor: str
    expected_version: int | None
    future: asyncio.Future[list[m.Recorded]]
    rows: list[tuple[int, float, str, int, str, str, bytes]] = field(default_factory=list)
    _records: list[m.Recorded] | None = None

    def records(self) -> list[m.Recorded]:
        """The staged rows as records."""
        if self._records is None or len(self._records) != len(self.rows):
            self._records = self._make_records()
        return self._records

    def _make_records(self) -> list[m.Recorded]:
        return [
            m.Recorded(seq=seq, ts=ts, stream=stream, version=version, actor=actor, event=event)
            for (seq, ts, stream, version, _t, actor, _d), event in zip(
                self.rows, self.events, strict=True
            )
        ]


@dataclass
class _Snapshot:
    state: SystemState
    future: asyncio.Future[None]


class EventStore:
    """The event log of one DGXMM instance."""

    def __init__(
        self,
        conn: aiosqlite.Connection,
        path: str,
        wall: Callable[[], float],
        readonly: bool,
        scratch: bool = False,
    ) -> None:
        self._conn = conn
        self._scratch = scratch
        self._behind: list[tuple[int, float, str, int, str, str, bytes]] = []  # scratch only
        self.path = path
        self._wall = wall
        self._readonly = readonly
        self._inbox: asyncio.Queue[_Append | _Snapshot | None] = asyncio.Queue(MAX_PENDING_APPENDS)
        self._versions: dict[str, int] = {}
        self._last_seq = 0
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        self._appended = asyncio.Event()
        self._listeners: list[Callable[[list[m.Recorded]], None]] = []
        self._stats = {"appends": 0, "events": 0, "transactions": 0}
        self._writing = False
        self._projector = Projector()
        self._readmodel_seq: int | None = None  # None: no read models usable in this file

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        readonly: bool = False,
        wall: Callable[[], float] = time.time,
        scratch: bool = False,
    ) -> EventStore:
        """Open (and with `create`, make) the log at `path`; raises StorageError subclasses.

        `scratch`: a simulation's own log, which nobody else opens and nobody asks for its
        audit trail: SQLite runs in the loop's thread (`storage.inline`), holds its lock for
        the file's whole life, does not sync, and no read models are kept.
        """
        path = os.fspath(path)
        if not create and not await asyncio.to_thread(os.path.exists, path):
            raise LogNotFound(f"{path}: no such file")
        conn: aiosqlite.Connection | None = None
        try:
            if readonly:
                uri = f"file:{urllib.parse.quote(path)}?mode=ro"
                conn = await aiosqlite.connect(uri, uri=True, timeout=2.0)
            elif scratch:
                conn = await connect_inline(path, timeout=5.0, isolation_level=None)
            else:
                conn = await aiosqlite.connect(path, timeout=5.0, isolation_level=None)
            store = cls(conn, path, wall, readonly, scratch)
            await store._prepare(create and not readonly)
        except sqlite3.Error as exc:
            # An unclosed connection keeps aiosqlite's (non-daemon) thread, and the process, alive.
            if conn is not None:
                with contextlib.suppress(sqlite3.Error, ValueError):
                    await conn.close()
            raise _map_error(exc, path) from exc
        return store

    async def _prepare(self, create: bool) -> None:
        conn = self._conn
        if create:
            # Look before switching to WAL, so that a foreign database is left untouched.
            tables = await self._tables()
            if tables and "events" not in tables:
                await conn.close()
                raise NotAnEventLog(f"{self.path}: an SQLite file, but not a DGXMM event log")
            await conn.execute("PRAGMA journal_mode=WAL")
            if self._scratch:
                await conn.execute("PRAGMA locking_mode=EXCLUSIVE")
                await conn.execute("PRAGMA synchronous=OFF")
            else:
                await conn.execute("PRAGMA synchronous=FULL")
            await conn.executescript(SCHEMA)
            await conn.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('application', ?)",
                (APPLICATION,),
            )
            await conn.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
        await self._check_is_ours()
        async with conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events") as cur:
            row = await cur.fetchone()
        self._last_seq = int(row[0]) if row else 0
        if self._readonly:
            self._readmodel_seq = await readmodels.applied_seq(conn)
        elif not self._scratch:
            self._readmodel_seq = await readmodels.prepare(conn)
            self._projector = await readmodels.load_projector(conn)
            await self._catch_up_readmodels()
        if not self._readonly:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    async def _catch_up_readmodels(self) -> None:
        """Project what the read models miss (new tables, or a log written by older code)."""
        assert self._readmodel_seq is not None
        if self._readmodel_seq >= self._last_seq:
            return
        log.info("readmodels_catching_up", since_seq=self._readmodel_seq, last_seq=self._last_seq)
        wanted = readmodels.PROJECTED_TYPES
        while self._readmodel_seq < self._last_seq:
            chunk = await self.read(
                since_seq=self._readmodel_seq, limit=readmodels.REBUILD_SLICE, types=wanted
            )
            # A slice ends at the last event it looked at, even if it yielded no rows.
            end = chunk[-1].seq if len(chunk) == readmodels.REBUILD_SLICE else self._last_seq
            await self._commit([], chunk, end)

    async def _tables(self) -> set[str]:
        async with self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'") as cur:
            return {str(r[0]) for r in await cur.fetchall()}

    async def _check_is_ours(self) -> None:
        tables = await self._tables()
        if not {"meta", "events"} <= tables:
            await self._conn.close()
            raise NotAnEventLog(f"{self.path}: an SQLite file, but not a DGXMM event log")
        async with self._conn.execute("SELECT value FROM meta WHERE key='application'") as cur:
            row = await cur.fetchone()
        if row is None or row[0] != APPLICATION:
            await self._conn.close()
            raise NotAnEventLog(f"{self.path}: an SQLite file, but not a DGXMM event log")

    # --- writing ------------------------------------------------------------------------

    async def append(
        self,
        stream: str,
        events: Sequence[m.AnyEvent],
        *,
        actor: str,
        expected_version: int | None = None,
    ) -> list[m.Recorded]:
        """Append `events` to `stream`; returns them recorded once they are durable."""
        if self._closed or self._writer is None:
            raise StoreClosed(f"{self.path}: the event log is closed")
        if not events:
            return []
        fut: asyncio.Future[list[m.Recorded]] = asyncio.get_running_loop().create_future()
        item = _Append(stream, events, actor, expected_version, fut)
        try:
            self._inbox.put_nowait(item)  # the common case, without a coroutine round trip
        except asyncio.QueueFull:
            await self._inbox.put(item)  # backpressure: wait for the writer
        return await fut

    def add_listener(self, listener: Callable[[list[m.Recorded]], None]) -> None:
        """Call `listener` with every batch of records right after it is durable."""
        self._listeners.append(listener)

    async def _stream_version(self, stream: str) -> int:
        version = self._versions.get(stream)
        if version is None:
            await self._write_behind()
            async with self._conn.execute(
                "SELECT COALESCE(MAX(version), 0) FROM events WHERE stream = ?", (stream,)
            ) as cur:
                row = await cur.fetchone()
            version = int(row[0]) if row else 0
            self._versions[stream] = version
        return version

    async def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            first = await self._inbox.get()
            if first is None:
                return
            if isinstance(first, _Snapshot):
                await self._write_snapshot(first)
                continue
            batch = [first]
            snapshot: _Snapshot | None = None
            while len(batch) < MAX_BATCH:
                try:
                    item = self._inbox.get_nowait()
                except asyncio.QueueEmpty:
                    break
                if item is None:
                    stopping = True
                    break
                if isinstance(item, _Snapshot):
                    snapshot = item  # written after the appends queued before it
                    break
                batch.append(item)
            self._writing = True
            try:
                await self._write_batch(batch)
            except Exception as exc:  # policy: fail this batch's callers, keep the writer alive
                await self._forget_caches()
                err = exc if isinstance(exc, StorageError) else _map_error(exc, self.path)
                log.error("append_failed", error=str(err))
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(err)
            finally:
                self._writing = False
            if snapshot is not None:
                await self._write_snapshot(snapshot)

    async def _write_batch(self, batch: list[_Append]) -> None:
        ts = self._wall()
        accepted: list[_Append] = []
        seq_before = self._last_seq
        for item in batch:
            cached = self._versions.get(item.stream)
            current = await self._stream_version(item.stream) if cached is None else cached
            if not self._expected(item, current):
                continue
            self._versions[item.stream] = self._stage(item, current, ts)
            accepted.append(item)
        if not accepted:
            return
        rows = [row for item in accepted for row in item.rows]
        try:
            await self._insert(rows, [rec for item in accepted for rec in item.records()])
        except sqlite3.IntegrityError:
            # Someone else wrote to this file: forget the caches and retry one by one.
            self._versions = {}
            self._last_seq = seq_before
            await self._reload_seq()
            for item in accepted:
                item.rows.clear()
                await self._write_single(item, ts)
            return
        self._publish(accepted)

    async def _forget_caches(self) -> None:
        # A failed transaction wrote nothing, but the cached numbers moved on: the file is the
        # truth again, or the next appends would leave gaps in seq and versions.
        self._versions = {}
        try:
            await self._reload_seq()
        except sqlite3.Error:
            log.exception("seq_reload_failed")

    async def _reload_seq(self) -> None:
        await self._write_behind()
        async with self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events") as cur:
            row = await cur.fetchone()
        self._last_seq = int(row[0]) if row else 0

    @staticmethod
    def _expected(item: _Append, current: int) -> bool:
        """Whether the append's expected version holds; fails its future when not."""
        if item.expected_version is None or item.expected_version == current:
            return True
        if not item.future.done():  # the appender may have been cancelled
            item.future.set_exception(ConcurrencyError(item.stream, item.expected_version, current))
        return False

    def _stage(self, item: _Append, version: int, ts: float) -> int:
        """Number the append's rows after `version`; returns the stream's new version."""
        for event in item.events:
            version += 1
            self._last_seq += 1
            item.rows.append(
                (
                    self._last_seq,
                    ts,
                    item.stream,
                    version,
                    type(event).__name__,
                    item.actor,
                    m.encode_event(event),
                )
            )
        return version

    async def _write_single(self, item: _Append, ts: float) -> None:
        current = await self._stream_version(item.stream)
        if not self._expected(item, current):
            return
        current = self._stage(item, current, ts)
        try:
            await self._insert(item.rows, item.records())
        except sqlite3.IntegrityError:
            self._versions.pop(item.stream, None)
            await self._reload_seq()
            actual = await self._stream_version(item.stream)
            if not item.future.done():
                item.future.set_exception(
                    ConcurrencyError(item.stream, item.expected_version or actual, actual)
                )
            return
        self._versions[item.stream] = current
        self._publish([item])

    async def _insert(
        self, rows: list[tuple[int, float, str, int, str, str, bytes]], recs: list[m.Recorded]
    ) -> None:
        await self._commit(rows, recs, recs[-1].seq)
        self._stats["transactions"] += 1

    async def _commit(
        self,
        rows: list[tuple[int, float, str, int, str, str, bytes]],
        recs: list[m.Recorded],
        seq: int,
    ) -> None:
        """Event rows and the read-model rows of `recs` in one transaction: both or neither."""
        if self._scratch:
            # Its rows reach the file when it is read (`_write_behind`), or a few thousand at
            # a time: nobody else reads it, and a transaction per append was a fifth of a
            # what-if's time.
            self._behind.extend(rows)
            if len(self._behind) >= SCRATCH_BEHIND:
                await self._write_behind()
            return
        conn = self._conn
        saved = self._projector.copy()
        audit, timeline = readmodels.sql_rows(self._projector, recs)
        await conn.execute("BEGIN IMMEDIATE")
        try:
            if rows:
                await conn.executemany(_INSERT_EVENTS, rows)
            await readmodels.write_rows(conn, audit, timeline, seq)
            await conn.execute("COMMIT")
        except BaseException:
            self._projector = saved
            with contextlib.suppress(sqlite3.Error):
                await conn.execute("ROLLBACK")
            raise
        self._readmodel_seq = seq

    async def _write_behind(self) -> None:
        """A scratch log's rows not in the file yet, written in one transaction (before any
        read of the file)."""
        if not self._behind:
            return
        rows, self._behind = self._behind, []
        await _in_transaction(self._conn, _INSERT_EVENTS, rows)

    def _publish(self, items: list[_Append]) -> None:
        published: list[m.Recorded] = []
        for item in items:
            recs = item.records()
            self._stats["appends"] += 1
            self._stats["events"] += len(recs)
            published.extend(recs)
            if not item.future.done():
                item.future.set_result(recs)
        for listener in self._listeners:
            try:
                listener(published)
            except Exception:  # policy: a broken listener must not break the log
                log.exception("listener_failed")
        woken, self._appended = self._appended, asyncio.Event()
        woken.set()

    # --- reading ------------------------------------------------------------------------

    async def read(
        self,
        *,
        since_seq: int = 0,
        stream: str | None = None,
        until_ts: float | None = None,
        limit: int | None = None,
        types: Collection[str] | None = None,
        until_seq: int | None = None,
    ) -> list[m.Recorded]:
        """Records with seq > since_seq (of one stream, of some types, up to a time or a seq),
        in order."""
        return [
            rec
            async for rec in self.iterate(
                since_seq=since_seq,
                stream=stream,
                until_ts=until_ts,
                limit=limit,
                types=types,
                until_seq=until_seq,
            )
        ]

    async def iterate(
        self,
        *,
        since_seq: int = 0,
        stream: str | None = None,
        until_ts: float | None = None,
        limit: int | None = None,
        types: Collection[str] | None = None,
        request_id: str | None = None,
        queue_of: str | None = None,
        descending: bool = False,
        until_seq: int | None = None,
    ) -> AsyncIterator[m.Recorded]:
        """Like `read`, streaming in chunks (for replaying large logs).

        `request_id`: only the events naming that request; `queue_of`: only the queue events
        of that deployment (both through indexes); `descending`: newest first.
        """
        sql = f"SELECT {_ROW_COLUMNS} FROM events WHERE seq > ?"
        params: list[object] = [since_seq]
        if stream is not None:
            sql += " AND stream = ?"
            params.append(stream)
        if types is not None:
            # Filtered in SQLite, before any row is decoded: the audit trail skips the bulk
            # of a busy log (the queue's events) this way.
            names = sorted(types)
            sql += f" AND type IN ({', '.join('?' * len(names))})"
            params.extend(names)
        if until_ts is not None:
            sql += " AND ts <= ?"
            params.append(until_ts)
        if until_seq is not None:
            sql += " AND seq <= ?"
            params.append(until_seq)
        for extra, value in (
            (readmodels.request_query, request_id),
            (readmodels.queue_of_query, queue_of),
        ):
            if value is not None:
                clause, more = extra(value)
                sql += clause
                params.extend(more)
        sql += " ORDER BY seq DESC" if descending else " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        try:
            await self._write_behind()
            async with self._conn.execute(sql, params) as cur:
                cur.arraysize = 5000
                while True:
                    rows = await cur.fetchmany(5000)
                    if not rows:
                        break
                    for row in rows:
                        try:
                            rec = record_from_row(row)  # type: ignore[arg-type]
                        except msgspec.DecodeError as exc:
                            raise LogCorrupt(
                                f"{self.path}: event {row[0]} cannot be decoded ({exc})"
                            ) from exc
                        yield rec
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc

    async def read_data(
        self, *, since_seq: int, until_seq: int, types: Collection[str]
    ) -> list[tuple[float, bytes]]:
        """The (ts, data) of the records in (since_seq, until_seq] of some types, in order,
        undecoded: for a reader that needs no more of each (the timeline reads the queue's
        bulk so, without a `Recorded` per request)."""
        names = sorted(types)
        sql = (
            f"SELECT ts, data FROM events WHERE seq > ? AND seq <= ?"
            f" AND type IN ({', '.join('?' * len(names))}) ORDER BY seq"
        )
        rows: list[tuple[float, bytes]] = []
        try:
            await self._write_behind()
            async with self._conn.execute(sql, [since_seq, until_seq, *names]) as cur:
                # In chunks, like `iterate`: the writer's appends get SQLite's one thread
                # between two of them.
                while chunk := await cur.fetchmany(5000):
                    rows.extend(chunk)  # type: ignore[arg-type]
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc
        return rows

    async def last_seq(self) -> int:
        """The newest sequence number on disk."""
        try:
            await self._write_behind()
            async with self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events") as cur:
                row = await cur.fetchone()
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc
        return int(row[0]) if row else 0

    async def seq_at(self, ts: float) -> int:
        """The newest seq recorded at or before `ts` (0: none), through the `events_ts` index."""
        try:
            await self._write_behind()
            async with self._conn.execute(
                "SELECT seq FROM events WHERE ts <= ? ORDER BY ts DESC, seq DESC LIMIT 1", (ts,)
            ) as cur:
                row = await cur.fetchone()
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc
        return int(row[0]) if row else 0

    async def version(self, stream: str) -> int:
        """The stream's current version (0 for a stream with no events)."""
        return await self._stream_version(stream)

    async def follow(self, *, since_seq: int = 0, poll_s: float = 0.5) -> AsyncIterator[m.Recorded]:
        """Every record after `since_seq`, then new ones as they are appended (forever).

        In the writing process new records wake the follower at once; a reader in another
        process polls the file every `poll_s` seconds.
        """
        last = since_seq
        while True:
            # Taken before reading: an append published during the read still wakes us.
            appended = self._appended
            batch = await self.read(since_seq=last, limit=5000)
            for rec in batch:
                last = rec.seq
                yield rec
            if batch:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(appended.wait(), poll_s)

    # --- snapshots ----------------------------------------------------------------------

    @property
    def readonly(self) -> bool:
        """Opened read-only (replay, what-if): no appends, no snapshots."""
        return self._readonly

    async def save_snapshot(self, state: SystemState) -> None:
        """Store the folded state as of `state.last_seq` (through the writer, between appends)."""
        if self._readonly:
            raise StorageError(f"{self.path}: opened read-only")
        if self._closed or self._writer is None:
            raise StoreClosed(f"{self.path}: the event log is closed")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._inbox.put(_Snapshot(state, fut))
        await fut

    async def _write_snapshot(self, item: _Snapshot) -> None:
        state = item.state
        try:
            await self._conn.execute(
                "INSERT OR REPLACE INTO snapshots (seq, ts, state) VALUES (?, ?, ?)",
                (state.last_seq, state.last_ts, encode_snapshot(state)),
            )
        except Exception as exc:  # policy: the snapshot is lost, the log is not
            err = exc if isinstance(exc, StorageError) else _map_error(exc, self.path)
            if not item.future.done():
                item.future.set_exception(err)
            return
        if not item.future.done():
            item.future.set_result(None)

    async def foreign_snapshots(self) -> int:
        """How many snapshots are of another format (another schema of the state): passed
        over by `latest_snapshot`."""
        sql = "SELECT COUNT(*) FROM snapshots WHERE substr(state, 1, ?) != ?"
        try:
            await self._write_behind()
            async with self._conn.execute(sql, (len(SNAPSHOT_PREFIX), SNAPSHOT_PREFIX)) as cur:
                row = await cur.fetchone()
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc
        return int(row[0]) if row else 0

    async def latest_snapshot(self, *, until_ts: float | None = None) -> SystemState | None:
        """The newest usable snapshot (taken at or before `until_ts`), or None.

        A snapshot that does not decode (written by code with another state schema, or
        damaged) is skipped with a warning: snapshots are derived data, the log is the truth.
        """
        # Only this code's format: a snapshot of another (an older schema) is passed over,
        # so that an older one of this format before it still serves.
        sql = "SELECT seq, state FROM snapshots WHERE seq <= ? AND substr(state, 1, ?) = ?"
        params: list[object] = [self._last_seq, len(SNAPSHOT_PREFIX), SNAPSHOT_PREFIX]
        if until_ts is not None:
            sql += " AND ts <= ?"
            params.append(until_ts)
        sql += " ORDER BY seq DESC LIMIT 1"
        try:
            await self._write_behind()
            async with self._conn.execute(sql, params) as cur:
                row = await cur.fetchone()
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc
        if row is None:
            return None
        state = decode_snapshot(row[1])
        if state is None or state.last_seq != row[0]:
            log.warning("snapshot_ignored", path=self.path, seq=row[0], reason="does not decode")
            return None
        return state

    # --- read models --------------------------------------------------------------------

    def readmodels_current(self) -> bool:
        """Whether the audit and Events-tab tables cover the whole log."""
        return self._readmodel_seq is not None and self._readmodel_seq >= self._last_seq

    async def audit_page(
        self, *, before: int | None, limit: int, where: AuditFilter = ANY_AUDIT
    ) -> list[AuditRow]:
        """A page of the audit trail, newest first (an indexed query: O(page))."""
        try:
            return await readmodels.audit_page(self._conn, before=before, limit=limit, where=where)
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc

    async def iterate_audit(self, where: AuditFilter = ANY_AUDIT) -> AsyncIterator[AuditRow]:
        """The audit trail oldest first, streamed from its table."""
        try:
            async for row in readmodels.iterate_audit(self._conn, where):
                yield row
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc

    async def timeline_page(
        self, deployment_id: str, *, before: int | None, limit: int, made_room: bool = False
    ) -> list[EventRow]:
        """A page of one deployment's Events tab, newest first (O(page))."""
        try:
            return await readmodels.timeline_page(
                self._conn, deployment_id, before=before, limit=limit, made_room=made_room
            )
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc

    # --- lifecycle ----------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether appends are queued or being written (simulations wait for quiet)."""
        return self._writing or not self._inbox.empty()

    def statistics(self) -> dict[str, int]:
        """Counters: appends, events, transactions, pending appends."""
        return {**self._stats, "pending": self._inbox.qsize(), "last_seq": self._last_seq}

    async def close(self) -> None:
        """Finish the appends already queued, then close the file."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None and not self._writer.done():
            await self._inbox.put(None)
            await self._writer
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if item is not None and not item.future.done():
                item.future.set_exception(StoreClosed(f"{self.path}: closed"))
        with contextlib.suppress(sqlite3.Error):
            await self._write_behind()
        with contextlib.suppress(sqlite3.Error):
            await self._conn.close()


async def _in_transaction(
    conn: aiosqlite.Connection,
    sql: str,
    rows: Sequence[Iterable[object]],
    then: str | None = None,
    then_params: tuple[object, ...] = (),
) -> None:
    """`sql` for each of `rows` (then `then`) in one transaction, rolled back on failure."""
    await conn.execute("BEGIN IMMEDIATE")
    try:
        await conn.executemany(sql, rows)
        if then is not None:
            await conn.execute(then, then_params)
        await conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            await conn.execute("ROLLBACK")
        raise
