"""Pure projection: the box over a window of time, as the memory and residency timeline draws it.

`project(start_state, records, since, until, usable_bytes)` folds the events of one window
(those after `since`, up to `until`) onto the state the log had at `since`, and returns:

- **lanes**: one per deployment, a run of `Segment`s while it is starting, ready, asleep,
  or stopping (until its engine is gone), each in that lifecycle state and with the memory
  its engine holds: none while a start waits for room or a start slot (requested, no
  engine yet), then the deployment's memory, fixed until the engine stops (a
  reconfiguration takes effect at the next start);
- **the usable-memory line** (`usable_bytes`, the budget engines may share);
- **marks**: cold starts (at the start, with their duration once ready), idle sleeps,
  make-room evictions (with the deployment they made room for), other sleeps (watchdog),
  failures (a start that failed, an engine lost), and the learned policy's decisions
  (issue 44): a pre-warm (at its start request, with the next request it expects), a
  sleep after a learned keep-warm (`kept_warm`), a pre-warm that no request came to
  (`prewarm_unused`) and one abandoned for a queued request; each with its event as JSON;
- **queue waits**: request id, deployment, from/to and outcome (the `RequestLeftQueue`
  reason, or `waiting` when it still waited at `until`).

Lanes follow `events.state`'s own `evolve_deployment`, so a lane's state is the
deployment's lifecycle at every instant.  `stack` turns lanes into the stacked pieces the
UI and the SVG draw (each deployment in a fixed order, one above the other).  Nothing here
reads the log: `storage` hands in the state at `since` (a snapshot plus the events after
it) and the window's records.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from events import model as m
from events.state import (
    DeploymentState,
    Lifecycle,
    QueueEntry,
    SystemState,
    evolve_deployment,
    new_deployment,
)

# The lifecycle states in which a deployment holds memory (its lane is drawn).
# A tuple, not a set: `in` compares identities first, where a set hashes each enum in Python.
HOLDING = (Lifecycle.STARTING, Lifecycle.READY, Lifecycle.ASLEEP, Lifecycle.STOPPING)
MAX_WAITS = 2_000  # queue waits kept per window (the longest); the rest are counted
MAX_MARKS = 5_000  # marks kept per window (the newest); the rest are counted
MIN_FITTED_S = 30.0  # a default window fitted to a log of a few seconds is still this wide

# The event types a window needs (everything else, e.g. logins and tokens, is skipped).
# RequestAdmitted is not read: a wait runs from its RequestQueued to its RequestLeftQueue.
QUEUE_TYPES = ("RequestQueued", "RequestLeftQueue")
DEPLOYMENT_TYPES = (
    "DeploymentCreated",
    "DeploymentReconfigured",
    "ModelSwitched",
    "DeploymentRemoved",
    "ModeChanged",
    "StartRequested",
    "EngineStarting",
    "EngineReady",
    "EngineStartFailed",
    "StopRequested",
    "PutToSleep",
    "EngineStopped",
    "EngineLost",
    "EngineAsleep",
    "EngineAwake",
    "EngineAdopted",
)
WINDOW_TYPES = (*DEPLOYMENT_TYPES, *QUEUE_TYPES)
# The events that are marks of their own (cold starts are marked at their end); a start or
# stop request only when the learned policy made it (`_mark`).
_MARKED = (m.PutToSleep, m.EngineStartFailed, m.EngineLost, m.StartRequested, m.StopRequested)
# One of the queue's events as `storage` reads them apart from the records: (ts, event).
QueueMove = tuple[float, m.AnyEvent]


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """A stretch of one deployment's lane: one lifecycle state, one amount of memory."""

    deployment_id: str
    state: str  # Lifecycle value: starting, ready, asleep, stopping
    start: float
    end: float
    memory_bytes: int


class Mark(msgspec.Struct, frozen=True, kw_only=True):
    """Something that happened to a deployment at one moment."""

    # cold_start, idle_sleep, make_room, sleep, failure; the learned policy's: prewarm,
    # kept_warm, prewarm_unused, prewarm_abandoned
    kind: str
    ts: float
    seq: int
    deployment_id: str
    title: str
    duration_s: float | None = None  # cold_start: start to ready (None: not ready by `until`)
    end: float | None = None  # cold_start: when it became ready (or failed)
    for_deployment: str | None = None  # make_room: the deployment it made room for
    for_name: str | None = None
    request_id: str | None = None  # cold_start: the request that asked for it
    event: m.AnyEvent | None = None  # the event itself (JSON: an object with its "type")
    actor: str = ""


class Wait(msgspec.Struct, frozen=True, kw_only=True):
    """A request waiting in the queue for a deployment."""

    request_id: str
    deployment_id: str
    start: float
    end: float
    outcome: str  # a LeaveReason, or "waiting" (still waiting at `until`)
    kind: str = "queued"  # queued (for memory) or waiting_start


class Lane(msgspec.Struct, frozen=True, kw_only=True):
    """One deployment of the window, in the order the lanes are stacked."""

    deployment_id: str
    name: str
    memory_bytes: int  # its memory at `until` (or when removed)


class Piece(msgspec.Struct, frozen=True, kw_only=True):
    """A rectangle of the stacked chart: a segment between two change points, at its height."""

    deployment_id: str
    state: str
    start: float
    end: float
    low_bytes: int
    high_bytes: int


class Timeline(msgspec.Struct, frozen=True, kw_only=True):
    """The box over one window."""

    since: float
    until: float
    usable_bytes: int
    lanes: list[Lane]
    segments: list[Segment]
    marks: list[Mark]
    waits: list[Wait]
    waits_omitted: int = 0
    marks_omitted: int = 0


class _Open:
    """A deployment's lane while the window is folded."""

    __slots__ = ("dep", "held", "since", "start_request", "start_seq", "start_since")

    def __init__(self, dep: DeploymentState, since: float) -> None:
        self.dep = dep
        self.held = dep.memory_bytes if _has_engine(dep) else 0
        self.since = since  # when the current segment began
        self.start_since: float | None = None  # a cold start in progress: when it began
        self.start_seq = 0
        self.start_request: str | None = None


def _has_engine(dep: DeploymentState) -> bool:
    """Whether the deployment's engine holds memory: a start has an engine once it is starting
    (`EngineStarting` sets the runtime id); before that it waits for room or a start slot."""
    if dep.lifecycle not in HOLDING:
        return False
    return dep.lifecycle is not Lifecycle.STARTING or dep.runtime_id is not None


class _Folder:
    def __init__(self, state: SystemState, since: float, until: float) -> None:
        self.since = since
        self.until = until
        self.open: dict[str, _Open] = {}
        self.names: dict[str, str] = {}
        self.order: list[str] = []
        self.segments: list[Segment] = []
        self.marks: list[Mark] = []
        self.waits: dict[str, tuple[str, float, str]] = {}  # request -> (deployment, start, kind)
        self.done_waits: list[Wait] = []
        for dep_id, dep in state.deployments.items():
            lane = _Open(dep, since)
            if dep.lifecycle is Lifecycle.STARTING:
                lane.start_since = dep.changed_at or since  # the real start, maybe before
            self.open[dep_id] = lane
            self.names[dep_id] = dep.name
            self.order.append(dep_id)
        for entry in state.queue.values():
            # It waited before the window too: clipped to the window like the lanes.
            self.waits[entry.request_id] = (entry.deployment_id, since, entry.kind)

    def _close(self, dep_id: str, lane: _Open, at: float) -> None:
        if lane.dep.lifecycle in HOLDING:
            self.segments.append(
                Segment(
                    deployment_id=dep_id,
                    state=lane.dep.lifecycle.value,
                    start=lane.since,
                    end=at,
                    memory_bytes=lane.held,
                )
            )

    def deployment(self, rec: m.Recorded) -> None:
        dep_id = rec.stream.partition(":")[2]
        ev = rec.event
        kind = type(ev)
        if kind is m.DeploymentCreated:
            dep = new_deployment(rec)
            self.open[dep_id] = _Open(dep, rec.ts)
            self.names[dep_id] = dep.name
            if dep_id not in self.order:
                self.order.append(dep_id)
            return
        lane = self.open.get(dep_id)
        if lane is None:
            return
        if kind is m.DeploymentRemoved:
            self._close(dep_id, lane, rec.ts)
            lane.held = 0
            lane.dep = msgspec.structs.replace(lane.dep, lifecycle=Lifecycle.STOPPED)
            del self.open[dep_id]
            return
        before = lane.dep.lifecycle
        after_dep = evolve_deployment(lane.dep, rec)
        after = after_dep.lifecycle
        # The memory an engine holds is fixed while it runs (from its start to its stop).
        held = (lane.held or after_dep.memory_bytes) if _has_engine(after_dep) else 0
        if after is not before or held != lane.held:
            self._close(dep_id, lane, rec.ts)
            lane.held = held
            lane.since = rec.ts
        lane.dep = after_dep
        if isinstance(ev, m.StartRequested) and ev.request_id is not None:
            lane.start_request = ev.request_id
        if after is not before:
            if after is Lifecycle.STARTING:
                lane.start_since, lane.start_seq = rec.ts, rec.seq
            elif before is Lifecycle.STARTING:
                if after is Lifecycle.READY and lane.start_since is not None:
                    self._cold_start(dep_id, lane, rec.ts)
                lane.start_since, lane.start_request = None, None
        if kind in _MARKED:
            self._mark(dep_id, rec)

    def _mark(self, dep_id: str, rec: m.Recorded) -> None:
        name = self.names.get(dep_id, dep_id)
        match rec.event:
            case m.PutToSleep(reason="make_room") as ev:
                target = ev.for_name or ev.for_deployment or "?"
                why = f" ({ev.kept_warm_reason})" if ev.kept_warm_s else ""
                self._add(
                    "make_room", rec, dep_id, f"{name} put to sleep to make room for {target}{why}",
                    for_deployment=ev.for_deployment, for_name=ev.for_name,
                )  # fmt: skip
            case m.PutToSleep(reason="idle", prewarm_unused=True):
                title = f"{name} put to sleep: no request came to its pre-warm"
                self._add("prewarm_unused", rec, dep_id, title)
            case m.PutToSleep(reason="idle") as ev if ev.kept_warm_s:
                title = f"{name} kept warm {ev.kept_warm_s} s ({ev.kept_warm_reason}), then slept"
                self._add("kept_warm", rec, dep_id, title)
            case m.PutToSleep(reason="idle") as ev:
                title = f"{name} put to sleep after {ev.idle_timeout_s} s idle"
                self._add("idle_sleep", rec, dep_id, title)
            case m.PutToSleep() as ev:
                self._add("sleep", rec, dep_id, f"{name} put to sleep ({ev.reason})")
            case m.EngineStartFailed() | m.EngineLost() as ev:
                what = "start failed" if isinstance(ev, m.EngineStartFailed) else "engine lost"
                self._add("failure", rec, dep_id, f"{name}: {what}: {ev.reason}")
            case m.StartRequested(reason="prewarm") as ev:
                why = f" ({ev.detail})" if ev.detail else ""
                self._add("prewarm", rec, dep_id, f"{name} pre-warmed{why}")
            case m.StopRequested(reason="prewarm_abandoned"):
                title = f"{name}: pre-warm abandoned for a queued request"
                self._add("prewarm_abandoned", rec, dep_id, title)

    def _add(
        self, kind: str, rec: m.Recorded, dep_id: str, title: str, **extra: str | None
    ) -> None:
        """A mark of `rec`'s event."""
        self.marks.append(
            Mark(
                kind=kind,
                ts=rec.ts,
                seq=rec.seq,
                deployment_id=dep_id,
                title=title,
                event=rec.event,
                actor=rec.actor,
                **extra,  # type: ignore[arg-type]
            )
        )

    def _cold_start(self, dep_id: str, lane: _Open, end: float | None) -> None:
        start = lane.start_since
        assert start is not None
        name = self.names.get(dep_id, dep_id)
        duration = None if end is None else round(end - start, 3)
        title = (
            f"{name} started in {duration:.1f} s"
            if duration is not None
            else f"{name} starting (not ready yet)"
        )
        self.marks.append(
            Mark(
                kind="cold_start",
                ts=start,
                seq=lane.start_seq,
                deployment_id=dep_id,
                title=title,
                duration_s=duration,
                end=end,
                request_id=lane.start_request,
            )
        )

    def queue(self, ts: float, ev: m.AnyEvent) -> None:
        if type(ev) is m.RequestQueued:
            self.waits[ev.request_id] = (ev.deployment_id, ts, ev.kind)
        elif type(ev) is m.RequestLeftQueue:
            wait = self.waits.pop(ev.request_id, None)
            self.done_waits.append(
                Wait(
                    request_id=ev.request_id,
                    deployment_id=ev.deployment_id,
                    start=wait[1] if wait is not None else max(self.since, ts - ev.waited_s),
                    end=ts,
                    outcome=ev.reason,
                    kind=wait[2] if wait is not None else "queued",
                )
            )

    def finish(self, usable_bytes: int) -> Timeline:
        for dep_id, lane in self.open.items():
            self._close(dep_id, lane, self.until)
            if lane.dep.lifecycle is Lifecycle.STARTING and lane.start_since is not None:
                self._cold_start(dep_id, lane, None)
        waits = self.done_waits + [
            Wait(
                request_id=rid,
                deployment_id=dep_id,
                start=start,
                end=self.until,
                outcome="waiting",
                kind=kind,
            )
            for rid, (dep_id, start, kind) in self.waits.items()
        ]
        omitted = max(0, len(waits) - MAX_WAITS)
        if omitted:
            waits = sorted(waits, key=lambda w: w.end - w.start, reverse=True)[:MAX_WAITS]
        waits.sort(key=lambda w: (w.start, w.request_id))
        marks = sorted(self.marks, key=lambda k: (k.ts, k.seq))
        marks_omitted = max(0, len(marks) - MAX_MARKS)
        marks = marks[marks_omitted:]
        rank = {dep_id: i for i, dep_id in enumerate(self.order)}
        segments = sorted(
            (s for s in self.segments if s.end > s.start or s.start == self.until),
            key=lambda s: (s.start, rank[s.deployment_id]),
        )
        lanes = []
        for dep_id in self.order:
            still = self.open.get(dep_id)
            memory = still.dep.memory_bytes if still is not None else 0
            if still is None:
                memory = max(
                    (s.memory_bytes for s in segments if s.deployment_id == dep_id), default=0
                )
            lanes.append(Lane(deployment_id=dep_id, name=self.names[dep_id], memory_bytes=memory))
        return Timeline(
            since=self.since,
            until=self.until,
            usable_bytes=usable_bytes,
            lanes=lanes,
            segments=segments,
            marks=marks,
            waits=waits,
            waits_omitted=omitted,
            marks_omitted=marks_omitted,
        )


def project(
    start: SystemState,
    records: Iterable[m.Recorded],
    since: float,
    until: float,
    usable_bytes: int,
    queue: Iterable[QueueMove] = (),
) -> Timeline:
    """The timeline of the window (`since`, `until`]: `start` is the state at `since`.

    `records` are the window's records in order (any other types are skipped); records
    after `until` are ignored.  The queue's events may come in `records` or apart, in
    `queue` (in order): the lanes and the waits are folded independently of each other.
    """
    folder = _Folder(start, since, until)
    for rec in records:
        if rec.ts > until:
            break
        if rec.stream == m.STREAM_QUEUE:
            folder.queue(rec.ts, rec.event)
        elif rec.stream.startswith("deployment:"):
            folder.deployment(rec)
    for ts, ev in queue:
        if ts > until:
            break
        folder.queue(ts, ev)
    return folder.finish(usable_bytes)


def catch_up(
    state: SystemState, records: Iterable[m.Recorded], queue: Iterable[QueueMove] = ()
) -> SystemState:
    """`state` moved on by `records` (and the queue's events apart from them, `queue`) as far
    as the timeline reads it (the deployments, the queue): what `events.state.fold` gives for
    those two, at a fraction of its cost on the queue's bulk (one dict updated in place
    instead of a new state per event).  Its `last_seq` is that of the newest of `records`."""
    deployments = dict(state.deployments)
    waiting = dict(state.queue)
    last = state.last_seq, state.last_ts
    for rec in records:
        ev = rec.event
        last = rec.seq, rec.ts
        if rec.stream == m.STREAM_QUEUE:
            _enqueue(waiting, ev)
        elif type(ev) is m.DeploymentCreated:
            deployments[ev.deployment_id] = new_deployment(rec)
        elif rec.stream.startswith("deployment:"):
            dep_id = rec.stream.partition(":")[2]
            dep = deployments.get(dep_id)
            if dep is None:
                continue
            if type(ev) is m.DeploymentRemoved:
                del deployments[dep_id]
            else:
                deployments[dep_id] = evolve_deployment(dep, rec)
    for _, ev in queue:
        _enqueue(waiting, ev)
    return msgspec.structs.replace(
        state, deployments=deployments, queue=waiting, last_seq=last[0], last_ts=last[1]
    )


def _enqueue(waiting: dict[str, QueueEntry], ev: m.AnyEvent) -> None:
    """The waiting requests after one of the queue's events (in place)."""
    if type(ev) is m.RequestQueued:
        waiting[ev.request_id] = QueueEntry(
            request_id=ev.request_id,
            deployment_id=ev.deployment_id,
            kind=ev.kind,
            arrived_at=ev.arrived_at,
            position=ev.position,
        )
    elif type(ev) is m.RequestLeftQueue:
        waiting.pop(ev.request_id, None)


def fitted_since(until: float, first_ts: float | None, span_s: float) -> float:
    """The start of a default window of `span_s` that ends at `until`, fitted to a log that
    began later (its first record at `first_ts`; None: an empty log): a young box's minutes
    fill the chart instead of its rightmost sliver.  At least `MIN_FITTED_S` wide."""
    since = until - span_s
    if first_ts is not None and first_ts < until:
        since = max(since, first_ts)
    return min(since, until - MIN_FITTED_S)


def lane_at(timeline: Timeline, deployment_id: str, at: float) -> Segment | None:
    """The segment of a deployment's lane that covers `at` (the later one at a boundary)."""
    found = None
    for seg in timeline.segments:
        if seg.deployment_id == deployment_id and seg.start <= at < seg.end:
            found = seg
    return found


def held_at(timeline: Timeline, at: float) -> int:
    """The memory all lanes hold at `at`."""
    return sum(s.memory_bytes for s in timeline.segments if s.start <= at < s.end)


def stack(timeline: Timeline) -> list[Piece]:
    """The stacked chart: between two change points, each holding lane above the ones before it.

    Lanes are stacked in `timeline.lanes` order; a piece runs until any lane changes.
    """
    rank = {lane.deployment_id: i for i, lane in enumerate(timeline.lanes)}
    held = [s for s in timeline.segments if s.memory_bytes and s.end > s.start]
    # Change points: a segment begins (after the ends at the same instant) or ends.
    changes = sorted(
        [(s.start, 1, rank.get(s.deployment_id, 0), s) for s in held]
        + [(s.end, 0, rank.get(s.deployment_id, 0), s) for s in held],
        key=lambda c: (c[0], c[1]),
    )
    slots: list[Segment | None] = [None] * (max(rank.values(), default=0) + 1)
    latest: list[int | None] = [None] * len(slots)  # each lane's newest piece
    pieces: list[Piece] = []
    i, n = 0, len(changes)
    while i < n:
        left = changes[i][0]
        while i < n and changes[i][0] == left:
            _, begins, at, seg = changes[i]
            if begins:
                slots[at] = seg
            elif slots[at] is seg:
                slots[at] = None
            i += 1
        if i >= n:
            break
        right = changes[i][0]
        low = 0
        for at, slot in enumerate(slots):
            if slot is None:
                continue
            seg = slot
            high = low + seg.memory_bytes
            j = latest[at]
            prev = pieces[j] if j is not None else None
            if (
                j is not None
                and prev is not None
                and prev.end == left
                and prev.state == seg.state
                and prev.low_bytes == low
                and prev.high_bytes == high
            ):
                pieces[j] = msgspec.structs.replace(prev, end=right)
            else:
                latest[at] = len(pieces)
                pieces.append(
                    Piece(
                        deployment_id=seg.deployment_id,
                        state=seg.state,
                        start=left,
                        end=right,
                        low_bytes=low,
                        high_bytes=high,
                    )
                )
            low = high
    return pieces
