"""Ctrl-C and SIGTERM stop the demo the same way, and its next start brings the always-on
model back (issue 46, stumble 1).

The demo's engines are its own children, so it stops them and records the stop.  It used to
close its deployments while their stops were still under way: the log kept only
"StopRequested", the next start finished that stop and left the always-on model stopped (503
"... is always on and is stopped"), and an engine that was starting was never stopped at all.
These tests run a real `dgxmm serve --demo` and signal it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dgxmm.app import stops_unfinished
from dgxmm.engines.runtimes import process
from events import model as m
from events.state import DeploymentState, Lifecycle
from tests.e2e_support import Box
from tests.serve_support import banner_auth, start_demo

DEADLINE_S = 60.0
SIGNALS = [signal.SIGINT, signal.SIGTERM]


def events(db: Path) -> list[tuple[str, str, dict[str, object]]]:
    """(stream, type, data) of every event, oldest first (read-only)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT stream, type, data FROM events ORDER BY seq").fetchall()
    return [(stream, kind, json.loads(data)) for stream, kind, data in rows]


def streams_by_name(db: Path) -> dict[str, str]:
    """Deployment name -> its stream."""
    return {
        str(data["name"]): stream
        for stream, kind, data in events(db)
        if kind == "DeploymentCreated"
    }


def last_lifecycle_event(db: Path, stream: str) -> str:
    """The type of the deployment's last start or stop event."""
    kinds = ("StartRequested", "EngineStarting", "EngineReady", "StopRequested", "EngineStopped")
    found = [kind for s, kind, _ in events(db) if s == stream and kind in kinds]
    return found[-1] if found else ""


def wait_for_event(db: Path, stream: str, kind: str, after: int = 0) -> None:
    """Poll the log until `stream` has a `kind` event past the first `after` events."""
    deadline = time.monotonic() + DEADLINE_S
    while not any(s == stream and k == kind for s, k, _ in events(db)[after:]):
        assert time.monotonic() < deadline, f"no {kind} on {stream}"
        time.sleep(0.1)


def live_engines(root: Path) -> set[int]:
    """Engine processes of the demo in `root` still alive (marked with its state file)."""
    state = root / "dgxmm-data" / "engines" / process.STATE_FILE
    return process.marked_pids(f"{process.MARKER}={state}".encode())


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """The demo's directory; an engine a failed test leaves is killed afterwards."""
    yield tmp_path
    for pid in live_engines(tmp_path):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def signal_and_wait(proc: subprocess.Popen[str], sig: signal.Signals) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()


def chat(banner: str, name: str, model: str) -> tuple[int, str]:
    """A chat completion to deployment `name` through the banner's gateway: status, body."""
    found = re.search(rf"deployment     : {re.escape(name)} \((\w+),", banner)
    curl = re.search(r"curl -s (\S+)/d/\w+/v1/chat/completions", banner)
    assert found and curl, banner
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    request = urllib.request.Request(
        f"{curl.group(1)}/d/{found.group(1)}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **banner_auth(banner)},
    )
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def restart_and_ask_the_always_on_model(root: Path) -> None:
    proc, banner = start_demo(root, DEADLINE_S)
    try:
        status, text = chat(banner, "demo-always", "demo/router-1b")
        assert status == 200, text
    finally:
        assert signal_and_wait(proc, signal.SIGTERM) == 0
    assert live_engines(root) == set()


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_while_idle_records_every_stop_and_the_next_start_serves_the_always_on_model(
    root: Path, sig: signal.Signals
) -> None:
    proc, _ = start_demo(root, DEADLINE_S)
    db = root / "dgxmm-data" / "dgxmm.db"
    streams = streams_by_name(db)
    wait_for_event(db, streams["demo-always"], "EngineReady")
    assert signal_and_wait(proc, sig) == 0
    assert live_engines(root) == set()
    assert last_lifecycle_event(db, streams["demo-always"]) == "EngineStopped"
    restart_and_ask_the_always_on_model(root)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_signal_during_a_start_stops_that_engine_too(root: Path, sig: signal.Signals) -> None:
    proc, banner = start_demo(root, DEADLINE_S)
    db = root / "dgxmm-data" / "dgxmm.db"
    large = streams_by_name(db)["demo-large"]
    before = len(events(db))
    # demo-large takes 6 s to start: the signal comes while its engine loads.
    asking = threading.Thread(target=chat, args=(banner, "demo-large", "demo/large-70b"))
    asking.start()
    try:
        wait_for_event(db, large, "EngineStarting", after=before)
        assert signal_and_wait(proc, sig) == 0
    finally:
        asking.join(DEADLINE_S)
    assert live_engines(root) == set()
    assert last_lifecycle_event(db, large) == "EngineStopped"
    restart_and_ask_the_always_on_model(root)


def test_an_always_on_deployment_whose_shutdown_stop_was_cut_short_starts_again(
    tmp_path: Path,
) -> None:
    # DGXMM killed while its shutdown stopped the engines: the log says "stopping" (reason
    # shutdown).  The next start finishes that stop, then starts the always-on one again;
    # an administrator's stop stays a stop (tests/test_faults.py).
    async def main() -> None:
        box = await Box.open(tmp_path, "process")
        try:
            dep = await box.create("router")
            await box.wait_for_state(dep, "ready")
            await box.store.append(
                m.deployment_stream(dep),
                [m.StopRequested(reason="shutdown")],
                actor="system",
                expected_version=box.actor(dep).state.version,
            )
            await box.restart()
            await box.wait_for_state(dep, "ready")
            names = await box.event_names(dep)
            assert names[-5:-2] == ["StopRequested", "EngineStopped", "StartRequested"], names
        finally:
            await box.close()

    asyncio.run(main())


def test_only_a_stop_under_way_is_unfinished() -> None:
    def dep(name: str, lifecycle: Lifecycle) -> DeploymentState:
        return DeploymentState(
            deployment_id=name, name=name, engine="sim", model="m", memory_bytes=1,
            mode="always_on", idle_timeout_s=None, role="model", args=[], image=None,
            gpu=False, created_at=0.0, lifecycle=lifecycle,
        )  # fmt: skip

    states = [dep(lc.value, lc) for lc in Lifecycle]
    assert stops_unfinished(states) == ["stopping"]
