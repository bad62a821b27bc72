"""Support for the browser tests: a real DGXMM in a subprocess, a LiteLLM double, Chromium.

`dgxmm serve` runs as a child process with a configuration of its own (free ports, a
temporary data dir, the process runtime, simulated engines), exactly as an operator starts
it; the tests reach it over loopback like a browser and like LiteLLM would.  A small JSON
client logs in through the same API the UI uses, for setting things up and for checking
what the UI did.
"""

from __future__ import annotations

import contextlib
import http.client
import http.cookiejar
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.gateway_support import gateway_auth

PROJECT_DIR = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# The flags this machine's closed network and root user need (see the machine notes).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MASTER_KEY = "sk-browser-test"
START_TIMEOUT_S = 60.0

T = TypeVar("T")


def missing_prerequisite() -> str | None:
    """Why the browser tests cannot run here (Chromium or Playwright missing), or None."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install playwright; no browser download)"
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(what: str, check: Callable[[], T | None], timeout_s: float, every_s: float = 0.1) -> T:
    """Poll `check` until it returns something other than None; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


# --- a JSON client of the admin API ---------------------------------------------------------


class ApiFailure(Exception):
    """A non-2xx answer of the admin API."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class ApiClient:
    """A cookie session with its CSRF token, like the browser's."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        self.csrf: str | None = None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """`method /dgxmm/api/<path>`; the decoded JSON answer, ApiFailure otherwise."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}/dgxmm/api/{path.lstrip('/')}", data=data, method=method
        )
        if data is not None:
            req.add_header("content-type", "application/json")
        if self.csrf and method not in ("GET", "HEAD"):
            req.add_header("x-csrf-token", self.csrf)
        try:
            with self.opener.open(req, timeout=30) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                decoded: Any = json.loads(raw)
            except ValueError:
                decoded = raw.decode(errors="replace")
            raise ApiFailure(exc.code, decoded) from None
        return json.loads(raw) if raw else None

    def login(self, name: str, password: str) -> ApiClient:
        """Log in; keeps the cookie and the CSRF token."""
        answer = self.call("POST", "login", {"name": name, "password": password})
        self.csrf = answer["csrf_token"]
        return self

    def deployment(self, name: str) -> dict[str, Any]:
        """The record of the deployment called `name`."""
        record: dict[str, Any] = self.call("GET", f"deployments/{name}")
        return record


# --- the LiteLLM model-management API double, on a thread of its own -----------------------


class ThreadedLiteLLM:
    """`tests.litellm_double.LiteLLMDouble` served from a background event loop."""

    def __init__(self, master_key: str = MASTER_KEY) -> None:
        import asyncio

        from tests.litellm_double import LiteLLMDouble

        self._asyncio = asyncio
        self.double = LiteLLMDouble(master_key)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="litellm-double")

    def __enter__(self) -> ThreadedLiteLLM:
        self.thread.start()
        future = self._asyncio.run_coroutine_threadsafe(self.double.start(), self.loop)
        future.result(timeout=10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        future = self._asyncio.run_coroutine_threadsafe(self.double.stop(), self.loop)
        with contextlib.suppress(Exception):
            future.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @property
    def url(self) -> str:
        """Where LiteLLM listens."""
        return self.double.url

    def model_names(self) -> list[str]:
        """The model names LiteLLM's database holds now."""
        rows = list(self.double.db.values())
        return sorted(str(row.get("model_name")) for row in rows)


# --- DGXMM as a subprocess -----------------------------------------------------------------


@dataclass
class Dgxmm:
    """A running `dgxmm serve`."""

    process: subprocess.Popen[str]
    data_dir: Path
    admin_port: int
    gateway_port: int
    output: list[str] = field(default_factory=list)
    admin_password: str = ""

    @property
    def base_url(self) -> str:
        """The admin listener."""
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def ui_url(self) -> str:
        """Where the web UI is."""
        return f"{self.base_url}/dgxmm/"

    @property
    def db_path(self) -> Path:
        """The event log."""
        return self.data_dir / "dgxmm.db"

    def log_text(self) -> str:
        """Everything DGXMM printed so far (for failure messages)."""
        return "".join(self.output[-200:])

    def api(self, name: str = "admin", password: str | None = None) -> ApiClient:
        """A logged-in API client."""
        return ApiClient(self.base_url).login(name, password or self.admin_password)

    def add_user(self, name: str, role: str, password: str) -> None:
        """`dgxmm user add NAME --role ROLE --password-stdin --db <the log>` while serving."""
        result = subprocess.run(
            [sys.executable, "-m", "dgxmm.cli", "user", "add", name, "--role", role,
             "--password-stdin", "--db", str(self.db_path)],
            input=password + "\n", capture_output=True, text=True, cwd=PROJECT_DIR, timeout=60,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr

    def chat(self, deployment_id: str, model: str, timeout_s: float = 120.0) -> tuple[int, Any]:
        """A chat completion through the on-demand gateway, as LiteLLM sends it."""
        conn = http.client.HTTPConnection("127.0.0.1", self.gateway_port, timeout=timeout_s)
        try:
            body = {"model": model, "messages": [{"role": "user", "content": "Hello"}]}
            conn.request(
                "POST",
                f"/d/{deployment_id}/v1/chat/completions",
                body=json.dumps(body),
                headers={"content-type": "application/json", **gateway_auth(self.data_dir)},
            )
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
        finally:
            conn.close()


def write_config(
    path: Path, data_dir: Path, admin_port: int, gateway_port: int, *,
    idle_timeout_s: int, litellm_url: str | None,
) -> None:  # fmt: skip
    """The TOML file the test DGXMM runs with."""
    litellm = (
        f'[litellm]\nenabled = true\nbackend = "api"\nurl = "{litellm_url}"\n'
        # the file back-end (one test turns it on) reloads with a command that always fails
        'reload_command = "echo no gunicorn.pid >&2; exit 3"\n'
        if litellm_url
        else "[litellm]\nenabled = false\n"
    )
    path.write_text(
        f"ondemand_idle_timeout_s = {idle_timeout_s}\n"
        "ondemand_queue_timeout_s = 300\n"
        "\n[server]\n"
        f'data_dir = "{data_dir}"\n'
        f"admin_port = {admin_port}\n"
        f"gateway_port = {gateway_port}\n"
        "\n[runtime]\n"
        'kind = "process"\n'
        "stop_timeout_s = 5\n"
        "\n[memory]\n"
        "total_gib = 64\n"
        "reserve_gib = 0\n"
        "watchdog_threshold_gib = 0\n"
        "\n" + litellm
    )


def _reader(stream: Any, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)


@contextlib.contextmanager
def run_dgxmm(
    tmp: Path, *, idle_timeout_s: int = 60, litellm_url: str | None = None
) -> Iterator[Dgxmm]:
    """Start `python -m dgxmm.cli serve --config <tmp>/dgxmm.toml`, stop it and its engines."""
    data_dir = tmp / "data"
    config = tmp / "dgxmm.toml"
    admin_port, gateway_port = free_port(), free_port()
    write_config(
        config, data_dir, admin_port, gateway_port,
        idle_timeout_s=idle_timeout_s, litellm_url=litellm_url,
    )  # fmt: skip
    env = {**os.environ, "LITELLM_MASTER_KEY": MASTER_KEY, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "dgxmm.cli", "serve", "--config", str(config)],
        cwd=PROJECT_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    server = Dgxmm(process, data_dir, admin_port, gateway_port)
    reader = threading.Thread(target=_reader, args=(process.stdout, server.output), daemon=True)
    reader.start()
    try:

        def password() -> str | None:
            if process.poll() is not None:
                raise AssertionError(f"dgxmm serve exited:\n{server.log_text()}")
            for line in list(server.output):
                if "admin login" in line and "/" in line:
                    return line.rsplit("/", 1)[1].strip()
            return None

        server.admin_password = wait_for("the admin login in the banner", password, START_TIMEOUT_S)
        yield server
    finally:
        _stop(process)
        reader.join(timeout=5)
        _stop_engines(data_dir)


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _stop_engines(data_dir: Path) -> None:
    """Engines outlive `dgxmm serve` on purpose (adopted at the next start): end ours."""
    state = data_dir / "engines" / "process-engines.json"
    try:
        records = json.loads(state.read_text()).get("engines", [])
    except (OSError, ValueError):
        return
    for record in records:
        pid = int(record["pid"])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"simulations.engine" not in cmdline:
            continue  # the pid was reused by something that is not our engine
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the engine leads its own process group


def chromium_executable() -> str:
    """Debian's Chromium (Playwright never downloads a browser here)."""
    found = shutil.which("chromium") or CHROMIUM
    return found
