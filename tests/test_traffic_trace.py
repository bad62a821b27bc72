"""The traffic trace: rows in memory, one event per batch, bounded, ids as clients see them."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.admission import Refused
from events import model as m
from events.state import fold
from events.traffic import (
    CLIENT_GONE,
    LAYOUT,
    QUEUE_FULL,
    SERVED,
    TrafficRecord,
    decode_batch,
    encode_batch,
)
from gateway.express import Exchange
from gateway.trace import ROW, TrafficTrace
from gateway.trace import _columns as numpy_columns
from storage.eventlog import EventStore
from tests.gateway_support import (
    Client,
    FakeEngine,
    ScriptedController,
    poll,
    run,
    running_gateway,
)
from tests.perf.bench_trace_flush import stdlib_columns

T0 = 1000.0  # monotonic seconds in the rows below
OFFSET = 1_767_225_600.0 - T0
Row = tuple[str, int, float, float, float, float, int, bool]


def trace_at_t0() -> tuple[TrafficTrace, list[m.TrafficRecorded]]:
    """A trace whose clock stands at T0 (its wall clock at T0 + OFFSET), and what it writes."""
    written: list[m.TrafficRecorded] = []

    async def sink(event: m.TrafficRecorded) -> None:
        written.append(event)

    return TrafficTrace(sink, wall=lambda: T0 + OFFSET, monotonic=lambda: T0), written


def encode_rows(rows: list[Row]) -> m.TrafficRecorded:
    """The batch a trace makes of `rows`."""

    async def main() -> m.TrafficRecorded:
        trace, written = trace_at_t0()
        for row in rows:
            trace.record(*row)
        await trace.close()
        assert len(written) == 1
        return written[0]

    return run(main())


def _row(
    i: int,
    dep: str,
    *,
    wait: float = 0.0,
    first: float = 0.05,
    outcome: int = SERVED,
    streamed: bool = False,
) -> Row:
    arrived = T0 + i * 0.25
    return (
        dep,
        1_000_000 + i,
        arrived,
        arrived + wait,
        arrived + wait + first,
        arrived + 2.0,
        outcome,
        streamed,
    )


def test_a_batch_decodes_to_the_requests_it_was_made_of() -> None:
    rows = [
        _row(0, "a"),
        _row(1, "b", wait=12.5, streamed=True),
        _row(2, "a", first=0.0, outcome=CLIENT_GONE),
    ]
    rows[2] = (*rows[2][:4], 0.0, *rows[2][5:])  # no answer came
    records = decode_batch(encode_rows(rows))
    assert [r.deployment_id for r in records] == ["a", "b", "a"]
    assert [r.request_id for r in records] == [1_000_000, 1_000_001, 1_000_002]
    assert abs(records[1].arrived - (OFFSET + T0 + 0.25)) < 1e-6
    assert abs(records[1].wait_s - 12.5) < 1e-4
    assert records[1].streamed and not records[0].streamed
    assert abs(records[0].service_s - 2.0) < 1e-3  # no wait: arrival to end
    # Its row ends 2 s after arrival, before its 12.5 s wait would: no negative service time.
    assert records[1].service_s == 0.0
    assert records[2].ttfb_s is None and records[2].outcome == "client_gone"
    assert records[0].ttfb_s is not None and abs(records[0].ttfb_s - 0.05) < 1e-4


# A batch as the first layout (0) wrote it, before `TrafficRecorded.layout` existed (made by
# the trace of commit f997ba5): 22-byte rows, ids as deltas, zlib.
LAYOUT0_BATCH = (
    b'{"type":"TrafficRecorded","deployments":["a","b"],"base_time":1767225600.5,'
    b'"base_id":1767225600000007,"count":3,'
    b'"data":"eAFjYEADdgwMB+wZGZkgwvYMDB6ODAwNQNEFjgws/4GAgcEBKOrgABTdD6IB2jMKZw==",'
    b'"dropped_batches":0,"dropped_requests":0,"last_used_at":{"b":1767225621.0,"a":1767225602.0}}'
)


def test_a_batch_of_the_first_layout_still_decodes() -> None:
    event = m.decode_event(LAYOUT0_BATCH)
    assert isinstance(event, m.TrafficRecorded) and event.layout == 0
    assert decode_batch(event) == [
        TrafficRecord(
            request_id=1_767_225_600_000_007, deployment_id="a", arrived=1_767_225_600.5,
            wait_s=0.0, ttfb_s=0.125, duration_s=1.5, outcome="served", streamed=False,
        ),
        TrafficRecord(
            request_id=1_767_225_600_000_009, deployment_id="b", arrived=1_767_225_601.0,
            wait_s=12.5, ttfb_s=0.25, duration_s=20.0, outcome="served", streamed=True,
        ),
        TrafficRecord(
            request_id=1_767_225_600_000_008, deployment_id="a", arrived=1_767_225_601.25,
            wait_s=3.0, ttfb_s=None, duration_s=3.0, outcome="client_gone", streamed=False,
        ),
    ]  # fmt: skip
    again = encode_batch(decode_batch(event))  # written again, the current layout
    assert again.layout == LAYOUT and decode_batch(again) == decode_batch(event)
    assert again.last_used_at == event.last_used_at


class _View:
    deployment_id = "a"


class _Gateway:
    def __init__(self, trace: TrafficTrace) -> None:
        self.trace = trace
        self.relayed = self.relayed_express = 0
        self.exchanges: set[Exchange] = set()


class _Connection:
    def express_done(self, keep: bool) -> None:
        pass


def _express_row(trace: TrafficTrace, row: Row, *, one_write: bool, aborted: bool) -> None:
    """`row` as the express lane appends it, on an exchange that ended with it (`_end`), or
    that its client's connection cut (`abort`); `one_write`: its answer went out whole in
    the write that began it."""
    dep, rid, arrived, _, first, _, outcome, streamed = row
    exchange = Exchange.__new__(Exchange)
    exchange._gateway = _Gateway(trace)  # type: ignore[assignment]
    exchange._conn = _Connection()  # type: ignore[assignment]
    exchange._view = _View()  # type: ignore[assignment]
    exchange.request_id = rid
    exchange._arrived = arrived
    exchange._first = first
    exchange._last_byte = first if one_write else 0.0
    exchange._outcome = outcome
    exchange._chunks_through = streamed
    exchange._ended = exchange._paused = False
    exchange._upstream = exchange._lease = exchange._connecting = None
    assert dep == "a"
    if aborted:
        assert outcome == CLIENT_GONE
        exchange.abort()
    else:
        exchange._end(keep=True)


def _columns(trace: TrafficTrace) -> bytes:
    """The batch so far."""
    return bytes(trace.buf[: trace.off])


def test_the_express_lane_appends_the_rows_record_would(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        written: list[m.TrafficRecorded] = []

        async def sink(event: m.TrafficRecorded) -> None:
            written.append(event)

        by_record = TrafficTrace(sink, wall=lambda: T0 + OFFSET, monotonic=lambda: T0)
        inline = TrafficTrace(sink, wall=lambda: T0 + OFFSET, monotonic=lambda: T0)
        whole = _row(0, "a")
        whole = (*whole[:5], whole[4], *whole[6:])  # ended in the write that began it
        gone = _no_answer(_row(2, "a", outcome=CLIENT_GONE))
        rows = [whole, _row(1, "a", streamed=True), gone, _row(3, "a", outcome=CLIENT_GONE)]
        for i, row in enumerate(rows):
            by_record.record(*row)
            with monkeypatch.context() as patch:  # the exchange's end, when it reads the clock
                patch.setattr(time, "monotonic", lambda end=row[5]: end)
                _express_row(inline, row, one_write=row is whole, aborted=i == 3)
            assert _columns(inline) == _columns(by_record), i
        await by_record.close()
        await inline.close()
        assert len(written) == 2 and written[0] == written[1]

    run(main())


def test_the_express_lane_keeps_the_bound_drops_beyond_it_and_counts() -> None:
    async def main() -> None:
        written: list[m.TrafficRecorded] = []

        async def sink(event: m.TrafficRecorded) -> None:
            written.append(event)

        trace = TrafficTrace(sink, batch_size=2)
        for i in range(10):  # no await: the flush scheduled when the batch filled runs later
            _express_row(trace, _row(i, "a"), one_write=False, aborted=False)
        assert trace.statistics()["pending"] == 8
        assert trace.statistics()["requests_dropped"] == 2
        await poll(lambda: trace.statistics()["recorded"] == 8)
        assert [e.count for e in written] == [8]

    run(main())


_times = st.floats(-1e300, 1e300, allow_nan=False)  # far beyond float32: infinity there
_packed_rows = st.lists(
    st.tuples(
        st.integers(0, 254), st.integers(0, 255), st.booleans(),
        st.integers(-(2**63), 2**63 - 1),  # ids a whole int64 apart: differences wrap
        _times, st.one_of(st.none(), _times), st.one_of(st.just(0.0), _times), _times,
    ),
    min_size=1, max_size=40,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_packed_rows, _times)
def test_the_flush_writes_the_bytes_a_plain_python_encoding_of_its_rows_would(
    rows: list[tuple[int, int, bool, int, float, float | None, float, float]], base: float
) -> None:
    """numpy's columns (`gateway.trace._columns`) against the standard library's, byte for byte: the
    float32 of each difference, infinity past its range, -1 without an answer, the ids'
    differences modulo 2**64 (a lease at the arrival: None)."""
    buf = bytearray(len(rows) * ROW.size)
    for i, (index, outcome, streamed, rid, arrived, admitted, first, end) in enumerate(rows):
        at = arrived if admitted is None else admitted
        ROW.pack_into(buf, i * ROW.size, index, outcome, streamed, rid, arrived, at, first, end)
    assert numpy_columns(buf, len(rows), base) == stdlib_columns(buf, len(rows), base)


def test_importing_the_gateway_loads_numpy_only_once_a_trace_is_made() -> None:
    """LiteLLM's workers import `gateway` (`dgxmm.litellm`) and never flush a trace."""
    script = (
        "import sys, gateway, gateway.trace, dgxmm.litellm.backend\n"
        "assert 'numpy' not in sys.modules, 'imported'\n"
        "gateway.trace.TrafficTrace(print)\n"
        "assert 'numpy' in sys.modules, 'not made'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def _no_answer(row: Row) -> Row:
    return (*row[:4], 0.0, *row[5:])


def test_a_batch_says_when_each_deployment_was_last_used_by_a_request_that_reached_it() -> None:
    rows = [
        _row(0, "a"),
        _row(1, "b"),
        _row(2, "a"),  # a's newest
        _no_answer(_row(3, "c", outcome=QUEUE_FULL)),  # refused: no use
        _no_answer(_row(4, "b", outcome=CLIENT_GONE)),  # left while waiting: no use
        _row(5, "d", outcome=CLIENT_GONE),  # left once the answer began: a use
    ]
    batch = encode_rows(rows)
    end = OFFSET + T0 + 2.0  # each row ends 2 s after it arrived, rows 0.25 s apart
    assert batch.last_used_at.keys() == {"a", "b", "d"}
    for dep, i in (("a", 2), ("b", 1), ("d", 5)):
        assert abs(batch.last_used_at[dep] - (end + i * 0.25)) < 1e-3, dep
    assert encode_batch(decode_batch(batch)).last_used_at == batch.last_used_at


def test_a_request_costs_no_write_until_the_batch_is_flushed() -> None:
    async def main() -> None:
        written: list[m.TrafficRecorded] = []

        async def sink(event: m.TrafficRecorded) -> None:
            written.append(event)

        trace = TrafficTrace(sink)
        for i in range(10):
            trace.record(*_row(i, "a"))
        await asyncio.sleep(0)
        assert written == []
        await trace.close()
        assert [e.count for e in written] == [10]
        assert trace.statistics()["recorded"] == 10

    run(main())


def test_a_writer_that_falls_behind_loses_whole_batches_counted_and_reported() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        written: list[m.TrafficRecorded] = []

        async def sink(event: m.TrafficRecorded) -> None:
            await gate.wait()
            written.append(event)

        trace = TrafficTrace(sink, max_in_flight=2)
        for batch in range(4):  # two wait for the writer, two are dropped whole
            for i in range(3):
                trace.record(*_row(batch * 3 + i, "a"))
            trace.flush()
        stats = trace.statistics()
        assert stats["batches_dropped"] == 2 and stats["requests_dropped"] == 6
        gate.set()
        await poll(lambda: trace.statistics()["batches_written"] == 2)
        trace.record(*_row(99, "a"))
        await trace.close()
        assert [e.count for e in written] == [3, 3, 1]
        assert (written[-1].dropped_batches, written[-1].dropped_requests) == (2, 6)

    run(main())


def test_rows_beyond_the_bound_are_dropped_when_the_loop_never_flushes() -> None:
    async def main() -> None:
        async def sink(event: m.TrafficRecorded) -> None:
            return None

        trace = TrafficTrace(sink, batch_size=4)
        for i in range(20):  # no await: the flush scheduled at the batch's size never runs
            trace.record(*_row(i, "a"))
        assert trace.statistics()["requests_dropped"] == 20 - 16
        await trace.close()

    run(main())


def test_a_batch_keeps_255_deployments_and_drops_the_rows_of_any_beyond_counted() -> None:
    rows = [_row(i, f"dep{i}") for i in range(256)] + [_row(256, "dep0"), _row(257, "dep255")]

    async def main() -> tuple[list[m.TrafficRecorded], dict[str, int]]:
        trace, written = trace_at_t0()
        for row in rows:
            trace.record(*row)
        trace.flush()
        trace.record(*_row(300, "dep255"))  # a new batch has room for it
        await trace.close()
        return written, trace.statistics()

    (first, second), stats = run(main())
    assert len(first.deployments) == 255 and "dep255" not in first.deployments
    assert [r.request_id for r in decode_batch(first)][-1] == 1_000_256
    assert first.count == 256 and stats["requests_dropped"] == 2
    assert first.dropped_requests == 2  # the batch says what it lost itself
    assert second.dropped_requests == 0 and decode_batch(second)[0].deployment_id == "dep255"


def test_a_request_takes_at_most_40_bytes_of_the_log_on_disk(tmp_path: Path) -> None:
    """Ten minutes of batches as `dgxmm serve` writes them (one each 10 s), 8 requests a
    second (Poisson) over 8 models."""

    async def main() -> int:
        rng = random.Random(7)
        at, rid, n = T0, 1_767_225_600_000_000, 0
        for _batch in range(60):
            rows: list[Row] = []
            end_of_second = at + 10.0
            while True:
                at += rng.expovariate(8.0)
                if at > end_of_second:
                    break
                rid += 1
                wait = 0.0 if rng.random() < 0.9 else rng.uniform(1, 60)
                first = wait + rng.uniform(0.02, 0.5)
                rows.append(
                    (f"dep{rng.randrange(8)}", rid, at, at + wait, at + first,
                     at + first + rng.expovariate(0.2), SERVED, rng.choice((0, 1)) == 1)
                )  # fmt: skip
            at = end_of_second
            if rows:
                n += len(rows)
                batches.append(rows)
        return n

    batches: list[list[Row]] = []
    n = run(main())
    events = [encode_rows(rows) for rows in batches]

    async def write() -> None:
        store = await EventStore.open(tmp_path / "log.db")
        for event in events:
            await store.append(m.STREAM_TRAFFIC, [event], actor="system")
        await store.close()

    before = _empty_log_bytes(tmp_path / "empty.db")
    run(write())
    size = os.path.getsize(tmp_path / "log.db") - before
    assert n > 4000
    assert size / n <= 40, f"{size / n:.1f} bytes per request"
    print(f"{size / n:.1f} bytes per request on disk")


def _empty_log_bytes(path: Path) -> int:
    async def main() -> None:
        await (await EventStore.open(path)).close()

    run(main())
    return os.path.getsize(path)


def test_both_lanes_record_each_request_with_the_id_its_client_saw() -> None:
    async def main() -> None:
        async with FakeEngine() as engine:
            controller = ScriptedController()
            controller.add("a", handle=engine.handle)
            controller.add("cold", state="stopped")
            controller.deployments["cold"].refuse = _queue_full()
            written: list[m.TrafficRecorded] = []

            async def sink(event: m.TrafficRecorded) -> None:
                written.append(event)

            async with running_gateway(controller) as (gateway, server):
                gateway.trace = TrafficTrace(sink)
                client = await Client.connect(server.port)
                seen: dict[int, int] = {}
                # Each names the model its deployment serves: another name gets 404 at once.
                for dep in ("a", "cold") * 2:
                    body = {
                        "model": f"served-{dep}",
                        "messages": [{"role": "user", "content": "hi"}],
                    }
                    reply = await client.request("POST", f"/d/{dep}/v1/chat/completions", body)
                    shown = reply.header("x-dgxmm-request-id")
                    assert shown is not None
                    seen[int(shown)] = reply.status
                client.close()
                await gateway.trace.close()
            records = [r for ev in written for r in decode_batch(ev)]
            assert sorted(r.request_id for r in records) == sorted(seen)
            by_id = {r.request_id: r for r in records}
            for rid, status in seen.items():
                rec = by_id[rid]
                if status == 200:
                    assert (rec.deployment_id, rec.outcome) == ("a", "served")
                    assert rec.ttfb_s is not None and rec.ttfb_s <= rec.duration_s
                else:
                    assert (rec.deployment_id, rec.outcome) == ("cold", "queue_full")
            assert gateway.relayed_express >= 1  # the express lane was among them

    run(main())


def _queue_full() -> Refused:
    return Refused(503, "ondemand_queue_full", "full", 10)


assert QUEUE_FULL == 3  # the outcome numbers are on disk: never renumber them


def test_archive_moves_old_trace_batches_and_keeps_the_newest(tmp_path: Path) -> None:
    from storage.archive import archive_queue_events

    now = [100.0]
    batches = [encode_rows([_row(i, "a")]) for i in range(3)]

    async def main() -> tuple[list[str], list[str]]:
        store = await EventStore.open(tmp_path / "log.db", wall=lambda: now[0])
        for i in range(3):
            now[0] = 100.0 + i * 100
            await store.append(m.STREAM_TRAFFIC, [batches[i]], actor="system")
        await store.close()
        moved = await archive_queue_events(tmp_path / "log.db", tmp_path / "old.db", 350.0)
        assert moved == 2  # the newest stays, though older than --before
        left: list[str] = []
        gone: list[str] = []
        for path, into in ((tmp_path / "log.db", left), (tmp_path / "old.db", gone)):
            log = await EventStore.open(path, create=False, readonly=True)
            into.extend(r.type for r in await log.read(stream=m.STREAM_TRAFFIC))
            await log.close()
        return left, gone

    left, gone = run(main())
    assert left == ["TrafficRecorded"] and gone == ["TrafficRecorded"] * 2


def test_archive_keeps_the_newest_batch_with_each_deployments_last_use(tmp_path: Path) -> None:
    # The folded state keeps the last uses (and its snapshot); the log folded alone, with
    # no snapshot (a new snapshot format after an upgrade), must know them too.
    from storage.archive import archive_queue_events

    now = [100.0]
    batches = [
        encode_rows([_row(0, "a"), _row(1, "b")]),
        encode_rows([_row(0, "a")]),  # moves: a is used again in the next
        encode_rows([_row(1, "a")]),
    ]

    async def main() -> tuple[list[float], list[float], dict[str, float], dict[str, float]]:
        store = await EventStore.open(tmp_path / "log.db", wall=lambda: now[0])
        for dep in ("a", "b"):
            created = m.DeploymentCreated(
                deployment_id=dep, name=dep, engine="sim", model="x", memory_bytes=1
            )
            await store.append(m.deployment_stream(dep), [created], actor="admin:alice")
        for i, batch in enumerate(batches):
            now[0] = 100.0 + i * 100
            await store.append(m.STREAM_TRAFFIC, [batch], actor="system")
        before = fold(await store.read()).last_used_at
        await store.close()
        assert await archive_queue_events(tmp_path / "log.db", tmp_path / "old.db", 1e9) == 1
        kept: list[float] = []
        moved: list[float] = []
        after: dict[str, float] = {}
        for path, into in ((tmp_path / "log.db", kept), (tmp_path / "old.db", moved)):
            log = await EventStore.open(path, create=False, readonly=True)
            into.extend(r.ts for r in await log.read(stream=m.STREAM_TRAFFIC))
            if into is kept:
                after = fold(await log.read()).last_used_at
            await log.close()
        return kept, moved, before, after

    kept, moved, before, after = run(main())
    assert kept == [100.0, 300.0] and moved == [200.0]
    assert after == before and before.keys() == {"a", "b"}


def test_rows_after_a_quiet_day_keep_their_millisecond() -> None:
    """An empty flush moves the batch's base to now: a row's float32 offset stays small, so
    a request a day after the last one is not rounded to 8 ms."""

    async def main() -> list[m.TrafficRecorded]:
        written: list[m.TrafficRecorded] = []
        now = [T0]

        async def sink(event: m.TrafficRecorded) -> None:
            written.append(event)

        trace = TrafficTrace(sink, wall=lambda: T0 + OFFSET, monotonic=lambda: now[0])
        for _ in range(24 * 360):  # a quiet day, a flush every 10 s
            now[0] += 10.0
            trace.flush()
        arrived = now[0] + 0.0013
        trace.record("a", 7, arrived, arrived, arrived + 0.0021, arrived + 0.0042, SERVED, False)
        await trace.close()
        return written

    (batch,) = run(main())
    (record,) = decode_batch(batch)
    assert abs(record.arrived - (T0 + 86400 + 0.0013 + OFFSET)) < 1e-4
    assert abs(record.ttfb_s - 0.0021) < 1e-5 if record.ttfb_s is not None else False
