"""Cold-start phases end to end: a real `dgxmm serve`, a request that waits for a start, and
what replay, `/metrics`, the progress and the queue views say about it.

The simulated engine runs as a process and prints vLLM's loading lines over its start-up
delay, so the milestones are read from a real log file by the real watcher.  The same story
with the real llama.cpp is in `test_a_real_llama_cpp_start_is_told_in_phases`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dgxmm.admin.phase_metrics import StartPhases
from events import model as m
from tests.cold_start_support import (
    ENGINE_TOLERANCE_S,
    assert_adds_up,
    llama_log_moments,
    phase_disagreements,
    process_started_at,
    replay_wait,
    shifted,
)
from tests.gateway_support import request_once
from tests.real_engine_support import ENGINE_ARGS, RuntimeKind, poll, serving
from tests.serve_support import Serve, chat_body, sim_spec, write_config

DEADLINE_S = 60.0
T0 = 1_767_225_600.0


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 180))


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it holds; fail naming `what` after the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


def test_a_request_that_made_room_for_a_vllm_like_start_is_told_in_phases(tmp_path: Path) -> None:
    async def main() -> None:
        serve = Serve(tmp_path, write_config(tmp_path, total_gib=2))
        await serve.start()
        try:
            api = serve.api
            assert api is not None

            async def state(dep: str) -> str:
                return str((await api.ok("GET", f"/dgxmm/api/deployments/{dep}"))["state"])

            # `big` is created (it starts at once), then stopped; `small` takes the memory.
            big_spec = sim_spec("big", mode="on_demand", gib=1.5, args=["--startup-delay", "2"])
            big = (await api.ok("POST", "/dgxmm/api/deployments", big_spec, 201))["id"]
            await until(lambda: _is(state(big), "ready"), "big is ready")
            await api.ok("POST", f"/dgxmm/api/deployments/{big}/stop")
            await until(lambda: _is(state(big), "stopped"), "big is stopped")
            small_spec = {**sim_spec("small", mode="on_demand", gib=1.5), "make_room_after_s": 0}
            small = (await api.ok("POST", "/dgxmm/api/deployments", small_spec, 201))["id"]
            await until(lambda: _is(state(small), "ready"), "small is ready")

            # Its one start so far is its expected start time, shown where a start is waited for.
            record = await api.ok("GET", f"/dgxmm/api/deployments/{big}")
            expected = record["expected_start_s"]
            assert 2.0 < expected < 20.0, record
            sent_at = time.time()
            sent = asyncio.ensure_future(
                request_once(
                    serve.gateway_port,
                    "POST",
                    f"/d/{big}/v1/chat/completions",
                    chat_body("sim/big"),
                    key=serve.gateway_key,
                )
            )
            rows: list[dict[str, Any]] = []

            async def waiting() -> bool:
                rows[:] = (await api.ok("GET", "/dgxmm/api/queue"))["requests"]
                return bool(rows)

            await until(waiting, "the request waits in the queue")
            assert [r["expected_start_s"] for r in rows] == [expected], rows
            answer = await sent
            answered_at = time.time()
            assert answer.status == 200, answer.body
            request_id = answer.header("x-dgxmm-request-id")
            assert request_id is not None
            assert await state(small) == "stopped"

            async def first_byte_recorded() -> bool:
                return any(isinstance(r.event, m.FirstByteRelayed) for r in await serve.records())

            await until(first_byte_recorded, "the first byte is recorded")
            wait, text = replay_wait(serve.db, request_id)
            names = [p["name"] for p in wait["phases"]]
            # The sim prints the API server line as it starts listening: DGXMM may see it
            # ready first, and then that milestone counts in no phase.
            expected = ["stopping_victims", "launch", "loading_weights", "loading_model",
                        "engine_init", "ready", "first_byte"]  # fmt: skip
            assert [n for n in names if n != "server_start"] == expected, names
            assert_adds_up(wait)
            # The end of the launch against the kernel's start time of the engine's process,
            # the wait against the test's clock (the sim's log carries no clock of its own).
            launched = [r.event for r in await serve.records() if r.stream == f"deployment:{big}"
                        and isinstance(r.event, m.EngineStarting)][-1]  # fmt: skip
            engine = {"launch": process_started_at(launched.runtime_id)}
            assert phase_disagreements(wait, engine, (sent_at, answered_at)) == [], (wait, engine)
            assert wait["wait_s"] > 2.0  # the start-up delay
            stopping = wait["phases"][0]
            assert stopping["detail"].startswith("small "), stopping
            loading = sum(p["seconds"] for p in wait["phases"] if p["name"].startswith("load"))
            assert 0.6 < loading < 1.6, wait  # the sim spreads its 2 s: weights at 0.8 s ...
            for name in names:
                assert f"    {name} " in text, text
            assert "from arrival to the first byte" in text, text

            metrics = await api.call("GET", "/metrics")
            assert metrics.status == 200
            lines = metrics.body.decode().splitlines()
            assert "# TYPE dgxmm_cold_start_phase_seconds histogram" in lines
            # Two starts of big (at its creation, then for the request); one made room.
            counts = {"stopping_victims": 1, "launch": 2, "loading_weights": 2, "ready": 2,
                      "first_byte": 1}  # fmt: skip
            for phase, n in counts.items():
                labels = f'deployment="big",id="{big}",phase="{phase}"'
                count = f"dgxmm_cold_start_phase_seconds_count{{{labels}}} {n}"
                assert count in lines, (phase, [x for x in lines if "phase_seconds_count" in x])
        finally:
            serve.kill()
            serve.kill_engines()

    run(main())


async def _is(value: Awaitable[str], wanted: str) -> bool:
    return await value == wanted


def _rec(seq: int, ts: float, stream: str, event: m.AnyEvent) -> m.Recorded:
    return m.Recorded(seq=seq, ts=ts, stream=stream, version=seq, actor="system", event=event)


def test_the_phase_histogram_counts_each_phase_of_a_start_and_of_its_waiting_requests() -> None:
    phases = StartPhases()
    d = "deployment:d1"
    phases.recorded(
        [
            _rec(1, T0, "queue", m.RequestQueued(request_id="r1", deployment_id="d1",
                                                 kind="queued", position=1, arrived_at=T0)),
            _rec(2, T0 + 3, "deployment:d2", m.PutToSleep(reason="make_room", for_deployment="d1")),
            _rec(3, T0 + 3, "queue", m.RequestAdmitted(request_id="r1", deployment_id="d1")),
            _rec(4, T0 + 3, d, m.StartRequested(reason="request", request_id="r1")),
            _rec(5, T0 + 6, d, m.EngineStarting(runtime_id="pid:1", host="h", port=1,
                                                launch_began_at=T0 + 5)),
            _rec(6, T0 + 9, d, m.EngineMilestoneReached(milestone="model_loaded", at=T0 + 8)),
            _rec(7, T0 + 10, d, m.EngineReady()),
            _rec(8, T0 + 10.5, "queue", m.FirstByteRelayed(request_id="r1", deployment_id="d1",
                                                          waited_s=10.5, at=T0 + 10.5)),
        ]
    )  # fmt: skip
    text = "\n".join(phases.histogram.render(lambda dep_id: {"d1": "big"}.get(dep_id, dep_id)))
    sums = {
        line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dgxmm_cold_start_phase_seconds_sum")
    }
    assert sums == {
        "waiting_for_memory": 3.0,
        "stopping_victims": 2.0,
        "launch": 1.0,
        "loading_model": 2.0,
        "ready": 2.0,
        "first_byte": 0.5,
    }
    assert 'deployment="big",id="d1",phase="launch",le="1"} 1' in text


@pytest.mark.llama
@pytest.mark.parametrize(
    "runtime",
    [
        pytest.param("process", id="process"),
        pytest.param("docker", id="docker", marks=pytest.mark.docker),
    ],
)
def test_a_real_llama_cpp_start_is_told_in_phases(tmp_path: Path, runtime: RuntimeKind) -> None:
    with serving(tmp_path, runtime) as serve:
        # Timestamps in its log: the engine's own clock for the phases' check.
        serve.deploy("gemma", args=[*ENGINE_ARGS, "--log-timestamps"])
        serve.wait_state("gemma", "ready")
        dep_id = serve.deployments["gemma"]
        serve.api("POST", f"/deployments/{dep_id}/stop", {})
        serve.wait_state("gemma", "stopped")
        sent = time.time()
        answer = serve.chat("gemma")
        answered = time.time()
        assert answer.status == 200, answer.body
        request_id = answer.headers.get("x-dgxmm-request-id")
        assert request_id, answer.headers
        poll(
            lambda: any(e["type"] == "FirstByteRelayed" for e in serve.events()),
            "the first byte to be recorded",
        )
        wait, text = replay_wait(serve.db, request_id)
        names = [p["name"] for p in wait["phases"]]
        assert names[0] == "launch" and names[-2:] == ["ready", "first_byte"], names
        assert "loading_model" in names, names  # llama-server's "main: model loaded"
        for name in names:
            assert f"    {name} " in text, text
        milestones = [e["data"]["milestone"] for e in serve.events("gemma")
                      if e["type"] == "EngineMilestoneReached"]  # fmt: skip
        assert "model_loaded" in milestones, milestones

        # The phases against the kernel's start time of the engine and the engine's own log
        # clock (DGXMM keeps the log: `dgxmm logs`), and the wait against the test's clock.
        started_at = process_started_at(serve.engine_runtime_id("gemma"))
        lines = serve.api("GET", f"/deployments/{dep_id}/logs?tail=5000")["lines"]
        engine = {"launch": started_at, **llama_log_moments(lines, started_at)}
        assert set(engine) >= {"launch", "loading_model", "ready", "first_byte"}, lines
        assert phase_disagreements(wait, engine, (sent, answered)) == [], (wait, engine)
        # A mark DGXMM got wrong by more than the tolerance fails the check, though the
        # phases still add up.
        planted = shifted(wait, "launch", 2 * ENGINE_TOLERANCE_S)
        total = sum(p["seconds"] for p in planted["phases"])
        assert math.isclose(total, wait["wait_s"], rel_tol=0.01), planted
        found = phase_disagreements(planted, engine, (sent, answered))
        assert [p.split(":")[0] for p in found] == ["launch"], found


def test_a_milestone_recorded_just_after_ready_still_counts_in_the_histogram() -> None:
    phases = StartPhases()
    d = "deployment:d1"
    phases.recorded(
        [
            _rec(1, T0, d, m.StartRequested(reason="admin")),
            _rec(2, T0 + 1, d, m.EngineStarting(runtime_id="pid:1", host="h", port=1)),
            _rec(3, T0 + 5, d, m.EngineReady()),
            # llama.cpp prints "model loaded" as it starts answering: read after ready.
            _rec(4, T0 + 5.1, d, m.EngineMilestoneReached(milestone="model_loaded", at=T0 + 5)),
        ]
    )
    assert phases.histogram.count("d1\0launch") == 0  # not counted before it settled
    phases.recorded([_rec(5, T0 + 60, "queue", m.RequestLeftQueue(
        request_id="r9", deployment_id="d2", reason="served"))])  # fmt: skip
    assert phases.histogram.count("d1\0launch") == 1
    text = "\n".join(phases.histogram.render(lambda dep_id: dep_id))
    assert 'phase="loading_model"} 4.0' in text, text
    assert 'phase="ready"} 0.0' in text, text
