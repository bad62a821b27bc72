"""LiteLLM's health probes through the gateway for an always-on deployment (issue 16).

With the file back-end every deployment's LiteLLM entry points at the gateway, so LiteLLM's
`/health` probe (marked `x-dgxmm-health-check: 1`) of an always-on model reaches the gateway;
it passes the probe to the engine (unmarked), so that `/health` still tests the engine.  The
on-demand behaviour (answered by the gateway, in every state) is in test_gateway_app.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from gateway.app import Gateway
from tests.gateway_support import (
    EngineScript,
    FakeEngine,
    ScriptedController,
    request_once,
    run,
)

CHAT = "/d/a/v1/chat/completions"
PROBE = [("x-dgxmm-health-check", "1")]
BODY = {"model": "served-a", "messages": [{"role": "user", "content": "What's 1 + 1?"}]}


@contextlib.asynccontextmanager
async def always_on(
    state: str = "ready", script: EngineScript | None = None
) -> AsyncIterator[tuple[FakeEngine, ScriptedController, Gateway, int]]:
    """Always-on deployment `a` in `state`, its engine and the gateway."""
    async with FakeEngine(script) as engine:
        controller = ScriptedController()
        handle = engine.handle if state == "ready" else None
        controller.add("a", state=state, handle=handle, mode="always_on")
        gateway = Gateway(controller, clock=lambda: 1700000000.0)
        server = await gateway.serve("127.0.0.1", 0)
        try:
            yield engine, controller, gateway, server.port
        finally:
            await gateway.shutdown(2.0)


def test_a_probe_of_a_ready_always_on_model_is_the_engines_own_answer() -> None:
    async def main() -> None:
        async with always_on() as (engine, controller, gateway, port):
            direct = await request_once(engine.port, "POST", "/v1/chat/completions", BODY)
            probe = await request_once(port, "POST", CHAT, BODY, PROBE)
            assert probe.status == 200
            assert probe.body == direct.body
            [_, seen] = engine.seen
            assert seen.target == "/v1/chat/completions"
            assert "x-dgxmm-health-check" not in seen.headers  # the engine gets a plain request
            # Not traffic: no lease, no queue; counted as a relayed probe.
            assert controller.acquired == 0 and controller.enqueued == 0
            stats = gateway.statistics()
            assert (stats["health_checks"], stats["health_checks_relayed"]) == (1, 1)

    run(main())


def test_an_engine_error_reaches_litellms_probe_unchanged() -> None:
    async def main() -> None:
        async with always_on(script=EngineScript(status=500)) as (engine, _, _, port):
            probe = await request_once(port, "POST", CHAT, BODY, PROBE)
            assert probe.status == 500
            assert len(engine.seen) == 1

    run(main())


@pytest.mark.parametrize("state", ["stopped", "starting", "stopping"])
def test_a_probe_of_an_always_on_model_that_is_not_serving_is_a_503_and_starts_nothing(
    state: str,
) -> None:
    async def main() -> None:
        async with always_on(state) as (engine, controller, gateway, port):
            probe = await request_once(port, "POST", CHAT, BODY, PROBE)
            assert probe.status == 503  # unhealthy, and no status LiteLLM cools down on
            assert probe.json()["error"]["code"] == "engine_not_ready"
            assert probe.header("x-dgxmm-ondemand-state") == state
            assert engine.seen == []
            assert controller.acquired == 0 and controller.enqueued == 0
            assert gateway.statistics()["health_checks_relayed"] == 0

    run(main())


def test_a_probe_of_a_failed_always_on_model_is_answered_503_at_once() -> None:
    async def main() -> None:
        async with always_on("failed") as (engine, controller, _, port):
            probe = await request_once(port, "POST", CHAT, BODY, PROBE)
            assert probe.status == 503
            assert probe.header("x-dgxmm-ondemand-state") == "failed"
            assert engine.seen == [] and controller.enqueued == 0

    run(main())


def test_a_probe_of_an_on_demand_model_is_still_answered_by_the_gateway() -> None:
    async def main() -> None:
        async with FakeEngine() as engine:
            controller = ScriptedController()
            controller.add("a", state="ready", handle=engine.handle, mode="on_demand")
            gateway = Gateway(controller, clock=lambda: 1700000000.0)
            server = await gateway.serve("127.0.0.1", 0)
            try:
                probe = await request_once(server.port, "POST", CHAT, BODY, PROBE)
                assert probe.status == 200
                assert probe.json()["choices"][0]["message"]["content"] == ""
                assert engine.seen == []
                assert gateway.statistics()["health_checks_relayed"] == 0
            finally:
                await gateway.shutdown(2.0)

    run(main())
