"""Routes for operators: engine logs, start progress, the queue, and `/healthz`.

Kept out of `api.py` (which routes to these handlers): each handler gets what it needs and
answers with `(status, data)` or streams itself; refusals are `actors.deployment.Refusal`,
which the API turns into its usual error body.

- `GET .../deployments/{id}/logs?tail=N[&follow=1]`: the engine's last lines as JSON, or
  with `follow=1` an SSE stream (`event: line`, one JSON string per line) that goes on
  across engine restarts.  Viewers may read; `engines.extra_env` values are redacted.
- `GET .../deployments/{id}/progress`: while a deployment starts, how long it has been
  starting, how long its last successful cold start took, its phases so far (launch, the
  engine's loading milestones), its expected start time (an estimate) and its engine's last
  log line.
- `GET .../queue`: every waiting request with its model, age, deadline, position and
  what it waits for, in words.
- `GET /healthz` (no login): 200 when the event log is writable and both listeners serve,
  else 503 with the reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from actors.controller import Controller
from actors.deployment import DeploymentActor, Refusal
from actors.errors import RuntimeFailure
from actors.memory_broker import gib
from actors.runtime import Clock
from dgxmm.admin.histograms import last_cold_start
from dgxmm.engines.logs import EngineLogs
from events import model as m
from events.cold_start import last_mark, marks_of, start_phases
from events.state import Lifecycle
from gateway.server import HTTPServer, Request, Responder
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.admin.ops")
_encoder = msgspec.json.Encoder()

LOG_TAIL_DEFAULT = 200
LOG_TAIL_MAX = 10_000
LOG_HEARTBEAT_S = 15.0
LOG_QUEUE_LINES = 1024
MAX_LOG_STREAMS = 32
MIN_FREE_DISK_BYTES = 16 * 1024 * 1024
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-store"),
    (b"x-accel-buffering", b"no"),
]


# --- what the routes answer (`dgxmm.admin.openapi` documents these types) ------------------


class LogTail(msgspec.Struct, kw_only=True):
    """`GET /deployments/{id}/logs` without `follow`: the engine's last lines."""

    deployment_id: str
    name: str
    lines: list[str]


class StartPhase(msgspec.Struct, kw_only=True):
    """One phase of a start (launch, the engine's loading milestones)."""

    name: str
    seconds: float
    detail: str


class Progress(msgspec.Struct, kw_only=True):
    """`GET /deployments/{id}/progress`: how a start goes (times in epoch seconds)."""

    deployment_id: str
    state: str
    starting: bool
    started_at: float | None
    elapsed_s: float | None
    last_cold_start_s: float | None
    phases: list[StartPhase]
    in_phase_s: float | None
    expected_start_s: float | None
    last_log_line: str | None
    last_error: str | None
    not_started: str | None


class QueuedRequest(msgspec.Struct, kw_only=True):
    """One waiting request: `kind` queued (for memory) or waiting_start; `reason` in words."""

    request_id: str
    deployment_id: str
    deployment: str
    model: str
    kind: str
    position: int
    arrived_at: float
    age_s: float
    deadline_at: float
    deadline_in_s: float
    idle_timeout_s: int
    expected_start_s: float | None
    reason: str
    waiting_for: list[str]


class MemoryBytes(msgspec.Struct, kw_only=True):
    """The memory budget in bytes."""

    total_bytes: int
    usable_bytes: int
    always_on_bytes: int
    on_demand_bytes: int
    free_bytes: int


class Queue(msgspec.Struct, kw_only=True):
    """`GET /queue`: every waiting request, oldest first."""

    requests: list[QueuedRequest]
    count: int
    memory: MemoryBytes


def human_duration(seconds: float) -> str:
    """`45 s`, `3 min`, `2 h`, `4 d` (pure)."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


@dataclass(frozen=True)
class Holder:
    """An on-demand deployment that holds memory and cannot be put to sleep now."""

    name: str
    in_flight: int
    starting: bool
    idle_for_s: float  # since its last request ended, or since it became ready
    used: bool = True  # False: no request has used it since it became ready


def wait_reason(
    *,
    kind: str,
    need: int,
    free: int,
    candidates: list[str],
    holders: list[Holder],
    ahead: int,
) -> str:
    """What a waiting request waits for, in one line (pure)."""
    if kind == "waiting_start":
        return "its model is starting"
    parts = [f"needs {gib(need)} GiB", f"{gib(max(0, free))} GiB free"]
    parts.append("idle candidates: " + (", ".join(candidates) if candidates else "none"))
    if holders:
        said = []
        for h in holders[:3]:
            if h.starting:
                said.append(f"{h.name} (starting)")
            elif h.in_flight:
                said.append(f"{h.name} ({h.in_flight} in flight)")
            elif not h.used:
                said.append(f"{h.name} (ready {human_duration(h.idle_for_s)}, never used)")
            else:
                said.append(f"{h.name} (used {human_duration(h.idle_for_s)} ago)")
        more = f" and {len(holders) - 3} more" if len(holders) > 3 else ""
        parts.append("waiting for " + ", ".join(said) + more)
    if ahead:
        parts.append(f"behind {ahead} earlier request{'s' if ahead != 1 else ''}")
    return "; ".join(parts)


def health_problems(
    db_path: Path, *, storage_closed: bool, listeners: dict[str, bool]
) -> list[str]:
    """Why DGXMM is not healthy (empty: healthy).  Reads file metadata only."""
    problems: list[str] = []
    if storage_closed:
        problems.append("the event log is closed")
    try:
        st = db_path.stat()
    except OSError as exc:
        problems.append(f"the event log {db_path} cannot be read: {exc.strerror}")
    else:
        # Mode bits, not access(): root passes access() for a file made read-only on purpose.
        if not st.st_mode & 0o222 or not os.access(db_path, os.W_OK):
            problems.append(f"the event log {db_path} is not writable")
        if not os.access(db_path.parent, os.W_OK | os.X_OK):
            problems.append(f"the event log's directory {db_path.parent} is not writable")
        with contextlib.suppress(OSError):
            if shutil.disk_usage(db_path.parent).free < MIN_FREE_DISK_BYTES:
                problems.append(f"the disk holding {db_path} is full")
    for name, serving in listeners.items():
        if not serving:
            problems.append(f"the {name} listener is not serving")
    return problems


async def _listening(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to host:port is accepted."""
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class OpsApi:
    """The operators' handlers."""

    def __init__(
        self,
        controller: Controller,
        store: EventStore,
        clock: Clock,
        logs: EngineLogs | None,
        *,
        gateway_address: Callable[[], tuple[str, int] | None] = lambda: None,
        admin_server: Callable[[], HTTPServer | None] = lambda: None,
    ) -> None:
        self.controller = controller
        self.store = store
        self.clock = clock
        self.logs = logs
        self.gateway_address = gateway_address
        self.admin_server = admin_server
        self.log_streams = 0
        self._closing = asyncio.Event()  # set: every log stream ends (the server stops)

    def close(self) -> None:
        """End the log streams (before the server shuts down)."""
        self._closing.set()

    # --- engine logs ---------------------------------------------------------------------

    def _logs(self) -> EngineLogs:
        if self.logs is None:
            raise Refusal(404, "logs_unavailable", "this DGXMM has no engine runtime to read")
        return self.logs

    async def log_tail(self, actor: DeploymentActor, tail: int) -> LogTail:
        """The engine's last `tail` lines."""
        lines = await self._logs().tail(actor.deployment_id, tail)
        return LogTail(deployment_id=actor.deployment_id, name=actor.state.name, lines=lines)

    async def log_follow(
        self, actor: DeploymentActor, tail: int, request: Request, responder: Responder
    ) -> None:
        """Stream the log as SSE until the client leaves or the server stops."""
        logs = self._logs()
        if self.log_streams >= MAX_LOG_STREAMS:
            raise Refusal(503, "too_many_streams", "too many log streams are open")
        self.log_streams += 1
        # A task reads the log into a bounded queue (a slow client slows the reading, never
        # grows a buffer); this coroutine writes, with a heartbeat while nothing comes.
        lines: asyncio.Queue[str | None] = asyncio.Queue(maxsize=LOG_QUEUE_LINES)

        async def pump() -> None:
            try:
                async for line in logs.follow(actor.deployment_id, tail):
                    await lines.put(line)
            except RuntimeFailure as exc:  # policy: the stream ends; the client reconnects
                log.warning(
                    "engine_log_follow_failed", deployment=actor.deployment_id, error=str(exc)
                )
            finally:
                with contextlib.suppress(asyncio.QueueFull):
                    lines.put_nowait(None)

        reader = asyncio.ensure_future(pump())
        gone = asyncio.ensure_future(_first(request.client_gone.wait(), self._closing.wait()))
        try:
            await responder.start(200, list(SSE_HEADERS))
            await responder.send(b"retry: 2000\n\n")
            while True:
                get = asyncio.ensure_future(lines.get())
                done, _ = await asyncio.wait(
                    (get, gone), timeout=LOG_HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED
                )
                if get not in done:
                    get.cancel()
                    if gone in done:
                        if self._closing.is_set():
                            await responder.end()
                        return
                    await responder.send(b": heartbeat\n\n")
                    continue
                batch = [get.result()]
                while not lines.empty() and len(batch) < 256:
                    batch.append(lines.get_nowait())
                ended = None in batch
                out = b"".join(
                    b"event: line\ndata: " + _encoder.encode(line) + b"\n\n"
                    for line in batch
                    if line is not None
                )
                if out:
                    await responder.send(out)
                if ended:
                    await responder.end()
                    return
        finally:
            self.log_streams -= 1
            gone.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    # --- start progress ------------------------------------------------------------------

    async def progress(self, actor: DeploymentActor) -> Progress:
        """How a start goes: elapsed against the last successful cold start, last log line."""
        dep = actor.state
        records = await self.store.read(stream=m.deployment_stream(dep.deployment_id))
        started_at = None
        for rec in reversed(records):
            if isinstance(rec.event, m.StartRequested):
                started_at = rec.ts
                break
        starting = dep.lifecycle is Lifecycle.STARTING
        now = self.clock.wall()
        last_line = None
        if starting and self.logs is not None:
            last_line = await self.logs.last_line(dep.deployment_id)
        record = self.controller.record(actor)
        marks = marks_of(records)
        phases = [StartPhase(name=p.name, seconds=round(p.seconds, 3), detail=p.detail)
                  for p in start_phases(marks)]  # fmt: skip
        in_phase = None
        if starting and marks.requested_at is not None:
            in_phase = round(max(0.0, now - last_mark(marks)), 1)
        return Progress(
            deployment_id=dep.deployment_id,
            state=dep.lifecycle.value,
            starting=starting,
            started_at=started_at if starting else None,
            elapsed_s=round(now - started_at, 1) if starting and started_at else None,
            last_cold_start_s=_round(last_cold_start(records)),
            # The start's phases so far (the last start's, once ready), and how long the one
            # under way has run; the expected start time is an estimate from its history.
            phases=phases,
            in_phase_s=in_phase,
            expected_start_s=record.expected_start_s,
            last_log_line=last_line,
            last_error=dep.last_error,
            not_started=record.not_started,
        )

    # --- the queue -----------------------------------------------------------------------

    def queue(self) -> Queue:
        """Every waiting request, oldest first, with what it waits for."""
        controller = self.controller
        broker = controller.broker
        now, wall = self.clock.now(), self.clock.wall()
        default_idle = int(controller.setting("ondemand_idle_timeout_s"))
        names = {d: a.state.name for d, a in controller.actors.items()}
        waiting = controller.queue.waiting()
        rows = []
        queued_ahead = 0
        counted: set[str] = set()
        for position, w in enumerate(waiting, start=1):
            actor = controller.actors.get(w.deployment_id)
            if actor is None:
                continue
            dep = actor.state
            candidates = [names.get(c.deployment_id, c.deployment_id)
                          for c in controller.candidates(dep.deployment_id)]  # fmt: skip
            candidate_ids = {c.deployment_id for c in controller.candidates(dep.deployment_id)}
            holders = []
            for other_id, other in controller.actors.items():
                o = other.state
                if (other_id == dep.deployment_id or other_id in candidate_ids
                        or not broker.holds(other_id) or not o.on_demand):  # fmt: skip
                    continue
                holders.append(
                    Holder(
                        name=o.name,
                        in_flight=other.activity.in_flight,
                        starting=o.lifecycle is Lifecycle.STARTING,
                        idle_for_s=now - other.activity.last_used,
                        used=other.activity.served > 0,
                    )
                )
            # The one that will be idle soonest is named first.
            holders.sort(key=lambda h: (h.starting, h.in_flight > 0, -h.idle_for_s))
            reason = wait_reason(
                kind=w.kind,
                need=dep.memory_bytes,
                free=broker.free(),
                candidates=candidates,
                holders=holders,
                ahead=queued_ahead,
            )
            if w.kind == "queued" and w.deployment_id not in counted:
                counted.add(w.deployment_id)
                queued_ahead += 1
            rows.append(
                QueuedRequest(
                    request_id=w.request_id,
                    deployment_id=dep.deployment_id,
                    deployment=dep.name,
                    model=dep.model,
                    kind=w.kind,
                    position=position,
                    arrived_at=round(wall - (now - w.arrived), 3),
                    age_s=round(now - w.arrived, 1),
                    deadline_at=round(wall + (w.deadline - now), 3),
                    deadline_in_s=round(max(0.0, w.deadline - now), 1),
                    idle_timeout_s=dep.effective_idle_timeout_s(default_idle),
                    expected_start_s=controller.start_history.expected_s(dep.deployment_id),
                    reason=reason,
                    waiting_for=[h.name for h in holders] if w.kind == "queued" else [],
                )
            )
        memory = msgspec.convert(broker.snapshot(), MemoryBytes)
        return Queue(requests=rows, count=len(rows), memory=memory)

    # --- health --------------------------------------------------------------------------

    async def health(self) -> tuple[int, dict[str, Any]]:
        """`GET /healthz`: 200 or 503 with the reasons."""
        listeners: dict[str, bool] = {}
        address = self.gateway_address()
        listeners["gateway"] = address is not None and await _listening(*address)
        admin = self.admin_server()
        listeners["admin"] = admin is not None and not admin.closing
        problems = await asyncio.to_thread(
            health_problems,
            Path(self.store.path),
            storage_closed=_store_closed(self.store),
            listeners=listeners,
        )
        if problems:
            return 503, {"status": "unavailable", "reasons": problems}
        return 200, {"status": "ok"}


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Return when the first of `waits` is done; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def _store_closed(store: EventStore) -> bool:
    """Whether the store stopped writing (closed, or its writer task ended)."""
    writer = getattr(store, "_writer", None)
    return bool(getattr(store, "_closed", False)) or writer is None or writer.done()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
