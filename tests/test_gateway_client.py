"""DGXMM's one outbound HTTP client (`gateway.client`), against raw servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway import client
from tests.runtime_support import run

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[int]:
    """A server that runs `handler` on each connection; yields its port."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def answering(response: bytes, seen: list[bytes] | None = None) -> Handler:
    """A handler that reads one request head (and a small body) and writes `response`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if seen is not None:
            seen.append(head)
        writer.write(response)
        await writer.drain()

    return handler


async def _call(handler: Handler, **kwargs: object) -> client.Response:
    async with raw_server(handler) as port:
        return await client.request("127.0.0.1", port, "GET", "/x", **kwargs)  # type: ignore[arg-type]


def test_a_content_length_answer_comes_back_whole_with_its_headers() -> None:
    seen: list[bytes] = []
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello"
    response = run(_call(answering(answer, seen), headers=[("X-Probe", "1")]))
    assert (response.status, response.body) == (200, b"hello")
    assert response.header("content-type") == b"text/plain"
    assert seen[0].startswith(b"GET /x HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"connection: close\r\n" in seen[0] and b"x-probe: 1\r\n" in seen[0]


def test_a_chunked_answer_is_reassembled_and_its_json_decoded() -> None:
    answer = (
        b'HTTP/1.1 503 No\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{"a\r\n4\r\n":1}\r\n0\r\n\r\n'
    )
    response = run(_call(answering(answer)))
    assert response.status == 503 and response.json() == {"a": 1}


def test_an_answer_ended_by_close_is_complete_when_the_server_closes() -> None:
    response = run(_call(answering(b"HTTP/1.1 200 OK\r\n\r\nuntil close")))
    assert response.body == b"until close"


def test_nothing_listening_is_connection_refused_naming_the_request() -> None:
    async def main() -> None:
        async with raw_server(answering(b"")) as port:
            pass
        await client.request("127.0.0.1", port, "GET", "/health")

    with pytest.raises(client.ConnectionRefused, match=r"GET http://127\.0\.0\.1:\d+/health"):
        run(main())


def test_a_server_that_closes_mid_body_is_connection_dropped() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"
    with pytest.raises(client.ConnectionDropped):
        run(_call(answering(answer)))


def test_a_server_that_closes_before_answering_is_connection_dropped() -> None:
    with pytest.raises(client.ConnectionDropped):
        run(_call(answering(b"")))


def test_an_answer_that_is_not_http_is_a_bad_response() -> None:
    with pytest.raises(client.BadResponse):
        run(_call(answering(b"SSH-2.0-OpenSSH\r\n\r\n")))


def test_a_body_over_the_bound_is_a_bad_response() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    with pytest.raises(client.BadResponse, match="larger than 10 bytes"):
        run(_call(answering(answer), max_body_bytes=10))


def test_a_silent_server_is_a_timeout_after_the_deadline() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.Event().wait()

    with pytest.raises(client.RequestTimedOut, match=r"within 0\.2 s"):
        run(_call(silent, timeout_s=0.2))


def test_a_header_value_with_a_line_break_is_refused_before_connecting() -> None:
    with pytest.raises(client.BadResponse, match="cannot send"):
        run(_call(answering(b""), headers=[("x-a", "1\r\nx-b: 2")]))


def test_request_url_puts_the_base_path_in_front_of_the_target() -> None:
    seen: list[bytes] = []
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"

    async def main() -> client.Response:
        async with raw_server(answering(answer, seen)) as port:
            origin = client.Origin.parse(f"http://127.0.0.1:{port}/litellm/")
            return await client.request_url(origin, "POST", "/model/new", body=b"{}")

    assert run(main()).status == 200
    assert seen[0].startswith(b"POST /litellm/model/new HTTP/1.1\r\n")
    assert b"content-length: 2\r\n" in seen[0]


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://h/x", "http://", "http://h:99999/"])
def test_origin_refuses_anything_but_http_urls(url: str) -> None:
    with pytest.raises(ValueError):
        client.Origin.parse(url)
