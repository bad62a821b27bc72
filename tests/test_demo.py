"""The README's first command: `dgxmm serve --demo` gives a newcomer a model to call at once,
through the LiteLLM it puts in front (`dgxmm.demo`, `dgxmm.demo_litellm`), or alone with
`--no-litellm` (what the other tests of the demo run: they look at DGXMM)."""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dgxmm.config import Config, LiteLLMConfig, ServerConfig
from dgxmm.demo import (
    MASTER_KEY_FILE,
    curl_label,
    demo_config,
    demo_notes,
    plan_front,
    reload_command,
)
from dgxmm.demo_litellm import (
    PARENT_DEATH_EXEC,
    installed_count,
    pip_progress,
    progress_line,
)
from tests.litellm_support import require_litellm
from tests.serve_support import PROJECT, banner_auth, litellm_ready, start_demo, stop_demo

DEADLINE_S = 60.0
LITELLM_READY_S = 240.0  # LiteLLM under gunicorn takes 13-40 s to answer on a loaded box


def _config(data_dir: Path, **litellm: Any) -> Config:
    return Config(server=ServerConfig(data_dir=str(data_dir)), litellm=LiteLLMConfig(**litellm))


def test_the_demo_keeps_one_master_key_across_restarts_in_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The banner's key changed at every restart, and a key in the environment won over the
    # one the demo's LiteLLM runs with.
    config = _config(tmp_path / "data")
    keys = []
    for stray in ("sk-from-the-shell", None):  # two starts, each a new process environment
        if stray is None:
            monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
        else:
            monkeypatch.setenv("LITELLM_MASTER_KEY", stray)
        front = plan_front(config, PROJECT, no_litellm=False, env={})
        assert front is not None
        demo_config(config, front)
        keys.append(os.environ["LITELLM_MASTER_KEY"])
    path = tmp_path / "data" / MASTER_KEY_FILE
    assert keys[0] == keys[1] == path.read_text().strip()
    assert keys[0].startswith("sk-") and len(keys[0]) > 30
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_demo_syncs_its_own_litellm_on_loopback_and_reloads_it_by_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
    config = _config(tmp_path / "data", url="http://localhost:4123")
    front = plan_front(config, PROJECT, no_litellm=False, env={})
    assert front is not None
    lite = demo_config(config, front).litellm
    assert (lite.enabled, lite.backend, lite.url) == (True, "file", "http://127.0.0.1:4123")
    assert lite.config_path == str(tmp_path / "data" / "litellm.yaml")
    assert lite.reload_command == reload_command(front.pidfile)
    assert front.venv == str(PROJECT / ".venv-litellm")
    assert front.bootstrap == str(PROJECT / "scripts" / "bootstrap")


def test_no_litellm_runs_dgxmm_alone_and_a_configured_litellm_is_left_as_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --no-litellm synced to a LiteLLM nobody ran: "Synced" beside "Not loaded", and a
    # gateway-key rotation that waited 2 minutes for it.
    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
    alone = _config(tmp_path / "alone")
    assert plan_front(alone, PROJECT, no_litellm=True, env={}) is None
    assert demo_config(alone, None).litellm == alone.litellm  # disabled: no sync at all
    assert "LITELLM_MASTER_KEY" not in os.environ
    assert not (tmp_path / "alone" / MASTER_KEY_FILE).exists()
    notes = "\n".join(demo_notes(demo_config(alone, None), None))
    assert "No LiteLLM in front (--no-litellm)" in notes
    own = _config(tmp_path / "own", enabled=True, url="http://10.0.0.5:4000")
    assert plan_front(own, PROJECT, no_litellm=False, env={}) is None
    assert demo_config(own, None).litellm == own.litellm


def test_no_litellm_goes_with_demo_only() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", "serve", "--no-litellm"],
        env={**os.environ, "PYTHONPATH": str(PROJECT)}, capture_output=True, text=True,
        timeout=DEADLINE_S, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--no-litellm goes with --demo" in done.stderr


def test_the_banner_shows_the_openai_client_through_litellm_and_labels_the_curl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
    config = _config(tmp_path / "data")
    front = plan_front(config, PROJECT, no_litellm=False, env={})
    assert front is not None
    notes = demo_notes(demo_config(config, front), front)
    text = "\n".join(notes)
    assert "LiteLLM in front: starting on http://127.0.0.1:4000/v1" in text
    assert "A line below says when it answers." in text
    example = next(line for line in notes if "OPENAI_BASE_URL" in line)
    assert f"OPENAI_API_KEY=$(cat {tmp_path / 'data' / MASTER_KEY_FILE})" in example
    assert "model='demo-chat'" in example and "from openai import OpenAI" in example
    assert "DGXMM alone" in curl_label(front) and "without LiteLLM" in curl_label(front)


def test_the_first_run_shows_the_venvs_progress_from_pips_log(tmp_path: Path) -> None:
    preparing = "LiteLLM: .venv-litellm: preparing (10 s)"  # python -m venv, or pip's index
    assert progress_line(".venv-litellm", 0, None, 9.6) == preparing
    log = (
        "Looking in indexes: https://pypi.org/simple\n"
        "Collecting litellm[proxy]==1.108.7\n"
        "  Downloading litellm-1.108.7-py3-none-any.whl (10.2 MB)\n"
        "Processing /opt/pypi/files/six-1.17.0-py2.py3-none-any.whl (from x)\n"
        "Collecting fastuuid<1.0 (from litellm[proxy]==1.108.7)\n"
    )
    assert pip_progress(log) == (3, None)
    assert progress_line(".venv-litellm", 3, None, 12.4) == (
        "LiteLLM: .venv-litellm: 3 packages fetched (12 s)"
    )
    log += "Installing collected packages: six, fastuuid, litellm\n"
    assert pip_progress(log) == (3, 3)
    site = tmp_path / ".venv-litellm" / "lib" / "python3.11" / "site-packages"
    for name in ("pip-25.1", "six-1.17.0", "fastuuid-0.14.0"):
        (site / f"{name}.dist-info").mkdir(parents=True)
    installed = installed_count(tmp_path / ".venv-litellm")  # pip's own is not one of them
    assert progress_line(".venv-litellm", 3, 3, 40, installed) == (
        "LiteLLM: .venv-litellm: installed 2 of 3 packages (40 s)"
    )


def test_the_reload_command_signals_only_the_gunicorn_its_pidfile_names(tmp_path: Path) -> None:
    pidfile = tmp_path / "gunicorn.pid"
    command = reload_command(pidfile)

    def run() -> int:
        return subprocess.run(["/bin/sh", "-c", command], timeout=10, check=False).returncode

    assert run() == 0  # LiteLLM not started yet: nothing to signal, and no failure
    bystander = subprocess.Popen(["sleep", "60"])  # a stale pidfile's pid, now another program
    hupped = tmp_path / "hupped"
    master = subprocess.Popen(  # a stand-in for gunicorn: its command line names the pidfile
        ["bash", "-c", f'trap "touch {hupped}; exit 0" HUP; while :; do sleep 0.05; done', "_",
         "--pid", str(pidfile)]
    )  # fmt: skip
    try:
        pidfile.write_text(f"{bystander.pid}\n")
        assert run() == 0
        assert bystander.poll() is None  # not signalled (a HUP would have ended it)
        pidfile.write_text(f"{master.pid}\n")
        assert run() == 0
        assert master.wait(timeout=10) == 0 and hupped.exists()
    finally:
        for proc in (bystander, master):
            proc.kill()
            proc.wait()


def test_the_demos_litellm_gets_sigterm_when_dgxmm_is_killed(tmp_path: Path) -> None:
    # gunicorn runs in a session of its own (a Ctrl-C is DGXMM's to handle): without the
    # parent-death signal a killed demo left it running, holding LiteLLM's port.
    termed = tmp_path / "termed"
    child = ["bash", "-c", f'trap "touch {termed}; exit 0" TERM; while :; do sleep 0.05; done']
    dgxmm = subprocess.Popen(  # a stand-in for DGXMM: starts the child as the demo does
        [sys.executable, "-c",
         "import os, subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid()), "
         "'/bin/bash', *sys.argv[2:]], start_new_session=True); time.sleep(60)",
         PARENT_DEATH_EXEC, *child[1:]],
    )  # fmt: skip
    started: list[int] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (started := _bash_children_of(dgxmm.pid)):  # the wrapper exec'd bash
            assert time.monotonic() < deadline
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
        dgxmm.kill()
        dgxmm.wait()
        deadline = time.monotonic() + DEADLINE_S
        while not termed.exists():
            assert time.monotonic() < deadline, "the child outlived its killed parent"
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
    finally:
        dgxmm.kill()
        dgxmm.wait()
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _bash_children_of(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(c) for c in children if Path(f"/proc/{c}/comm").read_text().strip() == "bash"]


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets that listen on `port` (from /proc/net)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for row in f:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if int(hex_port, 16) == port and state == "0A":  # LISTEN
                    found.add(address)
    return found


def _admin_session(admin: str, password: str) -> urllib.request.OpenerDirector:
    opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
    )
    login = urllib.request.Request(
        f"{admin}/dgxmm/api/login",
        json.dumps({"name": "admin", "password": password}).encode(),
        {"content-type": "application/json"},
    )
    with opener.open(login, timeout=DEADLINE_S) as answer:
        assert answer.status == 200
    return opener


def _run_line(line: str) -> str:
    """A banner line, run by bash as a reader would paste it; its output."""
    done = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, timeout=DEADLINE_S, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.litellm
@pytest.mark.timeout(LITELLM_READY_S + 4 * DEADLINE_S)
def test_the_demo_puts_a_real_litellm_in_front_that_the_banners_openai_client_goes_through(
    tmp_path: Path,
) -> None:
    require_litellm()
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}
    proc, banner = start_demo(tmp_path, DEADLINE_S, env=state, litellm=True)
    gunicorn_pid = 0
    try:
        port = re.search(r"LiteLLM in front: starting on http://127\.0\.0\.1:(\d+)/v1", banner)
        assert port is not None, banner
        # The banner did not wait for LiteLLM: it does not answer yet.
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/health/liveliness", timeout=5)
        example = re.search(r"^  (OPENAI_BASE_URL=.*)$", banner, re.M)
        curl = banner.index("curl -s")
        assert example is not None and example.start() < curl, banner
        assert "Check DGXMM alone, without LiteLLM" in banner[example.end() : curl]
        litellm_ready(proc, LITELLM_READY_S)
        assert _listening_addresses(int(port.group(1))) == {"0100007F"}  # 127.0.0.1 only
        gunicorn_pid = int((tmp_path / "dgxmm-data" / "litellm" / "gunicorn.pid").read_text())
        assert _run_line(example.group(1)).strip()  # demo-chat's answer, through LiteLLM

        # DGXMM syncs with the same key: synced and loaded, no reload failed.
        admin = re.search(r"web UI and API : (http://\S+)/dgxmm/", banner)
        password = re.search(r"admin login    : admin / (\S+)", banner)
        assert admin and password
        session = _admin_session(admin.group(1), password.group(1))
        deadline = time.monotonic() + DEADLINE_S
        while True:
            with session.open(f"{admin.group(1)}/dgxmm/api/litellm", timeout=10) as answer:
                status = json.loads(answer.read())
            if status["loaded"] and not status["reload"]["pending"]:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)  # poll interval; the deadline bounds the wait
        assert (status["ok"], status["error"], status["load_error"]) == (True, None, None)
        assert status["reload"]["failures"] == 0, status

        # A rotation of the gateway key is served by LiteLLM within seconds, not 2 minutes.
        began = time.monotonic()
        rotated = _cli(tmp_path, state, "gateway-key", "rotate")
        assert time.monotonic() - began < 30.0, rotated
        assert "LiteLLM" not in rotated, rotated  # neither "not seen serving" nor an error
        assert _run_line(example.group(1)).strip()  # through LiteLLM with the new key
    finally:
        stop_demo(proc)
    if gunicorn_pid:  # the demo's stop took its LiteLLM with it
        with pytest.raises(ProcessLookupError):
            os.kill(gunicorn_pid, 0)


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
