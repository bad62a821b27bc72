"""The event log read for people: times, names, redaction, folding and timelines, streamed.

Shared by `dgxmm replay`, `dgxmm events` and `dgxmm audit` (`dgxmm.replay`).  Nothing here
holds the log in memory: the state is the newest snapshot before the moment asked for plus
the events after it, and timelines come from indexed queries, oldest first or the last N.
"""

from __future__ import annotations

import collections
import datetime as dt
import heapq
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Literal

import msgspec
from msgspec.structs import replace

from events import model as m
from events.projections import EventRow, Projector
from events.state import EMPTY, DeploymentState, IllegalTransition, SystemState, evolve
from storage.eventlog import EventStore

GIB = 1 << 30
REDACTED = "<redacted>"
MAX_WARNINGS = 100
QUEUE_EVENTS = (m.RequestQueued, m.RequestAdmitted, m.RequestLeftQueue)
LEAVE_TEXT = {
    "served": "served",
    "client_gone": "the client hung up",
    "timeout": "timed out",
    "stopped": "its model was stopped by an administrator",
    "start_failed": "its model could not start",
    "does_not_fit": "its model can never fit",
    "removed": "its deployment was removed",
}


class NotInLog(Exception):
    """The log has no such deployment or request (at that time)."""


# --- time -----------------------------------------------------------------------------------


_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_time(text: str, now: float | None = None) -> float:
    """ISO 8601 (`2026-11-30T10:42:00`, zone optional, naive = local), epoch seconds, a time
    of today (`17:30`, `17:30:15`, local), or a time before `now` (default: the clock):
    `-2h`, `-30m`, `-90s`, `-1d`."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise ValueError(f"not a time: {text!r}")
        return value
    if now is None:
        now = time.time()
    if text[:1] == "-" and text[-1:] in _UNIT_S:
        try:
            amount = float(text[1:-1])
        except ValueError:
            amount = math.nan
        if math.isfinite(amount) and amount >= 0:
            return now - amount * _UNIT_S[text[-1]]
    try:
        of_day = dt.time.fromisoformat(text) if ":" in text and len(text) <= 8 else None
    except ValueError:
        of_day = None
    if of_day is not None:
        today = dt.datetime.fromtimestamp(now).date()
        return dt.datetime.combine(today, of_day).timestamp()  # local, as a naive time
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (use ISO 8601 like 2026-11-30T10:42:00, a time of today "
            "like 17:30, a time ago like -2h (s, m, h, d), or epoch seconds)"
        ) from None
    return parsed.timestamp()  # a naive time is taken as local time


_second_cache: dict[int, tuple[str, str]] = {}


def _slow_time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(sep=" ", timespec="milliseconds")


def format_time(ts: float) -> str:
    """Local time with milliseconds and the zone offset."""
    # Formatting dominates a long replay: the date, time and zone are computed once a second.
    sec = math.floor(ts)
    us = round((ts - sec) * 1e6)
    if us >= 1_000_000:
        return _slow_time(ts)
    cached = _second_cache.get(sec)
    if cached is None:
        whole = _slow_time(float(sec))  # "YYYY-MM-DD HH:MM:SS.000+ZZ:ZZ"
        cached = (whole[:19], whole[23:])
        if len(_second_cache) >= 4096:
            _second_cache.clear()
        _second_cache[sec] = cached
    return f"{cached[0]}.{us // 1000:03d}{cached[1]}"


def relative_time(ts: float, reference: float) -> str:
    """`ts` as a distance from `reference`: `2 h 05 min ago`, `12.0 s ago`, `in 3.0 s`."""
    delta = reference - ts
    span = abs(delta)
    if span < 60:
        text = f"{span:.1f} s"
    elif span < 3600:
        text = f"{int(span // 60)} min {int(span % 60):02d} s"
    elif span < 86400:
        text = f"{int(span // 3600)} h {int(span % 3600 // 60):02d} min"
    else:
        text = f"{int(span // 86400)} d {int(span % 86400 // 3600):02d} h"
    return f"{text} ago" if delta >= 0 else f"in {text}"


def time_formatter(
    relative: bool, reference: float | None = None, *, live: bool = False
) -> Callable[[float], str]:
    """Absolute local times, or distances from `reference` (now when None; with `live`, the
    moment each line is written, for events that happen after the command began)."""
    if not relative:
        return format_time
    if live:
        return lambda ts: relative_time(ts, time.time())
    ref = time.time() if reference is None else reference
    return lambda ts: relative_time(ts, ref)


def gib(n: int) -> str:
    """Bytes as GiB with one decimal."""
    return f"{n / GIB:.1f} GiB"


# --- timelines -----------------------------------------------------------------------------


class TimelineItem(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a timeline: an Events-tab row or a queue event."""

    seq: int
    ts: float
    time: str
    actor: str
    kind: Literal["event", "queue"]
    type: str
    title: str
    deployment_id: str | None = None
    deployment: str | None = None
    request_id: str | None = None


# --- folding ----------------------------------------------------------------------------------


class Folded(msgspec.Struct, kw_only=True):
    """The state at the moment asked for, and what went wrong on the way."""

    state: SystemState = EMPTY
    warnings: list[str] = []
    more_warnings: int = 0

    def names(self) -> dict[str, str]:
        """Deployment id -> name, removed ones too."""
        return {
            **{k: d.name for k, d in self.state.removed.items()},
            **{k: d.name for k, d in self.state.deployments.items()},
        }


async def fold_log(store: EventStore, until: float | None) -> Folded:
    """The newest snapshot before `until` plus the events after it, folded (streamed)."""
    out = Folded(state=await store.latest_snapshot(until_ts=until) or EMPTY)
    async for rec in store.iterate(since_seq=out.state.last_seq, until_ts=until):
        try:
            out.state = evolve(out.state, rec)
        except IllegalTransition as exc:
            # Keep going: an operator replays a log to find out what went wrong.
            if len(out.warnings) < MAX_WARNINGS:
                out.warnings.append(f"event {rec.seq} ({rec.type}) skipped: {exc}")
            else:
                out.more_warnings += 1
            out.state = replace(out.state, last_seq=rec.seq, last_ts=rec.ts)
    return out


def redact(state: SystemState) -> SystemState:
    """The state without password and token hashes (they have no place on a terminal)."""
    users = {
        name: replace(
            user,
            password_hash=REDACTED,
            tokens=dict.fromkeys(user.tokens, REDACTED),
        )
        for name, user in state.users.items()
    }
    return replace(state, users=users)


def redact_record(rec: m.Recorded) -> m.Recorded:
    """The record without the password or token hash it may carry."""
    match rec.event:
        case m.UserCreated() | m.PasswordChanged():
            return replace(rec, event=replace(rec.event, password_hash=REDACTED))
        case m.ApiTokenCreated():
            return replace(rec, event=replace(rec.event, token_hash=REDACTED))
    return rec


def queue_title(ev: m.RequestQueued | m.RequestAdmitted | m.RequestLeftQueue) -> str:
    """A queue event in words."""
    match ev:
        case m.RequestQueued():
            waits = "waiting for memory" if ev.kind == "queued" else "waiting for its start"
            return (
                f"Request {ev.request_id} queued at position {ev.position}, {waits}"
                f" ({gib(ev.free_bytes)} free, needs {gib(ev.needed_bytes)})"
            )
        case m.RequestAdmitted():
            ahead = " ahead of the head (it fit in free memory)" if ev.jumped_ahead else ""
            return f"Request {ev.request_id} admitted{ahead}"
        case m.RequestLeftQueue():
            why = LEAVE_TEXT.get(ev.reason, ev.reason)
            return f"Request {ev.request_id} left the queue: {why} after {ev.waited_s:.1f} s"


def queue_item(rec: m.Recorded, names: dict[str, str], fmt: Callable[[float], str]) -> TimelineItem:
    """A queue record as a timeline line."""
    ev = rec.event
    assert isinstance(ev, QUEUE_EVENTS)
    return TimelineItem(
        seq=rec.seq,
        ts=rec.ts,
        time=fmt(rec.ts),
        actor=rec.actor,
        kind="queue",
        type=rec.type,
        title=queue_title(ev),
        deployment_id=ev.deployment_id,
        deployment=names.get(ev.deployment_id),
        request_id=ev.request_id,
    )


def event_item(
    row: EventRow, dep_id: str, name: str | None, fmt: Callable[[float], str]
) -> TimelineItem:
    """An Events-tab row as a timeline line."""
    return TimelineItem(
        seq=row.seq,
        ts=row.ts,
        time=fmt(row.ts),
        actor=row.actor,
        kind="event",
        type=row.type,
        title=row.title,
        deployment_id=dep_id,
        deployment=name,
    )


async def merged(*sources: AsyncIterator[m.Recorded]) -> AsyncIterator[m.Recorded]:
    """Records of several seq-ordered streams, in seq order."""
    heads: list[tuple[int, int, m.Recorded]] = []
    for i, src in enumerate(sources):
        first = await anext(src, None)
        if first is not None:
            heads.append((first.seq, i, first))
    heapq.heapify(heads)
    while heads:
        _, i, rec = heads[0]
        yield rec
        following = await anext(sources[i], None)
        if following is None:
            heapq.heappop(heads)
        else:
            heapq.heapreplace(heads, (following.seq, i, following))


async def timeline(
    store: EventStore,
    dep_id: str,
    names: dict[str, str],
    until_seq: int,
    fmt: Callable[[float], str],
) -> AsyncIterator[TimelineItem]:
    """One deployment's Events tab merged with its queue events, oldest first (streamed)."""
    own = store.iterate(stream=m.deployment_stream(dep_id), until_seq=until_seq)
    queue = store.iterate(queue_of=dep_id, until_seq=until_seq)
    projector = Projector(names)
    name = names.get(dep_id)
    async for rec in merged(own, queue):
        _, tabs = projector.apply(rec)
        for tab in tabs:
            if tab.deployment_id == dep_id and not tab.made_room:
                yield event_item(tab.row, dep_id, name, fmt)
        if isinstance(rec.event, QUEUE_EVENTS):
            yield queue_item(rec, names, fmt)


async def recent_timeline(
    store: EventStore,
    dep_id: str,
    names: dict[str, str],
    until_seq: int,
    last: int,
    fmt: Callable[[float], str],
) -> list[TimelineItem]:
    """The last `last` lines of one deployment's timeline, oldest first.

    From the Events-tab read model and the queue index, newest first: O(last) however long
    the log.  A log whose read models are missing or behind (never opened by this version
    of `serve`) is streamed through a window of `last` lines instead: O(log) time, still
    O(last) memory.
    """
    if last <= 0:
        return []
    if not store.readmodels_current():
        window: collections.deque[TimelineItem] = collections.deque(maxlen=last)
        async for item in timeline(store, dep_id, names, until_seq, fmt):
            window.append(item)
        return list(window)
    name = names.get(dep_id)
    rows = await store.timeline_page(dep_id, before=until_seq + 1, limit=last)
    items = [event_item(row, dep_id, name, fmt) for row in rows]
    async for rec in store.iterate(
        queue_of=dep_id, until_seq=until_seq, descending=True, limit=last
    ):
        items.append(queue_item(rec, names, fmt))
    # A queue timeout is both a queue line and an Events-tab line: the tab's comes first.
    items.sort(key=lambda item: (item.seq, item.kind == "queue"))
    return items[-last:]


def matches(dep: DeploymentState, wanted: str | None) -> bool:
    """Whether `--deployment` selects `dep` (by name or id)."""
    return wanted is None or wanted in (dep.name, dep.deployment_id)


def chosen(state: SystemState, wanted: str | None) -> list[tuple[DeploymentState, bool]]:
    """The deployments replay shows, live ones first, each with whether it was removed."""
    live = sorted(state.deployments.values(), key=lambda d: (d.name, d.deployment_id))
    gone = sorted(state.removed.values(), key=lambda d: (d.name, d.deployment_id))
    return [(d, False) for d in live if matches(d, wanted)] + [
        (d, True) for d in gone if d.deployment_id not in state.deployments and matches(d, wanted)
    ]


def until_text(until: float | None) -> str:
    return "" if until is None else f" up to {format_time(until)}"


def human_field(key: str, value: Any, names: dict[str, str]) -> tuple[str, Any]:
    """An event field for people: sizes in GiB, deployments by name."""
    if key.endswith("_bytes") and isinstance(value, int):
        return key.removesuffix("_bytes"), gib(value)
    if key in ("deployment_id", "for_deployment") and isinstance(value, str):
        return key.removesuffix("_id"), names.get(value, value)
    return key, value


def event_line(rec: m.Recorded, names: dict[str, str], fmt: Callable[[float], str]) -> str:
    """One event as a line of text, with names and human sizes."""
    data = msgspec.to_builtins(rec.event)
    data.pop("type", None)
    body = dict(human_field(k, v, names) for k, v in data.items())
    where = rec.stream
    if where.startswith("deployment:"):
        dep_id = where.partition(":")[2]
        where = f"{names[dep_id]} ({dep_id})" if dep_id in names else where
    text = msgspec.json.encode(body).decode()
    return f"{rec.seq:>7} {fmt(rec.ts)} {where} v{rec.version} {rec.actor} {rec.type} {text}"


def write_lines(lines: Iterable[str]) -> None:
    """Print lines to stdout."""
    out = sys.stdout
    for line in lines:
        out.write(line)
        out.write("\n")
