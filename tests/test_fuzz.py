"""Fuzzing both listeners and the CLI: malformed input gets a clear 4xx, never a 5xx or a crash.

Hypothesis generates request heads, bodies and JSON for the admin API and the gateway (both
real `HTTPServer`s on loopback, in a thread of their own, in front of a simulated box and a
simulated engine), and argument lists for `dgxmm`; a fixed corpus adds the cases of the
hostile-input report (HEAD, 200k-level JSON, garbled configs, ...).  Meanwhile a healthy
client keeps using both listeners and must see no error at all.

The gateway requires its key (issue 38): generated heads carry `Authorization` values from
the right key to near misses (a byte off, a prefix, another scheme, no scheme), and a case
without the right key never reaches the engine.  A real DGXMM (`App`, with its event log)
gets generated requests with wrong keys too: its log shows no model started and no request
queued, and its gateway relayed nothing.  Each test is bounded
(`DGXMM_FUZZ_EXAMPLES`, default 300 cases per generator; about a minute in all) and prints
how many cases it tried.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.controller import DeploymentSpec
from actors.memory_broker import GIB
from actors.ports import EngineHandle
from dgxmm import cli
from dgxmm.app import App
from dgxmm.config import Config, MemoryConfig, RuntimeConfig, ServerConfig
from events import model as m
from gateway.access import Access
from simulations.engine import SimOptions, serve
from tests.api_support import api_box
from tests.litellm_support import AppInThread, free_port, stop_leftover_engines
from tests.test_gateway_sim import MODEL, sim_rig

EXAMPLES = int(os.environ.get("DGXMM_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
IO_TIMEOUT_S = 5.0
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
KEY = b"dgxmm-gw-fuzz-0123456789abcdefghijklmnopqrstuvwxyz"  # the rig's gateway key
AUTH = b"authorization: Bearer " + KEY


# --- the rig: both listeners in a thread, and a healthy client ---------------------------------


@dataclass
class Rig:
    admin_port: int = 0
    gateway_port: int = 0
    cookie: str = ""
    csrf: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None
    healthy_ok: int = 0
    healthy_errors: list[str] = field(default_factory=list)
    tried: dict[str, int] = field(default_factory=dict)
    wake: Callable[[], object] = lambda: None  # ends the listeners' loop (set by it)
    # Requests the engine of deployment `a` received (the healthy client uses `h`, on its own).
    engine_requests: Callable[[], int] = lambda: 0

    def count(self, what: str) -> None:
        self.tried[what] = self.tried.get(what, 0) + 1


def exchange(port: int, raw: bytes, *, half_close: bool = True) -> bytes:
    """Send raw bytes, close our side, read until the server closes (bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        sock.settimeout(IO_TIMEOUT_S)
        try:
            sock.sendall(raw)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server refused early (e.g. a 413 and close): read what it said
        chunks: list[bytes] = []
        deadline = time.monotonic() + IO_TIMEOUT_S
        with contextlib.suppress(OSError):  # a reset or the timeout ends the reply too
            while sum(map(len, chunks)) < 4 << 20 and time.monotonic() < deadline:
                chunks.append(sock.recv(65536))
                if not chunks[-1]:
                    break
        return b"".join(chunks)


def statuses(reply: bytes) -> list[int]:
    """The status codes of every response in `reply` (pipelined answers included)."""
    found = []
    for line in reply.split(b"\r\n"):
        if line.startswith(b"HTTP/1.1 ") and line[9:12].isdigit():
            found.append(int(line[9:12]))
    return found


def _serve(rig: Rig, tmp: Path) -> None:
    async def main() -> None:
        options = SimOptions(flavour="vllm", model=MODEL, tokens=4)  # type: ignore[arg-type]
        access = Access([KEY.decode()])
        async with (
            api_box(tmp) as box,
            sim_rig(options, access) as (engine, controller, gateway),
        ):
            healthy = await serve(options)
            controller.add(
                "h",
                handle=EngineHandle(deployment_id="h", host="127.0.0.1", port=healthy.port,
                                    runtime_id="sim"),
                served_model=MODEL,
            )  # fmt: skip
            rig.engine_requests = lambda: asyncio.run_coroutine_threadsafe(
                _count(engine), loop
            ).result(IO_TIMEOUT_S)
            rig.admin_port, rig.gateway_port = box.port, gateway.port
            admin = await box.login("alice")
            rig.cookie, rig.csrf = admin.cookie or "", admin.csrf or ""
            stop = asyncio.Event()
            rig.wake = lambda: loop.call_soon_threadsafe(stop.set)
            rig.ready.set()
            await stop.wait()
            await healthy.close()

    async def _count(engine: Any) -> int:
        return int(engine.statistics().inference_requests)

    loop = asyncio.new_event_loop()

    try:
        loop.run_until_complete(main())
    except BaseException as exc:  # reported by the fixture
        rig.failure = exc
        rig.ready.set()
    finally:
        loop.close()


def _healthy(rig: Rig) -> None:
    """Use both listeners the normal way, over and over, until the fuzzing ends."""
    session = (
        f"GET /dgxmm/api/session HTTP/1.1\r\nhost: x\r\ncookie: {rig.cookie}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    chat = (
        b"POST /d/h/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"%s\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (AUTH, len(CHAT), CHAT)
    )
    while not rig.stop.is_set():
        for port, raw in ((rig.admin_port, session), (rig.gateway_port, chat)):
            try:
                got = statuses(exchange(port, raw, half_close=False))
            except OSError as exc:
                got = []
                rig.healthy_errors.append(f"{port}: {exc!r}")
            if got == [200]:
                rig.healthy_ok += 1
            else:
                rig.healthy_errors.append(f"{port}: {got}")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    rig = Rig()
    server = threading.Thread(target=_serve, args=(rig, tmp_path_factory.mktemp("fuzz")))
    server.start()
    assert rig.ready.wait(60), "the listeners did not start"
    if rig.failure is not None:
        raise rig.failure
    healthy = threading.Thread(target=_healthy, args=(rig,))
    healthy.start()
    try:
        yield rig
    finally:
        rig.stop.set()
        healthy.join(30)  # the healthy client stops before the listeners do
        rig.wake()
        server.join(30)
        print(f"\nfuzz cases tried: {rig.tried}; healthy requests answered 200: {rig.healthy_ok}")
    assert rig.failure is None, rig.failure
    assert rig.healthy_errors == []
    assert rig.healthy_ok > 0


def check(rig: Rig, port: int, raw: bytes, what: str, *, half_close: bool = True) -> list[int]:
    """Send one case; the answer, if any, is no 5xx, and the listener still answers.

    `half_close`: shut our side after sending (an incomplete request then ends); a client
    that hangs up may get no answer, so complete requests say `connection: close` instead.
    """
    rig.count(what)
    keyed = KEY in raw  # possibly the right key: it may reach the engine
    reached = rig.engine_requests() if port == rig.gateway_port and not keyed else 0
    reply = exchange(port, raw, half_close=half_close)
    codes = statuses(reply)
    if port == rig.gateway_port and not keyed:
        assert rig.engine_requests() == reached, ("reached the engine without the key", raw[:300])
        rig.count("gateway without the key")
    # RFC 9112 6.1: a transfer coding the server does not implement gets 501; every other
    # refusal of malformed input is a 4xx.
    allowed = {501} if b"transfer-encoding" in raw.lower() else set()
    assert all(c < 500 or c in allowed for c in codes), (codes, raw[:300], reply[:300])
    assert server_alive(port), raw[:300]
    assert rig.healthy_errors == [], rig.healthy_errors[:5]
    return codes


def server_alive(port: int) -> bool:
    probe = b"GET /nope HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    return bool(statuses(exchange(port, probe, half_close=False)))


# --- strategies ---------------------------------------------------------------------------------

ADMIN_PATHS = [
    "/dgxmm/api/login", "/dgxmm/api/session", "/dgxmm/api/deployments", "/api/deployments/x",
    "/dgxmm/api/deployments/x/start", "/dgxmm/api/deployments/x/mode", "/dgxmm/api/settings",
    "/dgxmm/api/audit?limit=5", "/dgxmm/api/audit?since=garbage", "/dgxmm/api/tokens",
    "/dgxmm/api/users", "/dgxmm/api/users/victor", "/dgxmm/api/litellm", "/metrics",
    "/dgxmm/", "/dgxmm/js/main.js", "/dgxmm/..%2f..%2fetc/passwd", "/", "/dgxmm/api/%ff",
    "/dgxmm/api/events/stream?x=%zz",
]  # fmt: skip
GATEWAY_PATHS = [
    "/v1/models", "/d/a/v1/chat/completions", "/d/a/v1/completions", "/d/a/v1/embeddings",
    "/d/a/v1/models", "/d/nope/v1/chat/completions", "/d/a/../../etc/passwd", "/d/%2e%2e/v1/x",
    "/d/a/v1/chat/completions?stream=true", "/d//v1", "/health",
]  # fmt: skip
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "CONNECT", "BREW"]
HEADER_NAMES = [
    "host", "content-length", "transfer-encoding", "content-type", "cookie", "authorization",
    "x-csrf-token", "expect", "connection", "origin", "x-dgxmm-health-check", "accept",
]  # fmt: skip

token_bytes = st.binary(min_size=0, max_size=40)
# Authorization values: the right one (the door opens: the interior is fuzzed too), and near
# misses that must never open it.
auth_values = st.sampled_from(
    [
        b"Bearer " + KEY, b"bearer  " + KEY + b" ", b"Bearer " + KEY[:-1],
        b"Bearer " + KEY + b"x", b"Bearer " + KEY.upper(), b"Bearer " + KEY[:-1] + b"\x00",
        b"Basic " + KEY, KEY, b"Bearer", b"Bearer ", b"Bearer " + KEY[::-1], b"",
    ]
) | st.builds(lambda t: b"Bearer " + t, token_bytes)  # fmt: skip
text_token = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=40)


@st.composite
def heads(draw: st.DrawFn, paths: list[str]) -> bytes:
    """A request: mostly plausible, with any part replaced by garbage now and then."""
    method = draw(st.sampled_from(METHODS).map(str.encode) | token_bytes)
    target = draw(
        st.sampled_from(paths).map(str.encode)
        | st.sampled_from(paths).map(lambda p: p.encode() + b"/" + b"%00")
        | token_bytes
        | st.builds(lambda p, t: p.encode() + t, st.sampled_from(paths), token_bytes)
    )
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b""]))
    headers = draw(
        st.lists(
            st.tuples(
                st.sampled_from(HEADER_NAMES).map(str.encode) | token_bytes,
                text_token.map(lambda t: t.encode("utf-8")) | token_bytes
                | st.integers(-5, 1 << 40).map(lambda n: str(n).encode())
                | st.sampled_from([b"chunked", b"gzip, chunked", b"close", b"100-continue"]),
            ),
            max_size=8,
        )
    )  # fmt: skip
    if draw(st.booleans()):
        headers.insert(0, (b"host", b"x"))
    if draw(st.integers(0, 3)):  # mostly with an Authorization header, right or not
        headers.insert(draw(st.integers(0, len(headers))), (b"authorization", draw(auth_values)))
    body = draw(st.binary(max_size=512) | jsons.map(lambda v: json.dumps(v).encode()))
    head = b" ".join(x for x in (method, target, version) if x or draw(st.booleans()))
    lines = [head] + [n + b": " + v for n, v in headers]
    eol = draw(st.sampled_from([b"\r\n", b"\n", b"\r"]))
    return eol.join(lines) + eol + eol + body


JSON_KEYS = [
    "name", "engine", "model", "memory_gib", "mode", "role", "args", "password", "url", "user",
    "expires_in_s", "idle_timeout_s", "ondemand_max_queued", "current", "image", "gpu",
]  # fmt: skip
jsons = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text_token,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(JSON_KEYS) | text_token, inner, max_size=6)
    ),
    max_leaves=20,
)

JSON_ROUTES = [
    ("POST", "/dgxmm/api/deployments"), ("PATCH", "/dgxmm/api/settings"),
    ("POST", "/dgxmm/api/login"), ("POST", "/dgxmm/api/tokens"), ("POST", "/dgxmm/api/users"),
    ("PATCH", "/dgxmm/api/users/victor"), ("PATCH", "/dgxmm/api/litellm"),
    ("POST", "/dgxmm/api/session/password"), ("PATCH", "/dgxmm/api/deployments/x/mode"),
    ("POST", "/dgxmm/api/deployments/x/switch-model"),
]  # fmt: skip


def json_request(rig: Rig, method: str, path: str, body: bytes) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nhost: x\r\ncookie: {rig.cookie}\r\n"
        f"x-csrf-token: {rig.csrf}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


# --- the listeners ------------------------------------------------------------------------------


@FUZZ
@given(raw=heads(ADMIN_PATHS))
def test_the_admin_listener_answers_generated_requests_without_a_5xx(rig: Rig, raw: bytes) -> None:
    check(rig, rig.admin_port, raw, "admin heads")


@FUZZ
@given(raw=heads(GATEWAY_PATHS))
def test_the_gateway_answers_generated_requests_without_a_5xx(rig: Rig, raw: bytes) -> None:
    check(rig, rig.gateway_port, raw, "gateway heads")


@FUZZ
@given(route=st.sampled_from(JSON_ROUTES), value=jsons)
def test_the_admin_api_answers_generated_json_with_a_2xx_or_4xx(
    rig: Rig, route: tuple[str, str], value: Any
) -> None:
    body = json.dumps(value).encode()
    raw = json_request(rig, *route, body)
    [code] = check(rig, rig.admin_port, raw, "admin json", half_close=False)
    assert code < 500


@FUZZ
@given(value=jsons)
def test_the_gateway_answers_generated_json_bodies_without_a_5xx(rig: Rig, value: Any) -> None:
    body = json.dumps(value).encode()
    raw = (
        b"POST /d/a/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"%s\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (AUTH, len(body), body)
    )
    [code] = check(rig, rig.gateway_port, raw, "gateway json", half_close=False)
    assert code < 500


DEEP = b"[" * 200_000 + b"]" * 200_000
CORPUS = [
    ("admin", b"HEAD /dgxmm/ HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("admin", b"HEAD /dgxmm/api/session HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("gateway", b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("admin", b"POST /dgxmm/api/login HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
     % (len(DEEP), DEEP)),
    ("admin", b"POST /api/login HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
     b"content-length: 5\r\n\r\n0\r\n\r\n"),
    ("gateway", b"POST /d/a/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
     b"transfer-encoding: chunked\r\ntransfer-encoding: identity\r\n\r\n0\r\n\r\n"),
    ("gateway", b"GET /d/a/v1/models HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n"),
    ("admin", b"GET /dgxmm/%2e%2e/%2e%2e/etc/passwd HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("admin", b"GET /dgxmm/" + b"a/" * 20_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n"),
    ("gateway", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256))),
    ("admin", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("gateway", b"GET / HTTP/1.1\r\n" + b"x-a: b\r\n" * 5000 + b"\r\n"),
]  # fmt: skip


@pytest.mark.parametrize(("listener", "raw"), CORPUS, ids=[str(i) for i in range(len(CORPUS))])
def test_the_reports_corpus_gets_no_5xx_and_heads_get_an_answer(
    rig: Rig, listener: str, raw: bytes
) -> None:
    port = rig.admin_port if listener == "admin" else rig.gateway_port
    codes = check(rig, port, raw, "corpus")
    if raw.startswith(b"HEAD "):
        assert codes, "HEAD gets an answer (like GET, without a body)"


# --- a real DGXMM: a wrong key starts nothing and reaches no engine (its event log) -----------

LOCKED_ENDPOINTS = [
    ("POST", "chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, {}),
    ("POST", "chat/completions", {"messages": [], "stream": True}, {}),
    ("POST", "completions", {"prompt": "hi"}, {}),
    ("POST", "embeddings", {"input": "hi"}, {}),
    ("POST", "responses", {"input": "hi"}, {}),
    ("POST", "chat/completions", {"messages": []}, {"x-dgxmm-health-check": "1"}),
    ("GET", "models", None, {}),
    ("GET", "models/fz", None, {}),
]
NEAR_MISSES = ["none", "byte off", "prefix", "longer", "upper", "basic", "no scheme", "empty"]


def near_miss(key: str, how: str, noise: str) -> str | None:
    """An Authorization value that is not the key (None: no header)."""
    return {
        "none": None, "byte off": "Bearer " + key[:-1] + ("A" if key[-1] != "A" else "B"),
        "prefix": "Bearer " + key[: len(key) // 2], "longer": "Bearer " + key + "x",
        "upper": "Bearer " + key.upper(), "basic": "Basic " + key, "no scheme": key,
        "empty": "Bearer ", "noise": "Bearer " + noise,
    }[how]  # fmt: skip


@dataclass
class Locked:
    dgxmm: AppInThread
    ids: dict[str, str]
    key: str
    baseline: int  # the event log's last seq before the fuzzing

    @property
    def port(self) -> int:
        return int(self.dgxmm.app.config.server.gateway_port)

    def events_since(self) -> list[m.Recorded]:
        store = self.dgxmm.app.store
        return list(self.dgxmm.run(store.read(since_seq=self.baseline)))

    def relayed(self) -> tuple[int, int, int]:
        stats = self.dgxmm.read(self.dgxmm.app.gateway.statistics)
        return stats["relayed"], stats["relayed_express"], stats["health_checks_relayed"]


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Locked]:
    data_dir = tmp_path_factory.mktemp("locked")
    config = Config(
        server=ServerConfig(data_dir=str(data_dir), admin_port=free_port(), gateway_port=0),
        memory=MemoryConfig(total_gib=8.0, reserve_gib=0.0, watchdog_threshold_gib=0.0),
        runtime=RuntimeConfig(kind="process"),
    )
    dgxmm = AppInThread(App(config)).start()
    try:
        controller = dgxmm.app.controller
        ids = {}
        for name, mode in (("fz-ready", "always_on"), ("fz-sleep", "on_demand")):
            spec = DeploymentSpec(
                name=name, engine="sim", model=f"fz/{name}", memory_bytes=GIB, mode=mode
            )
            ids[name] = dgxmm.run(controller.create(spec, "admin:fuzz")).id

        def states() -> dict[str, str]:
            return {r.name: r.state for r in controller.records()}

        deadline = time.monotonic() + 60
        while dgxmm.read(states) != {"fz-ready": "ready", "fz-sleep": "ready"}:
            assert time.monotonic() < deadline, dgxmm.read(states)
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
        dgxmm.run(controller.stop(ids["fz-sleep"], "admin:fuzz"))
        while dgxmm.read(states)["fz-sleep"] != "stopped":
            assert time.monotonic() < deadline, dgxmm.read(states)
            time.sleep(0.05)  # poll interval; the deadline bounds the wait
        key = dgxmm.read(dgxmm.app.gateway_keys.current)
        last = dgxmm.run(dgxmm.app.store.read())
        yield Locked(dgxmm, ids, key, last[-1].seq if last else 0)
    finally:
        dgxmm.stop()
        stop_leftover_engines(data_dir)


@FUZZ
@given(
    name=st.sampled_from(["fz-ready", "fz-sleep"]),
    endpoint=st.sampled_from(LOCKED_ENDPOINTS),
    how=st.sampled_from([*NEAR_MISSES, "noise"]),
    noise=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=60),
    extra=st.lists(st.tuples(st.sampled_from(HEADER_NAMES[5:]), text_token), max_size=3),
)
def test_a_wrong_key_starts_no_model_and_reaches_no_engine_as_the_event_log_shows(
    locked: Locked, name: str, endpoint: tuple[str, str, Any, dict[str, str]], how: str,
    noise: str, extra: list[tuple[str, str]],
) -> None:  # fmt: skip
    method, path, body, headers = endpoint
    value = near_miss(locked.key, how, noise)
    assert value is None or value.split(" ")[-1] != locked.key or not value.startswith("Bearer")
    lines = [f"{method} /d/{locked.ids[name]}/v1/{path} HTTP/1.1", "host: x"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"{k}: {v}" for k, v in extra if k not in ("authorization", "content-length",
                                                         "transfer-encoding", "host")]  # fmt: skip
    if value is not None:
        lines.append(f"authorization: {value}")
    data = b"" if body is None else json.dumps({"model": f"fz/{name}", **body}).encode()
    lines += ["connection: close", f"content-length: {len(data)}"]
    raw = "\r\n".join(lines).encode("utf-8", "replace") + b"\r\n\r\n" + data
    before = locked.relayed()
    codes = statuses(exchange(locked.port, raw, half_close=False))
    assert codes and all(c < 500 for c in codes), (codes, raw[:300])
    assert codes[0] in (400, 401), (codes, raw[:300])  # refused at the door (or malformed)
    assert locked.relayed() == before, "a request without the key reached an engine"
    started = [r for r in locked.events_since() if r.stream.startswith("deployment:")
               or r.stream == m.STREAM_QUEUE]  # fmt: skip
    assert started == [], [r.type for r in started]


# --- the CLI --------------------------------------------------------------------------------------

COMMANDS = [
    ["user", "add"], ["user", "remove"], ["user", "passwd"], ["user", "list"], ["token", "create"],
    ["token", "list"], ["token", "revoke"], ["replay"], ["events"], ["audit"], ["user"], ["token"],
    ["archive"],
    [], ["--help"], ["bogus"],
]  # fmt: skip
OPTIONS = [
    "--db", "--role", "--json", "--until", "--since", "--deployment", "--name", "--user",
    "--expires-in", "--password-stdin", "--last", "--request", "admin", "viewer", "metrics",
    "--to", "--before", "--type",
    "-h", "--", "-", "",
]  # fmt: skip
argv_token = st.sampled_from(OPTIONS) | st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00/\\~"), max_size=30
).filter(lambda t: ".." not in t)


@dataclass
class CliRun:
    code: int
    stderr: str


def run_cli(argv: list[str], workdir: Path) -> CliRun:
    """`dgxmm ARGV` in this process, with stdin empty and cwd in a scratch directory."""
    err, out = io.StringIO(), io.StringIO()
    old_cwd, old_stdin = Path.cwd(), sys.stdin
    os.chdir(workdir)
    sys.stdin = io.StringIO("")
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = cli.main(argv)
            except SystemExit as exc:  # argparse: usage errors and --help
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        sys.stdin = old_stdin
        os.chdir(old_cwd)
    return CliRun(code, err.getvalue())


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("cli-fuzz")
    assert (
        run_cli(
            ["user", "add", "alice", "--role", "admin", "--password-stdin", "--db", "log.db"], work
        ).code
        == 2
    )  # fmt: skip  (no password on stdin)
    return work


@FUZZ
@given(command=st.sampled_from(COMMANDS), rest=st.lists(argv_token, max_size=6), db=st.booleans())
def test_the_cli_answers_generated_arguments_with_a_line_and_an_exit_code_never_a_traceback(
    cli_dir: Path, command: list[str], rest: list[str], db: bool
) -> None:
    argv = [*command, *rest, *(["--db", "log.db"] if db else [])]
    if "--follow" in argv:
        return
    result = run_cli(argv, cli_dir)
    assert result.code in (0, 1, 2), (argv, result)
    assert "Traceback" not in result.stderr, (argv, result.stderr)


def test_the_cli_corpus_exits_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(os.urandom(4096))
    directory = tmp_path / "dir.db"
    directory.mkdir()
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    cases = [
        ["replay", "--db", str(garbage)], ["events", "--db", str(directory)],
        ["audit", "--db", str(empty)], ["user", "list", "--db", str(garbage)],
        ["token", "list", "--db", str(directory)], ["token", "revoke", "", "--db", str(empty)],
        ["user", "remove", "x" * 10_000, "--db", str(garbage)], ["replay", "--until", "yesterday"],
        ["audit", "--since", "\u202e2024", "--db", str(garbage)],
        ["user", "add", "é", "--role", "admin"],
        ["token", "create", "--expires-in", "-1d", "--db", str(garbage)],
        ["replay", "--db", "/dev/null"], ["user", "passwd", "alice", "--db", "/dev/null"],
    ]  # fmt: skip
    for argv in cases:
        result = run_cli(argv, tmp_path)
        assert result.code in (1, 2), (argv, result)
        assert "Traceback" not in result.stderr and result.stderr.strip(), (argv, result)
    shutil.rmtree(directory)
