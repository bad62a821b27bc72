"""`dgxmm_cold_start_phase_seconds{deployment, id, phase}`: a histogram per cold-start phase.

Folded from the events as they are recorded (a store listener, like `histograms.Latencies`):

- a start's own phases, counted once it is ready and a milestone read just after ready
  had its time (`SETTLE_S`): `stopping_victims` (when models were put
  to sleep to make room for it), `launch`, the engine's milestones (`loading_weights`,
  `loading_model`, `engine_init`, `server_start`) and `ready`, cut by the pure
  `events.cold_start.start_phases`;
- the phases of requests that waited: `waiting_for_memory` (queued for memory until
  admitted) and `first_byte` (the engine ready until its first byte reached the request).

Memory is bounded: one pending start per deployment, one pending arrival per waiting request
(the queue is bounded by `ondemand_max_queued`), and `histograms.MAX_SERIES` label sets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from actors.cold_start import AFTER_READY_S
from dgxmm.admin.histograms import COLD_START_BUCKETS, Histogram
from dgxmm.admin.metrics import escape_label
from events import model as m
from events.cold_start import StartMarks, Victim, start_phases

# A milestone read just after ready is recorded within `AFTER_READY_S`: a ready start is
# counted once that is over (or at a scrape, or when its deployment records anything else).
SETTLE_S = AFTER_READY_S + 1.0
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, *COLD_START_BUCKETS)
VICTIM_SLACK_S = 5.0  # a model put to sleep this long before a start was put to sleep for it
MAX_PENDING_ARRIVALS = 4096


class PhaseHistogram(Histogram):
    """A histogram labelled by deployment and phase."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text, buckets)
        self.before_render: Callable[[], None] = lambda: None

    def render(self, name_of: Callable[[str], str]) -> list[str]:
        """The exposition lines, once what is pending was counted."""
        self.before_render()
        return super().render(name_of)

    def observe_phase(self, deployment_id: str, phase: str, value: float) -> None:
        """Count one phase of one deployment."""
        self.observe(f"{deployment_id}\0{phase}", value)

    def labels(self, key: str, name_of: Callable[[str], str]) -> str:
        """deployment, id and phase."""
        dep_id, _, phase = key.partition("\0")
        return f'deployment="{escape_label(name_of(dep_id))}",id="{dep_id}",phase="{phase}"'


class StartPhases:
    """Folds recorded events into the phase histogram."""

    def __init__(self, buckets: Sequence[float] = PHASE_BUCKETS) -> None:
        self.histogram = PhaseHistogram(
            "dgxmm_cold_start_phase_seconds",
            "Seconds each phase of a cold start took (waiting for memory, stopping the models "
            "that made room, launch, the engine's loading milestones, ready, first byte).",
            buckets,
        )
        self.histogram.before_render = self.settle
        self._starts: dict[str, StartMarks] = {}
        self._settling: dict[str, StartMarks] = {}  # ready, for a late milestone to come
        self._made_room: dict[str, float] = {}  # deployment -> when a model slept for it
        self._ready: dict[str, float] = {}  # deployment -> when its last start was ready
        self._arrivals: dict[str, float] = {}  # request queued for memory -> arrival

    def recorded(self, records: list[m.Recorded]) -> None:
        """A store listener."""
        for rec in records:
            self.feed(rec)

    def feed(self, rec: m.Recorded) -> None:
        """Fold one record."""
        ev = rec.event
        if self._settling:
            self.settle(rec.ts - SETTLE_S)
        if isinstance(ev, m.RequestQueued | m.RequestAdmitted | m.RequestLeftQueue):
            self._request(rec.ts, ev)
            return
        if isinstance(ev, m.FirstByteRelayed):
            ready = self._ready.get(ev.deployment_id)
            if ready is not None and ev.at >= ready:
                self.histogram.observe_phase(ev.deployment_id, "first_byte", ev.at - ready)
            return
        if not rec.stream.startswith("deployment:"):
            return
        dep_id = rec.stream.partition(":")[2]
        if dep_id in self._settling and not isinstance(ev, m.EngineMilestoneReached):
            self._observe(dep_id, self._settling.pop(dep_id))
        match ev:
            case m.PutToSleep(reason="make_room", for_deployment=str(for_id)):
                self._made_room[for_id] = rec.ts
            case m.StartRequested():
                if dep_id not in self._starts:
                    self._starts[dep_id] = StartMarks(requested_at=rec.ts)
            case m.EngineStarting():
                self._update(dep_id, launched_at=rec.ts, launch_began_at=ev.launch_began_at)
            case m.EngineMilestoneReached():
                for table in (self._starts, self._settling):
                    if (start := table.get(dep_id)) is not None:
                        found = [*start.milestones, (ev.milestone, ev.at)]
                        table[dep_id] = msgspec.structs.replace(start, milestones=found)
            case m.EngineReady():
                start = self._starts.pop(dep_id, None)
                self._ready[dep_id] = rec.ts
                if start is not None:
                    self._settling[dep_id] = self._ready_start(dep_id, start, rec.ts)
            case m.EngineStartFailed() | m.EngineStopped() | m.EngineLost():
                self._starts.pop(dep_id, None)
            case m.DeploymentRemoved():
                self._starts.pop(dep_id, None)
                self._settling.pop(dep_id, None)
                self._made_room.pop(dep_id, None)
                self._ready.pop(dep_id, None)

    def settle(self, ready_before: float = math.inf) -> None:
        """Count the ready starts whose late milestones had their time (all, at a scrape)."""
        for dep_id, start in list(self._settling.items()):
            if start.ready_at is None or start.ready_at < ready_before:
                self._observe(dep_id, self._settling.pop(dep_id))

    def _update(self, dep_id: str, **changes: Any) -> None:
        start = self._starts.get(dep_id)
        if start is not None:
            self._starts[dep_id] = msgspec.structs.replace(start, **changes)

    def _ready_start(self, dep_id: str, start: StartMarks, ready_at: float) -> StartMarks:
        room = self._made_room.pop(dep_id, None)
        victims = []
        requested = start.requested_at
        if room is not None and requested is not None and room >= requested - VICTIM_SLACK_S:
            victims = [Victim(deployment_id="", name="", drain_s=None)]
        return msgspec.structs.replace(start, ready_at=ready_at, victims=victims)

    def _observe(self, dep_id: str, start: StartMarks) -> None:
        for phase in start_phases(start):
            self.histogram.observe_phase(dep_id, phase.name, phase.seconds)

    def _request(
        self, ts: float, ev: m.RequestQueued | m.RequestAdmitted | m.RequestLeftQueue
    ) -> None:
        if isinstance(ev, m.RequestQueued):
            if ev.kind == "queued" and len(self._arrivals) < MAX_PENDING_ARRIVALS:
                self._arrivals[ev.request_id] = ev.arrived_at
        elif isinstance(ev, m.RequestAdmitted):
            arrived = self._arrivals.pop(ev.request_id, None)
            if arrived is not None:
                self.histogram.observe_phase(
                    ev.deployment_id, "waiting_for_memory", max(0.0, ts - arrived)
                )
        else:
            self._arrivals.pop(ev.request_id, None)
