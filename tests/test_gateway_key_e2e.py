"""Only LiteLLM gets in (issue 38): a real LiteLLM 1.108.7 in front of a real DGXMM, on loopback.

DGXMM runs in-process (`App`, process runtime, simulated engines) with the LiteLLM file
back-end and the default `gateway_auth = "required"`; the pinned LiteLLM runs with `--reload`
on the file DGXMM writes, which carries the gateway key as each entry's `api_key`.

- Every kind of request LiteLLM sends (chat, a stream, embeddings, a probe) succeeds through
  LiteLLM, as does its model list, and the same request straight to the gateway without the
  key gets 401 (and with the key, 200: only the key differs).
- A rotation through `dgxmm gateway-key rotate` under load through LiteLLM fails no request:
  the new key is written to LiteLLM's file (its worker restarts) while the gateway accepts
  both, and the old key is refused only once LiteLLM serves the new one.  LiteLLM's restart
  may reset a connection it had accepted but not read (notes/litellm.md); the load's clients
  retry such a reset, as the OpenAI SDK does, and count it apart.  Any answer but 200 fails.
- Afterwards no key, old or new, is in DGXMM's log output, its API, its UI or its event log.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog

from actors.controller import DeploymentSpec
from actors.memory_broker import GIB
from dgxmm.app import App
from dgxmm.config import Config, LiteLLMConfig, MemoryConfig, RuntimeConfig, ServerConfig
from tests.browser_support import ApiClient
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

PROJECT = Path(__file__).resolve().parent.parent
ALWAYS, OD = "key-always", "key-od"
SPECS = (
    DeploymentSpec(
        name=ALWAYS, engine="sim", model="key/always-1b", memory_bytes=1 * GIB, mode="always_on"
    ),
    DeploymentSpec(
        name=OD, engine="sim", model="key/od-1b", memory_bytes=1 * GIB, mode="on_demand"
    ),
)
SERVED = {spec.name: spec.model for spec in SPECS}  # what the engines call their models
READY_S = 60.0
SYNC_S = 150.0  # LiteLLM serving what DGXMM wrote (a reload can take 42 s, plus a drain)
LOAD_CLIENTS = 4
CLIENT_TIMEOUT_S = 120.0  # new connections wait through LiteLLM's worker restart (7-42 s)
TEST_GRACE_S = 5.0  # the old key's grace after LiteLLM serves the new one (30 s by default)


@dataclass
class Stack:
    dgxmm: AppInThread
    proxy: LiteLLMProxy
    config_path: Path
    data_dir: Path
    log_path: Path
    cli_config: Path
    ids: dict[str, str] = field(default_factory=dict)
    keys_seen: set[str] = field(default_factory=set)  # every gateway key of the run

    @property
    def app(self) -> App:
        return self.dgxmm.app  # type: ignore[no-any-return]

    @property
    def gateway_url(self) -> str:
        return self.app.config.server.public_gateway_url

    def key(self) -> str:
        keys = self.app.gateway_keys
        assert keys is not None
        key = self.dgxmm.read(keys.current)
        self.keys_seen.add(key)
        return key

    def unauthorized(self) -> int:
        gateway = self.app.gateway
        assert gateway is not None
        return int(self.dgxmm.read(lambda: gateway.unauthorized))

    def via_litellm(self, path: str, body: object | None = None, method: str = "POST") -> Response:
        return http_request(
            self.proxy.url, method, path, body, self.proxy.auth, timeout_s=CLIENT_TIMEOUT_S
        )

    def direct(
        self, name: str, path: str, body: object | None = None, *, key: str | None = None,
        method: str = "POST", headers: dict[str, str] | None = None,
    ) -> Response:  # fmt: skip
        """Straight to the gateway, as anyone who can reach its port could."""
        sent = dict(headers or {})
        if key is not None:
            sent["authorization"] = f"Bearer {key}"
        return http_request(
            self.gateway_url, method, f"/d/{self.ids[name]}/v1/{path}", body, sent, 60.0
        )

    def loaded(self) -> bool:
        status = self.dgxmm.read(self.app.litellm.status)
        return bool(status["ok"] and status["loaded"])

    def wait_loaded(self) -> None:
        deadline = time.monotonic() + SYNC_S
        while not self.loaded():
            if time.monotonic() > deadline:
                pytest.fail(f"LiteLLM does not serve DGXMM's file:\n{self.proxy.log_tail()}")
            time.sleep(0.2)  # poll interval; the deadline bounds the wait


def _config(data_dir: Path, config_path: Path, litellm_url: str) -> Config:
    return Config(
        server=ServerConfig(data_dir=str(data_dir), admin_port=free_port(), gateway_port=0),
        memory=MemoryConfig(total_gib=8.0, reserve_gib=0.0, watchdog_threshold_gib=0.0),
        runtime=RuntimeConfig(kind="process"),
        litellm=LiteLLMConfig(
            enabled=True, backend="file", config_path=str(config_path), url=litellm_url
        ),
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary = require_litellm()
    data_dir = tmp_path_factory.mktemp("dgxmm-data")
    config_path = tmp_path_factory.mktemp("litellm-config") / "litellm.json"
    proxy = LiteLLMProxy(binary, config_path, tmp_path_factory.mktemp("litellm-run"))
    config = _config(data_dir, config_path, proxy.url)
    log_path = tmp_path_factory.mktemp("logs") / "dgxmm.log"
    cli_config = data_dir.parent / "cli.toml"
    cli_config.write_text(
        f'[server]\ndata_dir = "{data_dir}"\nadmin_port = {config.server.admin_port}\n'
    )
    stack: Stack | None = None
    with log_path.open("w") as log, pytest.MonkeyPatch.context() as env:
        # Everything DGXMM logs goes to one file the leak test reads.
        # From the defaults: an earlier test may have left a level filter (the what-if runs
        # and the fairness scenarios keep only warnings), which would hide the rotation line.
        structlog.reset_defaults()
        structlog.configure(logger_factory=structlog.WriteLoggerFactory(file=log))
        env.setenv("LITELLM_MASTER_KEY", proxy.master_key)
        try:
            stack = Stack(
                AppInThread(App(config)).start(), proxy, config_path, data_dir, log_path, cli_config
            )
            controller = stack.app.controller
            assert controller is not None
            for spec in SPECS:
                stack.ids[spec.name] = stack.dgxmm.run(controller.create(spec, "admin:e2e")).id
            deadline = time.monotonic() + READY_S
            while stack.dgxmm.read(lambda: {r.state for r in controller.records()}) != {"ready"}:
                assert time.monotonic() < deadline, "the deployments did not become ready"
                time.sleep(0.05)  # poll interval; the deadline bounds the wait
            stack.key()
            proxy.start()
            stack.wait_loaded()
            yield stack
        finally:
            proxy.stop()
            if stack is not None:
                stack.dgxmm.stop()
            stop_leftover_engines(data_dir)
            structlog.reset_defaults()


# --------------------------------------------------------------------------------------------
# Through LiteLLM: yes.  Around it: 401.


def chat(name: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        body["stream"] = True
    return body


def assert_refused(answer: Response) -> None:
    assert answer.status == 401, answer.body
    assert answer.headers.get("www-authenticate") == "Bearer"
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


@pytest.mark.parametrize("name", [OD, ALWAYS])
def test_a_chat_completion_passes_through_litellm_and_not_around_it(
    stack: Stack, name: str
) -> None:
    before = stack.unauthorized()
    answer = stack.via_litellm("/v1/chat/completions", chat(name))
    assert answer.status == 200, answer.body
    assert answer.json()["choices"][0]["message"]["content"]
    assert stack.unauthorized() == before  # LiteLLM's key was never refused
    assert_refused(stack.direct(name, "chat/completions", chat(name)))
    assert_refused(stack.direct(name, "chat/completions", chat(name), key="sk-guess"))
    mine = stack.direct(name, "chat/completions", chat(SERVED[name]), key=stack.key())
    assert mine.status == 200, mine.body
    assert stack.unauthorized() == before + 2


def test_a_stream_passes_through_litellm_and_not_around_it(stack: Stack) -> None:
    answer = stack.via_litellm("/v1/chat/completions", chat(OD, stream=True))
    assert answer.status == 200, answer.body
    assert sse_data(answer.body)[-1] == "[DONE]"
    refused = stack.direct(OD, "chat/completions", chat(OD, stream=True))
    assert_refused(refused)
    assert b"data:" not in refused.body


def test_embeddings_pass_through_litellm_and_not_around_it(stack: Stack) -> None:
    body = {"model": OD, "input": "hello"}
    answer = stack.via_litellm("/v1/embeddings", body)
    assert answer.status == 200, answer.body
    assert answer.json()["data"][0]["embedding"]
    assert_refused(stack.direct(OD, "embeddings", body))


def test_a_probe_passes_through_litellm_and_not_around_it(stack: Stack) -> None:
    before = stack.unauthorized()
    health = stack.via_litellm(f"/health?model={OD}", method="GET")
    assert health.status == 200, health.body
    assert health.json()["healthy_count"] == 1 and health.json()["unhealthy_count"] == 0
    assert stack.unauthorized() == before
    probe = {"x-dgxmm-health-check": "1"}
    assert_refused(stack.direct(OD, "chat/completions", chat(OD), headers=probe))
    answered = stack.direct(
        OD, "chat/completions", chat(SERVED[OD]), key=stack.key(), headers=probe
    )
    assert answered.status == 200 and answered.headers["x-dgxmm-ondemand-state"] == "ready"


def test_the_model_list_is_litellms_and_the_gateways_needs_the_key(stack: Stack) -> None:
    listed = stack.via_litellm("/v1/models", method="GET")
    assert listed.status == 200
    assert {OD, ALWAYS} <= {m["id"] for m in listed.json()["data"]}
    assert_refused(stack.direct(OD, "models", method="GET"))
    mine = stack.direct(OD, "models", method="GET", key=stack.key())
    assert mine.status == 200 and mine.json()["data"][0]["id"] == "key/od-1b"


# --------------------------------------------------------------------------------------------
# A rotation under load


@dataclass
class Load:
    """Clients sending chats (streamed or not) through LiteLLM until told to stop."""

    stack: Stack
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    resets: int = 0  # connections LiteLLM reset without an answer, retried
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, index: int) -> None:
        turn = 0
        while not self.stop.is_set():
            turn += 1
            name = (OD, ALWAYS)[(index + turn) % 2]
            stream = turn % 3 == 0
            try:
                answer = self.stack.via_litellm("/v1/chat/completions", chat(name, stream))
            except (ConnectionResetError, ConnectionRefusedError, http.client.RemoteDisconnected):
                with self.lock:
                    self.resets += 1
                continue  # no answer at all: retried, as the OpenAI SDK does
            except OSError as exc:  # a timeout: a failed request
                with self.lock:
                    self.failures.append(f"{name}: {exc!r}")
                continue
            good = answer.status == 200 and (not stream or sse_data(answer.body)[-1] == "[DONE]")
            with self.lock:
                if good:
                    self.ok += 1
                else:
                    self.failures.append(f"{name}: {answer.status} {answer.body[:200]!r}")


def rotate_with_the_cli(stack: Stack) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", "gateway-key", "rotate", "--config",
         str(stack.cli_config)],
        capture_output=True, text=True, timeout=240, cwd=PROJECT, check=False,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
    )  # fmt: skip


def test_a_key_rotation_under_load_through_litellm_fails_no_request(stack: Stack) -> None:
    keys = stack.app.gateway_keys
    assert keys is not None
    keys.grace_s = TEST_GRACE_S
    old = stack.key()
    before = stack.unauthorized()
    writes = stack.dgxmm.read(stack.app.litellm.status)["config_writes"]
    load = Load(stack)
    threads = [threading.Thread(target=load.run, args=(i,)) for i in range(LOAD_CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while load.ok < 20:  # the load is flowing before the rotation
            assert time.monotonic() < deadline and not load.failures, load.failures
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
        done = rotate_with_the_cli(stack)
        assert done.returncode == 0, done.stdout + done.stderr
        new = stack.key()
        assert new != old
        assert new not in done.stdout and old not in done.stdout  # fingerprints only
        assert "new key id" in done.stdout
        # The old key goes after the grace; the load runs on through it and beyond.
        deadline = time.monotonic() + SYNC_S
        while stack.dgxmm.read(keys.statistics)["previous_key_id"] is not None:
            assert time.monotonic() < deadline, "the old key was never retired"
            time.sleep(0.1)  # poll interval; the deadline bounds the wait
        settled = load.ok
        deadline = time.monotonic() + 30
        while load.ok < settled + 20:
            assert time.monotonic() < deadline, "no load after the rotation"
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(CLIENT_TIMEOUT_S + 10)
    print(f"\nrotation under load: {load.ok} answered 200, {len(load.failures)} failed, "
          f"{load.resets} connection resets retried")  # fmt: skip
    assert load.failures == []
    assert stack.unauthorized() == before  # LiteLLM never sent a key the gateway refused
    assert stack.dgxmm.read(stack.app.litellm.status)["config_writes"] == writes + 1
    assert_refused(stack.direct(OD, "chat/completions", chat(OD), key=old))
    assert stack.direct(OD, "chat/completions", chat(SERVED[OD]), key=new).status == 200
    entries = json.loads(stack.config_path.read_text())["model_list"]
    assert {e["litellm_params"]["api_key"] for e in entries} == {new}


# --------------------------------------------------------------------------------------------
# The key stays secret


def test_no_key_is_in_the_logs_the_api_the_ui_or_the_event_log(stack: Stack) -> None:
    stack.key()
    keys = sorted(stack.keys_seen)
    assert len(keys) >= 2, "run after the rotation: an old key and a new one"
    key_file = stack.data_dir / "gateway.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((stack.config_path).stat().st_mode) & 0o077 == 0  # LiteLLM's file too

    # The API: everything an admin can read (engine logs included), and /metrics.
    password = stack.app.admin_password
    assert password is not None
    admin_url = f"http://127.0.0.1:{stack.app.admin.port}"
    api = ApiClient(admin_url).login("admin", password)
    seen: dict[str, str] = {}
    paths = ["deployments", "litellm", "settings", "gateway-key", "audit", "queue", "memory"]
    for dep in stack.ids.values():
        paths += [f"deployments/{dep}", f"deployments/{dep}/events", f"deployments/{dep}/logs"]
    for path in paths:
        seen[f"api {path}"] = json.dumps(api.call("GET", path))
    # The UI: its pages and scripts as the browser gets them (its data is the API's, above).
    for path in ("/dgxmm/", "/metrics"):
        with api.opener.open(admin_url + path, timeout=30) as page:
            seen[f"ui {path}"] = page.read().decode(errors="replace")
    # The event log, as stored (the log file, its WAL) and as `dgxmm events` prints it.
    db = stack.app.config.server.db_path
    for suffix in ("", "-wal"):
        with contextlib.suppress(FileNotFoundError):
            seen[f"log{suffix}"] = Path(f"{db}{suffix}").read_bytes().decode("latin-1")
    events = subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", "events", "--db", str(db), "--json"],
        capture_output=True, text=True, timeout=60, cwd=PROJECT, check=False,
    )  # fmt: skip
    assert events.returncode == 0, events.stderr
    seen["dgxmm events"] = events.stdout
    # The CLI shows the fingerprint.
    shown = subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", "gateway-key", "show", "--config",
         str(stack.cli_config)],
        capture_output=True, text=True, timeout=60, cwd=PROJECT, check=False,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert json.loads(seen["api gateway-key"])["key_id"] in shown.stdout
    seen["dgxmm gateway-key show"] = shown.stdout
    # DGXMM's own log output (structlog), which says when keys were made and rotated.
    logged = stack.log_path.read_text()
    assert "gateway_key_rotated" in logged
    seen["logs"] = logged
    for where, text in seen.items():
        for key in keys:
            assert key not in text, f"a gateway key in {where}"
    # What is shown instead: the fingerprint.
    assert json.loads(seen["api gateway-key"])["key_id"]


def test_a_litellm_holding_a_stale_key_reports_an_authentication_error(stack: Stack) -> None:
    """Last in the module: LiteLLM cools the entry down after it."""
    access = stack.app.gateway.access if stack.app.gateway is not None else None
    assert access is not None
    current = stack.key()
    stack.dgxmm.read(lambda: access.set_keys(["a-key-litellm-does-not-hold"]))
    try:
        answer = stack.via_litellm("/v1/chat/completions", chat(ALWAYS))
    finally:
        stack.dgxmm.read(lambda: access.set_keys([current]))
    assert answer.status == 401, answer.body
    assert b"AuthenticationError" in answer.body and b"Incorrect API key provided" in answer.body
    assert current.encode() not in answer.body
