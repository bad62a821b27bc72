"""Pure projections of the log: the audit trail, the Events tab, badges.

The audit trail is not a second table: it is this projection over the event log, so it can
never disagree with what happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from events import model as m
from events.cold_start import MILESTONE_TEXT
from events.state import DeploymentState, Lifecycle

QUEUE_TIMEOUT_AUDIT_EVERY_S = 60.0

STATE_LABELS = {
    Lifecycle.STOPPED: "Stopped",
    Lifecycle.STARTING: "Loading",
    Lifecycle.READY: "Ready",
    Lifecycle.STOPPING: "Stopping",
    Lifecycle.FAILED: "Failed",
    Lifecycle.ASLEEP: "Asleep",
}


def badge(dep: DeploymentState, queued: int = 0) -> str:
    """The status badge the UI shows (the seed's "Status badges")."""
    if not dep.on_demand:
        return STATE_LABELS[dep.lifecycle]
    if queued > 0:
        return f"{queued} queued"
    match dep.lifecycle:
        case Lifecycle.STOPPED | Lifecycle.STOPPING | Lifecycle.ASLEEP:
            return "Sleeping (on demand)"
        case Lifecycle.STARTING if dep.start_reason == "request":  # a mode switch: Loading
            return "Starting for a request"
        case Lifecycle.READY:
            return "Ready"
    return STATE_LABELS[dep.lifecycle]


def minutes(seconds: float) -> str:
    """`300` -> `5`, `90` -> `1.5`: minutes as the UI writes them."""
    return f"{seconds / 60:g}"


class AuditRow(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the audit log."""

    seq: int
    ts: float
    actor: str
    action: str
    target: str
    details: dict[str, Any] = {}


def duration_text(seconds: float) -> str:
    """`45 s`, `12 min`, `2 h`, `3 days`: a duration in the unit an operator would say."""
    if seconds < 90:
        return f"{round(seconds)} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    if seconds < 36 * 3600:
        return f"{round(seconds / 3600)} h"
    days = round(seconds / 86_400)
    return f"{days} day" if days == 1 else f"{days} days"


def _target(rec: m.Recorded) -> str:
    if rec.stream.startswith("deployment:"):
        return rec.stream
    ev = rec.event
    if isinstance(ev, m.RequestQueued | m.RequestAdmitted | m.RequestLeftQueue):
        return m.deployment_stream(ev.deployment_id)
    return rec.stream


def _action(rec: m.Recorded) -> tuple[str, dict[str, Any]] | None:
    ev = rec.event
    match ev:
        case m.DeploymentCreated():
            return "deployment_create", {"name": ev.name, "engine": ev.engine, "mode": ev.mode}
        case m.DeploymentRemoved():
            return "deployment_remove", {}
        case m.DeploymentReconfigured():
            return "deployment_reconfigure", {}
        case m.ModelSwitched():
            return "deployment_switch_model", {"model": ev.model}
        case m.ModeChanged():
            mode: dict[str, Any] = {"mode": ev.mode, "idle_timeout_s": ev.idle_timeout_s}
            if not isinstance(ev.make_room_after_s, msgspec.UnsetType):
                mode["make_room_after_s"] = ev.make_room_after_s
            if not isinstance(ev.ondemand_policy, msgspec.UnsetType):
                mode["ondemand_policy"] = ev.ondemand_policy
            return "ondemand_mode", mode
        case m.PendingModeSet():  # the switch of a model that is not ready, applied once it is
            return "ondemand_mode", {"mode": ev.mode, "once": "ready"}
        case m.StartRequested() if ev.reason == "request":
            return "ondemand_start", {"request_id": ev.request_id}
        case m.StartRequested() if ev.reason == "admin":
            return "deployment_start", {}
        case m.StartRequested() if ev.reason == "prewarm":
            return "ondemand_prewarm", {"expected_at": ev.expected_at, "reason": ev.detail}
        case m.StopRequested() if ev.reason in ("admin", "removed"):
            return "deployment_stop", {}
        case m.StopRequested() if ev.reason == "prewarm_abandoned":
            why = "a queued request needs its memory or its start slot"
            return "ondemand_prewarm_abandoned", {"reason": why}
        case m.PutToSleep() if ev.reason == "watchdog":
            return "watchdog_stop", {"free_bytes": ev.free_bytes}
        case m.PutToSleep():
            details: dict[str, Any] = {"reason": ev.reason}
            if ev.for_deployment is not None:
                details["for"] = ev.for_name or ev.for_deployment
            if ev.kept_warm_s:
                details.update(kept_warm_s=ev.kept_warm_s, kept_warm_reason=ev.kept_warm_reason)
            if ev.prewarm_unused:
                details["prewarm_unused"] = True
            return "ondemand_sleep", details
        case m.EngineStartFailed():
            return "deployment_start_failed", {"reason": ev.reason, "failures": ev.failures}
        case m.EngineLost():
            return "engine_lost", {"reason": ev.reason}
        case m.SettingsChanged():
            return "settings_change", dict(ev.changes)
        case m.UserCreated():
            return "user_create", {"name": ev.name, "role": ev.role}
        case m.UserRemoved():
            return "user_remove", {"name": ev.name}
        case m.ApiTokenCreated():
            info: dict[str, Any] = {"name": ev.name, "token_id": ev.token_id}
            if ev.label:
                info["label"] = ev.label
            if ev.role is not None:
                info["role"] = ev.role
            if ev.expires_at is not None:
                info["expires_at"] = ev.expires_at
            return "api_token_create", info
        case m.ApiTokenRevoked():
            return "api_token_revoke", {"name": ev.name, "token_id": ev.token_id}
        case m.UserRoleChanged():
            return "user_role_change", {"name": ev.name, "role": ev.role}
        case m.PasswordChanged():
            return "password_change", {"name": ev.name, "reason": ev.reason}
        case m.UserLoggedIn():
            return "login", {"name": ev.name}
        case m.LoginFailed() if ev.name_hash is not None:
            return "login_failed", {"name": ev.name or None, "name_hash": ev.name_hash}
        case m.LoginFailed():
            return "login_failed", {"name": ev.name}
        case m.TuneApplied():
            return "tune_apply", {"changes": list(ev.changes), "label": ev.label}
        case m.TuneUndone():
            return "tune_undo", {"applied_seq": ev.applied_seq, "restored": dict(ev.restored)}
    return None


# Every event type that can yield an audit row (reading only these skips the queue's bulk).
AUDITED_TYPES = frozenset(
    {
        "DeploymentCreated",
        "DeploymentRemoved",
        "DeploymentReconfigured",
        "ModelSwitched",
        "ModeChanged",
        "PendingModeSet",
        "StartRequested",
        "StopRequested",
        "PutToSleep",
        "EngineStartFailed",
        "EngineLost",
        "SettingsChanged",
        "UserCreated",
        "UserRemoved",
        "ApiTokenCreated",
        "UserLoggedIn",
        "LoginFailed",
        "ApiTokenRevoked",
        "UserRoleChanged",
        "PasswordChanged",
        "RequestLeftQueue",
        "TuneApplied",
        "TuneUndone",
    }
)


class EventRow(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a deployment's Events tab."""

    seq: int
    ts: float
    actor: str
    title: str
    type: str


def _title(rec: m.Recorded, names: dict[str, str]) -> str | None:
    ev = rec.event
    match ev:
        case m.DeploymentCreated():
            mode = "on demand" if ev.mode == "on_demand" else "always on"
            return f"Created ({mode})"
        case m.DeploymentReconfigured():
            return "Reconfigured"
        case m.ModelSwitched():
            return f"Switched model to {ev.model}"
        case m.DeploymentRemoved():
            return "Removed"
        case m.ModeChanged() if ev.mode == "on_demand":
            idle = (
                "default idle timeout"
                if ev.idle_timeout_s is None
                else (f"sleep after {minutes(ev.idle_timeout_s)} min idle")
            )
            if isinstance(ev.ondemand_policy, str):
                idle += f"; {ev.ondemand_policy} policy"
            return f"Mode changed to on demand ({idle})"
        case m.ModeChanged():
            return "Mode changed to always on"
        case m.PendingModeSet():
            return "Switching to always on" if ev.mode == "always_on" else "Switching to on demand"
        case m.PendingModeCleared():
            return None
        case m.StartRequested() if ev.reason == "request":
            return "Started for a request"
        case m.StartRequested() if ev.reason == "admin":
            return "Started"
        case m.StartRequested() if ev.reason == "restart":
            return "Restarting after the engine was lost"
        case m.StartRequested() if ev.reason == "prewarm":
            return f"Pre-warmed ({ev.detail})" if ev.detail else "Pre-warmed"
        case m.StartRequested():
            return "Starting"
        case m.EngineStarting():
            return "Loading"
        case m.EngineMilestoneReached():
            what = MILESTONE_TEXT.get(ev.milestone, ev.milestone)
            return f"Loading: {what}" + ("" if ev.took_s is None else f" ({ev.took_s:g} s)")
        case m.EngineReady():
            return "Ready"
        case m.EngineStartFailed():
            return f"Start failed: {ev.reason}"
        case m.StopRequested() if ev.reason == "prewarm_abandoned":
            return "Pre-warm abandoned for a queued request"
        case m.StopRequested():
            return (
                "Stopped by an administrator" if ev.reason in ("admin", "removed") else ("Stopping")
            )
        case m.PutToSleep() if ev.reason == "idle" and ev.prewarm_unused:
            return f"Put to sleep: no request came to its pre-warm ({duration_text(ev.idle_for_s)})"
        case m.PutToSleep() if ev.reason == "idle" and ev.kept_warm_s:
            return f"Kept warm {duration_text(ev.kept_warm_s)} ({ev.kept_warm_reason})"
        case m.PutToSleep() if ev.reason == "idle":
            return f"Put to sleep after {minutes(ev.idle_timeout_s)} min idle"
        case m.PutToSleep() if ev.reason == "make_room":
            other = ev.for_name or names.get(ev.for_deployment or "", ev.for_deployment or "?")
            return f"Put to sleep to make room for {other}"
        case m.PutToSleep():
            return "Stopped by the memory watchdog"
        case m.EngineStopped():
            return "Stopped"
        case m.EngineLost():
            return f"Engine lost: {ev.reason}"
        case m.EngineAsleep():
            return "Engine in sleep mode"
        case m.EngineAwake():
            return "Engine woke from sleep mode"
        case m.EngineAdopted():
            return "Adopted running engine"
    return None


class TimelineRow(msgspec.Struct, frozen=True, kw_only=True):
    """An Events-tab row and the deployment whose tab shows it (the read model's row)."""

    deployment_id: str
    row: EventRow
    made_room: bool = False  # on the tab of the model it was put to sleep for


class Projector:
    """Folds records one at a time into audit rows and Events-tab rows.

    The one implementation behind `audit_rows`, `deployment_events` and the read models the
    store keeps up to date: each record yields at most one audit row, at most one row of its
    own deployment's Events tab, and, when it put a model to sleep to make room, one row
    ("Made room: X put to sleep") of the tab of the model it made room for.  Its memory is
    the deployments' names and each deployment's last audited queue timeout (the
    once-a-minute rule), nothing that grows with the log.
    """

    def __init__(
        self,
        names: dict[str, str] | None = None,
        last_timeouts: dict[str, float] | None = None,
    ) -> None:
        self.names: dict[str, str] = dict(names or {})
        self.last_timeouts: dict[str, float] = dict(last_timeouts or {})

    def copy(self) -> Projector:
        """An independent copy (to roll back what a failed transaction applied)."""
        return Projector(self.names, self.last_timeouts)

    def apply(self, rec: m.Recorded) -> tuple[AuditRow | None, list[TimelineRow]]:
        """The audit row (or None) and the Events-tab rows of one record."""
        ev = rec.event
        if isinstance(ev, m.DeploymentCreated):
            self.names[ev.deployment_id] = ev.name
        if isinstance(ev, m.RequestLeftQueue):
            if ev.reason != "timeout":
                return None, []
            last = self.last_timeouts.get(ev.deployment_id)
            if last is not None and rec.ts - last < QUEUE_TIMEOUT_AUDIT_EVERY_S:
                return None, []
            self.last_timeouts[ev.deployment_id] = rec.ts
            timeout = AuditRow(
                seq=rec.seq,
                ts=rec.ts,
                actor=rec.actor,
                action="ondemand_queue_timeout",
                target=_target(rec),
                # float(): an event built in memory may hold an int where it decodes a float.
                details={"request_id": ev.request_id, "waited_s": round(float(ev.waited_s), 3)},
            )
            tab = EventRow(
                seq=rec.seq,
                ts=rec.ts,
                actor=rec.actor,
                title="Queued request timed out",
                type=rec.type,
            )
            return timeout, [TimelineRow(deployment_id=ev.deployment_id, row=tab)]
        if isinstance(ev, m.RequestQueued | m.RequestAdmitted):
            return None, []
        audit: AuditRow | None = None
        found = _action(rec)
        if found is not None:
            action, details = found
            audit = AuditRow(
                seq=rec.seq,
                ts=rec.ts,
                actor=rec.actor,
                action=action,
                target=_target(rec),
                details=details,
            )
        tabs: list[TimelineRow] = []
        if rec.stream.startswith("deployment:"):
            dep_id = rec.stream.partition(":")[2]
            title = _title(rec, self.names)
            if title is not None:
                row = EventRow(seq=rec.seq, ts=rec.ts, actor=rec.actor, title=title, type=rec.type)
                tabs.append(TimelineRow(deployment_id=dep_id, row=row))
            if (
                isinstance(ev, m.PutToSleep)
                and ev.reason == "make_room"
                and ev.for_deployment is not None
                and ev.for_deployment != dep_id
            ):
                # The head's own tab names the models stopped for it.
                made = f"Made room: {self.names.get(dep_id, dep_id)} put to sleep"
                row = EventRow(seq=rec.seq, ts=rec.ts, actor=rec.actor, title=made, type=rec.type)
                tabs.append(TimelineRow(deployment_id=ev.for_deployment, row=row, made_room=True))
        return audit, tabs


def audit_rows(records: Iterable[m.Recorded]) -> Iterator[AuditRow]:
    """The audit trail: one row per audited event, queue timeouts at most once a minute."""
    projector = Projector()
    for rec in records:
        audit, _ = projector.apply(rec)
        if audit is not None:
            yield audit


def deployment_events(
    records: Iterable[m.Recorded],
    deployment_id: str,
    names: dict[str, str] | None = None,
    *,
    made_room: bool = False,
) -> list[EventRow]:
    """The Events tab of one deployment, oldest first.

    With `made_room`, the models put to sleep to make room for it are rows of its own tab
    too ("Made room: X put to sleep"), as the admin API shows it.
    """
    projector = Projector(names)
    rows: list[EventRow] = []
    for rec in records:
        _, tabs = projector.apply(rec)
        rows += [
            t.row
            for t in tabs
            if t.deployment_id == deployment_id and (made_room or not t.made_room)
        ]
    return rows
