"""Event log benchmarks: group-commit append throughput and replaying a million events.

Run with `python -m tests.perf.bench_storage` (not collected by pytest).  Targets from the
issue: at least 50,000 events/s appended by many concurrent appenders, and under 20 s to
replay (read + decode + fold) 1,000,000 events.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator

import uvloop

from events import model as m
from events.state import EMPTY, SystemState, evolve
from storage.eventlog import EventStore

APPEND_TARGET_EVENTS_S = 50_000
REPLAY_TARGET_S = 20.0
T0 = 1_767_225_600.0
GIB = 1 << 30


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, nearest rank."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[rank]


# --- append throughput ------------------------------------------------------------------


def _queue_event(i: int) -> m.AnyEvent:
    dep = f"d{i % 10}"
    match i % 3:
        case 0:
            return m.RequestQueued(
                request_id=f"r{i}",
                deployment_id=dep,
                kind="queued",
                position=1 + i % 64,
                arrived_at=T0 + i,
                free_bytes=8 * GIB,
                needed_bytes=40 * GIB,
            )
        case 1:
            return m.RequestAdmitted(request_id=f"r{i}", deployment_id=dep)
        case _:
            return m.RequestLeftQueue(
                request_id=f"r{i}", deployment_id=dep, reason="served", waited_s=1.5
            )


async def bench_append(directory: str, appenders: int, total: int) -> dict[str, float]:
    """`appenders` tasks append one event at a time, `total` events in all."""
    store = await EventStore.open(os.path.join(directory, "append.db"))
    per_task = total // appenders
    latencies: list[float] = []

    async def appender(k: int) -> None:
        for j in range(per_task):
            i = k * per_task + j
            # Mostly queue events (the hot, group-committed kind), some deployment events.
            stream = m.STREAM_QUEUE if j % 10 else m.deployment_stream(f"d{k % 10}")
            t = time.perf_counter()
            await store.append(stream, [_queue_event(i)], actor="ondemand")
            latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    cpu_started = time.process_time()
    await asyncio.gather(*(appender(k) for k in range(appenders)))
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    stats = store.statistics()
    await store.close()
    latencies.sort()
    return {
        "events": float(stats["events"]),
        "seconds": elapsed,
        "events_per_s": stats["events"] / elapsed,
        "events_per_cpu_s": stats["events"] / cpu,
        "transactions": float(stats["transactions"]),
        "events_per_transaction": stats["events"] / max(1, stats["transactions"]),
        "p50_ms": percentile(latencies, 50) * 1000,
        "p90_ms": percentile(latencies, 90) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "max_ms": latencies[-1] * 1000 if latencies else 0.0,
    }


# --- replay -----------------------------------------------------------------------------


def synthetic_log(count: int, deployments: int = 10) -> Iterator[tuple[str, str, m.AnyEvent]]:
    """A legal, incident-like history: (stream, actor, event), `count` of them."""
    made = 0
    for d in range(deployments):
        yield (
            m.deployment_stream(f"d{d}"),
            "admin:alice",
            m.DeploymentCreated(
                deployment_id=f"d{d}",
                name=f"model-{d}",
                engine="vllm",
                model=f"org/model-{d}",
                memory_bytes=(8 + 4 * d) * GIB,
                mode="on_demand",
            ),
        )
        made += 1
    request = 0
    while made < count:
        d = request % deployments
        dep_id = f"d{d}"
        stream = m.deployment_stream(dep_id)
        rid = f"req-{request}"
        burst: list[tuple[str, str, m.AnyEvent]] = [
            (
                m.STREAM_QUEUE,
                "ondemand",
                m.RequestQueued(
                    request_id=rid,
                    deployment_id=dep_id,
                    kind="queued" if request % 2 else "waiting_start",
                    position=1 + request % 8,
                    arrived_at=T0 + request,
                    free_bytes=4 * GIB,
                    needed_bytes=16 * GIB,
                ),
            ),
            (m.STREAM_QUEUE, "ondemand", m.RequestAdmitted(request_id=rid, deployment_id=dep_id)),
        ]
        if request % 50 < deployments:  # now and then a cold start and an idle sleep
            burst += [
                (stream, "ondemand", m.StartRequested(reason="request", request_id=rid)),
                (stream, "ondemand", m.EngineStarting(runtime_id="c", host="127.0.0.1", port=1)),
                (stream, "ondemand", m.EngineReady()),
            ]
        burst.append(
            (
                m.STREAM_QUEUE,
                "ondemand",
                m.RequestLeftQueue(
                    request_id=rid, deployment_id=dep_id, reason="served", waited_s=2.0
                ),
            )
        )
        if request % 50 < deployments:
            burst += [
                (stream, "ondemand", m.PutToSleep(reason="idle", idle_timeout_s=300)),
                (stream, "ondemand", m.EngineStopped()),
            ]
        if request % 1000 == 0:
            burst.append(
                (m.STREAM_SETTINGS, "admin:alice", m.SettingsChanged(changes={"n": request}))
            )
        for item in burst:
            if made >= count:
                return
            yield item
            made += 1
        request += 1


def write_log(path: str, count: int, spacing_s: float = 0.01) -> None:
    """Write `count` synthetic events straight into a DGXMM log (fast, no fsync per batch),
    `spacing_s` apart."""

    async def create() -> None:
        store = await EventStore.open(path)
        await store.close()

    uvloop.run(create())
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    versions: dict[str, int] = {}
    rows: list[tuple[int, float, str, int, str, str, bytes]] = []
    conn.execute("BEGIN")
    for seq, (stream, actor, event) in enumerate(synthetic_log(count), start=1):
        version = versions.get(stream, 0) + 1
        versions[stream] = version
        rows.append(
            (
                seq,
                T0 + seq * spacing_s,
                stream,
                version,
                type(event).__name__,
                actor,
                m.encode_event(event),
            )
        )
        if len(rows) == 50_000:
            conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
            rows.clear()
    conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    conn.execute("COMMIT")
    conn.close()


async def bench_replay(path: str) -> dict[str, float]:
    """Time read + decode + fold of the whole log, and the two halves separately."""
    store = await EventStore.open(path, create=False, readonly=True)
    started = time.perf_counter()
    state: SystemState = EMPTY
    count = 0
    async for rec in store.iterate():
        state = evolve(state, rec)
        count += 1
    total = time.perf_counter() - started

    started = time.perf_counter()
    records = await store.read()
    read_decode = time.perf_counter() - started
    await store.close()

    started = time.perf_counter()
    again = EMPTY
    for rec in records:
        again = evolve(again, rec)
    fold_only = time.perf_counter() - started
    assert again == state, "replay is not deterministic"
    return {
        "events": float(count),
        "seconds": total,
        "events_per_s": count / total,
        "read_decode_s": read_decode,
        "fold_s": fold_only,
        "deployments": float(len(state.deployments)),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print the numbers against the targets."""
    parser = argparse.ArgumentParser(prog="python -m tests.perf.bench_storage")
    parser.add_argument("--appenders", type=int, default=500)
    parser.add_argument("--append-events", type=int, default=200_000)
    parser.add_argument("--replay-events", type=int, default=1_000_000)
    parser.add_argument("--only", choices=["append", "replay"])
    parser.add_argument("--dir", help="where to put the database files (default: a temp dir)")
    args = parser.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        if args.only in (None, "append"):
            a = uvloop.run(bench_append(directory, args.appenders, args.append_events))
            hit = a["events_per_s"] >= APPEND_TARGET_EVENTS_S
            ok &= hit
            print(
                f"append: {a['events']:.0f} events by {args.appenders} concurrent appenders"
                f" in {a['seconds']:.2f} s = {a['events_per_s']:,.0f} events/s"
                f" (target >= {APPEND_TARGET_EVENTS_S:,}: {'met' if hit else 'MISSED'})"
            )
            print(
                f"  CPU: {a['events_per_cpu_s']:,.0f} events per CPU second of this process"
                " (wall time also counts other load on the host)"
            )
            print(
                f"  group commit: {a['transactions']:.0f} transactions,"
                f" {a['events_per_transaction']:.1f} events per transaction (fsync)"
            )
            print(
                f"  append latency: p50 {a['p50_ms']:.1f} ms, p90 {a['p90_ms']:.1f} ms,"
                f" p99 {a['p99_ms']:.1f} ms, max {a['max_ms']:.1f} ms"
            )
        if args.only in (None, "replay"):
            path = os.path.join(directory, "replay.db")
            started = time.perf_counter()
            write_log(path, args.replay_events)
            size = os.path.getsize(path)
            print(
                f"replay: wrote {args.replay_events:,} events ({size / 1e6:.0f} MB)"
                f" in {time.perf_counter() - started:.1f} s"
            )
            r = uvloop.run(bench_replay(path))
            hit = r["seconds"] < REPLAY_TARGET_S
            ok &= hit
            print(
                f"  read + decode + fold: {r['events']:,.0f} events in {r['seconds']:.2f} s"
                f" = {r['events_per_s']:,.0f} events/s"
                f" (target < {REPLAY_TARGET_S:.0f} s: {'met' if hit else 'MISSED'})"
            )
            print(
                f"  split: read + decode {r['read_decode_s']:.2f} s,"
                f" fold {r['fold_s']:.2f} s"
                f" ({r['fold_s'] / max(1e-9, r['read_decode_s'] + r['fold_s']):.0%} in fold)"
            )
    print("all targets met" if ok else "a target was MISSED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
