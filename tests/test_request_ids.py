"""`x-dgxmm-request-id` on every gateway answer, equal to the id the queue gets.

The gateway on a real loopback server in front of a fake engine and a scripted controller
(tests/gateway_support), as in tests/test_gateway_app.py.
"""

from __future__ import annotations

import asyncio
import time

from actors.admission import Refused
from gateway.app import REQUEST_ID_HEADER, Gateway
from tests.gateway_support import FakeEngine, Reply, ScriptedController, poll, request_once
from tests.runtime_support import run
from tests.test_gateway_app import PROBE, rig

CHAT = {"model": "served-a", "messages": [{"role": "user", "content": "hi"}]}


def rid(reply: Reply) -> int:
    value = reply.header(REQUEST_ID_HEADER.decode())
    assert value is not None and value.isdigit(), reply.headers
    return int(value)


def test_relayed_answers_carry_distinct_growing_ids_from_the_wall_clock() -> None:
    async def main() -> None:
        began = time.time()
        async with rig() as r:
            first = await request_once(r.port, "POST", "/d/a/v1/chat/completions", CHAT)
            second = await request_once(r.port, "POST", "/d/a/v1/chat/completions", CHAT)
            assert (first.status, second.status) == (200, 200)
            assert rid(second) > rid(first) >= int(began) * 1_000_000

    run(main())


def test_errors_health_answers_and_model_lists_carry_an_id_too() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            answers = [
                await request_once(r.port, "GET", "/d/nope/v1/models"),
                await request_once(r.port, "GET", "/elsewhere"),
                await request_once(r.port, "GET", "/d/a/v1/models"),
                await request_once(r.port, "POST", "/d/a/v1/chat/completions", CHAT, PROBE),
                await request_once(r.port, "GET", "/d/a/v1/models/m"),
            ]
            assert [a.status for a in answers] == [404, 404, 200, 200, 503]
            ids = [rid(a) for a in answers]
            assert len(set(ids)) == len(ids)

    run(main())


def test_a_body_over_the_cap_gets_its_413_with_the_request_id() -> None:
    async def main() -> None:
        async with rig(state="stopped") as r:
            body = b"\0" * (16 * 1024 * 1024 + 1)
            reply = await request_once(r.port, "POST", "/d/a/v1/chat/completions", body)
            assert reply.status == 413
            rid(reply)

    run(main())


def test_the_id_in_the_header_is_the_one_the_queue_was_given() -> None:
    async def main() -> None:
        async with FakeEngine() as engine:
            controller = ScriptedController()
            controller.add("a", state="stopped")
            gateway = Gateway(controller)
            server = await gateway.serve("127.0.0.1", 0)
            try:
                waiting = asyncio.ensure_future(
                    request_once(server.port, "POST", "/d/a/v1/chat/completions", CHAT)
                )
                await poll(lambda: bool(controller.pending("a")), 10)
                (waiter,) = controller.pending("a")
                controller.make_ready("a", engine.handle)
                reply = await asyncio.wait_for(waiting, 10)
                assert reply.status == 200
                assert str(rid(reply)) == waiter.request_id
                controller.deployments["a"].state = "stopped"
                controller.deployments["a"].refuse = Refused(503, "ondemand_queue_full", "full")
                refused = await request_once(server.port, "POST", "/d/a/v1/chat/completions", CHAT)
                assert refused.status == 503 and rid(refused) > rid(reply)
            finally:
                await gateway.shutdown(2.0)

    run(main())
