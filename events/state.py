"""Pure projection: fold events into the whole system state.

`evolve(state, recorded) -> state` is the one function that applies events; it runs when
an actor records an event, when DGXMM folds the log at start-up, and in `dgxmm replay`.
States are frozen; evolve returns a new one and never mutates its input.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
from msgspec.structs import replace

from events import model as m


class Lifecycle(enum.Enum):
    """A deployment's lifecycle state."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"
    ASLEEP = "asleep"  # vLLM sleep mode, put there by hand


class IllegalTransition(Exception):
    """An event does not apply to the deployment's current lifecycle state."""


# Which events may happen in which state, and where they lead.  `None` means "unchanged".
_TRANSITIONS: dict[type[m.Event], dict[Lifecycle, Lifecycle | None]] = {
    m.StartRequested: {
        Lifecycle.STOPPED: Lifecycle.STARTING,
        Lifecycle.FAILED: Lifecycle.STARTING,
        Lifecycle.ASLEEP: None,
        Lifecycle.READY: None,
        Lifecycle.STARTING: None,
    },
    m.EngineStarting: {
        Lifecycle.STOPPED: Lifecycle.STARTING,
        Lifecycle.FAILED: Lifecycle.STARTING,
        Lifecycle.STARTING: Lifecycle.STARTING,
    },
    m.EngineReady: {Lifecycle.STARTING: Lifecycle.READY, Lifecycle.ASLEEP: Lifecycle.READY},
    m.EngineStartFailed: {
        Lifecycle.STARTING: Lifecycle.FAILED,
        Lifecycle.STOPPED: Lifecycle.FAILED,
        Lifecycle.FAILED: Lifecycle.FAILED,
        Lifecycle.STOPPING: Lifecycle.FAILED,
    },
    m.StopRequested: {
        Lifecycle.STARTING: Lifecycle.STOPPING,
        Lifecycle.READY: Lifecycle.STOPPING,
        Lifecycle.ASLEEP: Lifecycle.STOPPING,
        Lifecycle.FAILED: Lifecycle.STOPPING,
        Lifecycle.STOPPED: Lifecycle.STOPPING,
        Lifecycle.STOPPING: Lifecycle.STOPPING,
    },
    m.PutToSleep: {
        Lifecycle.READY: Lifecycle.STOPPING,
        Lifecycle.ASLEEP: Lifecycle.STOPPING,
        Lifecycle.STARTING: Lifecycle.STOPPING,  # only the watchdog
    },
    m.EngineStopped: {
        Lifecycle.STOPPING: Lifecycle.STOPPED,
        Lifecycle.STARTING: Lifecycle.STOPPED,
        Lifecycle.READY: Lifecycle.STOPPED,
        Lifecycle.ASLEEP: Lifecycle.STOPPED,
        Lifecycle.FAILED: Lifecycle.FAILED,
        Lifecycle.STOPPED: Lifecycle.STOPPED,
    },
    m.EngineLost: {
        Lifecycle.STARTING: Lifecycle.STOPPED,
        Lifecycle.READY: Lifecycle.STOPPED,
        Lifecycle.ASLEEP: Lifecycle.STOPPED,
        Lifecycle.STOPPING: Lifecycle.STOPPED,
    },
    m.EngineAsleep: {Lifecycle.READY: Lifecycle.ASLEEP},
    m.EngineAwake: {Lifecycle.ASLEEP: Lifecycle.READY},
    m.EngineAdopted: {
        Lifecycle.STOPPED: Lifecycle.READY,
        Lifecycle.STARTING: Lifecycle.READY,
        Lifecycle.READY: Lifecycle.READY,
        Lifecycle.STOPPING: Lifecycle.READY,
        Lifecycle.FAILED: Lifecycle.READY,
        Lifecycle.ASLEEP: Lifecycle.READY,
    },
}


def next_lifecycle(current: Lifecycle, event: m.Event) -> Lifecycle:
    """Where `event` leads from `current`; raises IllegalTransition if it cannot happen."""
    table = _TRANSITIONS.get(type(event))
    if table is None:
        return current
    if current not in table:
        raise IllegalTransition(f"{type(event).__name__} cannot happen while {current.value}")
    target = table[current]
    return current if target is None else target


def can_happen(current: Lifecycle, event: m.Event) -> bool:
    """Whether `event` is legal from `current`."""
    table = _TRANSITIONS.get(type(event))
    return table is None or current in table


class DeploymentState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the log says about one deployment."""

    deployment_id: str
    name: str
    engine: str
    model: str
    memory_bytes: int
    mode: m.Mode
    idle_timeout_s: int | None  # None: follows the DGXMM default
    role: m.Role
    args: list[str]
    image: str | None
    gpu: bool
    created_at: float
    lifecycle: Lifecycle = Lifecycle.STOPPED
    pending_mode: m.Mode | None = None
    failures: int = 0
    retry_at: float | None = None
    last_error: str | None = None
    runtime_id: str | None = None
    host: str | None = None
    port: int | None = None
    start_reason: m.StartReason | None = None  # why the current/last start was asked for
    stop_reason: str | None = None
    changed_at: float = 0.0  # time of the last lifecycle change
    version: int = 0
    make_room_after_s: int | None = None  # None: follows the DGXMM default
    ondemand_policy: m.Policy | None = None  # None: follows the DGXMM default

    @property
    def on_demand(self) -> bool:
        """Whether the deployment is on demand."""
        return self.mode == "on_demand"

    def effective_idle_timeout_s(self, default_s: int) -> int:
        """The idle timeout in force, following the default when unset."""
        return default_s if self.idle_timeout_s is None else self.idle_timeout_s

    def effective_make_room_after_s(self, default_idle_s: int, default_s: int | None) -> int:
        """How long without a request before it may sleep to make room for the queue's head.

        Unset here and in the DGXMM default: the seed's rule, its full idle timeout.  Never
        longer than the idle timeout: a model idle by the seed's rule is always a candidate.
        """
        idle = self.effective_idle_timeout_s(default_idle_s)
        after = default_s if self.make_room_after_s is None else self.make_room_after_s
        return idle if after is None else min(after, idle)


class QueueEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A request waiting, as the log records it (for replay; the live queue is in memory)."""

    request_id: str
    deployment_id: str
    kind: m.WaitKind
    arrived_at: float
    position: int


class TokenInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the UI and `dgxmm token list` show of an API token (never its secret)."""

    label: str = ""
    created_at: float = 0.0
    expires_at: float | None = None
    role: str | None = None  # "metrics": reads /metrics only; None: the owner's role
    last_used_at: float | None = None


class UserRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A user account."""

    name: str
    role: str
    password_hash: str
    tokens: dict[str, str] = {}  # token id -> SHA-256 hash of its secret
    token_info: dict[str, TokenInfo] = {}  # token id -> name, expiry, role, last use
    created_at: float = 0.0


class LiteLLMStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The last LiteLLM sync."""

    last_sync_at: float | None = None
    ok: bool | None = None
    error: str | None = None
    entries: int = 0


class SystemState(msgspec.Struct, frozen=True, kw_only=True):
    """The whole folded state."""

    deployments: dict[str, DeploymentState] = {}
    removed: dict[str, DeploymentState] = {}
    settings: dict[str, Any] = {}  # overrides of the configured defaults
    users: dict[str, UserRecord] = {}
    litellm: LiteLLMStatus = LiteLLMStatus()
    queue: dict[str, QueueEntry] = {}
    # Deployment id -> when its last request that reached it ended (epoch seconds), from the
    # traffic trace's batches: what `dgxmm ps` shows after a restart.
    last_used_at: dict[str, float] = {}
    last_seq: int = 0
    last_ts: float = 0.0


EMPTY = SystemState()


def _evolve_deployment(dep: DeploymentState, rec: m.Recorded) -> DeploymentState:
    ev = rec.event
    lifecycle = next_lifecycle(dep.lifecycle, ev) if type(ev) in _TRANSITIONS else dep.lifecycle
    changed = rec.ts if lifecycle is not dep.lifecycle else dep.changed_at
    dep = replace(dep, lifecycle=lifecycle, changed_at=changed, version=rec.version)
    match ev:
        case m.DeploymentReconfigured():
            return replace(
                dep,
                memory_bytes=dep.memory_bytes if ev.memory_bytes is None else ev.memory_bytes,
                args=dep.args if ev.args is None else ev.args,
                image=dep.image if ev.image is None else ev.image,
                gpu=dep.gpu if ev.gpu is None else ev.gpu,
                failures=0,
                retry_at=None,
            )
        case m.ModelSwitched():
            return replace(
                dep,
                model=ev.model,
                memory_bytes=dep.memory_bytes if ev.memory_bytes is None else ev.memory_bytes,
                args=dep.args if ev.args is None else ev.args,
                failures=0,
                retry_at=None,
            )
        case m.ModeChanged():
            dep = replace(
                dep, mode=ev.mode, idle_timeout_s=ev.idle_timeout_s, failures=0, retry_at=None
            )
            if not isinstance(ev.make_room_after_s, msgspec.UnsetType):
                dep = replace(dep, make_room_after_s=ev.make_room_after_s)
            if not isinstance(ev.ondemand_policy, msgspec.UnsetType):
                dep = replace(dep, ondemand_policy=ev.ondemand_policy)
            return dep
        case m.PendingModeSet():
            return replace(dep, pending_mode=ev.mode)
        case m.PendingModeCleared():
            return replace(dep, pending_mode=None)
        case m.StartRequested():
            return replace(dep, start_reason=ev.reason)
        case m.EngineStarting() | m.EngineAdopted():
            return replace(
                dep,
                runtime_id=ev.runtime_id,
                host=ev.host,
                port=ev.port,
                last_error=None,
                stop_reason=None,
            )
        case m.EngineReady():
            return replace(dep, failures=0, retry_at=None, last_error=None)
        case m.EngineStartFailed():
            return replace(
                dep,
                failures=ev.failures,
                retry_at=ev.retry_at,
                last_error=ev.reason,
                runtime_id=None,
                host=None,
                port=None,
            )
        case m.StopRequested():
            return replace(dep, stop_reason=ev.reason)
        case m.PutToSleep():
            return replace(dep, stop_reason=ev.reason)
        case m.EngineStopped():
            return replace(dep, runtime_id=None, host=None, port=None)
        case m.EngineLost():
            return replace(dep, runtime_id=None, host=None, port=None, last_error=ev.reason)
    return dep


def _created(rec: m.Recorded, ev: m.DeploymentCreated) -> DeploymentState:
    return DeploymentState(
        deployment_id=ev.deployment_id,
        name=ev.name,
        engine=ev.engine,
        model=ev.model,
        memory_bytes=ev.memory_bytes,
        mode=ev.mode,
        idle_timeout_s=ev.idle_timeout_s,
        make_room_after_s=ev.make_room_after_s,
        ondemand_policy=ev.ondemand_policy,
        role=ev.role,
        args=ev.args,
        image=ev.image,
        gpu=ev.gpu,
        created_at=rec.ts,
        changed_at=rec.ts,
        version=rec.version,
    )


def evolve(state: SystemState, rec: m.Recorded) -> SystemState:
    """Apply one recorded event to the state; pure."""
    ev = rec.event
    base = replace(state, last_seq=rec.seq, last_ts=rec.ts)
    match ev:
        case m.DeploymentCreated():
            deps = dict(state.deployments)
            deps[ev.deployment_id] = _created(rec, ev)
            return replace(base, deployments=deps)
        case m.DeploymentRemoved():
            dep_id = rec.stream.partition(":")[2]
            deps = dict(state.deployments)
            gone = deps.pop(dep_id, None)
            removed = state.removed
            if gone is not None:
                removed = {**state.removed, dep_id: replace(gone, version=rec.version)}
            used = state.last_used_at
            if dep_id in used:
                used = {k: v for k, v in used.items() if k != dep_id}
            return replace(base, deployments=deps, removed=removed, last_used_at=used)
        case m.TrafficRecorded():
            return replace(base, last_used_at=_used(state, ev.last_used_at))
        case m.RequestQueued():
            entry = QueueEntry(
                request_id=ev.request_id,
                deployment_id=ev.deployment_id,
                kind=ev.kind,
                arrived_at=ev.arrived_at,
                position=ev.position,
            )
            return replace(base, queue={**state.queue, ev.request_id: entry})
        case m.RequestLeftQueue():
            if ev.request_id not in state.queue:
                return base
            queue = dict(state.queue)
            del queue[ev.request_id]
            return replace(base, queue=queue)
        case m.RequestAdmitted():
            return base
        case m.SettingsChanged():
            return replace(base, settings={**state.settings, **ev.changes})
        case m.UserCreated():
            user = UserRecord(
                name=ev.name, role=ev.role, password_hash=ev.password_hash, created_at=rec.ts
            )
            return replace(base, users={**state.users, ev.name: user})
        case m.UserRemoved():
            users = dict(state.users)
            users.pop(ev.name, None)
            return replace(base, users=users)
        case m.ApiTokenCreated():
            owner = state.users.get(ev.name)
            if owner is None:
                return base
            info = TokenInfo(
                label=ev.label, created_at=rec.ts, expires_at=ev.expires_at, role=ev.role
            )
            owner = replace(
                owner,
                tokens={**owner.tokens, ev.token_id: ev.token_hash},
                token_info={**owner.token_info, ev.token_id: info},
            )
            return replace(base, users={**state.users, ev.name: owner})
        case m.ApiTokenRevoked() | m.ApiTokenUsed():
            return replace(base, users=_token_changed(state.users, ev))
        case m.UserRoleChanged():
            owner = state.users.get(ev.name)
            if owner is None:
                return base
            return replace(base, users={**state.users, ev.name: replace(owner, role=ev.role)})
        case m.PasswordChanged():
            owner = state.users.get(ev.name)
            if owner is None:
                return base
            owner = replace(owner, password_hash=ev.password_hash)
            return replace(base, users={**state.users, ev.name: owner})
        case m.UserLoggedIn() | m.LoginFailed():
            return base
        case m.LiteLLMSynced():
            status = LiteLLMStatus(
                last_sync_at=rec.ts, ok=ev.ok, error=ev.error, entries=ev.entries
            )
            return replace(base, litellm=status)
    if rec.stream.startswith("deployment:"):
        dep_id = rec.stream.partition(":")[2]
        dep = state.deployments.get(dep_id)
        if dep is None:
            return base
        return replace(
            base, deployments={**state.deployments, dep_id: _evolve_deployment(dep, rec)}
        )
    return base


def fold(records: Any, state: SystemState = EMPTY) -> SystemState:
    """Fold an iterable of records onto `state`."""
    for rec in records:
        state = evolve(state, rec)
    return state


def evolve_deployment(dep: DeploymentState, rec: m.Recorded) -> DeploymentState:
    """Apply one event of the deployment's own stream (used by the deployment actor)."""
    return _evolve_deployment(dep, rec)


def new_deployment(rec: m.Recorded) -> DeploymentState:
    """The state a DeploymentCreated record starts."""
    assert isinstance(rec.event, m.DeploymentCreated)
    return _created(rec, rec.event)


def _used(state: SystemState, batch: dict[str, float]) -> dict[str, float]:
    """The last uses after a traffic batch: the newer of the two for each deployment that
    still exists."""
    used = state.last_used_at
    newer = {
        dep_id: at
        for dep_id, at in batch.items()
        if dep_id in state.deployments and at > used.get(dep_id, float("-inf"))
    }
    return {**used, **newer} if newer else used


def _token_changed(
    users: dict[str, UserRecord], ev: m.ApiTokenRevoked | m.ApiTokenUsed
) -> dict[str, UserRecord]:
    """The users after a token was revoked or used (an unknown token changes nothing)."""
    owner = users.get(ev.name)
    if owner is None or ev.token_id not in owner.tokens:
        return users
    if isinstance(ev, m.ApiTokenRevoked):
        tokens = {k: v for k, v in owner.tokens.items() if k != ev.token_id}
        info = {k: v for k, v in owner.token_info.items() if k != ev.token_id}
        return {**users, ev.name: replace(owner, tokens=tokens, token_info=info)}
    old = owner.token_info.get(ev.token_id, TokenInfo())
    info = {**owner.token_info, ev.token_id: replace(old, last_used_at=ev.at)}
    return {**users, ev.name: replace(owner, token_info=info)}
