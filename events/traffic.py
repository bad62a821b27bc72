"""The traffic trace's rows and their encoding (`TrafficRecorded.data`).

One request is one packed row of 27 bytes (`ROW`, little-endian): the deployment's index in
the batch's list, the outcome's code (`OUTCOMES`), whether the answer was streamed, the
request id, and four float32 seconds: the arrival from the batch's base time, the wait
(arrival to lease), the time to the first byte of the answer (negative: none came) and the
whole duration (arrival to end).

The gateway does not pack a row per request: it keeps the row's eight numbers on a flat
list (`gateway.trace`: a tuple appended, nothing computed that the request already has)
and packs the whole batch at the flush, 64 rows a C call (`pack_rows`), a fraction of what
one `struct` call per request cost.  The batch's bytes then go by their place in the row
(every row's first byte, then every second ...) and are raw-deflated (`deflate_rows`): the
places that barely change from row to row (the index, the outcome, the id's high bytes, a
float's exponent) become long runs, which deflate takes at a fraction of the cost of the
rows as they are and keeps smaller.  That is layout 1 (`LAYOUT`, what is written now).

Layout 0, what the trace wrote first, still reads (`rows_of`, `decode_batch`): 22-byte
rows (`ROW_LAYOUT0`: the outcome and the stream in one byte, `outcome << 1 | streamed`,
and the id a 32-bit delta from the previous row's), as they are, zlib-deflated.
"""

from __future__ import annotations

import struct
import zlib

import msgspec

from events.model import TrafficRecorded

# The outcome codes, in the order of their numbers (the schema only grows: append).
OUTCOMES = ("served", "engine_error", "client_gone", "queue_full", "queue_timeout", "refused")
SERVED, ENGINE_ERROR, CLIENT_GONE, QUEUE_FULL, QUEUE_TIMEOUT, REFUSED = range(len(OUTCOMES))

ROW = struct.Struct("<BB?qffff")
FIELDS = 8  # a row's numbers, as the gateway keeps them on a flat list
MAX_DEPLOYMENTS = 255  # per batch: the index is one byte
LAYOUT = 1  # what `encode_batch` and the gateway write (`TrafficRecorded.layout`)
ROW_LAYOUT0 = struct.Struct("<BBiffff")

_CHUNK = 64  # rows packed by one call: its format parsed once
_PACK_CHUNK = struct.Struct("<" + ROW.format[1:] * _CHUNK).pack


def pack_rows(values: list[float]) -> bytes:
    """The rows of a batch from their numbers one after the other (`FIELDS` a row, in
    `ROW`'s order), a few C calls for the whole batch (`struct.error` when a number does
    not fit its field)."""
    count = len(values) // FIELDS
    short = -count % _CHUNK  # the last chunk is filled with zeros, cut off after
    if short:
        zeros: list[float] = [0] * (short * FIELDS)
        values = values + zeros
    step = _CHUNK * FIELDS
    rows = b"".join([_PACK_CHUNK(*values[i : i + step]) for i in range(0, len(values), step)])
    return rows[: count * ROW.size] if short else rows


def deflate_rows(rows: bytes) -> bytes:
    """Layout 1's `data`: the rows' bytes by their place in the row, raw-deflated (level 1,
    no header, no checksum)."""
    size = ROW.size
    deflate = zlib.compressobj(1, zlib.DEFLATED, -15)
    return deflate.compress(b"".join([rows[j::size] for j in range(size)])) + deflate.flush()


def rows_of(event: TrafficRecorded) -> bytes:
    """A batch's rows as packed: `ROW`s one after the other (layout 0: `ROW_LAYOUT0`s)."""
    if event.layout == 0:
        return zlib.decompress(event.data)
    data = zlib.decompress(event.data, -15)
    size, count = ROW.size, len(data) // ROW.size
    rows = bytearray(len(data))
    for j in range(size):
        rows[j::size] = data[j * count : (j + 1) * count]
    return bytes(rows)


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


Row = tuple[int, int, bool, int, float, float, float, float]


def _layout0(event: TrafficRecorded) -> list[Row]:
    """The first layout's rows in the current one's order, with their ids."""
    rows: list[Row] = []
    rid = event.base_id
    for index, flags, delta, arrived, wait, first, duration in ROW_LAYOUT0.iter_unpack(
        rows_of(event)
    ):
        rid += delta
        rows.append((index, flags >> 1, bool(flags & 1), rid, arrived, wait, first, duration))
    return rows


def decode_batch(event: TrafficRecorded) -> list[TrafficRecord]:
    """The records of one batch, in the order they ended."""
    names, base = event.deployments, event.base_time
    last = len(OUTCOMES)
    rows = _layout0(event) if event.layout == 0 else ROW.iter_unpack(rows_of(event))
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


def last_uses(rows: bytes, names: list[str], base_time: float) -> dict[str, float]:
    """Per deployment of a batch (`names`), when its newest request that used it ended, in
    epoch seconds, from the rows as packed (`pack_rows`).  Rows come in the order requests
    ended, so the scan runs from the last row back and stops once every name is found."""
    found: dict[str, float] = {}
    unpack, size = ROW.unpack_from, ROW.size
    for offset in range(len(rows) - size, -1, -size):
        index, outcome, _, _, arrived, _, first, duration = unpack(rows, offset)
        name = names[index]
        if name not in found and counts_as_use(outcome, first):
            found[name] = base_time + arrived + duration
            if len(found) == len(names):
                break
    return found


def encode_batch(records: list[TrafficRecord]) -> TrafficRecorded:
    """A batch made of whole records (synthesised traces, tests), as the gateway writes its
    own (`gateway.trace`): the same `ROW`s, `LAYOUT`."""
    names = list(dict.fromkeys(r.deployment_id for r in records))
    index = {n: i for i, n in enumerate(names)}
    base = records[0].arrived if records else 0.0
    values: list[float] = []
    for r in records:
        code = OUTCOMES.index(r.outcome) if r.outcome in OUTCOMES else REFUSED
        values += (
            index[r.deployment_id], code, r.streamed, r.request_id, r.arrived - base, r.wait_s,
            -1.0 if r.ttfb_s is None else r.ttfb_s, r.duration_s,
        )  # fmt: skip
    rows = pack_rows(values)
    return TrafficRecorded(
        deployments=names,
        base_time=base,
        base_id=records[0].request_id if records else 0,
        count=len(records),
        data=deflate_rows(rows),
        layout=LAYOUT,
        last_used_at=last_uses(rows, names, base),
    )
