"""Gateway benchmark: direct vs nginx vs the gateway, against the same simulated engines.

    python -m tests.perf.bench_gateway [--quick] [--baseline DIR]

Starts (all on loopback, all ended at exit): two simulated vLLM engines (one answering at
once for latency, one pacing tokens for streams), nginx as a keep-alive reverse proxy with a
minimal config of ours, and the gateway with a scripted ready controller, each in its own
process on uvloop (the gateway checks that it is).  The load generator is this process.
Everything is bounded: fixed request counts, deadlines on every wait.

Fairness: every target is asked through the same client code, after a warm-up.  At
concurrency 1 the targets take turns request by request (rotating who goes first), so that
drifts of the shared machine hit them alike; at 64 and for streams they take turns by
rounds.  CPU is each proxy process's on-CPU time (user and system, ns, from schedstat) over
the requests it served.  `--baseline DIR` adds a second gateway built from the `gateway`
package in DIR (e.g. `git archive <rev> gateway | tar -x -C DIR`), measured in the same
turns: a before / after comparison on the same machine at the same time.

Measured: added latency p50/p99 of small non-streaming requests at concurrency 1 and 64, TTFB
and relayed tokens/s of 256 concurrent streams, and the extra RSS of 1,000 idle keep-alive
connections.  Targets: added p50 <= 2x nginx's; streaming >= 90% of direct; < 50 MB per 1,000
idle connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "bench"
SMALL = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
STREAM = (
    b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":%d,"stream":true}'
)
DEADLINE_S = 120.0
STREAM_ROUNDS = 3
ROUNDS_C64 = 4
WARMUP = 100  # requests per connection (a tenth of it at concurrency 64) before measuring


# --- the gateway process -----------------------------------------------------------------------


def serve_gateway(engines: list[int], port: int, package_dir: str) -> None:
    """Run the gateway with deployments d0.. ready on the given engine ports (child process).

    `package_dir`: where to import the `gateway` package from ("" for this checkout's).
    """
    if package_dir:
        sys.path.insert(0, package_dir)  # before the checkout, which `-m` put first
    import uvloop

    import gateway
    from actors.ports import EngineHandle
    from gateway.app import Gateway
    from tests.gateway_support import ScriptedController

    if package_dir and not str(gateway.__file__).startswith(package_dir):
        raise SystemExit(f"gateway imported from {gateway.__file__}, not {package_dir}")

    async def main() -> None:
        controller = ScriptedController()
        for index, engine_port in enumerate(engines):
            handle = EngineHandle(
                deployment_id=f"d{index}", host="127.0.0.1", port=engine_port, runtime_id="b"
            )
            controller.add(f"d{index}", handle=handle, served_model=MODEL)
        loop = asyncio.get_running_loop()
        if not isinstance(loop, uvloop.Loop):  # production runs on uvloop; so must this
            raise SystemExit(f"gateway loop is {type(loop)!r}, not uvloop")
        gateway = Gateway(controller)
        await gateway.serve("127.0.0.1", port)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        await gateway.shutdown(1.0)

    uvloop.run(main())


# --- processes -----------------------------------------------------------------------------


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Poll until something accepts on the port (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open")


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_timeout 75s;
    keepalive_requests 100000;
    upstream engine_fast {{ server 127.0.0.1:{fast}; keepalive 256; }}
    upstream engine_paced {{ server 127.0.0.1:{paced}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_max_body_size 16m;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_buffering off;
        proxy_read_timeout 1800s;
        location /fast/ {{ proxy_pass http://engine_fast/; }}
        location /paced/ {{ proxy_pass http://engine_paced/; }}
    }}
}}
"""


@dataclass
class Rig:
    """The processes of one benchmark run."""

    fast: int
    paced: int
    nginx: int
    gateway: int
    baseline: int = 0  # a second gateway from --baseline, 0 when none
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)


@contextlib.contextmanager
def processes(stream_tokens: int, token_delay: float, baseline: str | None) -> Iterator[Rig]:
    """Start engines, nginx and the gateway(s); stop exactly those at exit."""
    nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
    rig = Rig(fast=free_port(), paced=free_port(), nginx=free_port(), gateway=free_port())
    if baseline:
        rig.baseline = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    python = sys.executable
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        for name, port, extra in (
            ("engine-fast", rig.fast, []),
            ("engine-paced", rig.paced, ["--token-delay", str(token_delay)]),
        ):
            rig.procs[name] = subprocess.Popen(
                [python, "-m", "simulations.engine", "--host", "127.0.0.1", "--port", str(port),
                 "--flavour", "vllm", "--model", MODEL, "--tokens", str(stream_tokens),
                 "--max-running", "1024", *extra],
                env=env, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        conf = workdir / "nginx.conf"
        conf.write_text(
            NGINX_CONF.format(dir=workdir, fast=rig.fast, paced=rig.paced, port=rig.nginx)
        )
        rig.procs["nginx"] = subprocess.Popen(
            [nginx_bin, "-c", str(conf), "-p", str(workdir)], stderr=subprocess.DEVNULL
        )
        gateways = [("gateway", rig.gateway, "")]
        if baseline:
            gateways.append(("base", rig.baseline, os.path.abspath(baseline)))
        for name, port, package_dir in gateways:
            rig.procs[name] = subprocess.Popen(
                [python, "-m", "tests.perf.bench_gateway", "--serve-gateway",
                 "--engines", f"{rig.fast},{rig.paced}", "--port", str(port),
                 "--package-dir", package_dir],
                env=env, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        ports = [("engine-fast", rig.fast), ("engine-paced", rig.paced), ("nginx", rig.nginx)]
        for name, port in ports + [(name, port) for name, port, _ in gateways]:
            wait_port(port, rig.procs[name])
        yield rig
    finally:
        for proc in rig.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in rig.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


def rss_bytes(pid: int) -> int:
    """Resident set size of one process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """On-CPU time (user and system) of every thread of one process so far, ns-precise."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def children(pid: int) -> list[int]:
    """Direct children of a process (nginx's workers)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.extend(int(x) for x in text)
    return out


# --- the load generator ------------------------------------------------------------------------


@dataclass
class Exchange:
    """One measured request."""

    latency: float
    ttfb: float
    tokens: int


class Conn:
    """A minimal keep-alive HTTP/1.1 client: pre-encoded requests, Content-Length or chunked."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        """Connect to 127.0.0.1:port."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        return cls(reader, writer)

    async def exchange(self, request: bytes) -> Exchange:
        """Send one request and read its whole answer."""
        start = time.perf_counter()
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"unexpected answer {head[:60]!r}")
        lower = head.lower()
        ttfb = 0.0
        tokens = 0
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                data = await self.reader.readexactly(size + 2)
                if not ttfb:
                    ttfb = time.perf_counter() - start
                tokens += data.count(b"data: ")
        else:
            marker = lower.index(b"content-length:") + len(b"content-length:")
            length = int(lower[marker : lower.index(b"\r\n", marker)])
            await self.reader.readexactly(length)
            ttfb = time.perf_counter() - start
        return Exchange(time.perf_counter() - start, ttfb, tokens)

    def close(self) -> None:
        """Drop the connection."""
        self.writer.transport.abort()


def request_bytes(path: str, body: bytes) -> bytes:
    """A POST request with a JSON body."""
    return (
        f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def turns_run(
    targets: dict[str, tuple[int, str]], pids: dict[str, int], n: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Concurrency 1: one connection per target, the targets taking turns request by request.

    Returns the latencies per target and each proxy's CPU seconds over the measured requests.
    """
    conns = {name: await Conn.open(port) for name, (port, _) in targets.items()}
    requests = {name: request_bytes(path, SMALL) for name, (_, path) in targets.items()}
    names = list(targets)
    async with asyncio.timeout(DEADLINE_S):
        for _ in range(WARMUP):  # connections to the engine exist and code paths are hot
            for name in names:
                await conns[name].exchange(requests[name])
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        latencies: dict[str, list[float]] = {name: [] for name in names}
        for i in range(n):
            turn = i % len(names)  # rotate who goes first
            for name in names[turn:] + names[:turn]:
                latencies[name].append((await conns[name].exchange(requests[name])).latency)
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    for conn in conns.values():
        conn.close()
    return latencies, used


async def latency_run(
    port: int, path: str, pid: int | None, concurrency: int, per_conn: int
) -> tuple[list[float], float]:
    """Latencies of `concurrency` connections each sending `per_conn` small requests, and the
    proxy's CPU seconds over them (warm-up excluded)."""
    request = request_bytes(path, SMALL)
    conns = [await Conn.open(port) for _ in range(concurrency)]
    async with asyncio.timeout(DEADLINE_S):  # warm-up
        for _ in range(WARMUP // 10):
            await asyncio.gather(*(c.exchange(request) for c in conns))
    latencies: list[float] = []

    async def worker(conn: Conn) -> None:
        for _ in range(per_conn):
            latencies.append((await conn.exchange(request)).latency)

    before = cpu_seconds(pid) if pid else 0.0
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.gather(*(worker(c) for c in conns))
    used = cpu_seconds(pid) - before if pid else 0.0
    for conn in conns:
        conn.close()
    return latencies, used


async def stream_run(port: int, path: str, streams: int, tokens: int) -> tuple[list[float], float]:
    """TTFBs and aggregate tokens/s of `streams` concurrent streaming requests."""
    request = request_bytes(path, STREAM % tokens)
    conns = [await Conn.open(port) for _ in range(streams)]
    warm = request_bytes(path, STREAM % 1)
    async with asyncio.timeout(DEADLINE_S):  # warm-up: every proxy holds its engine connections
        await asyncio.gather(*(c.exchange(warm) for c in conns))
    start = time.perf_counter()
    async with asyncio.timeout(DEADLINE_S):
        results = await asyncio.gather(*(c.exchange(request) for c in conns))
    wall = time.perf_counter() - start
    for conn in conns:
        conn.close()
    return [r.ttfb for r in results], sum(r.tokens for r in results) / wall


async def idle_rss(port: int, path: str, pid: int, count: int) -> int:
    """Extra RSS of `pid` after `count` keep-alive connections each made one request."""
    request = request_bytes(path, SMALL)
    warm = [await Conn.open(port) for _ in range(32)]
    for conn in warm:
        await conn.exchange(request)
    for conn in warm:
        conn.close()
    before = rss_bytes(pid)
    conns: list[Conn] = []
    async with asyncio.timeout(DEADLINE_S):
        for start in range(0, count, 100):
            batch = [await Conn.open(port) for _ in range(min(100, count - start))]
            await asyncio.gather(*(c.exchange(request) for c in batch))
            conns.extend(batch)
    after = rss_bytes(pid)
    for conn in conns:
        conn.close()
    return after - before


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(rig: Rig, quick: bool, tokens: int) -> None:
    """Run every measurement and print the table."""
    n1, n64, streams = (300, 12, 64) if quick else (3000, 40, 256)
    targets = {
        "direct": (rig.fast, "/v1/chat/completions", rig.paced, "/v1/chat/completions"),
        "nginx": (rig.nginx, "/fast/v1/chat/completions", rig.nginx, "/paced/v1/chat/completions"),
        "gateway": (rig.gateway, "/d/d0/v1/chat/completions", rig.gateway,
                    "/d/d1/v1/chat/completions"),
    }  # fmt: skip
    pids = {"nginx": children(rig.procs["nginx"].pid)[0], "gateway": rig.procs["gateway"].pid}
    if rig.baseline:
        targets["base"] = (rig.baseline, "/d/d0/v1/chat/completions", rig.baseline,
                           "/d/d1/v1/chat/completions")  # fmt: skip
        pids["base"] = rig.procs["base"].pid
    names = list(targets)
    proxies = names[1:]
    cpu: dict[tuple[str, str], float] = {}  # CPU seconds used
    count: dict[tuple[str, str], int] = {}  # ... for this many requests or events

    def spent(name: str, what: str, seconds: float, items: int) -> None:
        cpu[(name, what)] = cpu.get((name, what), 0.0) + seconds
        count[(name, what)] = count.get((name, what), 0) + items

    # Memory first, on fresh processes: later phases leave freed memory behind that idle
    # connections would reuse, in amounts that differ between proxies.
    rss = {name: await idle_rss(targets[name][0], targets[name][1], pids[name], 1000)
           for name in proxies}  # fmt: skip
    lat: dict[tuple[str, int], list[float]] = {}
    got1, used1 = await turns_run({n: (t[0], t[1]) for n, t in targets.items()}, pids, n1)
    for name in names:
        lat[(name, 1)] = got1[name]
        if name in pids:
            spent(name, "c1", used1[name], n1)
    for turn in range(ROUNDS_C64):  # rounds, rotating who goes first
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            port, path, _, _ = targets[name]
            got, used = await latency_run(port, path, pids.get(name), 64, n64 // ROUNDS_C64)
            lat.setdefault((name, 64), []).extend(got)
            if name in pids:
                spent(name, "c64", used, len(got))
    ttfb: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    for _ in range(STREAM_ROUNDS):  # interleaved rounds; the median rate is reported
        for name, (_, _, port, path) in targets.items():
            before = cpu_seconds(pids[name]) if name in pids else 0.0
            got_ttfb, got_rate = await stream_run(port, path, streams, tokens)
            ttfb.setdefault(name, []).extend(got_ttfb)
            rates.setdefault(name, []).append(got_rate)
            if name in pids:
                # per relayed event (tokens and the closing events), warm-up included
                spent(name, "event", cpu_seconds(pids[name]) - before, streams * (tokens + 4))
    rate = {name: sorted(values)[len(values) // 2] for name, values in rates.items()}

    ms, us = 1000.0, 1e6
    rows: list[tuple[str, list[str], str]] = []

    def row(label: str, values: dict[str, float], note: str = "") -> None:
        rows.append((label, [f"{values[n]:.3f}" if n in values else "-" for n in names], note))

    def vs_nginx(values: dict[str, float], target: str = "") -> str:
        if values["nginx"] <= 0:
            return "gw/nginx n/a (nginx added <= 0)"
        return f"gw/nginx {values['gateway'] / values['nginx']:.2f}x{target}"

    for c in (1, 64):
        p50 = {name: pct(lat[(name, c)], 0.5) * ms for name in names}
        p99 = {name: pct(lat[(name, c)], 0.99) * ms for name in names}
        row(f"c={c} latency p50 (ms)", p50)
        row(f"c={c} latency p99 (ms)", p99)
        added50 = {name: p50[name] - p50["direct"] for name in proxies}
        added99 = {name: p99[name] - p99["direct"] for name in proxies}
        row(f"c={c} added p50 (ms)", added50, vs_nginx(added50, " (target <= 2x)"))
        row(f"c={c} added p99 (ms)", added99, vs_nginx(added99))
        if c == 1:  # the same turn's direct request as the reference: drift cancels out
            paired = {
                name: pct([a - b for a, b in zip(lat[(name, 1)], lat[("direct", 1)], strict=True)],
                          0.5) * ms
                for name in proxies
            }  # fmt: skip
            row("c=1 added, paired p50 (ms)", paired, vs_nginx(paired))
    row(f"{streams} streams TTFB p50 (ms)", {n: pct(v, 0.5) * ms for n, v in ttfb.items()})
    row(f"{streams} streams TTFB p99 (ms)", {n: pct(v, 0.99) * ms for n, v in ttfb.items()})
    row(f"{streams} streams tokens/s", rate,
        f"gw/direct {rate['gateway'] / rate['direct']:.1%} (target >= 90%)")  # fmt: skip
    row("RSS per 1,000 idle conns (MB)", {n: v / 1e6 for n, v in rss.items()}, "target < 50 MB")
    for what, label in (("c1", "request, c=1"), ("c64", "request, c=64"), ("event", "event")):
        per = {name: cpu[(name, what)] / count[(name, what)] * us for name in proxies}
        note = f"gw/nginx {per['gateway'] / per['nginx']:.1f}x"
        if "base" in per:
            note += f", gw/base {per['gateway'] / per['base']:.2f}x"
        row(f"proxy CPU per {label} (us)", per, note)

    width = max(len(label) for label, _, _ in rows)
    print(f"{'':{width}}  " + "  ".join(f"{n:>10}" for n in names) + "  notes")
    for label, cells, note in rows:
        print(f"{label:{width}}  " + "  ".join(f"{cell:>10}" for cell in cells) + f"  {note}")
    print(
        f"\n(samples: c=1 {n1}/target in turns, c=64 {len(lat[('direct', 64)])}/target in"
        f" {ROUNDS_C64} rounds; {STREAM_ROUNDS} rounds of {streams} streams of {tokens} tokens"
        " paced by the engine, median rate; added latency is p50(proxy) - p50(direct), paired:"
        " the median of proxy - direct within a turn; CPU is"
        " the proxy process's on-CPU time (user+system); the machine is shared: run it twice)"
    )


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument("--serve-gateway", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engines", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--package-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--token-delay", type=float, default=0.02)
    parser.add_argument(
        "--baseline", default=None, metavar="DIR", help="also measure the gateway package in DIR"
    )
    args = parser.parse_args()
    if args.serve_gateway:
        serve_gateway([int(p) for p in args.engines.split(",")], args.port, args.package_dir)
        return
    import uvloop

    with processes(args.stream_tokens, args.token_delay, args.baseline) as rig:
        uvloop.run(measure(rig, args.quick, args.stream_tokens))


if __name__ == "__main__":
    main()
