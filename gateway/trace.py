"""The traffic trace: every gateway request as a compact row, written in batches.

A what-if (`simulations.whatif`) needs all of the traffic, also the requests that never
waited, which the event log otherwise does not know: a request to a ready model writes
nothing *of its own*.  So the gateway keeps one row of small integers per request in memory
(`record`: one row packed by one C call onto a bytearray, no object kept, no I/O) and every
`flush_every_s` hands them as one `TrafficRecorded` event to the log's group commit
(`sink`).  The row is `events.traffic`'s.  The batch also says when each of its deployments
was last used (`last_used_at`, read off the rows at the flush, never per request), which
the folded state keeps across restarts.

Bounded, and never blocking a request: at most `max_in_flight` batches wait for the writer
(a batch beyond that is dropped whole); at most `4 * batch_size` rows wait for their flush,
and 255 deployments fit a batch (rows beyond are dropped); a write that fails drops its
batch.  Whatever was dropped is counted (`statistics()`) and carried by the next batch
that is written (`dropped_batches`, `dropped_requests`), so a trace with holes says where
they are.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Awaitable, Callable

import structlog

from events import model as m
from events.traffic import MAX_DEPLOYMENTS, ROW, last_uses

log = structlog.get_logger("gateway.trace")

Sink = Callable[[m.TrafficRecorded], Awaitable[object]]


class TrafficTrace:
    """Rows in memory, batches to `sink`."""

    def __init__(
        self,
        sink: Sink,
        *,
        batch_size: int = 4096,
        flush_every_s: float = 10.0,
        max_in_flight: int = 4,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sink = sink
        self.flush_every_s = flush_every_s
        self.max_in_flight = max_in_flight
        self._soft_bytes = batch_size * ROW.size  # a batch this full is flushed at once
        self._max_bytes = 4 * self._soft_bytes  # beyond: rows are dropped
        self._pack = ROW.pack
        self._monotonic = monotonic
        self._offset = wall() - monotonic()  # monotonic seconds + offset = epoch seconds
        self._buf = bytearray()
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self._base = monotonic()  # the batch's arrivals count from here ...
        self._base_id = 0  # ... its first id from here
        self._last_id = 0
        self._flush_soon = False
        self._timer: asyncio.TimerHandle | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._unreported_batches = 0  # dropped since the last batch written
        self._unreported_requests = 0
        self.recorded = 0
        self.batches_written = 0
        self.batches_dropped = 0
        self.requests_dropped = 0

    # --- the hot path ------------------------------------------------------------------------

    def record(
        self,
        deployment_id: str,
        request_id: int,
        arrived: float,
        admitted: float,
        first: float,
        end: float,
        flags: int,
    ) -> None:
        """One request ended (times are monotonic seconds; `first` 0: no answer came;
        `flags`: `outcome << 1 | streamed`): one packed row (`events.traffic.ROW`)."""
        index = self._index.get(deployment_id)
        buf = self._buf
        if index is None or len(buf) >= self._soft_bytes:
            index = self._slow(deployment_id, request_id)
            if index < 0:
                return
        buf += self._pack(
            index, flags, request_id - self._last_id, arrived - self._base, admitted - arrived,
            first - arrived if first else -1.0, end - arrived,
        )  # fmt: skip
        self._last_id = request_id

    def _slow(self, deployment_id: str, request_id: int) -> int:
        """A deployment new to the batch (the batch's first row among them), or a full batch:
        the row's index, -1 to drop it."""
        if not self._buf:  # the batch's ids count from its first
            self._base_id = self._last_id = request_id
        if len(self._buf) >= self._max_bytes:  # the loop has not flushed for a while
            self.requests_dropped += 1
            self._unreported_requests += 1
            return -1
        if len(self._buf) >= self._soft_bytes and not self._flush_soon:
            self._flush_soon = True  # full before its time: flushed in the loop's next round
            asyncio.get_running_loop().call_soon(self.flush)
        index = self._index.get(deployment_id)
        if index is None:
            if len(self._names) >= MAX_DEPLOYMENTS:
                self.requests_dropped += 1
                self._unreported_requests += 1
                return -1
            index = self._index[deployment_id] = len(self._names)
            self._names.append(deployment_id)
        return index

    # --- batches -----------------------------------------------------------------------------

    def start(self) -> None:
        """Flush every `flush_every_s` from now on (needs the running loop)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_every_s, self._tick)

    def _tick(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.flush_every_s, self._tick)
        self.flush()

    def flush(self) -> None:
        """Hand the rows so far to the writer as one batch (dropped when it is behind)."""
        self._flush_soon = False
        buf = self._buf
        if not buf:  # nothing to write; the next rows count from now (float32 stays exact)
            self._base = self._monotonic()
            return
        base_time = self._base + self._offset
        event = m.TrafficRecorded(
            deployments=self._names,
            base_time=base_time,
            base_id=self._base_id,
            count=len(buf) // ROW.size,
            data=zlib.compress(buf, 1),
            dropped_batches=self._unreported_batches,
            dropped_requests=self._unreported_requests,
            last_used_at=last_uses(buf, self._names, base_time),
        )
        self._buf, self._index, self._names = bytearray(), {}, []
        self._base = self._monotonic()
        if len(self._writes) >= self.max_in_flight:
            self._dropped(event)
            return
        self._unreported_batches = self._unreported_requests = 0
        task = asyncio.get_running_loop().create_task(self._write(event))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, event: m.TrafficRecorded) -> None:
        try:
            await self._sink(event)
        except Exception as exc:  # policy: a trace that cannot be written is dropped, counted
            log.warning("trace_write_failed", requests=event.count, error=repr(exc))
            self._dropped(event, reported=True)
            return
        self.batches_written += 1
        self.recorded += event.count

    def _dropped(self, event: m.TrafficRecorded, *, reported: bool = False) -> None:
        self.batches_dropped += 1
        self.requests_dropped += event.count
        self._unreported_batches += 1
        self._unreported_requests += event.count
        if reported:  # its own drop counts went with it: carry them again
            self._unreported_batches += event.dropped_batches
            self._unreported_requests += event.dropped_requests
        log.warning("trace_batch_dropped", requests=event.count, writes=len(self._writes))

    async def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is left and wait (bounded) for the writes under way."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=timeout_s)

    def statistics(self) -> dict[str, int]:
        """Counters: requests recorded (written), batches written and dropped."""
        return {
            "recorded": self.recorded,
            "pending": len(self._buf) // ROW.size,
            "batches_written": self.batches_written,
            "batches_dropped": self.batches_dropped,
            "requests_dropped": self.requests_dropped,
        }
