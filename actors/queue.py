"""QueueActor: every request that is not served at once waits here, first come, first served.

A request waits either for a start that is under way ("waiting_start") or for memory
("queued").  Both count against `ondemand_max_queued`.  Only the head of the queue (the
oldest request queued for memory) may put idle models to sleep; a later request may go
ahead when its model fits in the memory free right now, without stopping anything and
without the memory reserved for the head.

When a model planned to sleep for the head refuses (a request reached it after the plan),
the head's plan is made again at once with the candidates left (`replan`).  With
`ondemand_make_room_after_s` set, a model becomes a candidate before its idle timer runs
out, so the queue also looks again the moment the next one becomes one, and whenever a
model's last request in flight ends.

`enqueue` and `leave` are synchronous: the gateway needs an immediate answer (queue full,
does not fit), and a synchronous call cannot interleave with a re-check.  Re-checks, expiries
and the 15 s tick arrive through the mailbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from actors.admission import RETRY_AFTER_S, Refused, queue_timeout
from actors.deployment import DeploymentActor, LeaseImpl, StartDeployment
from actors.memory_broker import Candidate, MemoryBroker, gib
from actors.runtime import Actor, Clock, TimerHandle
from events import model as m
from events.state import Lifecycle
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.queue")

RECHECK_EVERY_S = 15.0
# A model whose idle timeout ends at the instant it becomes a make-room candidate (the
# default: `ondemand_make_room_after_s` unset) sleeps for "idle": the queue looks again
# this long after the candidate's time, so its own idle timer goes first whatever the
# order the two were armed in.
AFTER_IDLE_TIMERS_S = 1e-3


class Recheck(msgspec.Struct, frozen=True, tag=True):
    """Look at the queue again (a deployment changed, a timeout ran out, the 15 s tick)."""

    why: str = "tick"


class Expired(msgspec.Struct, frozen=True, tag=True):
    """A waiting request reached its deadline."""

    request_id: str


class _Tick(msgspec.Struct, frozen=True, tag=True):
    pass


class WaiterImpl:
    """One waiting request, as the gateway holds it."""

    def __init__(
        self, queue: QueueActor, request_id: str, deployment_id: str, now: float, deadline: float
    ) -> None:
        self._queue = queue
        self.request_id = request_id
        self.deployment_id = deployment_id
        self.arrived = now
        self.deadline = deadline
        self.kind: m.WaitKind = "waiting_start"
        self.queued = asyncio.Event()
        self.future: asyncio.Future[LeaseImpl] = asyncio.get_running_loop().create_future()
        self.timer: TimerHandle | None = None
        self.jumped_ahead = False
        self.first_byte_seen = False

    async def wait(self) -> LeaseImpl:
        """The lease once the model is ready; raises Refused otherwise."""
        return await self.future

    def cancel(self) -> None:
        """The client hung up."""
        self._queue.leave(self, "client_gone")
        if self.future.done() and not self.future.cancelled() and self.future.exception() is None:
            self.future.result().release()  # admitted just before the hang-up

    def first_byte(self) -> None:
        """The engine's first byte is being relayed to this request: its wait ends."""
        if not self.first_byte_seen:
            self.first_byte_seen = True
            self._queue.first_byte(self)

    @property
    def done(self) -> bool:
        """Whether the request stopped waiting."""
        return self.future.done()


class QueueActor(Actor):
    """The fair FIFO queue in front of memory, for all on-demand models together."""

    def __init__(
        self,
        *,
        clock: Clock,
        store: EventStore,
        broker: MemoryBroker,
        lookup: Callable[[str], DeploymentActor | None],
        candidates: Callable[[str], list[Candidate]],
        sleep_victims: Callable[[list[str], str, str], None],
        settings: Callable[[str], Any],
        plain_fifo: bool = False,
        candidate_due: Callable[[str], float | None] = lambda deployment_id: None,
    ) -> None:
        super().__init__("queue", clock)
        # Off in DGXMM; the fairness simulations turn it on to compare with plain FIFO.
        self.plain_fifo = plain_fifo
        self._store = store
        self._broker = broker
        self._lookup = lookup
        self._candidates = candidates
        self._sleep_victims = sleep_victims
        self._settings = settings
        self._candidate_due = candidate_due
        self._due_timer: TimerHandle | None = None
        self._waiting: dict[str, WaiterImpl] = {}  # insertion order is arrival order
        self._head: str | None = None  # the head its make-room timer was last armed for
        self._starting: set[str] = set()  # deployments started for requests, not yet settled
        self._made_room: dict[str, None] = {}  # of those, the heads that put models to sleep
        self._lost: set[str] = set()  # lost under waiting requests: to start for them
        self._writes: set[asyncio.Task[Any]] = set()
        self._stats = {"served": 0, "refused": 0, "timeouts": 0, "client_gone": 0, "admitted": 0}
        self.on_change: Callable[[str], None] = lambda deployment_id: None
        # The head cannot fit: stop pre-warms still starting whose memory it needs (True: some).
        self.abandon_prewarms: Callable[[str], bool] = lambda deployment_id: False

    def start(self) -> None:
        """Start serving and the 15 s re-check tick."""
        super().start()
        self.schedule(RECHECK_EVERY_S, _Tick())

    # --- reading -------------------------------------------------------------------------

    def counts(self, deployment_id: str) -> tuple[int, int]:
        """(queued for memory, waiting for a start) for one deployment."""
        queued = waiting = 0
        for w in self._waiting.values():
            if w.deployment_id == deployment_id:
                if w.kind == "queued":
                    queued += 1
                else:
                    waiting += 1
        return queued, waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[WaiterImpl]:
        """Every waiting request, oldest first."""
        return list(self._waiting.values())

    def queue_statistics(self) -> dict[str, int]:
        """Counters for /metrics."""
        return {**self._stats, "waiting": len(self._waiting)}

    # --- entering and leaving ------------------------------------------------------------

    def enqueue(self, actor: DeploymentActor, request_id: str, waited_s: float = 0.0) -> WaiterImpl:
        """Add a request for a model that is not ready; raises Refused when it cannot wait.

        `waited_s`: how long ago the request arrived; a request sent to an engine it never
        reached waits again with its first arrival, for the deadline and the log."""
        dep = actor.state
        max_queued = int(self._settings("ondemand_max_queued"))
        if len(self._waiting) >= max_queued:
            self._stats["refused"] += 1
            raise Refused(
                503,
                "ondemand_queue_full",
                f"too many requests are waiting for on-demand models ({max_queued}); "
                "try again later",
                RETRY_AFTER_S,
            )
        if actor.in_backoff():
            self._stats["refused"] += 1
            raise Refused(503, "start_failed", f"{dep.name} could not start: {dep.last_error}")
        held_by_self = (
            dep.memory_bytes if (not dep.on_demand and self._broker.holds(dep.deployment_id)) else 0
        )
        most = max(0, self._broker.usable_bytes - (self._broker.always_on_held() - held_by_self))
        if dep.memory_bytes > most:
            self._stats["refused"] += 1
            raise Refused(
                503,
                "does_not_fit",
                f"{dep.name} needs {gib(dep.memory_bytes)} GiB but at most {gib(most)} GiB "
                "can be freed for on-demand models",
            )
        now = self.clock.now()
        waited_s = max(0.0, waited_s)
        timeout = float(self._settings("ondemand_queue_timeout_s"))
        arrived = now - waited_s
        waiter = WaiterImpl(self, request_id, dep.deployment_id, arrived, arrived + timeout)
        waiter.timer = self.schedule(max(0.0, timeout - waited_s), Expired(request_id))
        # The head: no other model's request waits for memory ahead of this model's oldest
        # waiting request (a model's requests share one start and its place in the queue).
        is_head = True
        for w in self._waiting.values():
            if w.deployment_id == dep.deployment_id:
                break
            if w.kind == "queued":
                is_head = False
                break
        self._waiting[request_id] = waiter
        position = len(self._waiting)
        free = self._broker.free()
        admitted = self._try_admit(actor, may_make_room=is_head, jumped=not is_head)
        if not admitted:
            waiter.kind = "queued"
            waiter.queued.set()
            if is_head:
                self._arm_due(dep.deployment_id)
        self._record(
            m.RequestQueued(
                request_id=request_id,
                deployment_id=dep.deployment_id,
                kind=waiter.kind,
                position=position,
                arrived_at=self.clock.wall() - waited_s,
                free_bytes=max(0, free),
                needed_bytes=dep.memory_bytes,
            )
        )
        if admitted and not waiter.done:
            self._record(
                m.RequestAdmitted(
                    request_id=request_id,
                    deployment_id=dep.deployment_id,
                    jumped_ahead=not is_head,
                )
            )
        self.on_change(dep.deployment_id)
        return waiter

    def leave(self, waiter: WaiterImpl, reason: m.LeaveReason) -> None:
        """Remove a waiting request (client gone); idempotent."""
        if self._waiting.pop(waiter.request_id, None) is None:
            return
        if waiter.timer is not None:
            waiter.timer.cancel()
        if not waiter.future.done():
            waiter.future.cancel()
        self._stats["client_gone" if reason == "client_gone" else "refused"] += 1
        self._record_left(waiter, reason)
        self.on_change(waiter.deployment_id)
        self._tell_recheck("left")

    def _finish(self, waiter: WaiterImpl, reason: m.LeaveReason, error: Refused | None) -> None:
        if self._waiting.pop(waiter.request_id, None) is None:
            return
        if waiter.timer is not None:
            waiter.timer.cancel()
        if error is not None and not waiter.future.done():
            waiter.future.set_exception(error)
            # The gateway may already be gone; never log "exception was never retrieved".
            waiter.future.exception()
        self._record_left(waiter, reason)
        self.on_change(waiter.deployment_id)

    def _record_left(self, waiter: WaiterImpl, reason: m.LeaveReason) -> None:
        self._record(
            m.RequestLeftQueue(
                request_id=waiter.request_id,
                deployment_id=waiter.deployment_id,
                reason=reason,
                waited_s=round(self.clock.now() - waiter.arrived, 3),
            )
        )

    def first_byte(self, waiter: WaiterImpl) -> None:
        """Record the end of a waited request's wait (the last phase of its cold start)."""
        self._record(
            m.FirstByteRelayed(
                request_id=waiter.request_id,
                deployment_id=waiter.deployment_id,
                waited_s=round(self.clock.now() - waiter.arrived, 6),
                at=self.clock.wall(),
            )
        )

    def _record(self, event: m.AnyEvent) -> None:
        # Queue events go through group commit; nobody waits for their fsync.
        task = asyncio.get_running_loop().create_task(
            self._store.append(m.STREAM_QUEUE, [event], actor="ondemand")
        )
        self._writes.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[Any]) -> None:
        self._writes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("queue_event_not_recorded", error=str(task.exception()))

    def poke(self, why: str) -> None:
        """Look at the queue again soon (something the queue does not watch changed)."""
        self._tell_recheck(why)

    def _tell_recheck(self, why: str) -> None:
        if self.running:
            try:
                self.tell(Recheck(why))
            except Exception:  # policy: a full mailbox already holds a re-check
                log.debug("recheck_dropped", why=why)

    # --- admission -----------------------------------------------------------------------

    def _try_admit(self, actor: DeploymentActor, *, may_make_room: bool, jumped: bool) -> bool:
        """Start (or join the start of) `actor` for its waiters if memory allows; sync."""
        dep = actor.state
        dep_id = dep.deployment_id
        if dep.lifecycle is Lifecycle.READY and actor.activity.accepting:
            self._serve(actor)
            return True
        if dep.lifecycle is Lifecycle.STARTING or dep_id in self._starting or actor.recovering:
            # A start under way, or an engine being checked or replaced after a loss (its
            # outcome decides: served, started for these requests, or queued then).
            self._admitted(dep_id, jumped)
            return True
        if dep.lifecycle is Lifecycle.STOPPING or (
            dep.lifecycle is Lifecycle.READY and not actor.activity.accepting
        ):
            return False  # it must stop first; its memory is not free yet
        if actor.in_backoff():
            return False
        if jumped and self.plain_fifo:
            return False  # plain FIFO: nobody starts ahead of the head
        candidates = self._candidates(dep_id) if may_make_room else []
        victims = self._broker.reserve(
            dep_id,
            dep.memory_bytes,
            always_on=not dep.on_demand,
            candidates=candidates,
            make_room=may_make_room,
        )
        if victims is None:
            return False
        if victims:
            self._made_room[dep_id] = None
            self._sleep_victims(victims, dep_id, dep.name)
        self._starting.add(dep_id)
        first = next((w for w in self._waiting.values() if w.deployment_id == dep_id), None)
        actor.tell(
            StartDeployment(
                reason="request",
                actor="ondemand",
                request_id=first.request_id if first else None,
                reserved=True,
            )
        )
        self._admitted(dep_id, jumped)
        return True

    def _admitted(self, deployment_id: str, jumped: bool) -> None:
        for w in self._waiting.values():
            if w.deployment_id == deployment_id and w.kind == "queued":
                w.kind = "waiting_start"
                w.jumped_ahead = jumped
                self._stats["admitted"] += 1
                self._record(
                    m.RequestAdmitted(
                        request_id=w.request_id, deployment_id=deployment_id, jumped_ahead=jumped
                    )
                )
        self.on_change(deployment_id)

    def _serve(self, actor: DeploymentActor) -> None:
        dep_id = actor.deployment_id
        for w in [w for w in self._waiting.values() if w.deployment_id == dep_id]:
            lease = actor.try_acquire()
            if lease is None:
                return
            if w.future.done():
                lease.release()
                continue
            w.future.set_result(lease)
            self._stats["served"] += 1
            self._finish(w, "served", None)

    def recheck(self) -> None:
        """Walk the queue in arrival order; the head may make room, later ones may go ahead."""
        for dep_id in [d for d in self._made_room if d in self._starting]:
            self._replan(dep_id)  # a victim refused and no candidate was left then
        head_seen = False
        # A deployment's turn is its oldest waiting request's; serving one deployment's
        # requests leaves the others' as they are, so the walk can take them grouped.
        for dep_id, group in self._by_deployment().items():
            actor = self._lookup(dep_id)
            if actor is None:
                self._fail_all(dep_id, "removed", self._stopped_error(dep_id, None))
                continue
            dep = actor.state
            if dep.lifecycle is Lifecycle.READY and actor.activity.accepting:
                self._serve(actor)
                continue
            if actor.recovering:
                continue  # its check or restart reports its outcome (`deployment_changed`)
            waiting_for_memory = any(x.kind == "queued" for x in group)
            starting = dep.lifecycle is Lifecycle.STARTING or dep_id in self._starting
            lost = False
            if not starting and not waiting_for_memory:
                # Its start went away without an outcome for these requests (the watchdog
                # stopped it): they wait for memory again.  After its engine was lost they
                # first try to start it, and are queued (the line) only if that fails.
                lost = dep_id in self._lost
                for x in group:
                    x.kind = "queued"
                    if not lost:
                        x.queued.set()
                waiting_for_memory = True
            self._lost.discard(dep_id)
            if not waiting_for_memory:
                continue
            is_head = not head_seen
            admitted = self._try_admit(actor, may_make_room=is_head, jumped=not is_head)
            if lost and not admitted:
                for x in group:
                    if x.request_id in self._waiting:
                        x.queued.set()
                self.on_change(dep_id)
            if is_head and not admitted:
                self.abandon_prewarms(dep_id)
                self._arm_due(dep_id)
            # Once the head is admitted it no longer waits for memory: the next one is the head.
            head_seen = head_seen or not admitted

    def _by_deployment(self) -> dict[str, list[WaiterImpl]]:
        """The waiting requests per deployment, the deployments in their oldest's order."""
        groups: dict[str, list[WaiterImpl]] = {}
        for w in self._waiting.values():
            group = groups.get(w.deployment_id)
            if group is None:
                groups[w.deployment_id] = [w]
            else:
                group.append(w)
        return groups

    def _arm_due(self, head_id: str) -> None:
        """Look again when the next model becomes a make-room candidate for the head."""
        self._head = head_id
        due = self._candidate_due(head_id)
        if self._due_timer is not None:
            self._due_timer.cancel()
            self._due_timer = None
        now = self.clock.now()
        if due is not None and now < due < now + RECHECK_EVERY_S:
            self._due_timer = self.schedule(
                due - now + AFTER_IDLE_TIMERS_S, Recheck("make_room_after")
            )

    def replan(self, deployment_id: str) -> None:
        """A model planned to sleep for `deployment_id` refused: plan again at once."""
        self._replan(deployment_id)
        self._tell_recheck("victim refused")

    def _replan(self, deployment_id: str) -> None:
        actor = self._lookup(deployment_id)
        if actor is None:
            return
        victims = self._broker.replan(deployment_id, self._candidates(deployment_id))
        if victims:
            log.info("make_room_replanned", deployment=deployment_id, victims=victims)
            self._sleep_victims(victims, deployment_id, actor.state.name)

    def activity(self, deployment_id: str) -> None:
        """A request started or ended on a model: once none is in flight, it may be a candidate."""
        actor = self._lookup(deployment_id)
        if actor is None or actor.activity.in_flight:
            return
        if not (self._starting or any(w.kind == "queued" for w in self._waiting.values())):
            return
        # What its last request's end changes for the queue: its own waiters may be served,
        # and its memory may be taken for the head at once.  A model that becomes a candidate
        # only later does so on the head's timer, which must count it from now; nothing else
        # changed, and a walk of the whole queue (once per request ended on a busy box) would
        # find what the last one found.
        own = any(w.deployment_id == deployment_id for w in self._waiting.values())
        if own or actor.idle_candidate() is not None:
            self._tell_recheck("activity")
        elif self._head is not None:
            self._arm_due(self._head)

    def _fail_all(self, deployment_id: str, reason: m.LeaveReason, error: Refused) -> None:
        for w in [w for w in self._waiting.values() if w.deployment_id == deployment_id]:
            self._finish(w, reason, error)

    def _stopped_error(self, deployment_id: str, by: str | None) -> Refused:
        actor = self._lookup(deployment_id)
        name = actor.state.name if actor is not None else deployment_id
        who = f" ({by})" if by else ""
        return Refused(
            503,
            "ondemand_stopped",
            f"{name} was stopped by an administrator{who} while it was starting for this request",
        )

    # --- reactions -----------------------------------------------------------------------

    def deployment_changed(self, deployment_id: str, outcome: str | None, detail: str) -> None:
        """A deployment actor reports a change (called synchronously from its handler)."""
        actor = self._lookup(deployment_id)
        if outcome is not None:
            self._made_room.pop(deployment_id, None)
        if outcome in ("ready", "failed", "removed"):
            self._lost.discard(deployment_id)
        if outcome == "ready" and actor is not None:
            self._starting.discard(deployment_id)
            self._serve(actor)
        elif outcome == "failed" and actor is not None:
            self._starting.discard(deployment_id)
            error = Refused(503, "start_failed", f"{actor.state.name} could not start: {detail}")
            self._fail_all(deployment_id, "start_failed", error)
        elif outcome == "removed":
            self._starting.discard(deployment_id)
            self._fail_all(deployment_id, "removed", self._stopped_error(deployment_id, None))
        elif outcome == "stopped":
            self._starting.discard(deployment_id)
            reason, _, by = detail.partition(":")
            if reason == "lost" and actor is not None and not actor.recovering:
                # Its engine was lost under waiting requests: the next re-check starts it
                # for them, in queue order, and queues them only if that cannot be now.
                self._lost.add(deployment_id)
            elif reason in ("admin", "removed"):
                error = self._stopped_error(deployment_id, by or None)
                for w in [w for w in self._waiting.values() if w.deployment_id == deployment_id]:
                    if w.kind == "waiting_start":
                        self._finish(w, "stopped", error)
        self._tell_recheck("changed")

    async def handle(self, message: Any) -> Any:
        """Serve re-checks, expiries and the tick."""
        match message:
            case Recheck():
                self.recheck()
            case _Tick():
                self.schedule(RECHECK_EVERY_S, _Tick())
                self.recheck()
            case Expired():
                w = self._waiting.get(message.request_id)
                if w is not None:
                    actor = self._lookup(w.deployment_id)
                    name = actor.state.name if actor is not None else w.deployment_id
                    self._stats["timeouts"] += 1
                    self._finish(w, "timeout", queue_timeout(name))
                    self.recheck()
            case _:
                raise TypeError(f"unknown message {type(message).__name__}")
        return None

    def refuse_all(self, error: Refused) -> None:
        """Answer every waiting request with `error` at once (DGXMM is shutting down)."""
        for w in list(self._waiting.values()):
            self._finish(w, "stopped", error)

    async def stop(self) -> None:
        """Drop the queue (a restart drops it, with the waiting connections)."""
        for w in list(self._waiting.values()):
            self._finish(
                w,
                "stopped",
                Refused(503, "ondemand_stopped", "DGXMM is shutting down", RETRY_AFTER_S),
            )
        await super().stop()
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
