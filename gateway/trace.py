"""The traffic trace: every gateway request as a compact row, written in batches.

A what-if (`simulations.whatif`) needs all of the traffic, also the requests that never
waited, which the event log otherwise does not know: a request to a ready model writes
nothing *of its own*.  So the gateway keeps one row of eight numbers per request in memory
(`record`: one tuple appended to a flat list, no I/O) and every `flush_every_s` packs them
(`events.traffic.pack_rows`, 64 rows a C call) into one `TrafficRecorded` event for the
log's group commit (`sink`).  The row is `events.traffic`'s.  The batch also says when
each of its deployments was last used (`last_used_at`, read off the packed rows at the
flush, never per request), which the folded state keeps across restarts.

A request pays what `record` does (the express lane appends the same numbers itself,
`Exchange._traced`) and a share of the flush's packing and deflate;
`tests.perf.micro_gateway --instructions` counts both (`MICRO_GATEWAY_TRACE`).  The list
holds the numbers as the row stores them, so that the flush computes nothing per row:
times already seconds from the batch's base (`base`; float32 keeps them exact to the
microsecond), the deployment an index into the batch's names (`index`).

Bounded, and never blocking a request: at most `max_in_flight` batches wait for the writer
(a batch beyond that is dropped whole); at most `4 * batch_size` rows wait for their flush,
and 255 deployments fit a batch (rows beyond are dropped); a write that fails, or a batch
whose numbers do not fit its row, is dropped.  Whatever was dropped is counted
(`statistics()`) and carried by the next batch that is written (`dropped_batches`,
`dropped_requests`), so a trace with holes says where they are.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable

import structlog

from events import model as m
from events.traffic import (
    FIELDS,
    LAYOUT,
    MAX_DEPLOYMENTS,
    deflate_rows,
    last_uses,
    pack_rows,
)

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
        self.soft = batch_size * FIELDS  # a batch this full is flushed at once
        self._max = 4 * self.soft  # beyond: rows are dropped
        self._monotonic = monotonic
        self._offset = wall() - monotonic()  # monotonic seconds + offset = epoch seconds
        # The batch: `FIELDS` numbers a row (`events.traffic.ROW`'s), the deployments' indexes
        # (read and appended to by the express lane, `Exchange._traced`, too).
        self.rows: list[float] = []
        self.index: dict[str, int] = {}
        self._names: list[str] = []
        self.base = monotonic()  # the batch's arrivals count from here
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
        outcome: int,
        streamed: bool,
    ) -> None:
        """One request ended (times are monotonic seconds; `first` 0: no answer came;
        `outcome`: its code, `events.traffic.OUTCOMES`): its row's numbers onto the list."""
        rows = self.rows
        index = self.index.get(deployment_id)
        if index is None or len(rows) >= self.soft:  # new to the batch, or a full batch
            index = self._slow(deployment_id)
            if index < 0:
                return
        rows += (
            index, outcome, streamed, request_id, arrived - self.base, admitted - arrived,
            first - arrived if first else -1.0, end - arrived,
        )  # fmt: skip

    def _slow(self, deployment_id: str) -> int:
        """A deployment new to the batch, or a full batch: the row's index, -1 to drop it."""
        rows = self.rows
        if len(rows) >= self._max:  # the loop has not flushed for a while
            self.requests_dropped += 1
            self._unreported_requests += 1
            return -1
        if len(rows) >= self.soft and not self._flush_soon:
            self._flush_soon = True  # full before its time: flushed in the loop's next round
            asyncio.get_running_loop().call_soon(self.flush)
        index = self.index.get(deployment_id)
        if index is None:
            if len(self._names) >= MAX_DEPLOYMENTS:
                self.requests_dropped += 1
                self._unreported_requests += 1
                return -1
            index = self.index[deployment_id] = len(self._names)
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
        values = self.rows
        if not values:  # nothing to write; the next rows count from now (float32 stays exact)
            self.base = self._monotonic()
            return
        base_time = self.base + self._offset
        names = self._names
        self.rows, self.index, self._names = [], {}, []
        self.base = self._monotonic()
        count = len(values) // FIELDS
        try:
            rows = pack_rows(values)
        except struct.error as exc:  # policy: a number out of its field's range (a clock
            # gone wrong) loses its batch, counted, rather than the rest of the trace
            log.warning("trace_batch_unpacked", requests=count, error=repr(exc))
            self.batches_dropped += 1
            self.requests_dropped += count
            self._unreported_batches += 1
            self._unreported_requests += count
            return
        event = m.TrafficRecorded(
            deployments=names,
            base_time=base_time,
            base_id=int(values[3]),  # the first row's id
            count=count,
            data=deflate_rows(rows),
            layout=LAYOUT,
            dropped_batches=self._unreported_batches,
            dropped_requests=self._unreported_requests,
            last_used_at=last_uses(rows, names, base_time),
        )
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
            "pending": len(self.rows) // FIELDS,
            "batches_written": self.batches_written,
            "batches_dropped": self.batches_dropped,
            "requests_dropped": self.requests_dropped,
        }
