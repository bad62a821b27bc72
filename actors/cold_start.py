"""Cold starts, actors side: the engine's loading milestones, and each deployment's history.

`watch_milestones` reads an engine's log while it starts; `StartHistory` keeps the last cold
starts of each deployment for the expected start time (`Controller.start_history`).

Watching an engine's log for its loading milestones while it starts:

The deployment actor runs `watch_milestones` beside its readiness wait, from the launch
until the engine is ready (or the start ends otherwise), and records what it reports as
`EngineMilestoneReached`.  The log's lines come through a port (`EngineLogLines`, given by
`dgxmm/` as `Hooks.log_lines`; the simulations give none), the parsing is the pure
`events.cold_start.milestone_of`.

Bounded by design: each milestone is reported at most once per start, the watch ends when
all of them were seen or after `MAX_LINES` lines, and it never delays the start: it only
reads, in a task of its own, and is cancelled when the wait for readiness ends (a second
after ready, for the lines printed just before it).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Collection, Iterable

import structlog

from actors.errors import ActorError
from actors.ports import EngineHandle
from events import model as m
from events.cold_start import (
    ESTIMATE_STARTS,
    MILESTONES,
    ColdStarts,
    median_recent,
    milestone_of,
)
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.cold_start")

MAX_LINES = 50_000  # a chatty engine's start; past it the milestones are not looked for
AFTER_READY_S = 1.0  # the watch reads on this long after ready (see `stop_watching`)
SEED_EVENTS = 200  # start events read back per deployment at start-up
_HISTORY_TYPES = (
    "StartRequested",
    "EngineReady",
    "EngineStartFailed",
    "EngineStopped",
    "EngineLost",
)


# The lines an engine writes from its launch on, until cancelled.
EngineLogLines = Callable[[EngineHandle], AsyncIterator[str]]

Report = Callable[[str, float | None], None]  # (milestone, the engine's own seconds)


async def watch_milestones(lines: AsyncIterator[str], engine: str, report: Report) -> None:
    """Report each milestone of `engine` found in `lines`, once, in the order seen."""
    seen: set[str] = set()
    count = 0
    try:
        async for line in lines:
            count += 1
            found = milestone_of(engine, line)
            if found is not None and found.name not in seen:
                seen.add(found.name)
                report(found.name, found.took_s)
                if len(seen) == len(MILESTONES):
                    return
            if count >= MAX_LINES:
                return
    except ActorError as exc:  # policy: no milestones is a poorer story, never a failed start
        log.info("milestones_unreadable", error=str(exc))
    except Exception:  # policy: the same, for a bug in reading; logged with its trace
        log.exception("milestones_watch_failed")


def start_watching(
    log_lines: EngineLogLines | None, handle: EngineHandle, engine: str, report: Report
) -> asyncio.Task[None] | None:
    """The watch as a task, or None when nothing reads engine logs."""
    if log_lines is None:
        return None
    watch = watch_milestones(log_lines(handle), engine, report)
    return asyncio.get_running_loop().create_task(watch, name=f"milestones:{handle.deployment_id}")


def stop_watching(task: asyncio.Task[None] | None, *, ready: bool = False) -> None:
    """Cancel the watch (it ends at its next await; it keeps no resource).  Once the engine
    is ready it reads on for `AFTER_READY_S`: a line printed just before the health probe
    answered (llama.cpp prints "model loaded" as it starts answering) is read a little
    later, and still counts."""
    if task is None:
        return
    if ready:
        asyncio.get_running_loop().call_later(AFTER_READY_S, task.cancel)
    else:
        task.cancel()


class StartHistory:
    """Each deployment's last cold starts (`StartRequested` to `EngineReady`), for the
    expected start time; a start that failed, was stopped or lost counts nothing.

    Fed by the store as events are recorded, seeded at start-up from the newest events of
    each deployment's stream (`SEED_EVENTS`).  Bounded: `ESTIMATE_STARTS` per deployment.
    """

    def __init__(self, keep: int = ESTIMATE_STARTS) -> None:
        self._keep = keep
        self._pairing = ColdStarts()
        self._done: dict[str, collections.deque[float]] = {}

    def recorded(self, records: list[m.Recorded]) -> None:
        """A store listener."""
        for rec in records:
            self.feed(rec)

    def feed(self, rec: m.Recorded) -> None:
        """Fold one record."""
        found = self._pairing.feed(rec)
        if found is not None:
            dep_id, seconds = found
            self._done.setdefault(dep_id, collections.deque(maxlen=self._keep)).append(seconds)
        elif isinstance(rec.event, m.DeploymentRemoved):
            self._done.pop(rec.stream.partition(":")[2], None)

    def reset(self, deployment_id: str, seconds: Iterable[float]) -> None:
        """Its starts are these (a what-if's box: the recorded box's, not its own warm-up's)."""
        done = collections.deque(seconds, maxlen=self._keep)
        if done:
            self._done[deployment_id] = done
        else:
            self._done.pop(deployment_id, None)
        self._pairing.forget(deployment_id)

    def expected_s(self, deployment_id: str) -> float | None:
        """The median of its last cold starts (an estimate), or None without history."""
        done = self._done.get(deployment_id)
        return None if not done else round(median_recent(list(done), self._keep) or 0.0, 1)

    async def seed(self, store: EventStore, deployment_ids: Iterable[str]) -> None:
        """Read each deployment's newest start events (through the stream's index)."""
        for dep_id in deployment_ids:
            for rec in await newest_events(store, dep_id, _HISTORY_TYPES, SEED_EVENTS):
                self.feed(rec)
            self._pairing.forget(dep_id)  # a start under way at the restart was not timed


async def newest_events(
    store: EventStore,
    deployment_id: str,
    types: Collection[str],
    limit: int,
    until_seq: int | None = None,
) -> list[m.Recorded]:
    """The newest `limit` events of those types on one deployment's stream, oldest first
    (read newest first through the stream's index, so a long log costs nothing more)."""
    newest = [
        rec
        async for rec in store.iterate(
            stream=m.deployment_stream(deployment_id),
            types=types,
            until_seq=until_seq,
            descending=True,
            limit=limit,
        )
    ]
    return newest[::-1]
