"""Cold start from the request's arrival: an engine started directly against the same start
through DGXMM, so that DGXMM's admission, memory grant and launch count too.

    python -m tests.perf.bench_cold_arrival --engine llama --starts 20
    python -m tests.perf.bench_cold_arrival --engine vllm --starts 5

`tests/perf/bench_cold_start.py` measures DGXMM's share of a vLLM start from the engine's first
healthy answer to the first byte relayed, which leaves out everything before the engine runs.
Here each start is timed as a client sees it, interleaved (who goes first alternates):

- **direct**: the engine's command line exactly as DGXMM's process runtime runs it (same argv,
  same environment), spawned by this script; `GET /health` every 10 ms until 200, then a
  one-token chat completion; the time from the spawn to the answer's first byte.
- **through DGXMM**: a real `dgxmm serve` (process runtime) with the same engine deployed on
  demand and asleep; the same request to the gateway; the time from sending it to the answer's
  first byte.  Then Stop, waited for, before the next start.

Printed per start and as median [p25, p75] (min-max): direct, through DGXMM, and the
difference per interleaved pair (DGXMM minus direct, its median is the figure).  For the
DGXMM starts, where the time went, from the event log (all epoch seconds, one clock):
send -> arrival (`RequestQueued.arrived_at`), admission (-> `StartRequested`), memory grant
(-> `EngineStarting.launch_began_at`), spawn (-> `EngineStarting`), load + readiness
detection (-> `EngineReady`), relay (-> the first byte at the client); and for the direct
starts spawn -> healthy and healthy -> first byte.  Comparing "spawn + load + readiness" with
the direct "spawn -> healthy" and "relay" with the direct "healthy -> first byte" says which
part of the difference is DGXMM's own work and which is the engine starting slower or faster.

`--out FILE` also writes every start as a JSON line.  The llama.cpp engine is
scripts/build-llama-server's (LLAMA_SERVER / LLAMA_MODEL), vLLM scripts/build-vllm's
(VLLM_PYTHON / VLLM_MODEL).  Everything is on loopback on a shared machine: read medians and
spreads of interleaved pairs, never one start.  Exit status 0 even when the 50 ms target is
missed (it is a measurement).  The numbers are in docs/on-demand-gateway.md.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dgxmm.engines.runtimes import free_port
from tests.cold_start_support import llama_log_times, process_started_at
from tests.perf.bench_cold_start import HealthPoller
from tests.real_engine_support import ENGINE_ARGS, Serve, llama_build, poll
from tests.vllm_support import VLLM_ARGS, VLLM_ENV, vllm_serving

HEALTH_POLL_S = 0.010
ONE_TOKEN = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
TARGET_S = 0.050


@dataclass
class Subject:
    """One engine: DGXMM's deployment name and the same command line run directly."""

    name: str
    model: str
    argv: list[str]  # with "{port}" for the port
    env: dict[str, str]
    deadline_s: float
    engine_clock: bool = False  # llama.cpp's --log-timestamps: its own work is timed
    stream: bool = False  # vLLM: a stream, whose first byte does not wait for the token
    direct: list[dict[str, float]] = field(default_factory=list)
    dgxmm: list[dict[str, float]] = field(default_factory=list)


def first_byte(
    port: int, path: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> tuple[float, int, dict[str, str]]:
    """POST and read the answer: (perf_counter at its first byte, status, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(
            "POST", path, json.dumps(body).encode(), {"content-type": "application/json", **headers}
        )
        sock = conn.sock
        assert sock is not None
        peeked = sock.recv(1, socket.MSG_PEEK)  # left in the socket for the parser
        at = time.perf_counter()
        if not peeked:
            raise RuntimeError(f"{path}: the connection closed without an answer")
        answer = conn.getresponse()
        answer.read()
        return at, answer.status, {k.lower(): v for k, v in answer.getheaders()}
    finally:
        conn.close()


def healthy(port: int) -> bool:
    """Whether `GET /health` answers 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        answer = conn.getresponse()
        answer.read()
        return answer.status == 200
    except OSError:
        return False
    finally:
        conn.close()


def direct_start(subject: Subject, workdir: Path) -> dict[str, float]:
    """Spawn the engine, poll its health every 10 ms, ask once; the times from the spawn."""
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in subject.argv]
    log_path = workdir / f"{subject.name}-direct-{len(subject.direct) + 1}.log"
    with log_path.open("ab") as log:
        spawned = time.perf_counter()
        spawned_wall = time.time()
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **subject.env},
            start_new_session=True,
        )
    try:
        deadline = spawned + subject.deadline_s
        while not healthy(port):
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"{subject.name} direct: not healthy (see {workdir})")
            time.sleep(HEALTH_POLL_S)
        health_at = time.perf_counter()
        body = {"model": subject.model, **ONE_TOKEN, "stream": subject.stream}
        at, status, _ = first_byte(port, "/v1/chat/completions", body, {}, subject.deadline_s)
        if status != 200:
            raise RuntimeError(f"{subject.name} direct answered {status}")
        times = {
            "total": at - spawned,
            "spawn -> healthy": health_at - spawned,
            "healthy -> first byte": at - health_at,
        }
        if subject.engine_clock:
            times.update(
                engine_own(
                    lambda: log_path.read_text(errors="replace").splitlines(),
                    f"pid:{proc.pid}",
                    times["total"],
                    (spawned_wall, spawned_wall + health_at - spawned, spawned_wall + at - spawned),
                )
            )
        return times
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the engine's process group (vLLM's workers too), SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):  # workers left in the group
            os.killpg(proc.pid, signal.SIGKILL)
        return


def dgxmm_start(subject: Subject, serve: Serve) -> dict[str, float]:
    """One request to the sleeping deployment through the gateway; the times from sending."""
    dep_id = serve.deployments[subject.name]
    # Without the engine's clock, its first healthy answer as a 10 ms poller sees it.
    poller = None if subject.engine_clock else HealthPoller(serve, dep_id)
    sent_wall = time.time()
    sent = time.perf_counter()
    try:
        at, status, headers = first_byte(
            serve.gateway_port,
            serve.gateway_path(subject.name),
            {"model": subject.model, **ONE_TOKEN, "stream": subject.stream},
            serve.gateway_auth,
            subject.deadline_s,
        )
    finally:
        if poller is not None:
            poller.stop()
    if status != 200:
        raise RuntimeError(f"{subject.name} through DGXMM answered {status}")
    total = at - sent
    first_byte_wall = sent_wall + total
    request_id = headers.get("x-dgxmm-request-id", "")
    events: list[dict[str, Any]] = poll(
        lambda: (evs := serve.events()) and any(_is_first_byte(e, request_id) for e in evs) and evs,
        "the first byte to be recorded",
    )
    queued = next(
        e["data"] for e in events
        if e["type"] == "RequestQueued" and e["data"]["request_id"] == request_id
    )  # fmt: skip
    stream = f"deployment:{serve.deployments[subject.name]}"
    mine = [e for e in events if e.get("stream") == stream]
    requested = [e for e in mine if e["type"] == "StartRequested"][-1]
    starting = [e for e in mine if e["type"] == "EngineStarting"][-1]
    ready = [e for e in mine if e["type"] == "EngineReady"][-1]
    arrived = float(queued["arrived_at"])
    launch_began = float(starting["data"]["launch_began_at"])
    own = {}
    if poller is not None and poller.first_200 is not None:
        own["engine healthy -> first byte"] = at - poller.first_200
    if subject.engine_clock:
        own = engine_own(
            lambda: list(serve.api("GET", f"/deployments/{dep_id}/logs?tail=5000")["lines"]),
            str(starting["data"]["runtime_id"]),
            total,
            (launch_began, float(ready["ts"]), first_byte_wall),
        )
    serve.api("POST", f"/deployments/{dep_id}/stop", {})
    serve.wait_state(subject.name, "stopped", timeout_s=180)
    return {
        **own,
        "total": total,
        "send -> arrival": arrived - sent_wall,
        "admission": float(requested["ts"]) - arrived,
        "memory grant": launch_began - float(requested["ts"]),
        "spawn": float(starting["ts"]) - launch_began,
        "load + readiness": float(ready["ts"]) - float(starting["ts"]),
        "relay": first_byte_wall - float(ready["ts"]),
    }


def engine_own(
    lines: Callable[[], list[str]],
    runtime_id: str,
    total: float,
    walls: tuple[float, float, float],
) -> dict[str, float]:
    """The engine's own work in one start, on its own clock (llama.cpp's log timestamps from
    its process's start time): loading (process start to "model loaded") and its first
    request (task launched to released: the line may follow the answer, so the log is read
    until it has it); the rest of `total`, the time outside it; and that rest cut at the
    engine's moments, given `walls`: (launch began, seen ready, first byte) in epoch seconds."""
    started = process_started_at(runtime_id)
    wanted = {"model_loaded", "task_launched", "task_released"}
    times: dict[str, float] = poll(
        lambda: wanted <= (found := llama_log_times(lines(), started)).keys() and found,
        "the engine's log to show its first request released",
        10.0,
    )
    loading = times["model_loaded"] - started
    request = times["task_released"] - times["task_launched"]
    launch, ready, first_byte = walls
    return {
        "engine: loading": loading,
        "engine: request": request,
        "outside the engine": total - loading - request,
        "  launch -> process start": started - launch,
        "  model loaded -> seen ready": ready - times["model_loaded"],
        "  seen ready -> task launched": times["task_launched"] - ready,
        "  task released -> first byte": first_byte - times["task_released"],
    }


def _is_first_byte(event: dict[str, Any], request_id: str) -> bool:
    return bool(event["type"] == "FirstByteRelayed" and event["data"]["request_id"] == request_id)


# --- running and reporting ---------------------------------------------------------------------


def spread(values: Sequence[float]) -> str:
    """Median [p25, p75] (min-max), in ms."""
    ordered = sorted(v * 1000 for v in values)
    if len(ordered) < 2:
        return f"{ordered[0]:.1f} ms" if ordered else "-"
    p25, _, p75 = statistics.quantiles(ordered, n=4, method="inclusive")
    return (
        f"{statistics.median(ordered):8.1f} ms [{p25:.1f}, {p75:.1f}] "
        f"({ordered[0]:.1f} to {ordered[-1]:.1f})"
    )


def median_ci(values: Sequence[float]) -> tuple[float, float]:
    """A distribution-free confidence interval of the median (order statistics): the k-th
    smallest and largest of the values, k the largest with P(Binomial(n, 1/2) < k) <= 2.5 %
    (95 % or more; min to max below 6 values, 94 % for 5)."""
    ordered, n = sorted(values), len(values)
    k = 1
    while sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= 0.025:
        k += 1
    return ordered[k - 1], ordered[n - k]


def verdict(diff: Sequence[float]) -> str:
    """The 50 ms target against the median's confidence interval."""
    low, high = median_ci(diff)
    ci = f"CI of the median [{low * 1000:.1f}, {high * 1000:.1f}] ms"
    if high <= TARGET_S:
        return f"{ci}: target <= 50 ms met"
    if low > TARGET_S:
        return f"{ci}: target <= 50 ms NOT met"
    return f"{ci}: too wide to tell the 50 ms target"


def run(subject: Subject, serve: Serve, starts: int, workdir: Path, out: Path | None) -> None:
    """`starts` interleaved pairs, who goes first alternating; printed as they go."""
    for n in range(starts):
        order = ["direct", "dgxmm"] if n % 2 == 0 else ["dgxmm", "direct"]
        for which in order:
            if which == "direct":
                subject.direct.append(direct_start(subject, workdir))
            else:
                subject.dgxmm.append(dgxmm_start(subject, serve))
        d, g = subject.direct[-1], subject.dgxmm[-1]
        print(
            f"  start {n + 1:2} {subject.name}: direct {d['total'] * 1000:8.1f} ms   "
            f"through DGXMM {g['total'] * 1000:8.1f} ms   "
            f"difference {(g['total'] - d['total']) * 1000:7.1f} ms   "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        if out is not None:
            with out.open("a") as sink:
                row = {"engine": subject.name, "start": n + 1, "first": order[0], "direct": d}
                sink.write(json.dumps({**row, "dgxmm": g}) + "\n")


def report(subject: Subject) -> None:
    """Medians and spreads of the pairs, and where the time went."""
    direct = [d["total"] for d in subject.direct]
    dgxmm = [g["total"] for g in subject.dgxmm]
    diff = [g - d for d, g in zip(direct, dgxmm, strict=True)]
    print(f"\n{subject.name}: {len(diff)} interleaved pairs; median [p25, p75] (min to max)")
    print(f"  direct            {spread(direct)}")
    print(f"  through DGXMM     {spread(dgxmm)}")
    print(f"  difference        {spread(diff)}   {verdict(diff)}")
    if subject.engine_clock:
        outside = [
            g["outside the engine"] - d["outside the engine"]
            for d, g in zip(subject.direct, subject.dgxmm, strict=True)
        ]
        print("  the same without the engine's own work (its loading and its first request, on")
        print("  its own clock), so without the start-to-start spread of the engine:")
        print(f"  difference        {spread(outside)}   {verdict(outside)}")
    elif "engine healthy -> first byte" in subject.dgxmm[0]:
        within = [
            g["send -> arrival"] + g["admission"] + g["memory grant"]
            + g["engine healthy -> first byte"] - d["healthy -> first byte"]
            for d, g in zip(subject.direct, subject.dgxmm, strict=True)
        ]  # fmt: skip
        print("  the same within each start: DGXMM's time before the launch, plus its engine's")
        print("  first healthy answer (a 10 ms poller) to the first byte, minus the direct one's:")
        print(f"  difference        {spread(within)}   {verdict(within)}")
        for key in (k for k in subject.dgxmm[0] if k.startswith("  ")):
            part = [g[key] - d[key] for d, g in zip(subject.direct, subject.dgxmm, strict=True)]
            print(f"  {key:32} {spread(part)}")
    print("  where DGXMM's starts went:")
    for key in subject.dgxmm[0]:
        if key != "total":
            print(f"    {key:22} {spread([g[key] for g in subject.dgxmm])}")
    print("  the direct starts:")
    for key in subject.direct[0]:
        if key != "total":
            print(f"    {key:22} {spread([d[key] for d in subject.direct])}")
    own = [g["send -> arrival"] + g["admission"] + g["memory grant"] for g in subject.dgxmm]
    print(f"  before the spawn (send to launch began) {spread(own)}")


@contextlib.contextmanager
def llama(workdir: Path) -> Iterator[tuple[Subject, Serve]]:
    """llama.cpp: a `dgxmm serve` with `llama` on demand and asleep, and its direct argv."""
    build = llama_build()
    if isinstance(build, str):
        sys.exit(f"bench_cold_arrival: {build} (run scripts/build-llama-server)")
    argv = [str(build.server), "-m", str(build.model), "--host", "127.0.0.1", "--port", "{port}"]
    args = [*ENGINE_ARGS, "--log-timestamps"]  # the engine's own clock, for `engine_own`
    subject = Subject("llama", str(build.model), [*argv, "--metrics", *args], {}, 120.0, True)
    serve = Serve(workdir, "process", build, total_gib=8.0)
    try:
        serve.start()
        serve.deploy("llama", args=args, idle_timeout_s=3600)
        serve.wait_state("llama", "ready")
        serve.api("POST", f"/deployments/{serve.deployments['llama']}/stop", {})
        serve.wait_state("llama", "stopped")
        yield subject, serve
    finally:
        serve.close()


@contextlib.contextmanager
def vllm(workdir: Path) -> Iterator[tuple[Subject, Serve]]:
    """The CPU vLLM: tests/vllm_support.py's `dgxmm serve` (`vllm` asleep), and its argv."""
    with vllm_serving(workdir, litellm=False) as stack:
        listen = ["--host", "127.0.0.1", "--port", "{port}"]
        argv = [*stack.vllm.command, "--model", stack.model, *listen, *VLLM_ARGS]
        subject = Subject("vllm", stack.model, argv, dict(VLLM_ENV), 600.0, stream=True)
        yield subject, stack.serve


def main() -> None:
    """Run the benchmark and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--engine", choices=["llama", "vllm"], default="llama")
    parser.add_argument("--starts", type=int, default=20, help="interleaved pairs")
    parser.add_argument("--out", type=Path, help="append each pair as a JSON line")
    ns = parser.parse_args()
    print(
        f"bench_cold_arrival {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; {ns.engine}, {ns.starts} pairs",
        flush=True,
    )
    setup = llama if ns.engine == "llama" else vllm
    with tempfile.TemporaryDirectory(prefix="bench-arrival-") as tmp, setup(Path(tmp)) as both:
        subject, serve = both
        run(subject, serve, ns.starts, Path(tmp), ns.out)
        report(subject)


if __name__ == "__main__":
    main()
