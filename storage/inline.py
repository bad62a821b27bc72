"""An aiosqlite connection that runs each statement at once, in the event loop's thread.

For the simulations on the virtual clock (`simulations.whatif`): their event log is a
scratch file nobody else opens, and a week of simulated traffic appends tens of thousands
of times.  Through aiosqlite's own thread each statement costs two thread switches, a wake
of the loop's selector and the GIL's hand-over; a what-if spent most of its wall time
there.  Here a statement is a plain `sqlite3` call: the event store's code (group commit,
versions, read models) runs unchanged, only without the thread.  Never for a log a real
DGXMM writes: a statement blocks the loop for as long as SQLite takes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Generator
from typing import Any

import aiosqlite


class InlineConnection(aiosqlite.Connection):
    """aiosqlite's connection without its thread (no statement is queued)."""

    def __init__(self, connector: Callable[[], sqlite3.Connection]) -> None:
        super().__init__(connector, iter_chunk_size=64)

    async def _execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self._running or not self._connection:
            raise ValueError("Connection closed")
        return fn(*args, **kwargs)

    async def _connect(self) -> InlineConnection:
        if self._connection is None:
            self._connection = self._connector()
        return self

    def __await__(self) -> Generator[Any, None, InlineConnection]:
        return self._connect().__await__()

    def stop(self) -> None:
        """Close the SQLite connection (there is no thread to stop)."""
        self._running = False
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def connect_inline(path: str, **kwargs: Any) -> InlineConnection:
    """`aiosqlite.connect` without the thread: await it for the open connection."""
    return InlineConnection(lambda: sqlite3.connect(path, **kwargs))
