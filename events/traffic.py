"""The traffic trace's rows and their encoding (`TrafficRecorded.data`).

A request's row: the deployment (its index in the batch's list), the outcome's code
(`OUTCOMES`), whether the answer was streamed, the request id, and four float32 seconds:
the arrival from the batch's base time, the wait (arrival to lease), the time to the first
byte of the answer (negative: none came) and the whole duration (arrival to end).

Layout 1 (`LAYOUT`, what is written now) stores a batch by column, little-endian: every
row's deployment index (a byte), then every outcome (a byte), every stream flag (a byte),
every id as its difference from the row before's (int64; the first row's from `base_id`),
every wait (float32), all of it raw-deflated; then, as they are, the float32 arrivals, times
to first byte and durations (`pack_layout1`).  The deflated columns barely change from row
to row (one deployment, "served", ids one apart, the wait 0), so deflate takes them fast
and keeps them to a fraction of a byte a row; it would gain little on the three times and
cost as much again.  The gateway writes each request's row straight into its columns
(`gateway.trace`), so a flush only copies them out and deflates the first five.

Layout 0, what the trace wrote first, still reads (`decode_batch`): 22-byte rows one after
the other (`ROW_LAYOUT0`: the outcome and the stream in one byte, `outcome << 1 | streamed`,
and the id a 32-bit delta from the previous row's), zlib-deflated.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Sequence
from itertools import accumulate, chain
from operator import sub

import msgspec

from events.model import TrafficRecorded

# The outcome codes, in the order of their numbers (the schema only grows: append).
OUTCOMES = ("served", "engine_error", "client_gone", "queue_full", "queue_timeout", "refused")
SERVED, ENGINE_ERROR, CLIENT_GONE, QUEUE_FULL, QUEUE_TIMEOUT, REFUSED = range(len(OUTCOMES))
# A request with one of these never had its model (its row's wait is 0).
NEVER_LEASED = frozenset(("queue_full", "queue_timeout", "refused"))

MAX_DEPLOYMENTS = 255  # per batch: the index is one byte
LAYOUT = 1  # what `pack_layout1` writes (`TrafficRecorded.layout`)
FLUSH_EVERY_S = 10.0  # the gateway's trace writes its batch this often (so the log hears it)
ROW_LAYOUT0 = struct.Struct("<BBiffff")
_F32 = struct.Struct("<f")


def pack_layout1(
    index: bytes, outcomes: bytes, streamed: bytes, deltas: bytes,
    wait: bytes, arrived: bytes, ttfb: bytes, duration: bytes,
) -> bytes:  # fmt: skip
    """Layout 1's `data` from its columns as bytes (little-endian, the ids as int64 deltas)."""
    deflate = zlib.compressobj(1, zlib.DEFLATED, -15, 1)  # a small hash table: cleared each batch
    head = deflate.compress(b"".join((index, outcomes, streamed, deltas, wait)))
    return b"".join((head, deflate.flush(), arrived, ttfb, duration))


class TrafficRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One gateway request as the trace recorded it (times in seconds)."""

    request_id: int
    deployment_id: str
    arrived: float  # epoch seconds
    wait_s: float  # arrival to lease (0: served at once)
    ttfb_s: float | None  # arrival to the answer's first byte; None: no answer came
    duration_s: float  # arrival to the end
    outcome: str
    streamed: bool

    @property
    def service_s(self) -> float:
        """What the engine took once the request had its lease."""
        return max(0.0, self.duration_s - self.wait_s)

    @property
    def waited_s(self) -> float:
        """How long it waited for its model: to its lease, or all its time if it never had
        one (the trace writes those a wait of 0)."""
        return self.duration_s if self.outcome in NEVER_LEASED else self.wait_s


Row = tuple[int, int, bool, int, float, float, float, float]


def _layout0(event: TrafficRecorded) -> list[Row]:
    """The first layout's rows in the current one's order, with their ids."""
    rows: list[Row] = []
    rid = event.base_id
    for index, flags, delta, arrived, wait, first, duration in ROW_LAYOUT0.iter_unpack(
        zlib.decompress(event.data)
    ):
        rid += delta
        rows.append((index, flags >> 1, bool(flags & 1), rid, arrived, wait, first, duration))
    return rows


def _layout1(event: TrafficRecorded) -> Iterator[Row]:
    """Layout 1's columns, row by row."""
    n = event.count
    inflate = zlib.decompressobj(-15)
    data = inflate.decompress(event.data) + inflate.unused_data
    if len(data) != 27 * n:
        raise ValueError(f"a trace batch of {n} rows holds {len(data)} bytes")
    deltas = struct.unpack_from(f"<{n}q", data, 3 * n)
    times = struct.unpack_from(f"<{4 * n}f", data, 11 * n)
    ids = accumulate(deltas, initial=event.base_id)
    next(ids)
    return zip(
        data[:n], data[n : 2 * n], map(bool, data[2 * n : 3 * n]), ids,
        times[n : 2 * n], times[:n], times[2 * n : 3 * n], times[3 * n :], strict=True,
    )  # fmt: skip


def decode_batch(event: TrafficRecorded) -> list[TrafficRecord]:
    """The records of one batch, in the order they ended."""
    names, base = event.deployments, event.base_time
    last = len(OUTCOMES)
    rows = _layout0(event) if event.layout == 0 else _layout1(event)
    return [
        TrafficRecord(
            request_id=rid,
            deployment_id=names[index],
            arrived=base + arrived,
            wait_s=max(0.0, wait),
            ttfb_s=None if first < 0 else first,
            duration_s=max(0.0, duration),
            outcome=OUTCOMES[code] if code < last else "refused",
            streamed=streamed,
        )
        for index, code, streamed, rid, arrived, wait, first, duration in rows
    ]


def counts_as_use(outcome: int, first: float) -> bool:
    """Whether a row's request used its deployment: it reached the engine (served, or the
    engine failed it), or an answer began before the client left."""
    return outcome in (SERVED, ENGINE_ERROR) or first >= 0


def last_uses(
    names: Sequence[str], index: bytes, outcomes: bytes,
    ttfb: bytes, arrived: bytes, duration: bytes, base: float,
) -> dict[str, float]:  # fmt: skip
    """Per deployment of a batch (`names`; `index`: each row's), when its newest request
    that used it ended (`base` + arrival + duration, as stored: float32), from the columns
    of its rows.  Rows come in the order requests ended, so the scan runs from the last row
    back and stops once every name is found: one row, mostly."""
    found: dict[str, float] = {}
    f32 = _F32.unpack_from
    for i in range(len(index) - 1, -1, -1):
        name = names[index[i]]
        if name not in found and counts_as_use(outcomes[i], f32(ttfb, 4 * i)[0]):
            found[name] = base + f32(arrived, 4 * i)[0] + f32(duration, 4 * i)[0]
            if len(found) == len(names):
                break
    return found


def encode_batch(records: list[TrafficRecord]) -> TrafficRecorded:
    """A batch made of whole records (synthesised traces, tests), as the gateway writes its
    own (`gateway.trace`): the same columns, `LAYOUT`."""
    deployments = [r.deployment_id for r in records]
    names = list(dict.fromkeys(deployments))
    index = {n: i for i, n in enumerate(names)}
    base = records[0].arrived if records else 0.0
    base_id = records[0].request_id if records else 0
    outcomes = bytes(
        OUTCOMES.index(r.outcome) if r.outcome in OUTCOMES else REFUSED for r in records
    )
    ids = [r.request_id for r in records]

    def float32s(values: list[float]) -> bytes:
        return struct.pack(f"<{len(values)}f", *values)

    arrived = float32s([r.arrived - base for r in records])
    duration = float32s([r.duration_s for r in records])
    ttfb = float32s([-1.0 if r.ttfb_s is None else r.ttfb_s for r in records])
    index_bytes = bytes([index[d] for d in deployments])
    data = pack_layout1(
        index_bytes, outcomes, bytes([r.streamed for r in records]),
        struct.pack(f"<{len(ids)}q", *map(sub, ids, chain((base_id,), ids))),
        float32s([r.wait_s for r in records]), arrived, ttfb, duration,
    )  # fmt: skip
    return TrafficRecorded(
        deployments=names,
        base_time=base,
        base_id=base_id,
        count=len(records),
        data=data,
        layout=LAYOUT,
        last_used_at=last_uses(names, index_bytes, outcomes, ttfb, arrived, duration, base),
    )
