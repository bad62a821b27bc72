"""The operator's CLI against a real `dgxmm serve` (process runtime, simulated engines).

`ps`, `start`, `stop` and `logs` find the server through the configuration (`--config` or
`DGXMM_CONFIG`) and its token file; `user add --config` writes to the served database;
every gateway answer names its request id, and the id is the one the queue recorded.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dgxmm.engines.logs import RESTARTED
from events import model as m
from storage.eventlog import EventStore
from tests.browser_support import PROJECT_DIR, ApiClient, ApiFailure, Dgxmm, run_dgxmm, wait_for
from tests.gateway_support import gateway_auth

DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dgxmm]:
    tmp = tmp_path_factory.mktemp("cli-serve")
    with run_dgxmm(tmp) as server:
        yield server


@pytest.fixture(scope="module")
def admin(served: Dgxmm) -> ApiClient:
    return served.api()


def config_of(served: Dgxmm) -> Path:
    return served.data_dir.parent / "dgxmm.toml"


def dgxmm(
    served: Dgxmm, *args: str, stdin: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `python -m dgxmm ARGS` with the server's configuration in DGXMM_CONFIG."""
    return subprocess.run(
        [sys.executable, "-m", "dgxmm", *args],
        input=stdin, capture_output=True, text=True, cwd=PROJECT_DIR, timeout=60, check=False,
        env={**os.environ, "DGXMM_CONFIG": str(config_of(served)), **env},
    )  # fmt: skip


def deploy(
    admin: ApiClient, name: str, *, mode: str = "always_on", gib: float = 4
) -> dict[str, Any]:
    body = {
        "name": name, "engine": "sim", "model": f"test/{name}", "memory_gib": gib, "mode": mode,
        "args": ["--flavour", "llamacpp"],
    }  # fmt: skip
    created: dict[str, Any] = admin.call("POST", "deployments", body)
    return created


def asleep_on_demand(admin: ApiClient, name: str) -> dict[str, Any]:
    """An on-demand deployment that has run once (a cold start on record), now stopped."""
    dep = deploy(admin, name, mode="on_demand", gib=2)
    until_state(admin, name, "ready")
    admin.call("POST", f"deployments/{dep['id']}/stop")
    until_state(admin, name, "stopped")
    return dep


def http_get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    """GET on loopback: status, the response (for its headers) and the body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp, resp.read()
    finally:
        conn.close()


def state_of(admin: ApiClient, name: str) -> str:
    return str(admin.deployment(name)["state"])


def until_state(admin: ApiClient, name: str, state: str) -> None:
    wait_for(
        f"{name} {state}", lambda: True if state_of(admin, name) == state else None, DEADLINE_S
    )


def test_ps_lists_each_deployment_with_engine_mode_state_memory_and_traffic(
    served: Dgxmm, admin: ApiClient
) -> None:
    deploy(admin, "ps-one", gib=2)
    until_state(admin, "ps-one", "ready")
    done = dgxmm(served, "ps")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["NAME", "ENGINE", "MODE", "STATE", "MEMORY", "IN", "FLIGHT",
                              "QUEUED", "START", "(EST.)", "LAST", "USED"]  # fmt: skip
    row = next(r for r in rows if r.startswith("ps-one ")).split()
    assert row[:9] == ["ps-one", "sim", "always", "on", "Ready", "2", "GiB", "0", "0"]
    assert row[9] == "est." and row[10].endswith("s")  # its one start so far
    assert row[11:] == ["never"]


def test_stop_and_start_by_name_change_the_deployment_on_the_server(
    served: Dgxmm, admin: ApiClient
) -> None:
    deploy(admin, "cli-toggle", gib=2)
    until_state(admin, "cli-toggle", "ready")
    stopped = dgxmm(served, "stop", "cli-toggle", "--config", str(config_of(served)))
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith("cli-toggle: ")
    until_state(admin, "cli-toggle", "stopped")
    started = dgxmm(served, "start", "cli-toggle")
    assert started.returncode == 0, started.stderr
    until_state(admin, "cli-toggle", "ready")
    missing = dgxmm(served, "start", "no-such-deployment")
    assert missing.returncode == 1
    said, refused = missing.stderr.splitlines()
    assert said.startswith("dgxmm: server http://") and "from DGXMM_CONFIG=" in said, said
    assert refused == "dgxmm: start: no deployment no-such-deployment"


def test_ps_without_a_running_server_says_how_to_fix_it(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[server]\ndata_dir = "{tmp_path}"\nadmin_port = 1\n')
    done = subprocess.run(
        [sys.executable, "-m", "dgxmm", "ps", "--config", str(config)],
        capture_output=True, text=True, cwd=PROJECT_DIR, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "cannot reach DGXMM at http://127.0.0.1:1" in done.stderr
    assert "is `dgxmm serve` running with this configuration?" in done.stderr


class _Lines:
    """The stdout of a running command, line by line, read on a thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        assert process.stdout is not None
        threading.Thread(target=self._read, args=(process.stdout,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def until(self, check: Any, timeout_s: float = DEADLINE_S) -> list[str]:
        seen: list[str] = []
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"not within {timeout_s}s; saw {seen}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            seen.append(line)
            if check(line):
                return seen


def test_logs_follow_prints_new_lines_and_goes_on_across_a_restart(
    served: Dgxmm, admin: ApiClient
) -> None:
    deploy(admin, "cli-logs", gib=2)
    until_state(admin, "cli-logs", "ready")
    tail = dgxmm(served, "logs", "cli-logs", "--tail", "1")
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout.startswith("INFO:     Application startup complete")
    process = subprocess.Popen(
        [sys.executable, "-m", "dgxmm", "logs", "cli-logs", "-f", "--tail", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=PROJECT_DIR,
        env={**os.environ, "DGXMM_CONFIG": str(config_of(served)), "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        out = _Lines(process)
        first = out.until(lambda line: "Application startup complete" in line)
        assert "bound to" in first[0]
        admin.call("POST", "deployments/cli-logs/stop")
        until_state(admin, "cli-logs", "stopped")
        admin.call("POST", "deployments/cli-logs/start")
        later = out.until(lambda line: "Application startup complete" in line)
        assert RESTARTED in later
        assert any("bound to" in line for line in later[later.index(RESTARTED) :])
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_user_add_with_config_reaches_the_served_database_and_its_token_works_at_once(
    served: Dgxmm, admin: ApiClient
) -> None:
    done = dgxmm(served, "user", "add", "carol", "--role", "viewer", "--password-stdin",
                 stdin="carol-password\n")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"added viewer carol to {served.db_path}\n"
    carol = ApiClient(served.base_url).login("carol", "carol-password")  # a session at once
    assert carol.call("GET", "session")["user"] == "carol"
    token = admin.call("POST", "tokens", {"user": "carol"})["token"]
    began = time.monotonic()
    status, _, raw = http_get(
        served.admin_port, "/dgxmm/api/session", {"authorization": f"Bearer {token}"}
    )
    body = json.loads(raw)
    assert status == 200, body  # before the fix: 401 invalid_token for about 2 s
    assert (body["user"], body["via"]) == ("carol", "token")
    assert time.monotonic() - began < 1.0


def test_every_gateway_answer_names_its_request_and_a_waited_one_is_in_the_queue_events(
    served: Dgxmm, admin: ApiClient
) -> None:
    dep = asleep_on_demand(admin, "cli-rid")

    def chat() -> tuple[int, str | None]:
        conn = http.client.HTTPConnection("127.0.0.1", served.gateway_port, timeout=60)
        try:
            body = {"model": "test/cli-rid", "messages": [{"role": "user", "content": "Hi"}]}
            conn.request("POST", f"/d/{dep['id']}/v1/chat/completions", body=json.dumps(body),
                         headers={"content-type": "application/json",
                                  **gateway_auth(served.data_dir)})  # fmt: skip
            resp = conn.getresponse()
            resp.read()
            return resp.status, resp.getheader("x-dgxmm-request-id")
        finally:
            conn.close()

    waited_status, waited_id = chat()  # it waits for the start
    served_status, served_id = chat()  # ready now: served at once
    assert (waited_status, served_status) == (200, 200)
    assert waited_id is not None and served_id is not None and waited_id != served_id
    assert waited_id.isdigit() and int(served_id) > int(waited_id)

    async def queue_ids() -> set[str]:
        store = await EventStore.open(served.db_path, create=False, readonly=True)
        try:
            recs = await store.read(stream=m.STREAM_QUEUE)
        finally:
            await store.close()
        return {r.event.request_id for r in recs if isinstance(r.event, m.RequestQueued)}

    ids = wait_for("the queue event", lambda: (lambda s: s if waited_id in s else None)(
        asyncio.run(queue_ids())), 10)  # fmt: skip
    assert served_id not in ids
    story = dgxmm(served, "replay", "--request", waited_id)  # the log from the configuration
    assert story.returncode == 0, story.stderr
    assert waited_id in story.stdout and "cli-rid" in story.stdout
    status, missing, _ = http_get(
        served.gateway_port, "/d/nope/v1/models", gateway_auth(served.data_dir)
    )
    assert status == 404 and missing.getheader("x-dgxmm-request-id", "").isdigit()


def test_healthz_answers_200_and_503_with_the_reason_when_the_log_is_read_only(
    served: Dgxmm,
) -> None:
    def healthz() -> tuple[int, Any]:
        status, _, raw = http_get(served.admin_port, "/healthz")
        return status, json.loads(raw)

    assert healthz() == (200, {"status": "ok"})
    mode = served.db_path.stat().st_mode
    served.db_path.chmod(0o444)
    try:
        status, body = healthz()
    finally:
        served.db_path.chmod(mode)
    assert status == 503
    assert body == {
        "status": "unavailable",
        "reasons": [f"the event log {served.db_path} is not writable"],
    }
    assert healthz()[0] == 200


def test_the_cli_token_file_is_readable_by_its_owner_only(served: Dgxmm) -> None:
    path = served.data_dir / "cli.json"
    assert path.stat().st_mode & 0o777 == 0o600
    data = json.loads(path.read_text())
    assert data["url"] == served.base_url
    with pytest.raises(ApiFailure):
        ApiClient(served.base_url).call("GET", "deployments")  # no token, no session


def test_metrics_have_cold_start_queue_wait_and_first_byte_histograms_per_deployment(
    served: Dgxmm, admin: ApiClient
) -> None:
    dep = asleep_on_demand(admin, "cli-hist")
    status, _ = served.chat(dep["id"], "test/cli-hist")  # waits for a cold start
    assert status == 200
    token = json.loads((served.data_dir / "cli.json").read_text())["token"]

    def scrape() -> str:
        status, _, raw = http_get(
            served.admin_port, "/metrics", {"authorization": f"Bearer {token}"}
        )
        assert status == 200
        return raw.decode()

    def count(text: str, metric: str) -> int:
        prefix = f'{metric}_count{{deployment="cli-hist",id="{dep["id"]}"}} '
        line = next((x for x in text.splitlines() if x.startswith(prefix)), None)
        return int(line.removeprefix(prefix)) if line else 0

    text = wait_for(
        "the queue wait in the histogram",
        lambda: t if count(t := scrape(), "dgxmm_queue_wait_seconds") == 1 else None,
        10,
    )
    assert count(text, "dgxmm_cold_start_seconds") == 2  # created, then started for the request
    assert count(text, "dgxmm_gateway_time_to_first_byte_seconds") == 1
    assert "# TYPE dgxmm_cold_start_seconds histogram" in text
