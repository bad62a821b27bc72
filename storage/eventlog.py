"""The append-only event log: one SQLite file (WAL), group commit, optimistic concurrency.

One writer task owns all writes.  Appends that arrive together share one transaction and
one fsync (`synchronous=FULL`); each caller's future resolves only after that commit, so an
acknowledged append is on disk.  Stream versions and the sequence counter are cached by the
writer, so conflicts are found before any SQL runs; the UNIQUE(stream, version) constraint
still guards against a second writer, and a batch that trips it is retried append by
append so one bad append never fails its neighbours.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field

import aiosqlite
import msgspec
import structlog

from events import model as m
from events.state import SystemState
from storage.errors import (
    ConcurrencyError,
    LogCorrupt,
    LogLocked,
    LogNotFound,
    NotAnEventLog,
    StorageError,
    StoreClosed,
)

log = structlog.get_logger("dgxmm.storage")

APPLICATION = "dgxmm"
SCHEMA_VERSION = 1
MAX_PENDING_APPENDS = 10_000  # the writer's inbox; appenders wait (backpressure) beyond it
MAX_BATCH = 2_000  # appends per transaction

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


class EventStore:
    """The event log of one DGXMM instance."""

    def __init__(
        self, conn: aiosqlite.Connection, path: str, wall: Callable[[], float], readonly: bool
    ) -> None:
        self._conn = conn
        self.path = path
        self._wall = wall
        self._readonly = readonly
        self._inbox: asyncio.Queue[_Append | None] = asyncio.Queue(MAX_PENDING_APPENDS)
        self._versions: dict[str, int] = {}
        self._last_seq = 0
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        self._appended = asyncio.Event()
        self._listeners: list[Callable[[list[m.Recorded]], None]] = []
        self._stats = {"appends": 0, "events": 0, "transactions": 0}
        self._writing = False

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        readonly: bool = False,
        wall: Callable[[], float] = time.time,
    ) -> EventStore:
        """Open (and with `create`, make) the log at `path`; raises StorageError subclasses."""
        path = os.fspath(path)
        if not create and not await asyncio.to_thread(os.path.exists, path):
            raise LogNotFound(f"{path}: no such file")
        conn: aiosqlite.Connection | None = None
        try:
            if readonly:
                uri = f"file:{urllib.parse.quote(path)}?mode=ro"
                conn = await aiosqlite.connect(uri, uri=True, timeout=2.0)
            else:
                conn = await aiosqlite.connect(path, timeout=5.0, isolation_level=None)
            store = cls(conn, path, wall, readonly)
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
        if not self._readonly:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())

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
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    item = self._inbox.get_nowait()
                except asyncio.QueueEmpty:
                    break
                if item is None:
                    stopping = True
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
            await self._insert(rows)
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
            await self._insert(item.rows)
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

    async def _insert(self, rows: list[tuple[int, float, str, int, str, str, bytes]]) -> None:
        conn = self._conn
        await conn.execute("BEGIN IMMEDIATE")
        try:
            await conn.executemany(
                "INSERT INTO events (seq, ts, stream, version, type, actor, data)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            await conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                await conn.execute("ROLLBACK")
            raise
        self._stats["transactions"] += 1

    def _publish(self, items: list[_Append]) -> None:
        published: list[m.Recorded] = []
        for item in items:
            recs = [
                m.Recorded(seq=seq, ts=ts, stream=stream, version=version, actor=actor, event=event)
                for (seq, ts, stream, version, _t, actor, _d), event in zip(
                    item.rows, item.events, strict=True
                )
            ]
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
    ) -> list[m.Recorded]:
        """Records with seq > since_seq (of one stream, of some types, up to a time), in order."""
        return [
            rec
            async for rec in self.iterate(
                since_seq=since_seq, stream=stream, until_ts=until_ts, limit=limit, types=types
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
    ) -> AsyncIterator[m.Recorded]:
        """Like `read`, streaming in chunks (for replaying large logs)."""
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
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        try:
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

    async def last_seq(self) -> int:
        """The newest sequence number on disk."""
        try:
            async with self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events") as cur:
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

    async def save_snapshot(self, state: SystemState) -> None:
        """Store the folded state as of `state.last_seq`."""
        if self._readonly:
            raise StorageError(f"{self.path}: opened read-only")
        try:
            await self._conn.execute(
                "INSERT OR REPLACE INTO snapshots (seq, ts, state) VALUES (?, ?, ?)",
                (state.last_seq, state.last_ts, _state_encoder.encode(state)),
            )
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc

    async def latest_snapshot(self, *, until_ts: float | None = None) -> SystemState | None:
        """The newest snapshot (taken at or before `until_ts`), or None."""
        sql = "SELECT state FROM snapshots"
        params: list[object] = []
        if until_ts is not None:
            sql += " WHERE ts <= ?"
            params.append(until_ts)
        sql += " ORDER BY seq DESC LIMIT 1"
        try:
            async with self._conn.execute(sql, params) as cur:
                row = await cur.fetchone()
        except sqlite3.Error as exc:
            raise _map_error(exc, self.path) from exc
        return None if row is None else _state_decoder.decode(row[0])

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
            await self._conn.close()
