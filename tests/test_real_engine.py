"""A real llama.cpp engine through a real `dgxmm serve`, on the process and Docker runtimes.

Every test starts `dgxmm serve` as a subprocess (tests/real_engine_support.py) and deploys
the Gemma 3 270M model on the `llama-server` built by scripts/build-llama-server: on the
process runtime through `[engines] programs`, on the Docker runtime in the local image
`dgxmm-llama:local` with the model bind-mounted.  Requests go through the gateway's real
socket, as LiteLLM's would (and through a real LiteLLM in the last test).

Idle timeouts cannot be shorter than 60 s, so the idle-sleep and queue behaviours share one
test per runtime: a direct call keeps the first model awake past its timeout while a second
one waits in the queue, then the first is put to sleep and the second served.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.real_engine_support import (
    READY_S,
    RuntimeKind,
    Serve,
    SseStream,
    call,
    chat_body,
    comparable,
    data_of,
    litellm_file_backed,
    models_of,
    poll,
    serving,
    stream_text,
)

pytestmark = pytest.mark.llama

QUEUED = "⏳ Your message is queued — waiting for memory to free up for {model}."
RUNTIMES = [
    pytest.param("process", id="process"),
    pytest.param("docker", id="docker", marks=pytest.mark.docker),
]


def ready_then_asleep(serve: Serve, name: str) -> None:
    """Deploy `name` on demand (it starts at once), then stop it: a sleeping model."""
    serve.deploy(name)
    serve.wait_state(name, "ready")
    serve.api("POST", f"/deployments/{serve.deployments[name]}/stop", {})
    serve.wait_state(name, "stopped")


def answer_text(answer: dict[str, Any]) -> str:
    """The message text of a chat completion."""
    return str(answer["choices"][0]["message"]["content"] or "")


def assert_real_tokens(answer: dict[str, Any], serve: Serve) -> None:
    """A chat completion the real engine generated: its model file, tokens and text."""
    assert answer["model"] == str(serve.build.model)
    assert answer["usage"]["completion_tokens"] > 0
    assert answer_text(answer).strip()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_cold_start_through_the_gateway_gives_real_tokens_and_the_engines_stream_event_for_event(
    tmp_path: Path, runtime: RuntimeKind
) -> None:
    with serving(tmp_path, runtime) as serve:
        ready_then_asleep(serve, "gemma")
        answer = serve.chat("gemma")
        assert answer.status == 200, answer.body
        assert_real_tokens(answer.json(), serve)
        assert serve.state("gemma") == "ready"

        via_gateway = SseStream(
            serve.gateway_port,
            serve.gateway_path("gemma"),
            chat_body("gemma", stream=True),
            headers=serve.gateway_auth,
        ).rest()
        direct = SseStream(
            serve.engine_port("gemma"), "/v1/chat/completions", chat_body("gemma", stream=True)
        ).rest()
        assert data_of(via_gateway[-1]) == "[DONE]"
        assert len(via_gateway) > 5
        assert [comparable(e) for e in via_gateway] == [comparable(e) for e in direct]
        assert stream_text(via_gateway) == stream_text(direct) != ""


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_direct_call_keeps_a_real_engine_awake_while_a_queued_model_waits_then_it_sleeps_for_it(
    tmp_path: Path, runtime: RuntimeKind
) -> None:
    with serving(tmp_path, runtime, total_gib=1.5) as serve:
        serve.deploy("first")
        serve.wait_state("first", "ready")
        serve.deploy("second")  # 1 + 1 GiB > 1.5: it stays stopped
        assert serve.state("second") == "stopped"
        used = serve.chat("first")
        assert used.status == 200, used.body
        last_use = time.monotonic()

        queued = SseStream(
            serve.gateway_port,
            serve.gateway_path("second"),
            chat_body("second", stream=True),
            timeout_s=240,
            headers=serve.gateway_auth,
        )
        first_event = queued.next_event()
        assert first_event is not None
        assert QUEUED.format(model="second") in stream_text([first_event])

        # The idle timer of `first` runs out 60 s after its last use.  A direct call to its
        # engine port (not through the gateway) from 10 s before until 8 s after that keeps
        # it awake: the engine's requests_processing says it is busy.
        wait_until(last_use + 50)
        direct = SseStream(
            serve.engine_port("first"),
            "/v1/chat/completions",
            chat_body("first", stream=True, max_tokens=900, ignore_eos=True),
        )
        assert direct.next_event() is not None
        wait_until(last_use + 68, keep_reading=direct)
        assert serve.state("first") == "ready"
        titles = event_titles(serve, "first")
        assert not [t for t in titles if t.startswith("Put to sleep")], titles
        direct.close()  # llama-server stops generating for a closed connection
        ended = time.monotonic()

        rest = queued.rest()
        assert time.monotonic() > ended
        assert data_of(rest[-1]) == "[DONE]"
        assert stream_text(rest).strip(), rest
        assert serve.state("first") == "stopped"
        assert serve.state("second") == "ready"
        assert "Put to sleep to make room for second" in event_titles(serve, "first")

        request_id = next(
            e["data"]["request_id"]
            for e in serve.events()
            if e["type"] == "RequestQueued"
            and e["data"]["deployment_id"] == serve.deployments["second"]
        )
        story = serve.cli("replay", "--db", str(serve.db), "--request", request_id)
        assert "queued" in story.lower(), story
        assert "make room for second" in story, story
        assert "served" in story, story


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sigkill_mid_stream_ends_the_stream_cleanly_and_the_next_request_starts_the_engine_again(
    tmp_path: Path, runtime: RuntimeKind
) -> None:
    with serving(tmp_path, runtime) as serve:
        serve.deploy("gemma")
        serve.wait_state("gemma", "ready")
        runtime_id = serve.engine_runtime_id("gemma")  # before the stream: it reads the log
        stream = SseStream(
            serve.gateway_port,
            serve.gateway_path("gemma"),
            chat_body("gemma", stream=True, max_tokens=900, ignore_eos=True),
            headers=serve.gateway_auth,
        )
        for _ in range(3):
            assert stream.next_event() is not None
        serve.kill_engine("gemma", runtime_id)
        rest = stream.rest()
        assert data_of(rest[-1]) == "[DONE]", rest[-3:]
        error = json.loads(data_of(rest[-2]))
        assert error["error"]["message"], error

        serve.wait_state("gemma", "stopped", "failed")
        answer = serve.chat("gemma")
        assert answer.status == 200, answer.body
        assert_real_tokens(answer.json(), serve)
        assert serve.state("gemma") == "ready"


@pytest.mark.litellm
@pytest.mark.timeout(600)  # LiteLLM starts in 13 s on an idle machine, minutes on a busy one
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_request_through_a_real_litellm_for_a_sleeping_real_model_gets_real_tokens(
    tmp_path: Path, runtime: RuntimeKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, litellm_config, extra = litellm_file_backed(tmp_path, monkeypatch)
    with serving(tmp_path, runtime, extra_config=extra) as serve:
        ready_then_asleep(serve, "gemma")
        poll(
            lambda: litellm_config.exists() and "gemma" in litellm_config.read_text(),
            "DGXMM to write LiteLLM's config",
        )
        proxy.start()
        try:
            poll(lambda: models_of(proxy) and "gemma" in models_of(proxy), "LiteLLM to list gemma")
            assert serve.state("gemma") == "stopped"
            answer = call(
                proxy.port,
                "POST",
                "/v1/chat/completions",
                chat_body("gemma", stream=False),
                proxy.auth,
                timeout_s=READY_S,
            )
            assert answer.status == 200, answer.body
            assert answer_text(answer.json()).strip()
            assert answer.json()["usage"]["completion_tokens"] > 0
            assert serve.state("gemma") == "ready"
        finally:
            proxy.stop()


# --- helpers ------------------------------------------------------------------------------------


def event_titles(serve: Serve, name: str) -> list[str]:
    """The deployment's Events tab titles, from the admin API."""
    got = serve.api("GET", f"/deployments/{serve.deployments[name]}/events")
    rows = got.get("events", got) if isinstance(got, dict) else got
    return [str(row["title"]) for row in rows]


def wait_until(moment: float, keep_reading: SseStream | None = None) -> None:
    """Let time pass until `moment` (time.monotonic), reading a stream meanwhile if given.

    The behaviour under test is a timeout, so the test must let real time pass; a direct
    stream is drained meanwhile so that the engine never blocks on a full socket.
    """
    if keep_reading is None:
        threading.Event().wait(max(0.0, moment - time.monotonic()))
        return
    reader: Callable[[], str | None] = keep_reading.next_event
    while time.monotonic() < moment:
        assert reader() is not None, "the direct call ended early"


def _gone(runtime_id: str, port: int) -> bool:
    """Whether the engine's process (`pid:N`) or container no longer runs: for a process, its
    port refuses connections (its sockets are closed only once its last thread exited, which
    may be after its main thread shows as a zombie)."""
    if runtime_id.startswith("pid:"):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            return True
        return False
    done = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Running}}", runtime_id],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return done.returncode != 0 or done.stdout.strip() != "true"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_idle_real_engine_killed_then_a_request_is_answered_after_one_cold_start(
    tmp_path: Path, runtime: RuntimeKind
) -> None:
    """Issue 34's acceptance with the real llama.cpp: SIGKILL the idle engine, then a
    request at once: answered with real tokens after one cold start, every round
    (`DGXMM_LOST_ROUNDS`, 3 by default; the acceptance ran 20); the log has the loss and
    the start for the request each time."""
    rounds = int(os.environ.get("DGXMM_LOST_ROUNDS", "3"))
    with serving(tmp_path, runtime) as serve:
        serve.deploy("gemma")
        serve.wait_state("gemma", "ready")
        failed, waits = [], []
        for n in range(rounds):
            serve.wait_state("gemma", "ready")
            runtime_id = serve.engine_runtime_id("gemma")
            gone = functools.partial(_gone, runtime_id, serve.engine_port("gemma"))
            serve.kill_engine("gemma", runtime_id)
            poll(gone, "the engine to be gone", 60)
            started = time.monotonic()
            answer = serve.chat("gemma")
            waits.append(time.monotonic() - started)
            if answer.status != 200:
                failed.append((n, answer.status, answer.body[:200]))
                break  # it may be stopped now: the next round would find no engine
            assert_real_tokens(answer.json(), serve)
        events = serve.events("gemma")
        lost = sum(e["type"] == "EngineLost" for e in events)
        starts = [e["data"].get("reason") for e in events if e["type"] == "StartRequested"]
        print(
            f"\n[lost] {runtime}: {rounds} rounds, {len(failed)} failed; answered after "
            + ", ".join(f"{w:.2f}" for w in waits)
            + f" s; EngineLost {lost}, starts for a request {starts.count('request')}"
        )
        assert failed == []
        assert lost == rounds and starts.count("request") == rounds
