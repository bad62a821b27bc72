"""Engine logs: redaction, and a live follow across restarts for both runtimes, for real.

The process runtime runs real engine processes that write their log file; the Docker tests
run real containers of the local sim image (marker `docker`; run them under
`flock /tmp/dgxmm-docker.lock`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from actors.ports import EngineHandle, LaunchSpec
from dgxmm.engines.logs import RESTARTED, EngineLogs, Redactor, split_lines
from dgxmm.engines.runtimes.process import ProcessRuntime
from tests.runtime_support import run

SECRET = "hf_Sup3rSecretValue"
DEADLINE_S = 30.0
# An engine that prints a few lines (one with the secret), then one line a second.
CHATTY = (
    "import os, sys, time\n"
    "print('loading weights', flush=True)\n"
    "print('token is ' + os.environ['HF_TOKEN'], flush=True)\n"
    "print(sys.argv[1], flush=True)\n"
    "time.sleep(600)\n"
)


def test_the_redactor_hides_every_secret_value_and_leaves_short_values_alone() -> None:
    redact = Redactor([SECRET, "on", "sk-abc", "sk-abcdef"])
    assert redact(f"x={SECRET} y=sk-abcdef z=sk-abc on") == (
        "x=[redacted] y=[redacted] z=[redacted] on"
    )
    assert redact("a" * 10_000).endswith(" [dgxmm: line cut]")


def test_split_lines_keeps_the_unfinished_rest_for_the_next_piece() -> None:
    assert split_lines("", "one\ntw") == (["one"], "tw")
    assert split_lines("tw", "o\r\nthree\n") == (["two", "three"], "")
    assert split_lines("", "no end yet") == ([], "no end yet")


async def _next_until(lines: AsyncIterator[str], wanted: str) -> list[str]:
    """Read lines until one equals `wanted`; all of them."""
    seen: list[str] = []
    async with asyncio.timeout(DEADLINE_S):
        async for line in lines:
            seen.append(line)
            if line == wanted:
                return seen
    raise AssertionError(f"the follow ended before {wanted!r}: {seen}")


def _spec(deployment_id: str, marker: str, image: str = "ignored") -> LaunchSpec:
    return LaunchSpec(
        deployment_id=deployment_id,
        name="chatty",
        engine="sim",
        image=image,
        argv=[sys.executable, "-c", CHATTY, marker],
        port=8000,
        env={"PYTHONUNBUFFERED": "1", "HF_TOKEN": SECRET},
    )


async def _follow_across_a_restart(runtime: Any, dep: str, image: str) -> list[str]:
    """Launch CHATTY, follow its log, relaunch it; the lines after the restart."""
    current: dict[str, EngineHandle | None] = {"handle": None}
    logs = EngineLogs(
        runtime, Redactor([SECRET]), handle_of=lambda _: current["handle"], poll_s=0.05
    )
    current["handle"] = await runtime.launch(_spec(dep, "first-run", image))
    follow = logs.follow(dep, 10)
    try:
        seen = await _next_until(follow, "first-run")
        assert seen == ["loading weights", "token is [redacted]", "first-run"]
        assert await logs.tail(dep, 2) == ["token is [redacted]", "first-run"]
        await runtime.stop(current["handle"], 5)
        current["handle"] = await runtime.launch(_spec(dep, "second-run", image))
        after = await _next_until(follow, "second-run")
        assert await logs.last_line(dep) == "second-run"
        return after
    finally:
        await follow.aclose()  # type: ignore[attr-defined]
        if current["handle"] is not None:
            await runtime.stop(current["handle"], 5)
        await runtime.close()


def test_process_logs_are_tailed_followed_across_a_restart_and_redacted(tmp_path: Path) -> None:
    after = run(_follow_across_a_restart(ProcessRuntime(tmp_path), "dep1", "ignored"))
    assert after == [RESTARTED, "loading weights", "token is [redacted]", "second-run"]


def test_the_log_of_a_deployment_that_never_ran_is_empty(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        logs = EngineLogs(runtime, Redactor([]), handle_of=lambda _: None)
        assert await logs.tail("nope", 50) == []
        assert await logs.last_line("nope") is None
        await runtime.close()

    run(scenario())


@pytest.mark.docker
def test_docker_logs_follow_a_container_and_its_replacement_with_secrets_redacted() -> None:
    from dgxmm.engines.runtimes.docker import SIM_IMAGE, DockerRuntime
    from tests.e2e_support import require_docker

    require_docker()
    after = run(_follow_across_a_restart(DockerRuntime(), "logs-test", SIM_IMAGE))
    assert after[0] == RESTARTED and after[-1] == "second-run"
    assert "token is [redacted]" in after and SECRET not in "".join(after)
