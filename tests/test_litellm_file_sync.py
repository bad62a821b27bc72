"""ConfigFileSync against the double, which reloads LiteLLM's config file at once."""

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
from dgxmm.litellm.sync import READY, ConfigFileSync, Registration, desired_entries
from tests.litellm_double import LiteLLMDouble

GATEWAY = "http://127.0.0.1:8401"
KEY = "sk-" + secrets.token_hex(8)


def entries(*specs: tuple[str, str]) -> list[ModelEntry]:
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
    return desired_entries(regs, GATEWAY, 900)


class RecordingFileSync(ConfigFileSync):
    """Remembers every document it wrote."""

    written: list[dict[str, Any]]

    def _write(self, document: Mapping[str, Any]) -> None:
        self.written = [*getattr(self, "written", []), json.loads(json.dumps(document))]
        super()._write(document)


def ids(document: Mapping[str, Any]) -> list[str]:
    return [item["model_info"]["id"] for item in document["model_list"] if "model_info" in item]


def sync_with_double(
    path: Path, wanted: list[ModelEntry], reloads: bool = True
) -> RecordingFileSync:
    """Sync `wanted` into `path`, with a double that reloads the file at once (or never)."""

    async def main() -> RecordingFileSync:
        config_path = path if reloads else None
        async with LiteLLMDouble(KEY, db_connected=False, config_path=config_path) as double:
            sync = RecordingFileSync(path, double.url, KEY, reload_timeout_s=2.0)
            await sync.sync(wanted)
            return sync

    return asyncio.run(main())


def test_a_missing_file_is_created_with_the_entries_and_default_settings(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    sync_with_double(path, entries(("a", "on_demand")))
    document = json.loads(path.read_text())
    assert ids(document) == ["dgxmm-a-gw"]
    assert document["general_settings"] == {"disable_model_info_refresh": True}


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


def test_a_mode_switch_is_one_write_of_the_final_model_list(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    sync_with_double(path, entries(("a", "on_demand"), ("b", "on_demand")))
    switched = sync_with_double(path, entries(("a", "always_on"), ("b", "on_demand")))
    [final] = switched.written  # one write, so one restart of LiteLLM's worker
    assert sorted(ids(final)) == ["dgxmm-a", "dgxmm-b-gw"]
    assert json.loads(path.read_text()) == final


def test_a_mode_switch_keeps_foreign_entries_and_settings_in_its_one_write(tmp_path: Path) -> None:
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


def test_a_sync_that_changes_nothing_still_waits_for_litellm_to_serve_it(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    wanted = entries(("a", "on_demand"))
    sync_with_double(path, wanted)
    with pytest.raises(SyncFailed, match="--reload"):
        sync_with_double(path, wanted, reloads=False)  # this LiteLLM never loaded the file
    assert ids(json.loads(path.read_text())) == ["dgxmm-a-gw"]


def test_a_litellm_that_does_not_reload_fails_the_sync_with_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"
    with pytest.raises(SyncFailed, match="--reload"):
        sync_with_double(path, entries(("a", "on_demand")), reloads=False)
    assert ids(json.loads(path.read_text())) == ["dgxmm-a-gw"]  # written all the same


def test_a_mode_switch_that_litellm_never_loads_is_written_and_fails_the_sync(
    tmp_path: Path,
) -> None:
    path = tmp_path / "litellm.json"
    sync_with_double(path, entries(("a", "on_demand")))
    with pytest.raises(SyncFailed, match="--reload"):
        sync_with_double(path, entries(("a", "always_on")), reloads=False)
    assert ids(json.loads(path.read_text())) == ["dgxmm-a"]  # the next sync only waits


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
