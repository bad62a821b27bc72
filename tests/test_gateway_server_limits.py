"""The HTTP server at its edges, over real loopback sockets: HEAD, trickled bodies, the
connection cap and the process's file descriptors (issue 18's server items)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h11
import pytest
import structlog

from dgxmm.app import _http_config
from dgxmm.config import ConfigError, load_config
from gateway import limits
from gateway.app import Gateway
from gateway.server import HTTPServer, Request, Responder, ServerConfig
from tests.api_support import Box, run_box
from tests.gateway_support import Client, FakeEngine, ScriptedController, raw_exchange, run

DOC = b"hello, world"


async def handler(request: Request, responder: Responder) -> None:
    """GET /doc: a Content-Length answer; GET /stream: a chunked one; POST /echo."""
    if request.target == b"/doc":
        await responder.respond(200, [(b"content-type", b"text/plain")], DOC)
    elif request.target == b"/stream":
        await responder.start(200, [(b"content-type", b"text/event-stream")])
        for _ in range(3):
            await responder.send(b"data: x\n\n")
        await responder.end()
    else:
        await responder.respond(200, [], await request.read_body())


def answers(raw: bytes, methods: list[bytes]) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """The answers in `raw` to requests of `methods`, parsed by h11 (which knows HEAD)."""
    conn = h11.Connection(h11.CLIENT)
    conn.receive_data(raw)
    conn.receive_data(b"")
    out: list[tuple[int, dict[bytes, bytes], bytes]] = []
    for method in methods:
        conn.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"x")]))
        conn.send(h11.EndOfMessage())
        response = conn.next_event()
        assert isinstance(response, h11.Response), response
        body = b""
        while not isinstance(event := conn.next_event(), h11.EndOfMessage):
            assert isinstance(event, h11.Data), event
            body += bytes(event.data)
        out.append(
            (response.status_code, {n.lower(): v for n, v in response.headers.raw_items()}, body)
        )
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
    return out


async def serve(config: ServerConfig | None = None) -> HTTPServer:
    """A server with the test handler on a free port."""
    server = HTTPServer(handler, config or ServerConfig())
    await server.start("127.0.0.1", 0)
    return server


# --- HEAD ----------------------------------------------------------------------------------


def test_head_gets_the_get_answers_head_without_its_body_and_the_connection_goes_on() -> None:
    async def main() -> None:
        server = await serve()
        try:
            raw = (
                b"HEAD /doc HTTP/1.1\r\nhost: x\r\n\r\n"
                b"HEAD /stream HTTP/1.1\r\nhost: x\r\n\r\n"
                b"GET /doc HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            )
            got = await raw_exchange(server.port, raw)
            head_doc, head_stream, get_doc = answers(got, [b"HEAD", b"HEAD", b"GET"])
            assert head_doc == (200, {**head_doc[1], b"content-length": b"%d" % len(DOC)}, b"")
            assert head_stream[0] == 200 and head_stream[2] == b""
            assert get_doc == (200, head_doc[1] | {b"connection": b"close"}, DOC)
            assert got.count(DOC) == 1  # no body bytes after either HEAD answer
            assert server.statistics().requests_total == 3
        finally:
            await server.shutdown(1.0)

    run(main())


def test_head_on_the_gateway_gets_the_models_lists_head() -> None:
    async def main() -> None:
        async with FakeEngine() as engine:
            controller = ScriptedController()
            controller.add("a", handle=engine.handle)
            gateway = Gateway(controller)
            server = await gateway.serve("127.0.0.1", 0)
            try:
                raw = (
                    b"HEAD /d/a/v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
                    b"GET /d/a/v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                )
                head, get = answers(await raw_exchange(server.port, raw), [b"HEAD", b"GET"])
                assert head[0] == get[0] == 200 and head[2] == b""
                assert head[1][b"content-length"] == b"%d" % len(get[2])
            finally:
                await gateway.shutdown(1.0)

    run(main())


def test_head_on_the_admin_listener_gets_the_pages_and_the_metrics_heads(tmp_path: Path) -> None:
    web = tmp_path / "web"
    web.mkdir()
    (web / "index.html").write_text("<!doctype html><title>DGXMM</title>")

    async def test(box: Box) -> None:
        for target in (b"/dgxmm/", b"/metrics"):
            raw = (
                b"HEAD %s HTTP/1.1\r\nhost: x\r\n\r\n"
                b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % (target, target)
            )
            got = await raw_exchange(box.server.port, raw)
            head, get = answers(got, [b"HEAD", b"GET"])
            assert head[0] == get[0] == 200, (target, got[:300])
            assert head[2] == b"" and get[2]
            assert head[1][b"content-type"] == get[1][b"content-type"]

    run_box(tmp_path, test, web_root=web, metrics_public=True)


# --- a body trickled in ----------------------------------------------------------------------


async def trickle(port: int, pieces: list[bytes], every_s: float) -> tuple[bytes, float]:
    """Send `pieces` one every `every_s` until an answer comes: the answer and when it came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            try:
                async with asyncio.timeout(every_s):
                    return await reader.read(65536), time.monotonic() - start
            except TimeoutError:
                continue
        return b"", time.monotonic() - start
    finally:
        writer.transport.abort()


def test_a_body_trickled_in_gets_408_at_the_overall_deadline() -> None:
    async def main() -> None:
        server = await serve(ServerConfig(body_timeout_s=0.5))
        try:
            head = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
            # One byte every 50 ms: each pause is far below the deadline; the whole is not.
            got, elapsed = await trickle(server.port, [head] + [b"x"] * 99, 0.05)
            assert got.startswith(b"HTTP/1.1 408 "), got
            assert 0.45 <= elapsed < 2.0, elapsed
        finally:
            await server.shutdown(1.0)

    run(main())


def test_a_head_trickled_in_gets_408_at_the_overall_deadline() -> None:
    async def main() -> None:
        server = await serve(ServerConfig(header_timeout_s=30, body_timeout_s=0.5))
        try:
            head = b"POST /echo HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 200
            got, elapsed = await trickle(server.port, [bytes([b]) for b in head], 0.05)
            assert got.startswith(b"HTTP/1.1 408 "), got
            assert elapsed < 2.0, elapsed
        finally:
            await server.shutdown(1.0)

    run(main())


# --- the connection cap ----------------------------------------------------------------------


def test_a_connection_over_the_cap_gets_503_with_retry_after_and_one_warning() -> None:
    async def main() -> None:
        server = await serve(ServerConfig(max_connections=2))
        clients = [await Client.connect(server.port) for _ in range(2)]
        try:
            for client in clients:  # both connections are served and held open
                assert (await client.request("GET", "/doc")).status == 200
            with structlog.testing.capture_logs() as logs:
                refused = [
                    await raw_exchange(server.port, b"GET /doc HTTP/1.1\r\nhost: x\r\n\r\n")
                    for _ in range(3)
                ]
            for got in refused:
                status, headers, body = answers(got, [b"GET"])[0]
                assert status == 503 and headers[b"retry-after"] == b"1"
                assert b"too many connections" in body
            warnings = [e for e in logs if e["event"] == "connection_cap_reached"]
            assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
            assert server.statistics().connections_refused == 3
            clients.pop().close()  # a place frees up: the next connection is served
            await _until(lambda: server.statistics().connections_open < 2)
            client = await Client.connect(server.port)
            clients.append(client)
            assert (await client.request("GET", "/doc")).body == DOC
        finally:
            for client in clients:
                client.close()
            await server.shutdown(1.0)

    run(main())


async def _until(predicate: object) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in 5 s"
        await asyncio.sleep(0.005)


def test_the_cap_fits_the_descriptors_left_after_the_reserve() -> None:
    assert limits.connection_cap(8192, 1 << 20) == 8192
    assert limits.connection_cap(8192, 1024) == (1024 - limits.FD_RESERVE) // 3
    assert limits.connection_cap(8192, 100) == 1
    assert limits.fd_pressure(100, 1024) is None
    assert limits.fd_pressure(1024 - 100, 1024) == "low"
    assert limits.fd_pressure(1020, 1024) == "exhausted"
    every = limits.Every(60.0)
    assert [every.due(t) for t in (0.0, 1.0, 59.9, 60.0, 61.0)] == [True, False, False, True, False]


# --- file descriptors (in a child process: the limits are the process's) -----------------------


def child(code: str, soft: int, hard: int) -> list[dict[str, object]]:
    """Run `code` in a child with RLIMIT_NOFILE (soft, hard); its JSON log lines."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    prelude = textwrap.dedent(
        """
        import asyncio, json, resource, sys
        import structlog
        structlog.configure(processors=[structlog.processors.add_log_level,
                                        structlog.processors.JSONRenderer()])
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        preexec_fn=limit,
        capture_output=True,
        timeout=30,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    lines = [line for line in proc.stdout.decode().splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines]


def test_the_server_raises_the_soft_descriptor_limit_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    logs = child(
        """
        from gateway.server import HTTPServer
        async def main():
            server = HTTPServer(lambda request, responder: None)
            await server.start("127.0.0.1", 0)
            print(json.dumps({"event": "result",
                              "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                              "cap": server.max_connections}))
            await server.shutdown(1.0)
        asyncio.run(main())
        """,
        soft=256 + 64,
        hard=hard,
    )
    result = next(e for e in logs if e["event"] == "result")
    assert result["soft"] == hard
    assert result["cap"] == limits.connection_cap(8192, hard)


def test_a_low_hard_limit_lowers_the_cap_and_running_out_is_logged() -> None:
    logs = child(
        """
        import os
        from gateway import limits
        from gateway.server import HTTPServer
        limits.FD_CHECK_EVERY_S = 0.01
        async def main():
            server = HTTPServer(lambda request, responder: None)
            await server.start("127.0.0.1", 0)
            print(json.dumps({"event": "result", "cap": server.max_connections}))
            held = []
            try:
                while True:
                    held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            for _ in range(500):  # the sweeper notices within a few sweeps
                await asyncio.sleep(0.01)
            for fd in held:
                os.close(fd)
            await server.shutdown(1.0)
        asyncio.run(main())
        """,
        soft=400,
        hard=400,
    )
    assert next(e for e in logs if e["event"] == "result")["cap"] == (400 - 256) // 3
    assert any(e["event"] == "connection_cap_lowered" for e in logs)
    exhausted = [e for e in logs if e["event"] == "file_descriptors_exhausted"]
    assert len(exhausted) == 1 and exhausted[0]["level"] == "error"


# --- the settings ----------------------------------------------------------------------------


def test_the_server_settings_come_from_the_server_section(tmp_path: Path) -> None:
    path = tmp_path / "dgxmm.toml"
    path.write_text("[server]\nbody_timeout_s = 30\ngateway_fast_path = false\n")
    http = _http_config(load_config(path), 1234)
    assert (http.body_timeout_s, http.fast_path, http.max_body_bytes) == (30.0, False, 1234)
    defaults = _http_config(load_config(None), 1)
    assert (defaults.body_timeout_s, defaults.fast_path) == (120.0, True)
    path.write_text("[server]\nbody_timeout_s = 0\n")
    with pytest.raises(ConfigError, match="body_timeout_s"):
        load_config(path)
