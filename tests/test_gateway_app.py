"""The on-demand gateway over loopback: what callers see and what counts as traffic (seed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.admission import Refused
from gateway.app import MAX_SENDS, Gateway, GatewayConfig
from gateway.server import HTTPServer, ServerConfig
from tests.gateway_support import (
    Client,
    EngineScript,
    FakeEngine,
    Reply,
    ScriptedController,
    poll,
    raw_exchange,
    request_once,
    run,
)

LINE = (
    "⏳ Your message is queued — waiting for memory to free up for model-a. "
    "It will start automatically.\n\n"
)
CHAT = "/d/a/v1/chat/completions"
COMPLETIONS = "/d/a/v1/completions"
RESPONSES = "/d/a/v1/responses"
PROBE = [("x-dgxmm-health-check", "1")]
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass
class Rig:
    """An engine, a scripted controller and a gateway in front of them."""

    engine: FakeEngine
    controller: ScriptedController
    gateway: Gateway
    server: HTTPServer

    @property
    def port(self) -> int:
        """The gateway's port."""
        return self.server.port

    def ready(self) -> None:
        """Let every waiter of deployment `a` through."""
        self.controller.make_ready("a", self.engine.handle)


# Every test runs twice: with a cold pool (a ready model's first request goes the handler's
# way) and with an idle engine connection ready (it takes the express lane: gateway.express).
WARM = False


@pytest.fixture(autouse=True, params=["cold", "warm"])
def _pool(request: pytest.FixtureRequest) -> Iterator[None]:
    global WARM
    WARM = request.param == "warm"
    yield
    WARM = False


@contextlib.asynccontextmanager
async def rig(
    state: str = "ready",
    script: EngineScript | None = None,
    gateway_config: GatewayConfig | None = None,
) -> AsyncIterator[Rig]:
    """Deployment `a` in `state`, its engine, and the gateway."""
    async with FakeEngine(script) as engine:
        controller = ScriptedController()
        controller.add("a", state=state, handle=engine.handle if state == "ready" else None)
        gateway = Gateway(controller, config=gateway_config, clock=lambda: 1700000000.0)
        server = await gateway.serve("127.0.0.1", 0)
        if WARM and state == "ready":
            await gateway.upstream.open_idle("127.0.0.1", engine.port)
        try:
            yield Rig(engine, controller, gateway, server)
        finally:
            await gateway.shutdown(2.0)
        # Whatever happened, every lease was given back.
        assert controller.in_flight["a"] == 0


def end_to_end_headers(reply: Reply) -> list[tuple[bytes, bytes]]:
    """Headers a proxy must pass on (hop-by-hop ones removed), names lower-cased."""
    # The gateway's own x-dgxmm-request-id aside (tests/test_request_ids.py checks it).
    return [
        (n.lower(), v)
        for n, v in reply.headers
        if n.decode().lower() not in HOP_BY_HOP and n.lower() != b"x-dgxmm-request-id"
    ]


def sse_events(body: bytes) -> list[bytes]:
    """The data lines of an event stream."""
    return [e[len(b"data: ") :] for e in body.split(b"\n\n") if e.startswith(b"data: ")]


# --- the model is ready ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "served-a", "messages": []}),
        ("/v1/chat/completions", {"model": "served-a", "messages": [], "stream": True}),
        ("/v1/completions", {"model": "served-a", "prompt": "x", "stream": True}),
        ("/v1/completions", {"model": "served-a", "prompt": "x"}),
        ("/v1/responses", {"model": "served-a", "input": "x"}),
        ("/v1/embeddings", {"model": "served-a", "input": "x"}),
        ("/v1/score", {"model": "served-a"}),
    ],
)
def test_ready_model_answer_is_relayed_byte_for_byte(path: str, body: dict[str, Any]) -> None:
    async def main() -> None:
        async with rig() as r:
            direct = await request_once(r.engine.port, "POST", path, body)
            relayed = await request_once(r.port, "POST", "/d/a" + path, body)
            assert relayed.status == direct.status
            assert relayed.body == direct.body
            assert end_to_end_headers(relayed) == end_to_end_headers(direct)
            assert r.controller.acquired == 1 and r.controller.enqueued == 0

    run(main())


def test_request_reaches_the_engine_with_path_query_headers_and_body_but_not_the_key() -> None:
    async def main() -> None:
        async with rig() as r:
            body = b'{"model": "served-a", "messages": []}'
            headers = [
                ("authorization", "Bearer k"),
                ("x-custom", "1"),
                ("connection", "keep-alive, x-hop"),
                ("x-hop", "drop me"),
            ]
            await request_once(r.port, "POST", CHAT + "?api-version=1", body, headers)
            seen = r.engine.seen[-1]
            assert seen.target == "/v1/chat/completions?api-version=1"
            assert seen.body == body
            assert "authorization" not in seen.headers  # the gateway key stops at the gateway
            assert seen.headers["x-custom"] == "1"
            assert seen.headers["content-length"] == str(len(body))
            assert "x-hop" not in seen.headers
            assert seen.headers["host"] == f"127.0.0.1:{r.engine.port}"

    run(main())


def test_engine_connections_are_kept_alive_and_reused() -> None:
    async def main() -> None:
        async with rig() as r:
            client = await Client.connect(r.port)
            for _ in range(5):
                assert (await client.request("POST", CHAT, {"messages": []})).status == 200
            client.close()
            assert r.engine.connections == 1

    run(main())


def test_ready_model_request_never_parses_or_waits() -> None:
    async def main() -> None:
        async with rig() as r:
            reply = await request_once(r.port, "POST", CHAT, b"this is not json")
            assert reply.status == 200  # relayed as-is: the engine decides
            assert r.engine.seen[-1].body == b"this is not json"

    run(main())


def test_ready_models_are_never_refused() -> None:
    async def main() -> None:
        async with rig() as r:
            r.controller.deployments["a"].refuse = Refused(503, "ondemand_queue_full", "full", 60)
            assert (await request_once(r.port, "POST", CHAT, {"messages": []})).status == 200

    run(main())


# --- the model starts for the request ----------------------------------------------------


def test_waiting_for_a_start_sends_nothing_before_the_engine_answers() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            client = await Client.connect(r.port)
            await client.send("POST", CHAT, {"messages": [], "stream": True})
            await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
            r.ready()
            reply = await client.reply()
            assert reply.header("x-engine") == "fake"  # the first bytes were the engine's head
            assert LINE.encode() not in reply.body
            assert sse_events(reply.body)[-1] == b"[DONE]"
            client.close()

    run(main())


def test_requests_waiting_for_the_same_start_all_get_answers() -> None:
    async def main() -> None:
        async with rig(state="starting") as r:
            tasks = [
                asyncio.create_task(request_once(r.port, "POST", CHAT, {"messages": []}))
                for _ in range(5)
            ]
            await r.controller.until(lambda: len(r.controller.pending("a")) == 5)
            r.ready()
            replies = await asyncio.gather(*tasks)
            assert [x.status for x in replies] == [200] * 5
            assert all(LINE not in x.json()["choices"][0]["message"]["content"] for x in replies)

    run(main())


def test_line_is_added_only_when_really_queued_not_when_waiting_for_a_start() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            task = asyncio.create_task(request_once(r.port, "POST", CHAT, {"messages": []}))
            await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
            r.ready()
            reply = await task
            assert reply.json()["choices"][0]["message"]["content"] == "Hello world"

    run(main())


# --- queued ------------------------------------------------------------------------------


async def queued_stream(r: Rig, path: str, body: dict[str, Any]) -> tuple[Client, bytes]:
    """Start a streaming request, queue it, and return what arrived before it was served."""
    client = await Client.connect(r.port)
    await client.send("POST", path, body)
    await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
    r.controller.queue("a")
    status, headers = await client.head()
    assert status == 200
    assert dict(headers)[b"content-type"].startswith(b"text/event-stream")
    first = await client.read_until(b"\n\n")
    return client, first


def test_queued_streaming_chat_gets_the_line_at_once_then_the_real_answer() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            client, first = await queued_stream(r, CHAT, {"messages": [], "stream": True})
            event = json.loads(sse_events(first)[0])
            assert event["object"] == "chat.completion.chunk"
            assert event["choices"][0]["delta"]["content"] == LINE
            r.ready()
            rest = b""
            while (data := await client.chunk()) is not None:
                rest += data
            direct = await request_once(
                r.engine.port, "POST", "/v1/chat/completions", {"messages": [], "stream": True}
            )
            assert rest == direct.body  # then the engine's own stream, byte for byte
            client.close()

    run(main())


def test_queued_streaming_completions_get_a_text_completion_chunk() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            client, first = await queued_stream(r, COMPLETIONS, {"prompt": "x", "stream": True})
            event = json.loads(sse_events(first)[0])
            assert event["object"] == "text_completion"
            assert event["choices"][0]["text"] == LINE
            r.ready()
            rest = await client.read_until(b"data: [DONE]\n\n")
            assert b"t4 " in rest
            client.close()

    run(main())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (RESPONSES, {"input": "x", "stream": True}),
        ("/d/a/v1/messages", {"messages": [], "stream": True}),
        (CHAT, {"messages": [], "stream": True, "response_format": {"type": "json_object"}}),
        (CHAT, {"messages": [], "stream": True, "tools": []}),
        (COMPLETIONS, {"prompt": "x", "stream": True, "guided_regex": "a+"}),
    ],
)
def test_queued_streams_without_a_line_are_held_silently(path: str, body: dict[str, Any]) -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            client = await Client.connect(r.port)
            await client.send("POST", path, body)
            await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
            r.controller.queue("a")
            r.ready()
            reply = await client.reply()
            assert LINE.encode() not in reply.body
            assert reply.header("x-engine") == "fake"
            client.close()

    run(main())


async def queued_answer(r: Rig, path: str, body: dict[str, Any]) -> Reply:
    """A non-streaming request that gets queued, then served."""
    client = await Client.connect(r.port)
    await client.send("POST", path, body)
    await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
    r.controller.queue("a")
    r.ready()
    try:
        return await client.reply()
    finally:
        client.close()


def test_queued_chat_answer_has_the_line_in_front_of_its_content() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            reply = await queued_answer(r, CHAT, {"messages": []})
            assert reply.json()["choices"][0]["message"]["content"] == LINE + "Hello world"
            assert reply.header("content-length") == str(len(reply.body))
            assert reply.header("x-engine") == "fake"

    run(main())


def test_queued_completion_answer_has_the_line_in_front_of_its_text() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            reply = await queued_answer(r, COMPLETIONS, {"prompt": "x"})
            assert reply.json()["choices"][0]["text"] == LINE + "Hello world"
            assert reply.header("content-length") == str(len(reply.body))

    run(main())


def test_queued_responses_answer_has_the_line_in_its_first_output_text() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            reply = await queued_answer(r, RESPONSES, {"input": "x"})
            assert reply.json()["output"][1]["content"][0]["text"] == LINE + "Hello world"

    run(main())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/d/a/v1/embeddings", {"input": "x"}),
        ("/d/a/v1/messages", {"messages": []}),
        ("/d/a/v1/score", {"text_1": "a"}),
        (CHAT, {"messages": [], "response_format": {"type": "json_schema"}}),
        (CHAT, {"messages": [], "tool_choice": "none"}),
        (CHAT, {"messages": [], "functions": []}),
        (CHAT, {"messages": [], "function_call": "auto"}),
        (CHAT, {"messages": [], "structured_outputs": {"choice": ["a"]}}),
        (CHAT, {"messages": [], "guided_json": {}}),
        (RESPONSES, {"input": "x", "text": {"format": {"type": "json_schema"}}}),
        (RESPONSES, {"input": "x", "tools": [{"type": "function"}]}),
    ],
)
def test_queued_answers_that_must_not_change_are_the_engines(
    path: str, body: dict[str, Any]
) -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            reply = await queued_answer(r, path, body)
            direct = await request_once(r.engine.port, "POST", path[len("/d/a") :], body)
            assert (reply.status, reply.body) == (direct.status, direct.body)

    run(main())


def test_queued_error_answers_are_not_rewritten() -> None:
    async def main() -> None:
        async with rig(state="stopped", script=EngineScript(status=500)) as r:
            reply = await queued_answer(r, CHAT, {"messages": []})
            assert reply.status == 500
            assert LINE not in reply.body.decode()

    run(main())


# --- errors ------------------------------------------------------------------------------


SEED_REFUSALS = [
    Refused(503, "ondemand_queue_full", "too many requests wait for on-demand models", 60),
    Refused(503, "does_not_fit", "model-a needs 90 GiB but at most 60 GiB can be freed", None),
    Refused(503, "start_failed", "model-a could not start: exit 1", None),
    Refused(503, "ondemand_stopped", "model-a was stopped by an administrator", None),
    Refused(503, "ondemand_queue_timeout", "model model-a is busy; try again later", 60),
]


def expected_error(refused: Refused) -> dict[str, Any]:
    """The seed's error body for a refusal."""
    return {"error": {"message": refused.message, "type": "server_error", "code": refused.code}}


@pytest.mark.parametrize("refused", SEED_REFUSALS, ids=lambda x: x.code)
def test_refusal_at_enqueue_is_an_openai_error_with_retry_after_when_given(
    refused: Refused,
) -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            r.controller.deployments["a"].refuse = refused
            reply = await request_once(r.port, "POST", CHAT, {"messages": [], "stream": True})
            assert reply.status == refused.status
            assert reply.json() == expected_error(refused)
            expected_retry = None if refused.retry_after is None else str(refused.retry_after)
            assert reply.header("retry-after") == expected_retry
            assert reply.header("content-type") == "application/json"

    run(main())


@pytest.mark.parametrize("refused", SEED_REFUSALS[1:], ids=lambda x: x.code)
def test_refusal_while_waiting_is_an_error_reply(refused: Refused) -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            task = asyncio.create_task(request_once(r.port, "POST", CHAT, {"messages": []}))
            await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
            r.controller.queue("a")
            r.controller.refuse_waiters("a", refused)
            reply = await task
            assert reply.status == 503
            assert reply.json() == expected_error(refused)

    run(main())


def test_refusal_after_the_queued_chunk_ends_the_stream_with_error_and_done() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            client, _ = await queued_stream(r, CHAT, {"messages": [], "stream": True})
            refused = SEED_REFUSALS[-1]
            r.controller.refuse_waiters("a", refused)
            rest = b""
            while (data := await client.chunk()) is not None:
                rest += data
            events = sse_events(rest)
            assert [json.loads(events[0]), events[1]] == [expected_error(refused), b"[DONE]"]
            client.close()

    run(main())


def test_engine_error_after_the_queued_chunk_becomes_its_error_event() -> None:
    async def main() -> None:
        async with rig(state="stopped", script=EngineScript(status=400)) as r:
            client, _ = await queued_stream(r, CHAT, {"messages": [], "stream": True})
            r.ready()
            rest = b""
            while (data := await client.chunk()) is not None:
                rest += data
            events = sse_events(rest)
            assert json.loads(events[0]) == {"error": {"message": "bad things", "code": 400}}
            assert events[1] == b"[DONE]" and len(events) == 2
            client.close()

    run(main())


def test_gateway_deadline_gives_the_seed_queue_timeout() -> None:
    async def main() -> None:
        async with rig(state="stopped", gateway_config=GatewayConfig(wait_deadline_s=0.2)) as r:
            reply = await request_once(r.port, "POST", CHAT, {"messages": []})
            assert reply.status == 503
            assert reply.header("retry-after") == "60"
            assert reply.json() == {
                "error": {
                    "message": "model model-a is busy; try again later",
                    "type": "server_error",
                    "code": "ondemand_queue_timeout",
                }
            }
            assert r.controller.cancelled == [w.request_id for w in r.controller.waiters]
            assert r.controller.cancelled == [reply.header("x-dgxmm-request-id")]

    run(main())


def test_unknown_deployment_is_an_openai_404() -> None:
    async def main() -> None:
        async with rig() as r:
            reply = await request_once(r.port, "POST", "/d/nope/v1/chat/completions", b"{}")
            assert reply.status == 404
            assert reply.json()["error"]["code"] == "deployment_not_found"
            assert reply.json()["error"]["type"] == "invalid_request_error"  # OpenAI's, LiteLLM's
            assert r.engine.seen == []

    run(main())


def test_a_request_its_engine_refused_waits_for_the_engine_and_is_served_once() -> None:
    """Connection refused: the request never reached the engine.  Its lease goes back, the
    controller is told (and stops serving), and the request waits from its arrival for the
    engine's start, then gets the normal answer: no error, and no queued line."""

    async def main() -> None:
        async with rig() as r:
            r.controller.suspect_on_unreachable = True
            r.controller.deployments["a"].handle = r.engine.handle.__class__(
                deployment_id="a", host="127.0.0.1", port=1, runtime_id="x"
            )
            task = asyncio.create_task(request_once(r.port, "POST", CHAT, {"messages": []}))
            await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
            # Every lease back (the express lane's too, which handed the request over).
            assert r.controller.released == r.controller.acquired
            assert r.controller.unreachable == ["a"]
            assert r.controller.waited_s[0] > 0  # from its arrival, not from now
            r.controller.make_ready("a", r.engine.handle)
            reply = await task
            assert reply.status == 200 and "queued" not in reply.body.decode()
            assert len(r.engine.seen) == 1 and r.controller.released == r.controller.acquired

    run(main())


def test_a_request_whose_engines_keep_refusing_gets_502_after_its_last_send() -> None:
    async def main() -> None:
        async with rig() as r:
            r.controller.suspect_on_unreachable = True
            dead = r.engine.handle.__class__(
                deployment_id="a", host="127.0.0.1", port=1, runtime_id="x"
            )
            r.controller.deployments["a"].handle = dead
            task = asyncio.create_task(request_once(r.port, "POST", CHAT, {"messages": []}))
            for n in range(1, MAX_SENDS):
                await r.controller.until(lambda n=n: r.controller.enqueued == n)  # type: ignore[misc]
                r.controller.make_ready("a", dead)
            reply = await task
            assert reply.status == 502
            assert reply.json()["error"]["code"] == "engine_unreachable"
            assert r.controller.unreachable == ["a"] * MAX_SENDS
            assert r.controller.released == r.controller.acquired and r.engine.seen == []

    run(main())


# --- hang-ups and crashes ----------------------------------------------------------------


def test_client_hanging_up_while_queued_leaves_the_queue() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            client = await Client.connect(r.port)
            await client.send("POST", CHAT, {"messages": []})
            await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
            r.controller.queue("a")
            client.close()
            await r.controller.until(lambda: len(r.controller.cancelled) == 1)
            assert r.controller.cancelled == [w.request_id for w in r.controller.waiters]
            assert r.engine.seen == []

    run(main())


def test_client_hanging_up_after_the_queued_chunk_leaves_the_queue() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            client, _ = await queued_stream(r, CHAT, {"messages": [], "stream": True})
            client.close()
            await r.controller.until(lambda: len(r.controller.cancelled) == 1)
            assert r.controller.cancelled == [w.request_id for w in r.controller.waiters]

    run(main())


def test_lease_granted_as_the_client_leaves_is_given_back() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            client = await Client.connect(r.port)
            await client.send("POST", CHAT, {"messages": []})
            await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
            client.close()
            r.ready()  # the lease may be granted while the gateway learns of the hang-up
            await r.controller.until(lambda: r.controller.released == 1)

    run(main())


def test_client_hanging_up_aborts_the_engine_request() -> None:
    async def main() -> None:
        hold = asyncio.Event()
        async with rig(script=EngineScript(hold=hold)) as r:
            client = await Client.connect(r.port)
            await client.send("POST", CHAT, {"messages": []})
            await r.engine.started.wait()
            client.close()
            await poll(lambda: r.engine.disconnects == 1)
            await r.controller.until(lambda: r.controller.released == 1)

    run(main())


def test_engine_crash_mid_stream_ends_the_chunked_answer_cleanly() -> None:
    async def main() -> None:
        async with rig(script=EngineScript(tokens=5, crash_after=2)) as r:
            client = await Client.connect(r.port)
            reply = await client.request("POST", CHAT, {"messages": [], "stream": True})
            assert reply.status == 200
            assert b"t1 " in reply.body and b"t2 " not in reply.body
            # The answer ended cleanly (terminating chunk), so the connection still works.
            assert (await client.request("GET", "/d/a/v1/models")).status == 200
            client.close()

    run(main())


def test_engine_crash_after_the_queued_chunk_ends_with_error_and_done() -> None:
    async def main() -> None:
        async with rig(state="stopped", script=EngineScript(tokens=5, crash_after=2)) as r:
            client, _ = await queued_stream(r, CHAT, {"messages": [], "stream": True})
            r.ready()
            rest = b""
            while (data := await client.chunk()) is not None:
                rest += data
            events = sse_events(rest)
            assert events[-1] == b"[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_failed"
            assert b'{"partial' not in rest  # no half event before the error
            client.close()

    run(main())


# --- what counts as traffic --------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    [
        "chat/completions",
        "completions",
        "embeddings",
        "responses",
        "messages",
        "chat/completions/batch",
        "audio/transcriptions",
        "audio/translations",
        "rerank",
        "score",
    ],
)
def test_every_inference_endpoint_starts_a_stopped_model(endpoint: str) -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            task = asyncio.create_task(request_once(r.port, "POST", f"/d/a/v1/{endpoint}", b"{}"))
            await r.controller.until(lambda: len(r.controller.pending("a")) == 1)
            r.ready()
            await task
            assert r.engine.seen[-1].target == f"/v1/{endpoint}"

    run(main())


def test_models_list_is_answered_from_the_record_without_starting_anything() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            reply = await request_once(r.port, "GET", "/d/a/v1/models")
            assert reply.status == 200
            assert reply.json() == {
                "object": "list",
                "data": [
                    {
                        "id": "served-a",
                        "object": "model",
                        "created": 1700000000,
                        "owned_by": "dgxmm",
                    }
                ],
            }
            assert r.controller.enqueued == 0 and r.controller.acquired == 0
            assert r.engine.seen == []

    run(main())


def test_model_get_goes_to_a_ready_engine_without_counting_as_traffic() -> None:
    async def main() -> None:
        async with rig() as r:
            reply = await request_once(r.port, "GET", "/d/a/v1/models/org/model")
            assert reply.status == 200 and reply.json()["id"] == "org/model"
            assert r.engine.seen[-1].target == "/v1/models/org/model"
            assert r.controller.acquired == 0 and r.controller.enqueued == 0

    run(main())


def test_model_get_while_not_ready_is_503_not_ready() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            reply = await request_once(r.port, "GET", "/d/a/v1/models/served-a")
            assert reply.status == 503
            assert reply.json()["error"]["code"] == "ondemand_not_ready"
            assert reply.header("retry-after") is None
            assert r.controller.enqueued == 0

    run(main())


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/d/a/health"),
        ("GET", "/d/a/v1/health"),
        ("GET", "/d/a/metrics"),
        ("POST", "/d/a/tokenize"),
        ("POST", "/d/a/v1/tokenize"),
        ("POST", "/d/a/v1/messages/count_tokens"),
        ("POST", "/d/a/v1/load_lora_adapter"),
        ("GET", "/d/a/v1/responses/resp_1"),
        ("POST", "/d/a/sleep"),
        ("GET", "/d/a/is_sleeping"),
        ("GET", "/d/a/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/"),
    ],
)
def test_everything_else_is_404_and_never_reaches_engine_or_controller(
    method: str, path: str
) -> None:
    async def main() -> None:
        async with rig() as r:
            reply = await request_once(r.port, method, path, b"{}" if method == "POST" else b"")
            assert reply.status == 404
            assert reply.json()["error"]["type"] == "invalid_request_error"
            assert r.engine.seen == []
            assert r.controller.acquired == 0 and r.controller.enqueued == 0

    run(main())


@pytest.mark.parametrize("state", ["stopped", "starting", "ready", "stopping", "asleep"])
def test_health_probe_is_answered_by_the_gateway_in_every_state(state: str) -> None:
    async def main() -> None:
        async with rig(state=state) as r:
            reply = await request_once(
                r.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}]}, PROBE
            )
            assert reply.status == 200
            assert reply.header("x-dgxmm-ondemand-state") == state
            answer = reply.json()
            assert answer["object"] == "chat.completion"
            assert answer["choices"][0]["message"]["content"] == ""
            assert r.engine.seen == []
            assert r.controller.acquired == 0 and r.controller.enqueued == 0

    run(main())


def test_health_probe_of_a_failed_deployment_is_unhealthy() -> None:
    async def main() -> None:
        async with rig(state="failed") as r:
            reply = await request_once(r.port, "POST", CHAT, {"messages": []}, PROBE)
            assert reply.status == 503
            assert reply.header("x-dgxmm-ondemand-state") == "failed"
            assert reply.json()["error"]["type"] == "server_error"  # the seed's 503s stay so
            assert r.engine.seen == []

    run(main())


@pytest.mark.parametrize(
    ("path", "body", "check"),
    [
        (CHAT, {"stream": True}, "chat.completion.chunk"),
        (COMPLETIONS, {"stream": True}, "text_completion"),
        (RESPONSES, {"stream": True}, "response.created"),
        ("/d/a/v1/messages", {"stream": True}, "message_start"),
        (COMPLETIONS, {}, "text_completion"),
        (RESPONSES, {}, '"object":"response"'),
        ("/d/a/v1/embeddings", {}, '"data":[]'),
    ],
)
def test_health_probe_answers_have_the_endpoints_shape(
    path: str, body: dict[str, Any], check: str
) -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            reply = await request_once(r.port, "POST", path, body, PROBE)
            assert reply.status == 200
            assert check in reply.body.decode()
            if body.get("stream"):
                assert reply.header(
                    "content-type",
                ).startswith("text/event-stream")  # type: ignore[union-attr]

    run(main())


def test_request_bodies_over_16_mib_get_413_request_too_large() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            boundary = "b0undary"
            head = (
                f'--{boundary}\r\ncontent-disposition: form-data; name="file"; '
                'filename="a.wav"\r\ncontent-type: audio/wav\r\n\r\n'
            ).encode()
            body = head + b"\0" * (16 * 1024 * 1024) + f"\r\n--{boundary}--\r\n".encode()
            reply = await request_once(
                r.port,
                "POST",
                "/d/a/v1/audio/transcriptions",
                body,
                [("content-type", f"multipart/form-data; boundary={boundary}")],
            )
            assert reply.status == 413
            assert reply.json()["error"]["code"] == "request_too_large"
            assert reply.json()["error"]["type"] == "invalid_request_error"
            assert r.controller.enqueued == 0

    run(main())


def test_a_body_of_exactly_16_mib_is_accepted() -> None:
    async def main() -> None:
        async with rig() as r:
            body = b"\0" * (16 * 1024 * 1024)
            reply = await request_once(r.port, "POST", "/d/a/v1/audio/transcriptions", body)
            assert reply.status == 404  # the fake engine has no audio: its own answer
            assert len(r.engine.seen[-1].body) == len(body)

    run(main())


def test_chunked_upload_over_16_mib_gets_413_while_it_streams_in() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            writer.write(
                b"POST /d/a/v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            piece = b"%x\r\n%s\r\n" % (1 << 20, b"\0" * (1 << 20))
            got = b""
            for _ in range(64):  # up to 64 MiB: the answer must come long before
                writer.write(piece)
                try:
                    await writer.drain()
                except OSError:
                    break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.001):
                        got += await reader.read(65536)
                if got:
                    break
            got += await reader.read(65536)
            writer.transport.abort()
            assert got.startswith(b"HTTP/1.1 413 ")
            assert b"request_too_large" in got

    run(main())


def test_malformed_requests_do_not_disturb_the_gateway() -> None:
    async def main() -> None:
        async with rig() as r:
            got = await raw_exchange(r.port, b"POST /d/a/v1/chat/completions HTTP/1.1\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 400 ")
            assert b'"type":"invalid_request_error"' in got
            assert (await request_once(r.port, "POST", CHAT, {"messages": []})).status == 200

    run(main())


# --- adversarial bytes -------------------------------------------------------------------

_TARGETS = st.sampled_from(
    [
        b"/d/a/v1/chat/completions",
        b"/d/a/v1/completions?stream=true",
        b"/d/a/v1/models",
        b"/d/a/v1/models/../../etc",
        b"/d/a/v1/responses/x",
        b"/d//v1/chat/completions",
        b"/d/a",
        b"/d/a?/v1/chat/completions",
        b"/d/%61/v1/chat/completions",
        b"/d/a/v1/chat/completions/../../x",
        b"*",
        b"http://evil/d/a/v1/chat/completions",
        b"/" + b"a" * 3000,
    ]
)
_HEADERS = st.lists(
    st.sampled_from(
        [
            b"host: x\r\n",
            b"content-length: 2\r\n",
            b"content-length: 0\r\n",
            b"content-length: 99999999999\r\n",
            b"transfer-encoding: chunked\r\n",
            b"x-dgxmm-health-check: 1\r\n",
            b"x-dgxmm-health-check: 1\r\nx-dgxmm-health-check: 0\r\n",
            b"connection: close\r\n",
            b"connection: keep-alive, te\r\n",
            b"expect: 100-continue\r\n",
            b"content-type: application/json\r\n",
            b"\x00bad: header\r\n",
        ]
    ),
    max_size=6,
)
_BODIES = st.sampled_from(
    [b"", b"{}", b'{"stream": true}', b'{"stream": tru', b"2\r\n{}\r\n0\r\n\r\n", b"\xff\xfe"]
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from([b"POST", b"GET", b"PUT", b"HEAD", b"P\x00ST"]),
    target=_TARGETS,
    headers=_HEADERS,
    body=_BODIES,
    version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 x"]),
)
def test_adversarial_requests_get_an_answer_or_a_close_and_the_gateway_keeps_serving(
    method: bytes, target: bytes, headers: list[bytes], body: bytes, version: bytes
) -> None:
    async def main() -> None:
        config = ServerConfig(header_timeout_s=0.2, body_timeout_s=0.2, keepalive_timeout_s=0.2)
        async with FakeEngine() as engine:
            controller = ScriptedController()
            controller.add("a", handle=engine.handle)
            gateway = Gateway(controller, clock=lambda: 1700000000.0)
            server = await gateway.serve("127.0.0.1", 0, config)
            try:
                raw = method + b" " + target + b" " + version + b"\r\n" + b"".join(headers)
                got = await raw_exchange(server.port, raw + b"\r\n" + body)
                if got.startswith(b"HTTP/1.1 100 ") and b"expect: 100-continue\r\n" in headers:
                    got = got.partition(b"\r\n\r\n")[2]  # the go-ahead, then the answer
                if got:
                    assert got.startswith(b"HTTP/1.1 "), got[:80]
                    status = int(got[9:12])
                    assert status in (200, 400, 404, 408, 413, 431, 501), got[:200]
                    if status >= 400 and status != 404 and method != b"HEAD":  # no body
                        kind = b"server_error" if status >= 500 else b"invalid_request_error"
                        assert b'"type":"%s"' % kind in got
                reply = await request_once(server.port, "POST", CHAT, {"messages": []})
                assert reply.status == 200
                await poll(lambda: controller.in_flight["a"] == 0)
            finally:
                await gateway.shutdown(1.0)

    run(main(), timeout=20)


def test_a_request_for_a_model_the_deployment_does_not_serve_starts_nothing() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
            reply = await request_once(r.port, "POST", CHAT, body)
            assert reply.status == 404
            error = reply.json()["error"]
            assert (error["code"], error["type"]) == ("model_not_found", "invalid_request_error")
            assert "served-a" in error["message"]
            assert r.controller.enqueued == 0 and r.engine.seen == []

    run(main())


@pytest.mark.parametrize("depth", [200_000, 5_000])  # over and under the express lane's bound
@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("state", ["stopped", "ready"])
@pytest.mark.parametrize("shape", ["arrays", "objects"])
def test_a_body_nested_too_deep_is_a_400_naming_the_limit_that_starts_and_reaches_nothing(
    state: str, shape: str, named: bool, depth: int
) -> None:
    deep = (
        b"[" * depth + b"]" * depth if shape == "arrays" else b'{"a":' * depth + b"1" + b"}" * depth
    )
    # With and without the served model named first: the express lane (a warm pool) reads
    # the top level for the model, and leaves what it cannot read to the handler.
    body = (b'{"model":"served-a","messages":' if named else b'{"messages":') + deep + b"}"

    async def main() -> None:
        async with rig(state) as r:
            client = await Client.connect(r.port)
            try:
                reply = await client.request("POST", CHAT, body)
                assert reply.status == 400
                error = reply.json()["error"]
                assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
                assert "more than 900 levels deep" in error["message"]
                assert b"ecursion" not in reply.body and b"Error" not in reply.body
                assert r.controller.enqueued == r.controller.acquired == 0 and r.engine.seen == []
                # The body was read whole: the connection serves the next request.
                assert (await client.request("GET", "/d/a/v1/models")).status == 200
            finally:
                client.close()

    run(main())
