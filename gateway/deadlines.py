"""Deadlines for many connections from one sweeping task instead of a timer per read.

A connection sets `deadline` (loop time, 0 for none) before it waits and clears it after;
the sweeper calls `expire()` on the ones whose deadline passed.  This keeps the hot path to
two float assignments; the price is that a timeout fires up to one interval late.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Protocol

import structlog

log = structlog.get_logger("gateway.deadlines")


class Expirable(Protocol):
    """Something with a deadline that can be made to give up."""

    deadline: float

    def expire(self) -> None:
        """The deadline passed: make the pending wait fail."""
        ...


def sweep_interval(*timeouts: float) -> float:
    """A quarter of the shortest timeout, between 5 ms and 1 s."""
    return min(1.0, max(0.005, min(timeouts) / 4))


class Sweeper:
    """Expires the deadlines of `items()` every `interval` seconds."""

    def __init__(
        self,
        interval: float,
        items: Callable[[], Iterable[Expirable]],
        also: Callable[[float], None] | None = None,
    ) -> None:
        self.interval = interval
        self._items = items
        self._also = also  # more housekeeping on each sweep, given the loop time
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sweeping (idempotent; needs a running loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        """Stop sweeping."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def sweep(self, now: float) -> int:
        """Expire what is due at `now`; returns how many expired."""
        expired = 0
        for item in list(self._items()):
            deadline = item.deadline
            if 0 < deadline <= now:
                item.deadline = 0.0
                expired += 1
                try:
                    item.expire()
                except Exception as exc:  # policy: one bad item must not stop the sweeping
                    log.error("expire_failed", error=repr(exc))
        if self._also is not None:
            self._also(now)
        return expired

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            self.sweep(loop.time())
