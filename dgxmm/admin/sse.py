"""Server-Sent Events for the web UI: deployment records, queue counts and memory, live.

The controller calls `EventHub.changed` on every change.  Pushes are coalesced per key (one
deployment, the memory, the queue): at most one per `min_interval_s`, and a change inside
the window schedules one trailing push at its end that carries the state of that moment,
so the latest state always arrives and a burst of changes costs one message.  Each client
has a bounded buffer; a client that cannot keep up is dropped (its EventSource reconnects
and starts again from a fresh snapshot) instead of being buffered without bound.

Each event's data is one type (`EVENTS`), sent under its name only (`ui_event`); the OpenAPI
document describes the stream from that table.  A deployment, the settings and the memory
budget are the types the API's routes answer with too.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from actors.controller import Controller, DeploymentRecord
from actors.memory_broker import GIB
from actors.runtime import Clock, TimerHandle
from dgxmm.admin.guards import redact_record
from gateway.server import Request, Responder

_encoder = msgspec.json.Encoder()

HEARTBEAT = b": heartbeat\n\n"


def sse_message(
    event: str, data: Any, *, encode: Callable[[Any], bytes] = _encoder.encode
) -> bytes:
    """One SSE message: `event: <event>` and one `data:` line of JSON."""
    return b"event: " + event.encode() + b"\ndata: " + encode(data) + b"\n\n"


def record_json(record: Any) -> dict[str, Any]:
    """A deployment record as the API shows it (plus its memory in GiB)."""
    data: dict[str, Any] = msgspec.structs.asdict(record)
    data["memory_gib"] = round(record.memory_bytes / GIB, 3)
    return data


def memory_json(snapshot: dict[str, int]) -> dict[str, Any]:
    """The memory budget in bytes and GiB."""
    out: dict[str, Any] = dict(snapshot)
    for key, value in snapshot.items():
        if key.endswith("_bytes"):
            out[key[: -len("_bytes")] + "_gib"] = round(value / GIB, 3)
    return out


# --- what the stream sends: one type per event (`EVENTS`; dgxmm.admin.openapi documents it) ---


class Deployment(DeploymentRecord, frozen=True, kw_only=True):
    """A deployment as the API shows it (`args` with secrets redacted for viewers)."""

    memory_gib: float | None = None


class Gone(msgspec.Struct, kw_only=True):
    """A deployment that was removed."""

    id: str


class MemoryBudget(msgspec.Struct, kw_only=True):
    """The memory budget in bytes and GiB."""

    total_bytes: int
    usable_bytes: int
    always_on_bytes: int
    on_demand_bytes: int
    free_bytes: int
    total_gib: float
    usable_gib: float
    always_on_gib: float
    on_demand_gib: float
    free_gib: float


class QueueCounts(msgspec.Struct, kw_only=True):
    """Requests waiting now, the cap, and the queue's counters since start."""

    waiting: int
    max_queued: int
    counters: dict[str, int]


def _litellm(key: str) -> Any:
    return msgspec.field(default=msgspec.UNSET, name=f"litellm.{key}")


class Settings(msgspec.Struct, kw_only=True):
    """The settings in force (`ondemand_make_room_after_s` null: the full idle timeout).
    The LiteLLM integration's settings (`PATCH /litellm`) share their record, so they
    come too once changed."""

    ondemand_idle_timeout_s: int
    ondemand_queue_timeout_s: int
    ondemand_max_queued: int
    ondemand_make_room_after_s: int | None
    ondemand_policy: Literal["seed", "learned"] = "seed"  # the default of on-demand models
    litellm_enabled: bool | msgspec.UnsetType = _litellm("enabled")
    litellm_url: str | msgspec.UnsetType = _litellm("url")
    litellm_backend: str | msgspec.UnsetType = _litellm("backend")
    litellm_config_path: str | msgspec.UnsetType = _litellm("config_path")
    litellm_master_key_env: str | msgspec.UnsetType = _litellm("master_key_env")


class Snapshot(msgspec.Struct, kw_only=True):
    """The first event of the UI's stream: the whole picture (later events update a part)."""

    deployments: list[Deployment]
    memory: MemoryBudget
    queue: QueueCounts
    settings: Settings


# The stream's events by name: the hub sends each type under its name only (`ui_event`).
EVENTS: dict[str, type[msgspec.Struct]] = {
    "snapshot": Snapshot,
    "deployment": Deployment,
    "removed": Gone,
    "memory": MemoryBudget,
    "queue": QueueCounts,
    "settings": Settings,
}
_NAMES = {kind: name for name, kind in EVENTS.items()}


def ui_event(data: msgspec.Struct) -> bytes:
    """One message of the UI's stream, named for its type."""
    return sse_message(_NAMES[type(data)], data)


def deployment(record: DeploymentRecord, reveal: bool = True) -> Deployment:
    """A record as the API answers it: secrets in args only when `reveal`."""
    data = record_json(record)
    return msgspec.convert(data if reveal else redact_record(data), Deployment)


@dataclass(frozen=True)
class HubConfig:
    """Limits of the event stream."""

    min_interval_s: float = 1.0  # at most one push per key per interval
    heartbeat_s: float = 15.0
    max_buffered_messages: int = 256  # per client; beyond it the client is dropped
    max_buffered_bytes: int = 4 * 1024 * 1024
    max_clients: int = 64
    retry_ms: int = 3000  # what EventSource waits before reconnecting


@dataclass(eq=False)
class _Client:
    session: str | None
    reveal: bool = True  # admins see engine args as they are; viewers redacted
    buffer: collections.deque[bytes] = field(default_factory=collections.deque)
    buffered_bytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    dropped: bool = False


@dataclass
class _Slot:
    last: float | None = None  # when the key was last pushed (clock time)
    timer: TimerHandle | None = None  # the trailing push, when one is due


class TooManyStreams(Exception):
    """Every stream slot is taken."""


class EventHub:
    """Fans coalesced changes out to every connected UI."""

    def __init__(self, controller: Controller, clock: Clock, config: HubConfig | None = None):
        self.controller = controller
        self.clock = clock
        self.config = config or HubConfig()
        self._clients: set[_Client] = set()
        self._slots: dict[str, _Slot] = {}
        self._heartbeat: TimerHandle | None = None
        self._closed = False
        self.stats = {"pushes": 0, "coalesced": 0, "dropped_clients": 0, "streams_total": 0}
        self.pushes_by_key: collections.Counter[str] = collections.Counter()
        controller.add_listener(self._on_change)

    # --- changes -------------------------------------------------------------------------

    def _on_change(self, deployment_id: str, what: str) -> None:
        if deployment_id == "settings":
            self.changed("settings")
            for dep_id in list(self.controller.actors):
                self.changed(f"deployment:{dep_id}")  # the effective idle timeout may follow
            return
        self.changed(f"deployment:{deployment_id}")
        self.changed("queue")
        self.changed("memory")

    def changed(self, key: str) -> None:
        """Something under `key` changed: push now, or once at the end of the window."""
        if not self._clients or self._closed:
            return
        slot = self._slots.setdefault(key, _Slot())
        if slot.timer is not None:
            self.stats["coalesced"] += 1
            return  # the trailing push will carry this change too
        now = self.clock.now()
        interval = self.config.min_interval_s
        if slot.last is None or now - slot.last >= interval:
            self._push(key, slot)
            return
        self.stats["coalesced"] += 1
        slot.timer = self.clock.call_later(slot.last + interval - now, lambda: self._fire(key))

    def _fire(self, key: str) -> None:
        slot = self._slots.get(key)
        if slot is None or slot.timer is None:
            return
        slot.timer = None
        if self._clients and not self._closed:
            self._push(key, slot)

    def _push(self, key: str, slot: _Slot) -> None:
        slot.last = self.clock.now()
        message = self._message(key)
        if message is None:
            return
        self.stats["pushes"] += 1
        self.pushes_by_key[key] += 1
        redacted = message
        if key.startswith("deployment:") and any(not c.reveal for c in self._clients):
            redacted = self._message(key, reveal=False) or message
        self._broadcast(message, redacted)

    def _message(self, key: str, *, reveal: bool = True) -> bytes | None:
        c = self.controller
        if key.startswith("deployment:"):
            dep_id = key.partition(":")[2]
            actor = c.actors.get(dep_id)
            if actor is None:
                slot = self._slots.pop(key, None)
                if slot is not None and slot.timer is not None:
                    slot.timer.cancel()
                return ui_event(Gone(id=dep_id))
            return ui_event(deployment(c.record(actor), reveal))
        if key == "memory":
            return ui_event(self.memory())
        if key == "queue":
            return ui_event(self.queue_counts())
        if key == "settings":
            return ui_event(self.settings())
        return None

    def memory(self) -> MemoryBudget:
        """The memory budget now."""
        return msgspec.convert(memory_json(self.controller.memory()), MemoryBudget)

    def settings(self) -> Settings:
        """The settings in force."""
        return msgspec.convert(self.controller.settings(), Settings)

    def queue_counts(self) -> QueueCounts:
        """Requests waiting now, the cap, and the queue's counters."""
        c = self.controller
        return QueueCounts(
            waiting=len(c.queue),
            max_queued=int(c.setting("ondemand_max_queued")),
            counters=c.queue.queue_statistics(),
        )

    def snapshot(self, *, reveal: bool = True) -> bytes:
        """The first message of every stream: the whole picture."""
        return ui_event(
            Snapshot(
                deployments=[deployment(r, reveal) for r in self.controller.records()],
                memory=self.memory(),
                queue=self.queue_counts(),
                settings=self.settings(),
            )
        )

    # --- clients -------------------------------------------------------------------------

    def _broadcast(self, message: bytes, redacted: bytes | None = None) -> None:
        cfg = self.config
        for client in list(self._clients):
            sent = message if client.reveal or redacted is None else redacted
            if (
                len(client.buffer) >= cfg.max_buffered_messages
                or client.buffered_bytes + len(sent) > cfg.max_buffered_bytes
            ):
                self._drop(client)
                continue
            client.buffer.append(sent)
            client.buffered_bytes += len(sent)
            client.wake.set()

    def _drop(self, client: _Client) -> None:
        self.stats["dropped_clients"] += 1
        client.dropped = client.closed = True
        client.buffer.clear()
        client.buffered_bytes = 0
        client.wake.set()
        self._clients.discard(client)

    def _beat(self) -> None:
        self._heartbeat = None
        if self._closed or not self._clients:
            return
        self._broadcast(HEARTBEAT)
        self._heartbeat = self.clock.call_later(self.config.heartbeat_s, self._beat)

    def drop_session(self, session: str) -> None:
        """End the streams opened with a session (it logged out)."""
        for client in list(self._clients):
            if client.session == session:
                client.closed = True
                client.wake.set()
                self._clients.discard(client)

    @property
    def client_count(self) -> int:
        """Streams open now."""
        return len(self._clients)

    async def stream(
        self, request: Request, responder: Responder, session: str | None, *, reveal: bool = True
    ) -> None:
        """Serve one `GET .../events/stream` until the client leaves or is dropped."""
        if self._closed or len(self._clients) >= self.config.max_clients:
            raise TooManyStreams()
        client = _Client(session=session, reveal=reveal)
        self._clients.add(client)
        self.stats["streams_total"] += 1
        if self._heartbeat is None:
            self._heartbeat = self.clock.call_later(self.config.heartbeat_s, self._beat)
        try:
            await responder.start(
                200,
                [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache, no-store"),
                    (b"x-accel-buffering", b"no"),
                ],
            )
            first = self.snapshot(reveal=reveal)
            await responder.send(b"retry: %d\n\n" % self.config.retry_ms + first)
            while True:
                await client.wake.wait()
                client.wake.clear()
                if client.closed:
                    break
                if client.buffer:
                    out = b"".join(client.buffer)
                    client.buffer.clear()
                    client.buffered_bytes = 0
                    await responder.send(out)
            await responder.end()
        finally:
            self._clients.discard(client)
            if not self._clients and self._heartbeat is not None:
                self._heartbeat.cancel()
                self._heartbeat = None

    def close(self) -> None:
        """End every stream (before the server shuts down) and cancel the timers."""
        self._closed = True
        for client in list(self._clients):
            client.closed = True
            client.wake.set()
        self._clients.clear()
        for slot in self._slots.values():
            if slot.timer is not None:
                slot.timer.cancel()
                slot.timer = None
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
