"""Gateway benchmark: direct vs nginx vs the gateway, against the same simulated engines.

    python -m tests.perf.bench_gateway [--quick]

Starts (all on loopback, all ended at exit): two simulated vLLM engines (one answering at
once for latency, one pacing tokens for streams), nginx as a keep-alive reverse proxy with a
minimal config of ours, and the gateway with a scripted ready controller, each in its own
process on uvloop.  The load generator is this process.  Everything is bounded: fixed request
counts, deadlines on every wait.

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


# --- the gateway process -----------------------------------------------------------------------


def serve_gateway(engines: list[int], port: int) -> None:
    """Run the gateway with deployments d0.. ready on the given engine ports (child process)."""
    import uvloop

    from actors.ports import EngineHandle
    from gateway.app import Gateway
    from tests.gateway_support import ScriptedController

    async def main() -> None:
        controller = ScriptedController()
        for index, engine_port in enumerate(engines):
            handle = EngineHandle(
                deployment_id=f"d{index}", host="127.0.0.1", port=engine_port, runtime_id="b"
            )
            controller.add(f"d{index}", handle=handle, served_model=MODEL)
        gateway = Gateway(controller)
        await gateway.serve("127.0.0.1", port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
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
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)


@contextlib.contextmanager
def processes(stream_tokens: int, token_delay: float) -> Iterator[Rig]:
    """Start engines, nginx and the gateway; stop exactly those at exit."""
    nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
    rig = Rig(fast=free_port(), paced=free_port(), nginx=free_port(), gateway=free_port())
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
        rig.procs["gateway"] = subprocess.Popen(
            [python, "-m", "tests.perf.bench_gateway", "--serve-gateway",
             "--engines", f"{rig.fast},{rig.paced}", "--port", str(rig.gateway)],
            env=env, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        for name, port in (
            ("engine-fast", rig.fast),
            ("engine-paced", rig.paced),
            ("nginx", rig.nginx),
            ("gateway", rig.gateway),
        ):
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
    """User plus system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


async def latency_run(port: int, path: str, concurrency: int, per_conn: int) -> list[float]:
    """Latencies of `concurrency` connections each sending `per_conn` small requests."""
    request = request_bytes(path, SMALL)
    conns = [await Conn.open(port) for _ in range(concurrency)]
    for conn in conns:  # warm-up: connections to the engine exist and code paths are hot
        for _ in range(5):
            await conn.exchange(request)
    latencies: list[float] = []

    async def worker(conn: Conn) -> None:
        for _ in range(per_conn):
            latencies.append((await conn.exchange(request)).latency)

    async with asyncio.timeout(DEADLINE_S):
        await asyncio.gather(*(worker(c) for c in conns))
    for conn in conns:
        conn.close()
    return latencies


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
    n1, n64, streams = (300, 10, 64) if quick else (2000, 40, 256)
    targets = {
        "direct": (rig.fast, "/v1/chat/completions", rig.paced, "/v1/chat/completions"),
        "nginx": (rig.nginx, "/fast/v1/chat/completions", rig.nginx, "/paced/v1/chat/completions"),
        "gateway": (rig.gateway, "/d/d0/v1/chat/completions", rig.gateway,
                    "/d/d1/v1/chat/completions"),
    }  # fmt: skip
    pids = {"nginx": children(rig.procs["nginx"].pid)[0], "gateway": rig.procs["gateway"].pid}
    cpu: dict[tuple[str, str], float] = {}  # CPU seconds used
    count: dict[tuple[str, str], int] = {}  # ... for this many requests or events
    lat: dict[tuple[str, int], list[float]] = {}
    for concurrency, per_conn in ((1, n1), (64, n64)):
        # Interleave the targets in rounds so that drifts of the machine hit all alike.
        for _ in range(2):
            for name, (port, path, _, _) in targets.items():
                before = cpu_seconds(pids[name]) if name in pids else 0.0
                got = await latency_run(port, path, concurrency, per_conn // 2)
                lat.setdefault((name, concurrency), []).extend(got)
                if name in pids:
                    key = (name, f"c{concurrency}")
                    cpu[key] = cpu.get(key, 0.0) + cpu_seconds(pids[name]) - before
                    count[key] = count.get(key, 0) + len(got)
    ttfb: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    for _ in range(STREAM_ROUNDS):  # interleaved rounds; the median rate is reported
        for name, (_, _, port, path) in targets.items():
            before = cpu_seconds(pids[name]) if name in pids else 0.0
            got_ttfb, got_rate = await stream_run(port, path, streams, tokens)
            ttfb.setdefault(name, []).extend(got_ttfb)
            rates.setdefault(name, []).append(got_rate)
            if name in pids:
                # per relayed event (tokens and the closing events), warm-up included in both
                key = (name, "token")
                cpu[key] = cpu.get(key, 0.0) + cpu_seconds(pids[name]) - before
                count[key] = count.get(key, 0) + streams * (tokens + 4)
    rate = {name: sorted(values)[len(values) // 2] for name, values in rates.items()}
    rss = {
        "gateway": await idle_rss(rig.gateway, "/d/d0/v1/chat/completions", pids["gateway"], 1000),
        "nginx": await idle_rss(rig.nginx, "/fast/v1/chat/completions", pids["nginx"], 1000),
    }

    ms = 1000.0
    rows: list[tuple[str, str, str, str, str]] = []

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def row(label: str, d: float | None, n: float | None, g: float | None, ratio: str) -> None:
        rows.append((label, fmt(d), fmt(n), fmt(g), ratio))

    def ratio(gateway: float, nginx: float, target: str = "") -> str:
        return f"gw/nginx {gateway / nginx:.2f}x{target}" if nginx > 0 else ""

    for c in (1, 64):
        p = {name: (pct(lat[(name, c)], 0.5), pct(lat[(name, c)], 0.99)) for name in targets}
        row(f"c={c} latency p50 (ms)", p["direct"][0] * ms, p["nginx"][0] * ms,
            p["gateway"][0] * ms, "")  # fmt: skip
        row(f"c={c} latency p99 (ms)", p["direct"][1] * ms, p["nginx"][1] * ms,
            p["gateway"][1] * ms, "")  # fmt: skip
        added_n50, added_g50 = p["nginx"][0] - p["direct"][0], p["gateway"][0] - p["direct"][0]
        added_n99, added_g99 = p["nginx"][1] - p["direct"][1], p["gateway"][1] - p["direct"][1]
        row(f"c={c} added p50 (ms)", None, added_n50 * ms, added_g50 * ms,
            ratio(added_g50, added_n50, " (target <= 2x)"))  # fmt: skip
        row(f"c={c} added p99 (ms)", None, added_n99 * ms, added_g99 * ms,
            ratio(added_g99, added_n99))  # fmt: skip
    row(f"{streams} streams TTFB p50 (ms)", pct(ttfb["direct"], 0.5) * ms,
        pct(ttfb["nginx"], 0.5) * ms, pct(ttfb["gateway"], 0.5) * ms, "")  # fmt: skip
    row(f"{streams} streams TTFB p99 (ms)", pct(ttfb["direct"], 0.99) * ms,
        pct(ttfb["nginx"], 0.99) * ms, pct(ttfb["gateway"], 0.99) * ms, "")  # fmt: skip
    row(f"{streams} streams tokens/s", rate["direct"], rate["nginx"], rate["gateway"],
        f"gw/direct {rate['gateway'] / rate['direct']:.1%} (target >= 90%)")  # fmt: skip
    row("RSS per 1,000 idle conns (MB)", None, rss["nginx"] / 1e6, rss["gateway"] / 1e6,
        "target < 50 MB")  # fmt: skip
    us = 1e6
    for what, label in (
        ("c1", "request, c=1"),
        ("c64", "request, c=64"),
        ("token", "stream event"),
    ):
        n = cpu[("nginx", what)] / count[("nginx", what)]
        g = cpu[("gateway", what)] / count[("gateway", what)]
        row(f"proxy CPU per {label} (us)", None, n * us, g * us, "")

    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'direct':>10}  {'nginx':>10}  {'gateway':>10}  notes")
    for label, d_text, n_text, g_text, note in rows:
        print(f"{label:{width}}  {d_text:>10}  {n_text:>10}  {g_text:>10}  {note}")
    print(
        f"\n(samples: c=1 {len(lat[('direct', 1)])}/target, c=64 {len(lat[('direct', 64)])}"
        f"/target; {STREAM_ROUNDS} rounds of {streams} streams of {tokens} tokens paced by the"
        " engine, median rate; added latency is p50(proxy) - p50(direct); the machine is"
        " shared, so run it twice)"
    )


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument("--serve-gateway", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engines", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--token-delay", type=float, default=0.02)
    args = parser.parse_args()
    if args.serve_gateway:
        serve_gateway([int(p) for p in args.engines.split(",")], args.port)
        return
    import uvloop

    with processes(args.stream_tokens, args.token_delay) as rig:
        uvloop.run(measure(rig, args.quick, args.stream_tokens))


if __name__ == "__main__":
    main()
