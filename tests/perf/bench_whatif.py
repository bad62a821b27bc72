"""How fast the what-if runs: a recorded week (about 1M requests over 8 models) simulated
under one alternative, and `tune`'s staged search (about 22 simulations).

    python -m tests.perf.bench_whatif [--tune] [--hours 168]

The week is synthesised in the trace's own format (`tests.whatif_support.write_log`) into a
log cached under /tmp (built once, ~1 minute); the times are wall-clock seconds of loading
the history and of each simulation, beside the CPU seconds they took (this process's and its
children's: `tune` runs its points in worker processes), which a busy machine does not move
as much.  Targets: one alternative <= 60 s, the search <= 15 min.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import time
from pathlib import Path

import structlog

from simulations.tune import WORKERS, Goal, tune
from simulations.whatif import load_history, parse_overrides, simulate
from tests.whatif_support import Model, write_log

# 8 models, 176 GiB of them in a 100 GiB box, 1.65 requests a second in all (1M a week).
MODELS = [
    Model("chat", 20, 0.60, 3.0),
    Model("coder", 30, 0.40, 8.0),
    Model("mini", 8, 0.30, 1.0),
    Model("embed", 4, 0.20, 0.2),
    Model("vision", 30, 0.07, 6.0),
    Model("reason", 40, 0.04, 20.0),
    Model("audio", 24, 0.03, 4.0),
    Model("legal", 20, 0.01, 10.0),
]


def cpu_s() -> float:
    """CPU seconds of this process and of its children that ended."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


async def main(hours: float, with_tune: bool) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    path = Path(f"/tmp/dgxmm-bench-whatif-{hours:g}h.db")
    if not await asyncio.to_thread(path.exists):
        began = time.monotonic()
        n = await write_log(str(path) + ".part", MODELS, hours=hours, usable_gib=100)
        os.replace(str(path) + ".part", path)
        print(f"log: {n:,} requests written in {time.monotonic() - began:.0f} s")
    began = time.monotonic()
    history = await load_history(path)
    print(f"load: {len(history.traffic):,} requests in {time.monotonic() - began:.1f} s")
    began, cpu = time.monotonic(), cpu_s()
    over = parse_overrides(history, ["ondemand_make_room_after_s=30"])
    report = await simulate(history, over)
    took, cpu = time.monotonic() - began, cpu_s() - cpu
    print(
        f"one alternative (make room after 30 s): {took:.1f} s, {cpu:.1f} s of CPU"
        f" ({len(history.traffic) / took:,.0f} requests/s; cold starts {report.cold_starts},"
        f" p90 wait {report.waits.p90:.1f} s)"
    )
    if with_tune:
        began, cpu = time.monotonic(), cpu_s()
        result = await tune(history, Goal(bound="p90", limit_s=30, minimise="cold_starts"))
        took, cpu = time.monotonic() - began, cpu_s() - cpu
        best = result.recommended.label if result.recommended else "none"
        print(
            f"tune, {result.searched}, in {WORKERS} processes: {took:.0f} s"
            f" ({took / 60:.1f} min), {cpu:.0f} s of CPU; recommended: {best}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=168.0)
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.hours, args.tune))
