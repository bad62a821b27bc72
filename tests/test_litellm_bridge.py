"""The bridge in a real DGXMM (`App`, real SQLite, loopback) with LiteLLM down: no start-order trap.

The file back-end writes LiteLLM's config file at start-up, even with no deployments, and at
once on every change; LiteLLM being down is a status (the API's and /metrics', whose rendering
over HTTP is checked here too), not a stall.  The whole path through a real LiteLLM is in
test_litellm_e2e.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.controller import DeploymentSpec
from actors.memory_broker import GIB
from dgxmm.admin.metrics import litellm_families, render
from dgxmm.app import App
from dgxmm.config import Config, LiteLLMConfig, MemoryConfig, RuntimeConfig, ServerConfig
from tests.api_support import Box, run_box
from tests.litellm_support import AppInThread, free_port, stop_leftover_engines
from tests.test_api_stream import parse_exposition

DEADLINE_S = 20.0


def _app(tmp_path: Path, litellm_port: int, key: str | None = "sk-test") -> tuple[App, Path]:
    config_path = tmp_path / "litellm.json"
    config = Config(
        server=ServerConfig(
            data_dir=str(tmp_path / "data"), admin_port=free_port(), gateway_port=free_port()
        ),
        memory=MemoryConfig(total_gib=8.0, reserve_gib=0.0, watchdog_threshold_gib=0.0),
        runtime=RuntimeConfig(kind="process"),
        litellm=LiteLLMConfig(
            enabled=True,
            backend="file",
            config_path=str(config_path),
            url=f"http://127.0.0.1:{litellm_port}",
        ),
    )
    return App(config), config_path


def _wait(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)  # poll interval; the deadline bounds the wait


def _model_list(path: Path) -> list[dict[str, Any]] | None:
    try:
        items: list[dict[str, Any]] = json.loads(path.read_text())["model_list"]
    except (OSError, ValueError, KeyError):
        return None
    return items


@pytest.fixture
def running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[AppInThread, App, Path]]:
    """DGXMM with the file back-end, LiteLLM down; its engines stopped at the end."""
    monkeypatch.setenv("LITELLM_MASTER_KEY", "sk-test")
    app, config_path = _app(tmp_path, free_port())
    dgxmm = AppInThread(app).start()
    try:
        yield dgxmm, app, config_path
    finally:
        dgxmm.stop()
        stop_leftover_engines(tmp_path / "data")


def test_dgxmm_writes_an_empty_model_list_at_start_up_while_litellm_is_down(
    running: tuple[AppInThread, App, Path],
) -> None:
    dgxmm, app, config_path = running
    _wait(lambda: dgxmm.read(app.litellm.status)["loaded"] is False, "the load check")
    assert _model_list(config_path) == []
    status = dgxmm.read(app.litellm.status)
    assert status["ok"] is True and status["config_writes"] == 1
    assert status["last_write_at"] is not None
    assert "connection refused" in status["load_error"]
    text = render(litellm_families(status))
    assert "dgxmm_litellm_config_writes_total 1\n" in text
    assert "dgxmm_litellm_config_loaded 0\n" in text
    assert "dgxmm_litellm_sync_ok 1\n" in text
    # No reload_command: LiteLLM's --reload watches the file; none seen loaded yet.
    assert status["reload"]["mode"] == "watch" and status["reload"]["reloads"] == 0
    assert 'dgxmm_litellm_reload_mode{mode="watch"} 1\n' in text
    assert "dgxmm_litellm_reloads_total 0\n" in text


def test_a_deployment_reaches_the_file_at_once_and_its_state_changes_write_nothing(
    running: tuple[AppInThread, App, Path],
) -> None:
    dgxmm, app, config_path = running
    controller = app.controller
    _wait(lambda: dgxmm.read(app.litellm.status)["config_writes"] == 1, "the start-up write")
    spec = DeploymentSpec(
        name="bridge-od", engine="sim", model="t/od", memory_bytes=1 * GIB, mode="on_demand"
    )
    dep_id = dgxmm.run(controller.create(spec, "admin:t")).id
    _wait(lambda: dgxmm.read(app.litellm.status)["config_writes"] == 2, "the creation's write")
    [entry] = _model_list(config_path) or []
    assert entry["model_info"]["id"] == f"box-dgxmm-{dep_id}-gw"
    written = config_path.stat().st_mtime_ns
    writes = dgxmm.read(app.litellm.status)["config_writes"]
    _wait(lambda: dgxmm.read(lambda: controller.records()[0].state) == "ready", "ready")
    dgxmm.run(controller.change_mode(dep_id, "always_on", None, True, "admin:t"))
    dgxmm.run(controller.stop(dep_id, "admin:t"))
    _wait(lambda: dgxmm.read(lambda: controller.records()[0].state) == "stopped", "stopped")
    dgxmm.run(controller.change_mode(dep_id, "on_demand", None, True, "admin:t"))
    dgxmm.run(app.litellm.sync_now())  # a forced sync: it would write if anything differed
    assert config_path.stat().st_mtime_ns == written
    assert dgxmm.read(app.litellm.status)["config_writes"] == writes
    dgxmm.run(controller.remove(dep_id, "admin:t"))
    # The file is renamed into place just before the count is taken: wait on the count.
    _wait(lambda: dgxmm.read(app.litellm.status)["config_writes"] == writes + 1, "a write")
    assert _model_list(config_path) == []


def test_metrics_count_the_litellm_restarts_dgxmm_caused_and_say_whether_it_loaded(
    tmp_path: Path,
) -> None:
    status = {
        "enabled": True,
        "ok": True,
        "backend": "file",
        "config_writes": 3,
        "last_write_at": 1700000000.0,
        "loaded": None,
    }

    async def t(box: Box) -> None:
        alice = await box.login()
        reply = await alice.call("GET", "/metrics")
        assert reply.status == 200
        fams = parse_exposition(reply.body.decode())
        assert fams["dgxmm_litellm_config_writes_total"] == [("", 3.0)]
        assert fams["dgxmm_litellm_config_loaded"] == [("", -1.0)]  # not known
        assert fams["dgxmm_litellm_sync_ok"] == [("", 1.0)]
        last = fams["dgxmm_litellm_config_last_write_timestamp_seconds"]
        assert last == [("", 1700000000.0)]

    run_box(tmp_path, t, litellm=status)
