"""The learned policy at work: keep-warms kept up to date, predictable models started early.

Each on-demand model's keep-warm is kept up to date, and the predictable ones are started
ahead of their requests (issue 44; what it learns: `actors.anticipation`).

It hears every request the traffic trace records (a store listener: `recorded`; at start-up
it reads the last two weeks of the trace first), and on a tick — at the next pre-warm due,
at least every minute — it tells each on-demand model under `ondemand_policy = "learned"`
its keep-warm (`DeploymentActor.keep_s`) and starts the ones whose next session is due.

The rules a pre-warm keeps, whatever the policy (and checked by property tests):
- it starts only while no request is queued, and only a stopped model that is not backing
  off after failures;
- it uses only memory that is free, or held by idle models under the seed's making-room
  rules whose own next predicted session is later than its own;
- it never stops a model with a request in flight (the candidates are idle, and each checks
  again before it sleeps);
- until its first request it delays none: while ready it is a make-room candidate at once
  (`DeploymentActor.idle_candidate`), spared while idle models expected later than it can
  make the room (`spare`), else the first to go; while still starting, when the queue's
  head needs its memory (`abandon_for`), or a start for waiting requests needs the start
  slot it holds or waits for ahead (`give_way`), it is stopped at once: "Pre-warm abandoned
  for a queued request".
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import msgspec
import structlog

from actors.anticipation import HISTORY_S, Anticipator, Learned, Traffic, lead_s, traced
from actors.cold_start import StartHistory
from actors.deployment import DeploymentActor, StartDeployment, StopDeployment
from actors.memory_broker import Candidate, MemoryBroker
from actors.queue import QueueActor
from actors.runtime import Clock
from events import model as m
from events.projections import duration_text
from events.state import DeploymentState, Lifecycle
from events.traffic import decode_batch
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.prewarm")

TICK_S = 60.0  # the keep-warms and predictions are looked at again at least this often
TRAFFIC_TYPES = frozenset({"TrafficRecorded"})


class Host(Protocol):
    """What the pre-warmer needs of the controller (`actors.controller.Controller`)."""

    store: EventStore
    clock: Clock
    broker: MemoryBroker
    queue: QueueActor
    actors: dict[str, DeploymentActor]
    start_history: StartHistory

    @property
    def closing(self) -> bool:
        """Whether it is shutting down."""

    def setting(self, key: str) -> Any:
        """A setting in force."""

    def candidates(self, for_deployment: str) -> list[Candidate]:
        """The seed's make-room candidates for a deployment."""

    def sleep_victims(self, victims: list[str], for_id: str, for_name: str) -> None:
        """Put them to sleep to make room."""


def policy_of(dep: DeploymentState, default: str) -> str:
    """The policy in force for a deployment: its own, else the DGXMM default."""
    return dep.ondemand_policy or default


def governed(dep: DeploymentState, default: str) -> bool:
    """Whether the learned policy governs it (on demand, not the decision model)."""
    return dep.on_demand and dep.role != "decision" and policy_of(dep, default) == "learned"


class Prewarmer:
    """The controller's learned-policy side (one per controller)."""

    def __init__(self, controller: Host) -> None:
        self._c = controller
        self.anticipator = Anticipator()
        # Pre-warms by outcome, for /metrics: used (a request came), wasted (none came),
        # abandoned (stopped for a queued request while starting).
        self.counts = {"started": 0, "used": 0, "wasted": 0, "abandoned": 0}
        self.per_deployment: dict[str, dict[str, int]] = {}  # the same, per deployment id
        self._abandoning: set[str] = set()
        self._done: dict[str, float] = {}  # deployment -> the expected arrival pre-warmed for
        self._timer: Any = None
        self._history: asyncio.Task[None] | None = None
        self._loaded = False
        self._early: list[m.Recorded] = []  # batches heard while the history loads

    # --- hearing the traffic -------------------------------------------------------------

    def recorded(self, records: list[m.Recorded]) -> None:
        """A store listener: every request of the trace's batches."""
        batches = [r for r in records if isinstance(r.event, m.TrafficRecorded)]
        if not batches:
            return
        if not self._loaded:
            self._early.extend(batches)
            del self._early[:-1000]  # bounded: the history covers the rest
            return
        for rec in batches:
            self._feed(rec)

    def _feed(self, rec: m.Recorded) -> None:
        assert isinstance(rec.event, m.TrafficRecorded)
        observe = self.anticipator.observe
        for row in decode_batch(rec.event):
            observe(row.deployment_id, *traced(row))

    def observe(self, deployment_id: str, arrived: float, ended: float, wait_s: float) -> None:
        """One request that waited `wait_s` for its model, told directly (a what-if's
        replayed traffic, the property tests' box)."""
        self._loaded = True
        self.anticipator.observe(deployment_id, arrived, ended, wait_s)

    def adopt(self, deployment_id: str, traffic: Traffic) -> None:
        """A history learned elsewhere (a what-if: the recorded box's before its window)."""
        self._loaded = True
        self.anticipator.adopt(deployment_id, traffic)

    def in_use(self) -> bool:
        """Whether any deployment, or the default, is under the learned policy."""
        default = self._c.setting("ondemand_policy")
        return default == "learned" or any(
            a.state.ondemand_policy == "learned" for a in self._c.actors.values()
        )

    def start(self) -> None:
        """Tick (`refresh` reads the trace's last two weeks first, once the policy is in use)."""
        self.refresh()

    async def _load_history(self) -> None:
        store = self._c.store
        fed = 0  # the last batch read from the log: a batch heard meanwhile may be in it
        try:
            since = await store.seq_at(self._c.clock.wall() - HISTORY_S)
            async for rec in store.iterate(
                since_seq=since, stream=m.STREAM_TRAFFIC, types=TRAFFIC_TYPES
            ):
                self._feed(rec)
                fed = rec.seq
        except Exception as exc:  # policy: a log that cannot be read leaves the seed's rules
            log.error("prewarm_history_unreadable", error=str(exc))
        for rec in self._early:
            if rec.seq > fed:
                self._feed(rec)
        self._early.clear()
        self._loaded = True
        self.refresh()

    def close(self) -> None:
        """Stop ticking and reading."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._history is not None:
            self._history.cancel()

    # --- deciding --------------------------------------------------------------------------

    def learned(self, dep: DeploymentState) -> Learned | None:
        """What the policy learned of a deployment it governs (None: it does not)."""
        c = self._c
        default = c.setting("ondemand_policy")
        if not governed(dep, default):
            return None
        idle = dep.effective_idle_timeout_s(int(c.setting("ondemand_idle_timeout_s")))
        start = c.start_history.expected_s(dep.deployment_id)
        return self.anticipator.learned(dep.deployment_id, idle, c.clock.wall(), start)

    def refresh(self) -> None:
        """Tell every model its keep-warm; pre-warm the ones due; tick again."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._c.closing:
            return
        if self.in_use() and not self._loaded and self._history is None:
            self._history = asyncio.get_running_loop().create_task(self._load_history())
        wall = self._c.clock.wall()
        next_due = wall + TICK_S
        for actor in list(self._c.actors.values()):
            learned = self.learned(actor.state) if self._loaded else None
            keep = None if learned is None else learned.keep.seconds
            # Lending needs the pre-warm that brings it back: a predicted next session.
            lends = (
                learned.prediction.at
                if learned is not None and learned.keep.lends and learned.prediction is not None
                else None
            )
            if lends is None and learned is not None and learned.keep.lends:
                keep = None
            if keep != actor.keep_s or lends != actor.lends_for:
                actor.keep_s = keep
                actor.keep_reason = "" if learned is None else learned.keep.reason
                actor.lends_for = lends
                actor.keep_warm_changed()
            if learned is None or learned.prediction is None:
                continue
            due = self._due(actor, learned, wall)
            if due is not None and due < next_due:
                next_due = due
        delay = max(1.0, next_due - wall)
        self._timer = self._c.clock.call_later(delay, self.refresh)

    def _due(self, actor: DeploymentActor, learned: Learned, wall: float) -> float | None:
        """Pre-warm it now if due (and allowed); else when it will be due (None: never)."""
        pred = learned.prediction
        assert pred is not None
        dep = actor.state
        if self._done.get(dep.deployment_id) == pred.at:
            return None
        starts_at = pred.at - lead_s(
            self._c.start_history.expected_s(dep.deployment_id), pred.early_s
        )
        if wall < starts_at:
            return starts_at
        if wall > pred.at + pred.tolerance_s:
            return None
        if dep.lifecycle is Lifecycle.STOPPING:
            return wall + 5.0  # a pre-warm that gave way, still stopping: look again soon
        if dep.lifecycle is not Lifecycle.STOPPED or actor.in_backoff():
            return None
        if len(self._c.queue):
            return wall + 5.0  # never while a request is queued: look again soon
        self._prewarm(actor, learned, wall)
        return None

    def _prewarm(self, actor: DeploymentActor, learned: Learned, wall: float) -> None:
        c, dep, pred = self._c, actor.state, learned.prediction
        assert pred is not None
        victims = c.broker.reserve(
            dep.deployment_id,
            dep.memory_bytes,
            always_on=False,
            candidates=self._later_candidates(dep.deployment_id, pred.at),
        )
        if victims is None:
            log.info("prewarm_no_room", deployment=dep.deployment_id)
            return
        self._done[dep.deployment_id] = pred.at
        if victims:
            c.sleep_victims(victims, dep.deployment_id, dep.name)
        ahead = max(0.0, pred.at - wall)
        detail = f"next request expected in ~{duration_text(ahead)}: {pred.pattern}"
        self._count(dep.deployment_id, "started")
        actor.tell(
            StartDeployment(
                reason="prewarm",
                actor="ondemand",
                reserved=True,
                expected_at=pred.at,
                detail=detail,
                hold_until=c.clock.now() + ahead + pred.tolerance_s,
            )
        )
        log.info("prewarm", deployment=dep.deployment_id, detail=detail)

    def _next_at(self, deployment_id: str) -> float | None:
        """When a deployment's next session is predicted (None: it is not, or not governed)."""
        actor = self._c.actors.get(deployment_id)
        learned = None if actor is None else self.learned(actor.state)
        return None if learned is None or learned.prediction is None else learned.prediction.at

    def _later_candidates(self, deployment_id: str, at: float) -> list[Candidate]:
        """The seed's make-room candidates whose own next predicted session is later (a
        model lending its memory is one for requests before it is one under the seed's
        rule: not for a pre-warm)."""
        actors = self._c.actors
        return [
            c
            for c in self._c.candidates(deployment_id)
            if ((nxt := self._next_at(c.deployment_id)) is None or nxt > at)
            and not actors[c.deployment_id].lends_only()
        ]

    def spare(self, found: list[Candidate]) -> list[Candidate]:
        """Make-room candidates, with those expected before a ready pre-warm among them spared
        too: while others can make the room, the memory a pre-warm keeps is theirs, and a
        pre-warm uses only the memory of models expected later (or never)."""
        arrivals = [c.expected_at for c in found if c.expected_at is not None]
        if not arrivals:
            return found
        first = min(arrivals)
        marked = []
        for cand in found:
            nxt = None if cand.expected_at is not None else self._next_at(cand.deployment_id)
            if nxt is not None and nxt <= first:
                cand = msgspec.structs.replace(cand, expected_at=nxt)
            marked.append(cand)
        return marked

    def abandon_for(self, deployment_id: str) -> bool:
        """The queue's head (for `deployment_id`) cannot fit: stop pre-warms still starting,
        with no request waiting for them, whose memory would let it; True if any."""
        c = self._c
        head = c.actors.get(deployment_id)
        if head is None:
            return False
        starting = self._unwanted_starting()
        if not starting:
            return False
        room = max(0, c.broker.free()) + sum(x.memory_bytes for x in c.candidates(deployment_id))
        chosen, need = [], head.state.memory_bytes
        for a in sorted(starting, key=lambda a: -(a.prewarm_until or 0.0)):
            if room >= need:
                break
            chosen.append(a)
            room += a.state.memory_bytes
        if room < need:
            return False  # stopping them would not let it start: they stay
        self._abandon(chosen, deployment_id)
        return bool(chosen)

    def give_way(self, deployment_id: str) -> None:
        """A start with requests waiting for it waits for a start slot: stop the pre-warms
        still starting, with no request waiting for them, that hold the slots or wait for
        them ahead of it (a pre-warm begins only while no request waits, so every one still
        starting is ahead)."""
        c = self._c
        actor = c.actors.get(deployment_id)
        if (
            actor is None
            or actor.state.lifecycle is not Lifecycle.STARTING
            or c.broker.start_slot_free()
            or c.broker.holds_start_slot(deployment_id)
            or c.queue.counts(deployment_id) == (0, 0)
        ):
            return
        ahead = [a for a in self._unwanted_starting() if a.deployment_id != deployment_id]
        self._abandon(ahead, deployment_id)

    def _unwanted_starting(self) -> list[DeploymentActor]:
        """Pre-warms still starting that no request waits for (and not already stopping)."""
        c = self._c
        return [
            a
            for a in c.actors.values()
            if a.prewarm_until is not None
            and a.state.lifecycle is Lifecycle.STARTING
            and a.deployment_id not in self._abandoning
            and c.queue.counts(a.deployment_id) == (0, 0)
        ]

    def _abandon(self, actors: list[DeploymentActor], for_id: str) -> None:
        for a in actors:
            self._abandoning.add(a.deployment_id)
            a.tell(StopDeployment(reason="prewarm_abandoned", actor="ondemand"))
            log.info("prewarm_abandoned", deployment=a.deployment_id, for_=for_id)

    def ended(self, deployment_id: str, used: bool) -> None:
        """A deployment actor's report: its pre-warm was used, or ended unused."""
        if deployment_id in self._abandoning:
            self._abandoning.discard(deployment_id)
            self._count(deployment_id, "abandoned")
            # It gave way to a request, not to its prediction: once no request waits, and
            # while its session may still come, it is pre-warmed again.
            self._done.pop(deployment_id, None)
            self.refresh()
        else:
            self._count(deployment_id, "used" if used else "wasted")

    def _count(self, deployment_id: str, outcome: str) -> None:
        self.counts[outcome] += 1
        mine = self.per_deployment.setdefault(deployment_id, dict.fromkeys(self.counts, 0))
        mine[outcome] += 1

    def forget(self, deployment_id: str) -> None:
        """A removed deployment."""
        self.anticipator.forget(deployment_id)
        self._done.pop(deployment_id, None)
        self.per_deployment.pop(deployment_id, None)
