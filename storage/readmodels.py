"""Read models kept next to the log: the audit trail, the Events tab, request and queue indexes.

The audit trail and each deployment's Events tab are tables written by the store's writer in
the same transaction as the events they come from (`events.projections.Projector` computes
the rows), together with the last sequence number applied.  So they can never be ahead of or
behind the log they were committed with, a SIGKILL loses nothing, and a page of either is an
indexed query that costs O(page), not O(log).  They are derived data: when the tables are
missing, or were written by older code (`READMODEL_VERSION`), opening the log for writing
rebuilds them from the log, in committed slices, so an interrupted rebuild resumes.

Requests and a deployment's queue events are found through expression indexes on the events
table itself (no second copy of the data).
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import aiosqlite
import msgspec

from events import model as m
from events.projections import AuditRow, EventRow, Projector

# Bump when the projection changes meaning (new action, new title): the tables are rebuilt.
READMODEL_VERSION = 2
REBUILD_SLICE = 5_000
QUEUE_TYPES = ("RequestQueued", "RequestAdmitted", "RequestLeftQueue")
REQUEST_TYPES = (*QUEUE_TYPES, "StartRequested")
_QUEUE_IN = ", ".join(f"'{t}'" for t in QUEUE_TYPES)
_REQUEST_IN = ", ".join(f"'{t}'" for t in REQUEST_TYPES)
# The events that can yield a read-model row: all but the queue's bulk.
PROJECTED_SKIP = ("RequestQueued", "RequestAdmitted")
PROJECTED_TYPES = tuple(
    t.__name__ for t in get_args(m.AnyEvent) if t.__name__ not in PROJECTED_SKIP
)

# The data column holds JSON as a BLOB; SQLite's JSON functions want TEXT.
REQUEST_KEY = "json_extract(CAST(data AS TEXT), '$.request_id')"
DEPLOYMENT_KEY = "json_extract(CAST(data AS TEXT), '$.deployment_id')"

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    details BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_target ON audit (target, seq);
CREATE INDEX IF NOT EXISTS audit_action ON audit (action, seq);
CREATE INDEX IF NOT EXISTS audit_actor ON audit (actor, seq);
CREATE TABLE IF NOT EXISTS timeline (
    deployment_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    ts REAL NOT NULL,
    actor TEXT NOT NULL,
    title TEXT NOT NULL,
    type TEXT NOT NULL,
    made_room INTEGER NOT NULL,
    PRIMARY KEY (deployment_id, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_request ON events ({REQUEST_KEY})
    WHERE type IN ({_REQUEST_IN});
CREATE INDEX IF NOT EXISTS events_queue_deployment ON events ({DEPLOYMENT_KEY}, seq)
    WHERE type IN ({_QUEUE_IN});
"""
SCHEMA = [stmt.strip() for stmt in _SCHEMA.split(";") if stmt.strip()]

_details_encoder = msgspec.json.Encoder()
_details_decoder = msgspec.json.Decoder(dict[str, Any])

AuditSql = tuple[int, float, str, str, str, bytes]
TimelineSql = tuple[str, int, float, str, str, str, int]


def sql_rows(
    projector: Projector, records: Iterable[m.Recorded]
) -> tuple[list[AuditSql], list[TimelineSql]]:
    """The read-model rows of `records` (advances `projector`)."""
    audit: list[AuditSql] = []
    timeline: list[TimelineSql] = []
    for rec in records:
        row, tabs = projector.apply(rec)
        if row is not None:
            audit.append(
                (
                    row.seq,
                    row.ts,
                    row.actor,
                    row.action,
                    row.target,
                    _details_encoder.encode(row.details),
                )
            )
        for tab in tabs:
            r = tab.row
            timeline.append(
                (tab.deployment_id, r.seq, r.ts, r.actor, r.title, r.type, int(tab.made_room))
            )
    return audit, timeline


async def write_rows(
    conn: aiosqlite.Connection, audit: list[AuditSql], timeline: list[TimelineSql], seq: int
) -> None:
    """Insert read-model rows and record `seq` as applied (inside the caller's transaction)."""
    if audit:
        await conn.executemany("INSERT OR REPLACE INTO audit VALUES (?, ?, ?, ?, ?, ?)", audit)
    if timeline:
        await conn.executemany(
            "INSERT OR REPLACE INTO timeline VALUES (?, ?, ?, ?, ?, ?, ?)", timeline
        )
    await conn.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES ('readmodel_seq', ?)", (str(seq),)
    )


async def _meta(conn: aiosqlite.Connection, key: str) -> str | None:
    async with conn.execute("SELECT value FROM meta WHERE key = ?", (key,)) as cur:
        row = await cur.fetchone()
    return None if row is None else str(row[0])


async def applied_seq(conn: aiosqlite.Connection) -> int | None:
    """The last seq the read models hold, or None when they are absent or from other code."""
    try:
        version = await _meta(conn, "readmodel_version")
        seq = await _meta(conn, "readmodel_seq")
    except sqlite3.Error:
        return None
    if version != str(READMODEL_VERSION) or seq is None:
        return None
    return int(seq)


async def load_projector(conn: aiosqlite.Connection) -> Projector:
    """The projector's memory (names, last audited timeouts), read back from the tables."""
    names: dict[str, str] = {}
    async with conn.execute(
        "SELECT target, details FROM audit WHERE action = 'deployment_create' ORDER BY seq"
    ) as cur:
        async for target, details in cur:
            names[str(target).partition(":")[2]] = str(_details_decoder.decode(details)["name"])
    last: dict[str, float] = {}
    async with conn.execute(
        "SELECT target, MAX(ts) FROM audit WHERE action = 'ondemand_queue_timeout' GROUP BY target"
    ) as cur:
        async for target, ts in cur:
            last[str(target).partition(":")[2]] = float(ts)
    return Projector(names, last)


async def prepare(conn: aiosqlite.Connection) -> int:
    """Create the tables; start over when they were written by other code. Returns their seq."""
    seq = await applied_seq(conn)
    if seq is None:
        await conn.execute("BEGIN IMMEDIATE")
        try:
            await conn.execute("DROP TABLE IF EXISTS audit")
            await conn.execute("DROP TABLE IF EXISTS timeline")
            for stmt in SCHEMA:
                await conn.execute(stmt)
            await conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('readmodel_version', ?)",
                (str(READMODEL_VERSION),),
            )
            await conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('readmodel_seq', '0')"
            )
            await conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                await conn.execute("ROLLBACK")
            raise
        seq = 0
    return seq


# --- queries (each costs O(rows returned)) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """Which audit rows a query wants (None: any)."""

    since_ts: float | None = None
    until_ts: float | None = None
    actor: str | None = None
    action: str | None = None
    target: str | None = None


ANY_AUDIT = AuditFilter()


def _audit_where(where: AuditFilter) -> tuple[str, list[object]]:
    """The conditions of `where` as SQL to append after a WHERE clause, and their values."""
    sql = ""
    params: list[object] = []
    for column, value in (
        ("actor", where.actor),
        ("action", where.action),
        ("target", where.target),
    ):
        if value is not None:
            sql += f" AND {column} = ?"
            params.append(value)
    if where.since_ts is not None:
        sql += " AND ts >= ?"
        params.append(where.since_ts)
    if where.until_ts is not None:
        sql += " AND ts <= ?"
        params.append(where.until_ts)
    return sql, params


async def audit_page(
    conn: aiosqlite.Connection, *, before: int | None, limit: int, where: AuditFilter = ANY_AUDIT
) -> list[AuditRow]:
    """Audit rows, newest first, older than `before`, at most `limit`."""
    conditions, params = _audit_where(where)
    sql = (
        "SELECT seq, ts, actor, action, target, details FROM audit WHERE seq < ?"
        + conditions
        + " ORDER BY seq DESC LIMIT ?"
    )
    before_seq = before if before is not None else 2**63 - 1
    async with conn.execute(sql, [before_seq, *params, limit]) as cur:
        rows = await cur.fetchall()
    return [_audit_row(row) for row in rows]


def _audit_row(row: Any) -> AuditRow:
    seq, ts, actor, action, target, details = row
    return AuditRow(
        seq=seq,
        ts=ts,
        actor=actor,
        action=action,
        target=target,
        details=_details_decoder.decode(details),
    )


async def iterate_audit(
    conn: aiosqlite.Connection, where: AuditFilter = ANY_AUDIT
) -> AsyncIterator[AuditRow]:
    """Audit rows oldest first, streamed."""
    conditions, params = _audit_where(where)
    sql = "SELECT seq, ts, actor, action, target, details FROM audit WHERE 1" + conditions
    async with conn.execute(sql + " ORDER BY seq", params) as cur:
        while rows := await cur.fetchmany(2000):
            for row in rows:
                yield _audit_row(row)


async def timeline_page(
    conn: aiosqlite.Connection,
    deployment_id: str,
    *,
    before: int | None,
    limit: int,
    made_room: bool = False,
) -> list[EventRow]:
    """A deployment's Events-tab rows, newest first, older than `before`, at most `limit`.

    With `made_room`, the rows of models put to sleep to make room for it too.
    """
    only_own = "" if made_room else " AND made_room = 0"
    async with conn.execute(
        "SELECT seq, ts, actor, title, type FROM timeline"
        f" WHERE deployment_id = ? AND seq < ?{only_own} ORDER BY seq DESC LIMIT ?",
        (deployment_id, before if before is not None else 2**63 - 1, limit),
    ) as cur:
        rows = await cur.fetchall()
    return [
        EventRow(seq=seq, ts=ts, actor=actor, title=title, type=type_)
        for seq, ts, actor, title, type_ in rows
    ]


def request_query(request_id: str) -> tuple[str, Sequence[object]]:
    """SQL for every event naming one request (served by the `events_request` index)."""
    return (
        f" AND type IN ({_REQUEST_IN}) AND {REQUEST_KEY} = ?",
        (request_id,),
    )


def queue_of_query(deployment_id: str) -> tuple[str, Sequence[object]]:
    """SQL for one deployment's queue events (served by `events_queue_deployment`)."""
    return (f" AND type IN ({_QUEUE_IN}) AND {DEPLOYMENT_KEY} = ?", (deployment_id,))
