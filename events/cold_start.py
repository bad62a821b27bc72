"""Where a cold start's time goes: engine log milestones, a request's phases, the estimate.

Everything here is pure and owns three things:

- `milestone_of(engine, line)`: the loading milestones an engine prints while it starts
  (vLLM: weights loaded, model loaded, engine initialised (profile, KV cache, warm-up), API
  server starting; llama.cpp: model loaded, server listening).  The deployment actor records
  each as `EngineMilestoneReached`, once per start.
- `request_phases(...)`: a request that waited for a start, cut into contiguous phases that
  add up exactly to its wait (arrival at the gateway to the engine's first byte relayed to
  it).  Each phase is named for what ends it, so a phase that did not happen (no victims, an
  engine that prints no milestone) is simply absent and the next one takes its time.  They
  add up by construction (every mark is clamped into the wait), so that says nothing of the
  marks; `tests/test_cold_start_e2e.py` checks them against clocks DGXMM does not keep (the
  kernel's start time of the engine, llama.cpp's log timestamps, the client's clock).
- `ColdStarts`: pairs each start's request with its ready (the cold starts' durations).
- `median_recent(durations)`: the median of a deployment's last `ESTIMATE_STARTS` cold
  starts, shown as an estimate ("est.") where a start is waited for.

Phase names are stable (`PHASES`), for `dgxmm replay --request --json`, `/metrics` and the
web UI.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence

import msgspec

from events import model as m

# Milestones an engine's log shows, in the order they happen.
MILESTONES = ("weights_loaded", "model_loaded", "engine_initialized", "server_listening")

# Phases in order, each named for the moment that ends it:
#   waiting_for_memory  arrival -> its start was requested (only a request queued for memory)
#   stopping_victims    start requested -> the launch began (models put to sleep made room)
#   launch              -> the runtime's start call returned (process / container runs)
#   loading_weights     -> weights loaded (vLLM)
#   loading_model       -> model loaded (vLLM, llama.cpp)
#   engine_init         -> vLLM's profile, KV cache and warm-up done
#   server_start        -> the engine's HTTP server listens
#   ready               -> DGXMM saw the engine ready (its health probe answered)
#   first_byte          -> the engine's first byte reached the waiting request
PHASES = (
    "waiting_for_memory",
    "stopping_victims",
    "launch",
    "loading_weights",
    "loading_model",
    "engine_init",
    "server_start",
    "ready",
    "first_byte",
)
PHASE_OF_MILESTONE = {
    "weights_loaded": "loading_weights",
    "model_loaded": "loading_model",
    "engine_initialized": "engine_init",
    "server_listening": "server_start",
}
MILESTONE_TEXT = {
    "weights_loaded": "weights loaded",
    "model_loaded": "model loaded",
    "engine_initialized": "profile, KV cache and warm-up done",
    "server_listening": "server listening",
}

ESTIMATE_STARTS = 5  # the estimate is the median of this many last cold starts
MAX_LINE_CHARS = 2048  # longer lines are no milestone; never run a pattern over them

_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_VLLM: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("weights_loaded", re.compile(rf"Loading weights took {_NUMBER} ?s")),
    ("model_loaded", re.compile(rf"Model loading took .*? and {_NUMBER} ?s")),
    ("engine_initialized", re.compile(rf"init engine (?:\([^)]*\) )?took {_NUMBER} ?s")),
    ("server_listening", re.compile(r"Starting vLLM (?:API )?server\b")),
)
_LLAMACPP: tuple[tuple[str, re.Pattern[str]], ...] = (
    # `main: ...` in older builds, `srv  llama_server: ...` in newer ones.
    ("model_loaded", re.compile(r"\b(?:main|llama_server): model loaded\b")),
    ("server_listening", re.compile(r"\b(?:main|llama_server): (?:server is )?listening on\b")),
)
_PATTERNS = {"vllm": _VLLM, "sim": _VLLM, "llamacpp": _LLAMACPP}


class Milestone(msgspec.Struct, frozen=True):
    """A milestone found in a log line, with the engine's own duration when it says one."""

    name: str
    took_s: float | None = None


def milestone_of(engine: str, line: str) -> Milestone | None:
    """The loading milestone `line` of `engine`'s log announces, or None (pure)."""
    if len(line) > MAX_LINE_CHARS:
        return None
    for name, pattern in _PATTERNS.get(engine, ()):
        found = pattern.search(line)
        if found is not None:
            took = float(found.group(1)) if found.groups() else None
            return Milestone(name, took)
    return None


class Phase(msgspec.Struct, frozen=True, kw_only=True):
    """One phase of a request's wait: its name, when it began and how long it took."""

    name: str
    began_at: float  # epoch seconds
    seconds: float
    detail: str = ""


class Victim(msgspec.Struct, frozen=True, kw_only=True):
    """A model put to sleep to make room for the start, and how long it took to stop."""

    deployment_id: str
    name: str
    drain_s: float | None  # None: still stopping when the log ends


class StartMarks(msgspec.Struct, frozen=True, kw_only=True):
    """The recorded moments of one start (epoch seconds); None where unknown."""

    requested_at: float | None = None
    launch_began_at: float | None = None
    launched_at: float | None = None
    milestones: list[tuple[str, float]] = []
    ready_at: float | None = None
    victims: list[Victim] = []


def request_phases(
    arrived_at: float, first_byte_at: float, *, queued: bool, start: StartMarks
) -> list[Phase]:
    """The phases of a request's wait, contiguous from arrival to first byte (pure).

    Every moment is clamped into the wait and after the one before it, so the durations are
    never negative and add up to `first_byte_at - arrived_at` exactly.  A moment before the
    arrival (the request joined a start under way) ends no phase of this request: the time
    from its arrival goes to the phase under way then.
    """
    end = max(arrived_at, first_byte_at)
    marks: list[tuple[float | None, str, str]] = []
    if queued:
        marks.append((start.requested_at, "waiting_for_memory", ""))
    if start.victims:
        drains = ", ".join(
            f"{v.name} {'still stopping' if v.drain_s is None else f'{v.drain_s:.1f} s'}"
            for v in start.victims
        )
        marks.append((start.launch_began_at, "stopping_victims", drains))
    marks.append((start.launched_at, "launch", ""))
    for name, at in sorted(start.milestones, key=lambda item: MILESTONES.index(item[0])):
        marks.append((at, PHASE_OF_MILESTONE[name], MILESTONE_TEXT[name]))
    marks.append((start.ready_at, "ready", ""))
    phases: list[Phase] = []
    began = arrived_at
    for mark, name, detail in marks:
        if mark is None or mark <= arrived_at:
            continue
        at = min(max(mark, began), end)
        phases.append(Phase(name=name, began_at=began, seconds=at - began, detail=detail))
        began = at
    phases.append(Phase(name="first_byte", began_at=began, seconds=end - began))
    return phases


def start_phases(start: StartMarks) -> list[Phase]:
    """The phases of one start from its request to ready (or, while it starts, to its last
    known moment), for `/metrics` and the web UI."""
    if start.requested_at is None:
        return []
    phases = request_phases(start.requested_at, last_mark(start), queued=False, start=start)
    return [p for p in phases if p.name != "first_byte"]


def last_mark(start: StartMarks) -> float:
    """The latest moment known of a start (its ready, while it starts its last milestone)."""
    if start.ready_at is not None:
        return start.ready_at
    known = [start.requested_at, start.launch_began_at, start.launched_at]
    known += [at for _, at in start.milestones]
    return max((t for t in known if t is not None), default=0.0)


def marks_of(records: Iterable[m.Recorded]) -> StartMarks:
    """The marks of the last start among one deployment's records, oldest first (pure)."""
    marks = StartMarks()
    for rec in records:
        ev = rec.event
        if isinstance(ev, m.StartRequested) and (marks.requested_at is None or marks.ready_at):
            marks = StartMarks(requested_at=rec.ts)
        elif isinstance(ev, m.EngineStarting) and marks.launched_at is None:
            marks = msgspec.structs.replace(
                marks, launched_at=rec.ts, launch_began_at=ev.launch_began_at
            )
        elif isinstance(ev, m.EngineMilestoneReached) and marks.requested_at is not None:
            found = (ev.milestone, ev.at)
            marks = msgspec.structs.replace(marks, milestones=[*marks.milestones, found])
        elif isinstance(ev, m.EngineReady) and marks.ready_at is None:
            marks = msgspec.structs.replace(marks, ready_at=rec.ts)
        elif isinstance(ev, m.EngineStartFailed | m.EngineStopped | m.EngineLost):
            marks = StartMarks()  # that start ended without being ready
    return marks


class ColdStarts:
    """Pairs each deployment's `StartRequested` with its `EngineReady` (pure folding)."""

    def __init__(self) -> None:
        self._began: dict[str, float] = {}

    def feed(self, rec: m.Recorded) -> tuple[str, float] | None:
        """(deployment id, cold-start seconds) when `rec` ends a start, else None.

        A start that failed, was stopped, lost or removed counts nothing.
        """
        if not rec.stream.startswith("deployment:"):
            return None
        dep_id = rec.stream.partition(":")[2]
        event = rec.event
        if isinstance(event, m.StartRequested):
            self._began.setdefault(dep_id, rec.ts)
        elif isinstance(event, m.EngineReady):
            began = self._began.pop(dep_id, None)
            if began is not None:
                return dep_id, max(0.0, rec.ts - began)
        elif isinstance(
            event, m.EngineStartFailed | m.EngineStopped | m.EngineLost | m.DeploymentRemoved
        ):
            self._began.pop(dep_id, None)
        return None

    def forget(self, deployment_id: str) -> None:
        """Drop the start under way of one deployment (it will not be timed)."""
        self._began.pop(deployment_id, None)


def median_recent(durations: Sequence[float], n: int = ESTIMATE_STARTS) -> float | None:
    """The median of the last `n` durations, or None without any (pure)."""
    recent = list(durations[-n:])
    return statistics.median(recent) if recent else None


def phase_total(phases: Iterable[Phase]) -> float:
    """The phases' seconds added up."""
    return sum(p.seconds for p in phases)
