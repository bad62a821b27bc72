"""A window of the log for the timeline: the state at its start and its records, not the log.

`timeline_window(store, since, until, usable_bytes)` finds the state at `since` from the
newest snapshot taken at or before it plus the deployment and queue events after that
snapshot (at most the snapshot spacing, 10,000 events, when DGXMM serves), then reads only
the window's deployment and queue events (a range of sequence numbers found through the
`events_ts` index, filtered by type in SQLite before anything is decoded) and hands both to
the pure projection `events.timeline.project`.  Its cost follows the window, not the log.
"""

from __future__ import annotations

from events.state import EMPTY
from events.timeline import WINDOW_TYPES, Timeline, catch_up, project
from storage.eventlog import EventStore


async def timeline_window(
    store: EventStore, since: float, until: float, usable_bytes: int
) -> Timeline:
    """The timeline of (`since`, `until`] as `events.timeline.project` folds it."""
    state = await store.latest_snapshot(until_ts=since) or EMPTY
    start_seq = await store.seq_at(since)
    if start_seq > state.last_seq:
        before = store.iterate(since_seq=state.last_seq, until_seq=start_seq, types=WINDOW_TYPES)
        state = catch_up(state, [rec async for rec in before])
    end_seq = await store.seq_at(until)
    records = [
        rec
        async for rec in store.iterate(
            since_seq=max(start_seq, state.last_seq), until_seq=end_seq, types=WINDOW_TYPES
        )
    ]
    return project(state, records, since, until, usable_bytes)
