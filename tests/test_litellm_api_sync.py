"""ApiSync against the double of LiteLLM's model-management API, over loopback sockets."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from actors.errors import SyncFailed
from actors.ports import ModelEntry
from dgxmm.litellm.entries import READY, Registration, desired_entries, litellm_deployment
from dgxmm.litellm.filesync import ConfigFileSync
from dgxmm.litellm.sync import ApiSync, DisabledSync, LiteLLMSettings, make_sync
from tests.litellm_double import LiteLLMDouble
from tests.litellm_support import free_port

GATEWAY = "http://127.0.0.1:8401"
KEY = "sk-" + secrets.token_hex(8)


def entries(*specs: tuple[str, str], box_id: str = "") -> list[ModelEntry]:
    """Desired entries for (deployment_id, mode) pairs, all ready."""
    regs = [
        Registration(
            deployment_id=dep,
            model_name=f"model-{dep}",
            served_model=f"org/{dep}",
            mode=mode,  # type: ignore[arg-type]
            state=READY,
            engine_url="http://127.0.0.1:9001",
            box_id=box_id,
        )
        for dep, mode in specs
    ]
    return desired_entries(regs, GATEWAY, 900)


def run(test: Callable[[LiteLLMDouble], Awaitable[None]], **double_options: Any) -> None:
    """Run `test` with a started double, on a fresh event loop."""

    async def main() -> None:
        async with LiteLLMDouble(KEY, **double_options) as double:
            await test(double)

    asyncio.run(main())


def live_ids(double: LiteLLMDouble) -> set[str]:
    return set(double.db)


def test_sync_adds_every_missing_entry() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        await sync.sync(entries(("a", "on_demand"), ("b", "always_on")))
        assert live_ids(double) == {"dgxmm-a-gw", "dgxmm-b"}
        stored = double.db["dgxmm-a-gw"]
        assert stored == litellm_deployment(entries(("a", "on_demand"))[0])

    run(test)


def test_sync_sends_the_master_key_as_a_bearer_token() -> None:
    async def test(double: LiteLLMDouble) -> None:
        with pytest.raises(SyncFailed, match="refused the master key"):
            await ApiSync(double.url, "sk-wrong").sync(entries(("a", "on_demand")))
        await ApiSync(double.url, KEY).sync(entries(("a", "on_demand")))
        assert live_ids(double) == {"dgxmm-a-gw"}

    run(test)


def test_a_second_sync_of_the_same_entries_writes_nothing() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        wanted = entries(("a", "on_demand"), ("b", "always_on"))
        await sync.sync(wanted)
        writes = len(double.writes())
        await sync.sync(wanted)
        assert len(double.writes()) == writes

    run(test)


def test_a_mode_switch_adds_the_new_entry_before_it_removes_the_old() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        await sync.sync(entries(("a", "on_demand")))
        double.calls.clear()
        await sync.sync(entries(("a", "always_on")))
        assert double.writes() == [("new", "dgxmm-a"), ("delete", "dgxmm-a-gw")]
        assert live_ids(double) == {"dgxmm-a"}

    run(test)


def test_a_changed_entry_is_updated_in_place() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        await sync.sync(entries(("a", "always_on")))
        [entry] = entries(("a", "always_on"))
        moved = [msgspec.structs.replace(entry, api_base="http://127.0.0.1:9555/v1")]
        double.calls.clear()
        await sync.sync(moved)
        assert double.writes() == [("update", "dgxmm-a")]
        assert double.db["dgxmm-a"]["litellm_params"]["api_base"] == "http://127.0.0.1:9555/v1"

    run(test)


def test_entries_of_failed_deployments_are_removed() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        await sync.sync(entries(("a", "on_demand"), ("b", "on_demand")))
        await sync.sync(entries(("a", "on_demand")))
        assert live_ids(double) == {"dgxmm-a-gw"}

    run(test)


def test_entries_of_other_boxes_and_of_the_operator_are_left_alone() -> None:
    async def test(double: LiteLLMDouble) -> None:
        other_box = litellm_deployment(entries(("z", "on_demand"), box_id="spark2")[0])
        operator = {
            "model_name": "gpt-4o",
            "litellm_params": {"model": "openai/gpt-4o"},
            "model_info": {"id": "op-1"},
        }
        double.add_entry(other_box)
        double.add_entry(operator)
        await ApiSync(double.url, KEY).sync([])
        assert live_ids(double) == {"spark2-dgxmm-z-gw", "op-1"}

    run(test)


def test_sync_converges_after_litellm_restarts_with_an_empty_database() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        wanted = entries(("a", "on_demand"), ("b", "always_on"))
        await sync.sync(wanted)
        await double.stop()
        with pytest.raises(SyncFailed, match="cannot reach LiteLLM"):
            await sync.sync(wanted)
        assert sync.status().ok is False
        double.db.clear()
        await double.start()
        await sync.sync(wanted)
        assert live_ids(double) == {"dgxmm-a-gw", "dgxmm-b"}
        assert sync.status().ok is True

    run(test)


def test_a_restarted_dgxmm_removes_what_it_no_longer_wants() -> None:
    async def test(double: LiteLLMDouble) -> None:
        await ApiSync(double.url, KEY).sync(entries(("a", "on_demand"), ("b", "on_demand")))
        fresh = ApiSync(double.url, KEY)  # no memory of the earlier sync
        await fresh.sync(entries(("b", "always_on")))
        assert live_ids(double) == {"dgxmm-b"}

    run(test)


def test_an_add_refused_because_the_id_exists_becomes_an_update() -> None:
    async def test(double: LiteLLMDouble) -> None:
        [wanted] = entries(("a", "on_demand"))
        # Another LiteLLM worker already stored the entry, but this one does not list it yet.
        double.fail_next("GET", "/model/info", 200, {"data": []})
        double.add_entry(litellm_deployment(wanted) | {"model_name": "stale"})
        await ApiSync(double.url, KEY).sync([wanted])
        assert double.writes() == [("new", "dgxmm-a-gw"), ("update", "dgxmm-a-gw")]
        assert double.db["dgxmm-a-gw"]["model_name"] == "model-a"

    run(test)


def test_removing_an_entry_that_is_already_gone_is_not_an_error() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        await sync.sync(entries(("a", "on_demand")))
        listing = {"data": [litellm_deployment(entries(("a", "on_demand"))[0])]}
        double.db.clear()  # removed meanwhile; this worker still lists it once
        double.fail_next("GET", "/model/info", 200, listing)
        await sync.sync([])
        assert sync.status().ok

    run(test)


def test_an_entry_from_litellms_config_file_cannot_be_removed_and_says_so() -> None:
    stale = litellm_deployment(entries(("a", "on_demand"))[0])

    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        with pytest.raises(SyncFailed, match="config file"):
            await sync.sync([])
        assert "dgxmm-a-gw" in (sync.status().error or "")

    run(test, config_entries=[stale])


def test_a_litellm_without_database_fails_with_a_readable_reason() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY)
        with pytest.raises(SyncFailed) as failure:
            await sync.sync(entries(("a", "on_demand")))
        message = str(failure.value)
        assert "No DB Connected" in message
        assert "file back-end" in message

    run(test, db_connected=False)


def test_an_unreachable_litellm_fails_with_its_address() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    sync = ApiSync(url, KEY)
    with pytest.raises(SyncFailed, match=f"cannot reach LiteLLM at {url}"):
        asyncio.run(sync.sync([]))


def test_a_missing_master_key_fails_without_calling_litellm() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, None, master_key_env="MY_LITELLM_KEY")
        with pytest.raises(SyncFailed, match="MY_LITELLM_KEY is not set"):
            await sync.sync([])
        assert double.calls == []

    run(test)


def test_status_records_the_last_outcome_with_the_injected_clock() -> None:
    async def test(double: LiteLLMDouble) -> None:
        sync = ApiSync(double.url, KEY, clock=lambda: 1234.5)
        assert sync.status().last_sync_at is None and not sync.status().synced
        await sync.sync([])
        assert sync.status().last_sync_at == 1234.5 and sync.status().synced
        double.fail_next("GET", "/model/info", 500, {"error": {"message": "boom"}})
        with pytest.raises(SyncFailed):
            await sync.sync([])
        status = sync.status()
        assert status.enabled and not status.ok and not status.synced
        assert status.error == "LiteLLM answered HTTP 500 to GET /model/info: boom"

    run(test)


def test_the_master_key_never_shows_in_a_repr() -> None:
    sync = ApiSync("http://127.0.0.1:4000", KEY)
    assert KEY not in repr(sync)


def test_make_sync_picks_the_backend_and_reads_the_key_from_the_environment() -> None:
    env = {"LITELLM_MASTER_KEY": KEY}
    assert isinstance(make_sync(LiteLLMSettings(), env), DisabledSync)
    assert make_sync(LiteLLMSettings(), env).status().enabled is False
    assert isinstance(make_sync(LiteLLMSettings(enabled=True), env), ApiSync)
    file_settings = LiteLLMSettings(enabled=True, backend="file", config_path="/tmp/x.json")
    assert isinstance(make_sync(file_settings, env), ConfigFileSync)
    with pytest.raises(SyncFailed, match="config_path"):
        make_sync(LiteLLMSettings(enabled=True, backend="file"), env)
