"""Which model names a deployment's gateway accepts (issue 46, stumble 5), pure and on loopback.

Two names are the deployment's: the model its engine serves (what LiteLLM sends) and the
deployment's own name (what clients call it in LiteLLM).  The engine is sent the served
name either way (`classify.with_model`): vLLM answers 404 to any other, so a request with the
deployment's name used to start the model, evict another, and then get the engine's 404.
Any other name gets 404 `model_not_found` at once (tests/test_model_names_e2e.py: nothing
starts, nothing is put to sleep).
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from gateway.app import Gateway, GatewayConfig
from gateway.classify import Endpoint, names_served, with_model
from tests.gateway_support import FakeEngine, ScriptedController, request_once

CHAT = Endpoint.CHAT


def test_only_the_served_name_or_none_is_relayed_as_it_is() -> None:
    served = "org/b"
    assert names_served(CHAT, b'{"model":"org/b","messages":[]}', served)
    assert names_served(CHAT, b'{"messages":[]}', served)
    assert names_served(None, b"not json", served)  # no JSON body on this route
    assert not names_served(CHAT, b'{"model":"b","messages":[]}', served)  # the client's name
    assert not names_served(CHAT, b'{"model":"other","messages":[]}', served)
    assert not names_served(CHAT, b'{"model":7}', served)  # the handler judges it


def test_with_model_changes_the_top_level_model_and_keeps_every_other_members_bytes() -> None:
    members = (
        b'"messages": [{"role": "user", "content": "caf\\u00e9", "model": "b"}], '
        b'"temperature": 0.70, "max_tokens": 12345678901234567890123, "stream": true'
    )
    body = b'{"model": "b", ' + members + b"}"
    out = with_model(body, "org/b")
    assert json.loads(out) == {**json.loads(body), "model": "org/b"}
    for raw in (
        b'[{"role": "user", "content": "caf\\u00e9", "model": "b"}]',  # nested: not a model
        b"0.70",
        b"12345678901234567890123",
    ):
        assert raw in out
    assert with_model(b'{"model":"b"}', 'o"dd') == b'{"model":"o\\"dd"}'


@pytest.mark.parametrize("express", [True, False], ids=["express lane", "handler"])
@pytest.mark.parametrize("named", ["served-a", "model-a"], ids=["served name", "client name"])
def test_the_engine_is_sent_the_served_name_for_either_of_the_deployments_names(
    express: bool, named: str
) -> None:
    async def main() -> None:
        async with FakeEngine() as engine:
            controller = ScriptedController()
            controller.add("a", handle=engine.handle)  # model-a, serving served-a
            gateway = Gateway(controller, config=GatewayConfig(express=express))
            server = await gateway.serve("127.0.0.1", 0)
            await gateway.upstream.open_idle("127.0.0.1", engine.port)
            try:
                body = {"model": named, "messages": [{"role": "user", "content": "hi"}]}
                reply = await request_once(server.port, "POST", "/d/a/v1/chat/completions", body)
                assert reply.status == 200, reply.body
                [seen] = engine.seen
                assert msgspec.json.decode(seen.body) == {**body, "model": "served-a"}
            finally:
                await gateway.shutdown(2.0)

    asyncio.run(main())
