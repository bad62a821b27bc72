"""The simulated engine behaves like each real engine where DGXMM can tell the difference."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gateway import client
from simulations.answers import Flavour, generate, metrics_text
from simulations.engine import (
    Phase,
    SimOptions,
    SimServer,
    parse_args,
    serve,
)

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def run(coro: Awaitable[T]) -> T:
    """Run one test body on a fresh event loop."""

    async def main() -> T:
        return await coro

    return asyncio.run(main())


@contextlib.asynccontextmanager
async def engine(**fields: Any) -> AsyncIterator[SimServer]:
    """An in-process simulated engine on a free loopback port, closed afterwards."""
    fields.setdefault("model", "m")
    server = await serve(SimOptions(**fields))
    try:
        yield server
    finally:
        await server.close()


async def eventually(check: Callable[[], Awaitable[T | None]], timeout_s: float = 10.0) -> T:
    """Poll `check` until it returns something other than None, or fail at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = await check()
        if result is not None:
            return result
        if loop.time() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.01)


async def call(
    server: SimServer,
    method: str,
    target: str,
    body: Any = None,
    headers: tuple[tuple[str, str], ...] = (),
) -> client.Response:
    """One request to the engine; JSON-encodes `body` unless it is bytes."""
    raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    return await client.request(
        "127.0.0.1", server.port, method, target, body=raw, headers=headers, timeout_s=10.0
    )


async def status_or_none(port: int, target: str = "/health") -> int | None:
    """The status of GET target, or None when the connection is refused."""
    try:
        response = await client.request("127.0.0.1", port, "GET", target)
    except client.ConnectionRefused:
        return None
    return response.status


def sse_data(body: bytes) -> list[str]:
    """The `data:` payloads of an event stream, in order."""
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


def sse_events(body: bytes) -> list[str]:
    """The `event:` names of an event stream, in order."""
    return [line[7:] for line in body.decode().split("\n") if line.startswith("event: ")]


# --------------------------------------------------------------------------- start-up


def test_vllm_refuses_connections_until_the_startup_delay_has_passed() -> None:
    async def body() -> None:
        async with engine(flavour="vllm", startup_delay_s=0.5) as server:
            assert await status_or_none(server.port) is None
            assert server.statistics().phase is Phase.LOADING

            async def ready() -> int | None:
                return await status_or_none(server.port)

            assert await eventually(ready) == 200
            assert server.statistics().phase is Phase.READY

    run(body())


def test_llamacpp_answers_loading_model_503_then_status_ok() -> None:
    async def body() -> None:
        async with engine(flavour="llamacpp", startup_delay_s=0.5) as server:
            loading = await call(server, "GET", "/health")
            assert loading.status == 503
            assert json.loads(loading.body) == {
                "error": {"message": "Loading model", "type": "unavailable_error", "code": 503}
            }
            chat = await call(server, "POST", "/v1/chat/completions", CHAT)
            assert chat.status == 503

            async def ok() -> client.Response | None:
                response = await call(server, "GET", "/health")
                return response if response.status == 200 else None

            assert json.loads((await eventually(ok)).body) == {"status": "ok"}

    run(body())


def test_sglang_refuses_then_answers_503_during_warmup_then_200() -> None:
    async def body() -> None:
        async with engine(flavour="sglang", startup_delay_s=0.3, warmup_delay_s=0.5) as server:
            seen: list[int | None] = []

            async def ready() -> bool | None:
                status = await status_or_none(server.port)
                if not seen or seen[-1] != status:
                    seen.append(status)
                return True if status == 200 else None

            await eventually(ready)
            assert seen == [None, 503, 200]

    run(body())


def test_sglang_warmup_defaults_to_a_tenth_of_the_startup_delay() -> None:
    assert SimOptions(flavour="sglang", startup_delay_s=20.0).warmup_s == pytest.approx(2.0)
    assert SimOptions(flavour="sglang", warmup_delay_s=0.0, startup_delay_s=9).warmup_s == 0.0


def test_fail_at_start_ends_in_process_with_code_1_and_the_message() -> None:
    async def body() -> None:
        server = await serve(
            SimOptions(flavour="llamacpp", startup_delay_s=0.2, fail_at_start="boom")
        )
        assert await call(server, "GET", "/health")
        assert await asyncio.wait_for(server.wait_done(), 5) == 1
        assert server.failure == "boom"
        assert server.phase is Phase.FAILED
        assert await status_or_none(server.port) is None

    run(body())


# --------------------------------------------------------------------------- metrics


def test_vllm_metrics_have_help_type_and_exact_series() -> None:
    async def body() -> None:
        async with engine(flavour="vllm", model="org/M") as server:
            response = await call(server, "GET", "/metrics")
            text = response.body.decode()
            assert (
                response.header(
                    "content-type",
                )
                == b"text/plain; version=0.0.4; charset=utf-8"
            )
            assert "# TYPE vllm:num_requests_running gauge" in text
            assert "# HELP vllm:num_requests_waiting " in text
            assert 'vllm:num_requests_running{engine="0",model_name="org/M"} 0.0\n' in text
            assert 'vllm:num_requests_waiting{engine="0",model_name="org/M"} 0.0\n' in text
            assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="org/M",' in text

    run(body())


def test_llamacpp_metrics_need_the_metrics_flag() -> None:
    async def body() -> None:
        async with engine(flavour="llamacpp") as server:
            response = await call(server, "GET", "/metrics")
            assert response.status == 501
            assert json.loads(response.body)["error"]["type"] == "not_supported_error"
        async with engine(flavour="llamacpp", metrics=True) as server:
            text = (await call(server, "GET", "/metrics")).body.decode()
            assert (
                "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n"
                in text
            )
            assert "llamacpp:requests_deferred 0\n" in text

    run(body())


def test_sglang_metrics_need_enable_metrics_and_repeat_per_tp_rank() -> None:
    async def body() -> None:
        async with engine(flavour="sglang") as server:
            assert (await call(server, "GET", "/metrics")).status == 404
        async with engine(flavour="sglang", metrics=True, tp_size=2) as server:
            text = (await call(server, "GET", "/metrics")).body.decode()
            assert "# TYPE sglang:num_running_reqs gauge" in text
            assert text.count("sglang:num_running_reqs{") == 2
            assert 'tp_rank="1"} 0.0' in text
            assert "sglang:num_queue_reqs{" in text

    run(body())


def test_metrics_text_spreads_data_parallel_ranks() -> None:
    text = metrics_text("vllm", "m", [(1, 0), (2, 3)], 1).decode()
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 2.0' in text
    assert 'vllm:num_requests_waiting{engine="1",model_name="m"} 3.0' in text
    sglang = metrics_text("sglang", "m", [(1, 0), (2, 3)], 2).decode()
    assert sglang.count('dp_rank="1"') == 4


def test_running_and_waiting_follow_real_in_flight_requests() -> None:
    async def body() -> None:
        opts = {"flavour": "vllm", "token_delay_s": 0.05, "tokens": 40, "max_running": 1}
        async with engine(**opts) as server:
            streams = [
                asyncio.create_task(call(server, "POST", "/v1/completions", {"prompt": str(i)}))
                for i in range(2)
            ]

            async def busy() -> str | None:
                text = (await call(server, "GET", "/metrics")).body.decode()
                running = 'vllm:num_requests_running{engine="0",model_name="m"} 1.0' in text
                waiting = 'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0' in text
                return text if running and waiting else None

            await eventually(busy)
            stats = server.statistics()
            assert (stats.running, stats.waiting) == (1, 1)
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

            async def idle() -> bool | None:
                s = server.statistics()
                return True if (s.running, s.waiting) == (0, 0) else None

            await eventually(idle)

    run(body())


# --------------------------------------------------------------------------- inference


def test_chat_is_deterministic_for_a_given_body() -> None:
    async def body() -> None:
        async with engine(flavour="vllm") as server:
            first = await call(server, "POST", "/v1/chat/completions", CHAT)
            second = await call(server, "POST", "/v1/chat/completions", CHAT)
            other = {**CHAT, "messages": [{"role": "user", "content": "something else"}]}
            third = await call(server, "POST", "/v1/chat/completions", other)
            assert first.status == 200
            assert first.body == second.body
            assert first.body != third.body
            answer = json.loads(first.body)
            assert answer["object"] == "chat.completion"
            prompt = json.dumps(CHAT["messages"], separators=(",", ":")).encode()
            assert answer["choices"][0]["message"]["content"] == generate(prompt, None, 16).text

    run(body())


def test_vllm_chat_stream_starts_with_the_role_and_ends_with_done() -> None:
    async def body() -> None:
        async with engine(flavour="vllm", tokens=5) as server:
            response = await call(server, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
            assert response.header("content-type") == b"text/event-stream; charset=utf-8"
            assert response.body.endswith(b"\n\ndata: [DONE]\n\n")
            data = sse_data(response.body)
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
            assert len(chunks) == 6
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            whole = json.loads((await call(server, "POST", "/v1/chat/completions", CHAT)).body)
            assert text == whole["choices"][0]["message"]["content"]

    run(body())


def test_llamacpp_chat_stream_starts_with_null_content_and_ends_with_timings() -> None:
    async def body() -> None:
        async with engine(flavour="llamacpp", tokens=3) as server:
            response = await call(server, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
            data = sse_data(response.body)
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
            assert "timings" in chunks[-1]
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            assert all("timings" not in c for c in chunks[:-1])

    run(body())


def test_completions_stream_carries_text_completion_chunks() -> None:
    async def body() -> None:
        async with engine(flavour="sglang", tokens=4) as server:
            request = {"model": "m", "prompt": "Once", "stream": True}
            data = sse_data((await call(server, "POST", "/v1/completions", request)).body)
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert all(c["object"] == "text_completion" for c in chunks)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            whole = await call(server, "POST", "/v1/completions", {"model": "m", "prompt": "x"})
            assert json.loads(whole.body)["choices"][0]["text"]
            assert text

    run(body())


def test_responses_stream_is_event_pairs_without_done() -> None:
    async def body() -> None:
        async with engine(flavour="vllm", tokens=2) as server:
            request = {"model": "m", "input": "hi", "stream": True}
            response = await call(server, "POST", "/v1/responses", request)
            assert b"[DONE]" not in response.body
            assert sse_events(response.body) == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
            payloads = [json.loads(d) for d in sse_data(response.body)]
            assert [p["sequence_number"] for p in payloads] == list(range(10))
            plain = json.loads((await call(server, "POST", "/v1/responses", {"input": "x"})).body)
            assert plain["object"] == "response"
            assert plain["output"][0]["content"][0]["type"] == "output_text"
            assert plain["output"][0]["content"][0]["text"]

    run(body())


@pytest.mark.parametrize(("flavour", "done"), [("vllm", True), ("sglang", False)])
def test_messages_stream_runs_message_start_to_stop(flavour: Flavour, done: bool) -> None:
    async def body() -> None:
        async with engine(flavour=flavour, tokens=2) as server:
            request = {**CHAT, "max_tokens": 100, "stream": True}
            response = await call(server, "POST", "/v1/messages", request)
            assert sse_events(response.body) == [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
            assert response.body.endswith(b"data: [DONE]\n\n") is done
            plain = json.loads((await call(server, "POST", "/v1/messages", CHAT)).body)
            assert plain["type"] == "message"
            assert plain["content"][0]["type"] == "text"

    run(body())


def test_max_tokens_cuts_the_answer_and_says_length() -> None:
    async def body() -> None:
        async with engine(flavour="vllm", tokens=16) as server:
            request = {**CHAT, "max_tokens": 3}
            answer = json.loads((await call(server, "POST", "/v1/chat/completions", request)).body)
            assert answer["usage"]["completion_tokens"] == 3
            assert answer["choices"][0]["finish_reason"] == "length"
            whole = json.loads((await call(server, "POST", "/v1/chat/completions", CHAT)).body)
            full_text = whole["choices"][0]["message"]["content"]
            assert full_text.startswith(answer["choices"][0]["message"]["content"])

    run(body())


def test_embeddings_rerank_score_and_batch_have_their_shapes() -> None:
    async def body() -> None:
        async with engine(flavour="vllm") as server:
            emb = json.loads(
                (await call(server, "POST", "/v1/embeddings", {"input": ["a", "b"]})).body
            )
            assert emb["object"] == "list"
            assert [d["index"] for d in emb["data"]] == [0, 1]
            rerank = {"query": "q", "documents": ["a", "b", "c"], "top_n": 2}
            ranked = json.loads((await call(server, "POST", "/v1/rerank", rerank)).body)
            scores = [r["relevance_score"] for r in ranked["results"]]
            assert len(scores) == 2
            assert scores == sorted(scores, reverse=True)
            score = {"text_1": "q", "text_2": ["a", "b"]}
            scored = json.loads((await call(server, "POST", "/v1/score", score)).body)
            assert [d["object"] for d in scored["data"]] == ["score", "score"]
            convs = {
                "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
            }
            batch = json.loads(
                (await call(server, "POST", "/v1/chat/completions/batch", convs)).body
            )
            assert [c["index"] for c in batch["choices"]] == [0, 1]

    run(body())


def multipart() -> tuple[bytes, tuple[tuple[str, str], ...]]:
    """A small audio upload."""
    boundary = "simboundary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        f"Content-Type: audio/wav\r\n\r\nRIFF....WAVE\r\n--{boundary}--\r\n"
    ).encode()
    return body, (("content-type", f"multipart/form-data; boundary={boundary}"),)


def test_audio_is_served_by_vllm_but_404_on_llamacpp_and_with_no_audio() -> None:
    async def body() -> None:
        upload, headers = multipart()
        async with engine(flavour="vllm") as server:
            response = await call(server, "POST", "/v1/audio/transcriptions", upload, headers)
            assert response.status == 200
            assert json.loads(response.body)["text"]
            translated = await call(server, "POST", "/v1/audio/translations", upload, headers)
            assert translated.status == 200
        async with engine(flavour="vllm", audio=False, embeddings=False) as server:
            response = await call(server, "POST", "/v1/audio/transcriptions", upload, headers)
            assert (response.status, response.body) == (404, b'{"detail":"Not Found"}')
            response = await call(server, "POST", "/v1/embeddings", {"input": "a"})
            assert response.status == 404
        async with engine(flavour="llamacpp") as server:
            response = await call(server, "POST", "/v1/audio/transcriptions", upload, headers)
            assert response.status == 404
            assert json.loads(response.body)["error"]["type"] == "not_found_error"

    run(body())


def test_unknown_paths_answer_the_flavours_404_body() -> None:
    async def body() -> None:
        for flavour, expected in (
            ("vllm", {"detail": "Not Found"}),
            ("sglang", {"detail": "Not Found"}),
            (
                "llamacpp",
                {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}},
            ),
        ):
            async with engine(flavour=flavour) as server:
                response = await call(server, "GET", "/nope")
                assert response.status == 404
                assert json.loads(response.body) == expected

    run(body())


def test_malformed_json_is_a_400() -> None:
    async def body() -> None:
        for flavour in ("vllm", "llamacpp", "sglang"):
            async with engine(flavour=flavour) as server:
                response = await call(server, "POST", "/v1/chat/completions", b"{not json")
                assert response.status == 400
                assert json.loads(response.body)

    run(body())


def test_models_list_model_by_id_and_tokenize() -> None:
    async def body() -> None:
        async with engine(flavour="vllm", model="org/M") as server:
            models = json.loads((await call(server, "GET", "/v1/models")).body)
            assert [m["id"] for m in models["data"]] == ["org/M"]
            one = await call(server, "GET", "/v1/models/org/M")
            assert json.loads(one.body)["id"] == "org/M"
            assert (await call(server, "GET", "/v1/models/other")).status == 404
            tokens = json.loads((await call(server, "POST", "/tokenize", {"prompt": "a b c"})).body)
            assert tokens["count"] == 3

    run(body())


def test_vllm_sleep_endpoints_toggle_is_sleeping() -> None:
    async def body() -> None:
        async with engine(flavour="vllm") as server:
            assert json.loads((await call(server, "GET", "/is_sleeping")).body) == {
                "is_sleeping": False
            }
            assert (await call(server, "POST", "/sleep?level=1")).status == 200
            assert json.loads((await call(server, "GET", "/is_sleeping")).body) == {
                "is_sleeping": True
            }
            assert (await call(server, "POST", "/v1/chat/completions", CHAT)).status == 503
            assert (await call(server, "POST", "/wake_up")).status == 200
            assert json.loads((await call(server, "GET", "/is_sleeping")).body) == {
                "is_sleeping": False
            }
        async with engine(flavour="sglang") as server:
            assert (await call(server, "GET", "/is_sleeping")).status == 404

    run(body())


def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    async def body() -> None:
        async with engine(flavour="vllm") as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
            writer.write(request + request)
            await writer.drain()
            data = b""

            async def both() -> bytes | None:
                nonlocal data
                data += await reader.read(65536)
                return data if data.count(b"HTTP/1.1 200 OK") == 2 else None

            await eventually(both)
            assert server.statistics().connections == 1
            writer.close()

    run(body())


async def read_until_eof(port: int, request: bytes, timeout_s: float = 10.0) -> bytes:
    """Send raw bytes, then read until the peer closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        chunks = []
        async with asyncio.timeout(timeout_s):
            while data := await reader.read(65536):
                chunks.append(data)
        return b"".join(chunks)
    finally:
        writer.close()


def raw_post(path: str, body: dict[str, Any]) -> bytes:
    """A raw HTTP/1.1 POST with a JSON body."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(data)}\r\n\r\n"
    return head.encode() + data


def test_crash_after_cuts_the_nth_stream_and_stops_listening() -> None:
    async def body() -> None:
        server = await serve(SimOptions(flavour="vllm", model="m", crash_after=2, tokens=8))
        first = await call(server, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
        assert first.body.endswith(b"data: [DONE]\n\n")
        raw = await read_until_eof(
            server.port, raw_post("/v1/chat/completions", {**CHAT, "stream": True})
        )
        assert b"HTTP/1.1 200 OK" in raw
        assert b"chat.completion.chunk" in raw
        assert b"[DONE]" not in raw
        assert not raw.endswith(b"0\r\n\r\n")  # no end of the chunked body
        assert await asyncio.wait_for(server.wait_done(), 5) == 1
        assert server.phase is Phase.CRASHED
        assert await status_or_none(server.port) is None

    run(body())


def test_crash_after_cuts_a_non_streaming_body_in_the_middle() -> None:
    async def body() -> None:
        server = await serve(SimOptions(flavour="sglang", model="m", crash_after=1))
        raw = await read_until_eof(server.port, raw_post("/v1/chat/completions", CHAT))
        head, _, partial = raw.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        assert 0 < len(partial) < length
        assert await asyncio.wait_for(server.wait_done(), 5) == 1

    run(body())


def test_close_drops_open_streams_promptly() -> None:
    async def body() -> None:
        server = await serve(SimOptions(model="m", token_delay_s=1.0, tokens=100))
        task = asyncio.create_task(call(server, "POST", "/v1/completions", {"prompt": "x"}))

        async def running() -> bool | None:
            return True if server.statistics().running == 1 else None

        await eventually(running)
        await asyncio.wait_for(server.close(), 2)
        assert await asyncio.wait_for(server.wait_done(), 1) == 0
        with pytest.raises(client.HttpClientError):
            await task

    run(body())


def test_parse_args_maps_every_flag() -> None:
    opts = parse_args(
        [
            "--flavour", "sglang", "--model", "x", "--port", "0", "--startup-delay", "2",
            "--fail-at-start", "bad", "--crash-after", "3", "--token-delay", "0.1",
            "--tokens", "5", "--max-running", "2", "--no-audio", "--no-embeddings",
            "--enable-metrics", "--tp-size", "2", "--data-parallel-size", "3",
            "--warmup-delay", "0.5",
        ]
    )  # fmt: skip
    assert opts == SimOptions(
        flavour="sglang",
        model="x",
        port=0,
        startup_delay_s=2.0,
        fail_at_start="bad",
        crash_after=3,
        token_delay_s=0.1,
        tokens=5,
        max_running=2,
        audio=False,
        embeddings=False,
        metrics=True,
        tp_size=2,
        data_parallel_size=3,
        warmup_delay_s=0.5,
        log_milestones=True,
    )


# --------------------------------------------------------------------------- subprocess


@contextlib.asynccontextmanager
async def subprocess_engine(*args: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """`python -m simulations.engine ARGS --port 0`, with the port it reports it bound."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "simulations.engine",
        "--port",
        "0",
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 30)
        match = re.search(rb"bound to http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        yield proc, int(match.group(1))
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_subprocess_refuses_while_starting_and_exits_0_on_sigterm() -> None:
    async def body() -> None:
        async with subprocess_engine("--flavour", "vllm", "--startup-delay", "1") as (proc, port):
            assert await status_or_none(port) is None

            async def ready() -> int | None:
                return await status_or_none(port)

            assert await eventually(ready, 30) == 200
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 5) == 0

    run(body())


def test_subprocess_fail_at_start_prints_the_message_and_exits_1() -> None:
    async def body() -> None:
        args = ("--flavour", "sglang", "--startup-delay", "0.2", "--fail-at-start", "CUDA OOM")
        async with subprocess_engine(*args) as (proc, port):
            assert proc.stderr is not None
            rest = await asyncio.wait_for(proc.stderr.read(), 30)
            assert await asyncio.wait_for(proc.wait(), 5) == 1
            assert b"CUDA OOM" in rest
            assert await status_or_none(port) is None

    run(body())


def test_subprocess_crash_after_dies_in_the_middle_of_the_stream() -> None:
    async def body() -> None:
        async with subprocess_engine("--flavour", "llamacpp", "--crash-after", "1") as (proc, port):

            async def ready() -> int | None:
                status = await status_or_none(port)
                return status if status == 200 else None

            await eventually(ready, 30)
            raw = await read_until_eof(
                port, raw_post("/v1/completions", {"prompt": "x", "stream": True})
            )
            assert b"text_completion" in raw
            assert b"[DONE]" not in raw
            assert await asyncio.wait_for(proc.wait(), 5) == 1

    run(body())


# --- bodies that are not valid requests ----------------------------------------------------------

OK_MESSAGES = [{"role": "user", "content": "hi"}]
BAD_BODIES: list[tuple[str, bytes]] = [
    ("/v1/chat/completions", b'{"stream": true, "messages": 5}'),  # issue 47: was a dropped line
    ("/v1/chat/completions", b'{"stream": true}'),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/chat/completions", b'{"messages": [5]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("/v1/chat/completions", json.dumps({"messages": OK_MESSAGES, "max_tokens": "x"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": OK_MESSAGES, "stream": "yes"}).encode()),
    ("/v1/completions", b'{"stream": true}'),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", b'{"prompt": null}'),
    ("/v1/completions", b'{"max_tokens": -1}'),  # llama.cpp takes -1, not the missing prompt
    ("/v1/responses", b'{"stream": true}'),
    ("/v1/responses", b'{"input": 5}'),
    ("/v1/messages", b'{"max_tokens": 8, "messages": 5}'),
    ("/v1/chat/completions", b"{not json"),
]


def error_of(flavour: Flavour, body: bytes) -> str:
    """The message of an error body, after checking its shape is the flavour's: vLLM's
    `{"error": {message, type, param, code}}`, llama.cpp's `{"error": {code, message, type}}`
    (type `invalid_request_error`), SGLang's flat `{"object": "error", ...}`."""
    parsed = json.loads(body)
    if flavour == "sglang":
        assert set(parsed) == {"object", "message", "type", "param", "code"}, parsed
        assert (parsed["object"], parsed["code"]) == ("error", 400)
        return str(parsed["message"])
    assert set(parsed) == {"error"}, parsed
    error = parsed["error"]
    if flavour == "llamacpp":
        assert set(error) == {"code", "message", "type"}, error
        assert (error["code"], error["type"]) == (400, "invalid_request_error")
    else:
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == 400 and error["type"] in ("BadRequestError", "Bad Request")
    return str(error["message"])


@pytest.mark.parametrize("flavour", ["vllm", "llamacpp", "sglang"])
@pytest.mark.parametrize(("path", "body"), BAD_BODIES, ids=[b.decode() for _, b in BAD_BODIES])
def test_a_body_that_is_not_a_valid_request_is_the_flavours_400_on_a_connection_that_stays(
    flavour: Flavour, path: str, body: bytes
) -> None:
    async def main() -> None:
        async with engine(flavour=flavour) as server:
            await server.wait_ready()
            head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
            after = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            data = await read_until_eof(server.port, head.encode() + body + after)
            first, _, second = data.partition(b"HTTP/1.1 200 OK\r\n")
            assert first.startswith(b"HTTP/1.1 400 Bad Request\r\n"), data[:200]
            assert b'"object":"list"' in second  # the next request, on the same connection
            assert error_of(flavour, first.partition(b"\r\n\r\n")[2])

    run(main())


@pytest.mark.parametrize(
    ("flavour", "message"),
    [
        ("vllm", "'int' object is not iterable"),
        ("llamacpp", "Expected 'messages' to be an array"),
    ],
)
def test_messages_that_are_not_a_list_get_the_real_engines_words(
    flavour: Flavour, message: str
) -> None:
    # Both answers as the real engines gave them (vLLM 0.32 CPU, llama.cpp 0.3.36).
    async def main() -> None:
        async with engine(flavour=flavour) as server:
            await server.wait_ready()
            reply = await call(
                server, "POST", "/v1/chat/completions", {"stream": True, "messages": 5}
            )
            assert reply.status == 400
            assert error_of(flavour, reply.body) == message

    run(main())


@pytest.mark.parametrize(
    ("flavour", "body"),
    [
        ("vllm", {"messages": [{"role": "user"}]}),  # vLLM asks no content of a user message
        ("llamacpp", {"messages": OK_MESSAGES, "max_tokens": -1}),  # llama.cpp: no limit
        ("llamacpp", {"messages": OK_MESSAGES, "max_tokens": 1.5}),
        ("vllm", {"prompt": [[1, 2], [3]]}),  # token ids
        ("llamacpp", {"prompt": ["a", 5]}),  # strings and tokens mixed
    ],
)
def test_what_a_real_engine_takes_the_simulator_takes_too(
    flavour: Flavour, body: dict[str, Any]
) -> None:
    async def main() -> None:
        async with engine(flavour=flavour, tokens=3) as server:
            await server.wait_ready()
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            reply = await call(server, "POST", path, body)
            assert reply.status == 200, reply.body

    run(main())
