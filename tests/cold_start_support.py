"""Reading a waited request's cold-start phases the way an operator does, for the e2e tests
(the simulated engine, llama.cpp, and the real vLLM): `dgxmm replay --request ID [--json]`
in a subprocess; the check that the phases are whole; and the check that they are *true*,
against clocks DGXMM does not keep.

Whole (`assert_adds_up`) is only structure: `events.cold_start.request_phases` clamps every
mark into the wait, so the phases add up to it by construction, whatever the marks say.
True (`phase_disagreements`) compares the moment that ends each phase, as DGXMM recorded it,
with the same moment on an independent clock: the kernel's start time of the engine's
process (`/proc/<pid>/stat`, or Docker's `State.StartedAt`) for the end of `launch`, and the
engine's own log timestamps (llama.cpp's `--log-timestamps`, microseconds since its start)
for the ends of `loading_model`, `server_start`, `ready` and `first_byte`; and the wait's
two ends with the client's clock (sent before the arrival, answered after the first byte).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from events.cold_start import PHASES, milestone_of

PROJECT = Path(__file__).resolve().parent.parent


def replay_wait(db: Path, request_id: str) -> tuple[dict[str, Any], str]:
    """`dgxmm replay --request ID`: its JSON `wait` and its text."""
    base = [sys.executable, "-m", "dgxmm.cli", "replay", "--db", str(db), "--request", request_id]
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    as_json = subprocess.run([*base, "--json"], capture_output=True, text=True, env=env, timeout=60)
    as_text = subprocess.run(base, capture_output=True, text=True, env=env, timeout=60)
    assert as_json.returncode == 0 and as_text.returncode == 0, (as_json.stderr, as_text.stderr)
    wait = json.loads(as_json.stdout)["wait"]
    assert wait is not None, as_json.stdout
    return wait, as_text.stdout


def assert_adds_up(wait: dict[str, Any]) -> None:
    """Contiguous, non-negative phases that add up to the request's wait within 1 %: their
    structure only (they add up by construction; `phase_disagreements` checks the times)."""
    phases = wait["phases"]
    names = [p["name"] for p in phases]
    assert names == sorted(names, key=PHASES.index), names
    assert all(p["seconds"] >= 0 for p in phases)
    for before, after in itertools.pairwise(phases):
        assert math.isclose(before["began_at"] + before["seconds"], after["began_at"], abs_tol=1e-6)
    total = sum(p["seconds"] for p in phases)
    assert abs(total - wait["wait_s"]) <= 0.01 * wait["wait_s"], (total, wait["wait_s"])


# How far DGXMM's end of a phase may lie from the same moment on the engine's clock.  What
# separates the two: DGXMM reads the engine's log every 0.1 s and probes its health every
# 25 ms; the kernel counts a start in 10 ms ticks; llama.cpp's log clock starts after the
# exec and the loading of its libraries (a few ms; a container's process after its start);
# and on a loaded 2-core box any of them can be scheduled late by tens of ms.  Measured on
# this box (process runtime, load 3-7): at most 0.13 s apart.
ENGINE_TOLERANCE_S = 0.3

_LLAMA_STAMP = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) ")


def llama_log_times(lines: Iterable[str], started_at: float) -> dict[str, float]:
    """What one llama.cpp start did when, on its own clock, from its `--log-timestamps` lines
    (minutes.seconds.ms.us since its start) and its process's start time (epoch seconds):
    `model_loaded`, `server_listening`, and for its first request `task_launched` and
    `task_released` (generation began, ended)."""
    times: dict[str, float] = {}
    for line in lines:
        stamp = _LLAMA_STAMP.match(line)
        if stamp is None:
            continue
        minutes, seconds, millis, micros = (int(g) for g in stamp.groups())
        at = started_at + minutes * 60 + seconds + millis / 1e3 + micros / 1e6
        found = milestone_of("llamacpp", line)
        if found is not None:
            times.setdefault(found.name, at)
        elif " launch_slot_: " in line and "processing task" in line:
            times.setdefault("task_launched", at)
        elif " release: " in line and "stop processing" in line:
            times.setdefault("task_released", at)
    return times


def llama_log_moments(lines: Iterable[str], started_at: float) -> dict[str, float]:
    """The moments of one llama.cpp start on its own clock (`llama_log_times`), keyed by the
    phase each ends: `loading_model` and `ready` ("model loaded": the server turns healthy as
    it prints it), `server_start` ("listening on"), `first_byte` (the first task released: a
    plain answer is sent as its generation ends)."""
    times = llama_log_times(lines, started_at)
    ends = {
        "loading_model": "model_loaded",
        "ready": "model_loaded",
        "server_start": "server_listening",
        "first_byte": "task_released",
    }
    return {phase: times[name] for phase, name in ends.items() if name in times}


def process_started_at(runtime_id: str) -> float:
    """When the engine's process (`pid:N`) or container started, on the kernel's clock or
    Docker's, as epoch seconds."""
    if not runtime_id.startswith("pid:"):
        found = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.StartedAt}}", runtime_id],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        whole, _, fraction = found.stdout.strip().removesuffix("Z").partition(".")
        return datetime.fromisoformat(f"{whole}+00:00").timestamp() + float(f"0.{fraction or 0}")
    stat = Path(f"/proc/{runtime_id.removeprefix('pid:')}/stat").read_text()
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, after `comm`
    boot_at = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot_at + ticks / os.sysconf("SC_CLK_TCK")


def phase_disagreements(
    wait: dict[str, Any],
    engine: dict[str, float],
    client: tuple[float, float],
    tolerance_s: float = ENGINE_TOLERANCE_S,
) -> list[str]:
    """Where DGXMM's phases disagree with the independent clocks by more than `tolerance_s`
    (empty: they agree).

    `engine` maps a phase name to the moment that ends it on the engine's (or kernel's)
    clock; `client` is (sent, answered) on the client's clock.  Each phase the engine times
    must be there and end within the tolerance of that moment.
    """
    problems = []
    ends = {p["name"]: p["began_at"] + p["seconds"] for p in wait["phases"]}
    for name, at in engine.items():
        if name not in ends:
            problems.append(f"{name}: the engine timed it, DGXMM recorded no such phase")
        elif abs(ends[name] - at) > tolerance_s:
            problems.append(
                f"{name}: DGXMM ends it {ends[name] - at:+.3f} s from the engine's clock"
            )
    sent, answered = client
    arrived = wait["phases"][0]["began_at"]
    first_byte = arrived + wait["wait_s"]
    if not sent - tolerance_s <= arrived <= answered:
        problems.append(f"arrival {arrived - sent:+.3f} s after the client sent the request")
    if not sent <= first_byte <= answered + tolerance_s:
        problems.append(f"first byte {first_byte - answered:+.3f} s after the client's answer")
    return problems


def shifted(wait: dict[str, Any], phase: str, by_s: float) -> dict[str, Any]:
    """A copy of `wait` with the end of `phase` (the start of the next) moved by `by_s`:
    the phases still add up to the wait, only one mark is wrong."""
    planted = copy.deepcopy(wait)
    phases = planted["phases"]
    at = next(i for i, p in enumerate(phases) if p["name"] == phase)
    phases[at]["seconds"] += by_s
    phases[at + 1]["began_at"] += by_s
    phases[at + 1]["seconds"] -= by_s
    return planted
