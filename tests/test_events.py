"""Events, the pure fold and the projections, driven by random but legal histories."""

from __future__ import annotations

import asyncio
import contextlib
import io
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgxmm import cli
from dgxmm.replay import redact
from events import model as m
from events.projections import audit_rows, badge, deployment_events
from events.state import (
    EMPTY,
    DeploymentState,
    Lifecycle,
    SystemState,
    can_happen,
    evolve,
    fold,
    next_lifecycle,
)
from storage.eventlog import EventStore
from tests.replay_support import replay_document

T0 = 1_767_225_600.0
GIB = 1 << 30
ACTORS = ["admin:alice", "admin:bob", "ondemand", "watchdog", "system", "litellm"]
DEPLOYMENT_IDS = ["d1", "d2", "d3", "d4", "d5"]

# One example of every event that moves the lifecycle, to ask `can_happen` which are legal.
LIFECYCLE_PROTOTYPES: list[m.AnyEvent] = [
    m.StartRequested(reason="admin"),
    m.EngineStarting(runtime_id="r", host="h", port=1),
    m.EngineReady(),
    m.EngineStartFailed(reason="x", failures=1),
    m.StopRequested(),
    m.PutToSleep(reason="idle"),
    m.EngineStopped(),
    m.EngineLost(reason="x"),
    m.EngineAsleep(),
    m.EngineAwake(),
    m.EngineAdopted(runtime_id="r", host="h", port=1),
]

small_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=8)
setting_values = st.one_of(st.integers(-(10**6), 10**6), st.booleans(), small_text)
time_steps = st.one_of(
    st.sampled_from([0.0, 0.0, 0.001, 1.0, 30.0, 59.9, 60.0, 61.0, 300.0]),
    st.floats(min_value=0, max_value=900).map(lambda x: round(x, 3)),
)


def build_lifecycle_event(draw: st.DrawFn, proto: m.AnyEvent, dep_ids: list[str]) -> m.AnyEvent:
    """A random event of the same type as `proto`."""
    match proto:
        case m.StartRequested():
            reason = draw(st.sampled_from(get_args(m.StartReason)))
            rid = draw(st.none() | small_text) if reason == "request" else None
            return m.StartRequested(reason=reason, request_id=rid)
        case m.EngineStarting():
            return m.EngineStarting(
                runtime_id=draw(small_text), host="127.0.0.1", port=draw(st.integers(1, 65535))
            )
        case m.EngineAdopted():
            return m.EngineAdopted(
                runtime_id=draw(small_text), host="127.0.0.1", port=draw(st.integers(1, 65535))
            )
        case m.EngineStartFailed():
            failures = draw(st.integers(1, 6))
            retry = draw(st.none() | st.floats(T0, T0 + 10**6).map(lambda x: round(x, 3)))
            return m.EngineStartFailed(reason=draw(small_text), failures=failures, retry_at=retry)
        case m.StopRequested():
            return m.StopRequested(reason=draw(st.sampled_from(get_args(m.StopReason))))
        case m.PutToSleep():
            reason = draw(st.sampled_from(get_args(m.SleepReason)))
            if reason == "idle":
                return m.PutToSleep(reason="idle", idle_timeout_s=draw(st.integers(60, 86400)))
            if reason == "make_room":
                other = draw(st.sampled_from(dep_ids))
                return m.PutToSleep(reason="make_room", for_deployment=other)
            return m.PutToSleep(reason="watchdog", free_bytes=draw(st.integers(0, 8 * GIB)))
        case m.EngineLost():
            return m.EngineLost(reason=draw(small_text))
    return proto  # events without fields


def build_config_event(draw: st.DrawFn) -> m.AnyEvent:
    """A random event that changes a deployment's configuration or mode."""
    mode = draw(st.sampled_from(get_args(m.Mode)))
    memory = draw(st.none() | st.integers(1, 64).map(lambda n: n * GIB))
    match draw(st.integers(0, 4)):
        case 0:
            return m.ModeChanged(mode=mode, idle_timeout_s=draw(st.none() | st.integers(60, 86400)))
        case 1:
            return m.PendingModeSet(mode=mode)
        case 2:
            return m.PendingModeCleared(applied=draw(st.booleans()))
        case 3:
            return m.DeploymentReconfigured(
                memory_bytes=memory, gpu=draw(st.none() | st.booleans())
            )
        case _:
            return m.ModelSwitched(model=draw(small_text), memory_bytes=memory)


class HistoryBuilder:
    """Appends legal events, numbering them the way the store does."""

    def __init__(self) -> None:
        self.records: list[m.Recorded] = []
        self.ts = T0
        self.versions: dict[str, int] = {}
        self.lifecycles: dict[str, Lifecycle] = {}  # live deployments
        self.known: list[str] = []  # every deployment id ever created
        self.waiting: dict[str, str] = {}  # request id -> deployment id
        self.requests = 0
        self.users: list[str] = []

    def add(self, stream: str, event: m.AnyEvent, actor: str, step: float) -> None:
        """Record `event` on `stream`, `step` seconds after the previous one."""
        self.ts = round(self.ts + step, 3)
        version = self.versions.get(stream, 0) + 1
        self.versions[stream] = version
        self.records.append(
            m.Recorded(
                seq=len(self.records) + 1,
                ts=self.ts,
                stream=stream,
                version=version,
                actor=actor,
                event=event,
            )
        )


KINDS = [
    *["create"] * 2,
    *["lifecycle"] * 10,
    *["config"] * 2,
    "remove",
    *["queue"] * 3,
    "admit",
    *["leave"] * 2,
    "settings",
    "user",
    "login",
    "litellm",
]


@st.composite
def histories(draw: st.DrawFn, max_steps: int = 60) -> list[m.Recorded]:
    """A random legal history over several deployments, the queue, settings and users."""
    h = HistoryBuilder()
    for _ in range(draw(st.integers(0, max_steps))):
        kind = draw(st.sampled_from(KINDS))
        actor = draw(st.sampled_from(ACTORS))
        step = draw(time_steps)
        live = sorted(h.lifecycles)
        if kind in ("lifecycle", "config", "remove", "queue") and not live:
            kind = "create"
        match kind:
            case "create":
                free = [d for d in DEPLOYMENT_IDS if d not in h.lifecycles]
                if not free:
                    continue
                dep = draw(st.sampled_from(free))
                created = m.DeploymentCreated(
                    deployment_id=dep,
                    name=f"model-{dep}-{draw(small_text)}",
                    engine=draw(st.sampled_from(["vllm", "llamacpp", "sglang", "sim"])),
                    model=draw(small_text),
                    memory_bytes=draw(st.integers(1, 64)) * GIB,
                    mode=draw(st.sampled_from(get_args(m.Mode))),
                    idle_timeout_s=draw(st.none() | st.integers(60, 86400)),
                    args=draw(st.lists(small_text, max_size=3)),
                )
                h.add(m.deployment_stream(dep), created, "admin:alice", step)
                h.lifecycles[dep] = Lifecycle.STOPPED
                h.known.append(dep)
            case "lifecycle":
                dep = draw(st.sampled_from(live))
                legal = [p for p in LIFECYCLE_PROTOTYPES if can_happen(h.lifecycles[dep], p)]
                change = build_lifecycle_event(draw, draw(st.sampled_from(legal)), h.known)
                h.lifecycles[dep] = next_lifecycle(h.lifecycles[dep], change)
                h.add(m.deployment_stream(dep), change, actor, step)
            case "config":
                dep = draw(st.sampled_from(live))
                h.add(m.deployment_stream(dep), build_config_event(draw), actor, step)
            case "remove":
                dep = draw(st.sampled_from(live))
                h.add(m.deployment_stream(dep), m.DeploymentRemoved(), "admin:bob", step)
                del h.lifecycles[dep]
            case "queue":
                h.requests += 1
                rid = f"req-{h.requests}"
                dep = draw(st.sampled_from(live))
                h.waiting[rid] = dep
                queued = m.RequestQueued(
                    request_id=rid,
                    deployment_id=dep,
                    kind=draw(st.sampled_from(get_args(m.WaitKind))),
                    position=len(h.waiting),
                    arrived_at=h.ts + step,
                    free_bytes=draw(st.integers(0, 128)) * GIB,
                    needed_bytes=draw(st.integers(1, 64)) * GIB,
                )
                h.add(m.STREAM_QUEUE, queued, "ondemand", step)
            case "admit" | "leave" if h.waiting:
                rid = draw(st.sampled_from(sorted(h.waiting)))
                dep = h.waiting[rid]
                if kind == "admit":
                    event: m.AnyEvent = m.RequestAdmitted(
                        request_id=rid, deployment_id=dep, jumped_ahead=draw(st.booleans())
                    )
                else:
                    del h.waiting[rid]
                    event = m.RequestLeftQueue(
                        request_id=rid,
                        deployment_id=dep,
                        reason=draw(st.sampled_from([*get_args(m.LeaveReason), "timeout"])),
                        waited_s=draw(st.floats(0, 900)),
                    )
                h.add(m.STREAM_QUEUE, event, "ondemand", step)
            case "settings":
                changes = draw(st.dictionaries(small_text, setting_values, max_size=3))
                h.add(m.STREAM_SETTINGS, m.SettingsChanged(changes=changes), actor, step)
            case "user":
                name = draw(st.sampled_from(["alice", "bob", "carol"]))
                if name in h.users and draw(st.booleans()):
                    h.add(m.STREAM_USERS, m.UserRemoved(name=name), "admin:alice", step)
                    h.users.remove(name)
                elif name in h.users:
                    token = m.ApiTokenCreated(name=name, token_id=draw(small_text), token_hash="x")
                    h.add(m.STREAM_USERS, token, "admin:alice", step)
                else:
                    role: Literal["admin", "viewer"] = draw(st.sampled_from(["admin", "viewer"]))
                    user = m.UserCreated(name=name, role=role, password_hash="scrypt$" + name)
                    h.add(m.STREAM_USERS, user, "system", step)
                    h.users.append(name)
            case "login":
                name = draw(st.sampled_from(["alice", "bob", "mallory"]))
                login: m.AnyEvent = (
                    m.UserLoggedIn(name=name) if draw(st.booleans()) else m.LoginFailed(name=name)
                )
                h.add(m.STREAM_USERS, login, f"admin:{name}", step)
            case "litellm":
                ok = draw(st.booleans())
                synced = m.LiteLLMSynced(
                    ok=ok, error=None if ok else draw(small_text), entries=draw(st.integers(0, 9))
                )
                h.add(m.STREAM_LITELLM, synced, "litellm", step)
    return h.records


# --- writing a history into a real log ------------------------------------------------------


class ScriptedWall:
    """The store's wall clock, set by the test before each append."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def write_history(
    path: Path,
    records: Sequence[m.Recorded],
    after_each: Callable[[EventStore, int], Awaitable[None]] | None = None,
) -> EventStore:
    """Append `records` to a new log at `path` so that seq, ts and versions come out equal.

    `after_each(store, n)` runs after each transaction, when the first n records are in.
    """
    wall = ScriptedWall()
    store = await EventStore.open(path, wall=wall)
    i = 0
    while i < len(records):
        # Records sharing a time are appended together: one transaction, same ts, in order.
        j = i
        while j < len(records) and records[j].ts == records[i].ts:
            j += 1
        wall.now = records[i].ts
        await asyncio.gather(
            *(store.append(r.stream, [r.event], actor=r.actor) for r in records[i:j])
        )
        i = j
        if after_each is not None:
            await after_each(store, i)
    return store


def replay_json(path: Path, *args: str) -> dict[str, Any]:
    """Run `dgxmm replay --json` in this process and decode its output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["replay", "--db", str(path), "--json", *args])
    assert code == 0
    return replay_document(out.getvalue())


def encoded(state: SystemState) -> bytes:
    """The state's snapshot encoding, to compare states byte for byte."""
    return msgspec.json.encode(state)


# --- properties of the fold ---------------------------------------------------------------


@given(histories())
def test_replay_is_deterministic_and_never_mutates_a_state(records: list[m.Recorded]) -> None:
    assert fold(records) == fold(records)
    state = EMPTY
    for rec in records:
        before = encoded(state)
        after = evolve(state, rec)
        assert encoded(state) == before
        assert after.last_seq == rec.seq
        state = after
    assert encoded(state) == encoded(fold(records))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), st.data())
def test_a_snapshot_plus_the_rest_of_the_log_folds_to_the_same_state(
    records: list[m.Recorded], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(records)), label="cut")

    async def scenario(path: Path) -> tuple[SystemState, SystemState]:
        store = await write_history(path, records)
        try:
            assert await store.read() == records
            await store.save_snapshot(fold(records[:cut]))
            snapshot = await store.latest_snapshot()
            assert snapshot is not None
            rest = await store.read(since_seq=snapshot.last_seq)
            return snapshot, fold(rest, snapshot)
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as tmp:
        snapshot, resumed = asyncio.run(scenario(Path(tmp) / "log.db"))
    assert snapshot == fold(records[:cut])
    assert resumed == fold(records)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), st.data())
def test_replay_until_t_shows_the_state_of_folding_the_events_up_to_t(
    records: list[m.Recorded], data: st.DataObject
) -> None:
    times = sorted({r.ts for r in records}) or [T0]
    until = data.draw(
        st.one_of(
            st.sampled_from(times),
            st.sampled_from(times).map(lambda t: t - 0.0005),
            st.just(times[0] - 3600),
            st.just(times[-1] + 3600),
        ),
        label="until",
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "log.db"

        async def write() -> None:
            await (await write_history(path, records)).close()

        asyncio.run(write())
        shown = replay_json(path, "--until", repr(until))
    expected = redact(fold([r for r in records if r.ts <= until]))
    assert msgspec.json.decode(msgspec.json.encode(shown["state"]), type=SystemState) == expected
    live = {d["deployment_id"] for d in shown["deployments"] if not d["removed"]}
    assert live == set(expected.deployments)


def test_the_state_keeps_each_deployments_last_use_from_the_traffic_batches() -> None:
    def rec(seq: int, stream: str, event: m.AnyEvent) -> m.Recorded:
        return m.Recorded(seq=seq, ts=T0 + seq, stream=stream, version=1, actor="x", event=event)

    def created(dep: str) -> m.DeploymentCreated:
        return m.DeploymentCreated(
            deployment_id=dep, name=dep, engine="sim", model="x", memory_bytes=1
        )

    def batch(**used: float) -> m.TrafficRecorded:
        return m.TrafficRecorded(
            deployments=list(used), base_time=T0, base_id=0, count=0, data=b"",
            last_used_at=used,
        )  # fmt: skip

    state = fold(
        [
            rec(1, "deployment:a", created("a")),
            rec(2, "deployment:b", created("b")),
            rec(3, "traffic", batch(a=T0 + 10, b=T0 + 5)),
            rec(4, "traffic", batch(a=T0 + 20)),
            rec(5, "traffic", batch(b=T0 + 4)),  # older than b's last use: kept as it was
            rec(6, "traffic", batch(gone=T0 + 30)),  # no such deployment: not kept
        ]
    )
    assert state.last_used_at == {"a": T0 + 20, "b": T0 + 5}
    state = evolve(state, rec(7, "deployment:a", m.DeploymentRemoved()))
    assert state.last_used_at == {"b": T0 + 5}
    old = msgspec.json.decode(b'{"type": "TrafficRecorded", "deployments": ["b"], '
                              b'"base_time": 0, "base_id": 0, "count": 0, "data": ""}',
                              type=m.TrafficRecorded)  # fmt: skip
    assert old.last_used_at == {}  # a batch written before the field decodes, names no use
    assert evolve(state, rec(8, "traffic", old)).last_used_at == state.last_used_at


# --- properties of the projections ----------------------------------------------------------


@given(histories(max_steps=120))
def test_queue_timeouts_are_audited_at_most_once_a_minute_per_deployment(
    records: list[m.Recorded],
) -> None:
    rows = [r for r in audit_rows(records) if r.action == "ondemand_queue_timeout"]
    last: dict[str, float] = {}
    for row in rows:
        if row.target in last:
            assert row.ts - last[row.target] >= 60
        last[row.target] = row.ts
    timed_out = {
        m.deployment_stream(r.event.deployment_id)
        for r in records
        if isinstance(r.event, m.RequestLeftQueue) and r.event.reason == "timeout"
    }
    assert set(last) == timed_out


@given(histories())
def test_every_on_demand_decision_has_its_audit_action(records: list[m.Recorded]) -> None:
    actions = {row.seq: row for row in audit_rows(records)}
    for rec in records:
        ev = rec.event
        if isinstance(ev, m.StartRequested) and ev.reason == "request":
            assert actions[rec.seq].action == "ondemand_start"
        elif isinstance(ev, m.PutToSleep) and ev.reason in ("idle", "make_room"):
            assert actions[rec.seq].action == "ondemand_sleep"
            assert actions[rec.seq].details["reason"] == ev.reason
        elif isinstance(ev, m.ModeChanged):
            assert actions[rec.seq].action == "ondemand_mode"
        if rec.seq in actions:
            assert actions[rec.seq].actor == rec.actor
            assert actions[rec.seq].ts == rec.ts


# --- the seed's exact strings ---------------------------------------------------------------


class Log:
    """A hand-written history, numbered like the store numbers it."""

    def __init__(self) -> None:
        self.records: list[m.Recorded] = []
        self.versions: dict[str, int] = {}

    def at(self, ts: float, stream: str, event: m.AnyEvent, actor: str = "ondemand") -> Log:
        """Record `event` at `T0 + ts`."""
        version = self.versions.get(stream, 0) + 1
        self.versions[stream] = version
        self.records.append(
            m.Recorded(
                seq=len(self.records) + 1,
                ts=T0 + ts,
                stream=stream,
                version=version,
                actor=actor,
                event=event,
            )
        )
        return self


def two_on_demand_models() -> Log:
    """qwen (d1) and llama (d2), both on demand."""
    log = Log()
    for dep, name in (("d1", "qwen"), ("d2", "llama")):
        log.at(
            0,
            m.deployment_stream(dep),
            m.DeploymentCreated(
                deployment_id=dep,
                name=name,
                engine="vllm",
                model=f"org/{name}",
                memory_bytes=40 * GIB,
                mode="on_demand",
            ),
            actor="admin:alice",
        )
    return log


def timeout(ts: float, rid: str, dep: str) -> tuple[float, str, m.AnyEvent]:
    """A queued request that gave up."""
    return (
        ts,
        m.STREAM_QUEUE,
        m.RequestLeftQueue(request_id=rid, deployment_id=dep, reason="timeout"),
    )


def test_events_tab_titles_are_the_seeds() -> None:
    log = two_on_demand_models()
    d1, d2 = m.deployment_stream("d1"), m.deployment_stream("d2")
    log.at(10, d1, m.StartRequested(reason="request", request_id="r1"))
    log.at(11, d1, m.EngineStarting(runtime_id="c1", host="127.0.0.1", port=9000))
    log.at(40, d1, m.EngineReady())
    log.at(400, d1, m.PutToSleep(reason="idle", idle_timeout_s=300, idle_for_s=301))
    log.at(401, d1, m.EngineStopped())
    log.at(500, d2, m.StartRequested(reason="request", request_id="r2"))
    log.at(501, d2, m.EngineStarting(runtime_id="c2", host="127.0.0.1", port=9001))
    log.at(530, d2, m.EngineReady())
    log.at(600, d1, m.StartRequested(reason="request", request_id="r3"))
    log.at(601, d2, m.PutToSleep(reason="make_room", for_deployment="d1"))
    log.at(*timeout(700, "r4", "d1"))
    log.at(*timeout(730, "r5", "d1"))  # within the minute: no second row
    log.at(*timeout(765, "r6", "d1"))
    titles = [row.title for row in deployment_events(log.records, "d1")]
    assert titles == [
        "Created (on demand)",
        "Started for a request",
        "Loading",
        "Ready",
        "Put to sleep after 5 min idle",
        "Stopped",
        "Started for a request",
        "Queued request timed out",
        "Queued request timed out",
    ]
    d2_titles = [row.title for row in deployment_events(log.records, "d2")]
    assert "Put to sleep to make room for qwen" in d2_titles
    rows = deployment_events(log.records, "d1")
    assert rows[1].actor == "ondemand"
    assert rows[-2].ts == T0 + 700 and rows[-1].ts == T0 + 765


def test_idle_titles_write_the_timeout_in_minutes() -> None:
    log = two_on_demand_models()
    d1 = m.deployment_stream("d1")
    log.at(1, d1, m.StartRequested(reason="request"))
    log.at(2, d1, m.EngineStarting(runtime_id="c", host="h", port=1))
    log.at(3, d1, m.EngineReady())
    log.at(4, d1, m.PutToSleep(reason="idle", idle_timeout_s=90))
    assert deployment_events(log.records, "d1")[-1].title == "Put to sleep after 1.5 min idle"


def test_audit_actions_are_the_seeds() -> None:
    log = two_on_demand_models()
    d1, d2 = m.deployment_stream("d1"), m.deployment_stream("d2")
    log.at(5, d1, m.ModeChanged(mode="on_demand", idle_timeout_s=600), actor="admin:alice")
    log.at(10, d1, m.StartRequested(reason="request", request_id="r1"))
    log.at(11, d1, m.EngineStarting(runtime_id="c1", host="127.0.0.1", port=9000))
    log.at(12, d1, m.EngineReady())
    log.at(20, d2, m.StartRequested(reason="request", request_id="r2"))
    log.at(21, d1, m.PutToSleep(reason="make_room", for_deployment="d2", for_name="llama"))
    log.at(22, d1, m.EngineStopped())
    log.at(700, d2, m.EngineStarting(runtime_id="c2", host="127.0.0.1", port=9001))
    log.at(701, d2, m.EngineReady())
    log.at(1100, d2, m.PutToSleep(reason="idle", idle_timeout_s=300))
    for ts, rid, dep in (
        (1200, "a", "d1"),
        (1210, "b", "d1"),  # within the minute: not audited
        (1215, "c", "d2"),  # another deployment: audited
        (1259.9, "d", "d1"),  # still within the minute
        (1260, "e", "d1"),  # a minute after the last audited one
    ):
        log.at(*timeout(ts, rid, dep))
    rows = list(audit_rows(log.records))
    ondemand = [
        (r.action, r.target, r.details.get("reason")) for r in rows if r.actor != "admin:alice"
    ]
    assert ondemand == [
        ("ondemand_start", d1, None),
        ("ondemand_start", d2, None),
        ("ondemand_sleep", d1, "make_room"),
        ("ondemand_sleep", d2, "idle"),
        ("ondemand_queue_timeout", d1, None),
        ("ondemand_queue_timeout", d2, None),
        ("ondemand_queue_timeout", d1, None),
    ]
    assert [r.action for r in rows if r.actor == "admin:alice"] == [
        "deployment_create",
        "deployment_create",
        "ondemand_mode",
    ]
    sleep = next(r for r in rows if r.action == "ondemand_sleep")
    assert sleep.details == {"reason": "make_room", "for": "llama"}
    assert [r.ts - T0 for r in rows if r.action == "ondemand_queue_timeout"] == [1200, 1215, 1260]


def state_of(log: Log, dep_id: str) -> DeploymentState:
    """The folded state of one deployment."""
    return fold(log.records).deployments[dep_id]


def test_status_badges_are_the_seeds() -> None:
    log = two_on_demand_models()
    d1, d2 = m.deployment_stream("d1"), m.deployment_stream("d2")
    assert badge(state_of(log, "d1")) == "Sleeping (on demand)"
    log.at(1, d1, m.StartRequested(reason="request", request_id="r1"))
    log.at(2, d1, m.EngineStarting(runtime_id="c", host="h", port=1))
    assert badge(state_of(log, "d1")) == "Starting for a request"
    log.at(3, d1, m.EngineReady())
    assert badge(state_of(log, "d1")) == "Ready"
    assert badge(state_of(log, "d1"), queued=3) == "3 queued"
    log.at(4, d1, m.PutToSleep(reason="idle", idle_timeout_s=300))
    assert badge(state_of(log, "d1")) == "Sleeping (on demand)"
    log.at(5, d1, m.EngineStopped())
    assert badge(state_of(log, "d1")) == "Sleeping (on demand)"
    # Started by hand: the normal state badge; a failed start: Failed, not asleep.
    log.at(6, d2, m.StartRequested(reason="admin"), actor="admin:alice")
    log.at(7, d2, m.EngineStarting(runtime_id="c", host="h", port=2))
    assert badge(state_of(log, "d2")) == "Loading"
    log.at(8, d2, m.EngineStartFailed(reason="exit 1", failures=1, retry_at=T0 + 68))
    assert badge(state_of(log, "d2")) == "Failed"


def test_switching_a_sleeping_model_to_always_on_is_loading_and_audited_as_ondemand_mode() -> None:
    log = two_on_demand_models()
    d1 = m.deployment_stream("d1")
    log.at(1, d1, m.PendingModeSet(mode="always_on"), actor="admin:alice")
    log.at(2, d1, m.StartRequested(reason="mode_switch"), actor="admin:alice")
    log.at(3, d1, m.EngineStarting(runtime_id="c", host="h", port=1))
    assert badge(state_of(log, "d1")) == "Loading"  # no request waits for it
    rows = [r for r in audit_rows(log.records) if r.action == "ondemand_mode"]
    assert [(r.actor, r.details) for r in rows] == [
        ("admin:alice", {"mode": "always_on", "once": "ready"})
    ]


def test_a_removed_deployment_leaves_the_state_but_is_remembered() -> None:
    log = two_on_demand_models()
    log.at(1, m.deployment_stream("d1"), m.DeploymentRemoved(), actor="admin:alice")
    state = fold(log.records)
    assert set(state.deployments) == {"d2"}
    assert state.removed["d1"].name == "qwen"
    assert [r.action for r in audit_rows(log.records)][-1] == "deployment_remove"


def test_the_queue_holds_requests_until_they_leave() -> None:
    log = two_on_demand_models()
    queued = m.RequestQueued(
        request_id="r1", deployment_id="d1", kind="queued", position=1, arrived_at=T0 + 1
    )
    log.at(1, m.STREAM_QUEUE, queued)
    log.at(2, m.STREAM_QUEUE, m.RequestAdmitted(request_id="r1", deployment_id="d1"))
    assert set(fold(log.records).queue) == {"r1"}
    log.at(
        3, m.STREAM_QUEUE, m.RequestLeftQueue(request_id="r1", deployment_id="d1", reason="served")
    )
    assert fold(log.records).queue == {}


def test_events_round_trip_through_their_json_encoding() -> None:
    every: list[Callable[[], m.Event]] = [
        lambda: m.PutToSleep(reason="make_room", for_deployment="d2", for_name="llama"),
        lambda: m.SettingsChanged(changes={"ondemand_idle_timeout_s": 600}),
        lambda: m.RequestQueued(
            request_id="r", deployment_id="d", kind="waiting_start", position=2, arrived_at=T0
        ),
    ]
    for make in every:
        event = make()
        assert m.decode_event(m.encode_event(event)) == event
        assert msgspec.json.decode(m.encode_event(event))["type"] == type(event).__name__


def test_every_event_type_with_an_audit_row_is_in_audited_types() -> None:
    """AUDITED_TYPES filters the log before decoding: it must not drop an audited event."""
    from events.projections import AUDITED_TYPES, _action

    samples: list[m.AnyEvent] = [
        m.DeploymentCreated(deployment_id="d", name="n", engine="sim", model="x", memory_bytes=1),
        m.DeploymentRemoved(),
        m.DeploymentReconfigured(),
        m.ModelSwitched(model="y"),
        m.ModeChanged(mode="on_demand"),
        m.PendingModeSet(mode="always_on"),
        m.PendingModeCleared(),
        m.StartRequested(reason="request"),
        m.StartRequested(reason="admin"),
        m.EngineStarting(runtime_id="r", host="h", port=1),
        m.EngineReady(),
        m.EngineStartFailed(reason="x", failures=1),
        m.StopRequested(reason="admin"),
        m.PutToSleep(reason="idle"),
        m.PutToSleep(reason="watchdog"),
        m.EngineStopped(),
        m.EngineLost(reason="x"),
        m.EngineAsleep(),
        m.EngineAwake(),
        m.EngineAdopted(runtime_id="r", host="h", port=1),
        m.RequestQueued(request_id="r", deployment_id="d", kind="queued", position=1, arrived_at=0),
        m.RequestAdmitted(request_id="r", deployment_id="d"),
        m.SettingsChanged(changes={"ondemand_max_queued": 3}),
        m.UserCreated(name="a", role="admin", password_hash="h"),
        m.UserRemoved(name="a"),
        m.ApiTokenCreated(name="a", token_id="t", token_hash="h"),
        m.UserLoggedIn(name="a"),
        m.LoginFailed(name="a"),
        m.LiteLLMSynced(ok=True),
    ]
    for event in samples:
        rec = m.Recorded(seq=1, ts=0.0, stream="deployment:d", version=1, actor="x", event=event)
        if _action(rec) is not None:
            assert type(event).__name__ in AUDITED_TYPES, type(event).__name__
    assert "RequestLeftQueue" in AUDITED_TYPES  # queue timeouts
