"""Deploying never takes LiteLLM down (issue 33): a real LiteLLM 1.108.7 under gunicorn.

LiteLLM runs under gunicorn with `docs/litellm-gunicorn.conf.py` (2 workers, a pidfile) on a
config file DGXMM writes (file back-end), and DGXMM (in-process, process runtime, simulated
engines) reloads it with `reload_command = kill -HUP "$(cat <pidfile>)"`.  Each run: 4 clients
send requests continuously through LiteLLM to two always-on models and one on-demand model
(a fresh connection per request, no retries) while a model is created, another reconfigured
(switched to another served model) and the created one removed.  Every request must be
answered completely (none failed, none reset), each new entry served within 30 s of its write,
and one reload per write, never one started while the previous one's workers were booting
(read from gunicorn's log).

Clients that keep their connection alive meet what a fresh connection never does: the stopping
worker holds their connection.  One test runs a client with a new connection per request, a
pooled one with one retry (like the openai SDK) and a pooled one without retries through 3
creates and 3 removes, and none may fail; another stops the workers under two idle kept
connections and looks at what happens to each.

Set `DGXMM_RELOAD_OUTAGE=1` to run the same load against LiteLLM's `--reload` (no command) and
print the outage it causes (the figures in docs/litellm.md); it asserts only that the changes
are served, and is skipped otherwise (it takes minutes: each write restarts LiteLLM's worker).
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from actors.controller import DeploymentSpec
from actors.memory_broker import GIB
from dgxmm.app import App
from dgxmm.config import Config, LiteLLMConfig, MemoryConfig, RuntimeConfig, ServerConfig
from dgxmm.litellm.filesync import DEFAULT_CONFIG
from tests.keepalive_support import Kept
from tests.litellm_support import (
    REPO,
    AppInThread,
    LiteLLMProxy,
    Response,
    free_port,
    http_request,
    require_litellm,
    sse_data,
    stop_leftover_engines,
)
from tests.test_litellm_e2e import (
    LOAD_MAX_REQUESTS,
    Load,
    Outcome,
    _load_request,
    message_text,
    stream_text,
)

pytestmark = pytest.mark.litellm

ADMIN = "admin:e2e"
ALWAYS_1, ALWAYS_2, OD, SPARE = "rl-always-1", "rl-always-2", "rl-od", "rl-spare"
LOAD_MODELS = (ALWAYS_1, ALWAYS_2, OD)
CLIENTS = 4
SPECS = (
    DeploymentSpec(
        name=ALWAYS_1, engine="sim", model="rl/always-1b", memory_bytes=GIB, mode="always_on"
    ),
    DeploymentSpec(
        name=ALWAYS_2, engine="sim", model="rl/always-2b", memory_bytes=GIB, mode="always_on"
    ),
    DeploymentSpec(name=OD, engine="sim", model="rl/od-1b", memory_bytes=GIB, mode="on_demand"),
    DeploymentSpec(
        name=SPARE, engine="sim", model="rl/spare-v0", memory_bytes=GIB, mode="on_demand"
    ),
)
WORKERS = 2
SERVED_WITHIN_S = 30.0  # the bound from a write to its entry being served
READY_S = 60.0
RUNS = 3
GUNICORN_CONF = REPO / "docs" / "litellm-gunicorn.conf.py"


class GunicornLiteLLM(LiteLLMProxy):
    """LiteLLM's app under gunicorn with DGXMM's draining worker, as docs/litellm.md runs it."""

    def __init__(self, binary: Path, config_path: Path, workdir: Path) -> None:
        super().__init__(binary, config_path, workdir, reload=False)
        self.pidfile = workdir / "gunicorn.pid"

    def argv(self) -> list[str]:
        gunicorn = self.binary.parent / "gunicorn"
        return [
            str(gunicorn),
            "-c",
            str(GUNICORN_CONF),
            "--bind",
            f"127.0.0.1:{self.port}",
            "--workers",
            str(WORKERS),
            "--pid",
            str(self.pidfile),
        ]

    def extra_env(self) -> dict[str, str]:
        return {"LITELLM_CONFIG": str(self.config_path)}


@dataclass
class Stack:
    dgxmm: AppInThread
    proxy: LiteLLMProxy
    config_path: Path
    mode: str  # "command" (gunicorn + reload_command) or "watch" (--reload)
    ids: dict[str, str] = field(default_factory=dict)

    @property
    def app(self) -> App:
        app: App = self.dgxmm.app
        return app

    def chat_body(self, name: str, text: str = "hi", stream: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model": name, "messages": [{"role": "user", "content": text}]}
        if stream:
            body["stream"] = True
        return body

    def served(self) -> dict[str, str] | None:
        """LiteLLM's DGXMM entries now: model_info.id -> litellm_params.model (None: down)."""
        try:
            answer = http_request(
                self.proxy.url, path="/model/info", headers=self.proxy.auth, timeout_s=30
            )
        except OSError:
            return None
        if answer.status != 200:
            return None
        return {
            item["model_info"]["id"]: item["litellm_params"]["model"]
            for item in answer.json()["data"]
            if "-dgxmm-" in (item.get("model_info") or {}).get("id", "")
        }

    def wanted(self) -> dict[str, str]:
        entries = self.dgxmm.read(self.app.litellm.entries)
        return {e.model_id: f"openai/{e.upstream_model}" for e in entries}

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.dgxmm.read(self.app.litellm.status)
        return status

    def wait_serving(self, timeout_s: float) -> float:
        """Poll until LiteLLM serves exactly what DGXMM wants; returns time.time() then."""
        deadline = time.monotonic() + timeout_s
        while (served := self.served()) != self.wanted():
            if time.monotonic() > deadline:
                pytest.fail(
                    f"LiteLLM does not serve what DGXMM wants after {timeout_s:.0f} s: "
                    f"want {self.wanted()}, serves {served}, status {self.status()}\n"
                    f"{self.proxy.log_tail()}"
                )
            time.sleep(0.1)  # poll interval; the deadline bounds the wait
        return time.time()


def _config(data_dir: Path, config_path: Path, proxy: LiteLLMProxy, mode: str) -> Config:
    command = None
    if isinstance(proxy, GunicornLiteLLM):
        command = f'kill -HUP "$(cat {proxy.pidfile})"'
    return Config(
        server=ServerConfig(
            data_dir=str(data_dir), admin_port=free_port(), gateway_port=free_port()
        ),
        memory=MemoryConfig(total_gib=12.0, reserve_gib=0.0, watchdog_threshold_gib=0.0),
        runtime=RuntimeConfig(kind="process"),
        litellm=LiteLLMConfig(
            enabled=True,
            backend="file",
            config_path=str(config_path),
            url=proxy.url,
            reload_command=command,
            reload_timeout_s=SERVED_WITHIN_S,
        ),
    )


def _modes() -> list[Any]:
    outage = pytest.mark.skipif(
        not os.environ.get("DGXMM_RELOAD_OUTAGE"),
        reason="measures --reload's outage (minutes); set DGXMM_RELOAD_OUTAGE=1",
    )
    return ["command", pytest.param("watch", marks=outage)]


@pytest.fixture(scope="module", params=_modes())
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    mode: str = request.param
    binary = require_litellm()
    if mode == "command" and not (binary.parent / "gunicorn").is_file():
        pytest.fail(f"no gunicorn next to {binary}: LiteLLM's proxy extra installs it")
    data_dir = tmp_path_factory.mktemp("dgxmm-data")
    config_path = tmp_path_factory.mktemp("litellm-config") / "litellm.json"
    config_path.write_text(json.dumps(DEFAULT_CONFIG))
    workdir = tmp_path_factory.mktemp("litellm-run")
    proxy: LiteLLMProxy = (
        GunicornLiteLLM(binary, config_path, workdir)
        if mode == "command"
        else LiteLLMProxy(binary, config_path, workdir)
    )
    dgxmm: AppInThread | None = None
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("LITELLM_MASTER_KEY", proxy.master_key)
            proxy.start()  # LiteLLM first, on an empty model list
            dgxmm = AppInThread(App(_config(data_dir, config_path, proxy, mode))).start()
            stack = Stack(dgxmm, proxy, config_path, mode)
            controller = stack.app.controller
            assert controller is not None
            for spec in SPECS:
                stack.ids[spec.name] = dgxmm.run(controller.create(spec, ADMIN)).id
            stack.wait_serving(READY_S * 2)
            deadline = time.monotonic() + READY_S
            while (reload := stack.status()["reload"])["pending"]:  # every worker agrees
                assert time.monotonic() < deadline, reload
                time.sleep(0.1)  # poll interval; the deadline bounds the wait
            for name in LOAD_MODELS:  # each answers once before the load starts
                answer = http_request(
                    proxy.url,
                    "POST",
                    "/v1/chat/completions",
                    stack.chat_body(name),
                    proxy.auth,
                    READY_S,
                )
                assert answer.status == 200, answer.body
            yield stack
    finally:
        proxy.stop()
        if dgxmm is not None:
            dgxmm.stop()
        stop_leftover_engines(data_dir)


class CyclingLoad(Load):
    """`CLIENTS` clients, each calling the load models in turn until stopped (threads)."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(stack, (), 0)  # type: ignore[arg-type]
        self._threads = [
            threading.Thread(target=self._cycle, args=(stack, n), daemon=True)
            for n in range(CLIENTS)
        ]

    def _cycle(self, stack: Stack, n: int) -> None:
        for index in range(LOAD_MAX_REQUESTS):
            if self._stop.is_set():
                return
            model = LOAD_MODELS[(n + index) % len(LOAD_MODELS)]
            self.outcomes.append(_load_request(stack, model, n, index))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Change:
    what: str
    written_at: float  # DGXMM's last_write_at (wall clock)
    served_at: float  # the test saw LiteLLM serve it (wall clock)

    @property
    def took(self) -> float:
        return self.served_at - self.written_at


def _change(stack: Stack, what: str, action: Any) -> Change:
    """Make a change that writes the file once; wait until LiteLLM serves the new list."""
    writes = stack.status()["config_writes"]
    action()
    deadline = time.monotonic() + READY_S
    while (status := stack.status())["config_writes"] == writes:
        assert time.monotonic() < deadline, f"{what} wrote nothing: {status}"
        time.sleep(0.02)  # poll interval; the deadline bounds the wait
    assert status["config_writes"] == writes + 1, status
    served_at = stack.wait_serving(READY_S * 2)
    return Change(what, status["last_write_at"], served_at)


_HUP = re.compile(r"\[(\d+)\] \[INFO\] Handling signal: hup")
_BOOT = re.compile(r"Booting worker with pid: (\d+)")
_UP = re.compile(r"\[(\d+)\] \[INFO\] Application startup complete")


def _reloads_in_log(text: str) -> list[list[int]]:
    """Gunicorn's HUPs in its log, each with the workers it booted; asserts that every HUP came
    after the previous HUP's workers had all completed their start-up (reloads serialised)."""
    reloads: list[list[int]] = []
    up: set[int] = set()
    for line in text.splitlines():
        if _HUP.search(line):
            if reloads:
                assert set(reloads[-1]) <= up, f"a HUP while workers {reloads[-1]} booted"
            reloads.append([])
        elif (boot := _BOOT.search(line)) and reloads:
            reloads[-1].append(int(boot.group(1)))
        elif started := _UP.search(line):
            up.add(int(started.group(1)))
    return reloads


@pytest.mark.parametrize("run", range(1, RUNS + 1))
def test_creating_reconfiguring_and_removing_under_load_fail_no_request(
    stack: Stack, run: int
) -> None:
    controller = stack.app.controller
    assert controller is not None
    log_from = stack.proxy.log_path.stat().st_size
    before = stack.status()["reload"]
    new = DeploymentSpec(
        name=f"rl-new-{run}",
        engine="sim",
        model=f"rl/new-{run}",
        memory_bytes=GIB,
        mode="on_demand",
    )
    started = time.monotonic()
    with CyclingLoad(stack) as load:
        load.wait_for_more(2 * CLIENTS)
        created = _change(
            stack,
            "create",
            lambda: stack.ids.update({new.name: stack.dgxmm.run(controller.create(new, ADMIN)).id}),
        )
        answer = http_request(
            stack.proxy.url,
            "POST",
            "/v1/chat/completions",
            stack.chat_body(new.name),
            stack.proxy.auth,
            READY_S,
        )
        assert answer.status == 200, answer.body  # the new entry is served, by every worker
        load.wait_for_more(CLIENTS)
        reconfigured = _change(
            stack,
            "reconfigure",
            lambda: stack.dgxmm.run(
                controller.reconfigure(stack.ids[SPARE], ADMIN, model=f"rl/spare-v{run}")
            ),
        )
        load.wait_for_more(CLIENTS)
        removed = _change(
            stack,
            "remove",
            lambda: stack.dgxmm.run(controller.remove(stack.ids.pop(new.name), ADMIN)),
        )
        load.wait_for_more(CLIENTS)
        deadline = time.monotonic() + READY_S
        while (status := stack.status())["reload"]["pending"]:  # the last reload settles
            assert time.monotonic() < deadline, status
            time.sleep(0.1)  # poll interval; the deadline bounds the wait
    wall = time.monotonic() - started
    changes = (created, reconfigured, removed)
    outcomes = load.outcomes
    failed = [o for o in outcomes if not o.ok]
    slowest = max(o.ended - o.started for o in outcomes)
    reload = status["reload"]
    reloads = reload["reloads"] - before["reloads"]
    durations = [r["duration_s"] for r in reload["recent"]][-reloads:]
    report = (
        f"\n{stack.mode} run {run}: {len(outcomes)} requests, {len(failed)} failed "
        f"({len([o for o in failed if not o.answered])} without an answer); slowest "
        f"{slowest:.1f} s; served after write: "
        + ", ".join(f"{c.what} {c.took:.1f} s" for c in changes)
        + f"; {reloads} reloads by DGXMM, times {durations}; {wall:.0f} s"
    )
    if stack.mode == "watch":  # --reload: measured, not held to the bound
        print(report + "\n" + "\n".join(o.detail for o in failed[:10]))
        return
    log = stack.proxy.log_path.read_bytes()[log_from:].decode(errors="replace")
    hups = _reloads_in_log(log)
    print(report + f"; {len(hups)} HUPs, workers {hups}")
    assert failed == [], failed
    for change in changes:
        assert change.took <= SERVED_WITHIN_S, change
    # A reload per write (one more when a write came while the previous reload's workers may
    # still have been booting), each booting WORKERS new workers, none started early.
    assert 3 <= reloads <= 6, reload
    assert reload["failures"] == before["failures"] and reload["failing"] is False, reload
    assert all(d <= SERVED_WITHIN_S for d in durations), durations
    assert len(hups) == reloads, log
    assert all(len(workers) == WORKERS for workers in hups), hups
    assert status["loaded"] is True or stack.served() == stack.wanted()


# --------------------------------------------------------------------------------------------
# Kept-alive connections across reloads: a stopping worker answers what is already on its way


ROUNDS = 3  # each: a model created, then removed (two reloads)
POOLED = 1  # pooled clients without retries
CLOSE_SEEN_S = 10.0  # how long a client waits for the server's close after `Connection: close`
CONNECTION_ERRORS = (OSError, http.client.HTTPException)


@dataclass
class Tally:
    """What one client of `KeptAliveLoad` did."""

    kind: str
    requests: int = 0
    failed: list[str] = field(default_factory=list)
    retried: int = 0  # connection errors that a retry on a new connection answered
    connections: int = 0  # connections opened
    idle_closed: int = 0  # kept connections found closed by the server before reuse
    close_answers: int = 0  # answers that said `Connection: close`
    closed_after: int = 0  # ... after which the server closed the connection

    def line(self) -> str:
        """What the client did, in one line."""
        return (
            f"{self.kind}: {self.requests} requests, {len(self.failed)} failed, "
            f"{self.retried} retried, {self.connections} connections, "
            f"{self.close_answers} `Connection: close` answers (then closed: "
            f"{self.closed_after}), {self.idle_closed} found closed before reuse"
        )


def _verdict(status: int, data: bytes, stream: bool) -> str:
    """'' for a complete 200 answer, else what was wrong."""
    if status != 200:
        return f"HTTP {status}: {data[:300]!r}"
    try:
        if stream:
            payloads = sse_data(data)
            if payloads[-1:] == ["[DONE]"] and stream_text(payloads):
                return ""
            return f"incomplete stream: {data[-300:]!r}"
        return "" if message_text(Response(200, {}, data)) else f"no text: {data[:300]!r}"
    except (ValueError, LookupError) as exc:
        return f"{type(exc).__name__}: {exc}: {data[:300]!r}"


class PooledClient:
    """One connection kept alive across requests (`Kept`: a new one only after the server
    closed it, that is after an answer that said `Connection: close`, or when the kept one is
    readable before reuse).  `retries` connection errors are retried on a new connection (the
    openai SDK retries them; a plain integration does not)."""

    def __init__(self, stack: Stack, tally: Tally, retries: int) -> None:
        self._kept = Kept(stack.proxy.port)
        self._headers = {"content-type": "application/json", **stack.proxy.auth}
        self._tally = tally
        self._retries = retries

    def request(self, body: dict[str, Any]) -> tuple[bool, str]:
        """POST `body` to /v1/chat/completions: (answered, '' or what was wrong)."""
        kept = self._kept
        for attempt in range(self._retries + 1):
            before = kept.connections, kept.idle_closed
            try:
                conn = kept.connection()
                conn.request(
                    "POST", "/v1/chat/completions", json.dumps(body).encode(), self._headers
                )
                answer = conn.getresponse()
                data = answer.read()
            except CONNECTION_ERRORS as exc:
                self.close()
                if attempt < self._retries:
                    self._tally.retried += 1
                    continue
                return False, f"{type(exc).__name__}: {exc}"
            finally:
                self._tally.connections += kept.connections - before[0]
                self._tally.idle_closed += kept.idle_closed - before[1]
            if answer.will_close:  # http.client has already closed its side
                self._tally.close_answers += 1
                self._tally.closed_after += self._server_closed()
                self.close()
            return True, _verdict(answer.status, data, bool(body.get("stream")))
        raise AssertionError("unreachable: the last attempt returns")

    def close(self) -> None:
        """Close the kept connection, if any."""
        self._kept.close()

    def _server_closed(self) -> bool:
        """Whether the server closes the connection (EOF) within `CLOSE_SEEN_S`."""
        watch = self._kept.watch
        if watch is None or not select.select([watch], [], [], CLOSE_SEEN_S)[0]:
            return False
        try:
            return watch.recv(1) == b""
        except OSError:  # a reset is not the orderly close that `Connection: close` promises
            return False


class KeptAliveLoad(Load):
    """Three kinds of client at once, each calling the load models in turn until stopped: a
    new connection per request (like curl), a kept-alive one with one retry on a connection
    error (like the openai SDK), and `POOLED` kept-alive ones without retries."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(stack, (), 0)  # type: ignore[arg-type]
        self.tallies = [Tally("new connection per request"), Tally("pooled, one retry")]
        self.tallies += [Tally(f"pooled, no retry #{n + 1}") for n in range(POOLED)]
        self._threads = [
            threading.Thread(target=self._run, args=(stack, n), daemon=True)
            for n in range(len(self.tallies))
        ]

    def _run(self, stack: Stack, n: int) -> None:
        tally = self.tallies[n]
        pooled = None if n == 0 else PooledClient(stack, tally, retries=1 if n == 1 else 0)
        try:
            for index in range(LOAD_MAX_REQUESTS):
                if self._stop.is_set():
                    return
                model = LOAD_MODELS[(n + index) % len(LOAD_MODELS)]
                if pooled is None:
                    outcome = _load_request(stack, model, n, index)  # type: ignore[arg-type]
                    tally.connections += 1
                else:
                    outcome = self._pooled_request(stack, pooled, model, n, index)
                tally.requests += 1
                if not outcome.ok:
                    tally.failed.append(outcome.detail)
                self.outcomes.append(outcome)
        finally:
            if pooled is not None:
                pooled.close()

    @staticmethod
    def _pooled_request(
        stack: Stack, pooled: PooledClient, model: str, n: int, index: int
    ) -> Outcome:
        stream = index % 2 == 1
        started = time.monotonic()
        answered, detail = pooled.request(stack.chat_body(model, f"kept {n} {index}", stream))
        ok = answered and not detail
        return Outcome(model, n, stream, started, time.monotonic(), answered, ok, detail)


def test_kept_alive_clients_lose_no_request_while_models_are_created_and_removed(
    stack: Stack, tried: Callable[[str], None]
) -> None:
    """Clients that keep their connection alive, with and without a retry, and one that opens
    a connection per request, through 3 creates and 3 removes (a reload each): none fails.

    Each reload stops the workers that hold the kept connections; a stopping worker answers
    what is already on its way there, with `Connection: close`, and then closes."""
    if stack.mode == "watch":
        pytest.skip("--reload restarts its only worker: no kept connection can survive that")
    controller = stack.app.controller
    assert controller is not None

    def create(spec: DeploymentSpec) -> None:
        stack.ids[spec.name] = stack.dgxmm.run(controller.create(spec, ADMIN)).id

    def remove(name: str) -> None:
        stack.dgxmm.run(controller.remove(stack.ids.pop(name), ADMIN))

    log_from = stack.proxy.log_path.stat().st_size
    before = stack.status()["reload"]
    started = time.monotonic()
    load = KeptAliveLoad(stack)
    with load:
        load.wait_for_more(2 * len(load.tallies))
        for n in range(1, ROUNDS + 1):
            new = DeploymentSpec(
                name=f"rl-kept-{n}",
                engine="sim",
                model=f"rl/kept-{n}",
                memory_bytes=GIB,
                mode="on_demand",
            )
            _change(stack, "create", functools.partial(create, new))
            load.wait_for_more(len(load.tallies))
            _change(stack, "remove", functools.partial(remove, new.name))
            load.wait_for_more(len(load.tallies))
        deadline = time.monotonic() + READY_S
        while (status := stack.status())["reload"]["pending"]:  # the last reload settles
            assert time.monotonic() < deadline, status
            time.sleep(0.1)  # poll interval; the deadline bounds the wait
    reloads = status["reload"]["reloads"] - before["reloads"]
    log = stack.proxy.log_path.read_bytes()[log_from:].decode(errors="replace")
    hups = _reloads_in_log(log)
    print(f"\n{reloads} reloads, {len(hups)} HUPs, {time.monotonic() - started:.0f} s")
    for tally in load.tallies:
        print(tally.line())
        tried(tally.line())
    assert [t.failed for t in load.tallies] == [[] for _ in load.tallies]
    assert 2 * ROUNDS <= reloads <= 4 * ROUNDS and len(hups) == reloads, status["reload"]
    for tally in load.tallies[1:]:
        # Every reload stopped the worker that held the kept connection: it answered the
        # next request with `Connection: close`, then closed the connection.
        assert tally.close_answers >= len(hups), tally
        assert tally.closed_after == tally.close_answers, tally


def _wait_log(stack: Stack, offset: int, done: Callable[[str], bool], what: str) -> None:
    """Poll LiteLLM's log from `offset` until `done(text)`; fails after `READY_S`."""
    deadline = time.monotonic() + READY_S
    while not done(stack.proxy.log_path.read_bytes()[offset:].decode(errors="replace")):
        assert time.monotonic() < deadline, f"no {what}:\n{stack.proxy.log_tail()}"
        time.sleep(0.05)  # poll interval; the deadline bounds the wait


def _ask(stack: Stack, conn: http.client.HTTPConnection, model: str) -> tuple[int, str, bytes]:
    """One chat request on `conn`: status, the answer's Connection header, body."""
    body = json.dumps(stack.chat_body(model)).encode()
    conn.request(
        "POST",
        "/v1/chat/completions",
        body,
        {"content-type": "application/json", **stack.proxy.auth},
    )
    answer = conn.getresponse()
    data = answer.read()
    return answer.status, (answer.getheader("connection") or "").lower(), data


def _closed_within(watch: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes the connection (EOF, not a reset) within `timeout_s`."""
    if not select.select([watch], [], [], timeout_s)[0]:
        return False
    try:
        return watch.recv(1) == b""
    except OSError:
        return False


def test_a_stopping_worker_answers_on_an_idle_kept_connection_and_closes_an_unused_one_late(
    stack: Stack, tried: Callable[[str], None]
) -> None:
    """Two connections kept alive and idle when the workers holding them are stopped (a HUP):
    neither is closed at once; a request sent on one afterwards is answered, with
    `Connection: close`, and then the connection is closed; the other is closed only after it
    has been idle longer than clients keep an idle connection (httpx: 5 s)."""
    if stack.mode == "watch":
        pytest.skip("--reload restarts its only worker: no kept connection can survive that")
    assert isinstance(stack.proxy, GunicornLiteLLM)
    conns = [http.client.HTTPConnection("127.0.0.1", stack.proxy.port, timeout=READY_S)]
    conns.append(http.client.HTTPConnection("127.0.0.1", stack.proxy.port, timeout=READY_S))
    watches: list[socket.socket] = []  # duplicates of the sockets, to see the server's close
    try:
        for conn in conns:
            conn.connect()
            assert conn.sock is not None
            watches.append(conn.sock.dup())
            status, connection, data = _ask(stack, conn, ALWAYS_1)
            assert (status, connection) == (200, ""), data
        last_answer = time.monotonic()
        log_from = stack.proxy.log_path.stat().st_size
        os.kill(int(stack.proxy.pidfile.read_text()), signal.SIGHUP)
        # uvicorn logs one of these in each old worker after `shutdown()` on each connection:
        # the first while connections remain open, the second when none did.
        _wait_log(
            stack,
            log_from,
            lambda text: (
                text.count("Waiting for connections to close") + text.count("Finished server")
                >= WORKERS
            ),
            "shutdown of both old workers",
        )
        assert select.select(watches, [], [], 0)[0] == [], "an idle connection was closed"
        status, connection, data = _ask(stack, conns[0], ALWAYS_2)
        assert (status, connection) == (200, "close"), data
        assert _closed_within(watches[0], CLOSE_SEEN_S), "not closed after `Connection: close`"
        assert _closed_within(watches[1], READY_S), "the unused connection was never closed"
        idle_s = time.monotonic() - last_answer
        tried(f"the unused kept connection was closed after {idle_s:.1f} s idle")
        print(f"\nthe unused kept connection was closed after {idle_s:.1f} s idle")
        assert 5.0 < idle_s < 15.0, idle_s
    finally:
        for conn in conns:
            conn.close()
        for watch in watches:
            watch.close()
