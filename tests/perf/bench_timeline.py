"""The timeline's window on a 1M-event log: server time of a 24-hour window.

    python -m tests.perf.bench_timeline [--events 1000000] [--days 30] [--dir /tmp/dgxmm-timeline]

Builds (once, then reused from `--dir`) a log of `bench_storage`'s synthetic history (10
on-demand models; every request waits, now and then a cold start and an idle sleep) spread
evenly over `--days` days, as a serving DGXMM leaves it (read models current, a snapshot
every 10,000 events: `bench_eventlog.finish_like_serve`).  Then times what the API's
`GET /api/timeline` does for a window, without HTTP: `storage.windows.timeline_window`
(snapshot, the events from it to the window's start, the window's events) and the JSON
encoding of the answer (`dgxmm.admin.timeline.timeline_json` + msgspec), for 24-hour
windows at the start, the middle and the end of the log; median and worst of `--runs`.

Target (issue 37): a 24-hour window in <= 300 ms server time.  With 1M events over 30 days
a day holds ~33,000 events (~25,000 queue events, ~8,000 of starts and sleeps).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from dgxmm.admin.timeline import timeline_json
from storage.eventlog import EventStore
from storage.snapshots import load_state
from storage.windows import timeline_window
from tests.perf.bench_eventlog import build
from tests.perf.bench_storage import GIB, T0

TARGET_MS = 300.0
DAY = 86400.0


async def measure(path: Path, events: int, days: float, runs: int) -> dict[str, float]:
    """Median and worst milliseconds per window position."""
    store = await EventStore.open(str(path))
    # As `dgxmm serve` starts: a log cached by an older state schema is folded once and
    # snapshotted again (storage.snapshots.load_state), then its windows start near their time.
    started = time.perf_counter()
    await load_state(store)
    print(f"start-up fold: {time.perf_counter() - started:.1f} s")
    span = days * DAY
    out: dict[str, float] = {}
    encoder = msgspec.json.Encoder()
    try:
        for label, since in (
            ("start", T0),
            ("middle", T0 + span / 2),
            ("end", T0 + span - DAY),
        ):
            times: list[float] = []
            cpu: list[float] = []
            size = counts = 0
            for _ in range(runs):
                started, cpu_started = time.perf_counter(), time.process_time()
                timeline = await timeline_window(store, since, since + DAY, 64 * GIB)
                body = encoder.encode(timeline_json(timeline))
                times.append((time.perf_counter() - started) * 1000)
                cpu.append((time.process_time() - cpu_started) * 1000)
                size = len(body)
                counts = len(timeline.segments) + len(timeline.marks) + len(timeline.waits)
            out[f"{label}_median_ms"] = statistics.median(times)
            out[f"{label}_max_ms"] = max(times)
            out[f"{label}_cpu_ms"] = statistics.median(cpu)
            print(
                f"24-hour window at the {label}: median {statistics.median(times):.0f} ms,"
                f" worst {max(times):.0f} ms, CPU {statistics.median(cpu):.0f} ms"
                f" ({counts:,} segments+marks+waits, {size / 1e6:.1f} MB of JSON)"
            )
    finally:
        await store.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "dgxmm-timeline"))
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"timeline-{args.events}-{args.days:g}d.db"
    build(path, args.events, spacing_s=args.days * DAY / args.events)
    figures = asyncio.run(measure(path, args.events, args.days, args.runs))
    worst_median = max(v for k, v in figures.items() if k.endswith("_median_ms"))
    worst_cpu = max(v for k, v in figures.items() if k.endswith("_cpu_ms"))
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    cores = os.cpu_count() or 1
    print(f"load average while measuring: {load:.2f} on {cores} cores")
    # On a machine shared beyond its cores the wall time measures the others' work too: the
    # process's own CPU time (all its threads, SQLite's included) is then the server's time.
    busy = load > cores
    figure = worst_cpu if busy else worst_median
    ok = figure <= TARGET_MS
    what = "CPU time (the machine is busy)" if busy else "wall time"
    print(f"target: <= {TARGET_MS:.0f} ms {what}: {'met' if ok else 'MISSED'} ({figure:.0f} ms)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
