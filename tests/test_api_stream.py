"""The UI's event stream (SSE) and /metrics, over loopback, on the virtual clock."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from actors.controller import Controller
from dgxmm.admin import metrics
from dgxmm.admin.sse import EventHub, HubConfig
from tests.api_support import STARTUP_S, ApiClient, Box, SseReader, error_of, run_box

API = "/dgxmm/api"


async def deploy(client: ApiClient, name: str = "alpha", **extra: Any) -> dict[str, Any]:
    body = {"name": name, "engine": "sim", "model": f"org/{name}", "memory_gib": 10, **extra}
    data: dict[str, Any] = await client.ok("POST", f"{API}/deployments", body, 201)
    return data


# --- the event stream ---------------------------------------------------------------------------


def test_the_stream_starts_with_a_snapshot_and_pushes_a_change(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await deploy(alice, mode="on_demand")
        victor = await box.login("victor")  # viewers may watch
        stream = await SseReader.open(victor)
        assert await stream.next() == ("retry", 3000)
        event, snap = await stream.next()
        assert event == "snapshot"
        assert [d["name"] for d in snap["deployments"]] == ["alpha"]
        assert {"memory", "queue", "settings"} <= set(snap)
        await box.advance(STARTUP_S + 2)
        msgs = await stream.until("deployment")
        record = msgs[-1][1]
        assert (record["id"], record["state"], record["badge"]) == (dep["id"], "ready", "Ready")
        stream.close()

    run_box(tmp_path, t)


def test_pushes_are_coalesced_to_one_a_second_per_deployment_with_a_trailing_push(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await deploy(alice, mode="on_demand")
        await box.advance(STARTUP_S + 2)
        stream = await SseReader.open(alice)
        await stream.until("snapshot")
        hub = box.api.hub
        key = f"deployment:{dep['id']}"
        before = hub.pushes_by_key[key]
        h = box.harness
        for i in range(5):  # five requests start at once and end within 0.5 s: ten changes
            h.request(dep["id"], hold_s=0.1 * (i + 1))
        await box.advance(0.55)
        assert hub.pushes_by_key[key] == before + 1  # the first change went out at once
        first = (await stream.until("deployment"))[-1][1]
        assert first["in_flight"] == 1  # the state when it was pushed: the first request began
        await box.advance(0.4)  # 0.95 s after the first push: still inside its window
        assert hub.pushes_by_key[key] == before + 1
        await box.advance(0.1)  # the window ends: one trailing push with the latest state
        assert hub.pushes_by_key[key] == before + 2
        trailing = (await stream.until("deployment"))[-1][1]
        assert trailing["in_flight"] == 0
        await box.advance(15)  # a heartbeat marks the end of what was sent so far
        tail = await stream.until("comment")
        assert [e for e, _ in tail if e == "deployment"] == []
        stream.close()

    run_box(tmp_path, t)


def test_changes_in_separate_seconds_are_each_pushed_at_once(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await deploy(alice, mode="on_demand")
        await box.advance(STARTUP_S + 2)
        stream = await SseReader.open(alice)
        await stream.until("snapshot")
        key = f"deployment:{dep['id']}"
        hub = box.api.hub
        before = hub.pushes_by_key[key]
        for i in range(3):
            box.harness.request(dep["id"], hold_s=0.01)
            await box.advance(0.001)
            # The request's start is pushed at once; its end 0.01 s later waits for the window.
            assert hub.pushes_by_key[key] == before + 2 * i + 1
            await box.advance(2.5)
            assert hub.pushes_by_key[key] == before + 2 * i + 2
        stream.close()

    run_box(tmp_path, t)


def test_a_removed_deployment_is_announced(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await deploy(alice)
        await box.advance(STARTUP_S + 2)
        stream = await SseReader.open(alice)
        await stream.until("snapshot")
        await alice.ok("DELETE", f"{API}/deployments/{dep['id']}")
        await box.advance(5)
        assert (await stream.until("removed"))[-1][1] == {"id": dep["id"]}
        stream.close()

    run_box(tmp_path, t)


def test_logging_out_ends_the_sessions_streams(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        stream = await SseReader.open(alice)
        await stream.until("snapshot")
        await alice.ok("POST", f"{API}/logout")
        assert await stream.ended()
        stream.close()

    run_box(tmp_path, t)


def test_the_stream_needs_credentials(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        reply = await ApiClient(box.port).get(f"{API}/events/stream")
        assert reply.status == 401

    run_box(tmp_path, t)


class BlockedResponder:
    """A responder whose writes wait until the test opens the gate (a client not reading)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sent: list[bytes] = []
        self.ended = False
        self.writing = asyncio.Event()

    async def start(self, status: int, headers: Any) -> None:
        assert status == 200

    async def send(self, data: bytes) -> None:
        self.sent.append(data)
        self.writing.set()
        await self.gate.wait()

    async def end(self) -> None:
        self.ended = True


def test_a_client_that_does_not_read_is_dropped_when_its_buffer_is_full(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        hub = EventHub(
            box.harness.controller, box.clock, HubConfig(max_buffered_messages=3, heartbeat_s=1e9)
        )
        responder = BlockedResponder()
        task = asyncio.ensure_future(hub.stream(None, responder, None))  # type: ignore[arg-type]
        await responder.writing.wait()  # stuck writing the snapshot
        assert hub.client_count == 1
        for key in ("memory", "queue", "settings"):
            hub.changed(key)
        assert hub.client_count == 1  # three buffered: still within the bound
        hub.changed("deployment:none")
        assert hub.client_count == 0
        assert hub.stats["dropped_clients"] == 1
        responder.gate.set()
        await asyncio.wait_for(task, 5)
        assert responder.ended
        assert len(responder.sent) == 1  # nothing more was written to the dropped client
        hub.close()

    run_box(tmp_path, t)


# --- metrics ------------------------------------------------------------------------------------

_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? '
    r"(-?[0-9.e+]+|NaN|[+-]Inf)$"
)


def parse_exposition(text: str) -> dict[str, list[tuple[str, float]]]:
    """A strict reader of the text format: families -> [(labels text, value)]."""
    assert text.endswith("\n")
    samples: dict[str, list[tuple[str, float]]] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter")
            assert name not in types, f"{name} declared twice"
            types[name] = kind
            continue
        found = _SAMPLE.match(line)
        assert found is not None, line
        name = found.group(1)
        assert name in types, f"{name} has no TYPE"
        if types[name] == "counter":
            assert name.endswith("_total"), name
        samples.setdefault(name, []).append((found.group(2) or "", float(found.group(4))))
    return samples


def test_metrics_parse_and_count_deployments_by_state_and_mode(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        await deploy(alice, "a")
        await deploy(alice, "b", mode="on_demand")
        await box.advance(STARTUP_S * 2 + 4)
        assert (await ApiClient(box.port).get("/metrics")).status == 401
        reply = await alice.call("GET", "/metrics")
        assert reply.status == 200
        assert reply.header("content-type") == "text/plain; version=0.0.4; charset=utf-8"
        fams = parse_exposition(reply.body.decode())
        deps = dict(fams["dgxmm_deployments"])
        assert deps['{state="ready",mode="always_on"}'] == 1
        assert deps['{state="ready",mode="on_demand"}'] == 1
        assert deps['{state="failed",mode="on_demand"}'] == 0
        memory = dict(fams["dgxmm_memory_bytes"])
        assert memory['{kind="usable"}'] == 100 * (1 << 30)
        assert fams["dgxmm_queue_waiting"] == [("", 0.0)]
        assert "dgxmm_queue_requests_total" in fams
        assert len(fams["dgxmm_deployment_in_flight"]) == 2
        assert "dgxmm_api_replies_total" in fams
        gw = dict(fams["dgxmm_gateway_relayed_total"])
        assert gw[""] == 7
        engines = dict(fams["dgxmm_gateway_engines_active"])
        assert engines['{engine="127.0.0.1:20000"}'] == 2
        assert dict(fams["dgxmm_gateway_server_error_replies_total"])['{status="503"}'] == 4
        token = await box.token_client("victor")
        assert (await token.get("/metrics")).status == 200

    def gateway_statistics() -> dict[str, Any]:
        return {
            "relayed": 7,
            "server": {"connections_open": 3, "error_replies": {503: 4}, "closing": False},
            "engines": {"127.0.0.1:20000": {"active": 2, "reused": 9}},
        }

    run_box(tmp_path, t, gateway_statistics=gateway_statistics)


def test_metrics_can_be_made_public(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        reply = await ApiClient(box.port).get("/metrics")
        assert reply.status == 200
        parse_exposition(reply.body.decode())
        post = await ApiClient(box.port).call("POST", "/metrics")
        assert post.status == 405
        assert error_of(post)["code"] == "method_not_allowed"

    run_box(tmp_path, t, metrics_public=True)


def test_label_values_are_escaped() -> None:
    fam = metrics.Family("x_total", "counter", "a help\nline")
    fam.add(1, name='a "quoted"\\ name\n')
    text = metrics.render([fam])
    assert text == (
        "# HELP x_total a help\\nline\n# TYPE x_total counter\n"
        'x_total{name="a \\"quoted\\"\\\\ name\\n"} 1\n'
    )
    parse_exposition(text)


def test_controller_families_cover_every_state_and_mode_even_when_empty(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        controller: Controller = box.harness.controller
        fams = {f.name: f for f in metrics.controller_families(controller)}
        assert len(fams["dgxmm_deployments"].samples) == len(metrics.STATES) * len(metrics.MODES)

    run_box(tmp_path, t)
