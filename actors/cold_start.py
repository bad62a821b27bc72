"""Watching an engine's log for its loading milestones while it starts.

The deployment actor runs `watch_milestones` beside its readiness wait, from the launch
until the engine is ready (or the start ends otherwise), and records what it reports as
`EngineMilestoneReached`.  The log's lines come through a port (`EngineLogLines`, given by
`dgxmm/` as `Hooks.log_lines`; the simulations give none), the parsing is the pure
`events.cold_start.milestone_of`.

Bounded by design: each milestone is reported at most once per start, the watch ends when
all of them were seen or after `MAX_LINES` lines, and it never delays the start: it only
reads, in a task of its own, and is cancelled the moment the wait for readiness ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import structlog

from actors.errors import ActorError
from actors.ports import EngineHandle
from events.cold_start import MILESTONES, milestone_of

log = structlog.get_logger("dgxmm.cold_start")

MAX_LINES = 50_000  # a chatty engine's start; past it the milestones are not looked for


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


def stop_watching(task: asyncio.Task[None] | None) -> None:
    """Cancel the watch (it ends at its next await; it keeps no resource)."""
    if task is not None:
        task.cancel()
