"""The traffic trace's flush per row: numpy (what `gateway.trace` runs) against the standard
library's best, on one batch of rows as the gateway packs them.

    python -m tests.perf.bench_trace_flush [--rows N]
    python -m tests.perf.bench_trace_flush [--rows N] --instructions

Why numpy stays in `dgxmm serve` (issue 47): turning a batch into layout 1's columns takes
four float subtractions a row, each rounded to float32.  The standard library has no
arithmetic on a column, so each is a Python float made, subtracted and packed
(`stdlib_columns`: the ids' differences on one big integer, the waits skipped when every
row's lease is its arrival, as on the express lane); numpy does them a few instructions a
value.  `tests/test_traffic_trace.py` holds both to the same bytes.  Times drift with the
machine; `--instructions` counts them under callgrind (two runs, 1 and 11 flushes after
the same set-up, the difference per row), as `tests.perf.micro_gateway` does.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import sub

from gateway.trace import ROW, _columns

Columns = Callable[[bytearray, int, float], tuple[int, list[bytes]]]
BASE = 100_000.0  # the batch's base, monotonic seconds
_SIGN = b"\0\0\0\0\0\0\0\x80"  # an int64's top bit, little-endian


def _float32s(values: Iterable[float], n: int) -> bytes:
    """`values` as float32, an overflow as infinity (as numpy's cast)."""
    values = tuple(values)
    try:
        return struct.pack(f"<{n}f", *values)
    except OverflowError:  # a clock gone wrong; array's cast does not check
        from array import array

        return array("f", values).tobytes()


def stdlib_columns(buf: bytearray, n: int, base: float) -> tuple[int, list[bytes]]:
    """`gateway.trace._columns` with the standard library only: the same bytes."""
    rows = list(ROW.iter_unpack(memoryview(buf)[: n * ROW.size]))
    index, outcome, streamed, ids, arrived, admitted, first, end = zip(*rows, strict=True)
    # The ids' differences from the row before, modulo 2**64 as numpy's, on one integer of
    # n 64-bit lanes: the top bit of each lane kept out of the subtraction, so that no
    # borrow crosses into the next lane, and put back after.
    packed = struct.pack(f"<{n}q", *ids)
    x = int.from_bytes(packed, "little")
    y = (x << 64 | ids[0] % 2**64) & ((1 << 64 * n) - 1)
    top = int.from_bytes(_SIGN * n, "little")
    deltas = ((x | top) - (y & ~top)) ^ (~(x ^ y) & top)
    # The express lane's rows waited for nothing: their lease is their arrival, bit for bit
    # (-0.0 less 0.0 is not 0.0).
    same = struct.pack(f"<{n}d", *admitted) == struct.pack(f"<{n}d", *arrived)
    wait = bytes(4 * n) if same else _float32s(map(sub, admitted, arrived), n)
    ttfb = list(map(sub, first, arrived))
    if min(first) <= 0.0:  # no answer came to some: their time to first byte says so
        for i, at in enumerate(first):
            if not at > 0.0:
                ttfb[i] = -1.0
    return ids[0], [
        bytes(index), bytes(outcome), bytes(streamed), deltas.to_bytes(8 * n, "little"),
        wait, _float32s(map(sub, arrived, repeat(base)), n), _float32s(ttfb, n),
        _float32s(map(sub, end, arrived), n),
    ]  # fmt: skip


def batch(n: int, seed: int = 7) -> bytearray:
    """`n` rows as the gateway packs them: three deployments, one row in 50 without an
    answer, ids in arrival order ending out of it."""
    rng = random.Random(seed)
    buf = bytearray(n * ROW.size)
    at = BASE
    for i in range(n):
        at += rng.expovariate(400.0)
        first = 0.0 if i % 50 == 0 else at + rng.uniform(0.02, 0.5)
        end = (first or at) + rng.uniform(0.1, 3.0)
        rid = 1_767_225_600_000_000 + i + rng.choice((0, 0, 0, 2, -2))
        streamed = rng.random() < 0.5
        ROW.pack_into(buf, i * ROW.size, rng.randrange(3), 0, streamed, rid, at, at, first, end)
    return buf


FLUSHES: dict[str, Columns] = {"numpy": _columns, "stdlib": stdlib_columns}


def timed(n: int) -> None:
    """CPU per batch, the least of 20 runs of each."""
    buf = batch(n)
    assert _columns(buf, n, BASE) == stdlib_columns(buf, n, BASE)
    for name, flush in FLUSHES.items():
        best = float("inf")
        for _ in range(20):
            start = time.process_time()
            flush(buf, n, BASE)
            best = min(best, time.process_time() - start)
        print(f"{name}: {best * 1e3:.2f} ms a batch of {n:,} rows, {best * 1e9 / n:.0f} ns a row")


def instructions(n: int) -> None:
    """Instructions per row: 1 and 11 flushes under callgrind, the difference."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind (Debian package valgrind)")
    for name in FLUSHES:
        counts = []
        for flushes in (1, 11):
            done = subprocess.run(
                [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                 "-m", "tests.perf.bench_trace_flush", "--rows", str(n), "--untimed", name,
                 "--flushes", str(flushes)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            match = re.search(r"Collected : (\d+)", done.stderr)
            if match is None:
                raise SystemExit(f"no count in callgrind's output:\n{done.stderr[-2000:]}")
            counts.append(int(match.group(1)))
        per = (counts[1] - counts[0]) / 10 / n
        print(f"{name}: {per:,.0f} instructions a row (batches of {n:,}, callgrind)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="rows a batch")
    parser.add_argument("--instructions", action="store_true", help="count them (callgrind)")
    parser.add_argument("--untimed", choices=sorted(FLUSHES), help=argparse.SUPPRESS)
    parser.add_argument("--flushes", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instructions:
        instructions(args.rows)
    elif args.untimed:
        buf, flush = batch(args.rows), FLUSHES[args.untimed]
        flush(buf, args.rows, BASE)  # numpy's first call sets up what it keeps
        for _ in range(args.flushes - 1):
            flush(buf, args.rows, BASE)
    else:
        timed(args.rows)


if __name__ == "__main__":
    main()
