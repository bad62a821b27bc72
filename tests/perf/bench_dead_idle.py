"""The dead-idle fix's real-engine proof, repeatable: N rounds of "SIGKILL the idle llama.cpp,
then a request at once", each answered after one cold start.

    python -m tests.perf.bench_dead_idle [--rounds 20] [--runtime process|docker]

It runs `tests/test_real_engine.py::
test_an_idle_real_engine_killed_then_a_request_is_answered_after_one_cold_start[RUNTIME]`
with `DGXMM_LOST_ROUNDS=N` (the test's default is 3; issue 34's acceptance is 20), in pytest,
so the rounds are exactly the test's: one `dgxmm serve`, the engine killed behind DGXMM's
back while idle, a request sent at once, real tokens asserted, and the log must hold one
`EngineLost` and one start for a request per round.  Printed: the rounds, how many failed,
the `EngineLost` and request-start counts, and the time from sending each request to its
answer (a cold start of llama.cpp, ~2 s), as median [p25, p75] (min to max).  The test's
`[lost]` line is the source; the exit status is pytest's.  The engine and model are
scripts/build-llama-server's (LLAMA_SERVER / LLAMA_MODEL; found by the tests without them).
The numbers are in docs/on-demand-gateway.md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST = (
    "tests/test_real_engine.py::"
    "test_an_idle_real_engine_killed_then_a_request_is_answered_after_one_cold_start"
)
_LOST = re.compile(
    r"\[lost\] (\S+): (\d+) rounds, (\d+) failed; answered after (.*) s; "
    r"EngineLost (\d+), starts for a request (\d+)"
)


def main() -> None:
    """Run the rounds in pytest and summarise the test's `[lost]` line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--runtime", choices=["process", "docker"], default="process")
    ns = parser.parse_args()
    print(
        f"bench_dead_idle {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; {ns.rounds} rounds on {ns.runtime}",
        flush=True,
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
         f"{TEST}[{ns.runtime}]"],
        cwd=REPO,
        env={**os.environ, "DGXMM_LOST_ROUNDS": str(ns.rounds)},
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    found = _LOST.search(done.stdout)
    if found is None:
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
        sys.exit(f"bench_dead_idle: no [lost] line (pytest exit status {done.returncode})")
    runtime, rounds, failed, answered, lost, starts = found.groups()
    waits = sorted(float(w) for w in answered.split(", "))
    p25, _, p75 = (
        statistics.quantiles(waits, n=4, method="inclusive") if len(waits) > 1 else [0] * 3
    )
    print(
        f"  {runtime}: rounds {rounds}, failed {failed}; EngineLost {lost}, "
        f"starts for a request {starts}"
    )
    print(
        f"  answered after: median {statistics.median(waits):.2f} s [{p25:.2f}, {p75:.2f}] "
        f"({waits[0]:.2f} to {waits[-1]:.2f}); each: {answered} s"
    )
    print(f"  pytest: {'passed' if done.returncode == 0 else f'exit status {done.returncode}'}")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
