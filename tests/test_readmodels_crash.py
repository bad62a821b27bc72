"""SIGKILL while snapshots and read models are written: after a restart nothing is lost.

State and read models after the restart equal those computed from the log from scratch.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from events.projections import audit_rows, deployment_events
from events.state import fold
from storage.eventlog import EventStore
from storage.snapshots import load_state
from tests.perf.bench_storage import write_log
from tests.runtime_support import python_child

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 60.0

# The child: appenders write deployment lifecycles, queue events (timeouts among them, which
# the audit trail and the Events tab show) and logins, while a Snapshotter snapshots the
# folded state every 25 events.  It prints "snap" after each snapshot; the test kills it.
CHILD = r"""
import asyncio, sys
from events import model as m
from events.state import EMPTY, evolve
from storage.eventlog import EventStore
from storage.snapshots import Snapshotter

class Folder:
    def __init__(self):
        self.state = EMPTY
    def __call__(self, recs):
        for rec in recs:
            if rec.seq > self.state.last_seq:
                self.state = evolve(self.state, rec)

CYCLE = [
    m.StartRequested(reason="request", request_id="r"),
    m.EngineStarting(runtime_id="c", host="127.0.0.1", port=1),
    m.EngineReady(),
    m.PutToSleep(reason="idle", idle_timeout_s=60),
    m.EngineStopped(),
]

async def lifecycle(store, dep):
    stream = m.deployment_stream(dep)
    await store.append(stream, [m.DeploymentCreated(
        deployment_id=dep, name="model-" + dep, engine="vllm", model="m", memory_bytes=1 << 30,
        mode="on_demand")], actor="admin:a")
    i = 0
    while True:
        await store.append(stream, [CYCLE[i % len(CYCLE)]], actor="ondemand")
        i += 1

async def queue(store, k):
    i = 0
    while True:
        i += 1
        rid = f"q{k}-{i}"
        dep = f"d{i % 3}"
        reason = "timeout" if i % 4 == 0 else "served"
        await store.append(m.STREAM_QUEUE, [
            m.RequestQueued(request_id=rid, deployment_id=dep, kind="queued", position=1,
                            arrived_at=0.0),
            m.RequestLeftQueue(request_id=rid, deployment_id=dep, reason=reason, waited_s=1.0),
        ], actor="ondemand")
        await store.append(m.STREAM_USERS, [m.UserLoggedIn(name=f"u{k}")], actor="system")

async def main():
    store = await EventStore.open(sys.argv[1])
    folder = Folder()
    folder(await store.read())
    store.add_listener(folder)
    snaps = Snapshotter(store, lambda: folder.state, every=25)
    def said(recs):
        sys.stdout.write(f"seq {recs[-1].seq} snapshots {snaps.written}\n")
        sys.stdout.flush()
    store.add_listener(said)
    sys.stdout.write("open\n")
    sys.stdout.flush()
    await asyncio.gather(*(lifecycle(store, f"d{k}") for k in range(3)),
                         *(queue(store, k) for k in range(8)))

asyncio.run(main())
"""


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child if a failed assertion left it running, and wait for it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def run_then_kill(path: Path, snapshots: int) -> None:
    """Start the child, wait until it wrote `snapshots` snapshots, SIGKILL it mid-write."""
    proc = python_child(CHILD, str(path))
    assert proc.stdout is not None
    buffer = b""
    deadline = time.monotonic() + DEADLINE_S
    try:
        fd = proc.stdout.fileno()
        while f" snapshots {snapshots}\n".encode() not in buffer:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the child wrote too few snapshots in time"
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                assert chunk, f"the child exited: {proc.stderr.read() if proc.stderr else ''!r}"
                buffer = buffer[-200:] + chunk
        proc.send_signal(signal.SIGKILL)  # appends, projections and snapshots in flight
        proc.communicate(timeout=DEADLINE_S)
    finally:
        reap(proc)
    assert proc.returncode == -signal.SIGKILL


def check(path: Path) -> None:
    """State and read models after a restart equal what the log gives from scratch."""

    async def reopen() -> None:
        store = await EventStore.open(path)
        try:
            records = await store.read()
            assert await load_state(store) == fold(records)
            assert store.readmodels_current()
            audit = list(reversed(await store.audit_page(before=None, limit=1 << 40)))
            assert audit == list(audit_rows(records))
            for dep in ("d0", "d1", "d2"):
                tab = list(reversed(await store.timeline_page(dep, before=None, limit=1 << 40)))
                assert tab == deployment_events(records, dep)
            assert any(r.action == "ondemand_queue_timeout" for r in audit)
        finally:
            await store.close()

    asyncio.run(reopen())
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("SELECT COUNT(*) FROM snapshots").fetchone()[0] >= 1


def test_sigkill_while_snapshots_and_read_models_are_written_loses_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.db"
    run_then_kill(path, snapshots=6)
    check(path)
    run_then_kill(path, snapshots=3)  # and again, on top of what the first run left
    check(path)


def test_sigkill_during_a_read_model_rebuild_resumes_where_it_stopped(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    write_log(str(path), 60_000)  # written behind the store's back: no read model rows yet
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import asyncio, sys\nfrom storage.eventlog import EventStore\n"
    code += "asyncio.run(EventStore.open(sys.argv[1]))\n"
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + DEADLINE_S
        reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        while True:  # poll (with a deadline) until the rebuild is part way through
            assert time.monotonic() < deadline, "the rebuild never started"
            row = reader.execute("SELECT value FROM meta WHERE key = 'readmodel_seq'").fetchone()
            if row is not None and 0 < int(row[0]) < 60_000:
                break
            assert proc.poll() is None, "the rebuild finished before it could be interrupted"
        reader.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=DEADLINE_S)
    finally:
        reap(proc)
    assert proc.returncode == -signal.SIGKILL
    check_rebuilt = sqlite3.connect(path)
    applied = int(
        check_rebuilt.execute("SELECT value FROM meta WHERE key = 'readmodel_seq'").fetchone()[0]
    )
    check_rebuilt.close()
    assert 0 < applied < 60_000
    check_after_rebuild(path)


def check_after_rebuild(path: Path) -> None:
    """Reopened, the rebuild finishes and the read models equal the projection."""

    async def reopen() -> None:
        store = await EventStore.open(path)
        try:
            records = await store.read()
            assert store.readmodels_current()
            audit = list(reversed(await store.audit_page(before=None, limit=1 << 40)))
            assert audit == list(audit_rows(records))
            tab = list(reversed(await store.timeline_page("d3", before=None, limit=1 << 40)))
            assert tab == deployment_events(records, "d3")
            assert tab and audit
        finally:
            await store.close()

    asyncio.run(reopen())
