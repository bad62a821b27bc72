"""The README's first command: `dgxmm serve --demo` gives a newcomer a model to call at once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.serve_support import PROJECT, banner_auth, start_demo, stop_demo

DEADLINE_S = 60.0


def test_the_demo_prints_a_login_and_a_curl_command_that_gets_a_chat_completion(
    tmp_path: Path,
) -> None:
    proc, banner = start_demo(tmp_path, DEADLINE_S)
    try:
        assert re.search(r"admin login    : admin / \S{12,}", banner)
        assert "web UI and API : http://127.0.0.1:" in banner
        url = re.search(r"curl -s (\S+)", banner)
        body = re.search(r"-d '(.+)'", banner)
        assert url is not None and body is not None
        # Without the key (a curl that skips LiteLLM): refused, nothing starts.
        refused = urllib.request.Request(
            url.group(1),
            data=body.group(1).encode(),
            headers={"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as no_key:
            urllib.request.urlopen(refused, timeout=DEADLINE_S)
        assert no_key.value.code == 401
        assert json.loads(no_key.value.read())["error"]["code"] == "invalid_api_key"
        request = urllib.request.Request(
            url.group(1),
            data=body.group(1).encode(),
            headers={"content-type": "application/json", **banner_auth(banner)},
        )
        # The model may still be loading: the gateway holds the request until it is ready.
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as answer:
            assert answer.status == 200
            reply = json.loads(answer.read())
        assert reply["object"] == "chat.completion"
        assert reply["choices"][0]["message"]["content"]
        assert (tmp_path / "dgxmm-data" / "dgxmm.db").exists()
    finally:
        stop_demo(proc)


def _post(url: str, body: str, timeout_s: float, auth: dict[str, str]) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=body.encode(), headers={"content-type": "application/json", **auth}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        assert answer.status == 200
        reply: dict[str, object] = json.loads(answer.read())
    return reply


def test_the_banners_curl_after_another_model_was_used_is_answered_within_10_s(
    tmp_path: Path,
) -> None:
    # demo-large takes 40 of the demo's 48 GiB: demo-chat needs it put to sleep. A real
    # install waits for its idle timeout; the demo makes room at once, as its banner says.
    proc, banner = start_demo(tmp_path, DEADLINE_S)
    try:
        assert "ondemand_make_room_after_s = 0" in banner
        url = re.search(r"curl -s (\S+)", banner)
        body = re.search(r"-d '(.+)'", banner)
        chat = re.search(r"deployment     : demo-chat \((\w+),", banner)
        large = re.search(r"deployment     : demo-large \((\w+),", banner)
        assert url and body and chat and large
        large_url = url.group(1).replace(f"/d/{chat.group(1)}/", f"/d/{large.group(1)}/")
        large_body = body.group(1).replace("demo/chat-8b", "demo/large-70b")
        _post(
            large_url, large_body, DEADLINE_S, banner_auth(banner)
        )  # demo-large starts and answers
        began = time.monotonic()
        reply = _post(url.group(1), body.group(1), 10.0, banner_auth(banner))
        assert time.monotonic() - began < 10.0
        assert reply["object"] == "chat.completion"
    finally:
        stop_demo(proc)


def test_a_demo_stopped_and_started_again_records_no_lost_engine(tmp_path: Path) -> None:
    # The demo's engines are its children and stop with it: it records their stop, so the
    # next start finds nothing missing (no engine_lost, "the engine was not running").
    proc, banner = start_demo(tmp_path, DEADLINE_S)
    try:
        url = re.search(r"curl -s (\S+)", banner)
        body = re.search(r"-d '(.+)'", banner)
        assert url and body
        _post(url.group(1), body.group(1), DEADLINE_S, banner_auth(banner))  # demo-chat runs
    finally:
        stop_demo(proc)
    proc, _ = start_demo(tmp_path, DEADLINE_S)
    stop_demo(proc)
    done = subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", "events", "--db", "dgxmm-data/dgxmm.db",
         "--type", "EngineLost", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=DEADLINE_S, check=True,
    )  # fmt: skip
    assert done.stdout == "", done.stdout


def test_a_model_used_before_a_restart_shows_its_last_use_after_it(tmp_path: Path) -> None:
    # The last use of a model lived only in memory: after a restart `dgxmm ps` said "never"
    # for a model used a minute before (issue 32, item 6).
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}
    proc, banner = start_demo(tmp_path, DEADLINE_S, env=state)
    try:
        url = re.search(r"curl -s (\S+)", banner)
        body = re.search(r"-d '(.+)'", banner)
        assert url and body
        asked = time.time()
        _post(url.group(1), body.group(1), DEADLINE_S, banner_auth(banner))  # demo-chat
        answered = time.time()
    finally:
        stop_demo(proc)
    proc, banner = start_demo(tmp_path, DEADLINE_S, env=state)
    try:
        table = _cli(tmp_path, state, "ps")
        listed = _cli(tmp_path, state, "ps", "--json")
    finally:
        stop_demo(proc)
    rows = {line.split()[0]: line for line in table.splitlines() if line.strip()}
    assert rows["demo-chat"].endswith(" ago"), table
    assert rows["demo-large"].endswith(" never"), table  # never used: still never
    chat = next(d for d in map(json.loads, listed.splitlines()) if d["name"] == "demo-chat")
    assert asked - 1.0 < chat["last_used_at"] < answered + 1.0, (asked, chat, answered)


def _cli(cwd: Path, env: dict[str, str], *args: str) -> str:
    """`dgxmm ARGS` as the user that runs the demo; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", *args],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(PROJECT), **env}, capture_output=True,
        text=True, timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout
