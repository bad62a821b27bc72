"""`/d/<name>/v1/...` reaches the deployment of that name, as `/d/<id>/v1/...` does (issue 46,
stumble 6).

A newcomer typed `/d/demo-chat/v1/chat/completions` and got "no on-demand deployment
demo-chat".  Names are unique per box, so the gateway now takes them too; an id always wins
(LiteLLM's entries use ids), and a name is looked up only after the id missed, on the
handler's way, so requests by id (the express lane's) pay nothing for it.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gateway.app import Gateway
from gateway.server import ServerConfig
from tests.gateway_support import FakeEngine, ScriptedController, request_once, run
from tests.serve_support import banner_auth, start_demo, stop_demo

CHAT = {"model": "served-a1b2c3d4", "messages": [{"role": "user", "content": "Hello"}]}


def by_name(controller: ScriptedController) -> Gateway:
    """A gateway over `controller` that looks names up as DGXMM's does."""

    def named(name: str) -> str | None:
        found = (d for d, dep in controller.deployments.items() if dep.model_name == name)
        return next(found, None)

    return Gateway(controller, named=named, clock=lambda: 1700000000.0)


def test_a_deployment_is_reached_by_its_name_and_the_engine_sees_the_same_request() -> None:
    async def main() -> None:
        async with FakeEngine() as engine:
            controller = ScriptedController()
            controller.add("a1b2c3d4", handle=engine.handle, model_name="team/chat")
            gateway = by_name(controller)
            server = await gateway.serve("127.0.0.1", 0)
            try:
                for segment in ("a1b2c3d4", "team%2Fchat"):
                    reply = await request_once(
                        server.port, "POST", f"/d/{segment}/v1/chat/completions?x=1", CHAT
                    )
                    assert reply.status == 200, reply.body
                by_id, by_its_name = engine.seen
                assert by_its_name.target == by_id.target == "/v1/chat/completions?x=1"
                assert by_its_name.body == by_id.body
                models = await request_once(server.port, "GET", "/d/team%2Fchat/v1/models")
                assert models.json()["data"][0]["id"] == "served-a1b2c3d4"
            finally:
                await gateway.shutdown(2.0)
            assert controller.in_flight["a1b2c3d4"] == 0

    run(main())


@pytest.mark.parametrize("fast_path", [True, False], ids=["express-lane", "handler-only"])
def test_an_id_wins_over_a_name_that_looks_like_it(fast_path: bool) -> None:
    async def main() -> None:
        async with FakeEngine() as named_so, FakeEngine() as with_that_id:
            controller = ScriptedController()
            controller.add("aaaa0001", handle=named_so.handle, model_name="bbbb0002")
            controller.add("bbbb0002", handle=with_that_id.handle, model_name="plain")
            gateway = by_name(controller)
            server = await gateway.serve("127.0.0.1", 0, ServerConfig(fast_path=fast_path))
            try:
                body = {**CHAT, "model": "served-bbbb0002"}
                reply = await request_once(
                    server.port, "POST", "/d/bbbb0002/v1/chat/completions", body
                )
                assert reply.status == 200, reply.body
                assert (len(named_so.seen), len(with_that_id.seen)) == (0, 1)
            finally:
                await gateway.shutdown(2.0)

    run(main())


def test_neither_an_id_nor_a_name_is_a_404_that_says_what_the_path_takes() -> None:
    async def main() -> None:
        controller = ScriptedController()
        controller.add("a1b2c3d4", model_name="chat")
        gateway = by_name(controller)
        server = await gateway.serve("127.0.0.1", 0)
        try:
            reply = await request_once(server.port, "POST", "/d/nope/v1/chat/completions", CHAT)
        finally:
            await gateway.shutdown(2.0)
        assert reply.status == 404
        assert reply.json()["error"] == {
            "message": "no deployment nope: the path is /d/<deployment id or name>/v1/...",
            "type": "invalid_request_error",
            "code": "deployment_not_found",
        }

    run(main())


def test_the_demo_answers_its_chat_model_by_name(tmp_path: Path) -> None:
    proc, banner = start_demo(tmp_path)
    try:
        curl = re.search(r"curl -s (\S+)/d/\w+/v1/chat/completions", banner)
        assert curl is not None, banner
        body = {"model": "demo/chat-8b", "messages": [{"role": "user", "content": "Hello"}]}
        request = urllib.request.Request(
            f"{curl.group(1)}/d/demo-chat/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", **banner_auth(banner)},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                answer = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(exc.read().decode()) from None
        assert answer["choices"][0]["message"]["content"]
    finally:
        stop_demo(proc)
