"""The traffic trace: every gateway request as a compact row, written in batches.

A what-if (`simulations.whatif`) needs all of the traffic, also the requests that never
waited, which the event log otherwise does not know: a request to a ready model writes
nothing *of its own*.  So the gateway keeps one row per request in memory (`record`: one
`struct.pack_into` of what the request already holds into a preallocated bytearray: no
object made, no arithmetic, no I/O) and every `flush_every_s` turns them into one
`TrafficRecorded` event for the log's group commit (`sink`).  The stored columns are
`events.traffic`'s (layout 1): the flush computes them with numpy (`_columns`), a few
instructions a value, where Python makes and frees a float per subtraction (the standard
library's best, `tests.perf.bench_trace_flush`, takes 5 to 20 times the instructions a
row, in batches of 500 to 4,096, which would double what the trace costs a request;
`tests/test_traffic_trace.py` holds the two to the same bytes).  numpy is imported when a
trace is made (`_rows`), not with this module, which every process importing `gateway`
loads.  The batch also says when each of its deployments was last used (`last_used_at`,
read off the last rows at the flush, never per request), which the folded state keeps
across restarts.

The express lane packs its row itself, in `Exchange._end`, with no check of its own: a
deployment new to the batch (a `KeyError`) or a full batch (`pack_into` past the buffer's
end, a `struct.error`) sends it to `record`, which sees to both.
`tests.perf.micro_gateway --instructions` counts what a request pays, the flush shared out
(`MICRO_GATEWAY_TRACE`).

Bounded, and never blocking a request: at most `max_in_flight` batches wait for the writer
(a batch beyond that is dropped whole); at most `4 * batch_size` rows wait for their flush,
and 255 deployments fit a batch (the rows of any beyond are dropped); a write that fails
drops its batch, a number that does not fit its field its row.  Whatever was
dropped is counted (`statistics()`) and carried by the next batch that is written
(`dropped_batches`, `dropped_requests`), so a trace with holes says where they are.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
from collections.abc import Awaitable, Callable
from functools import cache
from typing import TYPE_CHECKING, Any

import structlog

from events import model as m
from events.traffic import FLUSH_EVERY_S, LAYOUT, MAX_DEPLOYMENTS, last_uses, pack_layout1

if TYPE_CHECKING:
    import numpy as np

log = structlog.get_logger("gateway.trace")

Sink = Callable[[m.TrafficRecorded], Awaitable[object]]
# A request's row as the batch holds it in memory, packed by one C call and no arithmetic
# (`record`, and `Exchange._end` for the express lane): its deployment's index in the
# batch, outcome, stream flag, request id, and its monotonic seconds as they were read
# (arrival, lease, first byte or 0, end).  The flush turns the batch into
# `events.traffic`'s columns (layout 1: id differences, float32 seconds from the arrival
# and from the batch's base) with numpy, a few instructions a value, instead of Python's
# arithmetic on each row (a float made and freed per subtraction).
ROW = struct.Struct("<BB?qdddd")


@cache
def _rows() -> np.dtype[Any]:
    """`ROW` as numpy sees it, numpy imported on the first call.

    Only a process that makes a `TrafficTrace` (`dgxmm serve`) loads numpy (0.2 s and
    11 MB): `gateway` is imported by LiteLLM's workers (`dgxmm.litellm`), the admin and
    the engines' adapters too, which never flush a trace.  Loaded when the trace is made
    rather than at its first flush, which would stall the event loop that long."""
    # numpy's BLAS would start a thread per core that spins after use; the trace does no
    # linear algebra (set before numpy is first imported, as `dgxmm serve` does here).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import numpy as np

    return np.dtype(
        {
            "names": ["index", "outcome", "streamed", "id", "arrived", "admitted", "first", "end"],
            "formats": ["u1", "u1", "u1", "<i8", "<f8", "<f8", "<f8", "<f8"],
            "offsets": [0, 1, 2, 3, 11, 19, 27, 35],
            "itemsize": ROW.size,
        }
    )


def _columns(buf: bytearray, n: int, base: float) -> tuple[int, list[bytes]]:
    """The batch's first id and its layout-1 columns (index, outcome, streamed, id
    differences, wait, arrival from `base`, time to first byte or -1, duration)."""
    import numpy as np  # loaded by `_rows` when the trace was made: a lookup here

    rows = np.frombuffer(buf, dtype=_rows(), count=n)
    ids, arrived, first = rows["id"], rows["arrived"], rows["first"]
    with np.errstate(over="ignore"):  # a clock gone wrong: inf, not an error
        times = [
            rows["admitted"] - arrived,
            arrived - base,
            np.where(first > 0, first - arrived, -1.0),
            rows["end"] - arrived,
        ]
        floats = [t.astype("<f4").tobytes() for t in times]
    base_id = int(ids[0])
    deltas = np.diff(ids, prepend=ids[:1]).astype("<i8").tobytes()
    small = [rows[name].tobytes() for name in ("index", "outcome", "streamed")]
    return base_id, [*small, deltas, *floats]


class TrafficTrace:
    """Rows in memory, batches to `sink`.

    The batch is one preallocated bytearray of packed rows (`ROW`): a request's row is one
    `pack_into` of what it holds, which makes no object, so nothing is left for the garbage
    collector, and the flush computes the columns with numpy.  The express lane packs its
    rows itself (`Exchange._end`) when the batch has room and knows its deployment;
    everything else goes through `record`.
    """

    def __init__(
        self,
        sink: Sink,
        *,
        batch_size: int = 4096,
        flush_every_s: float = FLUSH_EVERY_S,
        max_in_flight: int = 4,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        _rows()  # numpy, now rather than at the first flush
        self._sink = sink
        self.flush_every_s = flush_every_s
        self.max_in_flight = max_in_flight
        self.soft = batch_size * ROW.size  # a batch this full (in bytes) is flushed at once
        self._max = 4 * self.soft  # beyond: rows are dropped
        self._monotonic = monotonic
        self._offset = wall() - monotonic()  # monotonic seconds + offset = epoch seconds
        # The batch's rows; `pack_into` past its end raises, which is how the express lane
        # learns that the batch is full (no check of its own); `_room` lets it grow to
        # `_max` until the flush.
        self.buf = bytearray(self.soft)
        self.off = 0  # the batch's bytes in `buf`
        self.pack_into = ROW.pack_into
        self.index: dict[str, int] = {}  # deployment id -> its index in the batch's names
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
        `outcome`: its code, `events.traffic.OUTCOMES`): its row into the batch (dropped,
        counted, beyond the batch's bounds)."""
        off = self.off
        if off + ROW.size > len(self.buf) and not self._room():
            return
        index = self.index.get(deployment_id)
        if index is None:
            if len(self._names) >= MAX_DEPLOYMENTS:
                self._drop_row()
                return
            index = self.index[deployment_id] = len(self._names)
            self._names.append(deployment_id)
        try:
            self.pack_into(
                self.buf, off, index, outcome, streamed, request_id, arrived, admitted, first, end
            )
        except struct.error:  # policy: a number out of its field's range loses its row, counted
            self._drop_row()
            return
        self.off = off + ROW.size

    def _room(self) -> bool:
        """A full batch: flush it soon; False (the row dropped, counted) beyond the bound."""
        if self.off + ROW.size > self._max:  # the loop has not flushed for a while
            self._drop_row()
            return False
        if len(self.buf) < self._max:
            self.buf.extend(bytes(self._max - len(self.buf)))
        if not self._flush_soon:
            self._flush_soon = True  # full before its time: flushed in the loop's next round
            asyncio.get_running_loop().call_soon(self.flush)
        return True

    def _drop_row(self) -> None:
        self.requests_dropped += 1
        self._unreported_requests += 1

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
        off, base, names = self.off, self.base, self._names
        self.base = self._monotonic()  # the next rows count from now (float32 stays exact)
        if not off:
            return
        self.off = 0
        self.index, self._names = {}, []
        n = off // ROW.size
        base_id, columns = _columns(self.buf, n, base)
        if len(self.buf) > self.soft:  # grown while the flush was late: back to its size
            del self.buf[self.soft :]
        index, outcomes, streamed, deltas, wait, since, ttfb, duration = columns
        base_time = base + self._offset
        event = m.TrafficRecorded(
            deployments=names,
            base_time=base_time,
            base_id=base_id,
            count=n,
            data=pack_layout1(index, outcomes, streamed, deltas, wait, since, ttfb, duration),
            layout=LAYOUT,
            dropped_batches=self._unreported_batches,
            dropped_requests=self._unreported_requests,
            last_used_at=last_uses(names, index, outcomes, ttfb, since, duration, base_time),
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
            "pending": self.off // ROW.size,
            "batches_written": self.batches_written,
            "batches_dropped": self.batches_dropped,
            "requests_dropped": self.requests_dropped,
        }
