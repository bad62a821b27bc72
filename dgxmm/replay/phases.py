"""`dgxmm replay --request ID`: where the wait of a request that waited for a start went.

Reads the few events of the start that served the request (its `StartRequested`, the
`EngineStarting` with the launch's beginning, the engine's milestones, `EngineReady`), the
models put to sleep to make room for it with their drain times, and the request's own
`RequestQueued` and `FirstByteRelayed` (not in the request index, whose partial index
predates it: it is looked for on the queue stream just after the request was served); the
cutting into phases is the pure
`events.cold_start.request_phases`.  Every read is bounded (`LOOKBACK`).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from actors.cold_start import newest_events
from events import model as m
from events.cold_start import MILESTONES, Phase, StartMarks, Victim, marks_of, request_phases
from storage.eventlog import EventStore

FIRST_BYTE_WITHIN = 100_000  # events after a request was served in which its first byte is
LOOKBACK = 256  # deployment events read back from the first byte to find its start
VICTIM_LOOKBACK = 64  # events before the start in which its victims were put to sleep
VICTIM_SLACK_S = 5.0  # a victim is put to sleep around its start's request, not long before
_START_TYPES = ("StartRequested", "EngineStarting", "EngineMilestoneReached", "EngineReady")


class WaitView(msgspec.Struct, frozen=True, kw_only=True):
    """A waited request's wait, cut into phases that add up to it."""

    deployment_id: str
    wait_s: float  # arrival to the first byte, as the gateway measured it
    phases: list[Phase]


async def request_wait(
    store: EventStore, named: Iterable[m.Recorded], names: dict[str, str]
) -> WaitView | None:
    """The request's phases, or None when it got no first byte (or never waited)."""
    queued = served = None
    for rec in named:
        if isinstance(rec.event, m.RequestQueued) and queued is None:
            queued = rec.event
        elif isinstance(rec.event, m.RequestLeftQueue) and rec.event.reason == "served":
            served = rec.seq
    if queued is None or served is None:
        return None
    first_byte = await _first_byte(store, queued.request_id, served)
    if first_byte is None or not isinstance(first_byte.event, m.FirstByteRelayed):
        return None
    dep_id = queued.deployment_id
    start, start_seq = await _start_marks(store, dep_id, first_byte.seq)
    if start_seq is not None and start.requested_at is not None:
        victims = await _victims(
            store, dep_id, start_seq, first_byte.seq, start.requested_at, names
        )
        start = msgspec.structs.replace(start, victims=victims)
    phases = request_phases(
        queued.arrived_at, first_byte.event.at, queued=queued.kind == "queued", start=start
    )
    return WaitView(deployment_id=dep_id, wait_s=first_byte.event.waited_s, phases=phases)


async def _first_byte(store: EventStore, request_id: str, served_seq: int) -> m.Recorded | None:
    """The request's `FirstByteRelayed`: on the queue stream, just after it was served."""
    async for rec in store.iterate(
        stream=m.STREAM_QUEUE,
        since_seq=served_seq,
        until_seq=served_seq + FIRST_BYTE_WITHIN,
        types=("FirstByteRelayed",),
    ):
        if isinstance(rec.event, m.FirstByteRelayed) and rec.event.request_id == request_id:
            return rec
    return None


async def _start_marks(
    store: EventStore, dep_id: str, until_seq: int
) -> tuple[StartMarks, int | None]:
    """The marks of the last start of `dep_id` before `until_seq`, and its seq."""
    oldest_first = await newest_events(store, dep_id, _START_TYPES, LOOKBACK, until_seq)
    chosen: list[m.Recorded] = []
    for rec in reversed(oldest_first):
        chosen.append(rec)
        if isinstance(rec.event, m.StartRequested):
            break
    else:
        return StartMarks(), None
    start_seq = chosen[-1].seq
    # A milestone read just after ready may be recorded after the first byte (at ready).
    late = [
        rec
        async for rec in store.iterate(
            stream=m.deployment_stream(dep_id),
            since_seq=until_seq,
            types=("EngineMilestoneReached", "StartRequested"),
            limit=len(MILESTONES) + 1,
        )
    ]
    ends = next((i for i, r in enumerate(late) if isinstance(r.event, m.StartRequested)), None)
    return marks_of([*reversed(chosen), *late[:ends]]), start_seq


async def _victims(
    store: EventStore,
    dep_id: str,
    start_seq: int,
    until_seq: int,
    requested_at: float,
    names: dict[str, str],
) -> list[Victim]:
    """The models put to sleep to make room for this start, each with its drain time."""
    put: dict[str, m.Recorded] = {}
    stopped: dict[str, float] = {}
    async for rec in store.iterate(
        since_seq=max(0, start_seq - VICTIM_LOOKBACK),
        until_seq=until_seq,
        types=("PutToSleep", "EngineStopped"),
    ):
        victim = rec.stream.partition(":")[2]
        ev = rec.event
        if (
            isinstance(ev, m.PutToSleep)
            and ev.reason == "make_room"
            and ev.for_deployment == dep_id
            and rec.ts >= requested_at - VICTIM_SLACK_S
        ):
            put[victim] = rec
        elif isinstance(ev, m.EngineStopped) and victim in put and victim not in stopped:
            stopped[victim] = rec.ts
    return [
        Victim(
            deployment_id=victim,
            name=names.get(victim, victim),
            drain_s=None if victim not in stopped else round(stopped[victim] - rec.ts, 3),
        )
        for victim, rec in put.items()
    ]


def render_wait(wait: WaitView) -> Iterable[str]:
    """The phases as text lines: name, seconds, share of the wait, detail."""
    total = sum(p.seconds for p in wait.phases)
    yield f"  wait {wait.wait_s:.3f} s from arrival to the first byte, in phases:"
    for p in wait.phases:
        share = p.seconds / total * 100 if total > 0 else 0.0
        detail = f"  ({p.detail})" if p.detail else ""
        yield f"    {p.name:<20} {p.seconds:9.3f} s  {share:5.1f} %{detail}"
    yield f"    {'total':<20} {total:9.3f} s"
