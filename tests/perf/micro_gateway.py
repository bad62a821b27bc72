"""The gateway's own Python per relayed request and per stream event, without sockets.

    python -m tests.perf.micro_gateway [--head wrk|litellm] [--stream] [--n N] [--profile]
    python -m tests.perf.micro_gateway [--head wrk|litellm] --instructions

The real objects of the express lane (`HTTPServer` connection, `Gateway`, `UpstreamPool`,
both sessions) on fake transports that only collect what is written: a client request is
fed to the client connection's `data_received`, the engine's answer to the engine
connection's, as the event loop would.  No syscall, no scheduling: what remains is the
Python the gateway runs for one exchange (or one stream event), the part that the sockets
of `bench_gateway` hide behind the kernel's cost and the machine's drift.  It reports the
minimum over 20 batches (the least disturbed), split into the request side and the answer
side.  `--head litellm` sends the 19 header lines LiteLLM's OpenAI client sends (observed
behind LiteLLM 1.108.7); `--profile` prints cProfile's view of one more batch (its
overhead inflates small functions: read it for call counts, not for times).

Times drift with the machine; instructions do not.  `--instructions` runs the exchanges under
valgrind's callgrind twice, 100 and 2,100 of them after the same warm-up, and prints the
difference per exchange: the same count (within a few tenths of a percent) however busy the
machine is, which tells a change of a few percent apart from noise.  It needs valgrind.  Both
runs hash strings with `PYTHONHASHSEED=0` unless it is set: seeded at random, dicts and sets
probe differently from run to run, which moves the count by a few hundred.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import re
import shutil
import subprocess
import sys
import time
from typing import Any

import uvloop

from actors.ports import EngineHandle
from gateway.access import Access
from gateway.app import Gateway
from gateway.server import HTTPServer, ServerConfig, _Connection
from gateway.trace import TrafficTrace
from gateway.transport import ByteStream
from gateway.upstream import _Connection as EngineConnection
from tests.gateway_support import ScriptedController

BODY = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
HEADS = {
    # wrk's POST with the benchmark's script: Host, Content-Length, Content-Type, and the
    # gateway key (which the gateway requires, as LiteLLM's head below carries it)
    "wrk": (
        b"host: 127.0.0.1:8401\r\ncontent-type: application/json\r\nauthorization: Bearer k\r\n"
    ),
    "litellm": (
        b"host: 127.0.0.1:8401\r\naccept-encoding: gzip, deflate\r\nconnection: keep-alive\r\n"
        b"authorization: Bearer k\r\naccept: application/json\r\n"
        b"content-type: application/json\r\nuser-agent: AsyncOpenAI/Python 3.57.0\r\n"
        b"x-stainless-lang: python\r\nx-stainless-package-version: 3.57.0\r\n"
        b"x-stainless-os: Linux\r\nx-stainless-arch: x64\r\nx-stainless-runtime: CPython\r\n"
        b"x-stainless-runtime-version: 3.11.7\r\nx-stainless-async: async:asyncio\r\n"
        b"x-stainless-raw-response: true\r\nx-stainless-retry-count: 0\r\n"
        b"x-stainless-read-timeout: 6000.0\r\n"
    ),
}
ANSWER_BODY = (
    b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"hi there"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'
)
ANSWER = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 18:00:00 GMT\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: keep-alive\r\n\r\n%s"
    % (len(ANSWER_BODY), ANSWER_BODY)
)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = (
    b'data: {"id":"cmpl-1","object":"chat.completion.chunk","created":1,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
)
BATCHES = 20


async def _discard(event: object) -> None:
    """The trace's writer (the log's group commit is not what this measures)."""


class Collector:
    """A transport that keeps what is written (the least an asyncio transport must do)."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        self.closing = True

    abort = close

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Rig:
    """One client connection to a gateway with one ready deployment and one idle engine
    connection."""

    def __init__(self) -> None:
        controller = ScriptedController()
        handle = EngineHandle(deployment_id="d0", host="127.0.0.1", port=9, runtime_id="b")
        controller.add("d0", handle=handle, served_model="bench")
        # The gateway key's check, as DGXMM runs it (both heads carry the key "k").
        self.gateway = gateway = Gateway(controller, access=Access(["k"]))
        # The traffic trace, as `dgxmm serve` runs it: "1" records and encodes the batches
        # (every 500 exchanges, their cost shared out), "rows" only records, "0" not at all.
        self.trace_mode = os.environ.get("MICRO_GATEWAY_TRACE", "1")
        if self.trace_mode != "0":
            gateway.trace = TrafficTrace(_discard, max_in_flight=1_000_000)
        server = HTTPServer(gateway.handle, ServerConfig())
        server._loop = asyncio.get_running_loop()
        server.request_id_header = b"x-dgxmm-request-id"
        server.express = gateway.express
        self.client, self.client_out = ByteStream(65536), Collector()
        self.client.transport = self.client_out  # type: ignore[assignment]
        conn = _Connection(server, self.client, self.client_out)  # type: ignore[arg-type]
        self.client.on_data = conn._express_data
        pool = gateway.upstream
        self.engine, self.engine_out = ByteStream(65536), Collector()
        self.engine.transport = self.engine_out  # type: ignore[assignment]
        idle = EngineConnection(self.engine, self.engine_out, pool.config, pool.outbox)  # type: ignore[arg-type]
        idle.expires = idle.loop.time() + 60.0
        pool._engine("127.0.0.1", 9).idle.append(idle)
        self.client_outbox, self.pool_outbox = server.outbox, pool.outbox

    def exchange(self, request: bytes) -> tuple[float, float]:
        """One request and its answer: the seconds each side took."""
        start = time.perf_counter()
        self.client.data_received(request)
        self.pool_outbox.flush()  # the end of the event loop's round: the request goes out
        middle = time.perf_counter()
        self.engine.data_received(ANSWER)
        self.client_outbox.flush()
        return middle - start, time.perf_counter() - middle

    def flush_trace(self) -> None:
        """Encode the trace's rows as the loop would between rounds (counted, amortised)."""
        trace = self.gateway.trace
        if trace is not None and self.trace_mode == "1":
            trace.flush()

    def event(self, chunk: bytes) -> None:
        """One chunk of a stream from the engine, and the end of the loop's round."""
        self.engine.data_received(chunk)
        self.client_outbox.flush()


def request_bytes(head: str) -> bytes:
    return b"POST /d/d0/v1/chat/completions HTTP/1.1\r\n%scontent-length: %d\r\n\r\n%s" % (
        HEADS[head],
        len(BODY),
        BODY,
    )


async def exchanges(head: str, n: int, profile: bool) -> None:
    rig = Rig()
    request = request_bytes(head)
    for _ in range(1000):  # warm-up; also checks that the lane carries them
        rig.exchange(request)
    assert rig.gateway.relayed_express == 1000, "not on the express lane"
    assert rig.client_out.out[-1].startswith(b"HTTP/1.1 200"), rig.client_out.out[-1][:80]
    sides: list[tuple[float, float]] = []
    for _ in range(BATCHES):
        await asyncio.sleep(0)  # the round ends (`Outbox`): the batch starts a new one
        rig.client_out.out.clear()
        rig.engine_out.out.clear()
        request_s = answer_s = 0.0
        rig.flush_trace()
        for _ in range(n // BATCHES):
            a, b = rig.exchange(request)
            request_s += a
            answer_s += b
        sides.append((request_s / (n // BATCHES), answer_s / (n // BATCHES)))
    best_request = min(s[0] for s in sides) * 1e6
    best_answer = min(s[1] for s in sides) * 1e6
    print(
        f"{head} head: request side {best_request:.2f} us, answer side {best_answer:.2f} us,"
        f" per exchange {best_request + best_answer:.2f} us (min of {BATCHES} batches)"
    )
    if profile:
        with cProfile.Profile() as p:
            for _ in range(n // BATCHES):
                rig.exchange(request)
        pstats.Stats(p).sort_stats("tottime").print_stats(25)


async def stream_events(n: int, profile: bool) -> None:
    rig = Rig()
    body = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"stream":true}'
    rig.client.data_received(
        b"POST /d/d0/v1/chat/completions HTTP/1.1\r\n%scontent-length: %d\r\n\r\n%s"
        % (HEADS["wrk"], len(body), body)
    )
    assert rig.gateway.exchanges, "not on the express lane"
    rig.pool_outbox.flush()
    rig.event(STREAM_HEAD)
    chunk = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
    for _ in range(1000):
        rig.event(chunk)
    best = float("inf")
    for _ in range(BATCHES):
        await asyncio.sleep(0)
        rig.client_out.out.clear()
        start = time.perf_counter()
        for _ in range(n // BATCHES):
            rig.event(chunk)
        best = min(best, (time.perf_counter() - start) / (n // BATCHES))
    assert rig.client_out.out[-1].endswith(EVENT + b"\r\n"), rig.client_out.out[-1][-80:]
    print(f"stream: {best * 1e6:.2f} us per event (min of {BATCHES} batches)")
    if profile:
        with cProfile.Profile() as p:
            for _ in range(n // BATCHES):
                rig.event(chunk)
        pstats.Stats(p).sort_stats("tottime").print_stats(15)


async def untimed(head: str, n: int) -> None:
    """The warm-up of `exchanges`, then `n` exchanges, untimed (what `--instructions` counts)."""
    rig = Rig()
    request = request_bytes(head)
    for _ in range(1000):
        rig.exchange(request)
    await asyncio.sleep(0)
    for i in range(n):
        if i % 50 == 0:
            rig.client_out.out.clear()
            rig.engine_out.out.clear()
        if i % 500 == 0:
            rig.flush_trace()
        rig.exchange(request)
    assert rig.gateway.relayed_express == 1000 + n, "not on the express lane"


def instructions(head: str) -> None:
    """Instructions per exchange: two runs under callgrind, the difference per exchange."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind (Debian package valgrind)")
    counts = []
    for n in (100, 2100):
        done = subprocess.run(
            [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             "-m", "tests.perf.micro_gateway", "--head", head, "--untimed", str(n)],
            capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": "0", **os.environ},
        )  # fmt: skip
        match = re.search(r"Collected : (\d+)", done.stderr)
        if match is None:
            raise SystemExit(f"no count in callgrind's output:\n{done.stderr[-2000:]}")
        counts.append(int(match.group(1)))
    per = (counts[1] - counts[0]) / 2000
    print(f"{head} head: {per:,.0f} instructions per exchange (callgrind, 2,100 less 100)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", choices=sorted(HEADS), default="wrk")
    parser.add_argument("--stream", action="store_true", help="per stream event instead")
    parser.add_argument("--n", type=int, default=200_000, help="exchanges or events")
    parser.add_argument("--profile", action="store_true", help="also cProfile one batch")
    parser.add_argument("--instructions", action="store_true", help="count them (callgrind)")
    parser.add_argument("--untimed", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instructions:
        instructions(args.head)
        return
    # On uvloop, as the gateway runs: its `loop.time()` is C, asyncio's a Python call.
    if args.untimed is not None:
        uvloop.run(untimed(args.head, args.untimed))
    elif args.stream:
        uvloop.run(stream_events(args.n, args.profile))
    else:
        uvloop.run(exchanges(args.head, args.n, args.profile))


if __name__ == "__main__":
    main()
