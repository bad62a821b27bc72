"""The memory watchdog: samples real free memory; below its threshold it stops on-demand models.

Idle ones go first, least recently used first, then busy ones in the same order: besides an
administrator it is the only thing allowed to cut off a request that is being answered.
Always-on deployments and the decision model are never its victims.  It stops one model at a
time and samples again once that model is gone, until free memory is back above the threshold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import structlog

from actors.deployment import DeploymentActor, SleepDeployment
from actors.errors import ActorError
from actors.ports import MemorySource
from actors.runtime import Actor, Clock
from events.state import Lifecycle

log = structlog.get_logger("dgxmm.watchdog")


class Victim(msgspec.Struct, frozen=True):
    """A deployment the watchdog could stop."""

    deployment_id: str
    idle: bool
    last_used: float


def watchdog_order(victims: Iterable[Victim]) -> list[str]:
    """Idle first, then busy; least recently used first within each; pure."""
    ordered = sorted(victims, key=lambda v: (not v.idle, v.last_used, v.deployment_id))
    return [v.deployment_id for v in ordered]


class _Sample(msgspec.Struct, frozen=True, tag=True):
    pass


class WatchdogActor(Actor):
    """Samples every `every_s` seconds; acts below `threshold_bytes`."""

    def __init__(
        self,
        *,
        clock: Clock,
        source: MemorySource,
        actors: Callable[[], Iterable[DeploymentActor]],
        threshold_bytes: int,
        every_s: float = 5.0,
    ) -> None:
        super().__init__("watchdog", clock)
        self._source = source
        self._actors = actors
        self.threshold_bytes = threshold_bytes
        self.every_s = every_s
        self.stopped: list[str] = []
        self.last_free: int | None = None

    def start(self) -> None:
        """Start sampling."""
        super().start()
        self.schedule(self.every_s, _Sample())

    async def handle(self, message: Any) -> Any:
        """One sample."""
        if isinstance(message, _Sample):
            try:
                await self.sample()
            finally:
                self.schedule(self.every_s, _Sample())
            return None
        raise TypeError(f"unknown message {type(message).__name__}")

    async def sample(self) -> str | None:
        """Sample once; stop one victim if free memory is below the threshold."""
        try:
            free = await self._source.free_bytes()
        except (OSError, ActorError) as exc:
            log.error("memory_sample_failed", error=str(exc))
            return None
        self.last_free = free
        if free >= self.threshold_bytes:
            return None
        actors = list(self._actors())
        if any(a.state.lifecycle is Lifecycle.STOPPING for a in actors):
            return None  # memory is already being returned; sample again after it is gone
        candidates = {}
        now = self.clock.now()
        for actor in actors:
            dep = actor.state
            if not dep.on_demand or dep.role == "decision":
                continue
            if dep.lifecycle not in (Lifecycle.READY, Lifecycle.ASLEEP, Lifecycle.STARTING):
                continue
            cand = actor.idle_candidate()
            candidates[dep.deployment_id] = (
                actor,
                Victim(dep.deployment_id, cand is not None, actor.activity.last_used),
            )
        for dep_id in watchdog_order(v for _, v in candidates.values()):
            actor = candidates[dep_id][0]
            try:
                stopped = await actor.ask(
                    SleepDeployment(reason="watchdog", actor="watchdog", free_bytes=free)
                )
            except ActorError as exc:
                log.error("watchdog_stop_failed", deployment=dep_id, error=str(exc))
                continue
            if stopped:
                log.warning("watchdog_stopped", deployment=dep_id, free_bytes=free, now=now)
                self.stopped.append(dep_id)
                return dep_id
        log.warning("watchdog_nothing_to_stop", free_bytes=free)
        return None
