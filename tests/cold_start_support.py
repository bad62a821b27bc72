"""Reading a waited request's cold-start phases the way an operator does, for the e2e tests
(the simulated engine, llama.cpp, and the real vLLM): `dgxmm replay --request ID [--json]`
in a subprocess, and the check that the phases are whole."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from events.cold_start import PHASES

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
    """Contiguous, non-negative phases that add up to the request's wait within 1 %."""
    phases = wait["phases"]
    names = [p["name"] for p in phases]
    assert names == sorted(names, key=PHASES.index), names
    assert all(p["seconds"] >= 0 for p in phases)
    for before, after in itertools.pairwise(phases):
        assert math.isclose(before["began_at"] + before["seconds"], after["began_at"], abs_tol=1e-6)
    total = sum(p["seconds"] for p in phases)
    assert abs(total - wait["wait_s"]) <= 0.01 * wait["wait_s"], (total, wait["wait_s"])
