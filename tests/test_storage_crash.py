"""SIGKILL in the middle of a burst of appends: every acknowledged append survives, untorn."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sqlite3
import time
from pathlib import Path

from events import model as m
from storage.eventlog import EventStore
from tests.runtime_support import python_child

DEADLINE_S = 60.0

# The child: many appenders in a burst, each printing the seqs of an append as soon as the
# store acknowledges it as durable.  It never stops by itself; the test kills it.
CHILD = r"""
import asyncio, sys
from events import model as m
from storage.eventlog import EventStore

async def appender(store, k):
    stream = m.deployment_stream(f"d{k % 5}") if k % 2 else m.STREAM_QUEUE
    i = 0
    while True:
        i += 1
        events = [m.SettingsChanged(changes={"k": k, "i": i, "pad": "x" * 200})] * (1 + i % 3)
        recs = await store.append(stream, events, actor="ondemand")
        sys.stdout.write(" ".join(str(r.seq) for r in recs) + "\n")
        sys.stdout.flush()

async def main():
    store = await EventStore.open(sys.argv[1])
    sys.stdout.write("open\n")
    sys.stdout.flush()
    await asyncio.gather(*(appender(store, k) for k in range(40)))

asyncio.run(main())
"""


def burst_then_kill(path: Path, kill_after: int) -> set[int]:
    """Start the child, read acknowledged seqs until `kill_after`, SIGKILL it; the acked seqs."""
    proc = python_child(CHILD, str(path))
    assert proc.stdout is not None
    acked: set[int] = set()
    buffer = b""
    deadline = time.monotonic() + DEADLINE_S
    try:
        fd = proc.stdout.fileno()
        while len(acked) < kill_after:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the child acknowledged too few appends in time"
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            assert chunk, f"the child exited early: {proc.stderr.read() if proc.stderr else ''!r}"
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line and line != b"open":
                    acked.update(int(s) for s in line.split())
        proc.send_signal(signal.SIGKILL)  # mid-burst: other appends are in flight right now
        # Lines already in the pipe were acknowledged before the kill: count them too.
        rest, _ = proc.communicate(timeout=DEADLINE_S)
        # The last piece has no newline: if the kill cut a line, it was not acknowledged.
        for line in (buffer + rest).split(b"\n")[:-1]:
            if line and line != b"open":
                acked.update(int(s) for s in line.split())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return acked


def check_log(path: Path, acked: set[int]) -> int:
    """Every acked seq is there; seqs are 1..N; each stream's versions are 1..k in seq order."""

    async def read() -> list[m.Recorded]:
        store = await EventStore.open(path, create=False, readonly=True)
        try:
            return await store.read()
        finally:
            await store.close()

    records = asyncio.run(read())
    seqs = [r.seq for r in records]
    assert seqs == list(range(1, len(seqs) + 1)), "the log has gaps"
    assert acked <= set(seqs), f"lost acknowledged appends: {sorted(acked - set(seqs))[:10]}"
    versions: dict[str, int] = {}
    for rec in records:
        versions[rec.stream] = versions.get(rec.stream, 0) + 1
        assert rec.version == versions[rec.stream], f"stream {rec.stream} torn at {rec.seq}"
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    return len(seqs)


def test_sigkill_mid_burst_keeps_every_acknowledged_append_and_a_contiguous_log(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.db"
    acked = burst_then_kill(path, kill_after=400)
    total = check_log(path, acked)
    assert total >= len(acked) >= 400


def test_a_log_killed_twice_reopens_and_keeps_numbering_without_gaps(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    first = burst_then_kill(path, kill_after=200)
    check_log(path, first)
    second = burst_then_kill(path, kill_after=200)
    assert min(second) > max(first)
    total = check_log(path, first | second)
    assert total >= len(first | second)
