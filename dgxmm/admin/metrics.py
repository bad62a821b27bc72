"""`GET /metrics`: the Prometheus text exposition format (version 0.0.4), built by hand.

Families: deployments by state and mode, per-deployment in flight / queued / waiting for a
start / memory, the memory budget, the queue's gauges and counters, the learned policy's
pre-warms per deployment by outcome, the admin API's event streams, the LiteLLM integration
(config-file writes, i.e. LiteLLM restarts DGXMM caused, and whether LiteLLM loaded the last
one), and the gateway's statistics when the composition root hands over a callable.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.controller import Controller

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
STATES = ("stopped", "starting", "ready", "stopping", "failed", "asleep")
MODES = ("on_demand", "always_on")
PREWARM_OUTCOMES = ("used", "wasted", "abandoned")

# Gateway statistics that are levels, not running totals.
_GAUGE_KEYS = frozenset(
    {"active", "idle", "connections_open", "connections_idle", "requests_active", "closing"}
)
_NAME_PART = re.compile(r"[^a-zA-Z0-9_]")
_LABEL_NAMES = {"engines": "engine", "error_replies": "status"}

Labels = tuple[tuple[str, str], ...]


@dataclass
class Family:
    """One metric family: name, type, help and its samples."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> None:
        """Add a sample."""
        self.samples.append((tuple(labels.items()), float(value)))


def escape_label(value: str) -> str:
    """A label value as the text format writes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def render(families: Iterable[Family]) -> str:
    """The exposition text of `families`."""
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            if labels:
                text = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels)
                lines.append(f"{fam.name}{{{text}}} {_number(value)}")
            else:
                lines.append(f"{fam.name} {_number(value)}")
    return "\n".join(lines) + "\n"


def controller_families(controller: Controller) -> list[Family]:
    """Deployments, memory and the queue."""
    records = controller.records()
    by_state = Family("dgxmm_deployments", "gauge", "Deployments by lifecycle state and mode.")
    counts = {(s, md): 0 for s in STATES for md in MODES}
    for rec in records:
        counts[(rec.state, rec.mode)] = counts.get((rec.state, rec.mode), 0) + 1
    for (state, mode), n in sorted(counts.items()):
        by_state.add(n, state=state, mode=mode)
    per = {
        "in_flight": Family(
            "dgxmm_deployment_in_flight", "gauge", "Requests in flight through the gateway."
        ),
        "queued": Family(
            "dgxmm_deployment_queued", "gauge", "Requests queued for memory for the deployment."
        ),
        "waiting_for_start": Family(
            "dgxmm_deployment_waiting_for_start", "gauge", "Requests waiting for its start."
        ),
        "memory_bytes": Family(
            "dgxmm_deployment_memory_bytes", "gauge", "Memory the deployment needs when running."
        ),
        "failures": Family(
            "dgxmm_deployment_start_failures", "gauge", "Consecutive failed starts."
        ),
    }
    up = Family("dgxmm_deployment_ready", "gauge", "1 when the deployment is ready, else 0.")
    for rec in records:
        labels = {"deployment": rec.name, "id": rec.id, "mode": rec.mode}
        per["in_flight"].add(rec.in_flight, **labels)
        per["queued"].add(rec.queued, **labels)
        per["waiting_for_start"].add(rec.waiting_for_start, **labels)
        per["memory_bytes"].add(rec.memory_bytes, **labels)
        per["failures"].add(rec.failures, **labels)
        up.add(1 if rec.state == "ready" else 0, **labels)
    memory = Family("dgxmm_memory_bytes", "gauge", "The memory budget, by kind.")
    for key, value in sorted(controller.memory().items()):
        memory.add(value, kind=key.removesuffix("_bytes"))
    stats = controller.queue.queue_statistics()
    waiting = Family("dgxmm_queue_waiting", "gauge", "Requests waiting (queued or for a start).")
    waiting.add(stats.get("waiting", len(controller.queue)))
    cap = Family("dgxmm_queue_max", "gauge", "ondemand_max_queued.")
    cap.add(int(controller.setting("ondemand_max_queued")))
    outcomes = Family(
        "dgxmm_queue_requests_total", "counter", "Waiting requests by outcome, since start."
    )
    for key, value in sorted(stats.items()):
        if key != "waiting":
            outcomes.add(value, outcome=key)
    return [
        by_state,
        *per.values(),
        up,
        memory,
        waiting,
        cap,
        outcomes,
        *prewarm_families(controller),
    ]


def prewarm_families(controller: Controller) -> list[Family]:
    """The learned policy's pre-warms per on-demand deployment, since start: started, and
    by outcome (used: a request came in its window; wasted: none came; abandoned: stopped
    while starting for a queued request).  Zero for a deployment never pre-warmed."""
    started = Family(
        "dgxmm_ondemand_prewarms_started_total",
        "counter",
        "Pre-warms started by the learned policy (ondemand_policy = learned), since start.",
    )
    ended = Family(
        "dgxmm_ondemand_prewarms_total",
        "counter",
        "Pre-warms ended, by outcome: used (a request came), wasted (none came), abandoned "
        "(stopped while starting for a queued request), since start.",
    )
    counts = controller.prewarmer.per_deployment
    for rec in controller.records():
        if rec.mode != "on_demand":
            continue
        mine = counts.get(rec.id, {})
        started.add(mine.get("started", 0), deployment=rec.name, id=rec.id)
        for outcome in PREWARM_OUTCOMES:
            ended.add(mine.get(outcome, 0), deployment=rec.name, id=rec.id, outcome=outcome)
    return [started, ended]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.asdict(value)
    return value


def flatten_statistics(prefix: str, stats: Mapping[str, Any]) -> list[Family]:
    """Families from nested statistics (numbers, dataclasses, structs, dicts)."""
    # Identifier keys become part of the name; other keys (like "host:port" or a status code)
    # become a label named after the enclosing key.  Levels are gauges, the rest counters.
    families: dict[str, Family] = {}

    def family(name: str, leaf: str) -> Family:
        gauge = leaf in _GAUGE_KEYS
        full = name if gauge or name.endswith("_total") else name + "_total"
        fam = families.get(full)
        if fam is None:
            fam = families[full] = Family(
                full, "gauge" if gauge else "counter", f"Gateway statistic {leaf}."
            )
        return fam

    def walk(name: str, leaf: str, value: Any, labels: dict[str, str]) -> None:
        value = _plain(value)
        if isinstance(value, bool):
            family(name, "closing" if leaf == "closing" else leaf).add(int(value), **labels)
        elif isinstance(value, int | float):
            family(name, leaf).add(value, **labels)
        elif isinstance(value, Mapping):
            for key, sub in value.items():
                key_s = str(key)
                if key_s.isidentifier():
                    part = _NAME_PART.sub("_", key_s)
                    walk(f"{name}_{part}", part, sub, labels)
                else:
                    label = _LABEL_NAMES.get(leaf, _NAME_PART.sub("_", leaf))
                    walk(name, leaf, sub, {**labels, label: key_s})

    for key, value in stats.items():
        part = _NAME_PART.sub("_", str(key))
        walk(f"{prefix}_{part}", part, value, {})
    return list(families.values())


def exposition(
    controller: Controller,
    *,
    gateway_statistics: Callable[[], Mapping[str, Any]] | None = None,
    extra: Iterable[Family] = (),
) -> str:
    """The whole `/metrics` text."""
    families = controller_families(controller)
    families.extend(extra)
    if gateway_statistics is not None:
        families.extend(flatten_statistics("dgxmm_gateway", gateway_statistics()))
    return render(families)


def litellm_families(status: Mapping[str, Any]) -> list[Family]:
    """The LiteLLM integration: sync outcome, and for the file back-end the restarts it caused."""
    if not status.get("enabled"):
        return []
    ok = Family("dgxmm_litellm_sync_ok", "gauge", "1 when the last LiteLLM sync succeeded.")
    ok.add(1 if status.get("ok") else 0)
    families = [ok]
    if status.get("backend") == "file":
        writes = Family(
            "dgxmm_litellm_config_writes_total",
            "counter",
            "Writes of LiteLLM's config file since start; each restarts LiteLLM's worker.",
        )
        writes.add(int(status.get("config_writes") or 0))
        loaded = Family(
            "dgxmm_litellm_config_loaded",
            "gauge",
            "1 when LiteLLM was last seen serving the file as written, 0 when not, -1 unknown.",
        )
        state = status.get("loaded")
        loaded.add(-1 if state is None else int(bool(state)))
        families += [writes, loaded]
        last = status.get("last_write_at")
        if isinstance(last, int | float):
            at = Family(
                "dgxmm_litellm_config_last_write_timestamp_seconds",
                "gauge",
                "When DGXMM last wrote LiteLLM's config file (Unix time).",
            )
            at.add(float(last))
            families.append(at)
        families += reload_families(status.get("reload"))
    return families


def _single(name: str, kind: str, text: str, value: float) -> Family:
    family = Family(name, kind, text)
    family.add(value)
    return family


def reload_families(reload: Any) -> list[Family]:
    """The file back-end's reloads: the mode, how many, how long each took, the failures."""
    if not isinstance(reload, Mapping):
        return []
    mode = Family(
        "dgxmm_litellm_reload_mode",
        "gauge",
        "1 for the way LiteLLM is reloaded after a write: command (reload_command) or watch.",
    )
    for name in ("command", "watch"):
        mode.add(int(reload.get("mode") == name), mode=name)
    families = [
        mode,
        _single(
            "dgxmm_litellm_reloads_total",
            "counter",
            "Reloads done: LiteLLM served the new list.",
            int(reload.get("reloads") or 0),
        ),
        _single(
            "dgxmm_litellm_reload_seconds_total",
            "counter",
            "Sum over reloads of the time from the write to LiteLLM serving the new list.",
            float(reload.get("durations_sum_s") or 0.0),
        ),
        _single(
            "dgxmm_litellm_reload_failures_total",
            "counter",
            "Reload command runs that failed, hung, or were not followed by the new list in time.",
            int(reload.get("failures") or 0),
        ),
        _single(
            "dgxmm_litellm_reload_failing",
            "gauge",
            "1 while the last reload attempt failed.",
            int(bool(reload.get("failing"))),
        ),
    ]
    last = reload.get("last_duration_s")
    if isinstance(last, int | float):
        families.append(
            _single(
                "dgxmm_litellm_reload_last_seconds",
                "gauge",
                "The last reload's time from the write to LiteLLM serving the new list.",
                float(last),
            )
        )
    return families
