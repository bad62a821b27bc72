"""Every event DGXMM records, as frozen tagged msgspec Structs.

Events are facts in the past tense.  The schema only grows: a new field always gets a
default, so every log ever written still decodes.  The envelope (`Recorded`) carries what
the store adds: sequence number, time, stream, version and the actor that caused it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Mode = Literal["on_demand", "always_on"]
Role = Literal["model", "decision"]
# How an on-demand model is kept warm: the seed's rules alone, or its own traffic's too
# (`actors.anticipation`).
Policy = Literal["seed", "learned"]


class Event(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Base of every event; the tag is the class name."""


# --- deployments (stream "deployment:<id>") -------------------------------------------


class DeploymentCreated(Event, frozen=True, kw_only=True):
    """An administrator created a deployment."""

    deployment_id: str
    name: str
    engine: str
    model: str
    memory_bytes: int
    mode: Mode = "always_on"
    idle_timeout_s: int | None = None  # None: follows the DGXMM default
    role: Role = "model"
    args: list[str] = []
    image: str | None = None
    gpu: bool = False
    # How long without a request before it may sleep to make room; None: the DGXMM default.
    make_room_after_s: int | None = None
    ondemand_policy: Policy | None = None  # None: follows the DGXMM default


class DeploymentReconfigured(Event, frozen=True, kw_only=True):
    """The deployment's engine settings changed (takes effect on its next start)."""

    memory_bytes: int | None = None
    args: list[str] | None = None
    image: str | None = None
    gpu: bool | None = None


class ModelSwitched(Event, frozen=True, kw_only=True):
    """ "Switch model…": the deployment now serves another model; its mode is kept."""

    model: str
    memory_bytes: int | None = None
    args: list[str] | None = None


class DeploymentRemoved(Event, frozen=True, kw_only=True):
    """The deployment was removed."""


class ModeChanged(Event, frozen=True, kw_only=True):
    """The mode (and idle timeout: None means the DGXMM default) changed."""

    mode: Mode
    idle_timeout_s: int | None = None
    # UNSET (left out): kept; None: follows the DGXMM default.
    make_room_after_s: int | msgspec.UnsetType | None = msgspec.UNSET
    ondemand_policy: Policy | msgspec.UnsetType | None = msgspec.UNSET  # the same


class PendingModeSet(Event, frozen=True, kw_only=True):
    """A switch to `mode` waits for the deployment to become ready."""

    mode: Mode


class PendingModeCleared(Event, frozen=True, kw_only=True):
    """The pending switch was applied or abandoned."""

    applied: bool = True


StartReason = Literal["admin", "request", "always_on", "mode_switch", "restart", "prewarm"]


class StartRequested(Event, frozen=True, kw_only=True):
    """Somebody asked for the deployment to start (or wake)."""

    reason: StartReason
    request_id: str | None = None
    # A pre-warm's: when its next request is expected (epoch seconds) and why, in words.
    expected_at: float | None = None
    detail: str = ""


class EngineStarting(Event, frozen=True, kw_only=True):
    """The runtime launched the engine; it is loading."""

    runtime_id: str
    host: str
    port: int
    # When the runtime's launch call began (epoch seconds); None in logs written before
    # cold-start phases were recorded.  The launch phase runs from it to this event.
    launch_began_at: float | None = None


class EngineMilestoneReached(Event, frozen=True, kw_only=True):
    """The engine's log showed a loading milestone while it started (a few per start).

    `milestone` is one of `events.cold_start.MILESTONES`; `at` is when DGXMM read the line
    (epoch seconds); `took_s` the engine's own figure when its line gives one.
    """

    milestone: str
    at: float
    took_s: float | None = None


class EngineReady(Event, frozen=True, kw_only=True):
    """The engine answered its readiness probe."""


class EngineStartFailed(Event, frozen=True, kw_only=True):
    """The engine crashed or never became ready; no new start before `retry_at`."""

    reason: str
    failures: int
    retry_at: float | None = None  # epoch seconds


StopReason = Literal[
    "admin", "removed", "idle", "make_room", "watchdog", "mode_switch", "shutdown",
    "prewarm_abandoned",
]  # fmt: skip


class StopRequested(Event, frozen=True, kw_only=True):
    """An administrator (or DGXMM itself, reason given) asked for the engine to stop."""

    reason: StopReason = "admin"


SleepReason = Literal["idle", "make_room", "watchdog"]


class PutToSleep(Event, frozen=True, kw_only=True):
    """The on-demand controller (or the watchdog) stops the deployment to free its memory."""

    reason: SleepReason
    idle_timeout_s: int = 0  # the timeout that ran out (reason idle)
    for_deployment: str | None = None  # the deployment it made room for (reason make_room)
    for_name: str | None = None
    idle_for_s: float = 0.0
    free_bytes: int | None = None  # measured free memory (reason watchdog)
    # The learned policy's keep-warm that ran out in place of the idle timeout (reason
    # idle), and why it was that long; 0: the seed's idle timeout.
    kept_warm_s: int = 0
    kept_warm_reason: str = ""
    prewarm_unused: bool = False  # it had been pre-warmed and no request came


class EngineStopped(Event, frozen=True, kw_only=True):
    """The engine is gone and its memory is back in the budget."""


class EngineLost(Event, frozen=True, kw_only=True):
    """The engine vanished behind DGXMM's back (crash, killed, not found at restart)."""

    reason: str


class EngineAsleep(Event, frozen=True, kw_only=True):
    """vLLM reports it was put into sleep mode (by hand)."""


class EngineAwake(Event, frozen=True, kw_only=True):
    """vLLM reports it left sleep mode."""


class EngineAdopted(Event, frozen=True, kw_only=True):
    """At start-up DGXMM found the engine still running and adopted it."""

    runtime_id: str
    host: str
    port: int


# --- the queue (stream "queue") --------------------------------------------------------

WaitKind = Literal["queued", "waiting_start"]


class RequestQueued(Event, frozen=True, kw_only=True):
    """A request started waiting: for memory ("queued") or for a start ("waiting_start")."""

    request_id: str
    deployment_id: str
    kind: WaitKind
    position: int  # 1-based place among all waiting requests
    arrived_at: float  # epoch seconds
    free_bytes: int = 0
    needed_bytes: int = 0


class RequestAdmitted(Event, frozen=True, kw_only=True):
    """The request's model got its memory (its start began, or it joined one)."""

    request_id: str
    deployment_id: str
    jumped_ahead: bool = False  # went ahead of the head under the go-ahead rule


LeaveReason = Literal[
    "served", "client_gone", "timeout", "stopped", "start_failed", "does_not_fit", "removed"
]


class RequestLeftQueue(Event, frozen=True, kw_only=True):
    """The request stopped waiting."""

    request_id: str
    deployment_id: str
    reason: LeaveReason
    waited_s: float = 0.0


class FirstByteRelayed(Event, frozen=True, kw_only=True):
    """The engine's first byte reached a request that waited for a start (never recorded
    for a request to a ready model).  `waited_s` runs from its arrival at the gateway."""

    request_id: str
    deployment_id: str
    waited_s: float
    at: float  # epoch seconds


# --- the traffic trace (stream "traffic"; see `events.traffic`) ----------------------------


class TraceStarted(Event, frozen=True, kw_only=True):
    """The gateway began tracing its traffic; what a what-if needs of the box that the other
    events do not say: its memory budget and the configured defaults of the settings."""

    usable_bytes: int
    total_bytes: int = 0
    max_concurrent_starts: int = 1
    defaults: dict[str, Any] = {}


class TrafficRecorded(Event, frozen=True, kw_only=True):
    """A batch of gateway requests, packed rows (`events.traffic`).  Records dropped since
    the previous batch (the writer fell behind) are counted, not lost silently."""

    deployments: list[str]  # the batch's deployment ids; rows name them by index
    base_time: float  # epoch seconds the rows' arrivals count from
    base_id: int  # the first row's request id (layout 0: the rows' ids count from it)
    count: int
    data: bytes
    # How `data` holds the rows (`events.traffic`): 0, the first, 22-byte rows, zlib, ids
    # as deltas; 1, by column, the bytes, id deltas and waits raw-deflated, the times not.
    layout: int = 0
    dropped_batches: int = 0
    dropped_requests: int = 0
    # Per deployment of the batch that was used (a request reached its engine), when its
    # newest such request ended, epoch seconds: the state keeps each deployment's last use
    # without decoding the rows (`events.traffic.last_uses`).
    last_used_at: dict[str, float] = {}


# --- settings, users, LiteLLM -----------------------------------------------------------


class SettingsChanged(Event, frozen=True, kw_only=True):
    """Settings changed; `changes` holds only the keys that changed."""

    changes: dict[str, Any]


class UserCreated(Event, frozen=True, kw_only=True):
    """A user was added (password stored as an scrypt hash)."""

    name: str
    role: Literal["admin", "viewer"]
    password_hash: str


class UserRemoved(Event, frozen=True, kw_only=True):
    """A user was removed."""

    name: str


class ApiTokenCreated(Event, frozen=True, kw_only=True):
    """An API token was issued (only its hash is kept).

    `role` "metrics" makes a scrape token that reads `/metrics` and nothing else; None acts
    with its owner's role.  `expires_at` None never expires.
    """

    name: str
    token_id: str
    token_hash: str
    label: str = ""
    expires_at: float | None = None
    role: Literal["metrics"] | None = None


class ApiTokenRevoked(Event, frozen=True, kw_only=True):
    """An API token was revoked; it stops working at once."""

    name: str
    token_id: str


class ApiTokenUsed(Event, frozen=True, kw_only=True):
    """An API token was used (recorded at most every few minutes per token, not audited)."""

    name: str
    token_id: str
    at: float


class UserRoleChanged(Event, frozen=True, kw_only=True):
    """An administrator changed a user's role."""

    name: str
    role: Literal["admin", "viewer"]


class PasswordChanged(Event, frozen=True, kw_only=True):
    """A user's password hash was replaced: set by the user, reset by an admin, or rehashed
    with stronger scrypt parameters at a login (`reason` "self", "reset", "rehash")."""

    name: str
    password_hash: str
    reason: Literal["self", "reset", "rehash"] = "reset"


class UserLoggedIn(Event, frozen=True, kw_only=True):
    """A user logged in."""

    name: str


class LoginFailed(Event, frozen=True, kw_only=True):
    """A login attempt failed.

    `name` is the account's name when the name typed is a user's, else "" with `name_hash`,
    a keyed hash that tells repeated guesses apart without keeping what was typed (it may
    be a password typed in the wrong field).  Older logs hold the name as typed.
    """

    name: str
    name_hash: str | None = None


class LiteLLMSynced(Event, frozen=True, kw_only=True):
    """A LiteLLM sync ran; `ok` false carries the error."""

    ok: bool
    error: str | None = None
    entries: int = 0


class TuneApplied(Event, frozen=True, kw_only=True):
    """An administrator applied `dgxmm tune`'s recommendation (stream "settings"): the
    settings it changed (`settings`, by deployment id; `changes`, as the operator writes
    them), what they were before (`previous`, for the undo), and what it predicted per hour
    of traffic (`prediction`, beside `baseline`: the settings as they were)."""

    settings: dict[str, Any] = {}
    changes: list[str] = []
    previous: dict[str, Any] = {}
    label: str = ""
    goal: str = ""
    prediction: dict[str, Any] = {}
    baseline: dict[str, Any] = {}


class TuneUndone(Event, frozen=True, kw_only=True):
    """An administrator undid the application recorded at `applied_seq`: `restored` holds
    the settings put back."""

    applied_seq: int = 0
    restored: dict[str, Any] = {}


AnyEvent = (
    DeploymentCreated
    | DeploymentReconfigured
    | ModelSwitched
    | DeploymentRemoved
    | ModeChanged
    | PendingModeSet
    | PendingModeCleared
    | StartRequested
    | EngineStarting
    | EngineMilestoneReached
    | EngineReady
    | EngineStartFailed
    | StopRequested
    | PutToSleep
    | EngineStopped
    | EngineLost
    | EngineAsleep
    | EngineAwake
    | EngineAdopted
    | RequestQueued
    | RequestAdmitted
    | RequestLeftQueue
    | FirstByteRelayed
    | SettingsChanged
    | UserCreated
    | UserRemoved
    | ApiTokenCreated
    | UserLoggedIn
    | LoginFailed
    | ApiTokenRevoked
    | ApiTokenUsed
    | UserRoleChanged
    | PasswordChanged
    | LiteLLMSynced
    | TraceStarted
    | TrafficRecorded
    | TuneApplied
    | TuneUndone
)


class Recorded(msgspec.Struct, frozen=True, kw_only=True):
    """An event as the log holds it."""

    seq: int
    ts: float  # epoch seconds
    stream: str
    version: int
    actor: str  # "admin:<user>", "ondemand", "watchdog", "system", "litellm"
    event: AnyEvent

    @property
    def type(self) -> str:
        """The event's type name."""
        return type(self.event).__name__


_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[AnyEvent] = msgspec.json.Decoder(AnyEvent)
_recorded_encoder = msgspec.json.Encoder()
_recorded_decoder = msgspec.json.Decoder(Recorded)


def encode_event(event: Event) -> bytes:
    """The event's JSON, tag included (what the `data` column holds)."""
    return _encoder.encode(event)


def decode_event(data: bytes | str) -> AnyEvent:
    """Decode a `data` column back into its event."""
    return _decoder.decode(data)


def encode_recorded(rec: Recorded) -> bytes:
    """One JSON line for `dgxmm events --json`."""
    return _recorded_encoder.encode(rec)


def decode_recorded(data: bytes | str) -> Recorded:
    """The inverse of `encode_recorded`."""
    return _recorded_decoder.decode(data)


def deployment_stream(deployment_id: str) -> str:
    """The stream name of one deployment."""
    return f"deployment:{deployment_id}"


STREAM_QUEUE = "queue"
STREAM_SETTINGS = "settings"
STREAM_USERS = "users"
STREAM_LITELLM = "litellm"
STREAM_TRAFFIC = "traffic"
