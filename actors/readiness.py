"""Waiting for a launched engine to become ready, at the engine's speed.

A cold start costs the caller the engine's own time to healthy plus whatever DGXMM adds; the
readiness probe's period is most of the latter.  So an engine is probed often while it is
young (every `FAST_PROBE_S` for its first `YOUNG_S` seconds: a small model is healthy in one
or two), then less and less often, in steps (`BANDS`), up to once a second after 40 s, so a
vLLM load of several minutes costs one cheap `GET /health` a second.  The detection delay
stays under about 2.5 % of the start time after the first seconds.

An engine that refuses connections until it is ready (vLLM, SGLang: their HTTP server starts
after the load) is different: a probe of it is one refused connect on loopback, nothing the
engine has to serve, and its start is long, so the bands would add up to a second to every
vLLM start.  While the real probe finds nothing listening (`Readiness.DOWN`), the next probe
comes `REFUSED_PROBE_S` later whatever the age: about 50 cheap connects a second, and the
engine is seen ready within that period of its first answer.

Probes fall on a grid of the engine's age (multiples of the current period), so a long start
is probed at whole seconds of age, as it always was.  `next_probe_age` is the schedule, a pure
function of the age.  A probe may bring its own schedule (an attribute `probe_schedule`, same
signature): the simulated engines of the virtual-clock harness become ready at known virtual
instants, so their probe asks on whole seconds (`whole_seconds`) and a simulated hour stays
cheap; the real probe keeps the default.  Such a probe may also say when its engine will
first answer (`ready_at(handle)`, clock seconds, None when it cannot tell): the wait then
sleeps straight to the first probe of the schedule at or after that instant, skipping the
probes that would only have found the engine not ready yet (same instants, same outcome;
each skipped probe cost the event loop several rounds, most of a what-if's start).  Only
while the exit watch below runs, which notices an exit during the skipped stretch; a watch
that fails during it leaves an exit to be noticed at the stretch's end.

An engine that exits while loading is noticed at once, not at the next probe: the wait races
every probe and every pause against `Runtime.wait_exited` (a pidfd or the child's exit for
the process runtime, Docker's `wait` endpoint for containers).  Where that wait fails (the
Docker engine did not answer it), the loop falls back to asking `Runtime.is_running` before
each probe, as it always did.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import math
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog

from actors.errors import ActorError, EngineUnreachable
from actors.ports import EngineHandle, EngineProbe, Readiness, Runtime
from actors.runtime import Clock

log = structlog.get_logger("dgxmm.readiness")
T = TypeVar("T")

FAST_PROBE_S = 0.025
YOUNG_S = 5.0
# (age below which, period): every period divides the next band's start and one second.
BANDS = ((YOUNG_S, FAST_PROBE_S), (10.0, 0.1), (20.0, 0.25), (40.0, 0.5))
SLOW_PROBE_S = 1.0
REFUSED_PROBE_S = 0.02  # the period while nothing listens (default schedule only)
SLACK_S = 1e-6  # a probe lands just after its grid point, never a float rounding before it


def probe_interval_s(age_s: float) -> float:
    """The probe period for an engine launched `age_s` seconds ago."""
    for below, period in BANDS:
        if age_s < below:
            return period
    return SLOW_PROBE_S


def next_probe_age(age_s: float) -> float:
    """The age at which to probe next: the first grid point of the current period after it."""
    period = probe_interval_s(age_s)
    return (math.floor(age_s / period + 1e-9) + 1) * period


def whole_seconds(age_s: float) -> float:
    """A coarse schedule: the next whole second of age."""
    return float(math.floor(age_s + 1e-9) + 1)


Schedule = Callable[[float], float]


class BootOutcome(enum.Enum):
    """How waiting for an engine ended."""

    READY = "ready"
    EXITED = "exited"
    TIMED_OUT = "timed_out"


async def wait_until_ready(
    *,
    runtime: Runtime,
    probe: EngineProbe,
    clock: Clock,
    engine: str,
    handle: EngineHandle,
    launched_at: float,
    deadline: float,
    schedule: Schedule | None = None,
) -> BootOutcome:
    """Probe `handle` on the schedule until it is ready, exits, or `deadline` passes.

    `schedule`: default the probe's own `probe_schedule` if it has one, else `next_probe_age`,
    and then an engine that refuses connections is probed every `REFUSED_PROBE_S`.
    """
    own: Schedule | None = schedule or getattr(probe, "probe_schedule", None)
    next_age: Schedule = own or next_probe_age
    ready_at: Callable[[EngineHandle], float | None] | None = getattr(probe, "ready_at", None)
    exited: asyncio.Future[None] = asyncio.ensure_future(runtime.wait_exited(handle))
    exited.add_done_callback(functools.partial(_log_watch_failure, handle))
    try:
        while True:
            if _gone(exited):
                return BootOutcome.EXITED
            if exited.done() and not await runtime.is_running(handle):
                return BootOutcome.EXITED  # the watch failed: ask the runtime each round
            ready = await _race(exited, _probe(probe, engine, handle))
            if ready is None:
                return BootOutcome.EXITED
            if ready is Readiness.READY:
                return BootOutcome.READY
            now = clock.now()
            if now >= deadline:
                return BootOutcome.TIMED_OUT
            if own is None and ready is Readiness.DOWN:
                pause = min(REFUSED_PROBE_S, deadline - now)
            else:
                pause = min(launched_at + next_age(now - launched_at) - now, deadline - now)
            pause = max(0.0, pause) + SLACK_S
            known = None
            if ready_at is not None and own is not None and not exited.done():
                known = ready_at(handle)  # while the exit watch runs: it notices an exit
            if known is not None:
                pause = _skip_not_ready(now, pause, known, launched_at, deadline, next_age)
            if await _race(exited, _slept(clock, pause)) is None:
                return BootOutcome.EXITED
    finally:
        exited.cancel()
        with contextlib.suppress(asyncio.CancelledError, ActorError):
            await exited


def _skip_not_ready(
    now: float, pause: float, ready: float, launched_at: float, deadline: float, next_age: Schedule
) -> float:
    """The pause to the first probe of the schedule that finds the engine ready (at or after
    `ready`) or ends the wait (at or after `deadline`), instead of `pause`: the loop above's
    arithmetic without its probes, to the same float (a clock's `sleep` adds the pause to
    its now, as each skipped sleep would have)."""
    at = now + pause
    while at < ready and at < deadline:
        step = min(launched_at + next_age(at - launched_at) - at, deadline - at)
        at = at + (max(0.0, step) + SLACK_S)
    skipped = at - now
    while now + skipped < at:
        skipped = math.nextafter(skipped, math.inf)
    while now + skipped > at:
        skipped = math.nextafter(skipped, -math.inf)
    return skipped


async def _probe(probe: EngineProbe, engine: str, handle: EngineHandle) -> Readiness:
    try:
        return await probe.readiness(engine, handle)
    except EngineUnreachable:
        return Readiness.DOWN


async def _slept(clock: Clock, seconds: float) -> bool:
    await clock.sleep(seconds)
    return True


async def _race(exited: asyncio.Future[None], work: Coroutine[Any, Any, T]) -> T | None:
    """The result of `work`, or None when the engine exits first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    if not exited.done():
        waits: set[asyncio.Future[Any]] = {exited, task}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # the wait was given up (its start stopped): no orphan left pending
            raise
        if not task.done() and _gone(exited):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return await task  # done, or the watch failed (then the work simply finishes)


def _gone(exited: asyncio.Future[None]) -> bool:
    """Whether the exit watch saw the engine exit (False while it runs or if the watch failed)."""
    return exited.done() and not exited.cancelled() and exited.exception() is None


def _log_watch_failure(handle: EngineHandle, exited: asyncio.Future[None]) -> None:
    if not exited.cancelled() and exited.exception() is not None:
        log.warning(
            "engine_exit_watch_failed",
            deployment=handle.deployment_id,
            error=str(exited.exception()),
        )
