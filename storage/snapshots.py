"""Snapshots of the folded system state: start-up folds the newest one plus the tail.

A snapshot is derived data: deleting the `snapshots` table loses nothing, start-up then
folds the whole log.  The store (`storage.eventlog`) keeps the blobs, in the format
`storage.snapshot_format` owns; a snapshot of another format, or one that does not decode,
is ignored with a warning, never a refusal to start.  Here: when to write one
(`Snapshotter`, `load_state` on a long fold) and how start-up uses them (`load_state`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from events import model as m
from events.state import EMPTY, SystemState, evolve
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.storage")

SNAPSHOT_EVERY = 10_000  # events between two snapshots while serving


async def load_state(
    store: EventStore,
    fold_one: Callable[[SystemState, m.Recorded], SystemState] = evolve,
) -> SystemState:
    """The state at the end of the log: the newest usable snapshot plus the events after it
    (each applied with `fold_one`; the controller's marks a deployment it cannot fold failed)."""
    foreign = await store.foreign_snapshots()
    if foreign:
        log.warning("snapshot_ignored", path=store.path, count=foreign, reason="another format")
    state = await store.latest_snapshot() or EMPTY
    saved = state.last_seq
    async for rec in store.iterate(since_seq=state.last_seq):
        state = fold_one(state, rec)
        if state.last_seq - saved >= SNAPSHOT_EVERY and not store.readonly:
            # A long fold (a first start after the state's schema changed, or snapshots
            # lost): snapshots along the way again, so that a past window (the timeline,
            # replay) starts near its time instead of at the log's beginning.
            saved = state.last_seq
            try:
                await store.save_snapshot(state)
            except Exception as exc:  # policy: a lost snapshot costs time, nothing else
                log.warning("snapshot_failed", error=str(exc))
    return state


class Snapshotter:
    """Snapshots the running state every `every` events, and once more at shutdown.

    `current` returns the state DGXMM folded so far (the controller's); the snapshot is
    written by the store's writer between two transactions, one at a time.
    """

    def __init__(
        self, store: EventStore, current: Callable[[], SystemState], every: int = SNAPSHOT_EVERY
    ) -> None:
        self._store = store
        self._current = current
        self._every = every
        self._last_seq = current().last_seq
        self._pending: set[asyncio.Task[None]] = set()
        self.written = 0
        store.add_listener(self._on_append)

    def _on_append(self, recs: list[m.Recorded]) -> None:
        if self._pending or not recs or recs[-1].seq - self._last_seq < self._every:
            return
        task = asyncio.get_running_loop().create_task(self._save())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _save(self) -> None:
        state = self._current()
        if state.last_seq <= self._last_seq:
            return
        try:
            await self._store.save_snapshot(state)
        except Exception as exc:  # policy: a lost snapshot costs start-up time, nothing else
            log.warning("snapshot_failed", error=str(exc))
            return
        self._last_seq = state.last_seq
        self.written += 1
        log.info("snapshot_saved", seq=state.last_seq)

    async def close(self) -> None:
        """Wait for a snapshot being written, then write the final one."""
        for task in list(self._pending):
            with contextlib.suppress(Exception):
                await task
        await self._save()
