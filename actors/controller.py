"""The controller: the deployment actors, the queue and the broker, wired together.

It is what the gateway (`actors.admission.Controller`) and the admin API talk to.  It folds
the log at start-up, spawns one actor per deployment, reconciles with the runtime, and
relays changes to listeners (the UI's event stream, the LiteLLM sync).

Why it is over 600 lines: it is the one place where the admin commands meet the actors,
with their validation (done before anything is recorded); the pure validators at the end
are the part to move out first if it grows further.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from actors.admission import RETRY_AFTER_S, DeploymentView, Refused
from actors.cold_start import EngineLogLines, StartHistory
from actors.deployment import (
    Adopt,
    ChangeMode,
    DeploymentActor,
    Hooks,
    LeaseImpl,
    Reconfigure,
    Refusal,
    RemoveDeployment,
    SleepDeployment,
    StartDeployment,
    StopDeployment,
    evolve_or_fail,
)
from actors.errors import ActorError
from actors.memory_broker import Candidate, MemoryBroker
from actors.ports import (
    EngineHandle,
    EngineProbe,
    ExitTimes,
    LaunchSpec,
    Readiness,
    Runtime,
)
from actors.prewarm import Prewarmer
from actors.queue import QueueActor, WaiterImpl
from actors.runtime import Clock, TimerHandle
from events import model as m
from events.projections import badge, duration_text
from events.state import (
    EMPTY,
    DeploymentState,
    IllegalTransition,
    Lifecycle,
    SystemState,
    evolve,
    new_deployment,
)
from storage.eventlog import EventStore
from storage.snapshots import load_state

log = structlog.get_logger("dgxmm.controller")

DEFAULT_SETTINGS: dict[str, Any] = {
    "ondemand_idle_timeout_s": 300,
    "ondemand_queue_timeout_s": 900,
    "ondemand_max_queued": 64,
    "ondemand_make_room_after_s": None,  # None: the seed's rule (the full idle timeout)
    "ondemand_policy": "seed",  # or "learned" (`actors.anticipation`)
}
POLICIES = ("seed", "learned")

EXIT_SETTLE_S = 2.0  # how long `exited_before` waits for the runtime to see an exit
SHUTTING_DOWN = "DGXMM is shutting down; try again once it is back"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class DeploymentRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A deployment as the API shows it."""

    id: str
    name: str
    engine: str
    model: str
    memory_bytes: int
    mode: str
    pending_mode: str | None
    idle_timeout_s: int | None
    effective_idle_timeout_s: int
    role: str
    state: str
    badge: str
    in_flight: int
    queued: int
    waiting_for_start: int
    last_used_at: float | None
    failures: int
    retry_at: float | None
    last_error: str | None
    engine_url: str | None
    created_at: float
    args: list[str]
    make_room_after_s: int | None = None
    effective_make_room_after_s: int = 0
    # Why a deployment created (or started by an admin) did not start, until it starts.
    not_started: str | None = None
    # Median of its last cold starts, in seconds: an estimate; None without history.
    expected_start_s: float | None = None
    ondemand_policy: str | None = None  # its own; None: follows the DGXMM default
    effective_ondemand_policy: str = "seed"
    # Under the learned policy: its keep-warm (None: its idle timeout), its next expected
    # request (epoch seconds; None: not predictable) and both in words.
    learned_keep_warm_s: float | None = None
    next_expected_at: float | None = None
    learned: str | None = None


class DeploymentSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What an administrator asks for when creating a deployment."""

    name: str
    engine: str
    model: str
    memory_bytes: int
    mode: m.Mode = "always_on"
    idle_timeout_s: int | None = None
    role: m.Role = "model"
    args: list[str] = []
    image: str | None = None
    gpu: bool = False
    make_room_after_s: int | None = None
    ondemand_policy: m.Policy | None = None  # None: follows the DGXMM default


class Controller:
    """Owns the actors; implements `actors.admission.Controller`."""

    def __init__(
        self,
        *,
        store: EventStore,
        clock: Clock,
        runtime: Runtime,
        probe: EngineProbe,
        broker: MemoryBroker,
        launch_spec: Callable[[DeploymentState], LaunchSpec],
        defaults: dict[str, Any] | None = None,
        stop_timeout_s: float = 30.0,
        health_failure_window_s: float | None = None,
        watch_engines: bool = True,
        log_lines: EngineLogLines | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.runtime = runtime
        self.probe = probe
        self.broker = broker
        self._launch_spec = launch_spec
        self._defaults = {**DEFAULT_SETTINGS, **(defaults or {})}
        self.system: SystemState = EMPTY
        self._in_force()
        self.actors: dict[str, DeploymentActor] = {}
        self._hooks = Hooks()
        self._hooks.changed = self._on_changed
        self._hooks.candidates = self.candidates
        self._hooks.sleep_victims = self.sleep_victims
        self._hooks.default_idle_s = lambda: self._idle_s
        self._hooks.default_make_room_s = self.default_make_room_s
        self._hooks.launch_spec = launch_spec
        self._hooks.stop_timeout_s = stop_timeout_s
        if health_failure_window_s is not None:
            self._hooks.health_failure_window_s = health_failure_window_s
        self._hooks.watch_engines = watch_engines
        self._hooks.activity = self._on_activity
        self._hooks.log_lines = log_lines
        self.start_history = StartHistory()  # for the expected start time (an estimate)
        self.queue = QueueActor(
            clock=clock,
            store=store,
            broker=broker,
            lookup=self.actors.get,
            candidates=self.candidates,
            sleep_victims=self.sleep_victims,
            settings=self.setting,
            candidate_due=self.candidate_due,
        )
        self.queue.on_change = self._on_queue_change
        self.prewarmer = Prewarmer(self)
        self._hooks.prewarm_ended = self.prewarmer.ended
        self.queue.abandon_prewarms = self.prewarmer.abandon_for
        self._listeners: list[Callable[[str, str], None]] = []
        self._not_started: dict[str, Refusal] = {}  # deployment id -> why it did not start
        self._notes_due: TimerHandle | None = None  # when an idle model may make room for one
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    # --- settings ------------------------------------------------------------------------

    def setting(self, key: str) -> Any:
        """A setting: the recorded override, else the configured default."""
        return self.system.settings.get(key, self._defaults.get(key))

    @property
    def closing(self) -> bool:
        """Whether it is shutting down."""
        return self._closing

    def default_make_room_s(self) -> int | None:
        """`ondemand_make_room_after_s` in force (None: the seed's rule)."""
        return self._make_room_s

    def _in_force(self) -> None:
        # The two defaults every idle and make-room check reads (hundreds of thousands of
        # times in a what-if): kept as numbers, read again whenever the settings change.
        self._idle_s = int(self.setting("ondemand_idle_timeout_s"))
        value = self.setting("ondemand_make_room_after_s")
        self._make_room_s: int | None = None if value is None else int(value)

    def settings(self) -> dict[str, Any]:
        """All settings in force."""
        return {**self._defaults, **self.system.settings}

    async def change_settings(self, changes: dict[str, Any], actor: str) -> dict[str, Any]:
        """Validate and record settings; returns the settings in force."""
        checked = validate_settings(changes)
        current = self.settings()
        changed = {k: v for k, v in checked.items() if current.get(k) != v}
        if changed:
            recs = await self.store.append(
                m.STREAM_SETTINGS, [m.SettingsChanged(changes=changed)], actor=actor
            )
            self._fold(recs)
            if "ondemand_idle_timeout_s" in changed:
                for actor_ in self.actors.values():
                    actor_.default_idle_timeout_changed()
            if "ondemand_make_room_after_s" in changed or "ondemand_idle_timeout_s" in changed:
                self.queue.poke("settings")
            if "ondemand_policy" in changed or "ondemand_idle_timeout_s" in changed:
                self.prewarmer.refresh()
            self._notify("settings", "changed")
        return self.settings()

    # --- start-up ------------------------------------------------------------------------

    async def load(self) -> None:
        """Fold the log, spawn the actors, reconcile with the runtime."""
        # The newest snapshot plus the tail; a deployment whose event cannot happen is failed.
        state = await load_state(self.store, _evolve_or_fail)
        self.system = state
        self._in_force()
        self.store.add_listener(self._fold)
        await self.start_history.seed(self.store, state.deployments)
        self.store.add_listener(self.start_history.recorded)
        self.store.add_listener(self.prewarmer.recorded)
        self.queue.start()
        for dep in state.deployments.values():
            self._spawn(dep)
        await self.reconcile()
        self.prewarmer.start()

    def _fold(self, recs: list[m.Recorded]) -> None:
        state = self.system
        for rec in recs:
            if rec.seq > state.last_seq:
                state = _evolve_or_fail(state, rec)
        settings, self.system = self.system.settings, state
        if state.settings is not settings:
            self._in_force()

    def _spawn(self, dep: DeploymentState) -> DeploymentActor:
        actor = DeploymentActor(
            dep,
            clock=self.clock,
            store=self.store,
            runtime=self.runtime,
            probe=self.probe,
            broker=self.broker,
            hooks=self._hooks,
        )
        self.actors[dep.deployment_id] = actor
        actor.start()
        return actor

    async def reconcile(self) -> None:
        """Adopt engines still running, record the ones that vanished, stop orphans."""
        try:
            running = await self.runtime.list_engines()
        except ActorError as exc:
            log.error("reconcile_failed", error=str(exc))
            running = []
        by_dep: dict[str, EngineHandle] = {}
        for handle in running:
            actor = self.actors.get(handle.deployment_id)
            known = actor is not None and actor.state.lifecycle in (
                Lifecycle.STARTING,
                Lifecycle.READY,
                Lifecycle.ASLEEP,
                Lifecycle.STOPPING,
            )
            if not known or handle.deployment_id in by_dep:
                log.warning("orphan_engine_stopped", deployment=handle.deployment_id)
                try:
                    await self.runtime.stop(handle)
                except ActorError as exc:
                    log.error("orphan_stop_failed", error=str(exc))
                continue
            by_dep[handle.deployment_id] = handle
        for dep_id, actor in self.actors.items():
            found = by_dep.get(dep_id)
            if found is not None and not await self._answers(actor.state.engine, found):
                # Still loading when DGXMM stopped: start it again rather than guess.
                try:
                    await self.runtime.stop(found)
                except ActorError as exc:
                    log.error("stale_engine_stop_failed", error=str(exc))
                found = None
            try:
                await actor.ask(Adopt(handle=found), timeout=60)
            except ActorError as exc:  # policy: one deployment must not stop DGXMM starting
                log.error("adopt_failed", deployment=dep_id, error=str(exc))

    async def _answers(self, engine: str, handle: EngineHandle) -> bool:
        try:
            return await self.probe.readiness(engine, handle) is Readiness.READY
        except ActorError:
            return False

    async def close(self) -> None:
        """Stop the actors (engines keep running and are adopted at the next start)."""
        self.prewarmer.close()
        await self.queue.stop()
        for actor in list(self.actors.values()):
            await actor.stop()
        for task in list(self._tasks):
            task.cancel()
        if self._notes_due is not None:
            self._notes_due.cancel()

    # --- the gateway's side (actors.admission.Controller) --------------------------------

    def view(self, deployment_id: str) -> DeploymentView | None:
        """What the gateway needs to know about a deployment."""
        actor = self.actors.get(deployment_id)
        if actor is None:
            return None
        dep = actor.state
        return DeploymentView(
            deployment_id=dep.deployment_id,
            model_name=dep.name,
            served_model=dep.model,
            engine=dep.engine,
            state=dep.lifecycle.value,
            mode=dep.mode,
            created_at=dep.created_at,
            engine_handle=actor.engine_handle,
            lost=actor.lost_reason,
        )

    def try_acquire(self, deployment_id: str) -> LeaseImpl | None:
        """A lease at once when the model is ready."""
        actor = self.actors.get(deployment_id)
        return None if actor is None else actor.try_acquire()

    def enqueue(self, deployment_id: str, request_id: str, *, waited_s: float = 0.0) -> WaiterImpl:
        """Wait for the model; raises Refused at once when it cannot wait.  An always-on
        deployment DGXMM is restarting after a loss is waited for, not refused."""
        actor = self.actors.get(deployment_id)
        if actor is None:
            raise Refused(404, "model_not_found", f"no deployment {deployment_id}")
        if self._closing:
            raise Refused(503, "ondemand_stopped", SHUTTING_DOWN, RETRY_AFTER_S)
        refusal = None if actor.recovering else stopped_always_on(actor.state)
        if refusal is not None:
            raise refusal
        return self.queue.enqueue(actor, request_id, waited_s)

    async def exited_before(self, handle: EngineHandle, wall: float) -> bool:
        """Whether the engine had exited before `wall`; False unless the runtime can tell
        (`actors.ports.ExitTimes`)."""
        actor = self.actors.get(handle.deployment_id)
        known = None if actor is None else actor.last_exit
        if known is not None and known[0] == handle.runtime_id and known[1] is not None:
            return known[1] < wall  # asked before its engine was removed
        runtime = self.runtime
        if not isinstance(runtime, ExitTimes):
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EXIT_SETTLE_S
        try:
            at = await runtime.exited_at(handle)
            # The daemon may not have seen an exit of an instant ago: look again, briefly.
            while at is None and loop.time() < deadline and await runtime.is_running(handle):
                await asyncio.sleep(0.05)
                at = await runtime.exited_at(handle)
        except ActorError as exc:
            log.info("engine_exit_unknown", deployment=handle.deployment_id, error=str(exc))
            return False
        log.info("engine_exit_checked", deployment=handle.deployment_id, exited_at=at, sent=wall)
        return at is not None and at < wall

    def engine_unreachable(self, deployment_id: str) -> None:
        """The gateway could not reach the engine: the deployment checks it at once."""
        actor = self.actors.get(deployment_id)
        if actor is not None:
            actor.suspect()

    def begin_shutdown(self) -> None:
        """DGXMM is stopping: refuse new waits, answer every waiting request with 503."""
        self._closing = True
        self.queue.refuse_all(Refused(503, "ondemand_stopped", SHUTTING_DOWN, RETRY_AFTER_S))

    # --- make room -----------------------------------------------------------------------

    def candidates(self, for_deployment: str) -> list[Candidate]:
        """Idle on-demand deployments that could sleep to make room for another."""
        found = []
        for dep_id, actor in self.actors.items():
            if dep_id == for_deployment:
                continue
            cand = actor.idle_candidate()
            if cand is not None:
                found.append(cand)
        return self.prewarmer.spare(found)

    def candidate_due(self, for_deployment: str) -> float | None:
        """When the next model not yet a candidate becomes one (None: none will while idle)."""
        now = self.clock.now()
        due: float | None = None
        for dep_id, actor in self.actors.items():
            dep = actor.state
            if dep_id == for_deployment or not dep.on_demand or dep.role == "decision":
                continue
            if dep.lifecycle not in (Lifecycle.READY, Lifecycle.ASLEEP) or actor.activity.in_flight:
                continue
            at = actor.activity.last_used + actor.make_room_after_s()
            if at > now and (due is None or at < due):
                due = at
        return due

    def sleep_victims(self, victims: list[str], for_id: str, for_name: str) -> None:
        """Ask each victim to sleep; each re-checks that it is idle just before it stops."""
        for victim in victims:
            actor = self.actors.get(victim)
            if actor is None:
                self.broker.release(victim)
                continue
            self._spawn_task(self._sleep_one(actor, for_id, for_name))

    async def _sleep_one(self, actor: DeploymentActor, for_id: str, for_name: str) -> None:
        try:
            slept = await actor.ask(
                SleepDeployment(
                    reason="make_room", actor="ondemand", for_deployment=for_id, for_name=for_name
                )
            )
        except ActorError as exc:
            log.error("make_room_failed", deployment=actor.deployment_id, error=str(exc))
            slept = False
        if not slept:
            self.broker.unmark_releasing(actor.deployment_id)
            self.queue.replan(for_id)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- changes -------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[str, str], None]) -> None:
        """`listener(deployment_id, what)` on every change of a deployment or of the queue."""
        self._listeners.append(listener)

    def _notify(self, deployment_id: str, what: str) -> None:
        for listener in self._listeners:
            try:
                listener(deployment_id, what)
            except Exception:  # policy: a broken listener must not break the controller
                log.exception("listener_failed")

    def _on_changed(self, dep: DeploymentState, outcome: str | None, detail: str) -> None:
        if dep.lifecycle is not Lifecycle.STOPPED or outcome == "removed":
            self._not_started.pop(dep.deployment_id, None)
        self.queue.deployment_changed(dep.deployment_id, outcome, detail)
        self.prewarmer.give_way(dep.deployment_id)
        if outcome == "removed":
            self.prewarmer.forget(dep.deployment_id)
            actor = self.actors.pop(dep.deployment_id, None)
            if actor is not None:
                self._spawn_task(actor.stop())
        self._notify(dep.deployment_id, outcome or detail or "changed")
        if self._not_started:
            self._refresh_notes(dep.deployment_id)

    def _refresh_notes(self, changed: str) -> None:
        """Push again the deployments with a note on why they did not start: the note is
        read from the budget as it is (`_not_started_now`), and another deployment's change
        or use, or the moment an idle one may make room, can change it."""
        for dep_id in list(self._not_started):
            if dep_id != changed:  # "activity": no LiteLLM entry follows a note
                self._notify(dep_id, "activity")
        self._arm_notes_timer()

    def _arm_notes_timer(self) -> None:
        """Refresh the notes when the next model may make room.  A use only makes that
        moment later: a timer set before it fires early at worst, and sets the next one."""
        if self._notes_due is not None:
            self._notes_due.cancel()
            self._notes_due = None
        due: float | None = None
        for dep_id in self._not_started:
            at = self.candidate_due(dep_id)
            if at is not None and (due is None or at < due):
                due = at
        if due is not None:
            self._notes_due = self.clock.call_later(
                max(0.0, due - self.clock.now()), lambda: self._refresh_notes("")
            )

    def _on_activity(self, deployment_id: str) -> None:
        self._notify(deployment_id, "activity")
        if self._not_started:  # a note may follow this use; the hot path only pushes
            for dep_id in self._not_started:
                self._notify(dep_id, "activity")
            if self._notes_due is None:  # the last one found every model busy
                self._arm_notes_timer()
        if len(self.queue):
            self.queue.activity(deployment_id)

    def _on_queue_change(self, deployment_id: str) -> None:
        self.prewarmer.give_way(deployment_id)
        self._notify(deployment_id, "queue")

    # --- administration ------------------------------------------------------------------

    def _actor(self, deployment_id: str) -> DeploymentActor:
        actor = self.actors.get(deployment_id)
        if actor is None:
            raise Refusal(404, "not_found", f"no deployment {deployment_id}")
        return actor

    def find(self, name_or_id: str) -> DeploymentActor | None:
        """A deployment by id or by name."""
        actor = self.actors.get(name_or_id)
        if actor is not None:
            return actor
        return next((a for a in self.actors.values() if a.state.name == name_or_id), None)

    async def create(self, spec: DeploymentSpec, actor: str) -> DeploymentRecord:
        """Create a deployment and start it (every deployment starts right away)."""
        validate_spec(spec)
        if any(a.state.name == spec.name for a in self.actors.values()):
            raise Refusal(409, "name_taken", f"a deployment named {spec.name} exists")
        if spec.role == "decision" and spec.mode == "on_demand":
            raise Refusal(409, "decision_model_always_on", "the decision model is always on")
        dep_id = secrets.token_hex(4)
        created = m.DeploymentCreated(
            deployment_id=dep_id,
            name=spec.name,
            engine=spec.engine,
            model=spec.model,
            memory_bytes=spec.memory_bytes,
            mode=spec.mode,
            idle_timeout_s=spec.idle_timeout_s,
            make_room_after_s=spec.make_room_after_s,
            ondemand_policy=spec.ondemand_policy,
            role=spec.role,
            args=list(spec.args),
            image=spec.image,
            gpu=spec.gpu,
        )
        stream = m.deployment_stream(dep_id)
        now = self.clock.wall()
        # Checked before anything is recorded: the state this event would create.
        self._check_launch(
            new_deployment(
                m.Recorded(seq=0, ts=now, stream=stream, version=1, actor=actor, event=created)
            )
        )
        recs = await self.store.append(stream, [created], actor=actor, expected_version=0)
        dep_actor = self._spawn(new_deployment(recs[0]))
        self._notify(dep_id, "created")
        try:
            await dep_actor.ask(StartDeployment(reason="admin", actor=actor))
        except Refusal as exc:
            log.info("created_not_started", deployment=dep_id, reason=exc.message)
            self._not_started[dep_id] = exc
            self._notify(dep_id, "not_started")  # the UI shows why at once
        return self.record(dep_actor)

    async def start(self, deployment_id: str, actor: str) -> DeploymentRecord:
        """An administrator's Start (also resets a failed deployment's backoff)."""
        dep_actor = self._actor(deployment_id)
        try:
            await dep_actor.ask(StartDeployment(reason="admin", actor=actor))
        except Refusal as exc:
            if dep_actor.state.lifecycle is Lifecycle.STOPPED:
                self._not_started[deployment_id] = exc
                self._notify(deployment_id, "not_started")
            raise
        return self.record(dep_actor)

    async def stop(self, deployment_id: str, actor: str) -> DeploymentRecord:
        """An administrator's Stop."""
        dep_actor = self._actor(deployment_id)
        await dep_actor.ask(StopDeployment(reason="admin", actor=actor))
        return self.record(dep_actor)

    async def remove(self, deployment_id: str, actor: str) -> None:
        """Stop if running, then remove."""
        dep_actor = self._actor(deployment_id)
        await dep_actor.ask(RemoveDeployment(actor=actor))

    async def change_mode(
        self,
        deployment_id: str,
        mode: m.Mode,
        idle_timeout_s: int | None,
        keep_idle_timeout: bool,
        actor: str,
        make_room_after_s: int | msgspec.UnsetType | None = msgspec.UNSET,
        ondemand_policy: m.Policy | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> DeploymentRecord:
        """PATCH .../mode (`make_room_after_s` or `ondemand_policy` left UNSET: kept)."""
        dep_actor = self._actor(deployment_id)
        if not isinstance(make_room_after_s, msgspec.UnsetType):
            validate_make_room_after(make_room_after_s)
        if not isinstance(ondemand_policy, msgspec.UnsetType):
            validate_policy(ondemand_policy, nullable=True)
        await dep_actor.ask(
            ChangeMode(
                mode=mode,
                idle_timeout_s=idle_timeout_s,
                keep_idle_timeout=keep_idle_timeout,
                actor=actor,
                make_room_after_s=make_room_after_s,
                ondemand_policy=ondemand_policy,
            )
        )
        self.prewarmer.refresh()
        return self.record(dep_actor)

    async def reconfigure(
        self,
        deployment_id: str,
        actor: str,
        *,
        model: str | None = None,
        memory_bytes: int | None = None,
        args: list[str] | None = None,
        image: str | None = None,
    ) -> DeploymentRecord:
        """Reconfigure, or "Switch model…" when `model` is given (the mode is kept)."""
        dep_actor = self._actor(deployment_id)
        current = dep_actor.state
        if model is not None and not model.strip():
            raise Refusal(422, "invalid_model", "model: required")
        if memory_bytes is not None and memory_bytes <= 0:
            raise Refusal(422, "invalid_memory", "memory_gib: must be more than 0")
        self._check_launch(
            msgspec.structs.replace(
                current,
                model=current.model if model is None else model,
                memory_bytes=current.memory_bytes if memory_bytes is None else memory_bytes,
                args=current.args if args is None else list(args),
                image=current.image if image is None else image,
            )
        )
        await dep_actor.ask(
            Reconfigure(actor=actor, model=model, memory_bytes=memory_bytes, args=args, image=image)
        )
        return self.record(dep_actor)

    def _check_launch(self, dep: DeploymentState) -> None:
        """Refusal(422) naming the field when the engine could not be launched like this;
        checked before anything is recorded, so a bad request never reaches the log."""
        try:
            self._launch_spec(dep)
        except ActorError:
            raise
        except ValueError as exc:
            raise Refusal(422, "invalid_args", f"args: {exc}") from None

    # --- reading -------------------------------------------------------------------------

    def record(self, actor: DeploymentActor) -> DeploymentRecord:
        """The API's view of one deployment."""
        dep = actor.state
        queued, waiting = self.queue.counts(dep.deployment_id)
        act = actor.activity
        default_idle = int(self.setting("ondemand_idle_timeout_s"))
        engine_url = None
        if dep.host is not None and dep.port is not None:
            engine_url = f"http://{dep.host}:{dep.port}"
        # Served since this start: the live time; else the last use the log kept (the traffic
        # trace's batches, folded), so a restart does not make a used model "never" used.
        last_used = self.system.last_used_at.get(dep.deployment_id)
        if act.served:
            last_used = self.clock.wall() - (self.clock.now() - act.last_used)
        return DeploymentRecord(
            id=dep.deployment_id,
            name=dep.name,
            engine=dep.engine,
            model=dep.model,
            memory_bytes=dep.memory_bytes,
            mode=dep.mode,
            pending_mode=dep.pending_mode,
            idle_timeout_s=dep.idle_timeout_s,
            effective_idle_timeout_s=dep.effective_idle_timeout_s(default_idle),
            role=dep.role,
            state=dep.lifecycle.value,
            badge=badge(dep, queued),
            in_flight=act.in_flight,
            queued=queued,
            waiting_for_start=waiting,
            last_used_at=last_used,
            failures=dep.failures,
            retry_at=dep.retry_at,
            last_error=dep.last_error,
            engine_url=engine_url,
            created_at=dep.created_at,
            args=dep.args,
            make_room_after_s=dep.make_room_after_s,
            effective_make_room_after_s=dep.effective_make_room_after_s(
                default_idle, self.default_make_room_s()
            ),
            not_started=self._not_started_now(dep),
            expected_start_s=self.start_history.expected_s(dep.deployment_id),
            **self._policy_fields(dep),
        )

    def _policy_fields(self, dep: DeploymentState) -> dict[str, Any]:
        """The policy in force and, under the learned one, what it learned, in words."""
        default = self.setting("ondemand_policy")
        fields: dict[str, Any] = {
            "ondemand_policy": dep.ondemand_policy,
            "effective_ondemand_policy": dep.ondemand_policy or default,
        }
        learned = self.prewarmer.learned(dep)
        if learned is None:
            return fields
        if not self.prewarmer.anticipator.has_data(dep.deployment_id):
            fields["learned"] = "no traffic recorded yet: the seed's rules apply"
            return fields
        keep, pred = learned.keep, learned.prediction
        if keep.seconds is None:
            words = f"keeps warm its idle timeout ({keep.reason})"
        elif keep.lends:
            words = (
                f"keeps warm ~{duration_text(keep.seconds)}, then lends its memory to any"
                f" model that needs it ({keep.reason})"
            )
        else:
            words = f"keeps warm ~{duration_text(keep.seconds)} ({keep.reason})"
        if pred is not None:
            clock = time.strftime("%H:%M", time.localtime(pred.at))
            words += f"; next expected around {clock} ({pred.pattern})"
        else:
            words += "; no predictable next request"
        fields.update(
            learned_keep_warm_s=keep.seconds,
            next_expected_at=None if pred is None else pred.at,
            learned=words,
        )
        return fields

    def _not_started_now(self, dep: DeploymentState) -> str | None:
        """Why it did not start, true now: a refusal for memory is read again from the
        budget and the idle models as they are (issue 46, stumble 8: the note said no idle
        model could make room long after one could)."""
        refused = self._not_started.get(dep.deployment_id)
        if refused is None or refused.code != "insufficient_memory":
            return None if refused is None else refused.message
        candidates = self.candidates(dep.deployment_id)
        why = self.broker.no_room(dep.deployment_id, dep.name, dep.memory_bytes, candidates)
        if why is None and not dep.on_demand:  # on demand, its next request starts it
            return f"{dep.name} found no room when it was started; there is room now: start it"
        return why

    def records(self) -> list[DeploymentRecord]:
        """Every deployment, oldest first."""
        actors = sorted(self.actors.values(), key=lambda a: a.state.created_at)
        return [self.record(a) for a in actors]

    def memory(self) -> dict[str, int]:
        """The budget."""
        return self.broker.snapshot()


ENGINES = ("vllm", "llamacpp", "sglang", "sim")


def _evolve_or_fail(state: SystemState, rec: m.Recorded) -> SystemState:
    """`evolve`, except that a deployment whose event cannot happen becomes failed."""
    try:
        return evolve(state, rec)
    except IllegalTransition:
        dep_id = rec.stream.partition(":")[2]
        dep = evolve_or_fail(state.deployments[dep_id], rec)
        deployments = {**state.deployments, dep_id: dep}
        return msgspec.structs.replace(
            state, deployments=deployments, last_seq=rec.seq, last_ts=rec.ts
        )


def stopped_always_on(dep: DeploymentState) -> Refused | None:
    """A request never starts an always-on deployment that is stopped ("it runs until you
    stop it"): the refusal, or None when a request may wait for it."""
    if dep.on_demand or dep.lifecycle not in (Lifecycle.STOPPED, Lifecycle.STOPPING):
        return None
    how = "was stopped by an administrator" if dep.stop_reason == "admin" else "is stopped"
    return Refused(
        503,
        "deployment_stopped",
        f"{dep.name} is always on and {how}; requests do not start it: start it from its page",
    )


def validate_spec(spec: DeploymentSpec) -> None:
    """Raise Refusal(422) naming the field that is wrong."""
    if not _NAME.match(spec.name):
        raise Refusal(422, "invalid_name", "name: letters, digits and . _ : / - (1 to 128)")
    if spec.engine not in ENGINES:
        raise Refusal(422, "invalid_engine", f"engine: one of {', '.join(ENGINES)}")
    if not spec.model.strip():
        raise Refusal(422, "invalid_model", "model: required")
    if spec.memory_bytes <= 0:
        raise Refusal(422, "invalid_memory", "memory_gib: must be more than 0")
    if spec.mode not in ("on_demand", "always_on"):
        raise Refusal(422, "invalid_mode", 'mode: "on_demand" or "always_on"')
    validate_idle_timeout(spec.idle_timeout_s)
    validate_make_room_after(spec.make_room_after_s)
    validate_policy(spec.ondemand_policy, nullable=True)


def validate_policy(value: object, *, nullable: bool = False) -> None:
    """ondemand_policy is "seed" or "learned" (or null: the DGXMM default, per deployment)."""
    if value is None and nullable:
        return
    if value not in POLICIES:
        raise Refusal(
            422,
            "invalid_policy",
            'ondemand_policy: "seed" or "learned"' + (" or null" if nullable else ""),
        )


def validate_make_room_after(value: object) -> None:
    """make_room_after_s is null (the DGXMM default) or 0 to 86400 seconds."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 86400:
        raise Refusal(
            422, "invalid_make_room_after", "make_room_after_s: null or 0 to 86400 seconds"
        )


def validate_idle_timeout(value: object) -> None:
    """idle_timeout_s is null or 60 to 86400 seconds."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 60 <= value <= 86400:
        raise Refusal(422, "invalid_idle_timeout", "idle_timeout_s: null or 60 to 86400 seconds")


_SETTING_RANGES = {
    "ondemand_idle_timeout_s": (60, 86400),
    "ondemand_queue_timeout_s": (1, 86400),
    "ondemand_max_queued": (1, 10_000),
    "ondemand_make_room_after_s": (0, 86400),
}
_NULLABLE_SETTINGS = {"ondemand_make_room_after_s"}  # null: the seed's rule


def validate_settings(changes: dict[str, Any]) -> dict[str, Any]:
    """Only known keys, integers in range; raises Refusal(422) naming the key."""
    checked: dict[str, Any] = {}
    for key, value in changes.items():
        if key == "ondemand_policy":
            validate_policy(value)
            checked[key] = value
            continue
        bounds = _SETTING_RANGES.get(key)
        if bounds is None:
            raise Refusal(422, "unknown_setting", f"{key}: not a setting")
        if value is None and key in _NULLABLE_SETTINGS:
            checked[key] = None
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise Refusal(422, "invalid_setting", f"{key}: an integer")
        lo, hi = bounds
        if not lo <= value <= hi:
            raise Refusal(422, "invalid_setting", f"{key}: {lo} to {hi}")
        checked[key] = value
    return checked
