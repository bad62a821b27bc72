"""The memory budget: reservations for every start, make-room plans, the start-up queue.

Reservations are synchronous calls made from the event loop's thread.  A call runs to its
end without awaiting, so checking the budget and taking memory out of it can never
interleave with another start: that is "the deployer's lock".  Launches then go through the
start-up queue (`launch_slot`), which lets an engine launch only when its memory is
physically free (the models stopped to make room for it are gone) and only as many at once
as configured.

The decision is the pure function `plan_make_room`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

import msgspec

GIB = 1024**3


class Candidate(msgspec.Struct, frozen=True):
    """An idle on-demand deployment that could be put to sleep."""

    deployment_id: str
    memory_bytes: int
    last_used: float  # monotonic seconds of its last use (request end, ready, switch)
    # Set (epoch seconds): spared, stopped only when the others cannot make the room, the
    # one expected latest first. The learned policy's: a ready pre-warm, when its request is
    # expected; a model expected before such a one, when it is.
    expected_at: float | None = None


def plan_make_room(need: int, free: int, candidates: Iterable[Candidate]) -> list[str] | None:
    """The least recently used idle candidates to stop so `need` fits, or None if impossible.

    Only as many as needed, oldest use first (not by size); an empty list when it already
    fits; None (stop nothing) when even all of them together would not free enough.  The
    spared (`expected_at`) are left while the others alone can make the room; else they go
    first, the one expected latest first.
    """
    if need <= free:
        return []
    ordered = sorted(candidates, key=lambda c: (c.last_used, c.deployment_id))
    others = [c for c in ordered if c.expected_at is None]
    plan = _oldest_first(need, free, others)
    if plan is None and len(others) < len(ordered):
        spared = [c for c in ordered if c.expected_at is not None]
        spared.sort(key=lambda c: -(c.expected_at or 0.0))
        plan = _oldest_first(need, free, spared + others)
    return plan


def _oldest_first(need: int, free: int, ordered: list[Candidate]) -> list[str] | None:
    chosen: list[str] = []
    freed = 0
    for cand in ordered:
        chosen.append(cand.deployment_id)
        freed += cand.memory_bytes
        if free + freed >= need:
            return chosen
    return None


def no_room_note(name: str, need: int, free: int, idle: list[int]) -> str | None:
    """Why `name` cannot start for want of memory, in the present tense (pure): `free` bytes
    free for it and the `idle` candidates' sizes; None when it fits or they can make room."""
    if need <= free + sum(idle):  # what `plan_make_room` finds a plan for
        return None
    said = f"{name} needs {gib(need)} GiB but only {gib(max(0, free))} GiB are free"
    if not idle:
        return said + " and no idle on-demand model can make room"
    return said + f" and the idle on-demand models can free only {gib(sum(idle))} GiB more"


def gib(n: int) -> str:
    """Bytes as the seed's messages write GiB: `80`, `60.5`."""
    return f"{round(n / GIB, 1):g}"


class Holding(msgspec.Struct, kw_only=True):
    """Memory one deployment holds or has reserved."""

    memory_bytes: int
    always_on: bool
    launched: bool = False  # its engine (container/process) exists
    releasing: bool = False  # it is being stopped; its memory returns when it is gone


class MemoryBroker:
    """The budget of one box."""

    def __init__(self, usable_bytes: int, total_bytes: int, *, max_concurrent_starts: int = 1):
        self.total_bytes = total_bytes
        self.usable_bytes = usable_bytes
        self._held: dict[str, Holding] = {}
        self.max_concurrent_starts = max(1, max_concurrent_starts)
        self._starts = asyncio.Semaphore(self.max_concurrent_starts)
        self._in_slot: set[str] = set()  # deployments holding a start slot
        self._changed = asyncio.Event()
        self.peak_launched = 0

    # --- reading -------------------------------------------------------------------------

    def held_total(self) -> int:
        """Everything held or reserved, including memory still being released."""
        return sum(h.memory_bytes for h in self._held.values())

    def launched_total(self) -> int:
        """Memory of engines that physically exist (must never exceed the usable memory)."""
        return sum(h.memory_bytes for h in self._held.values() if h.launched)

    def free(self) -> int:
        """Memory free right now for a new reservation (memory freed for a start excluded)."""
        return self.usable_bytes - self.held_total()

    def always_on_held(self) -> int:
        """Memory held by always-on deployments."""
        return sum(h.memory_bytes for h in self._held.values() if h.always_on)

    def on_demand_held(self) -> int:
        """Memory held by on-demand deployments."""
        return sum(h.memory_bytes for h in self._held.values() if not h.always_on)

    def holds(self, deployment_id: str) -> bool:
        """Whether the deployment has memory reserved or held."""
        return deployment_id in self._held

    def reserved_for(self, deployment_id: str) -> int:
        """Memory the deployment holds and keeps (0 when none, or when it is being released)."""
        held = self._held.get(deployment_id)
        return 0 if held is None or held.releasing else held.memory_bytes

    def releasing_total(self) -> int:
        """Memory of deployments being stopped."""
        return sum(h.memory_bytes for h in self._held.values() if h.releasing)

    def snapshot(self) -> dict[str, int]:
        """Numbers for `GET /dgxmm/api/memory`."""
        return {
            "total_bytes": self.total_bytes,
            "usable_bytes": self.usable_bytes,
            "always_on_bytes": self.always_on_held(),
            "on_demand_bytes": self.on_demand_held(),
            "free_bytes": max(0, self.free()),
        }

    # --- deciding and reserving ----------------------------------------------------------

    def reserve(
        self,
        deployment_id: str,
        need: int,
        *,
        always_on: bool,
        candidates: Iterable[Candidate] = (),
        make_room: bool = True,
    ) -> list[str] | None:
        """Reserve `need` bytes, planning which idle candidates must sleep for it.

        With `make_room` (the queue's head, an administrator's start, a mode switch) memory
        that stops under way give back counts: what they were stopped for already holds its
        own reservation, so the rest comes back to the budget, and the launch waits for it.
        Without it (a later request going ahead) only memory free right now counts, and no
        candidate is stopped.

        Returns the deployments to stop (empty when it fits), or None when it does not fit
        even with every candidate stopped; then nothing is reserved.
        """
        existing = self._held.get(deployment_id)
        if existing is not None and not existing.releasing:
            existing.always_on = always_on
            return []
        free, eligible = self._room(deployment_id, candidates, make_room)
        plan = plan_make_room(need, free, eligible)
        if plan is None:
            return None
        for victim in plan:
            self._held[victim].releasing = True
        self._held[deployment_id] = Holding(memory_bytes=need, always_on=always_on)
        self._notify()
        return plan

    def _room(
        self, deployment_id: str, candidates: Iterable[Candidate], make_room: bool
    ) -> tuple[int, list[Candidate]]:
        """What a reservation for `deployment_id` may count on: the memory free for it, and
        the candidates it may stop (see `reserve`)."""
        existing = self._held.get(deployment_id)
        free = self.usable_bytes - self.held_total() + (existing.memory_bytes if existing else 0)
        if not make_room:
            return free, []
        free += sum(
            h.memory_bytes
            for dep_id, h in self._held.items()
            if h.releasing and dep_id != deployment_id
        )
        eligible = [
            c
            for c in candidates
            if c.deployment_id in self._held and not self._held[c.deployment_id].releasing
        ]
        return free, eligible

    def no_room(
        self, deployment_id: str, name: str, need: int, candidates: Iterable[Candidate]
    ) -> str | None:
        """Why a start of `deployment_id` (`need` bytes) would find no memory now, as the
        refusal says it; None when it would (it fits, or idle candidates can make room).  Read
        from the budget as it is, it is never stale (issue 46, stumble 8)."""
        if self.reserved_for(deployment_id):
            return None  # it holds its memory: its start is under way
        free, eligible = self._room(deployment_id, candidates, True)
        return no_room_note(name, need, free, [c.memory_bytes for c in eligible])

    def shortfall(self) -> int:
        """Memory held beyond the budget by deployments that keep it (0 normally).

        Only a planned stop that was refused (the victim got a request) leaves the books
        over: the reservation made for the head counted on that victim's memory.
        """
        kept = sum(h.memory_bytes for h in self._held.values() if not h.releasing)
        return max(0, kept - self.usable_bytes)

    def replan(self, deployment_id: str, candidates: Iterable[Candidate]) -> list[str] | None:
        """Make room again for a reservation whose victim refused, with the candidates left.

        Returns the further deployments to stop (empty when nothing is missing, or when
        `deployment_id` has no reservation waiting for its launch), or None when even all
        candidates left would not cover the shortfall; then nothing is stopped and the launch
        keeps waiting (the queue tries again on its next pass).
        """
        held = self._held.get(deployment_id)
        if held is None or held.launched or held.releasing:
            return []
        missing = self.shortfall()
        if missing == 0:
            return []
        eligible = [
            c
            for c in candidates
            if c.deployment_id != deployment_id
            and c.deployment_id in self._held
            and not self._held[c.deployment_id].releasing
        ]
        plan = plan_make_room(missing, 0, eligible)
        if plan is None:
            return None
        for victim in plan:
            self._held[victim].releasing = True
        self._notify()
        return plan

    def adopt(self, deployment_id: str, need: int, *, always_on: bool) -> None:
        """Account for an engine found running at start-up (it already exists)."""
        self._held[deployment_id] = Holding(memory_bytes=need, always_on=always_on, launched=True)
        self._notify()

    def set_always_on(self, deployment_id: str, always_on: bool) -> None:
        """The deployment's mode changed."""
        held = self._held.get(deployment_id)
        if held is not None:
            held.always_on = always_on

    def mark_releasing(self, deployment_id: str) -> None:
        """The deployment is being stopped."""
        held = self._held.get(deployment_id)
        if held is not None:
            held.releasing = True

    def unmark_releasing(self, deployment_id: str) -> None:
        """A planned stop was refused (the model got a request): it keeps its memory."""
        held = self._held.get(deployment_id)
        if held is not None:
            held.releasing = False
            self._notify()

    def keep_for_restart(self, deployment_id: str) -> None:
        """The engine is gone but the deployment keeps its reservation (always on, failed)."""
        held = self._held.get(deployment_id)
        if held is not None:
            held.launched = False
            held.releasing = False
            self._notify()

    def release(self, deployment_id: str) -> None:
        """The deployment's engine is gone (or its start was abandoned): memory is free."""
        if self._held.pop(deployment_id, None) is not None:
            self._notify()

    # --- the start-up queue --------------------------------------------------------------

    def _notify(self) -> None:
        woken, self._changed = self._changed, asyncio.Event()
        woken.set()

    def _physically_free_for(self, deployment_id: str) -> bool:
        held = self._held.get(deployment_id)
        if held is None:
            return False
        others = self.launched_total() - (held.memory_bytes if held.launched else 0)
        return others + held.memory_bytes <= self.usable_bytes

    def start_slot_free(self) -> bool:
        """Whether a start would get a slot at once (none taken by all, nobody waiting)."""
        return not self._starts.locked()

    def holds_start_slot(self, deployment_id: str) -> bool:
        """Whether the deployment's start holds a slot (else it waits for one, or has none)."""
        return deployment_id in self._in_slot

    @contextlib.asynccontextmanager
    async def launch_slot(self, deployment_id: str) -> AsyncIterator[None]:
        """Wait for a start slot and for the reserved memory to be physically free.

        The caller launches its engine inside the block; a failed launch releases it.
        Raises LookupError when the reservation was released while waiting.
        """
        async with self._starts:
            self._in_slot.add(deployment_id)
            try:
                while not self._physically_free_for(deployment_id):
                    if deployment_id not in self._held:
                        raise LookupError(f"no reservation for {deployment_id}")
                    await self._changed.wait()
                # From here on its memory counts as taken by an engine, so a launch in another
                # slot cannot pass the same check before this engine exists.
                self.launched(deployment_id)
                yield
            finally:
                self._in_slot.discard(deployment_id)

    def launched(self, deployment_id: str) -> None:
        """The engine now exists."""
        held = self._held.get(deployment_id)
        if held is not None:
            held.launched = True
            self.peak_launched = max(self.peak_launched, self.launched_total())
