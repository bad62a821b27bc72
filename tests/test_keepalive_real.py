"""No request lost to a keep-alive race, on a real llama.cpp, through the gateway and a real
LiteLLM (issue 43; the CPU vLLM's part is in tests/test_real_vllm.py).

llama.cpp's `llama-server` answers a streamed request with `Keep-Alive: timeout=5, max=100`
and then closes the connection (cpp-httplib ends the connection when the stream's content
provider returns false after its last chunk).  Before the fix, the gateway pooled that
connection and the next request, sent on it before the close arrived, got 502
`engine_unreachable` (4 of 25 streamed 2-token requests in a row), and the same request,
taken by the handler's path while the engine was being checked, got DGXMM's own 404 for a
model name the express lane had relayed.

Here: 100 streamed and 100 plain requests back to back, then across gaps of 0.1, 4.9, 5.1
and 10 s (the engine's keep-alive timeout is 5 s), each kind after each kind, straight to
the gateway, on a new connection per request and on one kept-alive connection (as LiteLLM's
pool holds one); the same through a real LiteLLM with a pooled client that never retries
(LiteLLM pools its own connections to the gateway, whose idle timeout of 75 s is far above
its pool's 15 s).  Every answer must be a complete 200.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.keepalive_support import GAPS_S, Pooled, fresh, series
from tests.real_engine_support import (
    call,
    chat_body,
    litellm_file_backed,
    models_of,
    poll,
    serving,
)

BACK_TO_BACK = int(os.environ.get("DGXMM_KEEPALIVE_BACK_TO_BACK", "100"))
# Gaps around the LiteLLM -> gateway hop's own timeouts (its pool drops a connection idle 15 s,
# the gateway one idle 75 s): minutes of waiting, so by hand, e.g.
# DGXMM_KEEPALIVE_LONG_GAPS=14.9,15.1,74.9,75.1 DGXMM_KEEPALIVE_BACK_TO_BACK=10
# (docs/on-demand-gateway.md has the result).
LONG_GAPS_S = tuple(
    float(gap) for gap in os.environ.get("DGXMM_KEEPALIVE_LONG_GAPS", "").split(",") if gap
)
# Each long gap stands three times in the LiteLLM series.
pytestmark = [
    pytest.mark.llama,
    pytest.mark.litellm,
    pytest.mark.timeout(900 + 4 * sum(LONG_GAPS_S)),
]
TOKENS = 2  # the short answers: the requests follow each other closely


def body(model: str, stream: bool) -> dict[str, object]:
    """A short deterministic chat completion."""
    return chat_body(model, stream=stream, max_tokens=TOKENS)


def test_streamed_and_plain_requests_back_to_back_and_across_keep_alive_gaps_all_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tried: Callable[[str], None]
) -> None:
    proxy, litellm_config, extra = litellm_file_backed(tmp_path, monkeypatch)
    with serving(tmp_path, "process", extra_config=extra) as serve:
        # The engine: llama.cpp's own thread count (both cores), whose busy threads
        # delay the HTTP thread's close after a stream by milliseconds (with `-t 1` the close
        # comes before the next request and the race shows far less).
        serve.deploy("gemma", idle_timeout_s=300, args=["-c", "2048", "--no-warmup"])
        serve.wait_state("gemma", "ready")
        port, path, auth = serve.gateway_port, serve.gateway_path("gemma"), serve.gateway_auth

        def to_gateway(stream: bool) -> str | None:
            return fresh(port, path, body("gemma", stream), auth)

        direct = series(to_gateway, BACK_TO_BACK)
        tried(direct.line("straight to the gateway, a new connection each"))
        # As LiteLLM's pool holds it: one kept-alive connection to the gateway, no retry.
        kept = Pooled(port)
        try:
            pooled = series(
                lambda stream: kept.send(path, body("gemma", stream), auth), BACK_TO_BACK
            )
        finally:
            kept.close()
        tried(
            pooled.line("straight to the gateway, one kept-alive client without retries")
            + f" ({kept.connections} client connections)"
        )

        # Another model's name: the gateway's 404 every time, after a stream as after a
        # plain answer (the same answer on both of its paths, in every state).
        named: list[tuple[int, str]] = []
        for stream in (True, False, True, True):
            direct.note("before another model's name", to_gateway(stream))
            other = call(port, "POST", path, body("g", stream), auth)
            code = other.json()["error"]["code"] if other.status != 200 else ""
            named.append((other.status, code))
        tried(f"another model's name, after each kind: {named}")

        poll(
            lambda: litellm_config.exists() and "gemma" in litellm_config.read_text(),
            "DGXMM to write LiteLLM's config",
        )
        proxy.start()
        client = Pooled(proxy.port)
        try:
            poll(lambda: "gemma" in models_of(proxy), "LiteLLM to list gemma")
            send = functools.partial(client.send, "/v1/chat/completions", headers=proxy.auth)
            through = series(
                lambda stream: send(body("gemma", stream)), BACK_TO_BACK, GAPS_S + LONG_GAPS_S
            )
            tried(
                through.line("through LiteLLM, one kept-alive client without retries")
                + f" ({client.connections} client connections)"
            )
        finally:
            client.close()
            proxy.stop()
        gaps = ", ".join(f"{g:g}" for g in GAPS_S + LONG_GAPS_S)
        tried(f"gaps of {gaps} s; {TOKENS} tokens an answer")
        assert direct.failed == [] and pooled.failed == [] and through.failed == []
        assert named == [(404, "model_not_found")] * 4
