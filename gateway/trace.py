"""The traffic trace: every gateway request as a compact row, written in batches.

A what-if (`simulations.whatif`) needs all of the traffic, also the requests that never
waited, which the event log otherwise does not know: a request to a ready model writes
nothing *of its own*.  So the gateway keeps one row per request in memory (`record`: a
tuple of what the request already holds, appended to a list, no I/O, no arithmetic) and
every `flush_every_s` turns them into one `TrafficRecorded` event for the log's group
commit (`sink`).  The row is `events.traffic`'s.  The batch also says when each of its
deployments was last used (`last_used_at`, read off the last rows at the flush, never per
request), which the folded state keeps across restarts.

A request pays the tuple and its append (the express lane appends it itself, in
`Exchange._end`) and a share of the flush, which builds the batch's columns in C loops,
none in Python per row: the list transposed (`zip`), the times made relative (`map` with
`operator.sub`) and packed (`struct`), the deployments' indexes through a dict's
`__getitem__`, then `events.traffic.pack_columns`.  `tests.perf.micro_gateway
--instructions` counts both (`MICRO_GATEWAY_TRACE`).

Bounded, and never blocking a request: at most `max_in_flight` batches wait for the writer
(a batch beyond that is dropped whole); at most `4 * batch_size` rows wait for their flush,
and 255 deployments fit a batch (the rows of any beyond are dropped at the flush); a write
that fails, or a batch whose numbers do not fit their columns, is dropped.  Whatever was
dropped is counted (`statistics()`) and carried by the next batch that is written
(`dropped_batches`, `dropped_requests`), so a trace with holes says where they are.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable
from itertools import repeat
from operator import sub

import structlog

from events import model as m
from events.traffic import LAYOUT, MAX_DEPLOYMENTS, float32s, last_uses, pack_columns

log = structlog.get_logger("gateway.trace")

Sink = Callable[[m.TrafficRecorded], Awaitable[object]]
# A request as it ended: deployment id, request id, and monotonic seconds when it arrived,
# got its lease, sent its first byte (0: none) and ended; its outcome's code; streamed.
Row = tuple[str, int, float, float, float, float, int, bool]


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
        self.soft = batch_size  # a batch this full is flushed at once
        self._max = 4 * batch_size  # beyond: rows are dropped
        self._monotonic = monotonic
        self._offset = wall() - monotonic()  # monotonic seconds + offset = epoch seconds
        # The batch: a `Row` a request (appended by the express lane, `Exchange._end`, too).
        self.rows: list[Row] = []
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
        `outcome`: its code, `events.traffic.OUTCOMES`): its row onto the batch."""
        rows = self.rows
        if len(rows) < self.soft or self._room():
            rows.append(
                (deployment_id, request_id, arrived, admitted, first, end, outcome, streamed)
            )

    def _room(self) -> bool:
        """A full batch: flush it soon; False (the row dropped, counted) beyond the bound."""
        if len(self.rows) >= self._max:  # the loop has not flushed for a while
            self.requests_dropped += 1
            self._unreported_requests += 1
            return False
        if not self._flush_soon:
            self._flush_soon = True  # full before its time: flushed in the loop's next round
            asyncio.get_running_loop().call_soon(self.flush)
        return True

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
        rows, base = self.rows, self.base
        self.base = self._monotonic()  # the next rows count from now (float32 stays exact)
        if not rows:
            return
        self.rows = []
        columns = tuple(zip(*rows, strict=True))
        names = list(dict.fromkeys(columns[0]))
        if len(names) > MAX_DEPLOYMENTS:
            rows = self._beyond_deployments(rows, names)
            columns = tuple(zip(*rows, strict=True))
            names = names[:MAX_DEPLOYMENTS]
        deployments, ids, arrived, admitted, first, end, outcomes, streamed = columns
        count = len(rows)
        index = {name: i for i, name in enumerate(names)}
        # Every column in C loops: the times relative to the arrival (and it to the base).
        firsts = list(map(sub, first, arrived))
        if 0.0 in first:  # no answer came to some: their time to first byte says so
            for i, at in enumerate(first):
                if not at:
                    firsts[i] = -1.0
        try:
            since = float32s(map(sub, arrived, repeat(base)), count)
            duration = float32s(map(sub, end, arrived), count)
            ttfb = float32s(firsts, count)
            # (the express lane's rows waited for nothing: their admission is their arrival)
            wait = (
                bytes(4 * count)
                if admitted == arrived
                else (float32s(map(sub, admitted, arrived), count))
            )
            data = pack_columns(
                bytes(map(index.__getitem__, deployments)), bytes(outcomes), bytes(streamed),
                ids[0], ids, wait, since, ttfb, duration,
            )  # fmt: skip
        except (struct.error, OverflowError) as exc:  # policy: a number out of its column's
            # range (a clock gone wrong) loses its batch, counted, rather than the rest
            log.warning("trace_batch_unpacked", requests=count, error=repr(exc))
            self.batches_dropped += 1
            self.requests_dropped += count
            self._unreported_batches += 1
            self._unreported_requests += count
            return
        base_time = base + self._offset
        event = m.TrafficRecorded(
            deployments=names,
            base_time=base_time,
            base_id=ids[0],
            count=count,
            data=data,
            layout=LAYOUT,
            dropped_batches=self._unreported_batches,
            dropped_requests=self._unreported_requests,
            last_used_at=last_uses(names, deployments, outcomes, ttfb, since, duration, base_time),
        )
        if len(self._writes) >= self.max_in_flight:
            self._dropped(event)
            return
        self._unreported_batches = self._unreported_requests = 0
        task = asyncio.get_running_loop().create_task(self._write(event))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _beyond_deployments(self, rows: list[Row], names: list[str]) -> list[Row]:
        """The rows of a batch's first `MAX_DEPLOYMENTS` deployments; the others' are
        dropped, counted."""
        keep = set(names[:MAX_DEPLOYMENTS])
        kept = [row for row in rows if row[0] in keep]
        self.requests_dropped += len(rows) - len(kept)
        self._unreported_requests += len(rows) - len(kept)
        return kept

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
            "pending": len(self.rows),
            "batches_written": self.batches_written,
            "batches_dropped": self.batches_dropped,
            "requests_dropped": self.requests_dropped,
        }
