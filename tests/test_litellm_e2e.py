"""A real LiteLLM proxy in front of a real DGXMM (issue 4's acceptance), on loopback.

DGXMM runs in-process (`App`, process runtime, simulated engines, a small memory budget so that
models compete) with the LiteLLM integration's `file` back-end; the pinned LiteLLM runs once for
the module with the config file DGXMM writes, and `--reload`.  Every request goes through
LiteLLM, as a client's would; a spy on the gateway's engine pool records what reached engines.

The deployments (12 GiB usable):

| name | mode | GiB | role in the tests |
|---|---|---|---|
| e2e-always | always on | 1 | LiteLLM's entry points at the engine |
| e2e-od | on demand | 2 | the gateway path: answers, cold start, health, Anthropic, mode switch |
| e2e-hog | on demand | 4 | a slow engine that holds memory while it answers |
| e2e-wait | on demand | 6 | does not fit while e2e-hog holds its memory: queued |
| e2e-huge | on demand | 16 | can never fit (16 > 12 - 1 always on): does_not_fit |
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from actors.controller import DeploymentRecord, DeploymentSpec
from actors.memory_broker import GIB
from dgxmm.app import App
from dgxmm.config import (
    Config,
    LiteLLMConfig,
    MemoryConfig,
    RuntimeConfig,
    ServerConfig,
)
from dgxmm.engines.runtimes.process import ProcessRuntime
from tests.litellm_support import (
    REPO,
    AppInThread,
    LiteLLMProxy,
    Response,
    free_port,
    http_request,
    require_litellm,
    sse_data,
)

pytestmark = pytest.mark.litellm

ADMIN = "admin:e2e"
ALWAYS, OD, HOG, WAIT, HUGE = "e2e-always", "e2e-od", "e2e-hog", "e2e-wait", "e2e-huge"
SPECS = (
    DeploymentSpec(
        name=ALWAYS, engine="sim", model="e2e/always-1b", memory_bytes=1 * GIB, mode="always_on"
    ),
    DeploymentSpec(
        name=OD,
        engine="sim",
        model="e2e/chat-2b",
        memory_bytes=2 * GIB,
        mode="on_demand",
        args=["--startup-delay", "1"],
    ),
    DeploymentSpec(
        name=HOG,
        engine="sim",
        model="e2e/hog-4b",
        memory_bytes=4 * GIB,
        mode="on_demand",
        args=["--token-delay", "0.25", "--tokens", "24"],  # a request holds it for 6 s
    ),
    # Created after the others: no room left, so they are created stopped.
    DeploymentSpec(
        name=WAIT,
        engine="sim",
        model="e2e/wait-6b",
        memory_bytes=6 * GIB,
        mode="on_demand",
        args=["--startup-delay", "1"],
    ),
    DeploymentSpec(
        name=HUGE, engine="sim", model="e2e/huge-16b", memory_bytes=16 * GIB, mode="on_demand"
    ),
)
TOTAL_GIB = 12.0
READY_S = 60.0  # deadline for an engine (or LiteLLM after a reload) to come up
SYNC_S = 150.0  # deadline for LiteLLM to serve what DGXMM wants (a reload can drain 30 s)


def queued_line(model: str) -> str:
    """The queued chunk's text (seed: "What callers see")."""
    return (
        f"⏳ Your message is queued — waiting for memory to free up for {model}. "
        "It will start automatically.\n\n"
    )


# --------------------------------------------------------------------------------------------
# The stack


@dataclass
class Relayed:
    """One request the gateway relayed to an engine (recorded by a spy on its pool)."""

    port: int
    method: str
    target: str
    body: bytes


@dataclass
class Stack:
    """DGXMM (in a thread), LiteLLM (a subprocess) and what the tests need to reach them."""

    dgxmm: AppInThread
    proxy: LiteLLMProxy
    config_path: Path
    ids: dict[str, str]  # deployment name -> id
    relayed: list[Relayed] = field(default_factory=list)

    # -- DGXMM's side

    @property
    def app(self) -> App:
        app: App = self.dgxmm.app
        return app

    def record(self, name: str) -> DeploymentRecord:
        """The deployment's record as the API shows it."""
        controller = self.app.controller
        assert controller is not None
        dep_id = self.ids[name]
        return self.dgxmm.read(lambda: controller.record(controller.actors[dep_id]))

    def wait_state(self, name: str, *states: str, timeout_s: float = READY_S) -> DeploymentRecord:
        """Poll until the deployment is in one of `states`."""
        deadline = time.monotonic() + timeout_s
        while (rec := self.record(name)).state not in states:
            if time.monotonic() > deadline:
                pytest.fail(f"{name} is {rec.state}, not {states}, after {timeout_s:.0f} s")
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
        return rec

    def stop(self, name: str) -> None:
        """An administrator's Stop; returns once the deployment is stopped."""
        controller = self.app.controller
        assert controller is not None
        self.dgxmm.run(controller.stop(self.ids[name], ADMIN))
        self.wait_state(name, "stopped")

    def change_mode(self, name: str, mode: str) -> DeploymentRecord:
        """PATCH .../mode, as the API calls it."""
        controller = self.app.controller
        assert controller is not None
        return self.dgxmm.run(
            controller.change_mode(self.ids[name], mode, None, True, ADMIN)  # type: ignore[arg-type]
        )

    def gateway_stats(self) -> dict[str, Any]:
        """The gateway's counters."""
        gateway = self.app.gateway
        assert gateway is not None
        return self.dgxmm.read(gateway.statistics)

    def relayed_to(self, name: str) -> list[Relayed]:
        """Requests the gateway relayed to this deployment's engine so far (any engine port)."""
        model = next(s.model for s in SPECS if s.name == name)
        items = self.dgxmm.read(lambda: list(self.relayed))
        return [r for r in items if _body_model(r.body) == model]

    def wanted_ids(self) -> dict[str, str]:
        """What DGXMM wants in LiteLLM: model_info.id -> api_base."""
        bridge = self.app.litellm
        return {e.model_id: e.api_base for e in self.dgxmm.read(bridge.entries)}

    # -- LiteLLM's side

    def served_ids(self) -> dict[str, str] | None:
        """What LiteLLM serves now (DGXMM's entries): model_info.id -> api_base; None if down."""
        try:
            answer = http_request(self.proxy.url, path="/model/info", headers=self.proxy.auth)
        except OSError:
            return None
        if answer.status != 200:
            return None
        served = {}
        for item in answer.json()["data"]:
            model_id = (item.get("model_info") or {}).get("id") or ""
            if "-dgxmm-" in model_id:
                served[model_id] = item["litellm_params"]["api_base"]
        return served

    def wait_synced(self, timeout_s: float = SYNC_S) -> dict[str, str]:
        """Poll until LiteLLM serves exactly what DGXMM wants and the last sync succeeded."""
        deadline = time.monotonic() + timeout_s
        while True:
            want = self.wanted_ids()
            status = self.dgxmm.read(self.app.litellm.status)
            if status["ok"] and self.served_ids() == want:
                return want
            if time.monotonic() > deadline:
                pytest.fail(
                    f"LiteLLM does not serve what DGXMM wants after {timeout_s:.0f} s: "
                    f"want {want}, serves {self.served_ids()}, status {status}\n"
                    f"{self.proxy.log_tail()}"
                )
            time.sleep(0.2)  # poll interval; the deadline bounds the wait

    def chat_body(self, name: str, text: str = "hi", stream: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model": name, "messages": [{"role": "user", "content": text}]}
        if stream:
            body["stream"] = True
        return body

    def chat(
        self, name: str, text: str = "hi", stream: bool = False, timeout_s: float = 120.0
    ) -> Response:
        """A chat completion through LiteLLM."""
        return http_request(
            self.proxy.url,
            "POST",
            "/v1/chat/completions",
            self.chat_body(name, text, stream),
            self.proxy.auth,
            timeout_s,
        )

    def direct_chat(self, name: str, text: str = "hi", stream: bool = False) -> Response:
        """The same chat completion straight to the engine (deterministic answers)."""
        rec = self.record(name)
        assert rec.engine_url is not None, f"{name} has no engine"
        body = self.chat_body(name, text, stream) | {"model": rec.model}
        return http_request(rec.engine_url, "POST", "/v1/chat/completions", body)


def _body_model(body: bytes) -> str | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value.get("model") if isinstance(value, dict) else None


def _install_spy(stack: Stack) -> None:
    """Record what the gateway sends to engines (wraps its engine pool's `request`)."""
    gateway = stack.app.gateway
    assert gateway is not None
    pool = gateway.upstream
    original = pool.request
    signature = inspect.signature(original)

    async def request(*args: Any, **kwargs: Any) -> Any:
        sent = signature.bind(*args, **kwargs).arguments
        stack.relayed.append(
            Relayed(
                sent["port"],
                bytes(sent["method"]).decode(),
                bytes(sent["target"]).decode(),
                bytes(sent["body"]),
            )
        )
        return await original(*args, **kwargs)

    setattr(pool, "request", request)  # noqa: B010 (an instance attribute shadows the method)


def _stop_leftover_engines(data_dir: Path) -> None:
    """`App.stop` leaves engines running (they are adopted at the next start): stop them."""

    async def stop_all() -> None:
        runtime = ProcessRuntime(data_dir / "engines", cwd=REPO)
        for handle in await runtime.list_engines():
            with contextlib.suppress(Exception):
                await runtime.stop(handle, 5.0)
        await runtime.close()

    asyncio.run(stop_all())


def _config(data_dir: Path, config_path: Path, litellm_url: str, litellm: bool) -> Config:
    return Config(
        server=ServerConfig(
            data_dir=str(data_dir),
            admin_port=free_port(),
            gateway_port=free_port(),
        ),
        memory=MemoryConfig(total_gib=TOTAL_GIB, reserve_gib=0.0, watchdog_threshold_gib=0.0),
        runtime=RuntimeConfig(kind="process"),
        litellm=LiteLLMConfig(
            enabled=litellm, backend="file", config_path=str(config_path), url=litellm_url
        ),
    )


def _deploy(data_dir: Path, config: Config) -> dict[str, str]:
    """Create the deployments with a DGXMM that has no LiteLLM yet; returns name -> id.

    The engines keep running when it stops, and the DGXMM of the tests adopts them: its first
    sync then writes the final model list, so LiteLLM starts with it and never has to reload
    during set-up (a reload costs 7-15 s).
    """
    first = AppInThread(App(config)).start()
    try:
        controller = first.app.controller
        ids = {}
        for spec in SPECS:
            ids[spec.name] = first.run(controller.create(spec, ADMIN)).id
        deadline = time.monotonic() + READY_S
        want = {ALWAYS: "ready", OD: "ready", HOG: "ready", WAIT: "stopped", HUGE: "stopped"}
        while True:
            states = first.read(lambda: {r.name: r.state for r in controller.records()})
            if states == want:
                return ids
            if time.monotonic() > deadline:
                pytest.fail(f"deployments are {states}, not {want}")
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
    finally:
        first.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary = require_litellm()
    data_dir = tmp_path_factory.mktemp("dgxmm-data")
    config_path = tmp_path_factory.mktemp("litellm-config") / "litellm.json"
    proxy = LiteLLMProxy(binary, config_path, tmp_path_factory.mktemp("litellm-run"))
    config = _config(data_dir, config_path, proxy.url, litellm=True)
    dgxmm = AppInThread(App(config))
    try:
        ids = _deploy(data_dir, _config(data_dir, config_path, proxy.url, litellm=False))
        with pytest.MonkeyPatch.context() as env:
            env.setenv("LITELLM_MASTER_KEY", proxy.master_key)
            dgxmm.start()
            stack = Stack(dgxmm, proxy, config_path, ids)
            _install_spy(stack)
            for name in (ALWAYS, OD, HOG):
                assert stack.record(name).state == "ready"
            # DGXMM's first sync writes the file and waits for LiteLLM, which starts with it.
            deadline = time.monotonic() + READY_S
            while _file_ids(config_path) != set(stack.wanted_ids()):
                assert time.monotonic() < deadline, "DGXMM did not write LiteLLM's config"
                time.sleep(0.05)  # poll interval; the deadline bounds the wait
            proxy.start()
            stack.wait_synced()
            yield stack
    finally:
        proxy.stop()
        dgxmm.stop()
        _stop_leftover_engines(data_dir)


def _file_ids(config_path: Path) -> set[str]:
    """The model_info.id of DGXMM's entries in LiteLLM's config file."""
    try:
        document = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return set()
    return {
        item["model_info"]["id"]
        for item in document.get("model_list", [])
        if "-dgxmm-" in item.get("model_info", {}).get("id", "")
    }


# --------------------------------------------------------------------------------------------
# Helpers


def message_text(answer: Response) -> str:
    """choices[0].message.content of a chat completion."""
    content: str = answer.json()["choices"][0]["message"]["content"]
    return content


def stream_text(payloads: list[str]) -> str:
    """The concatenated delta text of chat chunks."""
    text = ""
    for payload in payloads:
        if payload == "[DONE]":
            continue
        for choice in json.loads(payload).get("choices", []):
            text += (choice.get("delta") or {}).get("content") or ""
    return text


class Stream:
    """A streaming request read event by event (LiteLLM sends the queued chunk at once)."""

    def __init__(self, url: str, path: str, body: object, headers: dict[str, str]) -> None:
        host_port = url.removeprefix("http://")
        host, _, port = host_port.partition(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self._conn.request(
            "POST", path, json.dumps(body).encode(), {"content-type": "application/json", **headers}
        )
        self.response = self._conn.getresponse()

    def next_data(self) -> str | None:
        """The next `data:` payload, or None at the end of the body."""
        while True:
            line = self.response.readline()
            if not line:
                return None
            text = line.decode().rstrip("\r\n")
            if text.startswith("data:"):
                return text.removeprefix("data:").strip()

    def rest(self) -> list[str]:
        """Every remaining `data:` payload."""
        payloads = []
        while (payload := self.next_data()) is not None:
            payloads.append(payload)
        return payloads

    def close(self) -> None:
        self._conn.close()


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run `fn()` in a thread; its result (or exception) lands in the returned list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # the test asserts on it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# --------------------------------------------------------------------------------------------
# 1. chat, streaming and not, to an always-on and an on-demand model


def test_litellm_serves_the_always_on_model_from_its_engine_and_the_on_demand_one_via_the_gateway(
    stack: Stack,
) -> None:
    served = stack.served_ids()
    assert served is not None
    gateway = stack.app.config.server.public_gateway_url
    by_name = {name: stack.ids[name] for name in (ALWAYS, OD)}
    assert served[f"box-dgxmm-{by_name[ALWAYS]}"] == f"{stack.record(ALWAYS).engine_url}/v1"
    assert served[f"box-dgxmm-{by_name[OD]}-gw"] == f"{gateway}/d/{by_name[OD]}/v1"


@pytest.mark.parametrize("name", [ALWAYS, OD])
def test_a_chat_completion_through_litellm_is_the_engines_answer(stack: Stack, name: str) -> None:
    before = len(stack.relayed_to(name))
    answer = stack.chat(name, "plain question")
    assert answer.status == 200, answer.body
    assert answer.json()["model"] == name
    assert message_text(answer) == message_text(stack.direct_chat(name, "plain question"))
    # Only the on-demand entry goes through the gateway.
    assert len(stack.relayed_to(name)) - before == (1 if name == OD else 0)


@pytest.mark.parametrize("name", [ALWAYS, OD])
def test_a_streamed_chat_completion_through_litellm_is_the_engines_stream(
    stack: Stack, name: str
) -> None:
    answer = stack.chat(name, "streamed question", stream=True)
    assert answer.status == 200, answer.body
    payloads = sse_data(answer.body)
    assert payloads[-1] == "[DONE]"
    direct = sse_data(stack.direct_chat(name, "streamed question", stream=True).body)
    # LiteLLM re-serialises chunks: compare the text, not the bytes.
    assert stream_text(payloads) == stream_text(direct)
    assert stream_text(payloads)


# --------------------------------------------------------------------------------------------
# 2. an on-demand cold start through LiteLLM


def test_a_request_through_litellm_starts_a_stopped_on_demand_model_and_gets_the_normal_answer(
    stack: Stack,
) -> None:
    stack.stop(OD)
    config_before = stack.config_path.stat().st_mtime_ns
    started = time.monotonic()
    answer = stack.chat(OD, "cold start")
    took = time.monotonic() - started
    assert answer.status == 200, answer.body
    assert stack.record(OD).state == "ready"
    text = message_text(answer)
    assert text == message_text(stack.direct_chat(OD, "cold start"))  # no queued line: it fit
    assert took >= 1.0  # the engine's start-up delay
    # The on-demand entry is the same in every state: a cold start rewrites nothing.
    assert stack.config_path.stat().st_mtime_ns == config_before


# --------------------------------------------------------------------------------------------
# 3. the queued chunk through LiteLLM (and a full queue's 503)


def test_a_queued_stream_gets_the_queued_chunk_through_litellm_then_the_answer(
    stack: Stack,
) -> None:
    controller = stack.app.controller
    assert controller is not None
    stack.wait_state(HOG, "ready")
    assert stack.record(WAIT).state == "stopped"
    stats = stack.gateway_stats()
    # e2e-hog answers slowly; while it does, its 4 GiB cannot be freed and e2e-wait does not fit.
    hog, hog_answer = in_thread(lambda: stack.chat(HOG, "keep busy"))
    deadline = time.monotonic() + READY_S
    while stack.record(HOG).in_flight == 0:
        assert hog.is_alive() and time.monotonic() < deadline, hog_answer
        time.sleep(0.02)  # poll interval; the deadline bounds the wait
    max_queued = stack.dgxmm.read(lambda: controller.setting("ondemand_max_queued"))
    stream = Stream(
        stack.proxy.url,
        "/v1/chat/completions",
        stack.chat_body(WAIT, "queued", stream=True),
        stack.proxy.auth,
    )
    try:
        assert stream.response.status == 200
        first = stream.next_data()
        assert first is not None
        assert stream_text([first]) == queued_line(WAIT)
        assert stack.record(WAIT).queued == 1
        assert stack.record(HOG).in_flight == 1  # the chunk came while the memory was held

        # 5b. with the queue full, the next request that would wait is refused at once.
        stack.dgxmm.run(controller.change_settings({"ondemand_max_queued": 1}, ADMIN))
        refused_before = stack.gateway_stats()["refused"]
        full = stack.chat(HUGE, "no room in the queue")
        assert full.status == 503, full.body
        assert (
            "too many requests are waiting for on-demand models (1)"
            in (full.json()["error"]["message"])
        )
        assert full.headers["llm_provider-retry-after"] == "60"
        assert stack.gateway_stats()["refused"] - refused_before == 1  # LiteLLM did not retry

        hog.join(READY_S)
        assert not hog.is_alive()
        [hog_done] = hog_answer
        assert isinstance(hog_done, Response) and hog_done.status == 200, hog_done
        stack.stop(HOG)  # frees the memory: the queue starts e2e-wait
        rest = stream.rest()
    finally:
        stream.close()
        stack.dgxmm.run(controller.change_settings({"ondemand_max_queued": max_queued}, ADMIN))
    assert rest[-1] == "[DONE]"
    direct = sse_data(stack.direct_chat(WAIT, "queued", stream=True).body)
    assert stream_text(rest) == stream_text(direct)
    assert stack.gateway_stats()["queued_lines"] - stats["queued_lines"] == 1


# --------------------------------------------------------------------------------------------
# 4. LiteLLM's /health and a sleeping model


def test_litellm_health_reports_a_sleeping_on_demand_model_healthy_without_starting_it(
    stack: Stack,
) -> None:
    stack.stop(OD)
    before = stack.gateway_stats()
    relayed = len(stack.relayed_to(OD))
    answer = http_request(stack.proxy.url, path=f"/health?model={OD}", headers=stack.proxy.auth)
    assert answer.status == 200, answer.body
    health = answer.json()
    assert health["healthy_count"] == 1 and health["unhealthy_count"] == 0, health
    assert health["healthy_endpoints"][0]["model_id"] == f"box-dgxmm-{stack.ids[OD]}-gw"
    after = stack.gateway_stats()
    # The gateway answered one probe that carried x-dgxmm-health-check (it counts only those)...
    assert after["health_checks"] - before["health_checks"] == 1
    assert after["server"].requests_total - before["server"].requests_total == 1
    # ...without starting the model or reaching an engine.
    rec = stack.record(OD)
    assert rec.state == "stopped" and rec.in_flight == 0 and rec.waiting_for_start == 0
    assert len(stack.relayed_to(OD)) == relayed


# --------------------------------------------------------------------------------------------
# 5. a gateway 503 reaches the client as LiteLLM's error, after one attempt


@pytest.mark.parametrize("stream", [False, True])
def test_a_gateway_503_reaches_the_client_inside_litellms_error_after_one_attempt(
    stack: Stack, stream: bool
) -> None:
    before = stack.gateway_stats()
    answer = stack.chat(HUGE, "too big", stream=stream)
    after = stack.gateway_stats()
    assert answer.status == 503, answer.body
    error = answer.json()["error"]
    assert (
        "e2e-huge needs 16 GiB but at most 11 GiB can be freed for on-demand models"
        in (error["message"])
    )
    assert error["code"] == "503"
    assert after["refused"] - before["refused"] == 1
    assert after["server"].requests_total - before["server"].requests_total == 1  # no retry
    assert stack.record(HUGE).state == "stopped"


# --------------------------------------------------------------------------------------------
# 6. an Anthropic messages client


@pytest.mark.parametrize("stream", [False, True])
def test_an_anthropic_messages_client_reaches_the_engine_through_the_gateway_as_responses(
    stack: Stack, stream: bool
) -> None:
    before = len(stack.relayed_to(OD))
    body: dict[str, Any] = {
        "model": OD,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello from an Anthropic client"}],
    }
    if stream:
        body["stream"] = True
    answer = http_request(stack.proxy.url, "POST", "/v1/messages", body, stack.proxy.auth)
    assert answer.status == 200, answer.body
    [sent] = stack.relayed_to(OD)[before:]
    assert sent.target == "/v1/responses"
    # The engine's own answer to exactly what the gateway sent it, compared by text.
    rec = stack.record(OD)
    assert rec.engine_url is not None
    direct_body = json.loads(sent.body) | {"stream": False}
    direct = http_request(rec.engine_url, "POST", "/v1/responses", direct_body).json()
    engine_text = direct["output"][0]["content"][0]["text"]
    if stream:
        events = [json.loads(p) for p in sse_data(answer.body) if p != "[DONE]"]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        text = "".join(
            e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"
        )
    else:
        message = answer.json()
        assert message["type"] == "message"
        text = "".join(part.get("text", "") for part in message["content"])
    assert text == engine_text and text


# --------------------------------------------------------------------------------------------
# 7. a mode switch under load


LOAD_CLIENTS = 4
LOAD_MAX_REQUESTS = 1000  # per client: bounds the load even if the switch hangs
RESTARTS_PER_SWITCH = 1  # one write of the final model list per switch: one reload
WINDOW_SLACK_S = 0.5  # log lines are stamped when the watcher reads them (every 10 ms)


@dataclass(frozen=True)
class Outcome:
    """One request of the load, on the clock of `time.monotonic()`."""

    client: int
    stream: bool
    started: float
    ended: float
    answered: bool  # a status line arrived
    ok: bool  # 200 and a complete answer
    detail: str


@dataclass(frozen=True)
class Restart:
    """One restart of LiteLLM's worker, as its log tells it."""

    reload_at: float  # "StatReload detected changes ... Reloading..." (then SIGTERM)
    old_exit_at: float  # "Finished server process" of the old worker
    ready_at: float  # "Application startup complete." of the new worker


class LiteLLMWatcher:
    """Stamps LiteLLM's log lines and every version of its config file as they appear."""

    def __init__(self, stack: Stack) -> None:
        self._log = stack.proxy.log_path
        self._config = stack.config_path
        self._stop = threading.Event()
        self.lines: list[tuple[float, str]] = []
        self.versions: list[tuple[float, dict[str, Any]]] = []
        self._offset = 0
        self._mtime = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LiteLLMWatcher:
        self._offset = self._log.stat().st_size
        self._mtime = self._config.stat().st_mtime_ns
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._poll()

    def _run(self) -> None:
        while not self._stop.wait(0.01):  # poll interval; __exit__ ends it
            self._poll()

    def _poll(self) -> None:
        now = time.monotonic()
        with self._log.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self._offset += cut
        self.lines += [(now, line) for line in data[:cut].decode(errors="replace").splitlines()]
        mtime = self._config.stat().st_mtime_ns
        if mtime != self._mtime:
            self._mtime = mtime
            with contextlib.suppress(ValueError):  # os.replace makes the file whole or absent
                self.versions.append((now, json.loads(self._config.read_text())))

    def restarts(self) -> list[Restart]:
        """Every worker restart seen since `__enter__` (times not in the log yet are inf)."""
        found = []
        for at, line in self.lines:
            if "Reloading..." not in line:
                continue
            later = [(t, text) for t, text in self.lines if t >= at]
            never = float("inf")  # not (yet) in the log
            exit_at = next((t for t, text in later if "Finished server process" in text), never)
            ready_at = next(
                (t for t, text in later if "Application startup complete" in text), never
            )
            found.append(Restart(at, exit_at, ready_at))
        return found


def _load_request(stack: Stack, client: int, index: int) -> Outcome:
    """One chat request on a fresh connection (as curl would), classified; never retried."""
    stream = index % 2 == 1
    body = stack.chat_body(OD, f"load {client} {index}", stream)
    headers = {"content-type": "application/json", **stack.proxy.auth}
    conn = http.client.HTTPConnection("127.0.0.1", stack.proxy.port, timeout=120)
    started = time.monotonic()
    answered, ok, detail = False, False, ""
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), headers)
        response = conn.getresponse()
        answered = True
        data = response.read()
        if response.status != 200:
            detail = f"HTTP {response.status}: {data[:300]!r}"
        elif stream:
            payloads = sse_data(data)
            ok = payloads[-1:] == ["[DONE]"] and bool(stream_text(payloads))
            detail = "" if ok else f"incomplete stream: {data[-300:]!r}"
        else:
            ok = bool(message_text(Response(200, {}, data)))
    except (OSError, http.client.HTTPException, ValueError, LookupError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return Outcome(client, stream, started, time.monotonic(), answered, ok, detail)


def _switch_and_sync(stack: Stack, mode: str) -> tuple[float, float]:
    """Switch e2e-od and wait until LiteLLM serves the new path; returns (started, synced)."""
    started = time.monotonic()
    rec = stack.change_mode(OD, mode)
    assert rec.mode == mode and rec.pending_mode is None  # a ready deployment switches at once
    served = stack.wait_synced()
    gateway_entry = f"box-dgxmm-{stack.ids[OD]}-gw"
    assert (gateway_entry in served) == (mode == "on_demand"), served
    return started, time.monotonic()


def test_a_mode_switch_there_and_back_under_load_through_litellm(stack: Stack) -> None:
    """Switch e2e-od to always on and back while clients keep calling it through LiteLLM.

    With the file back-end a switch is one write of the final model list, so one restart of
    LiteLLM's worker (see docs/litellm.md).  What DGXMM guarantees, and this test asserts: every
    version of the file lists the model (the new path replaces the old one in the same write),
    so no request gets an error answer; every request LiteLLM answered was answered completely,
    those in flight when a worker stopped included (it finishes them on the old list); new
    connections wait for the new worker, which serves the new path.  What LiteLLM's restart
    does on its own: a connection the stopping worker had accepted but whose request it had not
    read yet is reset without an answer.  Those are counted, must fall inside a restart, and
    are reported.
    """
    if stack.record(OD).state != "ready":
        assert stack.chat(OD, "wake up").status == 200
    outcomes: list[Outcome] = []
    stop = threading.Event()

    def client(n: int) -> None:
        for index in range(LOAD_MAX_REQUESTS):
            if stop.is_set():
                return
            outcomes.append(_load_request(stack, n, index))

    clients = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(LOAD_CLIENTS)]
    with LiteLLMWatcher(stack) as watcher:
        for thread in clients:
            thread.start()
        try:
            deadline = time.monotonic() + READY_S
            while len([o for o in outcomes if o.ok]) < 2 * LOAD_CLIENTS:
                assert time.monotonic() < deadline, outcomes
                time.sleep(0.02)  # poll interval; the deadline bounds the wait
            switches = [_switch_and_sync(stack, "always_on")]
            assert stack.chat(OD, "straight to the engine").status == 200
            switches.append(_switch_and_sync(stack, "on_demand"))
            assert stack.chat(OD, "through the gateway again").status == 200
        finally:
            stop.set()
            for thread in clients:
                thread.join(150)
    restarts = watcher.restarts()
    relayed = [r.body for r in stack.relayed_to(OD)]
    assert not any(b"straight to the engine" in body for body in relayed)
    assert any(b"through the gateway again" in body for body in relayed)

    # One write per switch, and every version of the file lists the model: the new path only.
    versions = [doc for _, doc in watcher.versions]
    od_paths = [
        sorted(i["litellm_params"]["api_base"] for i in doc["model_list"] if i["model_name"] == OD)
        for doc in versions
    ]
    assert len(versions) == len(switches) * RESTARTS_PER_SWITCH, od_paths
    gateway_path = f"/d/{stack.ids[OD]}/v1"
    assert [[gateway_path in path for path in paths] for paths in od_paths] == [[False], [True]]
    assert len(restarts) == len(versions), watcher.lines
    for started, synced in switches:  # each switch: exactly one write and one restart
        written = [at for at, _ in watcher.versions if started <= at <= synced]
        restarted = [r for r in restarts if started <= r.reload_at <= synced]
        assert len(written) == len(restarted) == RESTARTS_PER_SWITCH, (switches, restarts)

    # No request got an error answer, and every answer that started was complete.
    answered = [o for o in outcomes if o.answered]
    assert all(o.ok for o in answered), [o for o in answered if not o.ok]
    # Requests that arrived while a worker restarted waited for the new one and succeeded...
    for restart in restarts:
        waited = [
            o
            for o in answered
            if restart.old_exit_at <= o.started + WINDOW_SLACK_S and o.ended >= restart.ready_at
        ]
        assert waited, (restart, outcomes)
    # ...and requests in flight when a worker was told to stop were finished by it.
    drained = [
        o
        for o in answered
        for r in restarts
        if o.started < r.reload_at < o.ended <= r.old_exit_at + WINDOW_SLACK_S
    ]
    assert drained, (restarts, outcomes)
    assert not [line for _, line in watcher.lines if "graceful shutdown exceeded" in line]
    # The only failures: connections reset without an answer while an old worker stopped,
    # at most one per client and restart.
    dropped = [o for o in outcomes if not o.answered]
    for o in dropped:
        assert o.detail.startswith(("ConnectionResetError", "RemoteDisconnected", "BrokenPipe")), o
        assert any(
            r.reload_at - WINDOW_SLACK_S <= o.ended <= r.old_exit_at + WINDOW_SLACK_S
            for r in restarts
        ), (o, restarts)
    assert len(dropped) <= LOAD_CLIENTS * len(restarts)
    waits = ", ".join(f"{r.ready_at - r.reload_at:.1f}" for r in restarts)
    resets = [
        f"{type_name(o)} {min(abs(o.ended - r.reload_at) for r in restarts):.2f} s after a reload"
        for o in dropped
    ]
    per_switch = ", ".join(f"{synced - started:.1f}" for started, synced in switches)
    print(
        f"\nmode switch under load: {len(outcomes)} requests from {LOAD_CLIENTS} clients, "
        f"{len(answered)} answered (all complete), {len(drained)} of them finished by a stopping "
        f"worker; {len(dropped)} reset without an answer {resets}; {len(restarts)} worker "
        f"restarts ({len(restarts) / len(switches):g} per switch) of {waits} s; switches "
        f"{per_switch} s, both {switches[-1][1] - switches[0][0]:.1f} s"
    )


def type_name(outcome: Outcome) -> str:
    """The exception's name out of an outcome's detail."""
    return outcome.detail.split(":", 1)[0]
