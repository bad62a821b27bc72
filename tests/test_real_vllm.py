"""A real vLLM (the CPU build, Gemma 3 270M) through a real `dgxmm serve` and a real LiteLLM.

A vLLM cold start takes one and a half to several minutes on these machines, so the tests
share starts: one `dgxmm serve` (process runtime) and one LiteLLM for the whole module
(tests/vllm_support.py), and the tests run in this order, each leaving the state the next
one starts from:

1. cold start #1, through LiteLLM: a plain request is held through the whole start, a
   streaming one arrives during it and joins it;
2. vLLM ready: relayed answers equal direct ones, for every endpoint it serves; streamed and
   plain requests back to back and across keep-alive gaps, straight and through LiteLLM,
   all answered;
3. vLLM ready: a request for `small` (which does not fit beside it) is queued; a long direct
   call to vLLM's port keeps it awake past its idle timeout; when it ends, vLLM is put to
   sleep and `small` served;
4. cold start #2, queued behind `small`: structured output comes unchanged, without the
   queued line that a plain request waiting beside it gets;
5. vLLM ready: SIGKILL mid-stream ends the stream with the error event and [DONE];
6. cold start #3: with the queue limit below the start, the seed's 503 comes at the limit;
7. a `--enable-sleep-mode` deployment fails to start with vLLM's own reason, then backs off.

Requests go through the gateway's real socket (the byte-for-byte comparisons must see what
the engine sent, which LiteLLM would rewrite) or through LiteLLM where the issue says so.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.cold_start_support import assert_adds_up, replay_wait
from tests.keepalive_support import Pooled, fresh, series
from tests.litellm_support import Response
from tests.real_engine_support import (
    PROMPT,
    SseStream,
    call,
    chat_body,
    data_of,
    poll,
    stream_text,
)
from tests.vllm_support import (
    COLD_S,
    VLLM_ARGS,
    VLLM_GIB,
    VllmStack,
    comparable,
    sse_events,
    stream_shape,
    vllm_serving,
)

pytestmark = [pytest.mark.vllm, pytest.mark.litellm, pytest.mark.timeout(900)]

QUEUED = "⏳ Your message is queued — waiting for memory to free up for {model}."
SHORT = 8  # tokens per answer where only the format matters (vLLM makes 5-6 a second here)
# A schema whose grammar leaves no room for whitespace: with an object, xgrammar allows any
# whitespace between its tokens, and a base model fills max_tokens with newlines.
SCHEMA = {"type": "string", "enum": ["yes", "no"]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmStack]:
    """DGXMM with `vllm` and `small` asleep, LiteLLM in front; shared by the whole module."""
    with vllm_serving(tmp_path_factory.mktemp("real-vllm")) as started:
        yield started


def chat(model: str, *, stream: bool, max_tokens: int = SHORT, **extra: Any) -> dict[str, Any]:
    """A deterministic chat completion request (temperature 0, fixed seed), short."""
    return chat_body(model, stream=stream, max_tokens=max_tokens, **extra)


def ensure_ready(stack: VllmStack) -> None:
    """Start `vllm` when an earlier test left it asleep (each test can run alone)."""
    serve = stack.serve
    if serve.state("vllm") != "ready":
        serve.api("POST", f"/deployments/{serve.deployments['vllm']}/start", {})
        serve.wait_state("vllm", "ready", timeout_s=COLD_S)


class InThread:
    """A blocking call run in a thread; `result()` waits for it with a deadline."""

    def __init__(self, fn: Callable[[], Response]) -> None:
        self._answer: list[Response] = []
        self._error: list[BaseException] = []
        self.ended = 0.0

        def run() -> None:
            try:
                self._answer.append(fn())
            except BaseException as exc:  # shown by result()
                self._error.append(exc)
            self.ended = time.monotonic()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout_s: float = COLD_S) -> Response:
        """The answer (fails the test if the call raised or did not end in time)."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the call did not end within {timeout_s:.0f} s"
        if self._error:
            raise self._error[0]
        return self._answer[0]


def litellm_lines(stack: VllmStack, since: int) -> list[str]:
    """LiteLLM's log lines after the first `since`."""
    return stack.litellm_log().splitlines()[since:]


def assert_no_litellm_retry(lines: list[str], requests: int) -> None:
    """LiteLLM answered `requests` chat completions, each once: no timeout, no retry."""
    suspicious = [line for line in lines if re.search(r"retr|timeout|timed out", line, re.I)]
    assert not suspicious, suspicious
    answered = [line for line in lines if '"POST /v1/chat/completions HTTP/1.1" 200' in line]
    assert len(answered) == requests, lines


def outcome_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How the queue's outcome counters moved (only those that did)."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def message_text(answer: dict[str, Any]) -> str:
    """The message text of a chat completion."""
    return str(answer["choices"][0]["message"]["content"] or "")


# --- 1. cold start #1 through LiteLLM -----------------------------------------------------------


def test_a_cold_request_through_litellm_is_held_through_the_whole_start_and_a_second_joins_it(
    stack: VllmStack,
) -> None:
    serve, proxy = stack.serve, stack.proxy
    assert proxy is not None and serve.state("vllm") == "stopped"
    before, log_at = serve.queue_outcomes(), len(stack.litellm_log().splitlines())

    sent = time.monotonic()
    plain = InThread(lambda: stack.via_litellm(chat("vllm", stream=False)))
    serve.wait_state("vllm", "starting", timeout_s=60)
    streamed = InThread(lambda: stack.via_litellm(chat("vllm", stream=True)))
    plain_answer, stream_answer = plain.result(), streamed.result()

    assert plain_answer.status == 200, plain_answer.body
    answer = plain_answer.json()
    assert answer["usage"]["completion_tokens"] > 0
    assert message_text(answer).strip()
    assert QUEUED.format(model="vllm") not in message_text(answer)  # it waited for a start only

    assert stream_answer.status == 200, stream_answer.body
    events = [data for _, data in sse_events(stream_answer.body)]
    assert events[-1] == "[DONE]"
    text = "".join(
        (c.get("delta") or {}).get("content") or ""
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
    )
    assert text.strip() and QUEUED.format(model="vllm") not in text

    # One real start, minutes long, held through; both requests waited for it and were served.
    started = [e for e in serve.events("vllm") if e["type"] == "EngineStarting"]
    ready = [e for e in serve.events("vllm") if e["type"] == "EngineReady"]
    assert len(started) == len(ready) == 1
    assert float(ready[0]["ts"]) - float(started[0]["ts"]) > 30.0
    assert min(plain.ended, streamed.ended) - sent > 30.0
    assert outcome_delta(before, serve.queue_outcomes()) == {"served": 2}
    assert_no_litellm_retry(litellm_lines(stack, log_at), requests=2)

    # Where the start's time went: `dgxmm replay --request` of each waited request names
    # every phase, vLLM's own loading milestones among them, and they add up to its wait.
    dep = serve.deployments["vllm"]

    def first_bytes() -> list[dict[str, Any]]:
        return [e for e in serve.events() if e["type"] == "FirstByteRelayed"
                and e["data"]["deployment_id"] == dep]  # fmt: skip

    poll(lambda: len(first_bytes()) == 2, "both first bytes to be recorded")
    waits = []
    for event in first_bytes():
        wait, text = replay_wait(serve.db, event["data"]["request_id"])
        names = [p["name"] for p in wait["phases"]]
        assert names[-2:] == ["ready", "first_byte"], names
        assert {"loading_weights", "engine_init"} & set(names), names  # vLLM's milestones
        assert_adds_up(wait)
        for name in names:
            assert f"    {name} " in text, text
        waits.append(wait)
    # The first request saw the whole start from its launch; the one that joined it later
    # sees the phases from its arrival on.
    first = max(waits, key=lambda w: w["wait_s"])
    assert "launch" in [p["name"] for p in first["phases"]], first


# --- 2. byte for byte ----------------------------------------------------------------------------


def _requests(model: str) -> list[tuple[str, dict[str, Any]]]:
    completion = {"model": model, "prompt": "One, two, three,", "max_tokens": SHORT}
    responses = {"model": model, "input": PROMPT, "max_output_tokens": SHORT}
    messages = {
        "model": model,
        "max_tokens": SHORT,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    greedy = {"temperature": 0, "seed": 42}
    cases = []
    for stream in (False, True):
        cases += [
            ("chat/completions", chat(model, stream=stream)),
            ("completions", {**completion, **greedy, "stream": stream}),
            ("responses", {**responses, "temperature": 0, "stream": stream}),
            ("messages", {**messages, "temperature": 0, "stream": stream}),
        ]
    return cases


@pytest.mark.parametrize("case", range(8))
def test_relayed_answers_equal_direct_ones_for_every_endpoint_vllm_serves(
    stack: VllmStack, case: int
) -> None:
    serve = stack.serve
    ensure_ready(stack)
    endpoint, body = _requests(stack.model)[case]
    relayed = call(
        serve.gateway_port,
        "POST",
        serve.gateway_path("vllm", endpoint),
        body,
        serve.gateway_auth,
    )
    direct = call(serve.engine_port("vllm"), "POST", f"/v1/{endpoint}", body)
    assert relayed.status == direct.status, (relayed.body, direct.body)
    if direct.status == 404:  # an endpoint this vLLM does not serve: relayed as it is
        assert relayed.body == direct.body
        return
    assert direct.status == 200, direct.body
    if body["stream"]:
        got, want = sse_events(relayed.body), sse_events(direct.body)
        assert len(want) > 3
        assert stream_shape(got) == stream_shape(want)
    else:
        assert comparable(relayed.json()) == comparable(direct.json())
        assert "usage" in direct.json()


def test_streamed_and_plain_requests_back_to_back_and_across_keep_alive_gaps_all_answer(
    stack: VllmStack, tried: Callable[[str], None]
) -> None:
    """Issue 43 on vLLM (uvicorn keeps a connection 5 s idle, streams included): fewer
    requests than on llama.cpp (tests/test_keepalive_real.py), its tokens are slow."""
    serve = stack.serve
    proxy = stack.proxy
    assert proxy is not None
    ensure_ready(stack)
    port, path, auth = serve.gateway_port, serve.gateway_path("vllm"), serve.gateway_auth
    direct = series(
        lambda stream: fresh(port, path, chat(stack.model, stream=stream, max_tokens=2), auth),
        back_to_back=10,
    )
    client = Pooled(proxy.port)
    try:
        through = series(
            lambda stream: client.send(
                "/v1/chat/completions", chat("vllm", stream=stream, max_tokens=2), proxy.auth
            ),
            back_to_back=10,
            gaps=(0.1, 5.1),
        )
    finally:
        client.close()
    tried(direct.line("vLLM straight to the gateway, a new connection each"))
    tried(through.line("vLLM through LiteLLM, one kept-alive client without retries"))
    assert direct.failed == [] and through.failed == []


# --- 3. queue and real idleness ------------------------------------------------------------------


def test_a_direct_call_keeps_vllm_awake_past_its_idle_timeout_while_small_is_queued_then_it_sleeps(
    stack: VllmStack,
) -> None:
    serve = stack.serve
    ensure_ready(stack)
    used = call(
        serve.gateway_port,
        "POST",
        serve.gateway_path("vllm"),
        chat(stack.model, stream=False),
        serve.gateway_auth,
    )
    assert used.status == 200, used.body
    last_use = time.monotonic()
    before, log_at = serve.queue_outcomes(), len(stack.litellm_log().splitlines())

    queued = InThread(lambda: stack.via_litellm(chat("small", stream=True, max_tokens=16)))
    poll(lambda: queued_for(stack, "small"), "the request for small to be queued")
    assert serve.state("small") == "stopped"

    # vLLM's idle timer runs out 60 s after its last use.  A direct call to its port (not
    # through the gateway) from 10 s before until 8 s after that keeps it awake: its real
    # vllm:num_requests_running says it is busy.
    wait_until(last_use + 50)
    direct = SseStream(
        serve.engine_port("vllm"),
        "/v1/chat/completions",
        chat(stack.model, stream=True, max_tokens=600, ignore_eos=True),
    )
    assert direct.next_event() is not None
    wait_until(last_use + 68, keep_reading=direct)
    assert serve.state("vllm") == "ready"
    assert not [t for t in event_titles(stack, "vllm") if t.startswith("Put to sleep")]
    direct.close()  # vLLM aborts a request whose client hung up
    ended = time.monotonic()

    answer = queued.result()
    assert queued.ended > ended
    assert answer.status == 200, answer.body
    events = [data for _, data in sse_events(answer.body)]
    text = "".join(
        (c.get("delta") or {}).get("content") or ""
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
    )
    assert text.startswith(QUEUED.format(model="small")), text
    assert text.removeprefix(QUEUED.format(model="small")).strip()  # then the real answer
    assert serve.state("vllm") == "stopped"
    assert serve.state("small") == "ready"
    assert "Put to sleep to make room for small" in event_titles(stack, "vllm")
    assert outcome_delta(before, serve.queue_outcomes()) == {"admitted": 1, "served": 1}
    assert_no_litellm_retry(litellm_lines(stack, log_at), requests=1)


# --- 4. cold start #2: structured output ----------------------------------------------------------


def test_structured_output_queued_through_a_real_start_is_the_engines_answer_without_the_line(
    stack: VllmStack,
) -> None:
    serve = stack.serve
    assert serve.state("small") == "ready" and serve.state("vllm") == "stopped"
    path = serve.gateway_path("vllm")
    schema = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": SCHEMA}}
    structured = chat(stack.model, stream=False, max_tokens=24, response_format=schema)
    plain = InThread(
        lambda: call(
            serve.gateway_port,
            "POST",
            path,
            chat(stack.model, stream=False),
            serve.gateway_auth,
            timeout_s=COLD_S,
        )
    )
    poll(lambda: queued_for(stack, "vllm", kind="queued"), "the plain request to be queued")
    shaped = InThread(
        lambda: call(serve.gateway_port, "POST", path, structured, serve.gateway_auth, COLD_S)
    )
    shaped_stream = InThread(
        lambda: call(
            serve.gateway_port,
            "POST",
            path,
            {**structured, "stream": True},
            serve.gateway_auth,
            timeout_s=COLD_S,
        )
    )
    plain_answer = plain.result()
    assert plain_answer.status == 200, plain_answer.body
    assert message_text(plain_answer.json()).startswith(QUEUED.format(model="vllm"))

    answer = shaped.result()
    assert answer.status == 200, answer.body
    content = message_text(answer.json())
    assert "⏳" not in content
    assert json.loads(content) in ("yes", "no")
    direct = call(serve.engine_port("vllm"), "POST", "/v1/chat/completions", structured)
    assert comparable(answer.json()) == comparable(direct.json())

    streamed = shaped_stream.result()
    assert streamed.status == 200, streamed.body
    assert "⏳" not in streamed.body.decode()
    events = sse_events(streamed.body)
    assert events[-1][1] == "[DONE]"
    text = stream_text([f"data: {json.dumps(d)}" for _, d in events if isinstance(d, dict)])
    assert json.loads(text) in ("yes", "no")


# --- 5. faults ------------------------------------------------------------------------------------


def test_sigkill_of_vllm_mid_stream_ends_the_stream_with_the_error_event_and_done(
    stack: VllmStack,
) -> None:
    serve = stack.serve
    ensure_ready(stack)
    # Looked up first: `dgxmm events` reads the whole log, which on a loaded machine took
    # longer than the 600 tokens, so the kill came after a complete answer.
    runtime_id = serve.engine_runtime_id("vllm")
    stream = SseStream(
        serve.gateway_port,
        serve.gateway_path("vllm"),
        chat(stack.model, stream=True, max_tokens=600, ignore_eos=True),
        headers=serve.gateway_auth,
    )
    for _ in range(3):
        assert stream.next_event() is not None
    serve.kill_engine("vllm", runtime_id)
    rest = stream.rest()
    assert data_of(rest[-1]) == "[DONE]", rest[-3:]
    assert '"finish_reason":"length"' not in "".join(rest).replace(" ", ""), "not cut"
    error = json.loads(data_of(rest[-2]))
    assert "error" in error and error["error"]["message"], rest[-4:]
    serve.wait_state("vllm", "stopped", "failed", timeout_s=120)


# --- 6. cold start #3: the queue limit -----------------------------------------------------------


def test_a_queue_limit_below_the_real_cold_start_gives_the_seeds_503_at_the_limit_not_before(
    stack: VllmStack,
) -> None:
    serve = stack.serve
    limit = 30
    if serve.state("small") != "stopped":
        serve.stop("small")
    serve.wait_state("vllm", "stopped", "failed", timeout_s=120)
    serve.settings(ondemand_queue_timeout_s=limit)
    try:
        sent = time.monotonic()
        answer = call(
            serve.gateway_port,
            "POST",
            serve.gateway_path("vllm"),
            chat(stack.model, stream=False),
            serve.gateway_auth,
            timeout_s=COLD_S,
        )
        took = time.monotonic() - sent
    finally:
        serve.settings(ondemand_queue_timeout_s=900)
    assert answer.status == 503, answer.body
    assert answer.headers.get("retry-after") == "60"
    assert answer.json() == {
        "error": {
            "message": "model vllm is busy; try again later",
            "type": "server_error",
            "code": "ondemand_queue_timeout",
        }
    }
    assert limit - 0.5 <= took <= limit + 5.0, took
    assert serve.state("vllm") == "starting"  # a start that has begun goes on
    serve.stop("vllm")


# --- 7. sleep mode on CPU -------------------------------------------------------------------------


def test_a_sleep_mode_deployment_fails_its_start_with_vllms_reason_then_backs_off(
    stack: VllmStack,
) -> None:
    serve = stack.serve
    for name in ("vllm", "small"):
        if serve.state(name) not in ("stopped", "failed"):
            serve.stop(name)
    serve.create("sleepy", "vllm", stack.model, VLLM_GIB, [*VLLM_ARGS, "--enable-sleep-mode"])
    path = serve.gateway_path("sleepy")
    waited = call(
        serve.gateway_port,
        "POST",
        path,
        chat(stack.model, stream=False),
        serve.gateway_auth,
        timeout_s=COLD_S,
    )
    assert waited.status == 503, waited.body
    error = waited.json()["error"]
    assert error["code"] == "start_failed"
    assert error["message"].startswith("sleepy could not start: ")
    assert "Sleep mode is not supported on current platform" in error["message"]
    failed = serve.wait_state("sleepy", "failed", "stopped", timeout_s=60)
    assert "Sleep mode is not supported on current platform" in str(failed["last_error"])

    # For 60 s no new start: a request is refused at once with the same reason.
    sent = time.monotonic()
    again = call(
        serve.gateway_port,
        "POST",
        path,
        chat(stack.model, stream=False),
        serve.gateway_auth,
        timeout_s=60,
    )
    assert time.monotonic() - sent < 5.0
    assert again.status == 503 and again.json()["error"]["code"] == "start_failed"
    assert len([e for e in serve.events("sleepy") if e["type"] == "EngineStarting"]) == 1


# --- helpers ------------------------------------------------------------------------------------


def queued_for(stack: VllmStack, name: str, kind: str = "queued") -> bool:
    """Whether a request for `name` waits in the queue (`queued`: for memory; `waiting_start`:
    for its start); the queue's events live in its own stream."""
    dep_id = stack.serve.deployments[name]
    return any(
        e["type"] == "RequestQueued"
        and e["data"].get("deployment_id") == dep_id
        and e["data"].get("kind") == kind
        for e in stack.serve.events()
    )


def event_titles(stack: VllmStack, name: str) -> list[str]:
    """The deployment's Events tab titles, from the admin API."""
    serve = stack.serve
    got = serve.api("GET", f"/deployments/{serve.deployments[name]}/events")
    rows = got.get("events", got) if isinstance(got, dict) else got
    return [str(row["title"]) for row in rows]


def wait_until(moment: float, keep_reading: SseStream | None = None) -> None:
    """Let real time pass until `moment` (the behaviour under test is a timeout), reading a
    stream meanwhile if given so that the engine never blocks on a full socket."""
    if keep_reading is None:
        threading.Event().wait(max(0.0, moment - time.monotonic()))
        return
    while time.monotonic() < moment:
        assert keep_reading.next_event() is not None, "the direct call ended early"
