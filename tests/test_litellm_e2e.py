"""A real LiteLLM proxy in front of a real DGXMM (issues 4 and 16), on loopback.

DGXMM runs in-process (`App`, process runtime, simulated engines, a small memory budget so that
models compete) with the LiteLLM integration's `file` back-end; the pinned LiteLLM runs once for
the module with the config file DGXMM writes, and `--reload`.  DGXMM starts first and creates
every deployment while LiteLLM is still down (the file is written at once each time); LiteLLM
is started second on that file.  Every request goes through LiteLLM, as a client's would; a spy
on the gateway's engine pool records what reached engines.  LiteLLM's worker restarts are
counted from LiteLLM's own output ("Reloading...") and from its process tree (the worker's pid).

The deployments (12 GiB usable):

| name | mode | GiB | role in the tests |
|---|---|---|---|
| e2e-always | always on | 1 | steady load; its probes are relayed to the engine |
| e2e-flaky | always on | 1 | its engine is killed, and restarted at once |
| e2e-od | on demand | 2 | the gateway path: answers, cold start, health, Anthropic, mode switch |
| e2e-hog | on demand | 4 | a slow engine that holds memory while it answers |
| e2e-nap | on demand | 1 | put to sleep and woken by a request under load |
| e2e-wait | on demand | 6 | does not fit while e2e-hog holds its memory: queued |
| e2e-huge | on demand | 16 | can never fit (16 > 12 - 2 always on): does_not_fit |
"""

from __future__ import annotations

import contextlib
import http.client
import inspect
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from actors.controller import DeploymentRecord, DeploymentSpec
from actors.deployment import SleepDeployment
from actors.memory_broker import GIB
from dgxmm.app import App
from dgxmm.config import (
    Config,
    LiteLLMConfig,
    MemoryConfig,
    RuntimeConfig,
    ServerConfig,
)
from tests.litellm_support import (
    AppInThread,
    LiteLLMProxy,
    Response,
    free_port,
    http_request,
    require_litellm,
    sse_data,
    stop_leftover_engines,
)

pytestmark = pytest.mark.litellm

ADMIN = "admin:e2e"
ALWAYS, OD, HOG, WAIT, HUGE = "e2e-always", "e2e-od", "e2e-hog", "e2e-wait", "e2e-huge"
FLAKY, NAP, NEW = "e2e-flaky", "e2e-nap", "e2e-new"
SPECS = (
    DeploymentSpec(
        name=ALWAYS, engine="sim", model="e2e/always-1b", memory_bytes=1 * GIB, mode="always_on"
    ),
    DeploymentSpec(
        name=FLAKY, engine="sim", model="e2e/flaky-1b", memory_bytes=1 * GIB, mode="always_on"
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
    DeploymentSpec(
        name=NAP,
        engine="sim",
        model="e2e/nap-1b",
        memory_bytes=1 * GIB,
        mode="on_demand",
        args=["--startup-delay", "1"],
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
    start_order: StartOrder | None = None

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
    """Record what the gateway sends to engines: wraps its engine pool's `request` (the
    handler's path) and `_send` (the express lane's writes, on idle or new connections)."""
    gateway = stack.app.gateway
    assert gateway is not None
    pool = gateway.upstream
    original = pool.request
    original_send = pool._send
    signature = inspect.signature(original)
    signature_send = inspect.signature(original_send)

    def record(port: int, sent: dict[str, Any]) -> None:
        stack.relayed.append(
            Relayed(
                port,
                bytes(sent["method"]).decode(),
                bytes(sent["target"]).decode(),
                bytes(sent["body"]),
            )
        )

    async def request(*args: Any, **kwargs: Any) -> Any:
        sent = signature.bind(*args, **kwargs).arguments
        record(sent["port"], sent)
        return await original(*args, **kwargs)

    def send(*args: Any, **kwargs: Any) -> Any:
        ok = original_send(*args, **kwargs)
        if ok:  # else the request did not go out (the lane hands it on or answers 502)
            sent = signature_send.bind(*args, **kwargs).arguments
            request = sent["request"]
            what = {"method": request.method, "target": request.head.target, "body": request.body}
            record(sent["engine"].port, what)
        return ok

    # Instance attributes shadow the methods.
    setattr(pool, "request", request)  # noqa: B010
    setattr(pool, "_send", send)  # noqa: B010


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


def _create_all(dgxmm: AppInThread) -> dict[str, str]:
    """Create the deployments (LiteLLM is not running yet); returns name -> id."""
    controller = dgxmm.app.controller
    ids = {}
    for spec in SPECS:
        ids[spec.name] = dgxmm.run(controller.create(spec, ADMIN)).id
    deadline = time.monotonic() + READY_S
    want = {ALWAYS: "ready", FLAKY: "ready", OD: "ready", HOG: "ready", NAP: "ready"}
    want |= {WAIT: "stopped", HUGE: "stopped"}
    while True:
        states = dgxmm.read(lambda: {r.name: r.state for r in controller.records()})
        if states == want:
            return ids
        if time.monotonic() > deadline:
            pytest.fail(f"deployments are {states}, not {want}")
        time.sleep(0.05)  # poll interval; the deadline bounds the wait


@dataclass(frozen=True)
class StartOrder:
    """What the fixture saw while DGXMM ran before LiteLLM (issue 16: no start-order trap)."""

    status_before_litellm: dict[str, Any]  # DGXMM's LiteLLM status just before LiteLLM started
    file_ids_before_litellm: set[str]
    litellm_live_at: float  # /health/liveliness answered (time.monotonic())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary = require_litellm()
    data_dir = tmp_path_factory.mktemp("dgxmm-data")
    config_path = tmp_path_factory.mktemp("litellm-config") / "litellm.json"
    proxy = LiteLLMProxy(binary, config_path, tmp_path_factory.mktemp("litellm-run"))
    config = _config(data_dir, config_path, proxy.url, litellm=True)
    stacks: list[Stack] = []
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("LITELLM_MASTER_KEY", proxy.master_key)
            # DGXMM first: every deployment is created while LiteLLM is down.
            stack = Stack(AppInThread(App(config)).start(), proxy, config_path, {})
            stacks.append(stack)
            stack.ids = _create_all(stack.dgxmm)
            _install_spy(stack)
            deadline = time.monotonic() + READY_S
            while _file_ids(config_path) != set(stack.wanted_ids()):
                assert time.monotonic() < deadline, "DGXMM did not write LiteLLM's config"
                time.sleep(0.05)  # poll interval; the deadline bounds the wait
            status = stack.dgxmm.read(stack.app.litellm.status)
            file_ids = _file_ids(config_path)
            # LiteLLM second, on the file DGXMM wrote.
            proxy.start()
            stack.start_order = StartOrder(status, file_ids, time.monotonic())
            yield stack
    finally:
        proxy.stop()
        for each in stacks:
            each.dgxmm.stop()
        stop_leftover_engines(data_dir)


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
# 1. DGXMM first, LiteLLM second; chat, streaming and not, to an always-on and an on-demand model


def test_dgxmm_started_first_wrote_every_entry_and_litellm_serves_them_once_it_is_up(
    stack: Stack,
) -> None:
    order = stack.start_order
    assert order is not None
    # While LiteLLM was down, every deployment reached the file at once, and the status said so.
    assert order.file_ids_before_litellm == {f"box-dgxmm-{i}-gw" for i in stack.ids.values()}
    before = order.status_before_litellm
    # The creations were written (with the start-up write of an empty model_list, or after it:
    # the bridge coalesces changes within 0.2 s, so one write or more; test_litellm_bridge
    # checks the empty start-up write on its own).
    assert before["ok"] is True and before["config_writes"] >= 1
    assert before["loaded"] is False
    assert "LiteLLM reads the file when it starts" in before["load_error"]
    # LiteLLM serves them from its first start: a deployment created before it is answered.
    answer = stack.chat(OD, "created before LiteLLM")
    served_after = time.monotonic() - order.litellm_live_at
    assert answer.status == 200, answer.body
    assert stack.chat(ALWAYS, "created before LiteLLM").status == 200
    # DGXMM notices within its check interval (at most 5 s between looks).
    assert _wait_loaded(stack)["load_error"] is None
    print(f"\nDGXMM first: first answer {served_after:.2f} s after LiteLLM was live")


def _wait_loaded(stack: Stack, timeout_s: float = 30.0) -> dict[str, Any]:
    """DGXMM's LiteLLM status once its background check saw LiteLLM serve the file."""
    deadline = time.monotonic() + timeout_s
    while not (status := stack.dgxmm.read(stack.app.litellm.status))["loaded"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.1)  # poll interval; the deadline bounds the wait
    return status


def test_every_entry_points_at_the_gateway_whatever_the_mode(stack: Stack) -> None:
    served = stack.served_ids()
    assert served is not None
    gateway = stack.app.config.server.public_gateway_url
    assert served == {f"box-dgxmm-{i}-gw": f"{gateway}/d/{i}/v1" for i in stack.ids.values()}


@pytest.mark.parametrize("name", [ALWAYS, OD])
def test_a_chat_completion_through_litellm_is_the_engines_answer(stack: Stack, name: str) -> None:
    before = len(stack.relayed_to(name))
    answer = stack.chat(name, "plain question")
    assert answer.status == 200, answer.body
    assert answer.json()["model"] == name
    assert message_text(answer) == message_text(stack.direct_chat(name, "plain question"))
    # Both go through the gateway (file back-end: one entry whatever the mode).
    assert len(stack.relayed_to(name)) - before == 1


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


def test_litellm_health_of_an_always_on_model_is_the_engines_answer(stack: Stack) -> None:
    before = stack.gateway_stats()
    relayed = len(stack.relayed)
    answer = http_request(stack.proxy.url, path=f"/health?model={ALWAYS}", headers=stack.proxy.auth)
    assert answer.status == 200, answer.body
    health = answer.json()
    assert health["healthy_count"] == 1 and health["unhealthy_count"] == 0, health
    after = stack.gateway_stats()
    assert after["health_checks_relayed"] - before["health_checks_relayed"] == 1
    # The probe reached the engine (LiteLLM's own probe text), without the marking header.
    probes = stack.dgxmm.read(lambda: list(stack.relayed))[relayed:]
    assert [_body_model(p.body) for p in probes] == ["e2e/always-1b"]


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
        "e2e-huge needs 16 GiB but at most 10 GiB can be freed for on-demand models"
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
# 7. under load: state changes and mode switches restart nothing and fail nothing (issue 16)


CLIENTS_PER_MODEL = 2
LOAD_MODELS = (ALWAYS, OD)
LOAD_MAX_REQUESTS = 2000  # per client: bounds the load even if a step hangs
WINDOW_SLACK_S = 0.5  # log lines are stamped when the watcher reads them (every 10 ms)


@dataclass(frozen=True)
class Outcome:
    """One request of the load, on the clock of `time.monotonic()`."""

    model: str
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
    """Stamps LiteLLM's log lines, its worker pids and every version of its config file."""

    def __init__(self, stack: Stack) -> None:
        self._proxy = stack.proxy
        self._log = stack.proxy.log_path
        self._config = stack.config_path
        self._stop = threading.Event()
        self.lines: list[tuple[float, str]] = []
        self.versions: list[tuple[float, dict[str, Any]]] = []
        self.workers: list[int] = []  # the reloader's children, in the order they appeared
        self._offset = 0
        self._mtime = 0
        self._initial_workers = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LiteLLMWatcher:
        self._offset = self._log.stat().st_size
        self._mtime = self._config.stat().st_mtime_ns
        self.workers = sorted(self._proxy.child_pids())
        self._initial_workers = len(self.workers)
        assert self.workers, "LiteLLM runs without --reload (no worker process)"
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
        for pid in sorted(self._proxy.child_pids()):
            if pid not in self.workers:
                self.workers.append(pid)

    def restarts(self) -> list[Restart]:
        """Every worker restart LiteLLM logged since `__enter__` (times not logged yet: inf)."""
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

    def new_workers(self) -> int:
        """Worker processes that appeared since `__enter__` (one per restart)."""
        return len(self.workers) - self._initial_workers


def _load_request(stack: Stack, model: str, client: int, index: int) -> Outcome:
    """One chat request on a fresh connection (as curl would), classified; never retried."""
    stream = index % 2 == 1
    body = stack.chat_body(model, f"load {client} {index}", stream)
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
    return Outcome(model, client, stream, started, time.monotonic(), answered, ok, detail)


class Load:
    """Clients calling models through LiteLLM in a loop until stopped (threads)."""

    def __init__(self, stack: Stack, models: tuple[str, ...], per_model: int) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(stack, model, n), daemon=True)
            for model in models
            for n in range(per_model)
        ]

    def _client(self, stack: Stack, model: str, n: int) -> None:
        for index in range(LOAD_MAX_REQUESTS):
            if self._stop.is_set():
                return
            self.outcomes.append(_load_request(stack, model, n, index))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)

    def wait_for_more(self, count: int, timeout_s: float = READY_S) -> None:
        """Wait until `count` more requests were answered completely (every model among them)."""
        mark = len(self.outcomes)
        deadline = time.monotonic() + timeout_s
        while True:
            new = [o for o in self.outcomes[mark:] if o.ok]
            models = {o.model for o in new}
            if len(new) >= count and len(models) == len({o.model for o in self.outcomes}):
                return
            assert time.monotonic() < deadline, self.outcomes[mark:]
            time.sleep(0.02)  # poll interval; the deadline bounds the wait


def _kill_engine(stack: Stack, name: str) -> None:
    """Kill the deployment's engine behind DGXMM's back (SIGKILL to its process)."""
    controller = stack.app.controller
    assert controller is not None
    handle = stack.dgxmm.read(lambda: controller.actors[stack.ids[name]].engine_handle)
    assert handle is not None, f"{name} has no engine"
    os.kill(int(handle.runtime_id.removeprefix("pid:")), signal.SIGKILL)


def test_mode_switches_sleep_wake_and_a_failure_under_load_restart_nothing_and_fail_nothing(
    stack: Stack,
) -> None:
    """Issue 16's acceptance through a real LiteLLM (file back-end, --reload).

    Steady load on two models (an always-on and an on-demand one, fresh connection per request,
    no retries) while: e2e-od switches to always on and back; e2e-nap is put to sleep and woken
    by a request; e2e-flaky's engine is killed and restarted at once.  None of it
    changes LiteLLM's entries, so DGXMM writes nothing, LiteLLM's worker never restarts, and
    every request of the load is answered completely.
    """
    controller = stack.app.controller
    assert controller is not None
    for name in (OD, NAP):
        if stack.record(name).state != "ready":
            assert stack.chat(name, "wake up").status == 200
    writes_before = stack.dgxmm.read(stack.app.litellm.status)["config_writes"]
    steps: dict[str, float] = {}
    with LiteLLMWatcher(stack) as watcher, Load(stack, LOAD_MODELS, CLIENTS_PER_MODEL) as load:
        load.wait_for_more(4 * len(LOAD_MODELS) * CLIENTS_PER_MODEL)
        # A mode switch in each direction.
        started = time.monotonic()
        assert stack.change_mode(OD, "always_on").mode == "always_on"
        load.wait_for_more(20)
        assert stack.change_mode(OD, "on_demand").mode == "on_demand"
        load.wait_for_more(20)
        steps["switches"] = time.monotonic() - started
        # An on-demand model put to sleep, then woken by a request through LiteLLM.
        started = time.monotonic()
        nap = controller.actors[stack.ids[NAP]]
        assert stack.dgxmm.run(nap.ask(SleepDeployment(reason="watchdog", actor="watchdog")))
        stack.wait_state(NAP, "stopped")
        woken = stack.chat(NAP, "wake up from sleep")
        assert woken.status == 200, woken.body
        assert stack.record(NAP).state == "ready"
        load.wait_for_more(20)
        steps["sleep_wake"] = time.monotonic() - started
        # A deployment's engine dies: always on, it is restarted at once (issue 13: the
        # backoff is for engines that fail to start), without touching LiteLLM.
        started = time.monotonic()
        before = stack.record(FLAKY).engine_url
        _kill_engine(stack, FLAKY)
        deadline = time.monotonic() + READY_S
        while (rec := stack.record(FLAKY)).state != "ready" or rec.engine_url == before:
            assert time.monotonic() < deadline, f"e2e-flaky was not restarted: {rec}"
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
        assert rec.failures == 0
        again = stack.chat(FLAKY, "after the restart")
        assert again.status == 200, again.body  # no cooldown left behind
        load.wait_for_more(20)
        steps["fail_restart"] = time.monotonic() - started
    # Nothing was written and LiteLLM's worker never restarted (its log and its process tree).
    assert stack.dgxmm.read(stack.app.litellm.status)["config_writes"] == writes_before
    assert watcher.versions == []
    assert watcher.restarts() == [], watcher.lines
    assert watcher.new_workers() == 0, watcher.workers
    # Every request of the load was answered, completely: none failed, none was reset.
    outcomes = load.outcomes
    failed = [o for o in outcomes if not o.ok]
    assert failed == [], failed
    by_model = {m: len([o for o in outcomes if o.model == m]) for m in LOAD_MODELS}
    took = ", ".join(f"{k} {v:.1f} s" for k, v in steps.items())
    print(
        f"\nunder load: {len(outcomes)} requests {by_model}, 0 failed, 0 reset; "
        f"0 LiteLLM restarts, 0 writes; {took}"
    )


# --------------------------------------------------------------------------------------------
# 8. LiteLLM first, DGXMM second (a DGXMM restart); creating and removing: one restart each


def _restart_dgxmm(stack: Stack) -> tuple[float, float]:
    """Stop DGXMM and start a new one on the same data and file; returns (stopped, serving)."""
    old = stack.dgxmm
    old.stop()
    stopped = time.monotonic()
    stack.dgxmm = AppInThread(App(old.app.config)).start()
    stack.relayed = []
    _install_spy(stack)
    return stopped, time.monotonic()


def test_a_dgxmm_restart_writes_nothing_and_always_on_traffic_fails_only_while_it_is_down(
    stack: Stack,
) -> None:
    with LiteLLMWatcher(stack) as watcher, Load(stack, (ALWAYS,), 2) as load:
        load.wait_for_more(8)
        down_from = time.monotonic()
        stopped, serving = _restart_dgxmm(stack)
        for name in (ALWAYS, OD):
            stack.wait_state(name, "ready")  # adopted, not restarted
        load.wait_for_more(8)
    # LiteLLM was up first; the new DGXMM found the file as it wants it and wrote nothing.
    status = stack.dgxmm.read(stack.app.litellm.status)
    assert status["config_writes"] == 0 and status["ok"] is True
    assert watcher.versions == [] and watcher.restarts() == []
    assert watcher.new_workers() == 0
    # Always-on traffic goes through the gateway: it fails while DGXMM is down, at once (LiteLLM
    # gets "connection refused"), never hangs, and the entry is not cooled down afterwards.
    failed = [o for o in load.outcomes if not o.ok]
    assert all(o.answered for o in failed), failed
    assert all(down_from - WINDOW_SLACK_S <= o.started <= serving for o in failed), failed
    assert all(o.ended - o.started < 5 for o in failed), failed
    after = [o for o in load.outcomes if o.started > serving]
    assert after and all(o.ok for o in after), after
    statuses = sorted({o.detail.split(":", 1)[0] for o in failed})
    print(
        f"\nDGXMM restart: down {serving - down_from:.2f} s (stop took "
        f"{stopped - down_from:.2f} s); always-on load {len(load.outcomes)} requests, "
        f"{len(failed)} failed while it was down ({statuses}), 0 after"
    )


def test_creating_and_removing_a_deployment_restart_litellm_exactly_once_each(
    stack: Stack,
) -> None:
    controller = stack.app.controller
    assert controller is not None
    spec = DeploymentSpec(
        name=NEW, engine="sim", model="e2e/new-1b", memory_bytes=1 * GIB, mode="on_demand"
    )
    with LiteLLMWatcher(stack) as created:
        dep_id = stack.dgxmm.run(controller.create(spec, ADMIN)).id
        stack.ids[NEW] = dep_id
        served = stack.wait_synced()
        assert f"box-dgxmm-{dep_id}-gw" in served
        answer = stack.chat(NEW, "a new model")
        assert answer.status == 200, answer.body
        _wait_restarts_logged(created, 1)
    with LiteLLMWatcher(stack) as removed:
        stack.dgxmm.run(controller.remove(dep_id, ADMIN))
        served = stack.wait_synced()
        assert f"box-dgxmm-{dep_id}-gw" not in served
        _wait_restarts_logged(removed, 1)
    for watcher in (created, removed):
        assert len(watcher.versions) == 1, watcher.versions
        assert len(watcher.restarts()) == 1, watcher.lines
        assert watcher.new_workers() == 1, watcher.workers
    status = _wait_loaded(stack)
    assert status["config_writes"] == 2  # DGXMM counted the two restarts it caused
    waits = [r.ready_at - r.reload_at for w in (created, removed) for r in w.restarts()]
    print(f"\ncreate/remove: one restart each, {', '.join(f'{w:.1f}' for w in waits)} s")


def _wait_restarts_logged(watcher: LiteLLMWatcher, count: int) -> None:
    """Wait until LiteLLM logged `count` complete restarts (the new worker started)."""
    deadline = time.monotonic() + SYNC_S
    while True:
        restarts = watcher.restarts()
        done = [r for r in restarts if r.ready_at != float("inf")]
        if len(done) >= count and watcher.new_workers() >= count:
            return
        assert time.monotonic() < deadline, watcher.lines
        time.sleep(0.05)  # poll interval; the deadline bounds the wait
