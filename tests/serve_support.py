"""Real `dgxmm serve` processes for fault and chaos tests: start, kill, restart, inspect.

`Serve` runs `python -m dgxmm.cli serve --config <root>/dgxmm.toml` on ephemeral ports with
the process runtime (sim engines are its children's children, in their own process groups,
so they outlive a SIGKILL of DGXMM as containers would).  It reads the banner for the ports
and the admin password, logs in to the admin API, and reads the event log with plain sqlite3
(read-only) to check what was recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from dgxmm.engines.runtimes import process
from events import model as m
from storage.eventlog import EventStore
from tests.api_support import ApiClient, login
from tests.e2e_support import process_identity
from tests.gateway_support import gateway_key

PROJECT = Path(__file__).resolve().parent.parent
START_DEADLINE_S = 60.0


def write_config(
    root: Path,
    *,
    total_gib: float = 8.0,
    grace_s: float = 2.0,
    extra: str = "",
    runtime: str = "process",
) -> Path:
    """A config for one test DGXMM under `root` (its data dir is `root/data`)."""
    path = root / "dgxmm.toml"
    path.write_text(
        f"""
[server]
data_dir = "{root / "data"}"
admin_port = 0
gateway_port = 0
shutdown_grace_s = {grace_s}

[runtime]
kind = "{runtime}"
stop_timeout_s = 5.0
health_failure_window_s = 6.0

[memory]
total_gib = {total_gib}
reserve_gib = 0
watchdog_threshold_gib = 0
{extra}
""",
        encoding="utf-8",
    )
    return path


class Serve:
    """One `dgxmm serve` process on `root` (restartable: same config, same data dir)."""

    def __init__(self, root: Path, config: Path) -> None:
        self.root = root
        self.config = config
        self.proc: subprocess.Popen[str] | None = None
        self.admin_port = 0
        self.gateway_port = 0
        self.password: str | None = None
        self.banner = ""
        self.api: ApiClient | None = None

    @property
    def db(self) -> Path:
        """The event log."""
        return self.root / "data" / "dgxmm.db"

    @property
    def gateway_key(self) -> str:
        """The key its gateway requires (what LiteLLM is given)."""
        return gateway_key(self.root / "data")

    def spawn(self, *, stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
        """Start the process without waiting for it."""
        return subprocess.Popen(
            [sys.executable, "-m", "dgxmm.cli", "serve", "--config", str(self.config)],
            cwd=self.root,
            env={**os.environ, "PYTHONPATH": str(PROJECT)},
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
        )

    async def start(self, *, pump: bool = True) -> None:
        """Start and wait for the banner; log in to the admin API.  Without `pump` nothing
        reads stdout after the banner (the caller may close it)."""
        self.proc = proc = self.spawn()
        lines: queue.Queue[str | None] = queue.Queue(maxsize=100_000)
        if not pump:
            await self._read_banner_only(proc)
            self.api = await self._login()
            return
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        banner: list[str] = []
        deadline = time.monotonic() + START_DEADLINE_S
        while not any(line.startswith("  runtime") for line in banner):
            left = deadline - time.monotonic()
            assert left > 0, f"no banner: {banner}"
            try:
                line = await asyncio.to_thread(lines.get, True, min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                err = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(f"dgxmm exited ({proc.wait()}): {banner} {err[-2000:]}")
            if line.startswith(("DGXMM is running", "  ")):
                banner.append(line)
        # The banner is one write: what follows the runtime line is there already.
        with contextlib.suppress(queue.Empty):
            while (line := await asyncio.to_thread(lines.get, True, 0.3)) is not None:
                if line.startswith("  "):
                    banner.append(line)
        self._parse_banner("".join(banner))
        self.api = await self._login()

    async def _read_banner_only(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        text = ""
        while "admin login" not in text:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert line, f"dgxmm exited: {text}"
            text += line
        self._parse_banner(text)

    def _parse_banner(self, text: str) -> None:
        self.banner = text
        admin = re.search(r"web UI and API : http://127\.0\.0\.1:(\d+)/", text)
        gateway = re.search(r"gateway        : http://127\.0\.0\.1:(\d+)/", text)
        assert admin and gateway, text
        self.admin_port, self.gateway_port = int(admin.group(1)), int(gateway.group(1))
        found = re.search(r"admin login    : admin / (\S+)", text)
        if found:
            self.password = found.group(1)

    async def _login(self) -> ApiClient:
        assert self.password is not None, "the first start prints the admin password"
        return await login(self.admin_port, "admin", self.password)

    def kill(self) -> None:
        """SIGKILL DGXMM (its engines live on)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    async def terminate(self, deadline_s: float = 60.0) -> int:
        """SIGTERM and wait for the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.proc.wait, deadline_s)

    # --- what the log says -----------------------------------------------------------------

    async def records(self) -> list[m.Recorded]:
        """Every record of the log (read-only, so it works while DGXMM runs)."""
        store = await EventStore.open(self.db, create=False, readonly=True)
        try:
            return await store.read()
        finally:
            await store.close()

    @property
    def engines_state(self) -> Path:
        """The process runtime's state file."""
        return self.root / "data" / "engines" / "process-engines.json"

    def engines(self) -> list[dict[str, Any]]:
        """The process runtime's record of the engines it launched."""
        path = self.engines_state
        if not path.exists():
            return []
        raw: dict[str, Any] = msgspec.json.decode(path.read_bytes())
        return list(raw.get("engines", []))

    def live_engine_pids(self) -> dict[int, str]:
        """pid -> deployment id of every engine process alive (the runtime's record)."""
        alive = {}
        for rec in self.engines():
            pid = int(rec["pid"])
            if process_identity(pid) is not None:
                alive[pid] = str(rec.get("deployment_id", ""))
        return alive

    def kill_engines(self) -> None:
        """Remove every engine (teardown), recorded or not (DGXMM killed before recording)."""
        marked = process.marked_pids(f"{process.MARKER}={self.engines_state}".encode())
        for pid in set(self.live_engine_pids()) | marked:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def start_demo(
    tmp_path: Path,
    deadline_s: float = 60.0,
    env: dict[str, str] | None = None,
    *,
    litellm: bool = False,
) -> tuple[subprocess.Popen[str], str]:
    """`dgxmm serve --demo` on ephemeral ports in tmp_path (so it never collides with a demo a
    developer runs), and its banner up to the printed curl command; `env` adds variables.

    Without `litellm` the demo runs DGXMM alone (`--no-litellm`): most tests look at DGXMM, and
    LiteLLM's start costs 15-40 s.  With it, its LiteLLM listens on a free port (`[litellm]
    url`); `litellm_ready` waits for the line that says it answers."""
    config = "[server]\nadmin_port = 0\ngateway_port = 0\n"
    if litellm:
        from tests.litellm_support import free_port

        config += f'[litellm]\nurl = "http://127.0.0.1:{free_port()}"\n'
    (tmp_path / "ports.toml").write_text(config)
    argv = [sys.executable, "-m", "dgxmm.cli", "serve", "--demo", "--config", "ports.toml"]
    proc = subprocess.Popen(
        argv if litellm else [*argv, "--no-litellm"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROJECT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    banner = ""
    deadline = time.monotonic() + deadline_s
    while "curl -s" not in banner:
        assert time.monotonic() < deadline, banner
        line = proc.stdout.readline()
        assert line, f"dgxmm exited: {banner}"
        banner += line
    return proc, banner


def litellm_ready(proc: subprocess.Popen[str], deadline_s: float) -> str:
    """Read the demo's output after its banner until the line that says its LiteLLM answers
    (what a reader of the quickstart waits for), and return that line; then keep reading in
    the background, so the demo never blocks on a full pipe."""
    assert proc.stdout is not None
    found: queue.Queue[str | None] = queue.Queue(maxsize=100_000)

    def read(stream: Any) -> None:
        with contextlib.suppress(Exception):
            for line in stream:
                if line.startswith("LiteLLM"):
                    found.put(line)
        found.put(None)

    threading.Thread(target=read, args=(proc.stdout,), daemon=True).start()
    said: list[str] = []
    deadline = time.monotonic() + deadline_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"LiteLLM not ready within {deadline_s:.0f} s: {said}"
        try:
            line = found.get(timeout=left)
        except queue.Empty:
            continue
        assert line is not None, f"the demo exited: {said}"
        said.append(line)
        assert not line.startswith("LiteLLM did not start"), line
        if line.startswith("LiteLLM is ready"):
            return line


def banner_auth(banner: str) -> dict[str, str]:
    """The Authorization header of the banner's curl command: it reads the gateway key from
    the file it names (`$(cat <data_dir>/gateway.key)`), as a shell would."""
    found = re.search(r'-H "authorization: Bearer \$\(cat (\S+)\)"', banner)
    assert found is not None, banner
    return {"authorization": "Bearer " + Path(found.group(1)).read_text().strip()}


def stop_demo(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the demo: it must exit 0 within 30 s (killed if it does not)."""
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    """Read the process's stdout for its whole life (so it never blocks on a full pipe)."""
    with contextlib.suppress(Exception):
        for line in stream:
            with contextlib.suppress(queue.Full):
                lines.put_nowait(line)
    lines.put(None)


def engine_processes(token: str) -> dict[int, str]:
    """pid -> model of every simulated engine alive whose model name contains `token`
    (found in /proc, so an engine the runtime never recorded is found too)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if b"simulations.engine" not in argv or ") Z" in stat:
            continue
        model = argv[argv.index(b"--model") + 1].decode() if b"--model" in argv else ""
        if token in model:
            found[int(entry.name)] = model
    return found


def sim_spec(
    name: str, *, mode: str = "always_on", gib: float = 1, args: list[str] | None = None
) -> dict[str, Any]:
    """A POST /api/deployments body for a sim engine."""
    return {
        "name": name,
        "engine": "sim",
        "model": f"sim/{name}",
        "memory_gib": gib,
        "mode": mode,
        "args": args or [],
    }


def chat_body(model: str, *, stream: bool = False, max_tokens: int = 8) -> bytes:
    """A chat completion request body."""
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hello"}],
            "stream": stream,
            "max_tokens": max_tokens,
        }
    ).encode()
