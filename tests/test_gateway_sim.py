"""The gateway in front of the simulated engines: answers byte for byte, crashes, hang-ups."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import h11
import pytest

from actors.ports import EngineHandle
from gateway.access import Access
from gateway.app import Gateway
from gateway.server import HTTPServer
from simulations.engine import SimOptions, SimServer, serve
from tests.gateway_support import Client, Reply, ScriptedController, request_once, run

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
MODEL = "sim-model"
CASES: list[tuple[str, dict[str, Any]]] = [
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
    (
        "chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    ("completions", {"model": MODEL, "prompt": "once upon"}),
    ("completions", {"model": MODEL, "prompt": "once upon", "stream": True}),
    ("responses", {"model": MODEL, "input": "hello"}),
    ("responses", {"model": MODEL, "input": "hello", "stream": True}),
    ("messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}),
    (
        "messages",
        {
            "model": MODEL,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
        },
    ),
    ("embeddings", {"model": MODEL, "input": ["a", "b"]}),
    ("rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]}),
    ("score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
    ("chat/completions", {"model": MODEL, "messages": []}),
    # Not valid requests: each engine's own 400, relayed on connections that stay (issue 47).
    ("chat/completions", {"model": MODEL, "stream": True, "messages": 5}),
    ("chat/completions", {"model": MODEL, "messages": [5]}),
    ("completions", {"model": MODEL, "prompt": 5, "stream": True}),
]


@contextlib.asynccontextmanager
async def sim_rig(
    options: SimOptions, access: Access | None = None
) -> AsyncIterator[tuple[SimServer, ScriptedController, HTTPServer]]:
    """A simulated engine, deployment `a` ready on it, and the gateway (with `access`, the
    gateway key's check)."""
    engine = await serve(options)
    controller = ScriptedController()
    handle = EngineHandle(deployment_id="a", host="127.0.0.1", port=engine.port, runtime_id="sim")
    controller.add("a", handle=handle, served_model=MODEL)
    gateway = Gateway(controller, access=access)
    server = await gateway.serve("127.0.0.1", 0)
    try:
        yield engine, controller, server
    finally:
        await gateway.shutdown(2.0)
        await engine.close()
    assert controller.in_flight["a"] == 0


def end_to_end(reply: Reply) -> list[tuple[bytes, bytes]]:
    """Headers minus hop-by-hop ones, names lower-cased."""
    # The gateway's own x-dgxmm-request-id aside (tests/test_request_ids.py checks it).
    return [
        (n.lower(), v)
        for n, v in reply.headers
        if n.decode().lower() not in HOP_BY_HOP and n.lower() != b"x-dgxmm-request-id"
    ]


@pytest.mark.parametrize("flavour", ["vllm", "llamacpp", "sglang"])
def test_answers_through_the_gateway_equal_direct_answers_byte_for_byte(flavour: str) -> None:
    async def main() -> None:
        options = SimOptions(flavour=flavour, model=MODEL, tokens=12)  # type: ignore[arg-type]
        async with sim_rig(options) as (engine, _, server):
            direct = await Client.connect(engine.port)
            relayed = await Client.connect(server.port)
            for path, body in CASES:
                want = await direct.request("POST", "/v1/" + path, body)
                got = await relayed.request("POST", "/d/a/v1/" + path, body)
                assert got.status == want.status, (path, body)
                assert got.body == want.body, (path, body)
                assert end_to_end(got) == end_to_end(want), (path, body)
            want = await direct.request("GET", f"/v1/models/{MODEL}")
            got = await relayed.request("GET", f"/d/a/v1/models/{MODEL}")
            assert (got.status, got.body) == (want.status, want.body)
            # Another model's name is the gateway's to refuse, whether or not the engine
            # would (llama.cpp answers any name): the same 404 in every state.
            other = {"model": "other-model", "messages": [{"role": "user", "content": "x"}]}
            got = await relayed.request("POST", "/d/a/v1/chat/completions", other)
            assert got.status == 404 and b'"code":"model_not_found"' in got.body
            direct.close()
            relayed.close()

    run(main())


def test_engine_crash_mid_stream_ends_the_clients_stream() -> None:
    async def main() -> None:
        options = SimOptions(model=MODEL, tokens=20, crash_after=1)
        async with sim_rig(options) as (_, controller, server):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
            reply = await request_once(server.port, "POST", "/d/a/v1/chat/completions", body)
            assert reply.status == 200
            # Never a silent clean end: a final error event, [DONE], then the terminator.
            events = [e for e in reply.body.split(b"\n\n") if e.strip()]
            assert events[-1] == b"data: [DONE]"
            error = json.loads(events[-2].removeprefix(b"data: "))
            assert error["error"]["code"] == "engine_failed"
            assert controller.released == 1
            assert controller.unreachable == ["a"]  # the engine is checked at once

    run(main())


def test_engine_crash_mid_answer_with_a_length_closes_the_client_connection() -> None:
    async def main() -> None:
        options = SimOptions(model=MODEL, tokens=20, crash_after=1)
        async with sim_rig(options) as (_, controller, server):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            client = await Client.connect(server.port)
            await client.send("POST", "/d/a/v1/chat/completions", body)
            status, _ = await client.head()
            assert status == 200
            with contextlib.suppress(h11.RemoteProtocolError):
                while await client.chunk() is not None:
                    pass
            assert client.conn.their_state is not h11.DONE  # the answer never completed
            client.close()
            assert controller.released == 1

    run(main())


def test_many_concurrent_streams_all_arrive_whole() -> None:
    async def main() -> None:
        options = SimOptions(model=MODEL, tokens=32)
        async with sim_rig(options) as (engine, _, server):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
            want = await request_once(engine.port, "POST", "/v1/chat/completions", body)
            replies = await asyncio.gather(
                *(
                    request_once(server.port, "POST", "/d/a/v1/chat/completions", body)
                    for _ in range(64)
                )
            )
            assert all(r.body == want.body for r in replies)
            assert json.loads(want.body.split(b"\n\n")[0][len(b"data: ") :])

    run(main())
