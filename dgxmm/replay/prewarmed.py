"""`dgxmm replay --request ID`: what the learned policy had done to the request's model.

Under `ondemand_policy = "learned"` (issue 44) a model may be started before its request
(a pre-warm) or have its pre-warm abandoned for another model's queued request.  A request
story says so in a line of its own: "the model was pre-warmed 95 s before this request".

A request served at once by a ready model (a pre-warm that worked) names nothing in the
event log, by design; its deployment and arrival are read from the traffic trace instead
(`trace_row`), when the trace was on.  The note is about the newest start or stop before
the arrival, within `NOTE_WITHIN_S`.  Both reads are bounded: the deployment's newest
start or stop before the arrival is one indexed row, and the trace is read from the second
its gateway numbered the request, until the request is found or the trace has moved
`TRACE_SPAN_S` past the arrival of a later-numbered request.
"""

from __future__ import annotations

from events import model as m
from events.projections import duration_text
from events.traffic import TrafficRecord, decode_batch
from storage.eventlog import EventStore

IDS_PER_SECOND = 1_000_000  # as `gateway.app` numbers requests (and `commands` reads them)
TRACE_SPAN_S = 3600.0  # no request of the trace lasts longer than this past a later one
MAX_TRACE_BATCHES = 20_000  # and no more batches than this are read for one request
# A pre-warm or abandonment older than this is not what the request met: the model has
# served other requests since (or slept and woke again, which is a newer start).
NOTE_WITHIN_S = 3600.0
_POLICY_TYPES = ("StartRequested", "StopRequested", "PutToSleep")


def seconds_text(seconds: float) -> str:
    """`95 s` up to ten minutes, then as an operator would say it (`12 min`, `2 h`)."""
    return f"{round(seconds)} s" if seconds < 600 else duration_text(seconds)


def note_of(last: m.Recorded | None, arrived: float) -> str | None:
    """The line a story gets from the deployment's newest start or stop before its arrival
    (`last`); None when the learned policy had not just acted on it.  Pure."""
    if last is None or arrived - last.ts > NOTE_WITHIN_S:
        return None
    ago = seconds_text(max(0.0, arrived - last.ts))
    match last.event:
        case m.StartRequested(reason="prewarm"):
            return f"the model was pre-warmed {ago} before this request"
        case m.StopRequested(reason="prewarm_abandoned"):
            return (
                f"the model's pre-warm was abandoned {ago} before this request"
                " (another model's queued request needed its memory)"
            )
    return None


async def prewarm_notes(store: EventStore, deployment_id: str, arrived: float) -> list[str]:
    """What the learned policy had done to `deployment_id` when a request arrived."""
    newest = store.iterate(
        stream=m.deployment_stream(deployment_id),
        types=_POLICY_TYPES,
        until_ts=arrived,
        descending=True,
        limit=1,
    )
    last = [rec async for rec in newest]
    note = note_of(last[0] if last else None, arrived)
    return [] if note is None else [note]


async def trace_row(
    store: EventStore, request_id: int, until: float | None
) -> TrafficRecord | None:
    """The request's row in the traffic trace (None: not there, or the trace was off)."""
    started = request_id // IDS_PER_SECOND
    since = await store.seq_at(started - 1)
    later: float | None = None  # the earliest arrival of a request numbered after it
    read = 0
    async for rec in store.iterate(
        since_seq=since, stream=m.STREAM_TRAFFIC, types=("TrafficRecorded",), until_ts=until
    ):
        if not isinstance(rec.event, m.TrafficRecorded):
            continue
        if (later is not None and rec.ts > later + TRACE_SPAN_S) or read >= MAX_TRACE_BATCHES:
            return None
        read += 1
        for row in decode_batch(rec.event):
            if row.request_id == request_id:
                return row
            if row.request_id > request_id and (later is None or row.arrived < later):
                later = row.arrived
    return None
