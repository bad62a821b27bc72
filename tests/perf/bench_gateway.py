"""Gateway benchmark: direct vs a bare relay vs nginx vs the gateway, on the same upstreams.

    python -m tests.perf.bench_gateway [--quick] [--rounds N] [--h11] [--baseline DIR] [--pin]
                                       [--one-cpu] [--poll-idle] [--floor]

Starts (all on loopback, all ended at exit): a static upstream (nginx answering every request
with a fixed small JSON body, in its own process: so that concurrency 64 measures the proxy,
not a saturated engine), a simulated vLLM engine pacing tokens for streams, the bare uvloop
byte relay (the Python floor: 30 lines that only forward bytes), nginx as a keep-alive
reverse proxy with a minimal config of ours, and the gateway with a scripted ready
controller, each in its own process on uvloop (the gateway checks that it is).  The load
generator is this process.  Everything is bounded: fixed request counts, deadlines on every
wait.

Fairness: every target is asked through the same client code, after a warm-up, in rounds;
each round rotates who goes first.  At concurrency 1 the targets take turns request by
request, so that drifts of the shared machine hit them alike; at 64 and for streams they
take turns target by target.  `--pin` puts every proxy on the last CPU and everything else
on the others ("on one core"; it also makes each hop cross CPUs, which adds latency to
every target); `--one-cpu` puts everything on one CPU (no hop wakes another: what the
proxies cost without the virtual machine's slow wake-ups, see `pin`); by default the
scheduler places them, as the issue measured.  `--poll-idle` keeps idle CPUs polling instead
of halting for the run (see `poll_idle`; root only), with any placement.  CPU is each
proxy process's on-CPU time (user and system, ns,
from schedstat) over the requests or events it relayed.  Every figure is the median over the
rounds.  `--h11` adds the gateway with its fast path off (`[server] gateway_fast_path =
false`); `--baseline DIR` adds a gateway built from the `gateway` package in DIR (e.g.
`git archive <rev> gateway | tar -x -C DIR`): before / after on the same machine at the
same time.  `--floor` adds the parsing floor: the bare relay plus the head work no proxy
can skip, done with the gateway's own parsers (`serve_floor`), for the small requests: what
the c=1 target leaves for everything else the gateway does.

Measured: added latency p50/p99 of small requests at concurrency 1 (and 64), requests/s at
concurrency 64, CPU per relayed request and per stream event, TTFB and relayed tokens/s of
256 concurrent streams, the extra RSS of 1,000 idle keep-alive connections; with the ratios
gateway/relay and gateway/nginx.  Targets (issue 19): CPU per request <= 3x the relay's;
>= 20,000 req/s at c=64; added p50 at c=1 <= 0.08 ms; CPU per stream event <= 1.5x nginx's;
256 streams >= 95 % of direct tokens/s; < 50 MB per 1,000 idle connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

MODEL = "bench"
SMALL = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
STREAM = (
    b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":%d,"stream":true}'
)
DEADLINE_S = 120.0
ROUNDS = 5
WARMUP = 100  # requests per connection (a tenth of it at concurrency 64) before measuring
STATIC_BODY = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"hi there"},'
    '"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'
)


# --- the gateway process -----------------------------------------------------------------------


def serve_gateway(engines: list[int], port: int, package_dir: str, fast_path: bool) -> None:
    """Run the gateway with deployments d0.. ready on the given engine ports (child process).

    `package_dir`: where to import the `gateway` package from ("" for this checkout's).
    """
    if package_dir:
        sys.path.insert(0, package_dir)  # before the checkout, which `-m` put first
    import uvloop

    import gateway
    from actors.ports import EngineHandle
    from gateway.app import Gateway
    from gateway.server import ServerConfig
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
        config = None if fast_path else ServerConfig(fast_path=False)  # a baseline may lack it
        await gateway.serve("127.0.0.1", port, config)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        await gateway.shutdown(1.0)

    # BENCH_PROFILE=FILE: the gateway runs under cProfile and writes its stats to FILE at exit.
    profile_to = os.environ.get("BENCH_PROFILE")
    if not profile_to:
        uvloop.run(main())
        return
    import cProfile

    with cProfile.Profile() as profile:
        uvloop.run(main())
    profile.dump_stats(profile_to)


# --- the bare relay: the Python floor ---------------------------------------------------------


def serve_routes(routes: list[tuple[int, int]], client: Callable[[int], asyncio.Protocol]) -> None:
    """Listen on each route's port with `client(upstream port)` per connection until SIGTERM
    (the relay's and the floor's processes)."""
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for port, upstream in routes:
            await loop.create_server(
                functools.partial(client, upstream), "127.0.0.1", port, backlog=4096
            )
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()

    uvloop.run(main())


class RouteClient(asyncio.Protocol):
    """A client's connection to the relay or the floor: it opens its own connection to the
    upstream and keeps what the client sends before that is up (`data_received` appends to
    `early` while `upstream` is None); the subclass relays."""

    def __init__(self, upstream_port: int) -> None:
        self.port = upstream_port
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def engine_side(self) -> asyncio.Protocol:
        """The protocol of the upstream connection."""
        raise NotImplementedError

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        asyncio.get_running_loop().create_task(self.connect())

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        self.upstream, _ = await loop.create_connection(self.engine_side, "127.0.0.1", self.port)
        if self.early:
            self.data_received(b"".join(self.early))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


def serve_relay(routes: list[tuple[int, int]]) -> None:
    """Forward bytes from each listening port to its upstream port, nothing else (child)."""

    class Pipe(asyncio.Protocol):
        def __init__(self, peer: asyncio.Transport) -> None:
            self.peer = peer

        def data_received(self, data: bytes) -> None:
            self.peer.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.peer.close()

    class Client(RouteClient):
        def engine_side(self) -> asyncio.Protocol:
            return Pipe(self.transport)

        def data_received(self, data: bytes) -> None:
            if self.upstream is None:
                self.early.append(data)
            else:
                self.upstream.write(data)

    serve_routes(routes, Client)


def serve_floor(routes: list[tuple[int, int]]) -> None:
    """The parsing floor (child): the bare relay plus the head work no HTTP proxy can skip,
    done with the gateway's own code: each request head parsed (`parse_head`) and rebuilt
    for the engine, each answer head parsed (`field_lines`) and rebuilt for the client with
    a request id; nothing else (no routing, leases, pool, deadlines, state machines).

    Only for the small-request phases: it assumes what they send, one whole request per
    read and one whole Content-Length answer per engine read.
    """

    from gateway.messages import HOP_BY_HOP, NOT_FORWARDED, field_lines
    from gateway.request_head import parse_head

    class Engine(asyncio.Protocol):
        def __init__(self, client: asyncio.Transport) -> None:
            self.client = client
            self.ids = 0

        def data_received(self, data: bytes) -> None:
            end = data.find(b"\r\n\r\n") + 4
            line = data.find(b"\r\n")
            out = [data[: line + 2]]
            length = 0
            for name, value in field_lines(data[line + 2 : end - 4]):
                if name == b"content-length":
                    length = int(value)
                if name not in HOP_BY_HOP:
                    out += (name, b": ", value, b"\r\n")
            self.ids += 1
            out += (b"x-request-id: %d\r\n\r\n" % self.ids, data[end : end + length])
            self.client.write(b"".join(out))

    class Client(RouteClient):
        def engine_side(self) -> asyncio.Protocol:
            return Engine(self.transport)

        def data_received(self, data: bytes) -> None:
            if self.upstream is None:
                self.early.append(data)
                return
            end = data.find(b"\r\n\r\n") + 4
            head = parse_head(data, end, 64 * 1024)
            if head is None:
                self.transport.abort()
                return
            body = data[end : end + int(head.content_length or 0)]
            parts = [head.method, b" ", head.target, b" HTTP/1.1\r\nhost: engine\r\n"]
            for name, value in head.headers:
                if name not in NOT_FORWARDED:
                    parts += (name, b": ", value, b"\r\n")
            parts += (b"content-length: %d\r\n\r\n" % len(body), body)
            self.upstream.write(b"".join(parts))

    serve_routes(routes, Client)


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
    upstream engine_fast {{ server 127.0.0.1:{static}; keepalive 256; }}
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

STATIC_CONF = """
worker_processes 1;
daemon off;
pid {dir}/static.pid;
error_log {dir}/static-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/static-body;
    keepalive_timeout 75s;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_max_body_size 16m;
        location / {{ default_type application/json; return 200 '{body}'; }}
    }}
}}
"""


@dataclass
class Rig:
    """The processes of one benchmark run."""

    static: int
    paced: int
    relay: int  # to the static upstream
    relay_paced: int  # the same relay process, to the paced engine
    nginx: int
    gateway: int
    baseline: int = 0  # a second gateway from --baseline, 0 when none
    h11: int = 0  # the gateway without its fast path (--h11), 0 when none
    floor: int = 0  # the parsing floor (--floor), 0 when none
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)


@contextlib.contextmanager
def processes(
    stream_tokens: int, token_delay: float, baseline: str | None, h11: bool, floor: bool = False
) -> Iterator[Rig]:
    """Start upstreams, the relay, nginx and the gateway(s); stop exactly those at exit."""
    nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
    rig = Rig(
        static=free_port(), paced=free_port(), relay=free_port(), relay_paced=free_port(),
        nginx=free_port(), gateway=free_port(),
    )  # fmt: skip
    if baseline:
        rig.baseline = free_port()
    if h11:
        rig.h11 = free_port()
    if floor:
        rig.floor = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    python = sys.executable
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        rig.procs["engine-paced"] = subprocess.Popen(
            [python, "-m", "simulations.engine", "--host", "127.0.0.1", "--port", str(rig.paced),
             "--flavour", "vllm", "--model", MODEL, "--tokens", str(stream_tokens),
             "--max-running", "1024", "--token-delay", str(token_delay)],
            env=env, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for name, conf_text in (
            ("static", STATIC_CONF.format(dir=workdir, port=rig.static, body=STATIC_BODY)),
            ("nginx", NGINX_CONF.format(dir=workdir, static=rig.static, paced=rig.paced,
                                        port=rig.nginx)),
        ):  # fmt: skip
            conf = workdir / f"{name}.conf"
            conf.write_text(conf_text)
            rig.procs[name] = subprocess.Popen(
                [nginx_bin, "-c", str(conf), "-p", str(workdir)], stderr=subprocess.DEVNULL
            )
        rig.procs["relay"] = subprocess.Popen(
            [python, "-m", "tests.perf.bench_gateway", "--serve-relay",
             "--routes", f"{rig.relay}:{rig.static},{rig.relay_paced}:{rig.paced}"],
            env=env,
        )  # fmt: skip
        if floor:
            rig.procs["floor"] = subprocess.Popen(
                [python, "-m", "tests.perf.bench_gateway", "--serve-floor",
                 "--routes", f"{rig.floor}:{rig.static}"],
                env=env,
            )  # fmt: skip
        gateways = [("gateway", rig.gateway, "", True)]
        if baseline:
            gateways.append(("base", rig.baseline, os.path.abspath(baseline), True))
        if h11:
            gateways.append(("h11", rig.h11, "", False))
        for name, port, package_dir, fast_path in gateways:
            rig.procs[name] = subprocess.Popen(
                [python, "-m", "tests.perf.bench_gateway", "--serve-gateway",
                 "--engines", f"{rig.static},{rig.paced}", "--port", str(port),
                 "--package-dir", package_dir, *([] if fast_path else ["--no-fast-path"])],
                env=env, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        ports = [("static", rig.static), ("engine-paced", rig.paced), ("nginx", rig.nginx),
                 ("relay", rig.relay), ("relay", rig.relay_paced)]  # fmt: skip
        if floor:
            ports.append(("floor", rig.floor))
        for name, port in ports + [(name, port) for name, port, _, _ in gateways]:
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


PROXIES = ("relay", "nginx", "gateway", "base", "h11", "floor")  # the processes measured


def pin(rig: Rig, *, together: bool = False) -> str:
    """Every proxy on the last CPU, the load generator and the upstreams on the others: "on
    one core", as the issue measures, and without the scheduler's placement (a proxy sharing
    a core with the load generator one run and not the next) in the figures.  `together`:
    everything on the last CPU instead (`--one-cpu`), so that no hop wakes another CPU: on
    a virtual machine a CPU that idles between hops comes back slow (the host runs others
    there), and at concurrency 1, where every hop waits on the one before, that cost, not
    the proxy's, is most of what is measured.  Says how."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "not pinned (one CPU)"
    proxy_cpu = {cpus[-1]}
    others = proxy_cpu if together else set(cpus[:-1])
    for name, proc in rig.procs.items():
        for pid in [proc.pid, *children(proc.pid)]:
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that just ended
                    os.sched_setaffinity(int(task.name), proxy_cpu if name in PROXIES else others)
    os.sched_setaffinity(0, others)  # this process, and wrk after it
    if together:
        return f"everything on CPU {cpus[-1]}"
    return f"proxies pinned to CPU {cpus[-1]}, load generator and upstreams to {sorted(others)}"


@contextlib.contextmanager
def poll_idle() -> Iterator[str]:
    """Idle CPUs poll instead of halting while this holds (`--poll-idle`).

    The kernel's PM QoS interface: while a process holds /dev/cpu_dma_latency open with 0
    written to it, the cpuidle governor takes no idle state with an exit latency, which
    leaves only polling.  A virtual machine's halted vCPU is woken through the hypervisor
    (an interprocessor interrupt, a VM exit); a polling one sees its work at once.  Which
    part of a figure is the proxies' and which the machine's idle policy: the same run with
    and without.  It costs the machine its idle CPUs while it holds (they spin), so only a
    benchmark does it, never DGXMM.  Says what it did."""
    try:
        device = open("/dev/cpu_dma_latency", "wb", buffering=0)  # noqa: SIM115 - `with` below
    except OSError as exc:
        raise SystemExit(f"--poll-idle: cannot open /dev/cpu_dma_latency: {exc}") from exc
    with device:
        device.write(struct.pack("i", 0))
        driver = Path("/sys/devices/system/cpu/cpuidle/current_driver")
        name = driver.read_text().strip() if driver.exists() else "unknown"
        yield f"idle CPUs polling (PM QoS 0, cpuidle driver {name})"


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
) -> tuple[list[float], float, float]:
    """Latencies of `concurrency` connections each sending `per_conn` small requests, the
    wall time they took and the proxy's CPU seconds over them (warm-up excluded)."""
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
    start = time.perf_counter()
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - start
    used = cpu_seconds(pid) - before if pid else 0.0
    for conn in conns:
        conn.close()
    return latencies, wall, used


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


# --- wrk: a load generator in C ----------------------------------------------------------------

WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
"""
WRK_SECONDS = 2
_WRK_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass
class WrkRun:
    """What one wrk run measured."""

    p50: float  # seconds
    p99: float
    rps: float
    requests: int


def wrk_run(wrk: str, script: Path, port: int, path: str, connections: int) -> WrkRun:
    """Run wrk (one thread, keep-alive POSTs of the small body) for `WRK_SECONDS`."""
    out = subprocess.run(
        [wrk, "-t1", f"-c{connections}", f"-d{WRK_SECONDS}s", "--latency", "-s", str(script),
         f"http://127.0.0.1:{port}{path}"],
        capture_output=True, text=True, timeout=WRK_SECONDS + 30, check=True,
    ).stdout  # fmt: skip
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")

    def latency(percent: str) -> float:
        match = re.search(rf"^\s+{percent}%\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
        if match is None:
            raise RuntimeError(f"no {percent}% line in wrk's output:\n{out}")
        return float(match.group(1)) * _WRK_UNITS[match.group(2)]

    total = re.search(r"^\s+(\d+) requests in", out, re.MULTILINE)
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.MULTILINE)
    if total is None or rps is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return WrkRun(latency("50"), latency("99"), float(rps.group(1)), int(total.group(1)))


def median(values: list[float]) -> float:
    """The median (the upper one of an even count)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


async def measure(rig: Rig, quick: bool, tokens: int, rounds: int, placement: str) -> None:
    """Run every measurement in `rounds` rounds and print the medians and ratios."""
    n1, per_conn64, streams = (200, 10, 64) if quick else (1000, 60, 256)
    path = "/v1/chat/completions"
    targets = {
        "direct": (rig.static, path, rig.paced, path),
        "relay": (rig.relay, path, rig.relay_paced, path),
        "nginx": (rig.nginx, "/fast" + path, rig.nginx, "/paced" + path),
        "gateway": (rig.gateway, "/d/d0" + path, rig.gateway, "/d/d1" + path),
    }
    pids = {
        "relay": rig.procs["relay"].pid,
        "nginx": children(rig.procs["nginx"].pid)[0],
        "gateway": rig.procs["gateway"].pid,
    }
    for name, port in (("base", rig.baseline), ("h11", rig.h11)):
        if port:
            targets[name] = (port, "/d/d0" + path, port, "/d/d1" + path)
            pids[name] = rig.procs[name].pid
    if rig.floor:  # small requests only: no stream phase
        targets["floor"] = (rig.floor, path, 0, "")
        pids["floor"] = rig.procs["floor"].pid
    names = list(targets)
    proxies = names[1:]
    got: dict[tuple[str, str], list[float]] = {}  # one value per round per (figure, target)

    def record(figure: str, name: str, value: float) -> None:
        got.setdefault((figure, name), []).append(value)

    # Memory first, on fresh processes: later phases leave freed memory behind that idle
    # connections would reuse, in amounts that differ between proxies.
    rss = {name: await idle_rss(targets[name][0], targets[name][1], pids[name], 1000)
           for name in proxies}  # fmt: skip
    wrk = shutil.which("wrk")
    script = Path(tempfile.mkdtemp(prefix="bench-wrk-")) / "post.lua"
    script.write_text(WRK_SCRIPT.format(body=SMALL.decode()))
    for turn in range(rounds):
        order = names[turn % len(names) :] + names[: turn % len(names)]
        lat1, used1 = await turns_run({n: (targets[n][0], targets[n][1]) for n in order}, pids, n1)
        for name in names:
            record("c1 p50", name, pct(lat1[name], 0.5))
            record("c1 p99", name, pct(lat1[name], 0.99))
            if name in pids:
                record("cpu c1", name, used1[name] / n1)
                diffs = [a - b for a, b in zip(lat1[name], lat1["direct"], strict=True)]
                record("c1 paired", name, pct(diffs, 0.5))
        for name in order:
            port, target, _, _ = targets[name]
            lat, wall, used = await latency_run(port, target, pids.get(name), 64, per_conn64)
            record("c64 rps", name, len(lat) / wall)
            record("c64 p50", name, pct(lat, 0.5))
            if name in pids:
                record("cpu c64", name, used / len(lat))
        if wrk is not None:
            for connections in (1, 64):
                for name in order:
                    port, target, _, _ = targets[name]
                    before = cpu_seconds(pids[name]) if name in pids else 0.0
                    done = wrk_run(wrk, script, port, target, connections)
                    record(f"wrk{connections} p50", name, done.p50)
                    record(f"wrk{connections} p99", name, done.p99)
                    record(f"wrk{connections} rps", name, done.rps)
                    if name in pids:
                        spent = cpu_seconds(pids[name]) - before
                        record(f"wrk{connections} cpu", name, spent / done.requests)
        for name in order:
            _, _, port, target = targets[name]
            if not port:
                continue
            before = cpu_seconds(pids[name]) if name in pids else 0.0
            ttfb, relayed_rate = await stream_run(port, target, streams, tokens)
            record("ttfb p50", name, pct(ttfb, 0.5))
            record("tokens/s", name, relayed_rate)
            if name in pids:
                # per relayed event (tokens and the closing events), warm-up included
                used = cpu_seconds(pids[name]) - before
                record("cpu event", name, used / (streams * (tokens + 4)))
        print(f"round {turn + 1}/{rounds} done", file=sys.stderr, flush=True)

    def med(figure: str, name: str) -> float:
        return median(got[(figure, name)])

    def added(figure: str, name: str) -> float:  # per round proxy - direct, then the median
        pairs = zip(got[(figure, name)], got[(figure, "direct")], strict=True)
        return median([a - b for a, b in pairs])

    ms, us = 1000.0, 1e6
    rows: list[tuple[str, dict[str, float], str]] = []
    streamed = [n for n in names if targets[n][2]]

    def per_round(figure: str, other: str) -> str:
        """The median over rounds of the round's gateway / `other` ratio: a drift of the
        shared machine between rounds cancels out (a ratio of medians does not)."""
        pairs = zip(got[(figure, "gateway")], got[(figure, other)], strict=True)
        return f"; per round gw/{other} {median([a / b for a, b in pairs if b > 0]):.2f}x"

    def ratios(values: dict[str, float]) -> str:
        gw = values["gateway"]
        parts = []
        for other in ("relay", "nginx", "base", "h11", "floor"):
            ref = values.get(other)
            if ref is not None:
                parts.append(f"gw/{other} " + (f"{gw / ref:.2f}x" if ref > 0 < gw else "n/a"))
        return ", ".join(parts)

    for figure, label in (("c1 p50", "c=1 latency p50"), ("c1 p99", "c=1 latency p99"),
                          ("c64 p50", "c=64 latency p50")):  # fmt: skip
        rows.append((f"{label} (ms)", {n: med(figure, n) * ms for n in names}, ""))
    for figure, label, goal in (
        ("c1 p50", "c=1 added p50", " [target: gw <= 0.08 ms]"),
        ("c1 p99", "c=1 added p99", ""),
    ):
        values = {n: added(figure, n) * ms for n in proxies}
        rows.append((f"{label} (ms)", values, ratios(values) + goal))
    paired = {n: med("c1 paired", n) * ms for n in proxies}
    rows.append(("c=1 added, paired p50 (ms)", paired, ratios(paired)))
    rps = {n: med("c64 rps", n) for n in names}
    rows.append(("c=64 requests/s", rps, ratios(rps) + " [target: gw >= 20,000]"))
    if wrk is not None:
        for figure, label, goal in (
            ("wrk1 p50", "wrk c=1 added p50 (ms)", " [target: gw <= 0.08 ms]"),
            ("wrk1 p99", "wrk c=1 added p99 (ms)", ""),
        ):
            values = {n: added(figure, n) * ms for n in proxies}
            rows.append((label, values, ratios(values) + goal))
        wrk_rps = {n: med("wrk64 rps", n) for n in names}
        rows.append(("wrk c=64 requests/s", wrk_rps, ratios(wrk_rps) + " [target: gw >= 20,000]"))
        for figure, label, goal in (
            ("wrk1 cpu", "wrk CPU per request, c=1 (us)", ""),
            ("wrk64 cpu", "wrk CPU per request, c=64 (us)", " [target: gw/relay <= 3x]"),
        ):
            values = {n: med(figure, n) * us for n in proxies}
            rows.append((label, values, ratios(values) + per_round(figure, "relay") + goal))
    for figure, label, goal, other in (
        ("cpu c1", "proxy CPU per request, c=1 (us)", "", "relay"),
        ("cpu c64", "proxy CPU per request, c=64 (us)", " [target: gw/relay <= 3x]", "relay"),
        ("cpu event", "proxy CPU per stream event (us)", " [target: gw/nginx <= 1.5x]", "nginx"),
    ):
        values = {n: med(figure, n) * us for n in proxies if (figure, n) in got}
        rows.append((label, values, ratios(values) + per_round(figure, other) + goal))
    rows.append(
        (f"{streams} streams TTFB p50 (ms)", {n: med("ttfb p50", n) * ms for n in streamed}, "")
    )
    rate = {n: med("tokens/s", n) for n in streamed}
    share = f"gw/direct {rate['gateway'] / rate['direct']:.1%} [target: >= 95%]"
    rows.append((f"{streams} streams tokens/s", rate, share))
    rows.append(
        ("RSS per 1,000 idle conns (MB)", {n: v / 1e6 for n, v in rss.items()}, "target < 50 MB")
    )

    width = max(len(label) for label, _, _ in rows)
    print(f"{'':{width}}  " + "  ".join(f"{n:>10}" for n in names) + "  notes")
    for label, values, note in rows:
        cells = [f"{values[n]:.3f}" if n in values else "-" for n in names]
        print(f"{label:{width}}  " + "  ".join(f"{cell:>10}" for cell in cells) + f"  {note}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\n(medians of {rounds} rounds, each: c=1 {n1} requests/target in turns, c=64"
        f" {64 * per_conn64} requests/target, {streams} streams of {tokens} tokens paced by the"
        " engine; added latency: the round's p(proxy) - p(direct); paired: the median of"
        " proxy - direct within a turn; wrk: one thread, targets in turns,"
        f" {WRK_SECONDS} s each{'' if wrk else ' (not installed: apt-get install wrk)'};"
        f" {placement}; CPU: the proxy process's on-CPU time (user+system);"
        f" load average at the end: {load}; the machine is shared: run it twice)"
    )


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds (medians over them)")
    parser.add_argument("--h11", action="store_true", help="also the gateway without fast path")
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument(
        "--pin", action="store_true", help="proxies on the last CPU, the rest on the others"
    )
    placement.add_argument(
        "--one-cpu",
        action="store_true",
        help="everything on the last CPU: no hop wakes another CPU (see `pin`)",
    )
    parser.add_argument(
        "--poll-idle",
        action="store_true",
        help="idle CPUs poll instead of halting during the run (root; see `poll_idle`)",
    )
    parser.add_argument("--serve-gateway", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--floor", action="store_true", help="also the parsing floor (small requests only)"
    )
    parser.add_argument("--engines", default="", help=argparse.SUPPRESS)
    parser.add_argument("--routes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--package-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--no-fast-path", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--token-delay", type=float, default=0.02)
    parser.add_argument(
        "--baseline", default=None, metavar="DIR", help="also measure the gateway package in DIR"
    )
    args = parser.parse_args()
    if args.serve_gateway:
        engines = [int(p) for p in args.engines.split(",")]
        serve_gateway(engines, args.port, args.package_dir, not args.no_fast_path)
        return
    if args.serve_relay or args.serve_floor:
        pairs = [route.split(":") for route in args.routes.split(",")]
        (serve_floor if args.serve_floor else serve_relay)([(int(a), int(b)) for a, b in pairs])
        return
    import uvloop

    # 1,000 idle connections and their engine connections: every process needs more than
    # the usual soft limit of 1,024 descriptors (the children inherit it).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"load average at the start: {os.getloadavg()}", file=sys.stderr, flush=True)
    with contextlib.ExitStack() as stack:
        idle = stack.enter_context(poll_idle()) if args.poll_idle else ""
        rig = stack.enter_context(
            processes(args.stream_tokens, args.token_delay, args.baseline, args.h11, args.floor)
        )
        if args.pin or args.one_cpu:
            placement = pin(rig, together=args.one_cpu)
        else:
            placement = "placed by the scheduler"
        if idle:
            placement += f"; {idle}"
        uvloop.run(measure(rig, args.quick, args.stream_tokens, args.rounds, placement))


if __name__ == "__main__":
    main()
