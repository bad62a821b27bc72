"""The pure side of LiteLLM sync: which entries DGXMM wants, how they are rendered and planned."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from actors.ports import ModelEntry
from dgxmm.litellm.entries import (
    FAILED,
    READY,
    Registration,
    desired_entries,
    differs,
    entry_id,
    litellm_deployment,
)
from dgxmm.litellm.filesync import config_document, load_verdict

GATEWAY = "http://127.0.0.1:8401"


def reg(
    deployment_id: str = "d1",
    mode: str = "on_demand",
    state: str = READY,
    engine_url: str | None = "http://127.0.0.1:9001",
    box_id: str = "",
) -> Registration:
    return Registration(
        deployment_id=deployment_id,
        model_name=f"name-{deployment_id}",
        served_model=f"org/served-{deployment_id}",
        mode=mode,  # type: ignore[arg-type]
        state=state,
        engine_url=engine_url,
        box_id=box_id,
    )


def test_a_ready_always_on_deployment_points_at_its_engine() -> None:
    [entry] = desired_entries([reg(mode="always_on")], GATEWAY, 900)
    assert entry.api_base == "http://127.0.0.1:9001/v1"
    assert entry.via_gateway is False
    assert entry.model_id == "dgxmm-d1"
    assert entry.upstream_model == "org/served-d1"
    assert entry.model_name == "name-d1"
    assert entry.timeout_s is None


def test_an_always_on_deployment_that_is_not_ready_is_absent() -> None:
    for state in ("starting", "stopped", "loading", FAILED):
        assert desired_entries([reg(mode="always_on", state=state)], GATEWAY, 900) == []


def test_an_always_on_deployment_without_an_engine_url_is_absent() -> None:
    assert desired_entries([reg(mode="always_on", engine_url=None)], GATEWAY, 900) == []


def test_an_on_demand_deployment_points_at_the_gateway_in_every_state_but_failed() -> None:
    for state in (READY, "stopped", "starting", "sleeping", "loading"):
        [entry] = desired_entries([reg(state=state, engine_url=None)], GATEWAY + "/", 900)
        assert entry.api_base == "http://127.0.0.1:8401/d/d1/v1"
        assert entry.via_gateway is True
        assert entry.model_id == "dgxmm-d1-gw"


def test_a_failed_on_demand_deployment_is_absent() -> None:
    assert desired_entries([reg(state=FAILED)], GATEWAY, 900) == []


def test_the_gateway_timeout_is_the_queue_limit_plus_ten_minutes() -> None:
    [default] = desired_entries([reg()], GATEWAY, 900)
    [longer] = desired_entries([reg()], GATEWAY, 3600)
    assert default.timeout_s == 1500
    assert longer.timeout_s == 4200


def test_the_two_paths_of_a_deployment_have_different_stable_ids() -> None:
    [on_demand] = desired_entries([reg(mode="on_demand")], GATEWAY, 900)
    [always_on] = desired_entries([reg(mode="always_on")], GATEWAY, 900)
    assert on_demand.model_id != always_on.model_id
    assert desired_entries([reg(mode="on_demand")], GATEWAY, 900)[0].model_id == on_demand.model_id


def test_the_box_id_prefixes_every_model_id() -> None:
    [entry] = desired_entries([reg(box_id="spark2")], GATEWAY, 900)
    assert entry.model_id == "spark2-dgxmm-d1-gw"
    assert entry_id("spark2", "d1", via_gateway=False) == "spark2-dgxmm-d1"


def test_entries_are_sorted_by_model_id() -> None:
    regs = [reg("b"), reg("a", mode="always_on"), reg("c")]
    ids = [e.model_id for e in desired_entries(regs, GATEWAY, 900)]
    assert ids == sorted(ids)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["on_demand", "always_on"]),
            st.sampled_from([READY, FAILED, "stopped", "starting"]),
            st.booleans(),
        ),
        max_size=8,
    )
)
def test_every_entry_follows_the_rules_and_ids_are_unique(
    specs: list[tuple[str, str, bool]],
) -> None:
    regs = [
        reg(f"d{i}", mode, state, "http://127.0.0.1:9001" if has_engine else None)
        for i, (mode, state, has_engine) in enumerate(specs)
    ]
    entries = desired_entries(regs, GATEWAY, 900)
    assert len({e.model_id for e in entries}) == len(entries)
    by_deployment = {e.deployment_id: e for e in entries}
    for r in regs:
        entry = by_deployment.get(r.deployment_id)
        if r.state == FAILED:
            assert entry is None
        elif r.mode == "on_demand":
            assert entry is not None and entry.via_gateway
        elif r.state == READY and r.engine_url:
            assert entry is not None and not entry.via_gateway
        else:
            assert entry is None


def test_a_gateway_entry_renders_with_health_header_timeouts_and_no_retries() -> None:
    [entry] = desired_entries([reg()], GATEWAY, 900)
    rendered = litellm_deployment(entry)
    assert rendered["model_name"] == "name-d1"
    params = rendered["litellm_params"]
    assert params["model"] == "openai/org/served-d1"
    assert params["api_base"] == "http://127.0.0.1:8401/d/d1/v1"
    assert params["timeout"] == 1500 and params["stream_timeout"] == 1500
    assert params["num_retries"] == 0
    info = rendered["model_info"]
    assert info["id"] == "dgxmm-d1-gw"
    assert info["health_check_params"] == {"extra_headers": {"x-dgxmm-health-check": "1"}}


def test_an_engine_entry_renders_without_gateway_settings() -> None:
    [entry] = desired_entries([reg(mode="always_on")], GATEWAY, 900)
    rendered = litellm_deployment(entry)
    assert "num_retries" not in rendered["litellm_params"]
    assert "timeout" not in rendered["litellm_params"]
    assert "health_check_params" not in rendered["model_info"]


def _gateway_entry() -> dict[str, Any]:
    return litellm_deployment(desired_entries([reg()], GATEWAY, 900)[0])


def test_an_entry_as_litellm_lists_it_does_not_differ() -> None:
    want = _gateway_entry()
    have = {
        "model_name": want["model_name"],
        "litellm_params": {
            **{k: v for k, v in want["litellm_params"].items() if k != "api_key"},
            "timeout": 1500.0,
            "use_in_pass_through": False,
        },
        "model_info": {**want["model_info"], "db_model": True, "max_tokens": None},
    }
    assert not differs(want, have)


def test_an_entry_with_another_api_base_or_timeout_differs() -> None:
    want = _gateway_entry()
    moved = {**want, "litellm_params": {**want["litellm_params"], "api_base": "http://x/v1"}}
    slower = {**want, "litellm_params": {**want["litellm_params"], "timeout": 99}}
    unmarked = {**want, "model_info": {"id": want["model_info"]["id"]}}
    assert differs(want, moved)
    assert differs(want, slower)
    assert differs(want, unmarked)


def _rendered(entries: list[ModelEntry]) -> dict[str, dict[str, Any]]:
    return {e.model_id: litellm_deployment(e) for e in entries}


def test_the_config_document_keeps_foreign_entries_and_settings() -> None:
    foreign = {"model_name": "gpt", "litellm_params": {"model": "openai/gpt"}, "model_info": {}}
    other_box = {"model_name": "x", "litellm_params": {}, "model_info": {"id": "b2-dgxmm-d9"}}
    document = {
        "model_list": [foreign, other_box],
        "litellm_settings": {"drop_params": True},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
    }
    want = _rendered(desired_entries([reg()], GATEWAY, 900))
    final = config_document(document, want, "")
    assert final["model_list"][:2] == [foreign, other_box]
    assert final["model_list"][2] == want["dgxmm-d1-gw"]
    assert final["litellm_settings"] == {"drop_params": True}
    assert final["general_settings"] == {
        "master_key": "os.environ/LITELLM_MASTER_KEY",
        "disable_model_info_refresh": True,
    }


def test_the_config_document_for_a_mode_switch_replaces_the_entry_in_one_write() -> None:
    old = _rendered(desired_entries([reg(mode="on_demand")], GATEWAY, 900))
    new = _rendered(desired_entries([reg(mode="always_on")], GATEWAY, 900))
    final = config_document({"model_list": list(old.values())}, new, "")
    assert [i["model_info"]["id"] for i in final["model_list"]] == ["dgxmm-d1"]


def test_the_config_document_that_only_removes_drops_the_entry() -> None:
    old = _rendered(desired_entries([reg("a"), reg("b")], GATEWAY, 900))
    new = _rendered(desired_entries([reg("a")], GATEWAY, 900))
    final = config_document({"model_list": list(old.values())}, new, "")
    assert [i["model_info"]["id"] for i in final["model_list"]] == ["dgxmm-a-gw"]


# --- stable entries (the file back-end) ------------------------------------------------------

STATES = ("stopped", "starting", READY, "stopping", FAILED, "asleep")


@given(
    mode=st.sampled_from(["on_demand", "always_on"]),
    state=st.sampled_from(STATES),
    engine_url=st.sampled_from([None, "http://127.0.0.1:9001", "http://127.0.0.1:9002"]),
    other_mode=st.sampled_from(["on_demand", "always_on"]),
    other_state=st.sampled_from(STATES),
)
def test_stable_entries_do_not_depend_on_mode_state_or_engine(
    mode: str, state: str, engine_url: str | None, other_mode: str, other_state: str
) -> None:
    one = desired_entries(
        [reg(mode=mode, state=state, engine_url=engine_url)], GATEWAY, 900, stable=True
    )
    other = desired_entries(
        [reg(mode=other_mode, state=other_state, engine_url=None)], GATEWAY, 900, stable=True
    )
    assert one == other
    [entry] = one
    assert entry.api_base == "http://127.0.0.1:8401/d/d1/v1"
    assert entry.model_id == "dgxmm-d1-gw"
    assert litellm_deployment(entry)["litellm_params"]["num_retries"] == 0


def test_stable_entries_change_when_a_deployment_is_created_or_removed() -> None:
    one = desired_entries([reg("a")], GATEWAY, 900, stable=True)
    two = desired_entries([reg("a"), reg("b", mode="always_on")], GATEWAY, 900, stable=True)
    assert [e.model_id for e in one] == ["dgxmm-a-gw"]
    assert [e.model_id for e in two] == ["dgxmm-a-gw", "dgxmm-b-gw"]


def test_a_failed_deployment_keeps_its_stable_entry() -> None:
    assert [
        e.model_id for e in desired_entries([reg(state=FAILED)], GATEWAY, 900, stable=True)
    ] == ["dgxmm-d1-gw"]


def test_litellm_serving_exactly_what_was_written_is_loaded() -> None:
    want = {e.model_id: litellm_deployment(e) for e in desired_entries([reg()], GATEWAY, 900)}
    assert load_verdict(want, want) is None
    verdict = load_verdict(want, {})
    assert verdict is not None and "missing or older: dgxmm-d1-gw" in verdict
    extra = load_verdict({}, want)
    assert extra is not None and "not in the file: dgxmm-d1-gw" in extra
