"""DeploymentActor: one deployment's lifecycle, mode, in-flight count, idle timer and backoff.

It is the only one that may decide "I am idle, stop me": a make-room eviction asks it, and
it refuses if a request arrived meanwhile.  Its lifecycle state is event-sourced (every
change is recorded before it counts); its activity (requests in flight, last use, engine
load) is volatile on purpose: a request to a ready model writes nothing to disk, and a
restart restarts the idle timer anyway.

Long work (launching, waiting for readiness, stopping) runs in a task of the actor's own,
which reports back through the mailbox, so the actor keeps answering while an engine loads.

Faults (issue 13): a command whose event cannot be written restores the volatile state it
touched and answers 503 (`WriteFailed`); an engine's report whose event cannot be written
comes again until it can.  Liveness after ready comes from the engine's own answers.

Why it is over 600 lines: it is one state machine, and every transition reads or changes the
same volatile state (leases, timers, the boot/stop/monitor tasks, the broker's holding, the
rollback of a failed write); split by concern, the parts would share all of it through an
interface as wide as the class.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import structlog

from actors.cold_start import EngineLogLines, start_watching, stop_watching
from actors.errors import ActorError, CommandRefused, RuntimeFailure
from actors.memory_broker import Candidate, MemoryBroker, gib
from actors.ports import (
    EngineHandle,
    EngineLoad,
    EngineProbe,
    ExitTimes,
    LaunchSpec,
    Readiness,
    Runtime,
)
from actors.readiness import BootOutcome, wait_until_ready
from actors.runtime import Actor, Clock, TimerHandle
from events import model as m
from events.state import DeploymentState, IllegalTransition, Lifecycle, evolve_deployment
from storage.errors import StorageError
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.deployment")

BACKOFF_S = (60, 120, 240, 480, 900)
METRICS_EVERY_S = 5.0
IDLE_CHECK_EVERY_S = 15.0
IDLE_SLACK_S = 1e-6  # the idle timer fires at last use + timeout; float rounding must not miss it
_AWAKE = (Lifecycle.READY, Lifecycle.ASLEEP)  # the lifecycles in which a model may be idle
# Made once: the idle rules run for every deployment at each make-room check.
_NOT_RUNNING = {lc: f"not running ({lc.value})" for lc in Lifecycle}
WRITE_RETRY_S = 2.0  # an engine's report whose event could not be written is tried again
HEALTH_FAILURE_WINDOW_S = 30.0  # a ready engine failing its health probe this long is lost
HEALTH_RETRY_S = 1.0  # how soon a failed health probe is tried again


def backoff_s(failures: int) -> int:
    """Seconds before the next start after `failures` failures in a row (60 s .. 15 min)."""
    return BACKOFF_S[min(max(failures, 1), len(BACKOFF_S)) - 1]


class Activity:
    """Volatile facts about traffic; never recorded (the hot path writes nothing)."""

    __slots__ = (
        "accepting",
        "direct",
        "engine_sleeping",
        "in_flight",
        "last_used",
        "load",
        "served",
    )

    def __init__(self, now: float) -> None:
        self.in_flight = 0
        self.last_used = now  # end of the last request, or ready / restart / switch time
        self.load: EngineLoad | None = None  # the engine's last metrics reading
        # Of that reading's requests, those beyond the gateway's own (`_on_scraped`): the
        # direct calls to the engine's port that the idle rules see.
        self.direct = 0
        self.engine_sleeping = False
        self.accepting = False  # ready and not being stopped: new requests may start
        self.served = 0


def is_idle(
    dep: DeploymentState, act: Activity, now: float, default_idle_s: int
) -> tuple[bool, str]:
    """The seed's idle rules, with the reason when not idle; pure."""
    return _idle_after(dep, act, now, dep.effective_idle_timeout_s(default_idle_s))


def may_make_room(
    dep: DeploymentState,
    act: Activity,
    now: float,
    default_idle_s: int,
    default_make_room_s: int | None,
) -> tuple[bool, str]:
    """Whether it may sleep to make room for the queue's head: the idle rules, with
    `ondemand_make_room_after_s` (or the deployment's own) in place of the idle timeout; pure."""
    after = dep.effective_make_room_after_s(default_idle_s, default_make_room_s)
    return _idle_after(dep, act, now, after)


def _idle_after(
    dep: DeploymentState, act: Activity, now: float, timeout: float
) -> tuple[bool, str]:
    """The idle rules with `timeout` seconds without a request as the idle time."""
    if not dep.on_demand or dep.role == "decision":
        return False, "not on demand"
    if dep.lifecycle not in _AWAKE:
        return False, _NOT_RUNNING[dep.lifecycle]
    if act.in_flight > 0:
        return False, f"{act.in_flight} requests in flight"
    if now - act.last_used < timeout - IDLE_SLACK_S:
        return False, "used recently"
    if act.direct > 0 and not act.engine_sleeping:
        return False, "the engine reports requests"
    return True, "idle"


def direct_calls(load: EngineLoad | None, in_flight: int, ended: int) -> int:
    """Of a metrics reading's requests, how many are not the gateway's own; pure.

    The engine counted its requests at some instant between the scrape's request and its
    handling here.  The gateway's own then were at most those in flight now plus those that
    ended since the scrape was sent (`ended`; every one that started meanwhile is still in
    flight or has ended).  The rest are direct calls to the engine's port, which keep it
    awake (the seed's idle rules).  A reading that counted a gateway request which has ended
    since is no longer a reason to stay awake: the decision does not depend on where the
    request fell in the 5 s between scrapes.  A direct call that overlaps a scrape together
    with a gateway request's start can hide from one reading; the next one sees it.
    """
    if load is None:
        return 0
    return max(0, load.running + load.waiting - in_flight - ended)


class LeaseImpl:
    """A request in flight on a ready engine."""

    __slots__ = ("_actor", "_released", "handle")

    def __init__(self, actor: DeploymentActor, handle: EngineHandle) -> None:
        self._actor = actor
        self.handle = handle
        self._released = False

    def release(self) -> None:
        """The request ended."""
        if not self._released:
            self._released = True
            self._actor.request_ended()


# --- messages (commands) -------------------------------------------------------------------


class Command(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Base of the deployment actor's messages."""


class StartDeployment(Command, frozen=True, kw_only=True):
    """Start (or wake) the engine; memory already reserved when `reserved`."""

    reason: m.StartReason
    actor: str
    request_id: str | None = None
    reserved: bool = False
    # A pre-warm's (`actors.anticipation`): the expected arrival (epoch seconds), why, and
    # until when (its clock's time) it waits for its first request.
    expected_at: float | None = None
    detail: str = ""
    hold_until: float | None = None


class StopDeployment(Command, frozen=True, kw_only=True):
    """Stop the engine (administrator, removal, shutdown)."""

    reason: m.StopReason
    actor: str


class SleepDeployment(Command, frozen=True, kw_only=True):
    """Put to sleep; refused unless idle (except for the watchdog)."""

    reason: m.SleepReason
    actor: str
    for_deployment: str | None = None
    for_name: str | None = None
    free_bytes: int | None = None


class ChangeMode(Command, frozen=True, kw_only=True):
    """Switch between on demand and always on."""

    mode: m.Mode
    idle_timeout_s: int | None
    keep_idle_timeout: bool
    make_room_after_s: int | msgspec.UnsetType | None = msgspec.UNSET  # UNSET: kept
    actor: str
    ondemand_policy: m.Policy | msgspec.UnsetType | None = msgspec.UNSET  # UNSET: kept


class Reconfigure(Command, frozen=True, kw_only=True):
    """Change engine settings, or switch the model (keeps the mode)."""

    actor: str
    model: str | None = None
    memory_bytes: int | None = None
    args: list[str] | None = None
    image: str | None = None


class RemoveDeployment(Command, frozen=True, kw_only=True):
    """Stop if running, then remove."""

    actor: str


class Adopt(Command, frozen=True, kw_only=True):
    """At start-up: the engine is (or is not) still running."""

    handle: EngineHandle | None


class IdleCheck(Command, frozen=True, kw_only=True):
    """Check the idle rules now."""


class _Launched(Command, frozen=True, kw_only=True):
    handle: EngineHandle
    attempt: int
    launch_began_at: float | None = None


class _Milestone(Command, frozen=True, kw_only=True):
    milestone: str
    took_s: float | None
    at: float
    attempt: int


class _Booted(Command, frozen=True, kw_only=True):
    attempt: int


class _BootFailed(Command, frozen=True, kw_only=True):
    reason: str
    attempt: int


class _Gone(Command, frozen=True, kw_only=True):
    attempt: int


class _Lost(Command, frozen=True, kw_only=True):
    reason: str
    attempt: int


class _Scraped(Command, frozen=True, kw_only=True):
    load: EngineLoad | None
    sleeping: bool
    attempt: int
    served_before: int  # the gateway's requests ended before the scrape was sent


class _RetryStart(Command, frozen=True, kw_only=True):
    failures: int


class _Cleared(Command, frozen=True, kw_only=True):
    attempt: int


class Refusal(CommandRefused):
    """A command was refused; `code` is the API's error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class WriteFailed(Refusal):
    """A command's event could not be written: nothing changed (503 with the reason)."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, "storage_unavailable", f"the event log cannot be written: {reason}")


class _Suspect(Command, frozen=True, kw_only=True):
    """The gateway could not reach the engine: check its liveness now."""


Outcome = Literal["ready", "failed", "stopped", "removed"]


class Hooks:
    """How a deployment actor tells the rest of DGXMM what happened (set by the controller)."""

    def __init__(self) -> None:
        self.changed: Callable[[DeploymentState, Outcome | None, str], None] = (
            lambda dep, outcome, detail: None
        )
        self.candidates: Callable[[str], list[Candidate]] = lambda deployment_id: []
        self.sleep_victims: Callable[[list[str], str, str], None] = lambda ids, for_id, name: None
        self.default_idle_s: Callable[[], int] = lambda: 300
        self.default_make_room_s: Callable[[], int | None] = lambda: None
        self.activity: Callable[[str], None] = lambda deployment_id: None
        # A pre-warm's outcome: its first request came (True), or it stopped without one.
        self.prewarm_ended: Callable[[str, bool], None] = lambda deployment_id, used: None
        self.stop_timeout_s = 30.0  # SIGTERM, then SIGKILL after this
        self.health_failure_window_s = HEALTH_FAILURE_WINDOW_S
        self.launch_spec: Callable[[DeploymentState], LaunchSpec] | None = None
        self.log_lines: EngineLogLines | None = None  # engine logs, for start milestones
        # False: no monitor of ready engines (a what-if's: they cannot exit, hang or report
        # load, so the monitor's every five seconds would only cost time).
        self.watch_engines = True


class DeploymentActor(Actor):
    """The lifecycle of one deployment."""

    def __init__(
        self,
        state: DeploymentState,
        *,
        clock: Clock,
        store: EventStore,
        runtime: Runtime,
        probe: EngineProbe,
        broker: MemoryBroker,
        hooks: Hooks,
    ) -> None:
        super().__init__(f"deployment:{state.deployment_id}", clock)
        self.state = state
        self.activity = Activity(clock.now())
        self._store = store
        self._runtime = runtime
        self._probe = probe
        self._broker = broker
        self._hooks = hooks
        self._handle: EngineHandle | None = None
        self._attempt = 0  # bumps on every launch/stop, so stale reports are ignored
        self._work: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._idle_timer: TimerHandle | None = None
        self._idle_due = 0.0  # when the idle timer is due (its clock's time)
        self._retry_timer: TimerHandle | None = None
        self._removed = False
        self._orphans: set[asyncio.Task[None]] = set()
        self._unhealthy_since: float | None = None
        self._checking: asyncio.Task[None] | None = None
        # From a suspicion (the gateway could not reach the engine) or a loss until the
        # outcome is known (cleared, stopped, or an always-on restart begun): requests wait
        # for it as for a start (`recovering`), never refused, never queued for memory.
        self._recovering = False
        self.lost_reason: str | None = None  # why the engine was lost, until it serves again
        # The last lost engine's runtime id and exit time (when the runtime knows it), kept
        # past its removal for the gateway's question (`Controller.exited_before`).
        self.last_exit: tuple[str, float | None] | None = None
        # The learned policy's keep-warm (seconds, shorter than the idle timeout) and why;
        # None: the idle timeout (the seed's rule).  Set by the controller.
        self.keep_s: float | None = None
        self.keep_reason = ""
        # Between sessions (`KeepWarm.lends`): after its keep-warm it lends its memory, as a
        # make-room candidate spared like a pre-warm for this session (epoch seconds), and
        # sleeps at its idle timeout; None: it does not lend.  Set by the controller.
        self.lends_for: float | None = None
        # A pre-warm waiting for its first request: until when (its clock's time) it is
        # kept for it, and when that request is expected (epoch seconds); None: no pre-warm
        # pending.
        self.prewarm_until: float | None = None
        self.prewarm_expected_at: float | None = None

    @property
    def deployment_id(self) -> str:
        """The deployment's id."""
        return self.state.deployment_id

    @property
    def recovering(self) -> bool:
        """Whether the engine is being checked or replaced after the gateway could not reach
        it, or after it was lost: requests wait for the outcome as for a start."""
        return self._recovering

    @property
    def engine_handle(self) -> EngineHandle | None:
        """Where the engine answers while it is ready and accepting requests."""
        return self._handle if self.activity.accepting else None

    # --- the hot path (synchronous, called by the gateway) -------------------------------

    def try_acquire(self) -> LeaseImpl | None:
        """A lease when ready and accepting requests; counts the request in flight."""
        act = self.activity
        if not act.accepting or self._handle is None:
            return None
        act.in_flight += 1
        act.last_used = self.clock.now()
        if self.prewarm_until is not None:
            self._prewarm_ended(used=True)
        # The idle timer stays armed: if it fires during the request, `_idle_check` finds
        # the model busy and the request's end arms it again.
        self._hooks.activity(self.deployment_id)
        return LeaseImpl(self, self._handle)

    def request_ended(self) -> None:
        """A request in flight ended; the idle timer runs from now."""
        act = self.activity
        act.in_flight = max(0, act.in_flight - 1)
        act.served += 1
        act.last_used = self.clock.now()
        if act.in_flight == 0:
            self._arm_idle_timer(lazily=True)
        self._hooks.activity(self.deployment_id)

    # --- recording -----------------------------------------------------------------------

    async def _record(self, actor: str, *events: m.AnyEvent) -> None:
        try:
            recs = await self._store.append(
                m.deployment_stream(self.deployment_id),
                list(events),
                actor=actor,
                expected_version=self.state.version,
            )
        except StorageError as exc:
            log.error("record_failed", deployment=self.deployment_id, error=str(exc))
            raise WriteFailed(str(exc)) from None
        for rec in recs:
            self.state = evolve_deployment(self.state, rec)

    async def on_crash(self, exc: Exception) -> None:
        """Rebuild the state from this deployment's stream."""
        recs = await self._store.read(stream=m.deployment_stream(self.deployment_id))
        state = self.state
        for rec in recs:
            if rec.version > state.version:
                state = evolve_or_fail(state, rec)
        self.state = state

    def _changed(self, outcome: Outcome | None = None, detail: str = "") -> None:
        self._hooks.changed(self.state, outcome, detail)

    # --- messages --------------------------------------------------------------------------

    async def handle(self, message: Any) -> Any:
        """Dispatch one command; an engine report whose event could not be written rolls
        forward: it is delivered again until the write succeeds."""
        try:
            return await self._dispatch(message)
        except WriteFailed:
            if isinstance(message, _REPORTS):
                self.schedule(WRITE_RETRY_S, message)
                return None
            raise

    async def _dispatch(self, message: Any) -> Any:
        match message:
            case StartDeployment():
                return await self._start(message)
            case StopDeployment():
                return await self._stop(message.reason, message.actor)
            case SleepDeployment():
                return await self._sleep(message)
            case ChangeMode():
                return await self._change_mode(message)
            case Reconfigure():
                return await self._reconfigure(message)
            case RemoveDeployment():
                return await self._remove(message.actor)
            case Adopt():
                return await self._adopt(message.handle)
            case IdleCheck():
                return await self._idle_check()
            case _Launched():
                return await self._on_launched(message)
            case _Milestone():
                return await self._on_milestone(message)
            case _Booted():
                return await self._on_booted(message)
            case _BootFailed():
                return await self._on_boot_failed(message)
            case _Gone():
                return await self._on_gone(message)
            case _Lost():
                return await self._on_lost(message)
            case _Scraped():
                return await self._on_scraped(message)
            case _RetryStart():
                return await self._on_retry(message)
            case _Suspect():
                return self._on_suspect()
            case _Cleared():
                return self._on_cleared(message)
        raise TypeError(f"unknown message {type(message).__name__}")

    # --- starting ------------------------------------------------------------------------

    async def _start(self, cmd: StartDeployment) -> None:
        dep = self.state
        if self._removed:
            if cmd.reserved:
                self._broker.release(self.deployment_id)
            raise Refusal(404, "not_found", f"{dep.name} was removed")
        if dep.lifecycle in (Lifecycle.READY, Lifecycle.STARTING):
            return
        if dep.lifecycle is Lifecycle.STOPPING:
            raise Refusal(409, "stopping", f"{dep.name} is stopping; start it once it stopped")
        if dep.lifecycle is Lifecycle.ASLEEP:
            await self._record(cmd.actor, _start_requested(cmd))
            await self._wake()
            return
        try:
            spec = self._checked_spec()
        except Refusal as exc:
            if cmd.reserved:  # the queue's reservation, for requests that now cannot be served
                self._broker.release(self.deployment_id)
                self._changed("failed", exc.message)
            raise
        held_before = self._broker.holds(self.deployment_id)
        if not cmd.reserved:
            victims = self._broker.reserve(
                self.deployment_id,
                dep.memory_bytes,
                always_on=not dep.on_demand,
                candidates=self._hooks.candidates(self.deployment_id),
            )
            if victims is None:
                free = max(0, self._broker.free())
                raise Refusal(
                    409,
                    "insufficient_memory",
                    f"{dep.name} needs {gib(dep.memory_bytes)} GiB but only {gib(free)} GiB "
                    "are free and no idle on-demand model can make room",
                )
            if victims:
                self._hooks.sleep_victims(victims, self.deployment_id, dep.name)
        try:
            await self._record(cmd.actor, _start_requested(cmd))
        except WriteFailed as exc:
            if cmd.reserved:
                self._broker.release(self.deployment_id)
                self._changed("failed", exc.message)
            elif not held_before:
                self._broker.release(self.deployment_id)
            raise
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        if self.prewarm_until is not None:  # left over from an engine lost since
            self._prewarm_ended(used=False)
        if cmd.reason == "prewarm":
            self.prewarm_until = cmd.hold_until
            self.prewarm_expected_at = cmd.expected_at
        self._begin_boot(spec)
        self._changed()

    def _checked_spec(self) -> LaunchSpec:
        """The launch spec, or Refusal(422) naming what is wrong; checked before recording."""
        try:
            return self._launch_spec()
        except ActorError:
            raise
        except ValueError as exc:
            raise Refusal(422, "invalid_args", f"args: {exc}") from None

    def _begin_boot(self, spec: LaunchSpec) -> None:
        self._attempt += 1
        attempt = self._attempt
        self._work = asyncio.get_running_loop().create_task(
            self._boot(spec, attempt), name=f"boot:{self.deployment_id}"
        )

    def _launch_spec(self) -> LaunchSpec:
        if self._hooks.launch_spec is None:
            raise RuntimeFailure("no launch spec builder configured")
        return self._hooks.launch_spec(self.state)

    async def _boot(self, spec: LaunchSpec, attempt: int) -> None:
        handle: EngineHandle | None = None
        try:
            async with self._broker.launch_slot(self.deployment_id):
                launch_began_at = self.clock.wall()
                launch = asyncio.ensure_future(self._runtime.launch(spec))
                try:
                    handle = await asyncio.shield(launch)
                except asyncio.CancelledError:
                    launch.add_done_callback(self._stop_orphan)
                    raise
                self._handle = handle
                self._broker.launched(self.deployment_id)
                self.tell(
                    _Launched(handle=handle, attempt=attempt, launch_began_at=launch_began_at)
                )
                launched_at = self.clock.now()
                watch = start_watching(
                    self._hooks.log_lines,
                    handle,
                    spec.engine,
                    lambda name, took: self.tell(
                        _Milestone(
                            milestone=name, took_s=took, at=self.clock.wall(), attempt=attempt
                        )
                    ),
                )
                outcome = None
                try:
                    outcome = await wait_until_ready(
                        runtime=self._runtime,
                        probe=self._probe,
                        clock=self.clock,
                        engine=spec.engine,
                        handle=handle,
                        launched_at=launched_at,
                        deadline=launched_at + spec.startup_timeout_s,
                    )
                finally:
                    stop_watching(watch, ready=outcome is BootOutcome.READY)
                if outcome is BootOutcome.READY:
                    self.tell(_Booted(attempt=attempt))
                    return
                why = (
                    "the engine exited"
                    if outcome is BootOutcome.EXITED
                    else f"not ready after {spec.startup_timeout_s:g} s"
                )
                tail = await self._runtime.logs_tail(handle, 20)
                self.tell(_BootFailed(reason=_reason(why, tail), attempt=attempt))
        except asyncio.CancelledError:
            raise
        except LookupError:
            self.tell(_BootFailed(reason="its memory reservation was withdrawn", attempt=attempt))
        except ActorError as exc:
            self.tell(_BootFailed(reason=str(exc), attempt=attempt))
        except Exception as exc:  # policy: any launch bug becomes a start failure, logged
            log.exception("boot_crashed", deployment=self.deployment_id)
            self.tell(_BootFailed(reason=f"internal error: {exc}", attempt=attempt))

    def _stop_orphan(self, launch: asyncio.Future[EngineHandle]) -> None:
        """A launch finished after its start was cancelled: stop what it made."""
        if launch.cancelled() or launch.exception() is not None:
            return
        self._spawn_stop(launch.result())

    def _spawn_stop(self, handle: EngineHandle) -> None:
        """Stop an engine nobody waits for (a failed start's leftovers, an orphan)."""
        task = asyncio.get_running_loop().create_task(self._stop_engine(handle))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _on_launched(self, msg: _Launched) -> None:
        if msg.attempt != self._attempt or self.state.lifecycle is not Lifecycle.STARTING:
            return
        await self._record(
            "system",
            m.EngineStarting(
                runtime_id=msg.handle.runtime_id,
                host=msg.handle.host,
                port=msg.handle.port,
                launch_began_at=msg.launch_began_at,
            ),
        )
        self._changed()

    async def _on_milestone(self, msg: _Milestone) -> None:
        """The engine's log showed a loading milestone: one event, a few per start.  One
        read just after the engine answered ready was printed before: it counts at ready."""
        dep = self.state
        if msg.attempt != self._attempt:
            return
        if dep.lifecycle is Lifecycle.STARTING:
            at = msg.at
        elif dep.lifecycle is Lifecycle.READY:
            at = min(msg.at, dep.changed_at)
        else:
            return
        event = m.EngineMilestoneReached(milestone=msg.milestone, at=at, took_s=msg.took_s)
        # Nothing the queue, LiteLLM or the deployment's record depend on changed: no hook.
        await self._record("system", event)

    async def _on_booted(self, msg: _Booted) -> None:
        if msg.attempt != self._attempt or self.state.lifecycle is not Lifecycle.STARTING:
            return
        events: list[m.AnyEvent] = [m.EngineReady()]
        if self.state.pending_mode is not None:
            events += [
                m.ModeChanged(
                    mode=self.state.pending_mode, idle_timeout_s=self.state.idle_timeout_s
                ),
                m.PendingModeCleared(),
            ]
        await self._record("system", *events)
        self.lost_reason = None
        self._broker.set_always_on(self.deployment_id, not self.state.on_demand)
        self.activity.last_used = self.clock.now()
        self.activity.accepting = True
        self.activity.load = None
        self.activity.direct = 0
        self._arm_idle_timer()
        self._start_monitor()
        self._changed("ready")

    async def _on_boot_failed(self, msg: _BootFailed) -> None:
        if msg.attempt != self._attempt or self.state.lifecycle is not Lifecycle.STARTING:
            return
        handle, self._handle = self._handle, None
        if handle is not None:
            self._spawn_stop(handle)
        failures = self.state.failures + 1
        retry_at = self.clock.wall() + backoff_s(failures)
        events: list[m.AnyEvent] = [
            m.EngineStartFailed(reason=msg.reason, failures=failures, retry_at=retry_at)
        ]
        if self.state.pending_mode is not None:
            # The switch is applied anyway: the deployment is now always on (and failed).
            events += [
                m.ModeChanged(
                    mode=self.state.pending_mode, idle_timeout_s=self.state.idle_timeout_s
                ),
                m.PendingModeCleared(),
            ]
        await self._record("system", *events)
        self.lost_reason = None
        if self.prewarm_until is not None:
            self._prewarm_ended(used=False)
        self._release_or_keep_for_restart()
        if not self.state.on_demand:
            self._retry_timer = self.schedule(backoff_s(failures), _RetryStart(failures=failures))
        self._changed("failed", msg.reason)

    def _release_or_keep_for_restart(self) -> None:
        """A failed always-on deployment keeps its memory for its restart; others give it back."""
        if self.state.on_demand:
            self._broker.release(self.deployment_id)
        else:
            self._broker.keep_for_restart(self.deployment_id)

    async def _on_retry(self, msg: _RetryStart) -> None:
        dep = self.state
        if dep.on_demand or dep.lifecycle is not Lifecycle.FAILED or dep.failures != msg.failures:
            return
        try:
            await self._start(StartDeployment(reason="restart", actor="system"))
        except Refusal as exc:
            log.warning("restart_refused", deployment=self.deployment_id, reason=exc.message)
            self._retry_timer = self.schedule(
                backoff_s(dep.failures), _RetryStart(failures=dep.failures)
            )

    def in_backoff(self) -> bool:
        """Whether a start failure forbids a new start right now."""
        dep = self.state
        return (
            dep.lifecycle is Lifecycle.FAILED
            and dep.retry_at is not None
            and self.clock.wall() < dep.retry_at
        )

    async def _wake(self) -> None:
        handle = self._handle
        if handle is None:
            return
        try:
            await self._probe.wake_up(self.state.engine, handle)
        except ActorError as exc:
            log.warning("wake_failed", deployment=self.deployment_id, error=str(exc))
        self.activity.engine_sleeping = False
        await self._record("system", m.EngineAwake())
        self.activity.accepting = True
        self.activity.last_used = self.clock.now()
        self._arm_idle_timer()
        self._changed("ready")

    # --- stopping ------------------------------------------------------------------------

    async def _stop(self, reason: m.StopReason, actor: str) -> None:
        dep = self.state
        if dep.lifecycle is Lifecycle.STOPPED:
            return
        if dep.lifecycle is Lifecycle.FAILED:
            await self._record(actor, m.StopRequested(reason=reason), m.EngineStopped())
            self._broker.release(self.deployment_id)  # an always-on one kept it for a restart
            self._changed("stopped", reason)
            return
        if dep.lifecycle is Lifecycle.STOPPING:
            # A stop is under way and reports when the engine is gone; halting again would
            # cancel it half-way and leave the engine running with its memory released.
            await self._record(actor, m.StopRequested(reason=reason))
            self._changed(None, f"{reason}:{actor}")
            return
        was_starting_for_request = dep.lifecycle is Lifecycle.STARTING
        accepting = self.activity.accepting
        self.activity.accepting = False  # no new request may start while the stop is recorded
        events: list[m.AnyEvent] = [m.StopRequested(reason=reason)]
        if dep.pending_mode is not None:
            events += [
                m.ModeChanged(mode=dep.pending_mode, idle_timeout_s=dep.idle_timeout_s),
                m.PendingModeCleared(),
            ]
        try:
            await self._record(actor, *events)
        except WriteFailed:
            self.activity.accepting = accepting  # nothing was recorded: nothing changed
            raise
        self._changed("stopped" if was_starting_for_request else None, f"{reason}:{actor}")
        await self._halt()

    async def _sleep(self, cmd: SleepDeployment) -> bool:
        dep = self.state
        if cmd.reason != "watchdog":
            idle, why = self._idle_for(cmd.reason)
            if not idle:
                log.info("sleep_refused", deployment=self.deployment_id, reason=why)
                return False
        elif not dep.on_demand or dep.lifecycle not in (
            Lifecycle.READY,
            Lifecycle.ASLEEP,
            Lifecycle.STARTING,
        ):
            return False
        accepting = self.activity.accepting
        self.activity.accepting = False
        self._broker.mark_releasing(self.deployment_id)
        idle_for = self.clock.now() - self.activity.last_used
        idle_timeout = dep.effective_idle_timeout_s(self._hooks.default_idle_s())
        # The learned keep-warm it ended: after which it slept, or lent the memory now taken.
        ended_by = "make_room" if self.lends_for is not None else "idle"
        kept = self.keep_s if cmd.reason == ended_by and self.prewarm_until is None else None
        kept = kept if kept is not None and kept < idle_timeout else None
        try:
            await self._record(
                cmd.actor,
                m.PutToSleep(
                    reason=cmd.reason,
                    idle_timeout_s=idle_timeout,
                    for_deployment=cmd.for_deployment,
                    for_name=cmd.for_name,
                    idle_for_s=round(idle_for, 3),
                    free_bytes=cmd.free_bytes,
                    kept_warm_s=0 if kept is None else max(1, round(kept)),
                    kept_warm_reason="" if kept is None else self.keep_reason,
                    prewarm_unused=self.prewarm_until is not None,
                ),
            )
        except WriteFailed:
            self.activity.accepting = accepting  # nothing was recorded: it keeps serving
            self._broker.unmark_releasing(self.deployment_id)
            raise
        self._changed(None, cmd.reason)
        await self._halt()
        return True

    def _prewarm_ended(self, *, used: bool) -> None:
        self.prewarm_until = self.prewarm_expected_at = None
        self._hooks.prewarm_ended(self.deployment_id, used)

    async def _halt(self) -> None:
        """Cancel a boot or monitor in progress and stop the engine in the background."""
        if self.prewarm_until is not None:
            self._prewarm_ended(used=False)
        self._attempt += 1
        attempt = self._attempt
        self._broker.mark_releasing(self.deployment_id)
        self._cancel_idle_timer()
        await self._cancel_tasks()
        handle, self._handle = self._handle, None
        self._work = asyncio.get_running_loop().create_task(
            self._stop_and_report(handle, attempt), name=f"stop:{self.deployment_id}"
        )

    async def _stop_and_report(self, handle: EngineHandle | None, attempt: int) -> None:
        if handle is not None:
            await self._stop_engine(handle)
        if self.running:
            self.tell(_Gone(attempt=attempt))

    async def _stop_engine(self, handle: EngineHandle) -> None:
        try:
            await self._runtime.stop(handle, self._hooks.stop_timeout_s)
        except ActorError as exc:
            log.error("engine_stop_failed", deployment=self.deployment_id, error=str(exc))

    async def _on_gone(self, msg: _Gone) -> None:
        if msg.attempt != self._attempt:
            return
        if self.state.lifecycle is Lifecycle.STOPPING:
            await self._record("system", m.EngineStopped())
        self._broker.release(self.deployment_id)
        self.activity.load = None
        self.activity.direct = 0
        self.activity.engine_sleeping = False
        self._changed("removed" if self._removed else "stopped", "stopped")

    async def _cancel_tasks(self) -> None:
        # Whatever the engine's check or loss was about, a stop or removal decides now.
        self._recovering = False
        self.lost_reason = None
        tasks = [t for t in (self._work, self._monitor) if t is not None and not t.done()]
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        for task in tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._work = None
        self._monitor = None

    # --- monitoring: metrics every 5 s, engine liveness ----------------------------------

    def _start_monitor(self) -> None:
        attempt = self._attempt
        self._unhealthy_since = None
        if self._monitor is not None and not self._monitor.done():
            self._monitor.cancel()
        if not self._hooks.watch_engines:
            return
        self._monitor = asyncio.get_running_loop().create_task(
            self._monitor_loop(attempt), name=f"monitor:{self.deployment_id}"
        )

    async def _monitor_loop(self, attempt: int) -> None:
        handle = self._handle
        if handle is None:
            return
        engine = self.state.engine
        while True:
            unhealthy = self._unhealthy_since is not None
            await self.clock.sleep(HEALTH_RETRY_S if unhealthy else METRICS_EVERY_S)
            try:
                running = await self._runtime.is_running(handle)
            except ActorError:
                running = True  # the runtime itself is unreachable: do not assume a crash
            if not running:
                tail = ""
                with contextlib.suppress(ActorError):
                    tail = await self._runtime.logs_tail(handle, 20)
                self.tell(_Lost(reason=_reason("the engine exited", tail), attempt=attempt))
                return
            healthy = await self._still_healthy(engine, handle, attempt)
            if healthy is None:
                return
            if not healthy:
                continue  # no scrape of an engine that does not answer: look again soon
            load: EngineLoad | None = None
            sleeping = False
            served = self.activity.served
            with contextlib.suppress(ActorError):
                load = await self._probe.load(engine, handle)
            if engine == "vllm":
                with contextlib.suppress(ActorError):
                    sleeping = await self._probe.is_sleeping(engine, handle)
            self.tell(_Scraped(load=load, sleeping=sleeping, attempt=attempt, served_before=served))

    # --- liveness after ready: the engine's own answers -----------------------------------

    async def _still_healthy(self, engine: str, handle: EngineHandle, attempt: int) -> bool | None:
        """Probe health: True when it answers, False while it fails within the window, None
        once it failed for the whole window and was reported lost (a hung engine keeps its
        process but answers nothing)."""
        started = self.clock.now()
        if self.state.lifecycle is not Lifecycle.READY:
            return True  # asleep by hand, or being stopped: not a health question
        if await self._answers_health(engine, handle):
            self._unhealthy_since = None
            return True
        if self._unhealthy_since is None:
            self._unhealthy_since = started
        window = self._hooks.health_failure_window_s
        if self.clock.now() - self._unhealthy_since < window:
            return False
        reason = f"the engine did not answer its health check for {window:g} s"
        self.tell(_Lost(reason=reason, attempt=attempt))
        return None

    async def _answers_health(self, engine: str, handle: EngineHandle) -> bool:
        try:
            return await self._probe.readiness(engine, handle) is Readiness.READY
        except ActorError:
            return False

    def _on_suspect(self) -> None:
        """The gateway found the engine refusing or resetting connections: stop sending it
        requests (they wait for it instead) and check it at once."""
        handle = self._handle
        if (
            handle is None
            or self.state.lifecycle is not Lifecycle.READY
            or not self.activity.accepting
            or self._checking is not None
        ):
            return
        self.activity.accepting = False
        self._recovering = True
        self._checking = asyncio.get_running_loop().create_task(
            self._check_suspect(handle, self._attempt), name=f"suspect:{self.deployment_id}"
        )

    async def _check_suspect(self, handle: EngineHandle, attempt: int) -> None:
        try:
            try:
                running = await self._runtime.is_running(handle)
            except ActorError:
                running = True
            healthy = running and await self._answers_health(self.state.engine, handle)
            if healthy:
                self.tell(_Cleared(attempt=attempt))
                return
            tail = ""
            if not running:
                with contextlib.suppress(ActorError):
                    tail = await self._runtime.logs_tail(handle, 20)
            what = "the engine exited" if not running else "the engine refused connections"
            self.tell(_Lost(reason=_reason(what, tail), attempt=attempt))
        finally:
            self._checking = None

    def _on_cleared(self, msg: _Cleared) -> None:
        if msg.attempt == self._attempt and self.state.lifecycle is Lifecycle.READY:
            self._recovering = False
            self.activity.accepting = True
            self._changed("ready")

    async def _on_scraped(self, msg: _Scraped) -> None:
        if msg.attempt != self._attempt:
            return
        default_idle = self._hooks.default_idle_s()
        act = self.activity
        was_idle, _ = is_idle(self.state, act, self.clock.now(), default_idle)
        act.load = msg.load
        act.direct = direct_calls(msg.load, act.in_flight, act.served - msg.served_before)
        now_idle, _ = is_idle(self.state, act, self.clock.now(), default_idle)
        if now_idle and not was_idle:
            # The engine went quiet after the timeout ran out: it just became idle, so the
            # queue's head may now make room with it.
            self._changed(None, "idle")
        dep = self.state
        if msg.sleeping and dep.lifecycle is Lifecycle.READY:
            # A sleeping vLLM cannot answer: new requests go through the queue, which wakes it.
            self.activity.engine_sleeping = True
            self.activity.accepting = False
            await self._record("system", m.EngineAsleep())
            self._changed()
        elif not msg.sleeping and dep.lifecycle is Lifecycle.ASLEEP:
            self.activity.engine_sleeping = False
            await self._record("system", m.EngineAwake())
            self.activity.accepting = True
            self._changed("ready")

    async def _on_lost(self, msg: _Lost) -> None:
        if msg.attempt != self._attempt or self.state.lifecycle not in (
            Lifecycle.READY,
            Lifecycle.ASLEEP,
        ):
            return
        self.activity.accepting = False  # true whatever the log says: the engine is gone
        # Requests that come meanwhile wait for the outcome (`recovering`); an error for a
        # request the engine had names the loss (`lost_reason`).
        self._recovering = True
        self.lost_reason = msg.reason
        # Recorded first: if the write fails this report comes again (see `handle`).
        await self._record("system", m.EngineLost(reason=msg.reason))
        self._attempt += 1
        handle, self._handle = self._handle, None
        if handle is not None:
            self.last_exit = (handle.runtime_id, await self._exit_time(handle))
            await self._stop_engine(handle)
        self._release_or_keep_for_restart()
        if self.state.on_demand:
            # Stopped: the queue starts it at once for the requests that wait for it.
            self._recovering = False
            self._changed("stopped", "lost")
            return
        self._changed("stopped", "lost")
        try:
            await self._restart_after_loss(msg.reason)
        finally:
            self._recovering = False
        self._changed()  # starting (the waiting requests join the start) or failed

    async def _exit_time(self, handle: EngineHandle) -> float | None:
        """When the engine's process exited, if the runtime knows (`ExitTimes`)."""
        runtime = self._runtime
        if isinstance(runtime, ExitTimes):
            with contextlib.suppress(ActorError):
                return await runtime.exited_at(handle)
        return None

    async def _restart_after_loss(self, reason: str) -> None:
        """An always-on engine died after running: start it again at once (the backoff is for
        engines that fail to start); only a refused start waits out the backoff."""
        try:
            await self._start(StartDeployment(reason="restart", actor="system"))
            return
        except Refusal as exc:
            log.warning("restart_refused", deployment=self.deployment_id, reason=exc.message)
        if self.state.lifecycle is Lifecycle.STOPPED:
            failures = self.state.failures + 1
            retry_at = self.clock.wall() + backoff_s(failures)
            await self._record(
                "system",
                m.EngineStartFailed(reason=reason, failures=failures, retry_at=retry_at),
            )
            self._retry_timer = self.schedule(backoff_s(failures), _RetryStart(failures=failures))
            self._changed("failed", reason)

    # --- idle ----------------------------------------------------------------------------

    def _arm_idle_timer(self, *, lazily: bool = False) -> None:
        """Fire `IdleCheck` at last use + the idle timeout.  `lazily` (at the end of each
        request, the hot path): keep a timer that has not fired and fires no later, instead
        of replacing it; when it fires early, `_idle_check` finds the model not yet idle and
        arms it for the rest.  Per request that saves a cancel and a new timer (about half
        of a lease's cost), and leaves no cancelled timer behind."""
        dep = self.state
        if not dep.on_demand or dep.role == "decision":
            self._cancel_idle_timer()
            return
        at = self._idle_at()
        # Not one that fired: its check may have been dropped (a full mailbox).
        if lazily and self.pending(self._idle_timer) and self._idle_due <= at:
            return
        self._schedule_idle_check(max(0.0, at - self.clock.now()))

    def _idle_at(self) -> float:
        """When the idle timeout runs out: last use + the deployment's effective timeout, or
        the learned keep-warm when shorter; a pre-warm waits for its expected request."""
        timeout = self.state.effective_idle_timeout_s(self._hooks.default_idle_s())
        last = self.activity.last_used
        keep = None if self.lends_for is not None else self.keep_s  # lends, then sleeps
        at = last + (keep if keep is not None and keep < timeout else timeout)
        if self.prewarm_until is not None:  # a make-room candidate meanwhile
            at = max(at, self.prewarm_until)
        return at

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _schedule_idle_check(self, delay: float) -> None:
        self._cancel_idle_timer()
        self._idle_timer = self.schedule(delay, IdleCheck())
        self._idle_due = self.clock.now() + delay

    async def _idle_check(self) -> bool:
        # A check can come from a timer replaced after it fired: the one armed since stays.
        armed = self.pending(self._idle_timer)
        if not armed:
            self._idle_timer = None
        dep = self.state
        if not dep.on_demand or dep.lifecycle not in (Lifecycle.READY, Lifecycle.ASLEEP):
            return False
        idle, _why = self._idle_for("idle")
        if not idle:
            if self.activity.in_flight == 0 and not armed:
                self._arm_idle_timer_periodic()
            return False
        try:
            return await self._sleep(SleepDeployment(reason="idle", actor="ondemand"))
        except WriteFailed:
            self._schedule_idle_check(IDLE_CHECK_EVERY_S)  # try again later
            return False

    def default_idle_timeout_changed(self) -> None:
        """The DGXMM default changed: a deployment following it re-arms its timer."""
        if self.state.idle_timeout_s is None and self.activity.in_flight == 0:
            self._arm_idle_timer()

    def keep_warm_changed(self) -> None:
        """The learned keep-warm changed (`keep_s`): re-arm the idle timer."""
        if self.activity.in_flight == 0:
            self._arm_idle_timer()

    def _arm_idle_timer_periodic(self) -> None:
        due = self._idle_at() - self.clock.now()
        self._schedule_idle_check(due if due > 0 else IDLE_CHECK_EVERY_S)

    def _idle_for(self, reason: m.SleepReason) -> tuple[bool, str]:
        """Idle enough to sleep for `reason` (make room: `ondemand_make_room_after_s`)."""
        now, default_idle = self.clock.now(), self._hooks.default_idle_s()
        if reason == "make_room":
            if self.prewarm_until is not None and self.activity.in_flight == 0:
                # A pre-warm never delays a request: until its first one it is as if asleep.
                return _idle_after(self.state, self.activity, now, 0.0)
            room = self._seed_room()
            if room[0] or self.lends_for is None or self.keep_s is None:
                return room
            return _idle_after(self.state, self.activity, now, self.keep_s)  # it lends
        if self.keep_s is None and self.prewarm_until is None:
            return is_idle(self.state, self.activity, now, default_idle)
        timeout = self._idle_at() - self.activity.last_used
        return _idle_after(self.state, self.activity, now, timeout)

    def idle_candidate(self) -> Candidate | None:
        """This deployment as a make-room candidate, when it may sleep for room right now."""
        idle, _ = self._idle_for("make_room")
        if not idle:
            return None
        mem = self.state.memory_bytes
        if self.prewarm_until is not None:
            # An unused pre-warm is spared while idle models can make the room, and then
            # goes first: it delays no request.
            expected = math.inf if self.prewarm_expected_at is None else self.prewarm_expected_at
            return Candidate(self.deployment_id, mem, -math.inf, expected)
        # One that lends its memory between sessions is spared as its pre-warm would be.
        return Candidate(self.deployment_id, mem, self.activity.last_used, self.lends_for)

    def _seed_room(self) -> tuple[bool, str]:
        """`may_make_room` for it now: the seed's making-room rule."""
        return may_make_room(
            self.state,
            self.activity,
            self.clock.now(),
            self._hooks.default_idle_s(),
            self._hooks.default_make_room_s(),
        )

    def make_room_after_s(self) -> float:
        """How long without a request before it may sleep to make room: the seed's rule
        (`ondemand_make_room_after_s`), or its keep-warm when sooner while it lends its memory
        between sessions."""
        after: float = self.state.effective_make_room_after_s(
            self._hooks.default_idle_s(), self._hooks.default_make_room_s()
        )
        if self.lends_for is not None and self.keep_s is not None:
            after = min(after, self.keep_s)
        return after

    def lends_only(self) -> bool:
        """A make-room candidate only because it lends its memory between sessions: under
        the seed's making-room rule it is not one yet (a pre-warm may not take its memory)."""
        return self.lends_for is not None and not self._seed_room()[0]

    # --- mode, reconfiguration, removal --------------------------------------------------

    async def _change_mode(self, cmd: ChangeMode) -> dict[str, Any]:
        dep = self.state
        idle = dep.idle_timeout_s if cmd.keep_idle_timeout else cmd.idle_timeout_s
        room, policy = cmd.make_room_after_s, cmd.ondemand_policy
        room_changed = (
            not isinstance(room, msgspec.UnsetType) and room != dep.make_room_after_s
        ) or (not isinstance(policy, msgspec.UnsetType) and policy != dep.ondemand_policy)
        if cmd.mode == "on_demand" and dep.role == "decision":
            raise Refusal(409, "decision_model_always_on", "the decision model is always on")
        if cmd.mode == dep.mode and dep.pending_mode is None:
            if idle != dep.idle_timeout_s or room_changed:
                await self._record(
                    cmd.actor,
                    m.ModeChanged(
                        mode=dep.mode,
                        idle_timeout_s=idle,
                        make_room_after_s=room,
                        ondemand_policy=policy,
                    ),
                )
                self.activity.last_used = (
                    self.clock.now() if dep.on_demand else self.activity.last_used
                )
                self._arm_idle_timer()
                self._changed()
            return {"applied": True}
        if cmd.mode == "on_demand":
            events: list[m.AnyEvent] = [
                m.ModeChanged(
                    mode="on_demand",
                    idle_timeout_s=idle,
                    make_room_after_s=room,
                    ondemand_policy=policy,
                )
            ]
            if dep.pending_mode is not None:
                events.append(m.PendingModeCleared(applied=False))
            await self._record(cmd.actor, *events)
            self._broker.set_always_on(self.deployment_id, False)
            self.activity.last_used = self.clock.now()
            if dep.lifecycle is Lifecycle.FAILED:
                self._broker.release(self.deployment_id)  # kept for an always-on restart
                if self._retry_timer is not None:
                    self._retry_timer.cancel()
                    self._retry_timer = None
            self._arm_idle_timer()
            self._changed()
            return {"applied": True}
        # on demand -> always on
        if dep.lifecycle is Lifecycle.READY:
            await self._record(
                cmd.actor,
                m.ModeChanged(
                    mode="always_on",
                    idle_timeout_s=idle,
                    make_room_after_s=room,
                    ondemand_policy=policy,
                ),
            )
            self._broker.set_always_on(self.deployment_id, True)
            self._cancel_idle_timer()
            self._changed()
            return {"applied": True}
        if dep.lifecycle is Lifecycle.STARTING:
            await self._record(cmd.actor, m.PendingModeSet(mode="always_on"))
            self._changed()
            return {"applied": False, "pending_mode": "always_on"}
        if dep.lifecycle is Lifecycle.STOPPING:
            raise Refusal(409, "stopping", f"{dep.name} is stopping; switch it once it stopped")
        # stopped, failed or asleep: start it first through the memory check
        if dep.lifecycle is Lifecycle.ASLEEP:
            await self._record(cmd.actor, m.PendingModeSet(mode="always_on"))
            await self._record(cmd.actor, m.StartRequested(reason="mode_switch"))
            await self._wake()
            await self._record(
                cmd.actor,
                m.ModeChanged(
                    mode="always_on",
                    idle_timeout_s=idle,
                    make_room_after_s=room,
                    ondemand_policy=policy,
                ),
                m.PendingModeCleared(),
            )
            self._changed()
            return {"applied": True}
        spec = self._checked_spec()
        held_before = self._broker.holds(self.deployment_id)
        victims = self._broker.reserve(
            self.deployment_id,
            dep.memory_bytes,
            always_on=False,
            candidates=self._hooks.candidates(self.deployment_id),
        )
        if victims is None:
            free = max(0, self._broker.free())
            raise Refusal(
                409,
                "insufficient_memory",
                f"{dep.name} needs {gib(dep.memory_bytes)} GiB but only {gib(free)} GiB are free",
            )
        if victims:
            self._hooks.sleep_victims(victims, self.deployment_id, dep.name)
        kept: list[m.AnyEvent] = []
        if room_changed:
            kept.append(
                m.ModeChanged(
                    mode=dep.mode,
                    idle_timeout_s=dep.idle_timeout_s,
                    make_room_after_s=room,
                    ondemand_policy=policy,
                )
            )
        try:
            await self._record(
                cmd.actor,
                *kept,
                m.PendingModeSet(mode="always_on"),
                m.StartRequested(reason="mode_switch"),
            )
        except WriteFailed:
            if not held_before:
                self._broker.release(self.deployment_id)
            raise
        self._begin_boot(spec)
        self._changed()
        return {"applied": False, "pending_mode": "always_on"}

    async def _reconfigure(self, cmd: Reconfigure) -> None:
        dep = self.state
        if dep.lifecycle in (Lifecycle.STARTING, Lifecycle.STOPPING):
            raise Refusal(
                409, "busy", f"{dep.name} is {dep.lifecycle.value}; try again when it settled"
            )
        event: m.AnyEvent
        if cmd.model is not None:
            event = m.ModelSwitched(model=cmd.model, memory_bytes=cmd.memory_bytes, args=cmd.args)
        else:
            event = m.DeploymentReconfigured(
                memory_bytes=cmd.memory_bytes, args=cmd.args, image=cmd.image
            )
        was_running = dep.lifecycle in (Lifecycle.READY, Lifecycle.ASLEEP)
        if was_running:
            await self._stop("admin", cmd.actor)
        await self._record(cmd.actor, event)
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        self._changed()

    async def _remove(self, actor: str) -> None:
        dep = self.state
        if dep.lifecycle is Lifecycle.STOPPING and self._work is not None and not self._work.done():
            # Let the stop under way finish: cancelling it could leave the engine running.
            await asyncio.shield(self._work)
        running = dep.lifecycle is not Lifecycle.STOPPED
        if running:
            accepting = self.activity.accepting
            self.activity.accepting = False
            try:
                await self._record(actor, m.StopRequested(reason="removed"))
            except WriteFailed:
                self.activity.accepting = accepting  # nothing recorded: it keeps serving
                raise
        self.activity.accepting = False
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        self._cancel_idle_timer()
        self._attempt += 1
        await self._cancel_tasks()
        handle, self._handle = self._handle, None
        if running:
            self._changed("stopped", f"removed:{actor}")
            if handle is not None:
                await self._stop_engine(handle)  # removal waits until the engine is gone
            if self.state.lifecycle is Lifecycle.STOPPING:
                # If this write fails the stop is an intent on disk: start-up completes it.
                await self._record("system", m.EngineStopped())
        self._removed = True
        try:
            await self._record(actor, m.DeploymentRemoved())
        except WriteFailed:
            self._removed = False  # stopped, not removed: the operator may try again
            raise
        self._broker.release(self.deployment_id)
        self._changed("removed", actor)

    async def _adopt(self, handle: EngineHandle | None) -> None:
        dep = self.state
        if dep.lifecycle is Lifecycle.STOPPING:
            await self._complete_stop(handle)
            # Stopped now; an always-on one that only DGXMM's shutdown stopped starts again.
            dep, handle = self.state, None
        if handle is not None:
            self._handle = handle
            self._broker.adopt(self.deployment_id, dep.memory_bytes, always_on=not dep.on_demand)
            await self._record(
                "system",
                m.EngineAdopted(runtime_id=handle.runtime_id, host=handle.host, port=handle.port),
            )
            self.activity.accepting = True
            self.activity.last_used = self.clock.now()  # a restart restarts the idle timer
            self._arm_idle_timer()
            self._start_monitor()
            self._changed("ready")
            return
        if dep.lifecycle in (
            Lifecycle.STARTING,
            Lifecycle.READY,
            Lifecycle.ASLEEP,
            Lifecycle.STOPPING,
        ):
            reason = "the engine was not running when DGXMM started"
            await self._record("system", m.EngineLost(reason=reason))
            self._changed("stopped", "lost")
        dep = self.state
        stopped_by_admin = dep.stop_reason in ("admin", "removed")
        if not dep.on_demand and dep.lifecycle is Lifecycle.STOPPED and not stopped_by_admin:
            try:
                await self._start(StartDeployment(reason="always_on", actor="system"))
            except Refusal as exc:
                if exc.code == "invalid_args":  # it can never start: say so, visibly
                    await self._record(
                        "system",
                        m.EngineStartFailed(
                            reason=exc.message, failures=self.state.failures + 1, retry_at=None
                        ),
                    )
                    self._changed("failed", exc.message)

    async def _complete_stop(self, handle: EngineHandle | None) -> None:
        """A stop was recorded but DGXMM died before it finished: finish it, never adopt.

        A stop is an intent that survives a crash; adopting the engine would undo it."""
        if handle is not None:
            self._broker.adopt(self.deployment_id, self.state.memory_bytes, always_on=False)
            self._broker.mark_releasing(self.deployment_id)
            await self._stop_engine(handle)
        await self._record("system", m.EngineStopped())
        self._broker.release(self.deployment_id)
        self._changed("stopped", "stopped")

    def suspect(self) -> None:
        """The gateway could not reach the engine (refused or reset): stop sending it
        requests at once (a request sent again must not find it ready before it was
        checked) and check it now."""
        self._on_suspect()

    async def stop(self) -> None:
        """Stop the actor (not the engine: engines outlive DGXMM and are adopted later)."""
        if self._checking is not None:
            self._checking.cancel()
        await self._cancel_tasks()
        await super().stop()


def evolve_or_fail(dep: DeploymentState, rec: m.Recorded) -> DeploymentState:
    """`evolve_deployment`, except that an event that cannot happen leaves the deployment
    visibly failed with the reason instead of raising: one bad event must not stop DGXMM
    from starting.  Later events apply to the failed state, so every fold agrees."""
    try:
        return evolve_deployment(dep, rec)
    except IllegalTransition as exc:
        reason = (
            f"its event log cannot be folded: event {rec.seq} "
            f"({type(rec.event).__name__}): {exc}; start it again from its page"
        )
        log.error("deployment_fold_failed", deployment=dep.deployment_id, error=reason)
        return msgspec.structs.replace(
            dep,
            lifecycle=Lifecycle.FAILED,
            last_error=reason,
            retry_at=None,
            runtime_id=None,
            host=None,
            port=None,
            changed_at=rec.ts,
            version=rec.version,
        )


def _start_requested(cmd: StartDeployment) -> m.StartRequested:
    """The event a start records (a pre-warm's with its expected arrival and why)."""
    return m.StartRequested(
        reason=cmd.reason, request_id=cmd.request_id, expected_at=cmd.expected_at, detail=cmd.detail
    )


def _reason(what: str, tail: str) -> str:
    tail = tail.strip()
    if not tail:
        return what
    lines = tail.splitlines()[-5:]
    return f"{what}: " + " | ".join(line.strip() for line in lines if line.strip())


# Reports from the actor's own tasks: when their event cannot be written they come again.
_REPORTS = (_Launched, _Booted, _BootFailed, _Gone, _Lost)
