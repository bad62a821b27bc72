"""The gateway key: the door's decision (`gateway.access`), the key file and its rotation
(`dgxmm.litellm.gateway_key`), and the LiteLLM entries that carry it (`dgxmm.litellm.entries`)."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest

from actors.errors import SyncFailed
from actors.ports import ModelEntry
from dgxmm.app import App
from dgxmm.config import (
    Config,
    ConfigError,
    MemoryConfig,
    RuntimeConfig,
    ServerConfig,
    load_config,
)
from dgxmm.litellm.entries import differs, litellm_deployment
from dgxmm.litellm.gateway_key import KEY_FILE, PREVIOUS_FILE, GatewayKeys, key_id
from gateway.access import Access
from tests.gateway_support import poll, run
from tests.litellm_support import AppInThread, free_port, http_request

LOCAL = ("127.0.0.1", 40000)
REMOTE = ("192.0.2.7", 40000)


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"gw"), (b"authorization", b"Bearer " + key.encode())]


# --- the door -------------------------------------------------------------------------------


def test_only_an_accepted_key_passes() -> None:
    access = Access(["k1"])
    assert access.allows(bearer("k1"), REMOTE)
    assert not access.allows(bearer("k2"), REMOTE)
    assert not access.allows(bearer("k1x"), REMOTE)
    assert not access.allows(bearer(""), REMOTE)
    assert not access.allows([(b"host", b"gw")], REMOTE)
    assert not access.allows([(b"authorization", b"Basic k1")], REMOTE)
    assert access.allows([(b"authorization", b"bearer  k1 ")], REMOTE)  # scheme case, OWS


def test_during_an_overlap_both_keys_pass_and_then_only_the_new_one() -> None:
    access = Access(["old"])
    access.set_keys(["new", "old"])
    assert access.allows(bearer("old"), REMOTE) and access.allows(bearer("new"), REMOTE)
    access.set_keys(["new"])
    assert not access.allows(bearer("old"), REMOTE) and access.allows(bearer("new"), REMOTE)


def test_no_key_accepted_means_nobody_gets_in_not_everybody() -> None:
    access = Access([])
    assert not access.allows(bearer(""), REMOTE)
    assert not access.allows([(b"authorization", b"Bearer ")], LOCAL)


def test_loopback_open_lets_loopback_in_without_a_key_and_nobody_else() -> None:
    access = Access(["k"], loopback_open=True)
    assert access.allows([], LOCAL)
    assert access.allows([], ("127.3.4.5", 1)) and access.allows([], ("::1", 1))
    assert not access.allows([], REMOTE) and not access.allows([], None)
    assert access.allows(bearer("k"), REMOTE)
    assert not Access(["k"]).allows([], LOCAL)  # required: loopback needs the key too


def test_the_401_is_openai_shaped_names_what_is_missing_and_never_the_key() -> None:
    access = Access(["secret-key"])
    status, headers, body = access.refusal([(b"host", b"gw")])
    assert status == 401 and (b"www-authenticate", b"Bearer") in headers
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert "needs its key" in error["message"]
    _, _, wrong = access.refusal(bearer("secret-kez"))
    message = json.loads(wrong)["error"]["message"]
    # OpenAI's words: LiteLLM maps this to an AuthenticationError, not to a 400.
    assert message.startswith("Incorrect API key provided") and "gateway's key" in message
    assert b"secret" not in wrong


# --- the key file -----------------------------------------------------------------------------


def test_the_key_is_made_at_first_start_0600_and_kept_across_starts(tmp_path: Path) -> None:
    first = GatewayKeys(tmp_path, Access())
    first.load()
    path = tmp_path / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = first.current()
    assert key.startswith("dgxmm-gw-") and len(key) > 40
    assert first.access.allows(bearer(key), REMOTE)
    again = GatewayKeys(tmp_path, Access())
    again.load()
    assert again.current() == key


def test_a_rotation_registers_the_new_key_while_both_pass_then_retires_the_old(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        keys = GatewayKeys(tmp_path, Access(), grace_s=0.05)
        keys.load()
        old = keys.current()
        seen: list[tuple[bool, bool]] = []

        async def register(timeout_s: float) -> bool:
            new = keys.current()
            # What LiteLLM is given is the new key, and the old one still passes meanwhile.
            seen.append((keys.access.allows(bearer(new), REMOTE),
                         keys.access.allows(bearer(old), REMOTE)))  # fmt: skip
            return True

        rotation = await keys.rotate(register)
        new = keys.current()
        assert new != old and seen == [(True, True)]
        assert rotation.registered and rotation.key_id == key_id(new)
        assert rotation.previous_key_id == key_id(old)
        assert (tmp_path / KEY_FILE).read_text().strip() == new
        previous = tmp_path / PREVIOUS_FILE
        assert stat.S_IMODE(previous.stat().st_mode) == 0o600
        await poll(lambda: not keys.access.allows(bearer(old), REMOTE) and not previous.exists())
        assert keys.access.allows(bearer(new), REMOTE)
        await keys.close()

    run(main())


def test_a_failed_registration_keeps_the_old_key_for_the_whole_overlap(tmp_path: Path) -> None:
    async def main() -> None:
        keys = GatewayKeys(tmp_path, Access(), overlap_s=3600, grace_s=0)
        keys.load()
        old = keys.current()

        async def register(timeout_s: float) -> bool:
            raise SyncFailed("LiteLLM config: permission denied")

        rotation = await keys.rotate(register)
        assert not rotation.registered and "permission denied" in (rotation.error or "")
        await asyncio.sleep(0)  # the retire task runs up to its wait
        assert keys.access.allows(bearer(old), REMOTE)
        assert keys.statistics()["previous_key_id"] == key_id(old)
        await keys.close()

    run(main())


def test_a_restart_during_the_overlap_keeps_accepting_the_old_key_until_its_time(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        keys = GatewayKeys(tmp_path, Access(), overlap_s=3600)
        keys.load()
        old = keys.current()
        await keys.rotate(None)
        await keys.close()  # DGXMM stops during the overlap
        after = GatewayKeys(tmp_path, Access())
        after.load()
        assert after.current() == keys.current()
        assert after.access.allows(bearer(old), REMOTE)
        late = GatewayKeys(tmp_path, Access(), wall=lambda: 4e12)  # past the overlap
        late.load()
        assert not late.access.allows(bearer(old), REMOTE)
        assert not (tmp_path / PREVIOUS_FILE).exists()

    run(main())


def test_the_statistics_show_fingerprints_never_a_key(tmp_path: Path) -> None:
    keys = GatewayKeys(tmp_path, Access())
    keys.load()
    shown = json.dumps(keys.statistics())
    assert keys.current() not in shown and key_id(keys.current()) in shown


# --- the LiteLLM entries ---------------------------------------------------------------------


def entry(via_gateway: bool) -> ModelEntry:
    return ModelEntry(
        model_id="box-dgxmm-d1-gw" if via_gateway else "box-dgxmm-d1",
        model_name="chat",
        api_base="http://127.0.0.1:8401/d/d1/v1",
        upstream_model="org/chat",
        via_gateway=via_gateway,
        timeout_s=1500.0 if via_gateway else None,
        deployment_id="d1",
    )


def test_a_gateway_entry_carries_the_key_and_its_fingerprint_an_engine_entry_neither() -> None:
    gw = litellm_deployment(entry(True), "the-key")
    assert gw["litellm_params"]["api_key"] == "the-key"
    assert gw["model_info"]["dgxmm_key_id"] == key_id("the-key")
    engine = litellm_deployment(entry(False), "the-key")
    assert engine["litellm_params"]["api_key"] == "dgxmm-no-key"
    assert "dgxmm_key_id" not in engine["model_info"]


@pytest.mark.parametrize("hidden", [True, False])
def test_an_entry_registered_with_another_key_differs_though_litellm_hides_keys(
    hidden: bool,
) -> None:
    want = litellm_deployment(entry(True), "new-key")
    have = litellm_deployment(entry(True), "old-key")
    if hidden:
        del have["litellm_params"]["api_key"]  # /model/info does not show it
    assert differs(want, have)
    assert not differs(want, litellm_deployment(entry(True), "new-key"))


# --- the configuration ------------------------------------------------------------------------


def test_the_gateway_requires_its_key_unless_the_config_says_loopback_open(tmp_path: Path) -> None:
    assert load_config(None).server.gateway_auth == "required"
    path = tmp_path / "dgxmm.toml"
    path.write_text('[server]\ngateway_auth = "loopback-open"\n')
    assert load_config(path).server.gateway_auth == "loopback-open"
    path.write_text('[server]\ngateway_auth = "open"\n')
    with pytest.raises(ConfigError, match="gateway_auth"):
        load_config(path)


@pytest.mark.parametrize(("mode", "status"), [("required", 401), ("loopback-open", 404)])
def test_a_running_dgxmm_lets_loopback_in_without_the_key_only_when_loopback_open(
    tmp_path: Path, mode: str, status: int
) -> None:
    config = Config(
        server=ServerConfig(
            data_dir=str(tmp_path / "data"), admin_port=free_port(), gateway_port=0,
            gateway_auth=mode,  # type: ignore[arg-type]
        ),
        memory=MemoryConfig(total_gib=8.0, reserve_gib=0.0, watchdog_threshold_gib=0.0),
        runtime=RuntimeConfig(kind="process"),
    )  # fmt: skip
    dgxmm = AppInThread(App(config)).start()
    try:
        url = dgxmm.app.config.server.public_gateway_url
        answer = http_request(url, path="/d/nope/v1/models", timeout_s=10)
        assert answer.status == status, answer.body  # 404: past the door, no such deployment
        key = (tmp_path / "data" / KEY_FILE).read_text().strip()
        keyed = http_request(
            url, path="/d/nope/v1/models", headers={"authorization": f"Bearer {key}"}
        )
        assert keyed.status == 404
    finally:
        dgxmm.stop()
