"""The `dgxmm` command line, run as a subprocess on real log files."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dgxmm.replay import parse_time, redact_record
from events import model as m
from events.state import SystemState, fold
from storage.eventlog import EventStore
from tests.replay_support import replay_document
from tests.serve_support import banner_auth, start_demo, stop_demo

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_796_035_320.0  # 2026-11-30T10:42:00Z
GIB = 1 << 30
DEADLINE_S = 30.0


class Wall:
    """The store's clock, moved by the scenario."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def write_incident(path: Path) -> list[m.Recorded]:
    """qwen serves, llama is asked for, qwen is put to sleep to make room, and so on."""
    wall = Wall()
    store = await EventStore.open(path, wall=wall)
    d1, d2 = m.deployment_stream("d1"), m.deployment_stream("d2")

    async def at(offset: float, stream: str, actor: str, *events: m.AnyEvent) -> None:
        wall.now = T0 + offset
        await store.append(stream, list(events), actor=actor)

    for dep, name in (("d1", "qwen"), ("d2", "llama")):
        created = m.DeploymentCreated(
            deployment_id=dep,
            name=name,
            engine="vllm",
            model=f"org/{name}",
            memory_bytes=80 * GIB,
            mode="on_demand",
        )
        await at(-600, m.deployment_stream(dep), "admin:alice", created)
    await at(
        -590,
        m.STREAM_USERS,
        "system",
        m.UserCreated(name="alice", role="admin", password_hash="scrypt$secret"),
    )
    await at(-500, d1, "ondemand", m.StartRequested(reason="request", request_id="r0"))
    await at(-499, d1, "ondemand", m.EngineStarting(runtime_id="c1", host="127.0.0.1", port=9001))
    await at(-450, d1, "ondemand", m.EngineReady())
    queued = m.RequestQueued(
        request_id="r1",
        deployment_id="d2",
        kind="queued",
        position=1,
        arrived_at=T0 - 100,
        free_bytes=20 * GIB,
        needed_bytes=80 * GIB,
    )
    await at(-100, m.STREAM_QUEUE, "ondemand", queued)
    await at(
        -40, d1, "ondemand", m.PutToSleep(reason="make_room", for_deployment="d2", for_name="llama")
    )
    await at(-35, d1, "ondemand", m.EngineStopped())
    await at(
        -34, m.STREAM_QUEUE, "ondemand", m.RequestAdmitted(request_id="r1", deployment_id="d2")
    )
    await at(-34, d2, "ondemand", m.StartRequested(reason="request", request_id="r1"))
    await at(-33, d2, "ondemand", m.EngineStarting(runtime_id="c2", host="127.0.0.1", port=9002))
    await at(0, d2, "ondemand", m.EngineReady())
    await at(
        0,
        m.STREAM_QUEUE,
        "ondemand",
        m.RequestLeftQueue(request_id="r1", deployment_id="d2", reason="served", waited_s=100),
    )
    await at(
        10,
        m.STREAM_QUEUE,
        "ondemand",
        m.RequestQueued(
            request_id="r2",
            deployment_id="d1",
            kind="queued",
            position=1,
            arrived_at=T0 + 10,
            free_bytes=20 * GIB,
            needed_bytes=80 * GIB,
        ),
    )
    await at(
        20,
        m.STREAM_QUEUE,
        "ondemand",
        m.RequestQueued(
            request_id="r3", deployment_id="d1", kind="queued", position=2, arrived_at=T0 + 20
        ),
    )
    await at(100, d1, "admin:alice", m.ModeChanged(mode="on_demand", idle_timeout_s=600))
    await at(
        910,
        m.STREAM_QUEUE,
        "ondemand",
        m.RequestLeftQueue(request_id="r2", deployment_id="d1", reason="timeout", waited_s=900),
    )
    await at(
        920,
        m.STREAM_QUEUE,
        "ondemand",
        m.RequestLeftQueue(request_id="r3", deployment_id="d1", reason="timeout", waited_s=900),
    )
    await at(1000, d2, "ondemand", m.PutToSleep(reason="idle", idle_timeout_s=300, idle_for_s=300))
    await at(1001, d2, "ondemand", m.EngineStopped())
    await at(
        1100,
        m.STREAM_SETTINGS,
        "admin:alice",
        m.SettingsChanged(changes={"ondemand_max_queued": 32}),
    )
    records = await store.read()
    await store.close()
    return records


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[m.Recorded]]:
    """A log file with a small incident in it."""
    path = tmp_path_factory.mktemp("cli") / "dgxmm.db"
    records = asyncio.run(write_incident(path))
    return path, records


# A state directory where no `dgxmm serve` registers.
NO_SERVERS = Path(tempfile.gettempdir()) / "dgxmm-tests-no-servers"


def dgxmm(
    *args: str, tz: str = "UTC", timeout: float = DEADLINE_S
) -> subprocess.CompletedProcess[str]:
    """Run the `dgxmm` command (as a user who runs no DGXMM: it never takes a server that
    another test runs, `dgxmm.where`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TZ": tz, "XDG_STATE_HOME": str(NO_SERVERS)}
    env.pop("DGXMM_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def ok(*args: str) -> str:
    """Run `dgxmm` and return its output, asserting it succeeded quietly."""
    done = dgxmm(*args)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


# --- replay ---------------------------------------------------------------------------------


def replay_doc(*args: str) -> dict[str, Any]:
    """`dgxmm replay --json` (JSON lines) put back together into one document."""
    return replay_document(ok("replay", *args, "--json"))


def test_replay_prints_each_deployments_state_and_the_timeline_that_led_there(
    incident: tuple[Path, list[m.Recorded]],
) -> None:
    path, _ = incident
    out = ok("replay", "--db", str(path))
    assert "qwen (d1): Sleeping (on demand)" in out
    assert "llama (d2): Sleeping (on demand)" in out
    assert "Put to sleep to make room for llama" in out
    assert "Put to sleep after 5 min idle" in out
    assert "Started for a request" in out
    assert "Queued request timed out" in out
    assert (
        "Request r1 queued at position 1, waiting for memory (20.0 GiB free, needs 80.0 GiB)" in out
    )
    assert "Request r1 left the queue: served after 100.0 s" in out
    assert "2026-11-30 10:41:20.000+00:00  ondemand     Put to sleep to make room for llama" in out
    assert "settings changed from the defaults: ondemand_max_queued=32" in out
    assert "scrypt$secret" not in out


def test_replay_until_shows_the_moment_asked_for(incident: tuple[Path, list[m.Recorded]]) -> None:
    path, _ = incident
    out = ok("replay", "--db", str(path), "--until", "2026-11-30T10:42:00Z", "--deployment", "qwen")
    assert "qwen (d1): 2 queued" not in out  # r2 and r3 arrive later
    assert "qwen (d1): Sleeping (on demand)" in out
    assert "stopped since 2026-11-30 10:41:25.000+00:00 (stop reason: make_room)" in out
    assert "llama (d2):" not in out
    later = ok("replay", "--db", str(path), "--until", str(T0 + 30), "--deployment", "d1")
    assert "qwen (d1): 2 queued" in later
    assert "queue: 2 waiting" in later


def test_replay_json_state_equals_folding_the_events_up_to_until(
    incident: tuple[Path, list[m.Recorded]],
) -> None:
    path, records = incident
    for until in (T0 - 1000, T0 - 40, T0, T0 + 915, T0 + 5000):
        doc = replay_doc("--db", str(path), "--until", repr(until))
        state = msgspec.convert(doc["state"], SystemState)
        expected = fold([r for r in records if r.ts <= until])
        assert state.deployments == expected.deployments
        assert state.queue == expected.queue
        assert state.last_seq == expected.last_seq
        assert all(u.password_hash == "<redacted>" for u in state.users.values())


def test_replay_json_describes_lifecycle_mode_failures_and_memory(
    incident: tuple[Path, list[m.Recorded]],
) -> None:
    path, _ = incident
    doc = replay_doc("--db", str(path), "--until", repr(T0 + 5))
    views = {d["name"]: d for d in doc["deployments"]}
    assert views["llama"]["lifecycle"] == "ready"
    assert views["llama"]["badge"] == "Ready"
    assert views["llama"]["endpoint"] == "127.0.0.1:9002"
    assert views["qwen"]["stop_reason"] == "make_room"
    assert views["qwen"]["mode"] == "on_demand"
    assert views["qwen"]["pending_mode"] is None
    assert views["qwen"]["failures"] == 0
    assert doc["memory_held_bytes"] == 80 * GIB
    titles = [t["title"] for t in views["qwen"]["timeline"]]
    assert titles[:4] == ["Created (on demand)", "Started for a request", "Loading", "Ready"]


def test_replay_of_one_request_tells_its_story(incident: tuple[Path, list[m.Recorded]]) -> None:
    path, _ = incident
    out = ok("replay", "--db", str(path), "--request", "r1")
    lines = out.splitlines()
    assert lines[0] == "request r1 for llama: left the queue: served"
    story = "\n".join(lines[1:])
    order = [
        "Request r1 queued at position 1, waiting for memory (20.0 GiB free, needs 80.0 GiB)",
        "Put to sleep to make room for llama",
        "Request r1 admitted",
        "Started for a request",
        "Ready",
        "Request r1 left the queue: served after 100.0 s",
    ]
    positions = [story.index(text) for text in order]
    assert positions == sorted(positions)
    doc = json.loads(ok("replay", "--db", str(path), "--request", "r1", "--json"))
    assert doc["deployment"] == "llama"
    assert doc["story"][0]["type"] == "RequestQueued"


def test_replay_of_an_unknown_request_or_deployment_says_so_in_one_line(
    incident: tuple[Path, list[m.Recorded]],
) -> None:
    path, _ = incident
    for args in (["--request", "nope"], ["--deployment", "nope"]):
        done = dgxmm("replay", "--db", str(path), *args)
        assert done.returncode == 1
        assert len(done.stderr.splitlines()) == 1
        assert "nope" in done.stderr


def test_replay_reports_an_impossible_event_and_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "odd.db"

    async def write() -> None:
        store = await EventStore.open(path)
        created = m.DeploymentCreated(
            deployment_id="d1", name="qwen", engine="vllm", model="q", memory_bytes=GIB
        )
        await store.append("deployment:d1", [created], actor="admin:alice")
        await store.append("deployment:d1", [m.EngineReady()], actor="system")  # while stopped
        await store.append("deployment:d1", [m.StartRequested(reason="admin")], actor="admin:a")
        await store.close()

    asyncio.run(write())
    out = ok("replay", "--db", str(path))
    assert "warning: event 2 (EngineReady) skipped: EngineReady cannot happen while stopped" in out
    assert "(event 3 of 3" in out


# --- events ---------------------------------------------------------------------------------


def test_events_prints_one_line_per_event(incident: tuple[Path, list[m.Recorded]]) -> None:
    path, records = incident
    lines = ok("events", "--db", str(path)).splitlines()
    assert len(lines) == len(records)
    assert lines[0].split()[0] == "1"
    assert "qwen (d1) v1 admin:alice DeploymentCreated" in lines[0]
    assert '"name":"qwen"' in lines[0]
    assert '"memory":"80.0 GiB"' in lines[0]  # sizes for people, not bytes


def test_events_json_lines_decode_back_into_the_records(
    incident: tuple[Path, list[m.Recorded]],
) -> None:
    path, records = incident
    lines = ok("events", "--db", str(path), "--json").splitlines()
    assert [m.decode_recorded(line) for line in lines] == [redact_record(r) for r in records]
    assert "scrypt$secret" not in "".join(lines)


def read_lines_until(proc: subprocess.Popen[bytes], count: int) -> list[str]:
    """Lines from the child's stdout until there are `count`, within the deadline."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buffer = b""
    deadline = time.monotonic() + DEADLINE_S
    while buffer.count(b"\n") < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only got {buffer!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, "the follower exited"
            buffer += chunk
    return buffer.decode().splitlines()


def wait_for_stderr_line(proc: subprocess.Popen[bytes]) -> str:
    """The child's first line on stderr, within the deadline."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    buffer = b""
    deadline = time.monotonic() + DEADLINE_S
    while b"\n" not in buffer:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only got {buffer!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 1)  # one byte at a time: nothing after the line is taken
            assert chunk, "the follower exited"
            buffer += chunk
    return buffer.decode().strip()


@contextlib.contextmanager
def ctrl_c_for_children() -> Iterator[None]:
    """Children started inside get SIGINT at its default, as at a terminal, even when this
    run inherited it ignored.  A shell without job control (a script's `cmd &`, `bash -c
    '... &'`) starts its background commands with SIGINT ignored, Python keeps an ignored
    SIGINT ignored, and so would the follower: it is what made the follow tests of one CI
    run (started that way) wait out their deadline.  A caught signal is reset to its
    default at exec, so catching it here for the moment of the fork is enough."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_children_get_ctrl_c_even_when_this_run_ignores_it() -> None:
    def ignores_sigint() -> bool:
        with ctrl_c_for_children():
            out = subprocess.run(
                ["grep", "^SigIgn:", "/proc/self/status"], capture_output=True, check=True
            ).stdout
        return bool(int(out.split()[1], 16) & (1 << (signal.SIGINT - 1)))

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job starts
    try:
        assert not ignores_sigint()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # this run's is left as it was
    finally:
        signal.signal(signal.SIGINT, before)
    assert not ignores_sigint()


def follower(path: Path, *args: str, as_json: bool = True) -> tuple[subprocess.Popen[bytes], int]:
    """`dgxmm events --db PATH --follow --json ARGS...` once it follows, and where it began."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with ctrl_c_for_children():
        proc = subprocess.Popen(
            [
                sys.executable,
                "-X",
                "faulthandler",  # for `stop_follower`: its threads' stacks on SIGABRT
                "-m",
                "dgxmm.cli",
                "events",
                "--db",
                str(path),
                "--follow",
                *(["--json"] if as_json else []),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
    try:
        said = wait_for_stderr_line(proc)
        assert said.startswith(f"dgxmm: following {path} after event "), said
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, int(said.rsplit(" ", 1)[1])


def stop_follower(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C: the follower exits with 130 and no traceback.  One that does not exit in time
    fails the test with the stacks of its threads (faulthandler, on SIGABRT)."""
    try:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=DEADLINE_S)
            stacks = err.decode(errors="replace")
            raise AssertionError(f"the follower ignored SIGINT; its threads:\n{stacks}") from None
        assert proc.returncode == 130
        assert b"Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def append_setting(path: Path, n: int) -> None:
    """One settings event appended to the log at `path`."""
    store = await EventStore.open(path)
    await store.append("settings", [m.SettingsChanged(changes={"n": n})], actor="admin:a")
    await store.close()


def test_events_follow_starts_at_now_and_prints_new_events_as_they_are_appended(
    tmp_path: Path,
) -> None:
    path = tmp_path / "live.db"

    asyncio.run(append_setting(path, 1))
    proc, start = follower(path)
    assert start == 1
    try:
        asyncio.run(append_setting(path, 2))
        line = read_lines_until(proc, 1)
        assert m.decode_recorded(line[0]).seq == 2  # event 1 was there before: not shown
    finally:
        stop_follower(proc)


def test_events_follow_relative_says_how_long_ago_each_new_event_happened(
    tmp_path: Path,
) -> None:
    path = tmp_path / "live.db"

    asyncio.run(append_setting(path, 1))
    proc, _ = follower(path, "--relative", as_json=False)
    try:
        asyncio.run(append_setting(path, 2))  # after the follower began: in its past when shown
        (line,) = read_lines_until(proc, 1)
        assert re.match(r" *2 [0-9.]+ s ago settings ", line), line
    finally:
        stop_follower(proc)


def test_the_relative_flag_of_events_and_audit_mentions_no_until() -> None:
    for command in ("events", "audit"):
        helped = ok(command, "--help")
        assert "--until" not in helped, helped


def test_events_follow_since_goes_back_first(tmp_path: Path) -> None:
    path = tmp_path / "live.db"

    asyncio.run(append_setting(path, 1))
    proc, _ = follower(path, "--since", "0")
    try:
        assert m.decode_recorded(read_lines_until(proc, 1)[0]).seq == 1
    finally:
        stop_follower(proc)


# --- audit ----------------------------------------------------------------------------------


def test_audit_lists_the_seeds_actions(incident: tuple[Path, list[m.Recorded]]) -> None:
    path, _ = incident
    out = ok("audit", "--db", str(path))
    actions = [line.split()[3] for line in out.splitlines()]
    assert actions == [
        "deployment_create",
        "deployment_create",
        "user_create",
        "ondemand_start",
        "ondemand_sleep",
        "ondemand_start",
        "ondemand_mode",
        "ondemand_queue_timeout",  # r3 ten seconds later is not audited again
        "ondemand_sleep",
        "settings_change",
    ]
    assert "ondemand_sleep           qwen (d1)  reason=make_room for=llama" in out
    assert "ondemand_sleep           llama (d2)  reason=idle" in out


def test_audit_filters_by_deployment_and_since(incident: tuple[Path, list[m.Recorded]]) -> None:
    path, _ = incident
    rows = [
        json.loads(line)
        for line in ok(
            "audit",
            "--db",
            str(path),
            "--deployment",
            "qwen",
            "--since",
            "2026-11-30T10:41:00Z",
            "--json",
        ).splitlines()
    ]
    assert [r["action"] for r in rows] == [
        "ondemand_sleep",
        "ondemand_mode",
        "ondemand_queue_timeout",
    ]
    assert {r["deployment"] for r in rows} == {"qwen"}
    assert rows[0]["details"] == {"reason": "make_room", "for": "llama"}
    assert rows[0]["actor"] == "ondemand"


def test_audit_since_reads_naive_times_as_local_time(
    incident: tuple[Path, list[m.Recorded]],
) -> None:
    path, _ = incident
    # 10:42 local in UTC-3 is 13:42 UTC: after everything in the log.
    done = dgxmm("audit", "--db", str(path), "--since", "2026-11-30T10:42:00", tz="XYZ+3")
    assert done.returncode == 0 and done.stdout == ""
    done = dgxmm("audit", "--db", str(path), "--since", "2026-11-30T10:42:00", tz="UTC")
    assert done.stdout.splitlines()[0].split()[3] == "ondemand_mode"


# --- times ----------------------------------------------------------------------------------


def test_times_are_iso_8601_with_or_without_zone_or_epoch_seconds() -> None:
    assert parse_time("2026-11-30T10:42:00Z") == T0
    assert parse_time("2026-11-30T10:42:00+01:00") == T0 - 3600
    assert parse_time(str(T0)) == T0
    assert parse_time("1796035320") == T0
    naive = dt.datetime(2026, 11, 30, 10, 42).timestamp()
    assert parse_time("2026-11-30T10:42:00") == naive
    assert parse_time("2026-11-30 10:42") == naive
    for bad in ("yesterday", "nan", "inf", "", "-h", "-xh", "-2w", "25:00", "-infh", "--2h"):
        with pytest.raises(ValueError):
            parse_time(bad, now=T0)


def test_a_time_of_today_and_a_time_ago_are_times_too() -> None:
    """`--since 17:30` and `--since -2h` (a new user's first tries, refused before)."""
    now = dt.datetime(2026, 11, 30, 18, 5, 7).timestamp()
    assert parse_time("17:30", now=now) == dt.datetime(2026, 11, 30, 17, 30).timestamp()
    assert parse_time("17:30:15", now=now) == dt.datetime(2026, 11, 30, 17, 30, 15).timestamp()
    assert parse_time("-2h", now=now) == now - 7200
    assert parse_time("-30m", now=now) == now - 1800
    assert parse_time("-90s", now=now) == now - 90
    assert parse_time("-1d", now=now) == now - 86400
    assert parse_time("-1.5h", now=now) == now - 5400


def test_a_time_ago_and_a_time_of_today_work_as_options(
    incident: tuple[Path, list[m.Recorded]],
) -> None:
    path, _ = incident  # recorded in 2026-11: long before any time ago of now
    for since in ("-2h", "-1.5d", "00:00"):
        done = dgxmm("audit", "--db", str(path), "--since", since)
        assert done.returncode == 0 and done.stdout == "", (since, done.stderr)
    done = dgxmm("replay", "--db", str(path), "--until", "-1d", "--all")
    assert done.returncode == 0 and done.stdout, done.stderr


def test_a_bad_time_is_a_usage_error(incident: tuple[Path, list[m.Recorded]]) -> None:
    path, _ = incident
    done = dgxmm("replay", "--db", str(path), "--until", "yesterday")
    assert done.returncode == 2
    assert "not a time: 'yesterday'" in done.stderr
    assert "Traceback" not in done.stderr


# --- files that are not readable logs -------------------------------------------------------


def bad_files(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A missing, a corrupt and a foreign file."""
    yield "missing", tmp_path / "missing.db"
    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(16384))
    yield "corrupt", junk
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE songs (title TEXT)")
    yield "not ours", other


@pytest.mark.parametrize("command", ["replay", "events", "audit"])
def test_a_missing_corrupt_or_foreign_file_gives_one_line_and_exit_2(
    tmp_path: Path, command: str
) -> None:
    for what, path in bad_files(tmp_path):
        done = dgxmm(command, "--db", str(path))
        assert done.returncode == 2, (what, done)
        assert len(done.stderr.splitlines()) == 1, (what, done.stderr)
        assert done.stderr.startswith(f"dgxmm: {path}"), (what, done.stderr)
        assert done.stdout == ""
    assert not (tmp_path / "missing.db").exists()


def test_a_locked_file_gives_one_line_and_exit_2(
    incident: tuple[Path, list[m.Recorded]], tmp_path: Path
) -> None:
    path = tmp_path / "locked.db"
    path.write_bytes(incident[0].read_bytes())
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode=EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("INSERT INTO meta VALUES ('lock', 'held')")
        done = dgxmm("replay", "--db", str(path))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"dgxmm: {path}: the database is locked by another process"]


def test_the_log_is_opened_read_only(
    incident: tuple[Path, list[m.Recorded]], tmp_path: Path
) -> None:
    path = tmp_path / "copy.db"
    path.write_bytes(incident[0].read_bytes())
    before = path.read_bytes()
    ok("replay", "--db", str(path))
    ok("audit", "--db", str(path))
    assert path.read_bytes() == before


# --- serve and user add ---------------------------------------------------------------------


def test_serve_with_a_missing_config_file_says_so_in_one_line_and_exits_2(
    tmp_path: Path,
) -> None:
    done = dgxmm("serve", "--config", str(tmp_path / "nope.toml"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"dgxmm: {tmp_path / 'nope.toml'}: no such file"]


def test_serve_with_an_unknown_config_key_names_it_and_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "dgxmm.toml"
    cfg.write_text("ondemand_idle_timeout_s = 300\n[server]\nadmin_prot = 1\n")
    done = dgxmm("serve", "--config", str(cfg))
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert "admin_prot" in line


def test_usage_errors_exit_2() -> None:
    assert dgxmm().returncode == 2
    assert dgxmm("user", "add", "alice", "--role", "root").returncode == 2
    assert dgxmm("replay").returncode == 2


# --- events --follow against a real `dgxmm serve` -------------------------------------------


def http(
    url: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    """One JSON request: status, headers, decoded body."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=hdrs, method="POST")
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as answer:
        found = {k.lower(): v for k, v in answer.headers.items()}
        # A login sets two cookies (the session and the known-client one): keep the session's.
        sessions = [c for c in answer.headers.get_all("set-cookie") or [] if "session" in c]
        if sessions:
            found["set-cookie"] = sessions[0]
        return answer.status, found, json.loads(answer.read())


def test_events_follow_of_one_deployment_prints_only_its_new_events_from_a_running_serve(
    tmp_path: Path,
) -> None:
    proc, banner = start_demo(tmp_path, DEADLINE_S)
    db = tmp_path / "dgxmm-data" / "dgxmm.db"
    follow: subprocess.Popen[bytes] | None = None
    try:
        ids = dict(re.findall(r"deployment +: (\S+) \((\w+),", banner))
        password = re.search(r"admin login +: admin / (\S+)", banner)
        url = re.search(r"curl -s (\S+)", banner)
        body = re.search(r"-d '(.+)'", banner)
        admin = re.search(r"(http://127\.0\.0\.1:\d+)/dgxmm/", banner)
        assert password and url and body and admin, banner
        follow, start = follower(db, "--deployment", "demo-chat")
        # Another deployment changes after the follower started: not for this follower.
        _, headers, session = http(
            f"{admin[1]}/dgxmm/api/login", {"name": "admin", "password": password[1]}
        )
        cookie = headers["set-cookie"].split(";")[0]
        for name in ("demo-always", "demo-chat"):
            http(
                f"{admin[1]}/dgxmm/api/deployments/{ids[name]}/stop",
                {},
                {"cookie": cookie, "x-csrf-token": session["csrf_token"]},
            )
        # demo-chat is stopped: this request starts it, waits in the queue, and is served.
        status, _, reply = http(url[1], json.loads(body[1]), banner_auth(banner))
        assert status == 200 and reply["object"] == "chat.completion"
        lines: list[m.Recorded] = []
        while not any(r.type == "RequestLeftQueue" for r in lines):
            lines += [m.decode_recorded(line) for line in read_lines_until(follow, 1)]
        chat = ids["demo-chat"]
        for rec in lines:
            ev = rec.event
            assert rec.stream == f"deployment:{chat}" or (
                isinstance(ev, m.RequestQueued | m.RequestAdmitted | m.RequestLeftQueue)
                and ev.deployment_id == chat
            ), rec
        assert all(r.seq > start for r in lines)  # nothing from before the follower started
        types = [r.type for r in lines]
        assert {"StopRequested", "RequestQueued", "EngineReady"} <= set(types)
    finally:
        if follow is not None:
            stop_follower(follow)
        stop_demo(proc)
    # The other deployment's stop was recorded after the follower started.
    stops = ok("events", "--db", str(db), "--deployment", "demo-always", "--type", "StopRequested")
    assert [int(line.split()[0]) > start for line in stops.splitlines()] == [True]


# --- archive --------------------------------------------------------------------------------


def test_archive_moves_old_queue_events_and_leaves_the_audit_trail_and_states_as_they_were(
    incident: tuple[Path, list[m.Recorded]], tmp_path: Path
) -> None:
    path, records = incident
    log = tmp_path / "log.db"
    log.write_bytes(path.read_bytes())
    audit_before = ok("audit", "--db", str(log))
    state_before = replay_doc("--db", str(log))["state"]
    out = ok("archive", "--db", str(log), "--before", repr(T0 + 15))
    archive = tmp_path / "log.archive.db"
    assert out.startswith(
        f"moved 4 queue events from before 2026-11-30 10:42:15.000+00:00 to {archive}"
    )
    moved = [
        m.decode_recorded(line)
        for line in ok("events", "--db", str(archive), "--json").splitlines()
    ]
    kept = [
        m.decode_recorded(line) for line in ok("events", "--db", str(log), "--json").splitlines()
    ]
    # r1's three events and r2's arrival (before the moment), nothing else.
    assert [(r.type, r.event.request_id) for r in moved] == [  # type: ignore[union-attr]
        ("RequestQueued", "r1"),
        ("RequestAdmitted", "r1"),
        ("RequestLeftQueue", "r1"),
        ("RequestQueued", "r2"),
    ]
    assert sorted(r.seq for r in moved + kept) == [r.seq for r in records]  # moved, not lost
    assert ok("audit", "--db", str(log)) == audit_before
    assert replay_doc("--db", str(log))["state"]["deployments"] == state_before["deployments"]
    story = ok("replay", "--db", str(archive), "--request", "r1")
    assert story.startswith("request r1 for d2: left the queue: served")
    assert "Request r1 queued at position 1" in story
    # Again: nothing more to move, and the newest queue event never moves.
    assert ok("archive", "--db", str(log), "--before", repr(T0 + 5000)).startswith("moved 1 ")
    last_queue = [r for r in records if r.stream == m.STREAM_QUEUE][-1]
    assert last_queue.seq in {
        m.decode_recorded(line).seq
        for line in ok("events", "--db", str(log), "--json").splitlines()
    }


def test_replay_and_audit_read_a_log_without_read_models_the_same_way(
    incident: tuple[Path, list[m.Recorded]], tmp_path: Path
) -> None:
    path, _ = incident
    bare = tmp_path / "bare.db"
    bare.write_bytes(path.read_bytes())
    with sqlite3.connect(bare) as conn:  # as a log written before read models existed
        conn.execute("DELETE FROM meta WHERE key LIKE 'readmodel_%'")
        conn.execute("DELETE FROM audit")
        conn.execute("DELETE FROM timeline")
    for args in (["replay"], ["replay", "--last", "3"], ["replay", "--until", repr(T0)], ["audit"]):
        with_models = ok(*args, "--db", str(path)).replace(str(path), "LOG")
        without = ok(*args, "--db", str(bare)).replace(str(bare), "LOG")
        assert without == with_models, args


def test_replay_of_a_request_id_this_log_never_gave_out_says_not_in_the_log(
    incident: tuple[Path, list[m.Recorded]],
) -> None:
    # A gateway id is its start second times a million plus a counter: 999 was never
    # given out (second 0), nor 9999999999999999 (the year 2286); an id from the log's
    # own time is a request served at once.
    path, _ = incident
    for rid in ("999", "9999999999999999"):
        done = dgxmm("replay", "--db", str(path), "--request", rid)
        assert done.returncode == 1, done.stdout
        assert "not in the log" in done.stderr
        assert rid in done.stderr
    plausible = str(int(T0) * 1_000_000 + 7)
    out = ok("replay", "--db", str(path), "--request", plausible)
    assert "served at once" in out
