"""A window of the log for the timeline: the state at its start and its records, not the log.

`timeline_window(store, since, until, usable_bytes)` finds the state at `since` from the
newest snapshot taken at or before it plus the deployment and queue events after that
snapshot (at most the snapshot spacing, 10,000 events, when DGXMM serves), then reads only
the window's deployment and queue events (a range of sequence numbers found through the
`events_ts` index, filtered by type in SQLite before anything is decoded) and hands both to
the pure projection `events.timeline.project`.  Its cost follows the window, not the log.

The queue's events, two thirds of a busy day, are read apart from the deployments' as
(ts, data) and handed over as (ts, event): the projection reads nothing else of them, so
no `Recorded` is built per request.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from events import model as m
from events.state import EMPTY
from events.timeline import DEPLOYMENT_TYPES, QUEUE_TYPES, QueueMove, Timeline, catch_up, project
from storage.errors import LogCorrupt
from storage.eventlog import EventStore


async def _read(
    store: EventStore, since_seq: int, until_seq: int
) -> tuple[list[m.Recorded], Iterator[QueueMove]]:
    """The deployments' records and the queue's events in (since_seq, until_seq], the latter
    decoded as they are folded (nothing kept per request but its row)."""
    records = await store.read(since_seq=since_seq, until_seq=until_seq, types=DEPLOYMENT_TYPES)
    rows = await store.read_data(since_seq=since_seq, until_seq=until_seq, types=QUEUE_TYPES)
    return records, _decoded(rows, store.path)


def _decoded(rows: list[tuple[float, bytes]], path: str) -> Iterator[QueueMove]:
    decode = m.decode_event
    for ts, data in rows:
        try:
            event = decode(data)
        except msgspec.DecodeError as exc:
            raise LogCorrupt(f"{path}: a queue event at {ts} cannot be decoded ({exc})") from exc
        yield ts, event


async def timeline_window(
    store: EventStore, since: float, until: float, usable_bytes: int
) -> Timeline:
    """The timeline of (`since`, `until`] as `events.timeline.project` folds it."""
    state = await store.latest_snapshot(until_ts=since) or EMPTY
    start_seq = max(await store.seq_at(since), state.last_seq)
    end_seq = await store.seq_at(until)
    if start_seq > state.last_seq:
        state = catch_up(state, *await _read(store, state.last_seq, start_seq))
    records, queue = await _read(store, start_seq, end_seq)
    return project(state, records, since, until, usable_bytes, queue=queue)
