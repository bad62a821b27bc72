"""The archive (`dgxmm archive`): old queue events and traffic-trace batches moved out of the log.

The queue's events are the bulk of a busy log and matter for incident replay of their time
only.  What moves: `RequestQueued`, `RequestAdmitted` and `RequestLeftQueue` other than
timeouts, and the traffic trace's batches (`TrafficRecorded`), older than a moment.  What
stays: everything else, queue timeouts included, so the
audit trail, the Events tab and the deployments' states are the same as before; the
newest event of each of those streams, so sequence numbers and the streams' versions keep
counting up; and of the trace's batches, the newest that names each deployment's last use
(`last_used_at`), so that the log folded alone, without a snapshot, still knows when each
deployment was last used.

The archive is a DGXMM event log itself (same schema, original seq, time, stream and
version), so `dgxmm replay --db ARCHIVE` and `dgxmm events --db ARCHIVE` read it.  Both files
stay append-only in the sense that matters: the archive only ever gains rows, and the log
never gets a row back.  Each slice is committed in the archive before it is deleted from
the log, and copying is idempotent, so an interrupted archive loses nothing: run it again.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Sequence

import aiosqlite

from storage.errors import StorageError
from storage.eventlog import EventStore, _in_transaction, _map_error

SLICE = 10_000
_MOVABLE = (
    "(type IN ('RequestQueued', 'RequestAdmitted') OR (type = 'RequestLeftQueue'"
    " AND json_extract(CAST(data AS TEXT), '$.reason') != 'timeout'))"
)
# Per stream: which of its events move, always but its newest (its version keeps counting).
_STREAMS = (("queue", _MOVABLE), ("traffic", "type = 'TrafficRecorded'"))


# Per deployment, the newest trace batch that says when it was last used.
_LAST_USES = (
    "SELECT MAX(e.seq) FROM events AS e, json_each(CAST(e.data AS TEXT), '$.last_used_at') AS u"
    " WHERE e.stream = 'traffic' AND e.type = 'TrafficRecorded' GROUP BY u.key"
)


def _movable_sql(keep: Sequence[int] = ()) -> str:
    kept = f" AND seq NOT IN ({', '.join(str(int(seq)) for seq in keep)})" if keep else ""
    return " OR ".join(
        f"(stream = '{stream}' AND {movable} AND seq <"
        f" (SELECT MAX(seq) FROM events WHERE stream = '{stream}'){kept})"
        for stream, movable in _STREAMS
    )


async def archive_queue_events(
    path: str | os.PathLike[str], archive_path: str | os.PathLike[str], before: float
) -> int:
    """Move the queue events older than `before` from `path` to `archive_path`; how many."""
    path, archive_path = os.fspath(path), os.fspath(archive_path)
    real = await asyncio.to_thread(lambda: {os.path.realpath(path), os.path.realpath(archive_path)})
    if len(real) == 1:
        raise StorageError(f"{path}: the archive must be another file")
    # Both opened as event logs first: checks the log is ours, creates the archive's schema.
    for name, create in ((path, False), (archive_path, True)):
        await (await EventStore.open(name, create=create)).close()
    moved = 0
    try:
        async with (
            aiosqlite.connect(path, timeout=5.0, isolation_level=None) as log,
            aiosqlite.connect(archive_path, timeout=5.0, isolation_level=None) as archive,
        ):
            for conn in (log, archive):
                await conn.execute("PRAGMA synchronous=FULL")
            # Once: a batch written meanwhile is newer, and moves in a later archive if at all.
            async with log.execute(_LAST_USES) as cur:
                movable = _movable_sql([row[0] for row in await cur.fetchall()])
            while True:
                async with log.execute(
                    "SELECT seq, ts, stream, version, type, actor, data FROM events WHERE ts < ?"
                    f" AND ({movable}) ORDER BY seq LIMIT ?",
                    (before, SLICE),
                ) as cur:
                    rows = list(await cur.fetchall())
                if not rows:
                    return moved
                async with archive.execute("SELECT COALESCE(MAX(seq), 0) FROM events") as cur:
                    had = await cur.fetchone()
                await _in_transaction(
                    archive,
                    "INSERT OR IGNORE INTO events (seq, ts, stream, version, type, actor, data)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                    # These events yield no read-model rows: the archive's read models stay
                    # current (when they were), and opening it has nothing to catch up.
                    "UPDATE meta SET value = (SELECT MAX(seq) FROM events)"
                    " WHERE key = 'readmodel_seq' AND CAST(value AS INTEGER) >= ?",
                    (had[0] if had else 0,),
                )
                await _in_transaction(
                    log, "DELETE FROM events WHERE seq = ?", [(row[0],) for row in rows]
                )
                moved += len(rows)
    except sqlite3.Error as exc:
        raise _map_error(exc, path) from exc
