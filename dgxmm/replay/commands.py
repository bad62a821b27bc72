"""`dgxmm replay`, `dgxmm events` and `dgxmm audit`: the event log read after the fact.

Everything here reads the log read-only and folds it with the same `evolve` the running
DGXMM uses, so what an operator sees is what DGXMM believed at that moment.  Nothing here
holds the log in memory: the state comes from the newest snapshot before the moment asked
for plus the events after it, timelines and audit rows are streamed from indexed queries,
and `--json` writes JSON lines as it goes.  Memory does not grow with the log's length.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec

from dgxmm.replay.logview import (
    LEAVE_TEXT,
    QUEUE_EVENTS,
    Folded,
    NotInLog,
    TimelineItem,
    chosen,
    event_item,
    event_line,
    fold_log,
    format_time,
    gib,
    merged,
    queue_item,
    recent_timeline,
    redact,
    redact_record,
    time_formatter,
    timeline,
    until_text,
    write_lines,
)
from dgxmm.replay.phases import WaitView, render_wait, request_wait
from dgxmm.replay.prewarmed import prewarm_notes, trace_row
from events import model as m
from events.projections import AUDITED_TYPES, AuditRow, Projector, badge
from events.state import EMPTY, DeploymentState, Lifecycle, SystemState
from storage.archive import archive_queue_events
from storage.eventlog import EventStore
from storage.readmodels import AuditFilter

DEFAULT_LAST = 50  # timeline lines per deployment unless --last or --all
MAX_STORY = 5_000  # deployment events shown around one request
HOLDING_MEMORY = (Lifecycle.STARTING, Lifecycle.READY, Lifecycle.STOPPING, Lifecycle.ASLEEP)
# The gateway numbers requests with decimal integers (`x-dgxmm-request-id`): its start
# second times IDS_PER_SECOND plus a counter (`gateway.app`).
GATEWAY_REQUEST_ID = re.compile(r"[0-9]{1,20}")
IDS_PER_SECOND = 1_000_000
STARTUP_SLACK_S = 60  # a new log's first event may be written after its gateway started
SERVED_AT_ONCE = "served at once (a request to a ready model records nothing by design)"


# --- what the commands print ----------------------------------------------------------------


class DeploymentView(msgspec.Struct, frozen=True, kw_only=True):
    """One deployment as replay shows it (its timeline follows as separate lines)."""

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
    ondemand_policy: str | None = None  # its own (issue 44); None: the DGXMM default


class QueueView(msgspec.Struct, frozen=True, kw_only=True):
    """A request waiting at that moment."""

    request_id: str
    deployment_id: str
    deployment: str
    kind: str
    position: int
    arrived_at: float
    arrived_time: str


class ReplayHead(msgspec.Struct, frozen=True, kw_only=True):
    """The first part of `dgxmm replay`: the moment, memory, settings and the whole state."""

    db: str
    until: float | None
    until_time: str | None
    last_seq: int
    last_time: str | None
    log_last_seq: int
    memory_held_bytes: int
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
    wait: WaitView | None = None  # a request that waited for a start: its phases
    # What the learned policy had done to its model (`dgxmm.replay.prewarmed`), in words.
    notes: list[str] = []


def deployment_view(
    state: SystemState, dep: DeploymentState, removed: bool, fmt: Callable[[float], str]
) -> DeploymentView:
    """What replay shows of one deployment."""
    waiting = [e for e in state.queue.values() if e.deployment_id == dep.deployment_id]
    queued = sum(1 for e in waiting if e.kind == "queued")
    return DeploymentView(
        deployment_id=dep.deployment_id,
        name=dep.name,
        removed=removed,
        badge="Removed" if removed else badge(dep, queued),
        lifecycle=dep.lifecycle.value,
        since=dep.changed_at,
        since_time=fmt(dep.changed_at),
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
        retry_at_time=None if dep.retry_at is None else fmt(dep.retry_at),
        last_error=dep.last_error,
        endpoint=None if dep.host is None else f"{dep.host}:{dep.port}",
        runtime_id=dep.runtime_id,
        queued=queued,
        waiting_start=len(waiting) - queued,
        ondemand_policy=dep.ondemand_policy,
    )


def queue_views(folded: Folded, wanted: str | None, fmt: Callable[[float], str]) -> list[QueueView]:
    """The requests waiting at that moment (the queue is bounded by `ondemand_max_queued`)."""
    names = folded.names()
    return [
        QueueView(
            request_id=e.request_id,
            deployment_id=e.deployment_id,
            deployment=names.get(e.deployment_id, e.deployment_id),
            kind=e.kind,
            position=e.position,
            arrived_at=e.arrived_at,
            arrived_time=fmt(e.arrived_at),
        )
        for e in sorted(folded.state.queue.values(), key=lambda e: (e.arrived_at, e.request_id))
        if wanted is None or wanted in (e.deployment_id, names.get(e.deployment_id))
    ]


def replay_head(
    folded: Folded, db: str, until: float | None, log_last_seq: int, fmt: Callable[[float], str]
) -> ReplayHead:
    """The moment, the memory held, settings, warnings and the (redacted) state."""
    state = folded.state
    held = sum(d.memory_bytes for d in state.deployments.values() if d.lifecycle in HOLDING_MEMORY)
    warnings = list(folded.warnings)
    if folded.more_warnings:
        warnings.append(f"{folded.more_warnings} more events skipped")
    return ReplayHead(
        db=db,
        until=until,
        until_time=None if until is None else fmt(until),
        last_seq=state.last_seq,
        last_time=fmt(state.last_ts) if state.last_seq else None,
        log_last_seq=log_last_seq,
        memory_held_bytes=held,
        settings=dict(state.settings),
        warnings=warnings,
        state=redact(state),
    )


# --- one request's story ------------------------------------------------------------------------


async def names_at(store: EventStore, until: float | None) -> dict[str, str]:
    """Deployment names from the newest snapshot plus the deployments created after it."""
    snap = await store.latest_snapshot(until_ts=until) or EMPTY
    names = {**{k: d.name for k, d in snap.removed.items()}}
    names.update({k: d.name for k, d in snap.deployments.items()})
    async for rec in store.iterate(
        since_seq=snap.last_seq, until_ts=until, types=("DeploymentCreated",)
    ):
        if isinstance(rec.event, m.DeploymentCreated):
            names[rec.event.deployment_id] = rec.event.name
    return names


async def story_view(
    store: EventStore, db: str, until: float | None, request_id: str, fmt: Callable[[float], str]
) -> StoryView:
    """One request's story: its queue events and the starts and sleeps around it."""
    # Through the request index: the events that name this request, nothing else.
    named = [rec async for rec in store.iterate(request_id=request_id, until_ts=until)]
    own = [r for r in named if isinstance(r.event, QUEUE_EVENTS)]
    started_for = [r for r in named if isinstance(r.event, m.StartRequested)]
    if not named:
        if await _given_out_by_this_log(store, until, request_id):
            # Its deployment and arrival from the traffic trace, when it was on.
            row = await trace_row(store, int(request_id), until)
            dep = None if row is None else row.deployment_id
            outcome = SERVED_AT_ONCE
            if row is not None and row.outcome != "served":
                outcome = f"did not wait; the traffic trace records it as {row.outcome}"
            return StoryView(
                db=db,
                until=until,
                request_id=request_id,
                deployment_id=dep,
                deployment=None if dep is None else (await names_at(store, until)).get(dep),
                outcome=outcome,
                story=[],
                notes=[] if row is None else await prewarm_notes(store, dep or "", row.arrived),
            )
        raise NotInLog(
            f"request {request_id!r} is not in the log{until_text(until)}"
            " (only requests that waited are recorded)"
        )
    names = await names_at(store, until)
    first = named[0].seq
    left = [r for r in own if isinstance(r.event, m.RequestLeftQueue)]
    last = left[-1].seq if left else (await store.last_seq())
    arrived = named[0].ts
    if own:
        ev = own[0].event
        assert isinstance(ev, QUEUE_EVENTS)
        dep_id = ev.deployment_id
        if isinstance(ev, m.RequestQueued):
            arrived = ev.arrived_at
    else:
        dep_id = started_for[0].stream.partition(":")[2]
    items = [queue_item(rec, names, fmt) for rec in own]
    # Starts, sleeps and evictions of every deployment while the request waited.
    window = store.iterate(since_seq=first - 1, until_seq=last, until_ts=until, types=_DEP_TYPES)
    extra = store.iterate(request_id=request_id, until_ts=until, types=("StartRequested",))
    projector = Projector(names)
    seen: set[int] = set()
    async for rec in merged(window, extra):
        if rec.seq in seen or not rec.stream.startswith("deployment:"):
            continue
        if len(seen) >= MAX_STORY:  # a request that never left (a restart drops the queue)
            break
        seen.add(rec.seq)
        _, tabs = projector.apply(rec)
        for tab in tabs:
            if not tab.made_room:  # the same event is on its own deployment's line already
                name = names.get(tab.deployment_id)
                items.append(event_item(tab.row, tab.deployment_id, name, fmt))
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
        deployment=names.get(dep_id),
        outcome=outcome,
        story=items,
        wait=await request_wait(store, named, names),
        notes=await prewarm_notes(store, dep_id, arrived),
    )


async def _given_out_by_this_log(store: EventStore, until: float | None, request_id: str) -> bool:
    """Whether a gateway writing this log could have numbered a request so: an id names the
    second its gateway started, which lies between the log's first event and `until` (now)."""
    if not GATEWAY_REQUEST_ID.fullmatch(request_id):
        return False
    started = int(request_id) // IDS_PER_SECOND
    first = [rec async for rec in store.iterate(limit=1)]
    if not first or started < first[0].ts - STARTUP_SLACK_S:
        return False
    return started <= (time.time() if until is None else until)


_DEP_TYPES = tuple(t.__name__ for t in m.AnyEvent.__args__ if t not in QUEUE_EVENTS)


# --- text rendering ---------------------------------------------------------------------------


def render_deployment(d: DeploymentView) -> Iterable[str]:
    """One deployment's state as text lines (its timeline follows)."""
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
        if d.ondemand_policy is not None:
            mode += f", its own policy {d.ondemand_policy}"
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


def render_tail(head: ReplayHead, queue: list[QueueView]) -> Iterable[str]:
    """Memory, queue, settings and warnings as text lines."""
    yield ""
    yield f"memory held by engines: {gib(head.memory_held_bytes)}"
    if queue:
        yield f"queue: {len(queue)} waiting"
        for q in queue:
            waits = "queued for memory" if q.kind == "queued" else "waiting for start"
            yield (
                f"  {q.request_id} for {q.deployment}: {waits}, position {q.position},"
                f" arrived {q.arrived_time}"
            )
    else:
        yield "queue: empty"
    if head.settings:
        changed = ", ".join(f"{k}={v}" for k, v in sorted(head.settings.items()))
        yield f"settings changed from the defaults: {changed}"
    for warning in head.warnings:
        yield f"warning: {warning}"


def render_story(view: StoryView) -> Iterable[str]:
    """A request's story as text lines."""
    if not view.story and view.outcome == SERVED_AT_ONCE:
        target = view.deployment or view.deployment_id
        yield f"request {view.request_id}{f' for {target}' if target else ''}: {view.outcome}"
        yield from (f"  {note}" for note in view.notes)
        return
    target = view.deployment or view.deployment_id or "?"
    yield f"request {view.request_id} for {target}: {view.outcome}"
    yield from (f"  {note}" for note in view.notes)
    for item in view.story:
        who = "queue" if item.kind == "queue" else (item.deployment or item.deployment_id or "")
        yield f"  {item.time}  {item.actor:<12} {who:<16} {item.title}"
    if view.wait is not None:
        yield from render_wait(view.wait)


def _json_line(kind: str, obj: msgspec.Struct) -> str:
    data = msgspec.to_builtins(obj)
    return msgspec.json.encode({"line": kind, **data}).decode()


# --- the commands -----------------------------------------------------------------------------


async def replay_command(args: argparse.Namespace) -> int:
    """`dgxmm replay`: the state at a moment and the timelines that led there, streamed."""
    until: float | None = args.until
    fmt = time_formatter(bool(getattr(args, "relative", False)), until)
    store = await EventStore.open(args.db, create=False, readonly=True)
    try:
        if args.request is not None:
            story = await story_view(store, args.db, until, args.request, fmt)
            if args.json:
                write_lines([msgspec.json.format(msgspec.json.encode(story), indent=2).decode()])
            else:
                write_lines(render_story(story))
            return 0
        folded = await fold_log(store, until)
        wanted: str | None = args.deployment
        deployments = chosen(folded.state, wanted)
        if wanted is not None and not deployments:
            raise NotInLog(f"no deployment named {wanted!r} in the log{until_text(until)}")
        head = replay_head(folded, args.db, until, await store.last_seq(), fmt)
        names = folded.names()
        queue = queue_views(folded, wanted, fmt)
        await _write_replay(store, args, head, deployments, names, queue, fmt)
    finally:
        await store.close()
    return 0


async def _write_replay(
    store: EventStore,
    args: argparse.Namespace,
    head: ReplayHead,
    deployments: list[tuple[DeploymentState, bool]],
    names: dict[str, str],
    queue: list[QueueView],
    fmt: Callable[[float], str],
) -> None:
    out = sys.stdout
    if args.json:
        out.write(_json_line("replay", head) + "\n")
    else:
        at = head.until_time or "the end of the log"
        last = f"event {head.last_seq} of {head.log_last_seq}"
        if head.last_time is not None:
            last += f", {head.last_time}"
        out.write(f"{head.db}: state at {at} ({last})\n")
        if not deployments:
            out.write("no deployments at that time\n")
    for dep, removed in deployments:
        view = deployment_view(head.state, dep, removed, fmt)
        if args.json:
            out.write(_json_line("deployment", view) + "\n")
        else:
            write_lines(render_deployment(view))
        shown: AsyncIterator[TimelineItem] | list[TimelineItem]
        heading = "  timeline\n"
        if args.all:
            shown = timeline(store, dep.deployment_id, names, head.last_seq, fmt)
        else:
            keep = DEFAULT_LAST if args.last is None else args.last
            shown = await recent_timeline(store, dep.deployment_id, names, head.last_seq, keep, fmt)
            if len(shown) == keep:
                heading = f"  timeline (the last {keep} lines; --last N or --all for more)\n"
        count = 0
        async for item in _aiter(shown):
            count += 1
            if args.json:
                out.write(_json_line("timeline", item) + "\n")
                continue
            if count == 1:
                out.write(heading)
            out.write(f"    {item.time}  {item.actor:<12} {item.title}\n")
    if args.json:
        for q in queue:
            out.write(_json_line("queue", q) + "\n")
    else:
        write_lines(render_tail(head, queue))


async def _aiter(
    items: AsyncIterator[TimelineItem] | list[TimelineItem],
) -> AsyncIterator[TimelineItem]:
    if isinstance(items, list):
        for item in items:
            yield item
    else:
        async for item in items:
            yield item


def _selected_types(args: argparse.Namespace) -> list[str] | None:
    """`--type` values (repeatable, comma-separated), checked against the event types."""
    given: list[str] = [t for raw in (args.type or []) for t in raw.split(",") if t.strip()]
    if not given:
        return None
    known = {t.__name__ for t in m.AnyEvent.__args__}
    unknown = sorted({t.strip() for t in given} - known)
    if unknown:
        raise NotInLog(f"no event type {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return sorted({t.strip() for t in given})


def _deployment_ids(state: SystemState, wanted: str) -> set[str]:
    found = {d.deployment_id for d, _ in chosen(state, wanted)}
    if not found:
        raise NotInLog(f"no deployment named {wanted!r} in the log")
    return found


def _concerns(rec: m.Recorded, dep_ids: set[str]) -> bool:
    """Whether a record belongs to one of the deployments (its stream or its queue events)."""
    if rec.stream.startswith("deployment:"):
        return rec.stream.partition(":")[2] in dep_ids
    ev = rec.event
    return isinstance(ev, QUEUE_EVENTS) and ev.deployment_id in dep_ids


async def events_command(args: argparse.Namespace) -> int:
    """`dgxmm events`: the raw log; `--follow` starts at now unless `--since` goes back."""
    since: float | None = args.since
    fmt = time_formatter(bool(args.relative), live=bool(args.follow))
    store = await EventStore.open(args.db, create=False, readonly=True)
    try:
        types = _selected_types(args)
        folded = await fold_log(store, None)  # the names, and what `--deployment` means
        names = folded.names()
        dep_ids = (
            None if args.deployment is None else _deployment_ids(folded.state, args.deployment)
        )
        start = 0
        if args.follow and since is None:
            start = await store.last_seq()
        if args.follow:
            records = store.follow(since_seq=start)
            # On stderr, so that the events stay alone on stdout; it also says when new
            # events will show up (a script can wait for this line).
            sys.stderr.write(f"dgxmm: following {args.db} after event {start}\n")
            sys.stderr.flush()
        else:
            records = store.iterate(since_seq=start, types=types)
        out = sys.stdout
        try:
            async for rec in records:
                if isinstance(rec.event, m.DeploymentCreated):
                    names[rec.event.deployment_id] = rec.event.name
                    if args.deployment in (rec.event.name, rec.event.deployment_id) and dep_ids:
                        dep_ids.add(rec.event.deployment_id)
                if since is not None and rec.ts < since:
                    continue
                if types is not None and rec.type not in types:
                    continue
                if dep_ids is not None and not _concerns(rec, dep_ids):
                    continue
                rec = redact_record(rec)
                out.write(
                    m.encode_recorded(rec).decode() if args.json else event_line(rec, names, fmt)
                )
                out.write("\n")
                if args.follow:
                    out.flush()
        finally:
            # Closed before the store, also when the reader went away (`| head`).
            await records.aclose()  # type: ignore[attr-defined]
    finally:
        await store.close()
    return 0


async def audit_command(args: argparse.Namespace) -> int:
    """`dgxmm audit`: from the audit read model when it covers the log, else projected."""
    since: float | None = args.since
    wanted: str | None = args.deployment
    fmt = time_formatter(bool(args.relative))
    store = await EventStore.open(args.db, create=False, readonly=True)
    try:
        folded = await fold_log(store, None)
        names = folded.names()
        targets: set[str] | None = None
        if wanted is not None:
            targets = {m.deployment_stream(d) for d in _deployment_ids(folded.state, wanted)}
        if store.readmodels_current():
            rows = store.iterate_audit(AuditFilter(since_ts=since))
        else:
            rows = _project_audit(store)
        shown = 0
        out = sys.stdout
        async for row in rows:
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
                line = f"{fmt(row.ts)}  {row.actor:<14} {row.action:<24} {target}"
                if details:
                    line += f"  {details}"
            out.write(line)
            out.write("\n")
            shown += 1
    finally:
        await store.close()
    if not shown:
        what = [
            f"deployment {wanted}" if wanted else "",
            f"since {format_time(since)}" if since else "",
        ]
        scope = " and ".join(w for w in what if w)
        sys.stderr.write(f"no audit rows{' for ' + scope if scope else ''} in {args.db}\n")
    return 0


async def _project_audit(store: EventStore) -> AsyncIterator[AuditRow]:
    """The audit trail computed from the log (a log without an up-to-date read model)."""
    projector = Projector()
    async for rec in store.iterate(types=AUDITED_TYPES):
        row, _ = projector.apply(rec)
        if row is not None:
            yield row


async def archive_command(args: argparse.Namespace) -> int:
    """`dgxmm archive`: old queue events to an archive file; the audit trail stays."""
    target = args.to or f"{args.db.removesuffix('.db')}.archive.db"
    moved = await archive_queue_events(args.db, target, args.before)
    sys.stdout.write(
        f"moved {moved} queue events from before {format_time(args.before)} to {target}"
        f" (read them with: dgxmm replay --db {target}); the audit trail is unchanged\n"
    )
    return 0
