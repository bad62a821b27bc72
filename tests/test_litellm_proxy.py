"""A real LiteLLM proxy (pinned, started once for this module) in front of what DGXMM registers.

The always-on entry points at the simulated engine; the on-demand entry points at a recording
upstream that stands where the gateway will be (`/d/<id>/v1`), so the tests can assert on what
LiteLLM really sends.  The config file is written by `ConfigFileSync`, and LiteLLM runs with
`--reload`, so the last test switches a deployment's mode through the file.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from actors.errors import SyncFailed
from actors.ports import ModelEntry
from dgxmm.litellm.entries import READY, Registration, desired_entries
from dgxmm.litellm.filesync import ConfigFileSync
from dgxmm.litellm.sync import ApiSync
from tests.litellm_support import (
    LiteLLMProxy,
    RecordingUpstream,
    Reply,
    SimEngineProcess,
    chat_chunk,
    http_request,
    litellm_proxy_factory,
    recording_upstream,
    sse_data,
)

pytestmark = pytest.mark.litellm

__all__ = ["litellm_proxy_factory", "recording_upstream"]  # fixtures used by this module

SERVED = "org/sim-model"  # a served name with a slash: LiteLLM must strip only `openai/`
ENGINE_MODEL = "sim-chat"  # always on, straight to the engine
ON_DEMAND_MODEL = "ondemand-chat"  # through the (stand-in) gateway
SWITCH_MODEL = "switch-chat"  # switched from on demand to always on in the last test
HEALTH_HEADER = "x-dgxmm-health-check"
QUEUED = (
    "⏳ Your message is queued — waiting for memory to free up for ondemand-chat. "
    "It will start automatically.\n\n"
)


def wanted_entries(engine_url: str, gateway_url: str, switch_mode: str) -> list[ModelEntry]:
    """The three deployments, with the switchable one in `switch_mode`."""

    def reg(dep: str, name: str, mode: str) -> Registration:
        return Registration(
            deployment_id=dep,
            model_name=name,
            served_model=SERVED,
            mode=mode,  # type: ignore[arg-type]
            state=READY,
            engine_url=engine_url,
        )

    regs = [
        reg("eng1", ENGINE_MODEL, "always_on"),
        reg("gw1", ON_DEMAND_MODEL, "on_demand"),
        reg("sw1", SWITCH_MODEL, switch_mode),
    ]
    return desired_entries(regs, gateway_url, 900)


@dataclass
class Stack:
    """Everything the tests talk to."""

    proxy: LiteLLMProxy
    engine: SimEngineProcess
    gateway: RecordingUpstream
    config_path: Path

    def entries(self, switch_mode: str = "on_demand") -> list[ModelEntry]:
        """What DGXMM wants in LiteLLM; the stand-in gateway is the recording upstream."""
        return wanted_entries(self.engine.url, self.gateway.url, switch_mode)

    def file_sync(self) -> ConfigFileSync:
        """A ConfigFileSync for this proxy's config file."""
        return ConfigFileSync(self.config_path, self.proxy.url, self.proxy.master_key)

    def chat(self, model: str, stream: bool = False, text: str = "hi") -> Any:
        """A chat completion through LiteLLM."""
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
        if stream:
            body["stream"] = True
        return http_request(self.proxy.url, "POST", "/v1/chat/completions", body, self.proxy.auth)


async def write_then_wait(
    sync: ConfigFileSync, entries: list[ModelEntry], timeout_s: float | None
) -> None:
    """Write the file; then (unless `timeout_s` is None) wait until LiteLLM has loaded it."""
    try:
        await sync.sync(entries)
        if timeout_s is not None:
            await sync.wait_until_loaded(timeout_s)
    finally:
        await sync.close()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    litellm_proxy_factory: Callable[[Path], LiteLLMProxy],
    recording_upstream: RecordingUpstream,
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("litellm-config")
    engine = SimEngineProcess(SERVED, workdir=workdir).start()
    config_path = workdir / "litellm.json"
    try:
        # The file is written before LiteLLM starts, so the one start serves it at once.
        writer = ConfigFileSync(config_path, "http://127.0.0.1:1", "unused")
        initial = wanted_entries(engine.url, recording_upstream.url, "on_demand")
        asyncio.run(write_then_wait(writer, initial, None))
        proxy = litellm_proxy_factory(config_path)
        yield Stack(proxy, engine, recording_upstream, config_path)
    finally:
        engine.stop()


@pytest.fixture
def gateway(stack: Stack) -> RecordingUpstream:
    """The stand-in gateway, with nothing recorded yet."""
    stack.gateway.clear()
    return stack.gateway


def direct_chat(stack: Stack, stream: bool = False) -> Any:
    body: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        body["stream"] = True
    return http_request(stack.engine.url, "POST", "/v1/chat/completions", body)


def stream_text(body: bytes) -> str:
    text = ""
    for payload in sse_data(body):
        if payload != "[DONE]":
            for choice in json.loads(payload).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


def test_a_chat_completion_reaches_the_engine_and_comes_back_under_the_client_name(
    stack: Stack,
) -> None:
    answer = stack.chat(ENGINE_MODEL)
    assert answer.status == 200, answer.body
    direct = direct_chat(stack).json()
    assert answer.json()["model"] == ENGINE_MODEL
    content = answer.json()["choices"][0]["message"]["content"]
    assert content == direct["choices"][0]["message"]["content"]


def test_a_streamed_chat_completion_arrives_whole_and_ends_with_done(stack: Stack) -> None:
    answer = stack.chat(ENGINE_MODEL, stream=True)
    assert answer.status == 200, answer.body
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert sse_data(answer.body)[-1] == "[DONE]"
    assert stream_text(answer.body) == stream_text(direct_chat(stack, stream=True).body)


def test_litellm_sends_the_served_name_and_the_entry_timeout_to_the_gateway(
    stack: Stack, gateway: RecordingUpstream
) -> None:
    assert stack.chat(ON_DEMAND_MODEL).status == 200
    assert stack.chat(ON_DEMAND_MODEL, stream=True).status == 200
    plain, streamed = gateway.requests("/d/gw1/v1/chat/completions")
    assert plain.body["model"] == SERVED
    # The openai client's read timeout is the entry's timeout / stream_timeout (1500 s).
    assert plain.headers["x-stainless-read-timeout"] == "1500.0"
    assert streamed.headers["x-stainless-read-timeout"] == "1500.0"
    assert HEALTH_HEADER not in plain.headers


def test_litellm_health_marks_its_probe_to_a_gateway_entry(
    stack: Stack, gateway: RecordingUpstream
) -> None:
    answer = http_request(
        stack.proxy.url, path=f"/health?model={ON_DEMAND_MODEL}", headers=stack.proxy.auth
    )
    assert answer.status == 200, answer.body
    assert answer.json()["healthy_count"] == 1
    [probe] = gateway.requests("/d/gw1/v1/chat/completions")
    assert probe.headers[HEALTH_HEADER] == "1"
    assert probe.body["max_tokens"] == 16


def test_litellm_health_does_not_mark_its_probe_to_an_engine_entry(stack: Stack) -> None:
    answer = http_request(
        stack.proxy.url, path=f"/health?model={ENGINE_MODEL}", headers=stack.proxy.auth
    )
    assert answer.status == 200, answer.body
    assert answer.json()["healthy_count"] == 1
    # The simulated engine answered a real completion (the gateway would answer a marked one).
    assert answer.json()["healthy_endpoints"][0]["model_id"] == "dgxmm-eng1"


def test_an_anthropic_messages_request_reaches_the_gateway_as_a_responses_request(
    stack: Stack, gateway: RecordingUpstream
) -> None:
    body = {
        "model": ON_DEMAND_MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    answer = http_request(stack.proxy.url, "POST", "/v1/messages", body, stack.proxy.auth)
    assert answer.status == 200, answer.body
    assert answer.json()["type"] == "message"
    assert answer.json()["content"][0]["text"] == "hello from upstream"
    [request] = gateway.requests()
    assert request.path == "/d/gw1/v1/responses"
    assert request.body["model"] == SERVED
    assert request.body["max_output_tokens"] == 64


def test_a_streamed_anthropic_messages_request_is_answered_from_the_engines_responses_stream(
    stack: Stack,
) -> None:
    body = {
        "model": ENGINE_MODEL,
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    answer = http_request(stack.proxy.url, "POST", "/v1/messages", body, stack.proxy.auth)
    assert answer.status == 200, answer.body
    events = [json.loads(p) for p in sse_data(answer.body) if p != "[DONE]"]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text.strip()


def test_a_gateway_503_reaches_the_client_with_its_message_and_is_not_retried(
    stack: Stack, gateway: RecordingUpstream
) -> None:
    error = {
        "error": {
            "message": "model ondemand-chat is busy; try again later",
            "type": "server_error",
            "code": "ondemand_queue_timeout",
        }
    }
    gateway.fail_next("/chat/completions", Reply(503, error, {"Retry-After": "60"}), times=3)
    started = time.monotonic()
    answer = stack.chat(ON_DEMAND_MODEL)
    elapsed = time.monotonic() - started
    assert answer.status == 503
    message = answer.json()["error"]["message"]
    assert "model ondemand-chat is busy; try again later" in message
    assert answer.json()["error"]["code"] == "503"
    assert "retry-after" not in answer.headers
    assert answer.headers["llm_provider-retry-after"] == "60"
    assert len(gateway.requests("/chat/completions")) == 1
    assert elapsed < 30  # a retry would have waited the 60 s of Retry-After


def test_a_stream_that_fails_after_the_queued_chunk_ends_with_litellms_error_and_no_done(
    stack: Stack, gateway: RecordingUpstream
) -> None:
    queued = json.dumps(chat_chunk(SERVED, QUEUED, role=True))
    error = json.dumps(
        {
            "error": {
                "message": "model ondemand-chat is busy; try again later",
                "type": "server_error",
                "code": "ondemand_queue_timeout",
            }
        }
    )
    gateway.fail_next("/chat/completions", Reply(200, sse=(queued, error, "[DONE]")))
    answer = stack.chat(ON_DEMAND_MODEL, stream=True)
    assert answer.status == 200
    payloads = sse_data(answer.body)
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == QUEUED
    assert "[DONE]" not in payloads
    final = json.loads(payloads[-1])
    assert "model ondemand-chat is busy; try again later" in final["error"]["message"]
    assert len(gateway.requests("/chat/completions")) == 1


def test_api_sync_finds_nothing_to_change_when_litellm_serves_the_entries(stack: Stack) -> None:
    # The same comparison ConfigFileSync waits on: LiteLLM's /model/info must match what we wrote.
    sync = ApiSync(stack.proxy.url, stack.proxy.master_key)
    asyncio.run(sync.sync(stack.entries()))
    assert sync.status().ok


def test_api_sync_against_litellm_without_a_database_says_what_is_missing(stack: Stack) -> None:
    sync = ApiSync(stack.proxy.url, stack.proxy.master_key)
    extra = desired_entries(
        [
            Registration(
                deployment_id="new1",
                model_name="new",
                served_model=SERVED,
                mode="on_demand",
                state=READY,
            )
        ],
        stack.gateway.url,
        900,
    )
    with pytest.raises(SyncFailed, match=r"No DB Connected.*file back-end"):
        asyncio.run(sync.sync(stack.entries() + extra))


def test_a_wrong_master_key_is_reported_as_such(stack: Stack) -> None:
    sync = ConfigFileSync(stack.config_path, stack.proxy.url, "sk-not-the-master-key")
    with pytest.raises(SyncFailed, match="refused the master key"):
        asyncio.run(write_then_wait(sync, stack.entries(), 10.0))
    assert sync.status().ok  # the file is what DGXMM wants; only the check was refused


def test_a_mode_switch_through_the_config_file_never_answers_that_the_model_is_unknown(
    stack: Stack, gateway: RecordingUpstream
) -> None:
    answers: list[int] = []
    dropped: list[str] = []  # each reload restarts LiteLLM's worker; see docs/litellm.md
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                answers.append(stack.chat(SWITCH_MODEL).status)
            except OSError as exc:
                dropped.append(type(exc).__name__)

    worker = threading.Thread(target=client)
    worker.start()
    try:
        started = time.monotonic()
        sync = stack.file_sync()
        asyncio.run(write_then_wait(sync, stack.entries(switch_mode="always_on"), 180.0))
        took = time.monotonic() - started
    finally:
        stop.set()
        worker.join(timeout=180)
    assert sync.status().ok, sync.status().error
    assert not stack.proxy.serves("dgxmm-sw1-gw")
    assert stack.proxy.serves("dgxmm-sw1")
    assert answers and set(answers) == {200}, answers
    assert gateway.requests("/d/sw1/v1/chat/completions")  # the old path served first
    after = stack.chat(SWITCH_MODEL).json()
    assert after["choices"][0]["message"]["content"] != "hello from upstream"  # now the engine
    print(f"mode switch: {took:.1f} s, {len(answers)} answered, connections dropped: {dropped}")
