"""End to end over real sockets: three on-demand models that do not all fit.

Real parts: the SQLite log, the gateway on loopback, the process runtime running simulated
engines as subprocesses, the HTTP engine probe, `dgxmm replay` as a subprocess.  The
controller's clock is virtual, so idle timeouts, queue deadlines and backoff run on
virtual time while engines and sockets run for real: `drive()` advances virtual time in
steps and yields real time to the engines, with a real deadline.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.controller import Controller, DeploymentSpec
from actors.memory_broker import GIB, MemoryBroker
from actors.runtime import VirtualClock
from dgxmm.engines import adapters as engines
from dgxmm.engines.runtimes.process import ProcessRuntime
from events import model as m
from events.projections import audit_rows, deployment_events
from events.state import DeploymentState
from gateway.app import Gateway
from storage.eventlog import EventStore
from tests.gateway_support import Client, Reply

PROJECT = Path(__file__).resolve().parent.parent
QUEUED = (
    "⏳ Your message is queued — waiting for memory to free up for c. "
    "It will start automatically.\n\n"
)
REAL_DEADLINE_S = 60.0


class Box:
    """A real DGXMM minus the admin API, with its controller on a virtual clock."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.clock = VirtualClock()
        self.db = tmp / "log.db"
        self.store: EventStore
        self.runtime = ProcessRuntime(tmp / "engines", cwd=PROJECT)
        # Engines start in real time while the controller's clock races ahead: no start-up deadline.
        settings = engines.EngineSettings(sim_python=sys.executable, startup_timeout_s=1e9)

        def spec(dep: DeploymentState) -> Any:
            return engines.launch_spec_for(dep, settings)

        self.launch_spec = spec
        self.controller: Controller
        self.gateway: Gateway
        self.port = 0

    async def start(self) -> None:
        self.store = await EventStore.open(self.db, wall=self.clock.wall)
        self.clock.add_busy_check(self.store.busy)
        broker = MemoryBroker(100 * GIB, 100 * GIB)
        self.controller = Controller(
            store=self.store,
            clock=self.clock,
            runtime=self.runtime,
            probe=engines.HttpEngineProbe(),
            broker=broker,
            launch_spec=self.launch_spec,
            defaults={"ondemand_max_queued": 3},
        )
        await self.controller.load()
        self.gateway = Gateway(self.controller)
        server = await self.gateway.serve("127.0.0.1", 0)
        self.port = server.port

    async def stop(self) -> None:
        await self.gateway.shutdown(2.0)
        for actor in list(self.controller.actors.values()):
            handle = actor.engine_handle or actor._handle
            if handle is not None:
                await self.runtime.stop(handle, 5.0)
        await self.controller.close()
        await self.runtime.close()
        await self.store.close()

    async def deploy(self, name: str, gib: int, args: list[str]) -> str:
        rec = await self.controller.create(
            DeploymentSpec(
                name=name,
                engine="sim",
                model=f"org/{name}",
                memory_bytes=gib * GIB,
                mode="on_demand",
                idle_timeout_s=120,
                args=args,
            ),
            actor="admin:test",
        )
        return rec.id

    def state(self, dep_id: str) -> str:
        return self.controller.actors[dep_id].state.lifecycle.value

    async def drive(
        self, cond: Callable[[], bool], step: float = 1.0, limit_s: float = 3600
    ) -> None:
        """Advance virtual time in steps until `cond()` holds (real deadline)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REAL_DEADLINE_S
        start = self.clock.now()
        while not cond():
            assert loop.time() < deadline, "condition not reached in real time"
            assert self.clock.now() - start < limit_s, "condition not reached in virtual time"
            await self.clock.advance(step)
            await asyncio.sleep(0.01)  # engines and sockets run in real time

    async def advance(self, seconds: float, step: float = 1.0) -> None:
        """Advance virtual time by `seconds`, yielding real time between steps."""
        for _ in range(int(seconds / step)):
            await self.clock.advance(step)
            await asyncio.sleep(0.005)


def cli(*args: str) -> str:
    """Run `dgxmm` as a subprocess; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", *args],
        capture_output=True,
        text=True,
        cwd=PROJECT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def chat(model: str, stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": stream,
        **extra,
    }


async def post(port: int, dep_id: str, body: dict[str, Any]) -> Reply:
    client = await Client.connect(port)
    try:
        return await client.request("POST", f"/d/{dep_id}/v1/chat/completions", body)
    finally:
        client.close()


def sse_text(body: bytes) -> str:
    """The concatenated delta contents of a chat stream."""
    text = ""
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            if "choices" in event:
                text += event["choices"][0]["delta"].get("content") or ""
    return text


def test_three_on_demand_models_that_do_not_all_fit(tmp_path: Path) -> None:
    async def main() -> None:
        box = Box(tmp_path)
        await box.start()
        try:
            await scenario(box)
        finally:
            await box.stop()
        await replay_tells_the_same_story(box)
        # Kept for the curious: `dgxmm replay --db <this file>` tells the story above.
        (tmp_path / "replay.txt").write_text(cli("replay", "--db", str(box.db)))

    asyncio.run(main())


async def scenario(box: Box) -> None:
    a = await box.deploy("a", 40, ["--startup-delay", "0.3", "--token-delay", "0.05"])
    b = await box.deploy("b", 40, ["--startup-delay", "0.3"])
    await box.drive(lambda: box.state(a) == "ready" and box.state(b) == "ready")
    c = await box.deploy("c", 50, ["--startup-delay", "0.5"])
    assert box.state(c) == "stopped"  # 20 GiB free: it does not fit

    # A long streaming answer keeps a busy (in flight: never a candidate).
    busy = asyncio.ensure_future(post(box.port, a, chat("org/a", True, max_tokens=16)))
    await box.drive(lambda: box.controller.actors[a].activity.in_flight == 1, step=0.1)

    # c does not fit and b is not idle yet: both requests are queued for memory.
    plain = asyncio.ensure_future(post(box.port, c, chat("org/c", False)))
    await box.drive(lambda: len(box.controller.queue) == 1, step=0.1)
    streamer = await Client.connect(box.port)
    await streamer.send("POST", f"/d/{c}/v1/chat/completions", chat("org/c", True))
    status, _ = await streamer.head()
    assert status == 200
    first = await streamer.read_until(b"\n\n")  # the queued chunk arrives at once
    assert sse_text(first) == QUEUED

    # b idles out after 2 min; then c fits and starts; both requests are answered.
    await box.drive(lambda: plain.done(), step=2.0)
    answer = plain.result()
    assert answer.status == 200
    content = answer.json()["choices"][0]["message"]["content"]
    assert content.startswith(QUEUED) and len(content) > len(QUEUED)
    rest = b""
    while (data := await streamer.chunk()) is not None:
        rest += data
    streamer.close()
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert len(sse_text(first + rest)) > len(QUEUED)
    assert (await busy).status == 200
    assert box.state(b) == "stopped"
    assert box.state(c) == "ready"

    # d needs 30 GiB while a (40) and c (50) hold 90: its requests queue; the cap is 3.
    d = await box.deploy("d", 30, ["--startup-delay", "0.3"])
    await box.controller.change_settings({"ondemand_queue_timeout_s": 60}, "admin:test")
    waiting = [asyncio.ensure_future(post(box.port, d, chat("org/d", False))) for _ in range(3)]
    await box.drive(lambda: len(box.controller.queue) == 3, step=0.1)
    refused = await post(box.port, d, chat("org/d", False))
    assert refused.status == 503
    assert refused.header("retry-after") == "60"
    assert refused.json()["error"]["code"] == "ondemand_queue_full"
    # a and c were used just now: not idle for 2 min, so the queue limit (60 s) runs out.
    await box.drive(lambda: all(w.done() for w in waiting), step=2.0)
    for w in waiting:
        reply = w.result()
        assert reply.status == 503 and reply.header("retry-after") == "60"
        assert reply.json() == {
            "error": {
                "message": "model d is busy; try again later",
                "type": "server_error",
                "code": "ondemand_queue_timeout",
            }
        }

    # e fails at start: every waiter gets start_failed, and no new start for 60 s.
    e = await box.deploy("e", 5, ["--startup-delay", "0.2", "--fail-at-start", "CUDA OOM"])
    await box.drive(lambda: box.state(e) == "failed", step=0.5)
    early = await post(box.port, e, chat("org/e", False))
    assert early.status == 503
    assert early.json()["error"]["code"] == "start_failed"
    assert early.json()["error"]["message"].startswith("e could not start: ")
    assert "CUDA OOM" in early.json()["error"]["message"]
    launches = box.controller.actors[e].state.failures
    await box.advance(61, step=2.0)
    late = asyncio.ensure_future(post(box.port, e, chat("org/e", False)))
    await box.drive(lambda: late.done(), step=0.5)
    assert late.result().json()["error"]["code"] == "start_failed"
    assert box.controller.actors[e].state.failures == launches + 1  # a new start was tried
    retry_at = box.controller.actors[e].state.retry_at
    assert retry_at is not None and retry_at - box.clock.wall() > 100  # 120 s this time


async def replay_tells_the_same_story(box: Box) -> None:
    store = await EventStore.open(box.db, create=False, readonly=True)
    try:
        recs = await store.read()
    finally:
        await store.close()
    names = {
        r.event.deployment_id: r.event.name
        for r in recs
        if isinstance(r.event, m.DeploymentCreated)
    }
    ids = {name: dep_id for dep_id, name in names.items()}
    b_titles = [row.title for row in deployment_events(recs, ids["b"])]
    assert "Put to sleep after 2 min idle" in b_titles
    c_titles = [row.title for row in deployment_events(recs, ids["c"])]
    assert "Started for a request" in c_titles
    d_titles = [row.title for row in deployment_events(recs, ids["d"])]
    assert d_titles.count("Queued request timed out") == 1  # at most once a minute
    actions = [row.action for row in audit_rows(recs)]
    assert actions.count("ondemand_queue_timeout") == 1
    assert "ondemand_start" in actions and "ondemand_sleep" in actions
    # c's requests were served in arrival order.
    c_left = [
        r.event.request_id
        for r in recs
        if isinstance(r.event, m.RequestLeftQueue) and r.event.deployment_id == ids["c"]
    ]
    c_queued = [
        r.event.request_id
        for r in recs
        if isinstance(r.event, m.RequestQueued) and r.event.deployment_id == ids["c"]
    ]
    assert c_left == c_queued and len(c_queued) == 2

    story = cli("replay", "--db", str(box.db))
    for line in (
        "Put to sleep after 2 min idle",
        "Started for a request",
        "Queued request timed out",
    ):
        assert line in story
    assert "e could not start" in story or "Start failed" in story
    request = cli("replay", "--db", str(box.db), "--request", c_queued[0])
    assert "queued" in request.lower() and "served" in request.lower()
