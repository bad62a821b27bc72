"""Test support for the admin API: a simulated box behind a real loopback server, and clients."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.runtime import VirtualClock
from dgxmm.admin.api import AdminApi
from dgxmm.admin.auth import Auth, AuthConfig, hash_password
from dgxmm.admin.openapi import document
from dgxmm.admin.sse import HubConfig
from events import model as m
from gateway.server import HTTPServer
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour
from tests.gateway_support import Client, Reply, poll

STARTUP_S = 30.0
PASSWORDS = {"alice": "alice-password", "victor": "victor-password"}
ROLES = {"alice": "admin", "victor": "viewer"}
TEST_SCRYPT_N = 2**14  # production uses 2**17; tests keep logins fast (and not rehashed)


@functools.cache
def password_hash(name: str) -> str:
    """The users' hashes, computed once per test run (scrypt is slow on purpose)."""
    return hash_password(PASSWORDS[name], n=TEST_SCRYPT_N)


@dataclass
class Box:
    """A simulated DGX box with the admin API listening on loopback."""

    harness: Harness
    auth: Auth
    api: AdminApi
    server: HTTPServer
    web_root: Path | None
    litellm: dict[str, Any] = field(default_factory=dict)

    @property
    def port(self) -> int:
        """The API's port."""
        return self.server.port

    @property
    def clock(self) -> VirtualClock:
        """The box's virtual clock."""
        return self.harness.clock

    async def advance(self, seconds: float) -> None:
        """Move virtual time."""
        await self.harness.advance(seconds)

    async def login(self, name: str = "alice", password: str | None = None) -> ApiClient:
        """A client logged in as `name` (cookie session with its CSRF token)."""
        return await login(self.port, name, password or PASSWORDS[name])

    async def token_client(self, user: str = "alice") -> ApiClient:
        """A client with a Bearer API token for `user` (issued by alice)."""
        admin = await self.login("alice")
        reply = await admin.call("POST", "/dgxmm/api/tokens", {"user": user})
        assert reply.status == 201, reply.body
        client = ApiClient(self.port)
        client.bearer = reply.json()["token"]
        return client

    async def events(self) -> list[m.Recorded]:
        """The whole log."""
        return await self.harness.events()


class ApiClient:
    """Requests to the API on fresh connections, with a session or a token if it has one."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.cookie: str | None = None
        self.csrf: str | None = None
        self.bearer: str | None = None

    def headers(self, method: str, *, csrf: bool = True) -> list[tuple[str, str]]:
        """Credentials for one request."""
        found = []
        if self.cookie:
            found.append(("cookie", self.cookie))
            if csrf and self.csrf and method not in ("GET", "HEAD"):
                found.append(("x-csrf-token", self.csrf))
        if self.bearer:
            found.append(("authorization", f"Bearer {self.bearer}"))
        return found

    async def call(
        self,
        method: str,
        target: str,
        body: Any = None,
        *,
        csrf: bool = True,
        headers: list[tuple[str, str]] | None = None,
    ) -> Reply:
        """One request; dict/list bodies are sent as JSON, bytes as they are."""
        hdrs = [*self.headers(method, csrf=csrf), *(headers or [])]
        raw = (
            body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        )
        if raw:
            hdrs.append(("content-type", "application/json"))
        client = await Client.connect(self.port)
        try:
            return await client.request(method, target, raw, hdrs)
        finally:
            client.close()

    async def get(self, target: str) -> Reply:
        """GET."""
        return await self.call("GET", target)

    async def ok(self, method: str, target: str, body: Any = None, status: int = 200) -> Any:
        """The JSON of a call that must answer `status`."""
        reply = await self.call(method, target, body)
        assert reply.status == status, (reply.status, reply.body)
        return reply.json()


async def login(port: int, name: str, password: str) -> ApiClient:
    """A client logged in as `name` on the admin API at `port` (cookie session + CSRF)."""
    client = ApiClient(port)
    reply = await client.call("POST", "/dgxmm/api/login", {"name": name, "password": password})
    assert reply.status == 200, reply.body
    cookie = reply.header("set-cookie")
    assert cookie is not None
    client.cookie = cookie.split(";")[0]
    client.csrf = reply.json()["csrf_token"]
    return client


def error_of(reply: Reply) -> dict[str, Any]:
    """The `error` object of an error reply (checking its shape)."""
    data = reply.json()
    assert set(data) == {"error"}, data
    err: dict[str, Any] = data["error"]
    assert {"message", "type", "code"} <= set(err), err
    return err


def default_behaviour(spec: Any) -> EngineBehaviour:
    """Engines that take STARTUP_S to load."""
    return EngineBehaviour(startup_s=STARTUP_S)


@contextlib.asynccontextmanager
async def api_box(
    tmp_path: Path,
    *,
    web_root: Path | None = None,
    auth_config: AuthConfig | None = None,
    hub_config: HubConfig | None = None,
    litellm: dict[str, Any] | None = None,
    gateway_statistics: Callable[[], dict[str, Any]] | None = None,
    metrics_public: bool = False,
    vendor_root: Path | None = None,
    **harness_kwargs: Any,
) -> AsyncIterator[Box]:
    """A harness (virtual clock, simulated engines), users alice (admin) and victor (viewer)."""
    harness_kwargs.setdefault("behaviour", default_behaviour)
    harness = await Harness.create(tmp_path / "log.db", **harness_kwargs)
    for name, role in ROLES.items():
        await harness.store.append(
            m.STREAM_USERS,
            [m.UserCreated(name=name, role=role, password_hash=password_hash(name))],  # type: ignore[arg-type]
            actor="system",
        )
    status = dict(litellm or {"enabled": False, "ok": False})
    calls: dict[str, Any] = {"status": status, "syncs": 0, "configured": []}

    async def sync_now() -> dict[str, Any]:
        calls["syncs"] += 1
        return {"ok": True, "entries": 3}

    async def configure(settings: dict[str, Any], actor: str) -> dict[str, Any]:
        if "url" in settings and not str(settings["url"]).startswith("http"):
            raise ValueError("url: an http(s) URL")
        calls["configured"].append((settings, actor))
        status.update(settings)
        return dict(status)

    auth_config = dataclasses.replace(auth_config or AuthConfig(), scrypt_n=TEST_SCRYPT_N)
    auth = Auth(harness.controller, harness.store, harness.clock, auth_config)
    api = AdminApi(
        harness.controller,
        harness.store,
        auth,
        harness.clock,
        litellm_status=lambda: status,
        litellm_sync_now=sync_now,
        litellm_configure=configure,
        web_root=web_root,
        gateway_statistics=gateway_statistics,
        metrics_public=metrics_public,
        hub_config=hub_config,
        vendor_root=vendor_root,
        openapi_document=document,
    )
    server = await api.serve("127.0.0.1", 0)
    box = Box(harness, auth, api, server, web_root, calls)
    try:
        yield box
    finally:
        await api.close(2.0)
        await harness.close()


def run_box(tmp_path: Path, test: Callable[[Box], Awaitable[None]], **kwargs: Any) -> None:
    """Run `test` against a fresh box with an overall deadline."""

    async def main() -> None:
        async with asyncio.timeout(60), api_box(tmp_path, **kwargs) as box:
            await test(box)
            assert box.harness.violations == []

    asyncio.run(main())


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll (bounded) until `predicate()` holds."""
    await poll(predicate, timeout)


class SseReader:
    """Reads one event stream message by message."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._buffer = b""
        self.messages: list[tuple[str, Any]] = []

    @classmethod
    async def open(cls, api: ApiClient, target: str = "/dgxmm/api/events/stream") -> SseReader:
        """Open the stream and check its head."""
        client = await Client.connect(api.port)
        await client.send("GET", target, b"", api.headers("GET"))
        status, headers = await client.head()
        assert status == 200, status
        assert dict(headers)[b"content-type"].startswith(b"text/event-stream")
        return cls(client)

    async def next(self) -> tuple[str, Any]:
        """The next message: (event name, decoded data); comments as ("comment", text)."""
        while b"\n\n" not in self._buffer:
            data = await self.client.chunk()
            assert data is not None, "stream ended"
            self._buffer += data
        raw, self._buffer = self._buffer.split(b"\n\n", 1)
        event, data_lines, comment = "message", [], None
        for line in raw.decode().split("\n"):
            if line.startswith(":"):
                comment = line[1:].strip()
            elif line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data_lines.append(line[len("data: ") :])
            elif line.startswith("retry: "):
                event = "retry"
                data_lines.append(line[len("retry: ") :])
        if comment is not None and not data_lines:
            message: tuple[str, Any] = ("comment", comment)
        else:
            message = (event, json.loads("\n".join(data_lines)))
        self.messages.append(message)
        return message

    async def until(self, event: str) -> list[tuple[str, Any]]:
        """Messages up to and including the next `event` one."""
        seen = []
        while True:
            msg = await self.next()
            seen.append(msg)
            if msg[0] == event:
                return seen

    async def ended(self) -> bool:
        """Whether the server ended the stream (reads to its end)."""
        while True:
            data = await self.client.chunk()
            if data is None:
                return True

    def close(self) -> None:
        """Hang up."""
        self.client.close()
