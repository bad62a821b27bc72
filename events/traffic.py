"""The traffic trace's rows and their encoding (`TrafficRecorded.data`).

One request is one packed row of 22 bytes (`ROW`, little-endian): the deployment's index in
the batch's list, `outcome << 1 | streamed`, the request id's delta from the previous row's
(rows come in the order requests ended), and four float32 seconds: the arrival from the
batch's base time, the wait (arrival to lease), the time to the first byte of the answer
(-1: none came) and the whole duration (arrival to end).  The gateway packs a row with one C
call and appends it to a bytearray (`gateway.trace`): no object per request lives on, which
keeps the garbage collector out of it; a batch is those bytes deflated (level 1: ids that
count by one and times near each other shrink), base64 in the log's JSON.
"""

from __future__ import annotations

import struct
import zlib

import msgspec

from events.model import TrafficRecorded

# The outcome codes, in the order of their numbers (the schema only grows: append).
OUTCOMES = ("served", "engine_error", "client_gone", "queue_full", "queue_timeout", "refused")
SERVED, ENGINE_ERROR, CLIENT_GONE, QUEUE_FULL, QUEUE_TIMEOUT, REFUSED = range(len(OUTCOMES))

ROW = struct.Struct("<BBiffff")
MAX_DEPLOYMENTS = 255  # per batch: the index is one byte


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


def decode_batch(event: TrafficRecorded) -> list[TrafficRecord]:
    """The records of one batch, in the order they ended."""
    names, base, rid = event.deployments, event.base_time, event.base_id
    last = len(OUTCOMES)
    records: list[TrafficRecord] = []
    rows = ROW.iter_unpack(zlib.decompress(event.data))
    for index, flags, delta, arrived, wait, first, duration in rows:
        rid += delta
        code = flags >> 1
        records.append(
            TrafficRecord(
                request_id=rid,
                deployment_id=names[index],
                arrived=base + arrived,
                wait_s=max(0.0, wait),
                ttfb_s=None if first < 0 else first,
                duration_s=max(0.0, duration),
                outcome=OUTCOMES[code] if code < last else "refused",
                streamed=bool(flags & 1),
            )
        )
    return records


def counts_as_use(outcome: int, first: float) -> bool:
    """Whether a row's request used its deployment: it reached the engine (served, or the
    engine failed it), or an answer began before the client left."""
    return outcome in (SERVED, ENGINE_ERROR) or first >= 0


def last_uses(rows: bytes | bytearray, names: list[str], base_time: float) -> dict[str, float]:
    """Per deployment of a batch (`names`), when its newest request that used it ended, in
    epoch seconds, from the rows as packed (undeflated).  Rows come in the order requests
    ended, so the scan runs from the last row back and stops once every name is found."""
    found: dict[str, float] = {}
    unpack, size = ROW.unpack_from, ROW.size
    for offset in range(len(rows) - size, -1, -size):
        index, flags, _, arrived, _, first, duration = unpack(rows, offset)
        name = names[index]
        if name not in found and counts_as_use(flags >> 1, first):
            found[name] = base_time + arrived + duration
            if len(found) == len(names):
                break
    return found


def encode_batch(records: list[TrafficRecord]) -> TrafficRecorded:
    """A batch made of whole records (synthesised traces, tests); the gateway packs its rows
    itself (`gateway.trace`), the same `ROW`s."""
    names = list(dict.fromkeys(r.deployment_id for r in records))
    index = {n: i for i, n in enumerate(names)}
    base = records[0].arrived if records else 0.0
    base_id = records[0].request_id if records else 0
    out = bytearray()
    last = base_id
    for r in records:
        code = OUTCOMES.index(r.outcome) if r.outcome in OUTCOMES else REFUSED
        out += ROW.pack(
            index[r.deployment_id], code << 1 | r.streamed, r.request_id - last, r.arrived - base,
            r.wait_s, -1.0 if r.ttfb_s is None else r.ttfb_s, r.duration_s,
        )  # fmt: skip
        last = r.request_id
    return TrafficRecorded(
        deployments=names,
        base_time=base,
        base_id=base_id,
        count=len(records),
        data=zlib.compress(out, 1),
        last_used_at=last_uses(out, names, base),
    )
