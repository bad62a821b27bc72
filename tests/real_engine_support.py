"""A real llama.cpp `llama-server` behind a real `dgxmm serve`, for the real-engine tests.

`scripts/build-llama-server` builds the binary and assembles Gemma 3 270M into a cache outside
the repository; the tests find both through `LLAMA_SERVER` / `LLAMA_MODEL` (the Makefile
exports them) or, without those, through `scripts/build-llama-server --print`.  Without them
the tests skip with the reason; under CI=true that is a failure.  The Docker variants also
need the image `dgxmm-llama:local` (scripts/make-llama-image).

`Serve` runs `python -m dgxmm.cli serve --config FILE` as a subprocess on ephemeral ports,
reads the banner (ports, the generated admin password), logs in through the admin API and
drives it as an operator would.  On close it stops its deployments through the API (engines
outlive DGXMM by design), then SIGTERMs DGXMM, and removes whatever engine is left.

The engine runs with one thread and a small context (2 cores are shared), and the tests ask
for short answers; a long call is cut short by closing its connection.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.e2e_support import docker_problem, remove_containers_of
from tests.gateway_support import gateway_auth
from tests.litellm_support import LiteLLMProxy, Response, http_request, require_litellm

REPO = Path(__file__).resolve().parents[1]
LLAMA_IMAGE = "dgxmm-llama:local"
ENGINE_ARGS = ["-t", "1", "-tb", "1", "-c", "2048", "-np", "2", "--no-warmup"]
BANNER_S = 60.0
READY_S = 120.0  # a cold start is ~2 s; generous for a loaded shared machine
PROMPT = "Count from one to twenty in words, separated by commas."
RuntimeKind = Literal["process", "docker"]


@dataclass(frozen=True)
class LlamaBuild:
    """Where the built llama-server and the Gemma model are."""

    server: Path
    model: Path


def build_paths(script: str, *names: str) -> list[str | None]:
    """The paths named `names`: from the environment, else from `scripts/<script> --print`."""
    found = [os.environ.get(name) for name in names]
    if not all(found):
        printed = subprocess.run(
            [str(REPO / "scripts" / script), "--print"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        paths = dict(line.split("=", 1) for line in printed.stdout.splitlines() if "=" in line)
        found = [value or paths.get(name) for value, name in zip(found, names, strict=True)]
    return found


def llama_build() -> LlamaBuild | str:
    """The build (from the environment or the build script's cache), or why there is none."""
    server, model = build_paths("build-llama-server", "LLAMA_SERVER", "LLAMA_MODEL")
    if not server or not model:
        return "scripts/build-llama-server --print named no paths"
    build = LlamaBuild(Path(server), Path(model))
    if not build.server.is_file():
        return f"no llama-server at {build.server}"
    ran = subprocess.run(
        [str(build.server), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    if ran.returncode != 0:
        return f"{build.server} does not run: {(ran.stderr or ran.stdout).strip()[-300:]}"
    if not build.model.is_file() or build.model.read_bytes()[:4] != b"GGUF":
        return f"no GGUF model at {build.model}"
    return build


def _skip_or_fail(problem: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the real-engine tests, but: {problem} (scripts/bootstrap builds it)")
    pytest.skip(f"{problem}; run scripts/bootstrap (or scripts/build-llama-server)")


def require_llama(runtime: RuntimeKind = "process") -> LlamaBuild:
    """The build; skips (fails under CI) without it, or without Docker and the image."""
    build = llama_build()
    if isinstance(build, str):
        _skip_or_fail(build)
        raise AssertionError("unreachable")
    if runtime == "docker":
        problem = docker_problem()
        if problem is None:
            found = subprocess.run(
                ["docker", "image", "inspect", LLAMA_IMAGE],
                capture_output=True,
                timeout=30,
                check=False,
            )
            if found.returncode != 0:
                problem = f"image {LLAMA_IMAGE} is missing (scripts/make-llama-image makes it)"
        if problem is not None:
            _skip_or_fail(problem)
    return build


def poll(predicate: Callable[[], Any], what: str, timeout_s: float = READY_S) -> Any:
    """Call `predicate` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)  # poll interval; the deadline bounds the wait


# --- HTTP ------------------------------------------------------------------------------------


def call(
    port: int,
    method: str,
    path: str,
    body: object | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = READY_S,
) -> Response:
    """One request to 127.0.0.1:`port` on a fresh connection; the whole answer."""
    return http_request(f"http://127.0.0.1:{port}", method, path, body, headers, timeout_s)


class SseStream:
    """A streaming POST read one SSE event (the lines up to a blank line) at a time."""

    def __init__(
        self,
        port: int,
        path: str,
        body: object,
        timeout_s: float = READY_S,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        self._conn.request(
            "POST",
            path,
            json.dumps(body).encode(),
            {"content-type": "application/json", **(headers or {})},
        )
        self.response = self._conn.getresponse()

    def next_event(self) -> str | None:
        """The next event's text (its lines joined by newlines), None at the end."""
        lines: list[str] = []
        while True:
            raw = self.response.readline()
            if not raw:
                return "\n".join(lines) if lines else None
            line = raw.decode().rstrip("\r\n")
            if line:
                lines.append(line)
            elif lines:
                return "\n".join(lines)

    def rest(self) -> list[str]:
        """Every remaining event."""
        events = []
        while (event := self.next_event()) is not None:
            events.append(event)
        return events

    def close(self) -> None:
        """Hang up (the engine stops generating for a closed connection)."""
        self._conn.close()


def chat_body(model: str, *, stream: bool, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    """A deterministic chat completion request (temperature 0, fixed seed)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 42,
        "stream": stream,
        **extra,
    }


def data_of(event: str) -> str:
    """The `data:` payload of one SSE event."""
    return "\n".join(
        line.removeprefix("data:").strip()
        for line in event.splitlines()
        if line.startswith("data:")
    )


# Fields that differ between two identical requests: ids, clocks, speed.
_VOLATILE = ("id", "created", "timings")


def comparable(event: str) -> Any:
    """An SSE event with its per-request fields (id, created, timings) dropped."""
    payload = data_of(event)
    if not payload.startswith("{"):
        return payload
    parsed = json.loads(payload)
    return {k: v for k, v in parsed.items() if k not in _VOLATILE}


def stream_text(events: list[str]) -> str:
    """The generated text of a streamed chat completion."""
    text = []
    for event in events:
        payload = data_of(event)
        if payload.startswith("{"):
            for choice in json.loads(payload).get("choices", []):
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def models_of(proxy: LiteLLMProxy) -> list[str]:
    """The model names LiteLLM lists ([] while it does not answer)."""
    try:
        answer = call(proxy.port, "GET", "/v1/models", headers=proxy.auth, timeout_s=10)
    except OSError:
        return []
    if answer.status != 200:
        return []
    return [m["id"] for m in answer.json().get("data", [])]


# --- a real `dgxmm serve` -----------------------------------------------------------------------


@dataclass
class Serve:
    """`dgxmm serve` in a subprocess, with its admin API logged in."""

    workdir: Path
    runtime: RuntimeKind
    build: LlamaBuild
    total_gib: float = 8.0
    extra_config: str = ""
    programs: bool = True  # name the built llama-server in [engines] programs
    path: str | None = None  # PATH of DGXMM (and of its engines); default: the test's
    proc: subprocess.Popen[bytes] | None = None
    admin_port: int = 0
    gateway_port: int = 0
    password: str = ""
    cookie: str = ""
    csrf: str = ""
    deployments: dict[str, str] = field(default_factory=dict)  # name -> id
    banner: str = ""

    @property
    def data_dir(self) -> Path:
        """DGXMM's data directory."""
        return self.workdir / "dgxmm-data"

    @property
    def db(self) -> Path:
        """The event log."""
        return self.data_dir / "dgxmm.db"

    def config_text(self) -> str:
        """The TOML configuration this DGXMM runs with."""
        images = f'images = {{llamacpp = "{LLAMA_IMAGE}"}}\n' if self.runtime == "docker" else ""
        programs = f'programs = {{llamacpp = "{self.build.server}"}}\n' if self.programs else ""
        return (
            "[server]\n"
            f'data_dir = "{self.data_dir}"\n'
            "admin_port = 0\ngateway_port = 0\n"
            "[memory]\n"
            f"total_gib = {self.total_gib}\nreserve_gib = 0\nwatchdog_threshold_gib = 0\n"
            "[runtime]\n"
            f'kind = "{self.runtime}"\nstop_timeout_s = 10\n'
            "[engines]\n"
            f"{images}{programs}gpu = false\nstartup_timeout_s = 120\n"
            f"{self.extra_config}"
        )

    def start(self) -> Serve:
        """Start DGXMM and log in as the generated admin."""
        config = self.workdir / "dgxmm.toml"
        config.write_text(self.config_text())
        log = (self.workdir / "dgxmm.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dgxmm.cli", "serve", "--config", str(config)],
            cwd=self.workdir,
            env=self._env(),
            stdout=subprocess.PIPE,
            stderr=log,
        )
        log.close()
        self.banner = self._read_banner()
        admin = re.search(r"web UI and API : http://[^:]+:(\d+)/", self.banner)
        gateway = re.search(r"gateway        : http://[^:]+:(\d+)/", self.banner)
        password = re.search(r"admin login    : admin / (\S+)", self.banner)
        assert admin and gateway and password, self.banner
        self.admin_port, self.gateway_port = int(admin[1]), int(gateway[1])
        self.password = password[1]
        # Several Set-Cookie headers (the session and a "known client" one): read them all.
        conn = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=READY_S)
        try:
            body = json.dumps({"name": "admin", "password": self.password}).encode()
            conn.request("POST", "/dgxmm/api/login", body, {"content-type": "application/json"})
            answer = conn.getresponse()
            login = Response(answer.status, {}, answer.read())
            cookies = [v for k, v in answer.getheaders() if k.lower() == "set-cookie"]
        finally:
            conn.close()
        assert login.status == 200, login.body
        self.cookie = next(c.split(";", 1)[0] for c in cookies if c.startswith("dgxmm_session="))
        self.csrf = login.json()["csrf_token"]
        return self

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if self.path is not None:
            env["PATH"] = self.path
        return env

    def _read_banner(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        text = ""
        deadline = time.monotonic() + BANNER_S
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while "runtime        :" not in text or "admin login" not in text:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    pytest.fail(f"dgxmm serve printed no banner in {BANNER_S:.0f} s: {text}")
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.fail(f"dgxmm serve exited: {text}{self.log_tail()}")
                text += chunk.decode(errors="replace")
        self._drain_stdout()
        return text

    def _drain_stdout(self) -> None:
        """Keep reading DGXMM's stdout into its log, so a full pipe never blocks it."""
        assert self.proc is not None and self.proc.stdout is not None
        out, path = self.proc.stdout, self.workdir / "dgxmm.out"

        def drain() -> None:
            with path.open("ab") as sink:
                for line in iter(out.readline, b""):
                    sink.write(line)
                    sink.flush()

        threading.Thread(target=drain, daemon=True).start()

    def log_tail(self, lines: int = 30) -> str:
        """The end of DGXMM's own output (stdout and stderr)."""
        text = ""
        for name in ("dgxmm.out", "dgxmm.log"):
            path = self.workdir / name
            if path.exists():
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def api(self, method: str, path: str, body: object | None = None) -> Any:
        """An admin API call that must succeed; its JSON."""
        headers = {"cookie": self.cookie, "x-csrf-token": self.csrf}
        got = call(self.admin_port, method, f"/dgxmm/api{path}", body, headers)
        assert got.status in (200, 201, 202), (method, path, got.status, got.body)
        return got.json()

    def deploy(
        self,
        name: str,
        *,
        memory_gib: float = 1.0,
        mode: str = "on_demand",
        engine: str = "llamacpp",
        model: str | None = None,
        args: list[str] | None = None,
        idle_timeout_s: int = 60,
    ) -> str:
        """Create a deployment (default: llama.cpp serving the Gemma model); its id."""
        created = self.api(
            "POST",
            "/deployments",
            {
                "name": name,
                "engine": engine,
                "model": model or str(self.build.model),
                "memory_gib": memory_gib,
                "mode": mode,
                "idle_timeout_s": idle_timeout_s,
                "args": ENGINE_ARGS if args is None else args,
            },
        )
        dep_id = str(created.get("id") or created["deployment"]["id"])
        self.deployments[name] = dep_id
        return dep_id

    def deployment(self, name: str) -> dict[str, Any]:
        """GET /deployments/{id}."""
        got: dict[str, Any] = self.api("GET", f"/deployments/{self.deployments[name]}")
        return got.get("deployment", got)

    def state(self, name: str) -> str:
        """The deployment's lifecycle state."""
        return str(self.deployment(name)["state"])

    def wait_state(self, name: str, *states: str, timeout_s: float = READY_S) -> dict[str, Any]:
        """Poll until the deployment is in one of `states`; the deployment."""
        return poll(  # type: ignore[no-any-return]
            lambda: (d := self.deployment(name))["state"] in states and d,
            f"{name} to be {'/'.join(states)}",
            timeout_s,
        )

    def chat(self, name: str) -> Response:
        """A short non-streaming chat completion for `name` through the gateway."""
        return call(
            self.gateway_port, "POST", self.gateway_path(name), chat_body(name, stream=False),
            self.gateway_auth,
        )  # fmt: skip

    @property
    def gateway_auth(self) -> dict[str, str]:
        """The Authorization header the gateway requires (what LiteLLM sends)."""
        return gateway_auth(self.data_dir)

    def gateway_path(self, name: str, endpoint: str = "chat/completions") -> str:
        """The gateway path LiteLLM would call for `name`."""
        return f"/d/{self.deployments[name]}/v1/{endpoint}"

    def engine_port(self, name: str) -> int:
        """The host port the deployment's engine answers on (from its EngineStarting event)."""
        started = [e for e in self.events(name) if e["type"] == "EngineStarting"]
        assert started, f"{name} has no engine"
        return int(started[-1]["data"]["port"])

    def engine_runtime_id(self, name: str) -> str:
        """The runtime's id of the deployment's engine (container id or `pid:N`)."""
        started = [e for e in self.events(name) if e["type"] == "EngineStarting"]
        assert started, f"{name} has no engine"
        return str(started[-1]["data"]["runtime_id"])

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The event log as `dgxmm events --json` prints it (optionally one deployment's)."""
        out = self.cli("events", "--db", str(self.db), "--json")
        events = []
        for line in out.splitlines():
            if line.strip():
                row = json.loads(line)
                events.append({**row, "type": row["event"]["type"], "data": row["event"]})
        if name is None:
            return events
        stream = f"deployment:{self.deployments[name]}"
        return [e for e in events if e.get("stream") == stream]

    def cli(self, *args: str) -> str:
        """Run a `dgxmm` command on this box; its stdout (it must succeed)."""
        done = subprocess.run(
            [sys.executable, "-m", "dgxmm.cli", *args],
            cwd=self.workdir,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    def kill_engine(self, name: str, runtime_id: str | None = None) -> None:
        """SIGKILL the deployment's engine behind DGXMM's back (`runtime_id`: looked up
        beforehand, since reading the log takes seconds on a long one)."""
        runtime_id = runtime_id or self.engine_runtime_id(name)
        if runtime_id.startswith("pid:"):
            os.killpg(int(runtime_id.removeprefix("pid:")), signal.SIGKILL)
        else:
            subprocess.run(["docker", "kill", "-s", "KILL", runtime_id], check=True, timeout=60)

    def close(self) -> None:
        """Stop the deployments, then DGXMM, then anything left behind."""
        if self.proc is not None and self.proc.poll() is None:
            for dep_id in self.deployments.values():
                with contextlib.suppress(Exception):
                    headers = {"cookie": self.cookie, "x-csrf-token": self.csrf}
                    call(
                        self.admin_port,
                        "POST",
                        f"/dgxmm/api/deployments/{dep_id}/stop",
                        {},
                        headers,
                        timeout_s=30,
                    )
            for name in self.deployments:
                with contextlib.suppress(Exception):
                    self.wait_state(name, "stopped", "failed", timeout_s=30)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        state = self.data_dir / "engines" / "process-engines.json"
        if state.exists():
            for record in json.loads(state.read_text()).get("engines", []):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(record["pid"]), signal.SIGKILL)
        if self.runtime == "docker":
            remove_containers_of(self.deployments.values())


@contextlib.contextmanager
def serving(tmp_path: Path, runtime: RuntimeKind, **kwargs: Any) -> Iterator[Serve]:
    """A started `Serve`, closed afterwards (its log shown when the test failed)."""
    build = require_llama(runtime)
    serve = Serve(tmp_path, runtime, build, **kwargs)
    try:
        yield serve.start()
    except BaseException:
        print(f"--- dgxmm log ---\n{serve.log_tail(60)}")
        raise
    finally:
        serve.close()


def litellm_file_backed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[LiteLLMProxy, Path, str]:
    """A real LiteLLM (not started) reading the config file DGXMM writes: the proxy, that
    file, and the `[litellm]` configuration that makes DGXMM write it (`Serve.extra_config`)."""
    litellm_config = tmp_path / "litellm.yaml"
    proxy = LiteLLMProxy(require_litellm(), litellm_config, tmp_path / "litellm-run")
    proxy.workdir.mkdir()
    monkeypatch.setenv("LITELLM_MASTER_KEY", proxy.master_key)
    extra = (
        '[litellm]\nenabled = true\nbackend = "file"\n'
        f'url = "{proxy.url}"\nconfig_path = "{litellm_config}"\n'
    )
    return proxy, litellm_config, extra
