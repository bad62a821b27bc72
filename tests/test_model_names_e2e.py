"""A request naming a model its deployment does not serve starts nothing (issue 46, stumble 5).

What a new user saw: such a request started the stopped deployment anyway, put another
model to sleep to make room for it, waited 6 s, then got the engine's 404.  Here the same
box: `a` ready and idle, `b` stopped and too large to fit beside it, swaps at once
(`ondemand_make_room_after_s = 0`, as the demo runs).  Real parts: the SQLite log, the gateway
on loopback, simulated engines as processes, the controller on a virtual clock
(tests/test_e2e_ondemand.py's `Box`), and a real LiteLLM in front for the second test, with the
config file DGXMM's own file back-end writes.

Through the gateway, another name gets 404 `model_not_found` at once, and `b` neither starts
nor evicts `a`; `b`'s own names do both.  Through LiteLLM no other name ever reaches the
gateway: LiteLLM answers a name it does not list itself, and sends the served name for one it
does (so the gateway's check is for clients that call the gateway directly, as the demo's
`curl` does).  The engine's headers come back to a LiteLLM client as `llm_provider-<name>`
(issue 46, stumble 12; tests/test_engine_headers.py holds the gateway's side).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from dgxmm.litellm.entries import Registration, desired_entries
from dgxmm.litellm.filesync import ConfigFileSync
from events import model as m
from tests.litellm_support import LiteLLMProxy, Response, http_request, require_litellm
from tests.test_e2e_make_room import two_models
from tests.test_e2e_ondemand import Box, chat, post

ANSWER_S = 10.0  # real seconds: the 404 comes at once; this only bounds a wrong wait


async def swapping_box(tmp_path: Path) -> tuple[Box, str, str]:
    """The box of the stumble: `a` ready and idle, `b` stopped; b's start would evict a."""
    box = Box(tmp_path)
    await box.start()
    await box.controller.change_settings({"ondemand_make_room_after_s": 0}, "admin:t")
    a, b = await two_models(box)
    assert box.controller.candidates(b), "a must be able to make room for b"
    return box, a, b


async def since(box: Box, count: int) -> list[Any]:
    """The events recorded after the first `count`."""
    return [r.event for r in (await box.store.read())[count:]]


def started_or_slept(events: list[Any]) -> list[str]:
    kinds = (m.StartRequested, m.EngineStarting, m.PutToSleep, m.StopRequested)
    return [type(e).__name__ for e in events if isinstance(e, kinds)]


def test_a_stopped_model_asked_for_by_another_name_gets_404_at_once_and_nothing_starts_or_sleeps(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        box, a, b = await swapping_box(tmp_path)
        try:
            before = len(await box.store.read())
            t0 = box.clock.now()
            for stream in (False, True):
                reply = await asyncio.wait_for(
                    post(box.port, b, chat("org/other", stream)), ANSWER_S
                )
                assert reply.status == 404, reply.body
                error = reply.json()["error"]
                assert (error["type"], error["code"]) == (
                    "invalid_request_error",
                    "model_not_found",
                )
                assert error["message"] == (
                    "the model org/other does not exist here; this deployment serves org/b"
                )
            assert box.clock.now() == t0  # answered without any virtual time passing
            await box.advance(10)  # and nothing follows a moment later
            assert (box.state(a), box.state(b)) == ("ready", "stopped")
            assert started_or_slept(await since(box, before)) == []
            # The same request with b's own names starts b, and a sleeps to make room for it:
            # what the other name did before the check.
            for name in ("org/b", "b"):  # the served model (what LiteLLM sends), the deployment's
                count = len(await box.store.read())
                reply_task = asyncio.ensure_future(post(box.port, b, chat(name, False)))
                await box.drive(reply_task.done, step=0.25, limit_s=300)
                assert reply_task.result().status == 200, reply_task.result().body
                if name == "org/b":
                    sleeps = [e for e in await since(box, count) if isinstance(e, m.PutToSleep)]
                    assert [(e.reason, e.for_deployment) for e in sleeps] == [("make_room", b)]
        finally:
            await box.stop()

    asyncio.run(main())


# --- through a real LiteLLM ------------------------------------------------------------------


def litellm_chat(proxy: LiteLLMProxy, model: str) -> Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}]}
    return http_request(proxy.url, "POST", "/v1/chat/completions", body, proxy.auth, timeout_s=120)


async def front_with_litellm(box: Box, workdir: Path) -> LiteLLMProxy:
    """LiteLLM on the config file DGXMM's file back-end writes for this box's deployments."""
    regs = [
        Registration(
            deployment_id=rec.id,
            model_name=rec.name,
            served_model=rec.model,
            mode=rec.mode,  # type: ignore[arg-type]
            state=rec.state,
        )
        for rec in box.controller.records()
    ]
    gateway_url = f"http://127.0.0.1:{box.port}"
    config = workdir / "litellm.json"
    writer = ConfigFileSync(config, "http://127.0.0.1:1", "unused")
    try:
        await writer.sync(desired_entries(regs, gateway_url, 900, stable=True))
    finally:
        await writer.close()
    proxy = LiteLLMProxy(require_litellm(), config, workdir, reload=False)
    await asyncio.to_thread(proxy.start)
    return proxy


def test_through_litellm_another_name_never_reaches_the_gateway_and_starts_nothing(
    tmp_path: Path,
) -> None:
    require_litellm()

    async def main() -> None:
        (tmp_path / "box").mkdir()
        box, a, b = await swapping_box(tmp_path / "box")
        run_dir = tmp_path / "litellm"
        run_dir.mkdir()
        proxy: LiteLLMProxy | None = None
        try:
            proxy = await front_with_litellm(box, run_dir)
            before = len(await box.store.read())
            assert box.gateway.server is not None
            requests_before = box.gateway.server.requests_total
            # A name LiteLLM does not list (the served name is not one either): LiteLLM's own
            # error, and the gateway sees nothing.
            for name in ("other", "org/b"):
                answer = await asyncio.to_thread(litellm_chat, proxy, name)
                assert 400 <= answer.status < 500, (name, answer.status, answer.body)
                assert "does not exist here" not in answer.body.decode(errors="replace")
            assert box.gateway.server.requests_total == requests_before
            assert (box.state(a), box.state(b)) == ("ready", "stopped")
            assert started_or_slept(await since(box, before)) == []
            # b's LiteLLM name arrives at the gateway as the served name: b starts, a sleeps.
            reply = asyncio.ensure_future(asyncio.to_thread(litellm_chat, proxy, "b"))
            await box.drive(reply.done, step=0.25, limit_s=300)
            answer = reply.result()
            assert answer.status == 200, answer.body
            assert json.loads(answer.body)["choices"][0]["message"]["content"]
            # The engine's headers, which the gateway relays as they are (`server: uvicorn`
            # here), reach a LiteLLM client renamed: LiteLLM's own answer has no Server.
            assert answer.headers.get("llm_provider-server") == "uvicorn", answer.headers
            assert "server" not in answer.headers
            sleeps = [e for e in await since(box, before) if isinstance(e, m.PutToSleep)]
            assert [(e.reason, e.for_deployment) for e in sleeps] == [("make_room", b)]
        finally:
            if proxy is not None:
                await asyncio.to_thread(proxy.stop)
            await box.stop()

    asyncio.run(main())
