"""The queue's and the controller's invariants, checked on runs of the real actors.

`Checker` watches a `Harness` while it runs, and checks what only the moment shows:

- every engine launch and every sample: the memory of the engines that exist (the
  simulated runtime's truth) and the broker's launched memory stay within the usable memory;
- every grant of memory: `CheckedBroker`, a subclass of the real broker, keeps its own
  ledger of what it granted and checks the broker's books against it, classifies each grant
  the queue makes (the head, or a later request going ahead of it) from the queue's own
  waiting list, and checks that a go-ahead stopped nothing and fitted in the memory free at
  that moment (memory held or being freed for the head is not free), and that making room
  stopped idle candidates only, least recently used first and only as many as needed, and
  that a re-plan after a refused victim does the same for the memory still missing;
- every put-to-sleep: no simulated client holds a request on the model, the actor counts
  none in flight, no direct call has kept the ready engine busy for a full metrics interval, and
  the deployment is on demand and not the decision model;
- every 5 s of virtual time: the queue holds at most `ondemand_max_queued`, and the head
  of the queue is not left waiting for more than `STARVATION_LIMIT_S` while its model could
  start (free memory plus idle on-demand models would make room for it).

After the run, `check_run` reads the event log and the clients' results: requests served
in arrival order except flagged go-aheads (and the flag only when someone earlier waited),
every request answered or refused with one of the seed's errors, none past its deadline,
queue-full only when full, put-to-sleep only after a full idle timeout (to make room:
after `ondemand_make_room_after_s`, or the deployment's own) and never while a request was
in flight, and `check_replay` folds the log and compares it with what the
actors hold.

`Program` is a list of steps (requests, bursts, time, direct calls, crashes, failing
starts, administrator stops, starts and mode switches) that hypothesis generates;
`run_program` plays one against a fresh box and returns every violation found.

Over 600 lines on purpose: the live checks, the after-the-fact checks of the log and the
program steps are one specification of the queue, read together when a property fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
from collections.abc import Awaitable, Iterable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from actors.deployment import DeploymentActor, Refusal
from actors.memory_broker import GIB, Candidate, MemoryBroker
from actors.queue import QueueActor
from events import model as m
from events.state import Lifecycle, SystemState, fold
from simulations.harness import Harness, RequestResult
from simulations.scenarios import EngineDraws, ModelSpec, Outcome, Scenario, simulate

SAMPLE_EVERY_S = 5.0
# The queue looks again at least every 15 s and metrics are scraped every 5 s: a head that
# could start must have started after both had their turn (and a margin for the sampling).
STARVATION_LIMIT_S = 15.0 + 5.0 + SAMPLE_EVERY_S + 1.0
# A direct call seen by at least one scrape: longer than the 5 s metrics interval.
SCRAPE_WINDOW_S = 5.0 + 1.0
EPS = 1e-3

SEED_ERRORS = (
    "ondemand_queue_full",
    "ondemand_queue_timeout",
    "does_not_fit",
    "start_failed",
    "ondemand_stopped",
)
# "Always on: it runs until you stop it": a request never starts a stopped always-on model.
ENDINGS = ("served", "client_gone", *SEED_ERRORS, "deployment_stopped")
HOLDING = (Lifecycle.STARTING, Lifecycle.READY, Lifecycle.STOPPING, Lifecycle.ASLEEP)


# --- the broker, watched --------------------------------------------------------------------


class Grant(msgspec.Struct, frozen=True, kw_only=True):
    """One reservation the broker granted."""

    at: float
    deployment_id: str
    need: int
    role: Literal["head", "go-ahead", "other"]  # other: not the queue (admin, always-on)
    victims: list[str]
    free_before: int  # by the independent ledger, the deployment's own old entry excluded


def making_room_order(eligible: list[Candidate], short: int) -> list[Candidate]:
    """The order idle candidates go in to free `short` bytes: the least recently used first.
    Under the learned policy, those spared (`expected_at`: a ready pre-warm, a model expected
    before one) only when the others cannot free it, and then first, latest expected first."""
    lru = sorted(eligible, key=lambda c: (c.last_used, c.deployment_id))
    others = [c for c in lru if c.expected_at is None]
    if sum(c.memory_bytes for c in others) >= short:
        return others
    return sorted((c for c in lru if c.expected_at is not None), key=_later_first) + others


def _later_first(c: Candidate) -> float:
    return -(c.expected_at or 0.0)


class CheckedBroker(MemoryBroker):
    """The real broker, with an independent ledger of what it granted, checked at each call."""

    def __init__(
        self, usable_bytes: int, total_bytes: int, *, max_concurrent_starts: int = 1
    ) -> None:
        super().__init__(usable_bytes, total_bytes, max_concurrent_starts=max_concurrent_starts)
        self.ledger: dict[str, int] = {}
        self.releasing_ids: set[str] = set()
        self.grants: list[Grant] = []
        self.problems: list[str] = []
        self.checker: Checker | None = None

    def _now(self) -> float:
        return 0.0 if self.checker is None else self.checker.h.clock.now()

    def _problem(self, text: str) -> None:
        self.problems.append(f"t={self._now():.1f}: {text}")

    def _books(self, after: str) -> None:
        if self.held_total() != sum(self.ledger.values()):
            self._problem(
                f"after {after} the broker holds {_g(self.held_total())} but granted "
                f"{_g(sum(self.ledger.values()))} ({sorted(self.ledger)})"
            )

    def reserve(
        self,
        deployment_id: str,
        need: int,
        *,
        always_on: bool,
        candidates: Iterable[Candidate] = (),
        make_room: bool = True,
    ) -> list[str] | None:
        """The real reserve; then the go-ahead rule and the books are checked."""
        cands = list(candidates)
        had = deployment_id in self.ledger and deployment_id not in self.releasing_ids
        free_before = self.usable_bytes - sum(
            v for k, v in self.ledger.items() if k != deployment_id
        )
        role = "other" if self.checker is None else self.checker.role_of(deployment_id)
        plan = super().reserve(
            deployment_id, need, always_on=always_on, candidates=cands, make_room=make_room
        )
        if plan is None or had:
            return plan
        self.grants.append(
            Grant(
                at=self._now(),
                deployment_id=deployment_id,
                need=need,
                role=role,
                victims=list(plan),
                free_before=free_before,
            )
        )
        name = self._name(deployment_id)
        if role == "go-ahead":
            if plan:
                self._problem(
                    f"{name} went ahead of the head and put {[self._name(v) for v in plan]} "
                    "to sleep for it (only the head may make room)"
                )
            if need > free_before:
                self._problem(
                    f"{name} went ahead of the head with {_g(need)} but only "
                    f"{_g(max(0, free_before))} were free right now (it used memory held or "
                    "being freed for others)"
                )
        elif not plan:
            # The head or an administrator's start may count memory that stops under way give
            # back (what those were stopped for already holds its own reservation).
            eventual = self.usable_bytes - sum(
                v
                for k, v in self.ledger.items()
                if k != deployment_id and k not in self.releasing_ids
            )
            if need > eventual:
                self._problem(
                    f"{name} got {_g(need)} without making room but only {_g(max(0, eventual))} "
                    "are free even once the stops under way complete (it used memory held for "
                    "others)"
                )
        self._check_plan(name, deployment_id, need, plan, cands)
        self.ledger[deployment_id] = need
        self.releasing_ids.discard(deployment_id)
        self.releasing_ids.update(plan)
        self._books(f"reserving for {name}")
        return plan

    def _check_plan(
        self, name: str, deployment_id: str, need: int, plan: list[str], cands: list[Candidate]
    ) -> None:
        """Making room: idle candidates only, least recently used first, only as many as needed."""
        if not plan:
            return
        # Memory of stops already under way comes back too (what it was freed for is in
        # the ledger already), so the last victim must have been needed on top of it.
        eventual = self.usable_bytes - sum(
            v for k, v in self.ledger.items() if k != deployment_id and k not in self.releasing_ids
        )
        eligible = making_room_order(
            [
                c
                for c in cands
                if c.deployment_id in self.ledger and c.deployment_id not in self.releasing_ids
            ],
            need - eventual,
        )
        size = {c.deployment_id: c.memory_bytes for c in eligible}
        victims = [self._name(v) for v in plan]
        if any(v not in size for v in plan):
            self._problem(f"{victims} put to sleep for {name}, not all of them idle candidates")
            return
        if [c.deployment_id for c in eligible[: len(plan)]] != plan:
            self._problem(f"{victims} put to sleep for {name}: not the least recently used")
        before_last = sum(size[v] for v in plan[:-1])
        if eventual + before_last >= need:
            self._problem(
                f"{victims} put to sleep for {name} ({_g(need)}): {victims[-1]} was not needed, "
                f"{_g(eventual + before_last)} are free once the stops under way complete"
            )

    def replan(self, deployment_id: str, candidates: Iterable[Candidate]) -> list[str] | None:
        """The real replan; a re-plan too stops idle candidates only, LRU, only as needed."""
        cands = list(candidates)
        missing = sum(v for k, v in self.ledger.items() if k not in self.releasing_ids)
        missing -= self.usable_bytes
        plan = super().replan(deployment_id, cands)
        if not plan:
            return plan
        name = self._name(deployment_id)
        victims = [self._name(v) for v in plan]
        eligible = making_room_order(
            [
                c
                for c in cands
                if c.deployment_id in self.ledger
                and c.deployment_id not in self.releasing_ids
                and c.deployment_id != deployment_id
            ],
            missing,
        )
        size = {c.deployment_id: c.memory_bytes for c in eligible}
        if any(v not in size for v in plan):
            self._problem(f"re-plan for {name} put {victims} to sleep, not all idle candidates")
        elif [c.deployment_id for c in eligible[: len(plan)]] != plan:
            self._problem(f"re-plan for {name} put {victims} to sleep: not the least recently used")
        elif sum(size[v] for v in plan[:-1]) >= missing:
            self._problem(f"re-plan for {name} put {victims} to sleep: {victims[-1]} not needed")
        self.releasing_ids.update(plan)
        return plan

    def adopt(self, deployment_id: str, need: int, *, always_on: bool) -> None:
        """The real adopt, in the ledger too."""
        super().adopt(deployment_id, need, always_on=always_on)
        self.ledger[deployment_id] = need
        self.releasing_ids.discard(deployment_id)
        self._books("adopting")

    def mark_releasing(self, deployment_id: str) -> None:
        """The real mark_releasing, in the ledger too."""
        super().mark_releasing(deployment_id)
        if deployment_id in self.ledger:
            self.releasing_ids.add(deployment_id)

    def unmark_releasing(self, deployment_id: str) -> None:
        """The real unmark_releasing, in the ledger too."""
        super().unmark_releasing(deployment_id)
        self.releasing_ids.discard(deployment_id)

    def release(self, deployment_id: str) -> None:
        """The real release, in the ledger too."""
        super().release(deployment_id)
        self.ledger.pop(deployment_id, None)
        self.releasing_ids.discard(deployment_id)
        self._books("releasing")

    def launched(self, deployment_id: str) -> None:
        """The real launched; memory is checked the moment an engine exists."""
        super().launched(deployment_id)
        if self.launched_total() > self.usable_bytes:
            self._problem(f"launched {_g(self.launched_total())} > usable {_g(self.usable_bytes)}")
        if self.checker is not None:
            self.checker.check_physical_memory(f"launching {self._name(deployment_id)}")

    def _name(self, deployment_id: str) -> str:
        return deployment_id if self.checker is None else self.checker.name(deployment_id)


def _g(n: int) -> str:
    return f"{n / GIB:g} GiB"


# --- watching a run -------------------------------------------------------------------------


class Checker:
    """Watches one harness while it runs; `problems` lists what went wrong, with times."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.problems: list[str] = []
        self._admitting: str | None = None
        self._head: tuple[str, float] | None = None  # (request, admissible since)
        self._starved: set[str] = set()
        self.samples = 0
        self.max_waiting = 0
        # deployment -> when its engine last became ready: its metrics are scraped from then
        self._ready_at: dict[str, float] = {}
        queue = h.controller.queue
        if not hasattr(QueueActor, "_try_admit"):
            raise RuntimeError("QueueActor._try_admit is gone: teach the Checker the new name")
        admit = queue._try_admit

        def traced(actor: DeploymentActor, *, may_make_room: bool, jumped: bool) -> bool:
            self._admitting = actor.deployment_id
            try:
                return admit(actor, may_make_room=may_make_room, jumped=jumped)
            finally:
                self._admitting = None

        # Only to tell which reservations the queue makes (and for whom); nothing else.
        setattr(queue, "_try_admit", traced)  # noqa: B010
        if isinstance(h.broker, CheckedBroker):
            h.broker.checker = self
        h.controller.add_listener(self._changed)
        self._arm()

    # --- helpers -----------------------------------------------------------------------

    def name(self, deployment_id: str) -> str:
        """A deployment's name (its id when unknown)."""
        actor = self.h.controller.actors.get(deployment_id)
        return deployment_id if actor is None else actor.state.name

    def _problem(self, text: str) -> None:
        self.problems.append(f"t={self.h.clock.now():.1f}: {text}")

    def role_of(self, deployment_id: str) -> Literal["head", "go-ahead", "other"]:
        """Whether a reservation for `deployment_id` happening now is the head's or a go-ahead."""
        if self._admitting != deployment_id:
            return "other"
        waiting = self.h.controller.queue.waiting()
        first = next(
            (i for i, w in enumerate(waiting) if w.deployment_id == deployment_id), len(waiting)
        )
        earlier = [
            w for w in waiting[:first] if w.kind == "queued" and w.deployment_id != deployment_id
        ]
        if earlier:
            return "go-ahead"
        return "head"

    def physical_bytes(self) -> int:
        """Memory of the simulated engines that exist right now."""
        now = self.h.clock.now()
        return sum(e.spec.memory_bytes for e in self.h.runtime.engines.values() if e.alive(now))

    def check_physical_memory(self, when: str) -> None:
        """The engines that exist fit in the usable memory."""
        used = self.physical_bytes()
        if used > self.h.broker.usable_bytes:
            self._problem(
                f"{when}: engines hold {_g(used)} > usable {_g(self.h.broker.usable_bytes)}"
            )

    # --- at the moment -----------------------------------------------------------------

    def _changed(self, deployment_id: str, what: str) -> None:
        queue = self.h.controller.queue
        cap = int(self.h.controller.setting("ondemand_max_queued"))
        self.max_waiting = max(self.max_waiting, len(queue))
        if len(queue) > cap:
            self._problem(f"{len(queue)} requests wait, more than {cap}")
        if what == "ready":
            self._ready_at[deployment_id] = self.h.clock.now()
        if what in ("idle", "make_room"):
            self._put_to_sleep(deployment_id, what)

    def _put_to_sleep(self, deployment_id: str, why: str) -> None:
        actor = self.h.controller.actors.get(deployment_id)
        name = self.name(deployment_id)
        if actor is not None:
            dep = actor.state
            if not dep.on_demand or dep.role == "decision":
                self._problem(f"{name} ({dep.mode}, {dep.role}) put to sleep ({why})")
            if actor.activity.in_flight:
                self._problem(
                    f"{name} put to sleep ({why}) with {actor.activity.in_flight} in flight"
                )
        held = self.h.in_flight.get(deployment_id, 0)
        if held:
            self._problem(f"{name} put to sleep ({why}) while clients hold {held} requests")
        now = self.h.clock.now()
        engine = None if actor is None else actor.state.runtime_id
        for call in self.h.direct_calls:
            seen_from = max(call.start, self._ready_at.get(deployment_id, math.inf))
            if call.runtime_id == engine and seen_from <= now - SCRAPE_WINDOW_S and call.end > now:
                self._problem(
                    f"{name} put to sleep ({why}) while its engine answered a direct call "
                    f"since t={call.start:.1f}"
                )

    # --- every few seconds --------------------------------------------------------------

    def _arm(self) -> None:
        self.h.clock.call_later(SAMPLE_EVERY_S, self._sample)

    def _sample(self) -> None:
        self.samples += 1
        self._arm()
        self.check_physical_memory("sample")
        broker = self.h.broker
        if broker.launched_total() > broker.usable_bytes:
            self._problem(f"launched {_g(broker.launched_total())} > usable")
        self._check_head()

    def _check_head(self) -> None:
        c = self.h.controller
        head = next((w for w in c.queue.waiting() if w.kind == "queued"), None)
        if head is None:
            self._head = None
            return
        now = self.h.clock.now()
        room = self.room_for(head.deployment_id)
        if room is None:
            self._head = None
            return
        if self._head is None or self._head[0] != head.request_id:
            self._head = (head.request_id, now)
            return
        since = self._head[1]
        if now - since > STARVATION_LIMIT_S and head.request_id not in self._starved:
            self._starved.add(head.request_id)
            free, idle = room
            self._problem(
                f"the head {head.request_id} for {self.name(head.deployment_id)} could start "
                f"since t={since:.1f} ({_g(free)} free, idle {idle}) but still waits"
            )

    def room_for(self, deployment_id: str) -> tuple[int, list[str]] | None:
        """(free, idle models) when `deployment_id` could start now, else None."""
        c = self.h.controller
        actor = c.actors.get(deployment_id)
        if actor is None:
            return None
        dep = actor.state
        if dep.lifecycle not in (Lifecycle.STOPPED, Lifecycle.FAILED) or actor.in_backoff():
            return None
        live = set(self.h.runtime.running())
        held = 0
        idle: list[str] = []
        freeable = 0
        for other_id, other in c.actors.items():
            if other_id == deployment_id:
                continue
            holds = (
                other_id in live
                or self.h.broker.holds(other_id)
                or other.state.lifecycle in HOLDING
            )
            if not holds:
                continue
            held += other.state.memory_bytes
            if other.idle_candidate() is not None:
                freeable += other.state.memory_bytes
                idle.append(other.state.name)
        free = self.h.broker.usable_bytes - held
        if dep.memory_bytes > free + freeable:
            return None
        return free, idle


# --- after the run --------------------------------------------------------------------------


class RunFacts(msgspec.Struct, kw_only=True):
    """What the after-the-fact checks need."""

    records: list[m.Recorded]
    results: list[RequestResult]
    wall_offset: float
    names: dict[str, str]  # deployment id -> name
    default_idle_s: int
    queue_timeout_s: float
    max_queued: int
    direct_calls: list[tuple[str, float, float]]  # (engine's runtime id, start, end)
    default_make_room_s: int | None = None  # the configured ondemand_make_room_after_s
    max_concurrent_starts: int = 1  # the start-up queue's slots


def facts_of(h: Harness, records: list[m.Recorded]) -> RunFacts:
    """Collect the facts of a run from its harness."""
    c = h.controller
    names = {dep_id: a.state.name for dep_id, a in c.actors.items()}
    for rec in records:
        if isinstance(rec.event, m.DeploymentCreated):
            names.setdefault(rec.event.deployment_id, rec.event.name)
    return RunFacts(
        records=records,
        results=list(h.results),
        wall_offset=h.clock.wall() - h.clock.now(),
        names=names,
        default_idle_s=int(c.setting("ondemand_idle_timeout_s")),
        queue_timeout_s=float(c.setting("ondemand_queue_timeout_s")),
        max_queued=int(c.setting("ondemand_max_queued")),
        direct_calls=[(d.runtime_id, d.start, d.end) for d in h.direct_calls],
        default_make_room_s=c._defaults.get("ondemand_make_room_after_s"),
        max_concurrent_starts=h.broker.max_concurrent_starts,
    )


def check_order(facts: RunFacts) -> list[str]:
    """Admissions in arrival order, except flagged go-aheads; the flag only when earned."""
    problems: list[str] = []
    waiting: dict[str, list[str]] = {}  # request -> [deployment, kind], arrival order
    for rec in facts.records:
        ev = rec.event
        t = rec.ts - facts.wall_offset
        if isinstance(ev, m.RequestQueued):
            waiting[ev.request_id] = [ev.deployment_id, ev.kind]
        elif isinstance(ev, m.RequestLeftQueue):
            waiting.pop(ev.request_id, None)
        elif isinstance(ev, m.RequestAdmitted) and ev.request_id in waiting:
            # A model's requests share one start: they stand where its oldest one stands.
            # So a request is out of order only when another model's request queued before
            # its model's oldest waiting request; it passed someone (by going ahead or by
            # joining a start) when another model's request queued before itself.
            earlier: list[str] = []
            passed: list[str] = []
            mine = False
            for rid, (dep, kind) in waiting.items():
                if rid == ev.request_id:
                    break
                mine = mine or dep == ev.deployment_id
                if kind == "queued" and dep != ev.deployment_id:
                    passed.append(rid)
                    if not mine:
                        earlier.append(rid)
            who = f"{ev.request_id} for {facts.names.get(ev.deployment_id, ev.deployment_id)}"
            if earlier and not ev.jumped_ahead:
                problems.append(
                    f"t={t:.1f}: {who} admitted before {earlier[0]} (queued earlier) "
                    "without the go-ahead flag"
                )
            if ev.jumped_ahead and not passed:
                problems.append(
                    f"t={t:.1f}: {who} flagged as going ahead, but no earlier request "
                    "waited for memory"
                )
            waiting[ev.request_id][1] = "waiting_start"
    return problems


def check_endings(facts: RunFacts) -> list[str]:
    """Every request answered or refused with a seed error, in time, with the seed's words."""
    problems: list[str] = []
    limit = facts.queue_timeout_s
    for r in facts.results:
        name = facts.names.get(r.deployment_id, r.deployment_id)
        who = f"{r.request_id} for {name} (arrived t={r.arrived:.1f})"
        if r.outcome not in ENDINGS:
            problems.append(f"{who} ended as {r.outcome!r}")
            continue
        if r.outcome == "served":
            assert r.admitted_at is not None
            if r.admitted_at - r.arrived > limit + EPS:
                problems.append(
                    f"{who} served after {r.admitted_at - r.arrived:.1f} s, past its deadline"
                )
            continue
        assert r.finished_at is not None
        waited = r.finished_at - r.arrived
        if waited > limit + EPS:
            problems.append(f"{who} ended ({r.outcome}) after {waited:.1f} s, past its deadline")
        if r.outcome == "ondemand_queue_timeout":
            if waited < limit - EPS:
                problems.append(f"{who} timed out after {waited:.1f} s, before {limit:g} s")
            if r.message != f"model {name} is busy; try again later" or r.retry_after != 60:
                problems.append(f"{who}: timeout answer {r.message!r}, {r.retry_after}")
        elif r.outcome == "ondemand_queue_full":
            if r.retry_after != 60:
                problems.append(f"{who}: queue full without Retry-After: 60")
            if r.waiting_before is None or r.waiting_before < facts.max_queued:
                problems.append(
                    f"{who} refused as queue full with {r.waiting_before} waiting "
                    f"(cap {facts.max_queued})"
                )
        elif r.outcome == "does_not_fit":
            pattern = rf"{re.escape(name)} needs [\d.]+ GiB but at most [\d.]+ GiB can be freed"
            if not re.fullmatch(pattern + " for on-demand models", r.message):
                problems.append(f"{who}: does_not_fit answer {r.message!r}")
        elif r.outcome == "start_failed":
            if not r.message.startswith(f"{name} could not start: "):
                problems.append(f"{who}: start_failed answer {r.message!r}")
        elif r.outcome == "ondemand_stopped" and not r.message.startswith(
            f"{name} was stopped by an administrator"
        ):
            problems.append(f"{who}: ondemand_stopped answer {r.message!r}")
        elif r.outcome == "deployment_stopped" and not r.message.startswith(
            f"{name} is always on and "
        ):
            problems.append(f"{who}: deployment_stopped answer {r.message!r}")
        if (
            r.outcome not in ("ondemand_queue_full", "deployment_stopped")  # refused at once
            and r.waiting_before is not None
            and r.waiting_before >= facts.max_queued
        ):
            problems.append(
                f"{who} was let in with {r.waiting_before} already waiting (cap {facts.max_queued})"
            )
    return problems


def check_queue_cap(facts: RunFacts) -> list[str]:
    """The log never shows more than `ondemand_max_queued` requests waiting."""
    waiting: set[str] = set()
    for rec in facts.records:
        ev = rec.event
        if isinstance(ev, m.RequestQueued):
            waiting.add(ev.request_id)
            if len(waiting) > facts.max_queued:
                t = rec.ts - facts.wall_offset
                return [f"t={t:.1f}: the log shows {len(waiting)} waiting (cap {facts.max_queued})"]
        elif isinstance(ev, m.RequestLeftQueue):
            waiting.discard(ev.request_id)
    return []


def check_sleeps(facts: RunFacts) -> list[str]:
    """Put to sleep only on demand, after a full idle timeout (to make room: after
    `ondemand_make_room_after_s`), with nothing in flight."""
    problems: list[str] = []
    state = fold([])
    activity: dict[str, float] = {}  # deployment -> last ready/awake/adopted/mode change
    ready_at: dict[str, float] = {}  # deployment -> when its engine last became ready
    # A model put to sleep and started again within the same instant (a request for it came
    # right after it made room): a request admitted at that instant may be the new engine's,
    # which times alone cannot tell; the live `Checker` saw the actor's own count at the sleep.
    ready_again: dict[int, float] = {}  # a PutToSleep's seq -> when its model was next ready
    slept: dict[str, int] = {}
    prewarmed: dict[str, list[float]] = {}  # deployment -> when it was pre-warmed
    for rec in facts.records:
        dep = rec.stream.partition(":")[2]
        if isinstance(rec.event, m.StartRequested) and rec.event.reason == "prewarm":
            prewarmed.setdefault(dep, []).append(rec.ts - facts.wall_offset)
        if isinstance(rec.event, m.PutToSleep):
            slept[dep] = rec.seq
        elif isinstance(rec.event, m.EngineReady | m.EngineAwake) and dep in slept:
            ready_again[slept.pop(dep)] = rec.ts - facts.wall_offset
    for rec in facts.records:
        ev = rec.event
        t = rec.ts - facts.wall_offset
        dep_id = rec.stream.partition(":")[2] if rec.stream.startswith("deployment:") else None
        before = state.deployments.get(dep_id) if dep_id is not None else None
        state = fold([rec], state)
        if dep_id is None:
            continue
        if isinstance(ev, m.EngineReady | m.EngineAwake | m.EngineAdopted | m.ModeChanged):
            activity[dep_id] = t
        if isinstance(ev, m.EngineReady | m.EngineAdopted):
            ready_at[dep_id] = t
        if not isinstance(ev, m.PutToSleep) or ev.reason == "watchdog" or before is None:
            continue
        name = facts.names.get(dep_id, dep_id)
        if not before.on_demand or before.role == "decision" or rec.actor != "ondemand":
            problems.append(
                f"t={t:.1f}: {name} ({before.mode}, {before.role}) put to sleep by {rec.actor}"
            )
        timeout = before.effective_idle_timeout_s(_default_idle(state, facts))
        if ev.kept_warm_s:  # the learned policy's keep-warm, shorter than the idle timeout
            if ev.kept_warm_s > timeout:
                problems.append(f"t={t:.1f}: {name} kept warm {ev.kept_warm_s} s > {timeout} s")
            timeout = ev.kept_warm_s
        if ev.prewarm_unused:
            timeout = 0  # nothing used it since it was pre-warmed: as if it were asleep
        elif ev.reason == "make_room":
            default_room = state.settings.get(
                "ondemand_make_room_after_s", facts.default_make_room_s
            )
            room = before.effective_make_room_after_s(_default_idle(state, facts), default_room)
            # One that lends its memory between sessions may go after its keep-warm, for a
            # request; a pre-warm takes only what the seed's rule makes a candidate.
            for_prewarm = any(
                abs(at - t) <= 1.0 for at in prewarmed.get(ev.for_deployment or "", [])
            )
            timeout = min(room, ev.kept_warm_s) if ev.kept_warm_s and not for_prewarm else room
        last = activity.get(dep_id, -math.inf)
        for r in facts.results:
            if r.deployment_id != dep_id or r.admitted_at is None or r.admitted_at > t + EPS:
                continue
            if r.admitted_at >= t - EPS and ready_again.get(rec.seq, math.inf) <= t + EPS:
                continue
            end = r.finished_at if r.finished_at is not None else math.inf
            if end > t + EPS:
                problems.append(f"t={t:.1f}: {name} put to sleep with {r.request_id} in flight")
            last = max(last, end)
        if t - last < timeout - EPS:
            problems.append(
                f"t={t:.1f}: {name} put to sleep ({ev.reason}) {t - last:.1f} s after its last "
                f"use; it must be quiet for {timeout} s"
            )
        for engine, start, end in facts.direct_calls:
            seen_from = max(start, ready_at.get(dep_id, math.inf))  # a starting engine: no scrape
            if engine == before.runtime_id and seen_from <= t - SCRAPE_WINDOW_S and end > t + EPS:
                problems.append(
                    f"t={t:.1f}: {name} put to sleep while a direct call ran since t={start:.1f}"
                )
    return problems


def _default_idle(state: SystemState, facts: RunFacts) -> int:
    value = state.settings.get("ondemand_idle_timeout_s", facts.default_idle_s)
    return int(value)


def check_prewarms(facts: RunFacts) -> list[str]:
    """A pre-warm starts only while no request waits; one abandoned had none waiting for
    it, nor in flight; one that sleeps unused served nothing since it was pre-warmed."""
    problems: list[str] = []
    prewarmed: dict[str, float] = {}  # deployment -> when its pending pre-warm began
    for rec in facts.records:
        ev, t = rec.event, rec.ts - facts.wall_offset
        dep = rec.stream.partition(":")[2]
        name = facts.names.get(dep, dep)
        if isinstance(ev, m.StartRequested) and ev.reason == "prewarm":
            prewarmed[dep] = t
            waiting = [
                r.request_id for r in facts.results if r.arrived < t - EPS and _pending_at(r, t)
            ]
            if waiting:
                problems.append(f"t={t:.1f}: {name} pre-warmed while {waiting[:3]} waited")
        elif isinstance(ev, m.StopRequested) and ev.reason == "prewarm_abandoned":
            mine = [
                r.request_id
                for r in facts.results
                if r.deployment_id == dep and r.arrived < t - EPS and _pending_at(r, t)
            ]
            if mine or dep not in prewarmed:
                problems.append(f"t={t:.1f}: {name}'s pre-warm abandoned with {mine} for it")
        elif isinstance(ev, m.PutToSleep) and ev.prewarm_unused:
            since = prewarmed.get(dep)
            used = [
                r.request_id
                for r in facts.results
                if r.deployment_id == dep
                and since is not None
                and r.admitted_at is not None
                and since - EPS <= r.admitted_at <= t + EPS
            ]
            if since is None or used:
                problems.append(f"t={t:.1f}: {name} called its pre-warm unused; {used} used it")
        if isinstance(ev, m.EngineStopped | m.EngineStartFailed | m.EngineLost):
            prewarmed.pop(dep, None)
    return problems


def check_prewarm_starts(facts: RunFacts) -> list[str]:
    """With one start at a time, a pre-warm no request waits for never holds the start slot
    a start with waiting requests wants: while such a start waits to launch, no such pre-warm
    launches or becomes ready (it is abandoned at once instead)."""
    if facts.max_concurrent_starts != 1:
        return []  # with more slots a pre-warm may launch beside a start waiting for memory
    problems: list[str] = []
    unlaunched: dict[str, float] = {}  # deployment -> when its start not yet launched began
    prewarms: set[str] = set()  # deployments whose pending start is a pre-warm
    for rec in facts.records:
        ev, t = rec.event, rec.ts - facts.wall_offset
        dep = rec.stream.partition(":")[2]
        if isinstance(ev, m.StartRequested):
            unlaunched[dep] = t
            if ev.reason == "prewarm":
                prewarms.add(dep)
            else:
                prewarms.discard(dep)
        elif isinstance(ev, m.EngineStarting | m.EngineReady):
            if dep in prewarms and not _wanted(facts, dep, t):
                held_up = [
                    facts.names.get(d, d)
                    for d, since in unlaunched.items()
                    if d != dep and since < t - EPS and _wanted(facts, d, t)
                ]
                if held_up:
                    what = "launched" if isinstance(ev, m.EngineStarting) else "became ready"
                    name = facts.names.get(dep, dep)
                    problems.append(f"t={t:.1f}: {name}'s pre-warm {what} while {held_up} waited")
            if isinstance(ev, m.EngineStarting):
                unlaunched.pop(dep, None)
            else:
                prewarms.discard(dep)
        elif isinstance(ev, m.EngineStopped | m.EngineStartFailed | m.EngineLost):
            unlaunched.pop(dep, None)
            prewarms.discard(dep)
    return problems


def _wanted(facts: RunFacts, deployment_id: str, t: float) -> bool:
    """Whether a request of the deployment was waiting until `t` (a start that ends at `t`
    admits its requests at `t`)."""
    return any(
        r.deployment_id == deployment_id and r.arrived < t - EPS and _pending_at(r, t - 2 * EPS)
        for r in facts.results
    )


def _pending_at(r: RequestResult, t: float) -> bool:
    """Whether request `r` was waiting (not yet admitted, refused or gone) at `t`."""
    ended = r.admitted_at if r.admitted_at is not None else r.finished_at
    return ended is None or ended > t + EPS


def check_run(facts: RunFacts) -> list[str]:
    """Every after-the-fact property."""
    return [
        *check_order(facts),
        *check_endings(facts),
        *check_queue_cap(facts),
        *check_sleeps(facts),
        *check_prewarms(facts),
        *check_prewarm_starts(facts),
    ]


SETTLE_S = 600.0


async def check_replay(h: Harness) -> list[str]:
    """Fold the log as `dgxmm replay` does; it must give the state the actors hold.

    Compared between handlers: a handler under way (stopping a lost engine's leftovers, say)
    has recorded its event but not yet given back the memory, so time moves on until none is,
    for at most `SETTLE_S` virtual seconds.
    """
    problems: list[str] = []
    deadline = h.clock.now() + SETTLE_S
    while any(a.busy for a in h.controller.actors.values()) and h.clock.now() < deadline:
        await h.clock.advance(1.0)
    if busy := sorted(a.state.name for a in h.controller.actors.values() if a.busy):
        problems.append(f"still busy {SETTLE_S:g} s after the run: {busy}")
    records = await h.events()
    state = fold(records)
    c = h.controller
    if set(state.deployments) != set(c.actors):
        problems.append(f"replay has {sorted(state.deployments)}, actors {sorted(c.actors)}")
    for dep_id, actor in c.actors.items():
        folded = state.deployments.get(dep_id)
        if folded != actor.state:
            problems.append(f"replay of {actor.state.name}: {folded!r} != actor {actor.state!r}")
    waiting = {w.request_id for w in c.queue.waiting()}
    if set(state.queue) != waiting:
        problems.append(f"replayed queue {sorted(state.queue)} != live queue {sorted(waiting)}")
    if state.settings != c.system.settings:
        problems.append(f"replayed settings {state.settings} != {c.system.settings}")
    # A failed always-on deployment keeps its memory for its restart.
    held = sum(
        d.memory_bytes
        for d in state.deployments.values()
        if d.lifecycle in HOLDING or (d.lifecycle is Lifecycle.FAILED and not d.on_demand)
    )
    if held != h.broker.held_total():
        problems.append(f"replayed memory {_g(held)} != broker {_g(h.broker.held_total())}")
    now = h.clock.now()
    for dep_id, dep in state.deployments.items():
        engine = h.runtime.engine_of(dep_id)
        if dep.lifecycle in (Lifecycle.READY, Lifecycle.ASLEEP) and engine is None:
            died = _died_at(h, dep_id)
            if died is None or now - died > SCRAPE_WINDOW_S:
                problems.append(f"replay says {dep.name} is {dep.lifecycle.value}; no engine runs")
        if dep.lifecycle in (Lifecycle.STOPPED, Lifecycle.FAILED) and engine is not None:
            problems.append(f"replay says {dep.name} is {dep.lifecycle.value}; its engine runs")
    return problems


def _died_at(h: Harness, deployment_id: str) -> float | None:
    last: float | None = None
    for e in h.runtime.engines.values():
        b = e.behaviour
        if e.handle.deployment_id == deployment_id and b.die_after_s is not None:
            at = e.started + b.startup_s + b.die_after_s
            last = at if last is None else max(last, at)
    return last


# --- a scenario, checked --------------------------------------------------------------------


class Checked(msgspec.Struct, kw_only=True):
    """A run and what the checks found."""

    outcome: Outcome
    problems: list[str]
    samples: int
    grants: int
    go_aheads: int


async def simulate_checked(
    spec: Scenario,
    db_path: str | Path,
    *,
    seed: int,
    policy: Literal["fifo-go-ahead", "fifo"] = "fifo-go-ahead",
    broker_cls: type[CheckedBroker] = CheckedBroker,
) -> Checked:
    """`simulate` with every property checked."""
    checkers: list[Checker] = []
    late: list[str] = []

    async def before_close(h: Harness) -> None:
        late.extend(await check_replay(h))
        late.extend(check_run(facts_of(h, await h.events())))

    out = await simulate(
        spec,
        db_path,
        seed=seed,
        policy=policy,
        broker_cls=broker_cls,
        attach=lambda h: checkers.append(Checker(h)),
        before_close=before_close,
    )
    checker = checkers[0]
    broker = checker.h.broker
    assert isinstance(broker, CheckedBroker)
    return Checked(
        outcome=out,
        problems=[*out.harness_violations, *broker.problems, *checker.problems, *late],
        samples=checker.samples,
        grants=len(broker.grants),
        go_aheads=sum(g.role == "go-ahead" for g in broker.grants),
    )


# --- generated programs ---------------------------------------------------------------------


class Request(msgspec.Struct, frozen=True, tag=True):
    """A client sends one request."""

    model: int
    hold_s: float
    hang_up_after_s: float | None = None


class Burst(msgspec.Struct, frozen=True, tag=True):
    """`n` requests for one model at once."""

    model: int
    n: int
    hold_s: float


class Advance(msgspec.Struct, frozen=True, tag=True):
    """Time passes."""

    seconds: float


class Direct(msgspec.Struct, frozen=True, tag=True):
    """A call straight to the model's engine port."""

    model: int
    seconds: float


class Kill(msgspec.Struct, frozen=True, tag=True):
    """The model's engine dies behind DGXMM's back."""

    model: int


class FailNextStart(msgspec.Struct, frozen=True, tag=True):
    """The model's next start fails."""

    model: int


class AdminStop(msgspec.Struct, frozen=True, tag=True):
    """An administrator stops the model."""

    model: int


class AdminStart(msgspec.Struct, frozen=True, tag=True):
    """An administrator starts the model."""

    model: int


class SwitchMode(msgspec.Struct, frozen=True, tag=True):
    """An administrator switches the model's mode."""

    model: int
    mode: m.Mode
    idle_timeout_s: int | None = None


Step = (
    Request | Burst | Advance | Direct | Kill | FailNextStart | AdminStop | AdminStart | SwitchMode
)


class Program(msgspec.Struct, frozen=True, kw_only=True):
    """A box and what happens to it."""

    usable_gib: int
    models: list[ModelSpec]
    settings: dict[str, int]
    steps: list[Step]
    cold: bool = True
    stop_s: float = 0.0
    max_concurrent_starts: int = 1


async def run_program(
    program: Program,
    db_path: str | Path,
    *,
    policy: Literal["fifo-go-ahead", "fifo"] = "fifo-go-ahead",
    broker_cls: type[CheckedBroker] = CheckedBroker,
    seed: int = 0,
) -> Checked:
    """Play `program` on a fresh box, drain it, and return every violation found."""
    spec = Scenario(
        name="program",
        description="generated",
        usable_gib=program.usable_gib,
        models=tuple(program.models),
        duration_s=0.0,
        settings=program.settings,
        cold=program.cold,
        stop_s=program.stop_s,
        max_concurrent_starts=program.max_concurrent_starts,
    )
    draws = EngineDraws(spec.models, random.Random(seed))
    checkers: list[Checker] = []
    late: list[str] = []

    admin: list[asyncio.Task[None]] = []

    async def play(h: Harness, ids: dict[str, str]) -> None:
        for step in program.steps:
            await _play(h, draws, spec, ids, step, admin)

    async def before_close(h: Harness) -> None:
        for task in admin:  # done long ago: the drain ran meanwhile
            if not task.done():
                late.append("an administrator's call never answered")
                task.cancel()
            elif task.exception() is not None:
                late.append(f"an administrator's call failed: {task.exception()!r}")
        late.extend(await check_replay(h))
        late.extend(check_run(facts_of(h, await h.events())))

    out = await simulate(
        spec,
        db_path,
        seed=seed,
        policy=policy,
        broker_cls=broker_cls,
        attach=lambda h: checkers.append(Checker(h)),
        drive=play,
        drain=_program_drain(program),
        before_close=before_close,
        engines=draws,
    )
    checker = checkers[0]
    broker = checker.h.broker
    assert isinstance(broker, CheckedBroker)
    return Checked(
        outcome=out,
        problems=[*checker.h.violations, *broker.problems, *checker.problems, *late],
        samples=checker.samples,
        grants=len(broker.grants),
        go_aheads=sum(g.role == "go-ahead" for g in broker.grants),
    )


def _program_drain(program: Program) -> float:
    timeout = program.settings.get("ondemand_queue_timeout_s", 900)
    holds = [s.hold_s for s in program.steps if isinstance(s, Request | Burst)]
    startup = max(spec.startup_s[1] for spec in program.models)
    # Long enough for every request to end and for a start failure's backoff to pass.
    return float(timeout + max(holds, default=0.0) + startup + 120)


async def _play(
    h: Harness,
    draws: EngineDraws,
    spec: Scenario,
    names: dict[str, str],
    step: Step,
    admin: list[asyncio.Task[None]],
) -> None:
    c = h.controller
    ids = {i: names[model.name] for i, model in enumerate(spec.models)}

    async def refused_is_fine(call: Awaitable[object]) -> None:
        with contextlib.suppress(Refusal):
            await call

    def as_admin(call: Awaitable[object]) -> None:
        # An administrator's call runs while time goes on (it may wait for an engine).
        admin.append(asyncio.get_running_loop().create_task(refused_is_fine(call)))

    match step:
        case Request():
            h.request(ids[step.model], step.hold_s, hang_up_after_s=step.hang_up_after_s)
        case Burst():
            for _ in range(step.n):
                h.request(ids[step.model], step.hold_s)
        case Advance():
            await h.advance(step.seconds)
        case Direct():
            h.direct_call(ids[step.model], step.seconds)
        case Kill():
            h.runtime.kill(ids[step.model])
        case FailNextStart():
            draws.fail_next.add(spec.models[step.model].name)
        case AdminStop():
            as_admin(c.stop(ids[step.model], "admin:program"))
        case AdminStart():
            as_admin(c.start(ids[step.model], "admin:program"))
        case SwitchMode():
            as_admin(
                c.change_mode(
                    ids[step.model], step.mode, step.idle_timeout_s, False, "admin:program"
                )
            )
    await h.clock.settle()


def summary(checked: Checked) -> str:
    """One line about a checked run."""
    out = checked.outcome
    ends: dict[str, int] = {}
    for r in out.results:
        ends[r.outcome] = ends.get(r.outcome, 0) + 1
    return (
        f"{len(out.results)} requests {ends}, {len(out.records)} events, "
        f"{checked.grants} grants ({checked.go_aheads} go-aheads), {checked.samples} samples, "
        f"{len(checked.problems)} problems"
    )


def first_problems(problems: Sequence[str], n: int = 15) -> str:
    """The first `n` problems as one text block."""
    more = f"\n... and {len(problems) - n} more" if len(problems) > n else ""
    return "\n".join(problems[:n]) + more
