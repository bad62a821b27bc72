"""ConfigFileSync: writes at once, checks LiteLLM in the background (double: reloads at once)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from actors.errors import SyncFailed
from actors.ports import ModelEntry
from dgxmm.litellm.entries import READY, Registration, desired_entries
from dgxmm.litellm.filesync import ConfigFileSync
from tests.litellm_double import LiteLLMDouble
from tests.litellm_support import free_port

GATEWAY = "http://127.0.0.1:8401"
KEY = "sk-" + secrets.token_hex(8)
DEADLINE_S = 10.0  # the background check looks every 0.05-0.2 s here


def entries(*specs: tuple[str, str], stable: bool = False) -> list[ModelEntry]:
    """Desired entries for (deployment_id, mode) pairs, all ready."""
    regs = [
        Registration(
            deployment_id=dep,
            model_name=f"model-{dep}",
            served_model=f"org/{dep}",
            mode=mode,  # type: ignore[arg-type]
            state=READY,
            engine_url="http://127.0.0.1:9001",
        )
        for dep, mode in specs
    ]
    return desired_entries(regs, GATEWAY, 900, stable=stable)


class RecordingFileSync(ConfigFileSync):
    """Remembers every document it wrote."""

    written: list[dict[str, Any]]

    def _write(self, document: Mapping[str, Any]) -> None:
        self.written = [*getattr(self, "written", []), json.loads(json.dumps(document))]
        super()._write(document)


def file_sync(path: Path, url: str, key: str | None = KEY) -> RecordingFileSync:
    return RecordingFileSync(path, url, key, check_first_s=0.05, check_max_s=0.2)


def ids(document: Mapping[str, Any]) -> list[str]:
    return [item["model_info"]["id"] for item in document["model_list"] if "model_info" in item]


def sync_with_double(
    path: Path, wanted: list[ModelEntry], reloads: bool = True
) -> RecordingFileSync:
    """Sync `wanted` into `path` with a double that reloads at once (or never); wait for it."""

    async def main() -> RecordingFileSync:
        config_path = path if reloads else None
        async with LiteLLMDouble(KEY, db_connected=False, config_path=config_path) as double:
            sync = file_sync(path, double.url)
            try:
                await sync.sync(wanted)
                if reloads:
                    await sync.wait_until_loaded(DEADLINE_S)
            finally:
                await sync.close()
            return sync

    return asyncio.run(main())


def test_a_missing_file_is_created_with_the_entries_and_default_settings(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    sync_with_double(path, entries(("a", "on_demand")))
    document = json.loads(path.read_text())
    assert ids(document) == ["dgxmm-a-gw"]
    assert document["general_settings"] == {"disable_model_info_refresh": True}


def test_a_missing_file_is_written_even_with_no_deployments(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    sync = sync_with_double(path, [])
    assert json.loads(path.read_text())["model_list"] == []
    assert sync.load_status().config_writes == 1
    assert sync.load_status().loaded is True


def test_settings_and_foreign_entries_in_the_file_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    operator = {"model_name": "gpt", "litellm_params": {"model": "openai/gpt"}}
    path.write_text(
        json.dumps(
            {
                "model_list": [operator],
                "litellm_settings": {"request_timeout": 1800},
                "general_settings": {"disable_model_info_refresh": False, "alerting": []},
                "router_settings": {"routing_strategy": "simple-shuffle"},
            }
        )
    )
    sync_with_double(path, entries(("a", "always_on")))
    document = json.loads(path.read_text())
    assert document["model_list"][0] == operator
    assert ids(document) == ["dgxmm-a"]
    assert document["litellm_settings"] == {"request_timeout": 1800}
    assert document["general_settings"] == {"disable_model_info_refresh": False, "alerting": []}
    assert document["router_settings"] == {"routing_strategy": "simple-shuffle"}


def test_an_unchanged_model_list_is_not_written_again(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    wanted = entries(("a", "on_demand"), ("b", "always_on"))
    sync_with_double(path, wanted)
    before = path.stat()
    again = sync_with_double(path, wanted)
    assert getattr(again, "written", []) == []
    assert again.load_status().config_writes == 0 and again.load_status().loaded is True
    assert path.stat().st_ino == before.st_ino and path.stat().st_mtime_ns == before.st_mtime_ns


def test_the_file_is_replaced_atomically_and_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    path.write_text("{}")
    os.chmod(path, 0o640)
    before = path.stat().st_ino
    sync_with_double(path, entries(("a", "on_demand")))
    assert path.stat().st_ino != before  # a new file renamed over the old one
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["litellm.json"]


def test_a_change_is_one_write_of_the_final_model_list(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    sync_with_double(path, entries(("a", "on_demand"), ("b", "on_demand")))
    switched = sync_with_double(path, entries(("a", "always_on"), ("b", "on_demand")))
    [final] = switched.written  # one write, so one restart of LiteLLM's worker
    assert sorted(ids(final)) == ["dgxmm-a", "dgxmm-b-gw"]
    assert json.loads(path.read_text()) == final


def test_with_stable_entries_a_mode_switch_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    sync_with_double(path, entries(("a", "on_demand"), ("b", "always_on"), stable=True))
    switched = sync_with_double(path, entries(("a", "always_on"), ("b", "on_demand"), stable=True))
    assert getattr(switched, "written", []) == []


def test_a_change_keeps_foreign_entries_and_settings_in_its_one_write(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    operator = {"model_name": "gpt", "litellm_params": {"model": "openai/gpt"}}
    other_box = {"model_name": "x", "litellm_params": {}, "model_info": {"id": "b2-dgxmm-a"}}
    path.write_text(
        json.dumps({"model_list": [operator, other_box], "router_settings": {"num_retries": 1}})
    )
    sync_with_double(path, entries(("a", "on_demand")))
    switched = sync_with_double(path, entries(("a", "always_on")))
    [final] = switched.written
    assert final["model_list"][:2] == [operator, other_box]
    assert ids(final) == ["b2-dgxmm-a", "dgxmm-a"]
    assert final["router_settings"] == {"num_retries": 1}
    assert final["general_settings"] == {"disable_model_info_refresh": True}


def test_the_file_is_written_at_once_while_litellm_is_down_and_that_is_a_status(
    tmp_path: Path,
) -> None:
    path = tmp_path / "litellm.json"

    async def main() -> None:
        sync = file_sync(path, f"http://127.0.0.1:{free_port()}")
        try:
            async with asyncio.timeout(2):  # no wait for LiteLLM (it used to be up to 120 s)
                await sync.sync(entries(("a", "on_demand")))
                await sync.sync(entries(("a", "on_demand"), ("b", "on_demand")))
            assert ids(json.loads(path.read_text())) == ["dgxmm-a-gw", "dgxmm-b-gw"]
            assert sync.status().ok is True
            with pytest.raises(SyncFailed, match="connection refused"):
                await sync.wait_until_loaded(0.5)
            status = sync.load_status()
            assert status.config_writes == 2 and status.last_write_at is not None
            assert status.loaded is False
            assert status.load_error is not None
            assert "LiteLLM reads the file when it starts" in status.load_error
        finally:
            await sync.close()

    asyncio.run(main())


def test_a_litellm_started_after_the_write_is_seen_to_load_it(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"

    async def main() -> None:
        port = free_port()
        sync = file_sync(path, f"http://127.0.0.1:{port}")
        try:
            await sync.sync(entries(("a", "on_demand")))
            assert sync.load_status().loaded is False
            async with LiteLLMDouble(KEY, db_connected=False, config_path=path, port=port):
                await sync.wait_until_loaded(DEADLINE_S)
            status = sync.load_status()
            assert status.loaded is True and status.load_error is None
            assert status.loaded_at is not None and status.config_writes == 1
        finally:
            await sync.close()

    asyncio.run(main())


def test_a_litellm_that_does_not_reload_is_reported_with_a_hint_and_the_sync_succeeds(
    tmp_path: Path,
) -> None:
    path = tmp_path / "litellm.json"

    async def main() -> None:
        async with LiteLLMDouble(KEY, db_connected=False) as double:  # never reads the file
            sync = file_sync(path, double.url)
            try:
                await sync.sync(entries(("a", "on_demand")))
                with pytest.raises(SyncFailed, match="--reload"):
                    await sync.wait_until_loaded(1.0)
                assert sync.status().ok is True
                error = sync.load_status().load_error
                assert error is not None and "missing or older: dgxmm-a-gw" in error
                assert f"--config {path} --reload" in error
            finally:
                await sync.close()

    asyncio.run(main())
    assert ids(json.loads(path.read_text())) == ["dgxmm-a-gw"]  # written all the same


def test_without_a_master_key_the_file_is_written_and_loading_is_unknown(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"

    async def main() -> None:
        sync = file_sync(path, f"http://127.0.0.1:{free_port()}", key=None)
        try:
            await sync.sync(entries(("a", "on_demand")))
            with pytest.raises(SyncFailed, match="LITELLM_MASTER_KEY"):
                await sync.wait_until_loaded(0.5)
            status = sync.load_status()
            assert status.config_writes == 1 and status.loaded is None
        finally:
            await sync.close()

    asyncio.run(main())
    assert ids(json.loads(path.read_text())) == ["dgxmm-a-gw"]


def test_a_file_that_is_not_json_is_left_alone_and_named(tmp_path: Path) -> None:
    path = tmp_path / "litellm.yaml"
    path.write_text("model_list:\n  - model_name: gpt\n")
    with pytest.raises(SyncFailed, match="is not JSON"):
        sync_with_double(path, entries(("a", "on_demand")))
    assert path.read_text() == "model_list:\n  - model_name: gpt\n"


def test_an_unwritable_directory_fails_with_the_path(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "litellm.json"
    with pytest.raises(SyncFailed, match="cannot write LiteLLM config"):
        sync_with_double(path, entries(("a", "on_demand")))


def test_a_wrong_master_key_is_reported_as_such_and_the_file_is_written(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"

    async def main() -> None:
        async with LiteLLMDouble(KEY, db_connected=False, config_path=path) as double:
            sync = file_sync(path, double.url, key="sk-not-the-master-key")
            try:
                await sync.sync(entries(("a", "on_demand")))
                with pytest.raises(SyncFailed, match="refused the master key"):
                    await sync.wait_until_loaded(1.0)
                error = sync.load_status().load_error
                assert error is not None and "reads the file when it starts" not in error
            finally:
                await sync.close()

    asyncio.run(main())
    assert ids(json.loads(path.read_text())) == ["dgxmm-a-gw"]
