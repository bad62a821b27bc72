"""Which of an engine's answer headers reach the client (issue 46, stumble 12).

The decision (docs/on-demand-gateway.md, "The engine's headers"): the gateway relays the
engine's answer as the engine wrote it, headers included, `Server: uvicorn` (vLLM, SGLang) or
`Server: llama.cpp` among them: every end-to-end header, in the engine's order, with its
value's bytes (the name in lower case: field names are case-insensitive, and uvicorn writes
them so).  It drops only the hop-by-hop headers (RFC 9110 7.6.1: Connection, Keep-Alive,
Transfer-Encoding, ... and whatever the engine's Connection header names), which describe the
engine's connection, not the answer; and it adds only `x-dgxmm-request-id`.  Its own answers
(errors, health probes, `/v1/models`) carry no `Server`.  Both paths (the express lane and
the handler) are held to this, on a raw engine that writes its answer byte by byte.  Through
LiteLLM the engine's headers come back renamed `llm_provider-<name>` (pinned in
tests/test_model_names_e2e.py with a real LiteLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from actors.ports import EngineHandle
from gateway.app import Gateway, GatewayConfig
from tests.gateway_support import ScriptedController

BODY = b'{"id":"cmpl-1","object":"chat.completion","choices":[]}'
# What uvicorn (vLLM) writes, plus what an engine might add: its own request id, and a header
# its Connection header names (hop-by-hop by that naming).
ENGINE_HEAD = [
    b"HTTP/1.1 200 OK",
    b"date: Tue, 01 Dec 2026 18:00:00 GMT",
    b"server: uvicorn",
    b"content-length: %d" % len(BODY),
    b"content-type: application/json",
    b"X-Request-Id: engine-7",
    b"Connection: x-engine-hop",
    b"X-Engine-Hop: only for the next hop",
    b"Keep-Alive: timeout=5, max=100",
]
PASSED = [  # the end-to-end headers, as the client must get them: names in lower case
    b"date: Tue, 01 Dec 2026 18:00:00 GMT",
    b"server: uvicorn",
    b"content-length: %d" % len(BODY),
    b"content-type: application/json",
    b"x-request-id: engine-7",
]
CHAT = b'{"model":"served-a","messages":[{"role":"user","content":"hi"}]}'


async def _engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request on the connection with ENGINE_HEAD and BODY, byte for byte."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            writer.write(b"\r\n".join(ENGINE_HEAD) + b"\r\n\r\n" + BODY)
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def gateway(express: bool, state: str = "ready") -> AsyncIterator[int]:
    """Deployment `a` on the raw engine behind a gateway; the gateway's port."""
    engine = await asyncio.start_server(_engine, "127.0.0.1", 0)
    port = int(engine.sockets[0].getsockname()[1])
    controller = ScriptedController()
    handle = EngineHandle(deployment_id="a", host="127.0.0.1", port=port, runtime_id="t")
    controller.add("a", state=state, handle=handle if state == "ready" else None)
    gw = Gateway(controller, config=GatewayConfig(express=express), clock=lambda: 1700000000.0)
    server = await gw.serve("127.0.0.1", 0)
    await gw.upstream.open_idle("127.0.0.1", port)  # the lane needs a warm pool
    try:
        yield server.port
    finally:
        await gw.shutdown(2.0)
        engine.close()


async def exchange(port: int, body: bytes, times: int = 1) -> list[tuple[list[bytes], bytes]]:
    """`times` chat requests on one connection; each answer's header lines and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers = []
    try:
        for _ in range(times):
            writer.write(
                b"POST /d/a/v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.removesuffix(b"\r\n\r\n").split(b"\r\n")
            length = next(
                int(line.partition(b":")[2])
                for line in lines
                if line.lower().startswith(b"content-length:")
            )
            answers.append((lines, await reader.readexactly(length)))
    finally:
        writer.close()
    return answers


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


@pytest.mark.parametrize("express", [True, False], ids=["express lane", "handler"])
def test_the_engines_end_to_end_headers_reach_the_client_as_it_wrote_them(express: bool) -> None:
    async def main() -> None:
        async with gateway(express) as port:
            for lines, body in await exchange(port, CHAT, times=3):
                assert lines[0] == b"HTTP/1.1 200 OK"
                assert body == BODY
                own = [line for line in lines[1:] if line.startswith(b"x-dgxmm-request-id: ")]
                assert len(own) == 1  # the only header the gateway adds
                assert [line for line in lines[1:] if line not in own] == PASSED

    run(main())


def test_the_gateways_own_answers_name_no_server() -> None:
    async def main() -> None:
        async with gateway(express=True) as port:
            other = CHAT.replace(b"served-a", b"another-model")
            [(lines, body)] = await exchange(port, other)
            assert lines[0] == b"HTTP/1.1 404 Not Found" and b"model_not_found" in body
            assert not [line for line in lines if line.lower().startswith(b"server:")]

    run(main())
