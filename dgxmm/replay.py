"""`dgxmm replay`, `dgxmm events` and `dgxmm audit`: the event log read after the fact.

Everything here reads the log read-only and folds it with the same `evolve` the running
DGXMM uses, so what an operator sees is what DGXMM believed at that moment.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
from collections.abc import AsyncGenerator, Iterable
from typing import Any, Literal

import msgspec
from msgspec.structs import replace

from events import model as m
from events.projections import EventRow, audit_rows, badge, deployment_events
from events.state import (
    EMPTY,
    DeploymentState,
    IllegalTransition,
    Lifecycle,
    SystemState,
    evolve,
)
from storage.eventlog import EventStore

GIB = 1 << 30
REDACTED = "<redacted>"
QUEUE_EVENTS = (m.RequestQueued, m.RequestAdmitted, m.RequestLeftQueue)
HOLDING_MEMORY = (Lifecycle.STARTING, Lifecycle.READY, Lifecycle.STOPPING, Lifecycle.ASLEEP)
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


def parse_time(text: str) -> float:
    """ISO 8601 (`2026-11-30T10:42:00`, zone optional, naive = local) or epoch seconds."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise ValueError(f"not a time: {text!r}")
        return value
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (use ISO 8601 like 2026-11-30T10:42:00, or epoch seconds)"
        ) from None
    return parsed.timestamp()  # a naive time is taken as local time


def format_time(ts: float) -> str:
    """Local time with milliseconds and the zone offset."""
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(sep=" ", timespec="milliseconds")


def gib(n: int) -> str:
    """Bytes as GiB with one decimal."""
    return f"{n / GIB:.1f} GiB"


# --- what the commands print ------------------------------------------------------------------


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


class DeploymentView(msgspec.Struct, frozen=True, kw_only=True):
    """One deployment as replay shows it."""

    deployment_id: str
    name: str
    removed: bool
    badge: str
    lifecycle: str
    since: float
    since_time: str
    mode: str
    idle_timeout_s: int | None
    pending_mode: str | None
    engine: str
    model: str
    memory_bytes: int
    start_reason: str | None
    stop_reason: str | None
    failures: int
    retry_at: float | None
    retry_at_time: str | None
    last_error: str | None
    endpoint: str | None
    runtime_id: str | None
    queued: int
    waiting_start: int
    timeline: list[TimelineItem]


class QueueView(msgspec.Struct, frozen=True, kw_only=True):
    """A request waiting at that moment."""

    request_id: str
    deployment_id: str
    deployment: str
    kind: str
    position: int
    arrived_at: float
    arrived_time: str


class ReplayView(msgspec.Struct, frozen=True, kw_only=True):
    """The answer of `dgxmm replay`."""

    db: str
    until: float | None
    until_time: str | None
    last_seq: int
    last_time: str | None
    log_last_seq: int
    memory_held_bytes: int
    deployments: list[DeploymentView]
    queue: list[QueueView]
    settings: dict[str, Any]
    warnings: list[str]
    state: SystemState


class StoryView(msgspec.Struct, frozen=True, kw_only=True):
    """The answer of `dgxmm replay --request`."""

    db: str
    until: float | None
    request_id: str
    deployment_id: str | None
    deployment: str | None
    outcome: str
    story: list[TimelineItem]


# --- folding ----------------------------------------------------------------------------------


class Folded(msgspec.Struct, kw_only=True):
    """The state at the moment asked for, and the records timelines are made of."""

    state: SystemState = EMPTY
    # Per deployment id: its own stream and its queue events, oldest first.
    by_deployment: dict[str, list[m.Recorded]] = {}
    names: dict[str, str] = {}  # deployment id -> name (removed ones too)
    warnings: list[str] = []


async def fold_log(store: EventStore, until: float | None) -> Folded:
    """Fold the log up to `until`, keeping what the timelines need."""
    out = Folded()
    async for rec in store.iterate(until_ts=until):
        try:
            out.state = evolve(out.state, rec)
        except IllegalTransition as exc:
            # Keep going: an operator replays a log to find out what went wrong.
            out.warnings.append(f"event {rec.seq} ({rec.type}) skipped: {exc}")
            out.state = replace(out.state, last_seq=rec.seq, last_ts=rec.ts)
            continue
        ev = rec.event
        if isinstance(ev, m.DeploymentCreated):
            out.names[ev.deployment_id] = ev.name
        if isinstance(ev, QUEUE_EVENTS):
            out.by_deployment.setdefault(ev.deployment_id, []).append(rec)
        elif rec.stream.startswith("deployment:"):
            out.by_deployment.setdefault(rec.stream.partition(":")[2], []).append(rec)
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
        case m.UserCreated():
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


def queue_item(rec: m.Recorded, names: dict[str, str]) -> TimelineItem:
    """A queue record as a timeline line."""
    ev = rec.event
    assert isinstance(ev, QUEUE_EVENTS)
    return TimelineItem(
        seq=rec.seq,
        ts=rec.ts,
        time=format_time(rec.ts),
        actor=rec.actor,
        kind="queue",
        type=rec.type,
        title=queue_title(ev),
        deployment_id=ev.deployment_id,
        deployment=names.get(ev.deployment_id),
        request_id=ev.request_id,
    )


def timeline(folded: Folded, dep_id: str, last: int | None = None) -> list[TimelineItem]:
    """The Events tab of one deployment merged with its queue events (the last `last`)."""
    name = folded.names.get(dep_id)
    records = folded.by_deployment.get(dep_id, [])
    entries: list[tuple[int, EventRow | m.Recorded]] = [
        (row.seq, row) for row in deployment_events(records, dep_id, folded.names)
    ]
    entries += [(rec.seq, rec) for rec in records if isinstance(rec.event, QUEUE_EVENTS)]
    entries.sort(key=lambda entry: (entry[0], isinstance(entry[1], m.Recorded)))
    if last is not None:
        entries = entries[-last:] if last > 0 else []
    # Formatting is the slow part on a long log: only for the lines that are shown.
    items: list[TimelineItem] = []
    for _, entry in entries:
        if isinstance(entry, m.Recorded):
            items.append(queue_item(entry, folded.names))
            continue
        items.append(
            TimelineItem(
                seq=entry.seq,
                ts=entry.ts,
                time=format_time(entry.ts),
                actor=entry.actor,
                kind="event",
                type=entry.type,
                title=entry.title,
                deployment_id=dep_id,
                deployment=name,
            )
        )
    return items


def deployment_view(
    folded: Folded, dep: DeploymentState, removed: bool, last: int | None
) -> DeploymentView:
    """What replay shows of one deployment."""
    waiting = [e for e in folded.state.queue.values() if e.deployment_id == dep.deployment_id]
    queued = sum(1 for e in waiting if e.kind == "queued")
    items = timeline(folded, dep.deployment_id, last)
    return DeploymentView(
        deployment_id=dep.deployment_id,
        name=dep.name,
        removed=removed,
        badge="Removed" if removed else badge(dep, queued),
        lifecycle=dep.lifecycle.value,
        since=dep.changed_at,
        since_time=format_time(dep.changed_at),
        mode=dep.mode,
        idle_timeout_s=dep.idle_timeout_s,
        pending_mode=dep.pending_mode,
        engine=dep.engine,
        model=dep.model,
        memory_bytes=dep.memory_bytes,
        start_reason=dep.start_reason,
        stop_reason=dep.stop_reason,
        failures=dep.failures,
        retry_at=dep.retry_at,
        retry_at_time=None if dep.retry_at is None else format_time(dep.retry_at),
        last_error=dep.last_error,
        endpoint=None if dep.host is None else f"{dep.host}:{dep.port}",
        runtime_id=dep.runtime_id,
        queued=queued,
        waiting_start=len(waiting) - queued,
        timeline=items,
    )


def matches(dep: DeploymentState, wanted: str | None) -> bool:
    """Whether `--deployment` selects `dep` (by name or id)."""
    return wanted is None or wanted in (dep.name, dep.deployment_id)


def replay_view(
    folded: Folded, db: str, until: float | None, log_last_seq: int, args: argparse.Namespace
) -> ReplayView:
    """The state at `until` and the timelines that led there."""
    state = folded.state
    wanted: str | None = args.deployment
    views = [
        deployment_view(folded, dep, False, args.last)
        for dep in sorted(state.deployments.values(), key=lambda d: (d.name, d.deployment_id))
        if matches(dep, wanted)
    ]
    views += [
        deployment_view(folded, dep, True, args.last)
        for dep in sorted(state.removed.values(), key=lambda d: (d.name, d.deployment_id))
        if dep.deployment_id not in state.deployments and matches(dep, wanted)
    ]
    if wanted is not None and not views:
        raise NotInLog(f"no deployment named {wanted!r} in the log{_until_text(until)}")
    queue = [
        QueueView(
            request_id=e.request_id,
            deployment_id=e.deployment_id,
            deployment=folded.names.get(e.deployment_id, e.deployment_id),
            kind=e.kind,
            position=e.position,
            arrived_at=e.arrived_at,
            arrived_time=format_time(e.arrived_at),
        )
        for e in sorted(state.queue.values(), key=lambda e: (e.arrived_at, e.request_id))
        if wanted is None or wanted in (e.deployment_id, folded.names.get(e.deployment_id))
    ]
    held = sum(d.memory_bytes for d in state.deployments.values() if d.lifecycle in HOLDING_MEMORY)
    return ReplayView(
        db=db,
        until=until,
        until_time=None if until is None else format_time(until),
        last_seq=state.last_seq,
        last_time=format_time(state.last_ts) if state.last_seq else None,
        log_last_seq=log_last_seq,
        memory_held_bytes=held,
        deployments=views,
        queue=queue,
        settings=dict(state.settings),
        warnings=list(folded.warnings),
        state=redact(state),
    )


def story_view(folded: Folded, db: str, until: float | None, request_id: str) -> StoryView:
    """One request's story: its queue events and the starts and sleeps around it."""
    own: list[m.Recorded] = []
    started_for: list[m.Recorded] = []
    for records in folded.by_deployment.values():
        for rec in records:
            ev = rec.event
            if isinstance(ev, QUEUE_EVENTS) and ev.request_id == request_id:
                own.append(rec)
            elif isinstance(ev, m.StartRequested) and ev.request_id == request_id:
                started_for.append(rec)
    own.sort(key=lambda rec: rec.seq)
    started_for.sort(key=lambda rec: rec.seq)
    if not own and not started_for:
        raise NotInLog(
            f"request {request_id!r} is not in the log{_until_text(until)}"
            " (only requests that waited are recorded)"
        )
    first = min(r.seq for r in own + started_for)
    left = [r for r in own if isinstance(r.event, m.RequestLeftQueue)]
    last = max(r.seq for r in left) if left else folded.state.last_seq
    dep_id: str | None = None
    if own:
        ev = own[0].event
        assert isinstance(ev, QUEUE_EVENTS)
        dep_id = ev.deployment_id
    else:
        dep_id = started_for[0].stream.partition(":")[2]
    items = [queue_item(rec, folded.names) for rec in own]
    # Starts, sleeps and evictions of every deployment while the request waited.
    started_seqs = {r.seq for r in started_for}
    for other in sorted(folded.by_deployment):
        name = folded.names.get(other)
        for row in deployment_events(folded.by_deployment[other], other, folded.names):
            if first <= row.seq <= last or row.seq in started_seqs:
                items.append(
                    TimelineItem(
                        seq=row.seq,
                        ts=row.ts,
                        time=format_time(row.ts),
                        actor=row.actor,
                        kind="event",
                        type=row.type,
                        title=row.title,
                        deployment_id=other,
                        deployment=name,
                    )
                )
    items.sort(key=lambda item: item.seq)
    if left:
        ev = left[-1].event
        assert isinstance(ev, m.RequestLeftQueue)
        outcome = f"left the queue: {LEAVE_TEXT.get(ev.reason, ev.reason)}"
    elif own:
        outcome = "still waiting at that time"
    else:
        outcome = "did not wait in the queue"
    return StoryView(
        db=db,
        until=until,
        request_id=request_id,
        deployment_id=dep_id,
        deployment=None if dep_id is None else folded.names.get(dep_id),
        outcome=outcome,
        story=items,
    )


def _until_text(until: float | None) -> str:
    return "" if until is None else f" up to {format_time(until)}"


# --- text rendering ---------------------------------------------------------------------------


def render_replay(view: ReplayView) -> Iterable[str]:
    """The replay as text lines."""
    at = view.until_time or "the end of the log"
    last = f"event {view.last_seq} of {view.log_last_seq}"
    if view.last_time is not None:
        last += f", {view.last_time}"
    yield f"{view.db}: state at {at} ({last})"
    if not view.deployments:
        yield "no deployments at that time"
    for d in view.deployments:
        yield ""
        yield f"{d.name} ({d.deployment_id}): {d.badge}"
        state = f"{d.lifecycle} since {d.since_time}"
        if d.lifecycle in ("stopping", "stopped") and d.stop_reason:
            state += f" (stop reason: {d.stop_reason})"
        elif d.lifecycle in ("starting", "ready") and d.start_reason:
            state += f" (start reason: {d.start_reason})"
        yield f"  state      {state}"
        mode = "on demand" if d.mode == "on_demand" else "always on"
        if d.mode == "on_demand":
            idle = "default" if d.idle_timeout_s is None else f"{d.idle_timeout_s} s"
            mode += f", idle timeout {idle}"
        if d.pending_mode is not None:
            mode += f"; switching to {d.pending_mode.replace('_', ' ')} once ready"
        yield f"  mode       {mode}"
        yield f"  engine     {d.engine}, model {d.model}, memory {gib(d.memory_bytes)}"
        if d.endpoint is not None:
            yield f"  running    at {d.endpoint} ({d.runtime_id})"
        if d.failures or d.last_error:
            fail = f"{d.failures} failed start(s)"
            if d.retry_at_time is not None:
                fail += f", no new start before {d.retry_at_time}"
            if d.last_error:
                fail += f"; last error: {d.last_error}"
            yield f"  failures   {fail}"
        if d.queued or d.waiting_start:
            yield f"  queue      {d.queued} queued for memory, {d.waiting_start} waiting for start"
        if d.timeline:
            yield "  timeline"
            for item in d.timeline:
                yield f"    {item.time}  {item.actor:<12} {item.title}"
    yield ""
    yield f"memory held by engines: {gib(view.memory_held_bytes)}"
    if view.queue:
        yield f"queue: {len(view.queue)} waiting"
        for q in view.queue:
            waits = "queued for memory" if q.kind == "queued" else "waiting for start"
            yield (
                f"  {q.request_id} for {q.deployment}: {waits}, position {q.position},"
                f" arrived {q.arrived_time}"
            )
    else:
        yield "queue: empty"
    if view.settings:
        changed = ", ".join(f"{k}={v}" for k, v in sorted(view.settings.items()))
        yield f"settings changed from the defaults: {changed}"
    for warning in view.warnings:
        yield f"warning: {warning}"


def render_story(view: StoryView) -> Iterable[str]:
    """A request's story as text lines."""
    target = view.deployment or view.deployment_id or "?"
    yield f"request {view.request_id} for {target}: {view.outcome}"
    for item in view.story:
        who = "queue" if item.kind == "queue" else (item.deployment or item.deployment_id or "")
        yield f"  {item.time}  {item.actor:<12} {who:<16} {item.title}"


def event_line(rec: m.Recorded) -> str:
    """One event as a line of text."""
    data = msgspec.to_builtins(rec.event)
    data.pop("type", None)
    body = msgspec.json.encode(data).decode()
    return (
        f"{rec.seq:>7} {format_time(rec.ts)} {rec.stream} v{rec.version} {rec.actor}"
        f" {rec.type} {body}"
    )


# --- the commands -----------------------------------------------------------------------------


def write_lines(lines: Iterable[str]) -> None:
    """Print lines to stdout."""
    out = sys.stdout
    for line in lines:
        out.write(line)
        out.write("\n")


async def replay_command(args: argparse.Namespace) -> int:
    """`dgxmm replay`."""
    until: float | None = args.until
    store = await EventStore.open(args.db, create=False, readonly=True)
    try:
        folded = await fold_log(store, until)
        log_last_seq = await store.last_seq()
    finally:
        await store.close()
    if args.request is not None:
        story = story_view(folded, args.db, until, args.request)
        if args.json:
            write_lines([msgspec.json.format(msgspec.json.encode(story), indent=2).decode()])
        else:
            write_lines(render_story(story))
        return 0
    view = replay_view(folded, args.db, until, log_last_seq, args)
    if args.json:
        write_lines([msgspec.json.format(msgspec.json.encode(view), indent=2).decode()])
    else:
        write_lines(render_replay(view))
    return 0


async def events_command(args: argparse.Namespace) -> int:
    """`dgxmm events`."""
    store = await EventStore.open(args.db, create=False, readonly=True)
    try:
        records = store.follow() if args.follow else store.iterate()
        out = sys.stdout
        try:
            async for rec in records:
                rec = redact_record(rec)
                out.write(m.encode_recorded(rec).decode() if args.json else event_line(rec))
                out.write("\n")
                if args.follow:
                    out.flush()
        finally:
            # Closed before the store, also when the reader went away (`| head`).
            if isinstance(records, AsyncGenerator):
                await records.aclose()
    finally:
        await store.close()
    return 0


async def audit_command(args: argparse.Namespace) -> int:
    """`dgxmm audit`."""
    since: float | None = args.since
    wanted: str | None = args.deployment
    names: dict[str, str] = {}
    auditable: list[m.Recorded] = []
    store = await EventStore.open(args.db, create=False, readonly=True)
    try:
        async for rec in store.iterate():
            ev = rec.event
            if isinstance(ev, m.DeploymentCreated):
                names[ev.deployment_id] = ev.name
            # Queue events are audited only as timeouts; leaving the rest out keeps a long log
            # out of memory and changes no row.
            if isinstance(ev, QUEUE_EVENTS) and not (
                isinstance(ev, m.RequestLeftQueue) and ev.reason == "timeout"
            ):
                continue
            auditable.append(rec)
    finally:
        await store.close()
    targets: set[str] | None = None
    if wanted is not None:
        targets = {
            m.deployment_stream(dep_id)
            for dep_id, name in names.items()
            if wanted in (dep_id, name)
        }
        if not targets:
            raise NotInLog(f"no deployment named {wanted!r} in the log")
    out = sys.stdout
    for row in audit_rows(auditable):
        if since is not None and row.ts < since:
            continue
        if targets is not None and row.target not in targets:
            continue
        dep_id = row.target.partition(":")[2] if row.target.startswith("deployment:") else None
        name = None if dep_id is None else names.get(dep_id)
        if args.json:
            line = msgspec.json.encode(
                {
                    "seq": row.seq,
                    "ts": row.ts,
                    "time": format_time(row.ts),
                    "actor": row.actor,
                    "action": row.action,
                    "target": row.target,
                    "deployment": name,
                    "details": row.details,
                }
            ).decode()
        else:
            target = row.target if name is None else f"{name} ({dep_id})"
            details = " ".join(f"{k}={v}" for k, v in row.details.items())
            line = f"{format_time(row.ts)}  {row.actor:<14} {row.action:<24} {target}"
            if details:
                line += f"  {details}"
        out.write(line)
        out.write("\n")
    return 0
