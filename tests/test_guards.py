"""Hostile bodies, secrets kept from viewers, and deployments that could never start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dgxmm.admin.guards import (
    MAX_JSON_DEPTH,
    json_too_deep,
    redact_args,
    redact_env,
    secret_name,
)
from tests.api_support import STARTUP_S, Box, SseReader, error_of, run_box

API = "/dgxmm/api"

SECRET_ARGS = [
    "--api-key", "sk-live-1234", "--hf-token=hf_abcdef", "HF_TOKEN=hf_zzz",
    "--max-num-batched-tokens", "8192", "--port", "8000", "--client-secret", "s3cr3t",
    "--tokenizer", "org/tok",
]  # fmt: skip


# --- pure ----------------------------------------------------------------------------------------


def test_secret_values_in_engine_args_are_redacted_and_the_rest_kept() -> None:
    assert redact_args(SECRET_ARGS) == [
        "--api-key", "***", "--hf-token=***", "HF_TOKEN=***", "--max-num-batched-tokens",
        "8192", "--port", "8000", "--client-secret", "***", "--tokenizer", "org/tok",
    ]  # fmt: skip
    assert redact_args(["--api-key"]) == ["--api-key"]
    assert redact_args(["--api-key", "--port", "1"]) == ["--api-key", "--port", "1"]
    assert redact_env({"HF_TOKEN": "x", "OPENAI_API_KEY": "y", "CUDA_VISIBLE_DEVICES": "0"}) == {
        "HF_TOKEN": "***",
        "OPENAI_API_KEY": "***",
        "CUDA_VISIBLE_DEVICES": "0",
    }


@pytest.mark.parametrize(
    "name", ["--api-key", "HF_TOKEN", "--password", "DB_PASSWD", "--auth", "hf.token", "key"]
)
def test_names_with_a_secret_word_are_secret(name: str) -> None:
    assert secret_name(name)


@pytest.mark.parametrize(
    "name", ["--max-num-batched-tokens", "--tokenizer", "--ssl-keyfile", "--kv-cache-dtype", "PATH"]
)
def test_names_that_only_contain_a_secret_word_inside_another_are_not(name: str) -> None:
    assert not secret_name(name)


def test_json_depth_is_measured_outside_strings() -> None:
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert not json_too_deep(ok)
    assert json_too_deep(b"[" + ok + b"]")
    assert not json_too_deep(json.dumps({"s": "[" * 10_000}).encode())
    assert json_too_deep(b"[" * 200_000)  # unbalanced does not matter: too deep is too deep


@given(
    st.recursive(
        st.none() | st.integers() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c)
    )
)
def test_json_depth_agrees_with_the_real_nesting(value: Any) -> None:
    def depth(v: Any) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    raw = json.dumps(value).encode()
    assert json_too_deep(raw, 3) == (depth(value) > 3)


# --- over the API --------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["login", "deployments", "settings", "tokens", "users"])
def test_deeply_nested_json_is_a_400_invalid_json_not_a_500(tmp_path: Path, route: str) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        method = "PATCH" if route == "settings" else "POST"
        for body in (b"[" * 200_000 + b"]" * 200_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
            reply = await admin.call(method, f"{API}/{route}", body)
            assert reply.status == 400, reply.body[:200]
            assert error_of(reply)["code"] == "invalid_json"
        assert (await admin.call("GET", f"{API}/session")).status == 200

    run_box(tmp_path, t)


def test_a_body_over_the_size_bound_is_a_413(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        reply = await admin.call("POST", f"{API}/deployments", b"[" + b"1," * 600_000 + b"1]")
        assert reply.status == 413

    run_box(tmp_path, t)


def test_viewers_see_engine_secrets_redacted_and_admins_see_them(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin, viewer = await box.login("alice"), await box.login("victor")
        body = {
            "name": "sec",
            "engine": "sim",
            "model": "org/m",
            "memory_gib": 1,
            "args": SECRET_ARGS,
        }
        created = await admin.ok("POST", f"{API}/deployments", body, status=201)
        assert created["args"] == SECRET_ARGS
        assert (await admin.ok("GET", f"{API}/deployments/sec"))["args"] == SECRET_ARGS
        for data in (
            await viewer.ok("GET", f"{API}/deployments/sec"),
            (await viewer.ok("GET", f"{API}/deployments"))["deployments"][0],
        ):
            assert "sk-live-1234" not in json.dumps(data) and "hf_abcdef" not in json.dumps(data)
            assert data["args"][:2] == ["--api-key", "***"]
        token = await box.token_client("victor")
        assert "sk-live" not in (await token.call("GET", f"{API}/deployments")).body.decode()

    run_box(tmp_path, t)


def test_the_viewers_event_stream_carries_redacted_args(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        body = {"name": "sec", "engine": "sim", "model": "org/m", "memory_gib": 1}
        await admin.ok("POST", f"{API}/deployments", {**body, "args": SECRET_ARGS}, status=201)
        streams = {}
        for name in ("victor", "alice"):
            streams[name] = stream = await SseReader.open(await box.login(name))
            assert await stream.next() == ("retry", 3000)
            event, snap = await stream.next()
            assert event == "snapshot"
            shown = snap["deployments"][0]["args"]
            assert shown == (SECRET_ARGS if name == "alice" else redact_args(SECRET_ARGS))
        await box.advance(STARTUP_S + 2)  # it becomes ready: a change pushed to both
        for name, stream in streams.items():
            record = (await stream.until("deployment"))[-1][1]
            assert ("sk-live-1234" in record["args"]) is (name == "alice")
            stream.close()

    run_box(tmp_path, t)


def test_memory_larger_than_the_usable_total_is_refused_with_both_numbers(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        body = {"name": "huge", "engine": "sim", "model": "org/m", "memory_gib": 101}
        reply = await admin.call("POST", f"{API}/deployments", body)
        assert reply.status == 422
        err = error_of(reply)
        assert err["code"] == "memory_too_large" and err["param"] == "memory_gib"
        assert "101 GiB" in err["message"] and "100 GiB" in err["message"]
        fits = await admin.ok("POST", f"{API}/deployments", {**body, "memory_gib": 100}, 201)
        switch = await admin.call(
            "POST",
            f"{API}/deployments/{fits['id']}/switch-model",
            {"model": "x/y", "memory_gib": 200},
        )
        assert switch.status == 422 and error_of(switch)["code"] == "memory_too_large"

    run_box(tmp_path, t)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://h/", "http://", "javascript:x", 7])
def test_patch_litellm_refuses_a_url_that_is_not_http_or_https(tmp_path: Path, url: Any) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        reply = await admin.call("PATCH", f"{API}/litellm", {"url": url})
        assert reply.status == 422 and error_of(reply)["param"] == "url"
        assert box.litellm["configured"] == []
        ok = await admin.call("PATCH", f"{API}/litellm", {"url": "https://lite.example:4000"})
        assert ok.status == 200

    run_box(tmp_path, t)
