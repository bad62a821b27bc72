"""Engine adapters: launch specs, metric and health parsers, and the HTTP probe on live sims."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from actors.errors import EngineUnreachable
from actors.ports import EngineHandle, EngineLoad, EngineProbe, Readiness
from dgxmm.engines.adapters import (
    DEFAULT_STARTUP_TIMEOUT_S,
    EngineSettings,
    HttpEngineProbe,
    InvalidEngineArgs,
    UnknownEngine,
    command_line,
    iter_samples,
    launch_spec,
    parse_load,
    readiness_from,
    sleeping_from,
)
from dgxmm.engines.runtimes import expand_argv
from gateway import client
from simulations.engine import SimOptions, SimServer, serve

ROOT = Path(__file__).resolve().parent.parent
METRICS = Path(__file__).resolve().parent / "data" / "metrics"
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    """Run one test body on a fresh event loop."""

    async def main() -> T:
        return await coro

    return asyncio.run(main())


def sample(name: str) -> str:
    """A saved /metrics exposition."""
    return (METRICS / name).read_text()


async def eventually(check: Callable[[], Awaitable[T | None]], timeout_s: float = 10.0) -> T:
    """Poll `check` until it returns something other than None, or fail at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = await check()
        if result is not None:
            return result
        if loop.time() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.01)


def handle_for(port: int) -> EngineHandle:
    """An engine handle on loopback."""
    return EngineHandle(deployment_id="d1", host="127.0.0.1", port=port, runtime_id="test")


@contextlib.asynccontextmanager
async def sim(**fields: Any) -> AsyncIterator[SimServer]:
    """An in-process simulated engine, closed afterwards."""
    server = await serve(SimOptions(model="m", **fields))
    try:
        yield server
    finally:
        await server.close()


# --------------------------------------------------------------------------- metrics


def test_vllm_load_sums_over_engines_and_ignores_waiting_by_reason() -> None:
    assert parse_load("vllm", sample("vllm_dp2.txt")) == EngineLoad(running=5, waiting=5)


def test_vllm_load_reads_the_older_exposition_without_engine_label() -> None:
    assert parse_load("vllm", sample("vllm_v0_idle.txt")) == EngineLoad(running=0, waiting=0)


def test_llamacpp_load_reads_processing_and_deferred() -> None:
    assert parse_load("llamacpp", sample("llamacpp.txt")) == EngineLoad(running=2, waiting=3)


def test_sglang_load_takes_one_tp_rank_and_skips_offline_batch_series() -> None:
    assert parse_load("sglang", sample("sglang_tp2.txt")) == EngineLoad(running=4, waiting=7)


def test_sglang_load_takes_the_max_over_tp_ranks_and_sums_dp_ranks() -> None:
    assert parse_load("sglang", sample("sglang_dp2_tp2.txt")) == EngineLoad(running=5, waiting=1)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vllm_dp2.txt", EngineLoad(5, 5)),
        ("llamacpp.txt", EngineLoad(2, 3)),
        ("sglang_tp2.txt", EngineLoad(4, 7)),
    ],
)
def test_sim_load_recognises_whichever_flavour_it_speaks(name: str, expected: EngineLoad) -> None:
    assert parse_load("sim", sample(name)) == expected


def test_load_is_none_without_the_engines_series() -> None:
    assert parse_load("vllm", sample("llamacpp.txt")) is None
    assert parse_load("llamacpp", "") is None
    assert parse_load("sglang", sample("vllm_dp2.txt")) is None
    assert parse_load("sim", "# nothing here\n") is None


def test_malformed_lines_are_skipped_not_fatal() -> None:
    text = (
        "vllm:num_requests_running{engine=0} 3.0\n"
        'vllm:num_requests_running{engine="1"} notanumber\n'
        'vllm:num_requests_running{engine="2"} 2.0\n'
        'vllm:num_requests_running{engine="3",note="a \\"quoted\\" {brace}, comma"} 1.0 17\n'
        'vllm:num_requests_waiting{engine="0"} NaN\n'
        'vllm:num_requests_waiting{engine="1"} 1e0\n'
    )
    assert parse_load("vllm", text) == EngineLoad(running=3, waiting=1)
    labels = [lab for _, lab, _ in iter_samples(text, frozenset({"vllm:num_requests_running"}))]
    assert labels[-1] == {"engine": "3", "note": 'a "quoted" {brace}, comma'}


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(UnknownEngine):
        parse_load("tgi", "")


# --------------------------------------------------------------------------- readiness


@pytest.mark.parametrize(
    ("engine", "status", "body", "expected"),
    [
        ("vllm", None, b"", Readiness.DOWN),
        ("vllm", 200, b"", Readiness.READY),
        ("vllm", 503, b"", Readiness.DOWN),
        ("sglang", None, b"", Readiness.DOWN),
        ("sglang", 503, b"", Readiness.LOADING),
        ("sglang", 200, b"", Readiness.READY),
        (
            "llamacpp",
            503,
            b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}',
            Readiness.LOADING,
        ),
        ("llamacpp", 503, b'{"status":"no slot available"}', Readiness.READY),
        ("llamacpp", 200, b'{"status":"ok"}', Readiness.READY),
        ("sim", 503, b"", Readiness.LOADING),
    ],
)
def test_readiness_follows_each_engines_health_semantics(
    engine: str, status: int | None, body: bytes, expected: Readiness
) -> None:
    assert readiness_from(engine, status, body) is expected


def test_sleeping_only_for_an_explicit_true() -> None:
    assert sleeping_from(200, b'{"is_sleeping": true}') is True
    assert sleeping_from(200, b'{"is_sleeping": false}') is False
    assert sleeping_from(404, b'{"detail":"Not Found"}') is False
    assert sleeping_from(200, b"garbage") is False


# --------------------------------------------------------------------------- launch


def test_vllm_launch_spec_serves_the_model_on_8000_with_caches() -> None:
    spec = launch_spec("d1", "chat", "vllm", "Qwen/Qwen3-8B", 16 << 30, ["--max-model-len", "8192"])
    assert spec.image == "vllm/vllm-openai"
    assert spec.port == 8000
    assert spec.argv[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert spec.argv[-2:] == ["--max-model-len", "8192"]
    assert spec.argv[3:7] == ["--host", "{host}", "--port", "{port}"]
    assert set(spec.volumes.values()) == {"/root/.cache/huggingface", "/root/.cache/vllm"}
    assert spec.startup_timeout_s == DEFAULT_STARTUP_TIMEOUT_S == 1200.0
    assert spec.gpu
    assert spec.memory_bytes == 16 << 30
    assert "VLLM_SERVER_DEV_MODE" not in spec.env


def test_vllm_sleep_mode_turns_on_the_dev_endpoints() -> None:
    spec = launch_spec("d1", "chat", "vllm", "m", 1, ["--enable-sleep-mode"])
    assert spec.env["VLLM_SERVER_DEV_MODE"] == "1"


def test_llamacpp_gets_metrics_exactly_once_and_hf_or_path_models() -> None:
    spec = launch_spec("d2", "small", "llamacpp", "ggml-org/gemma-3-1b-it-GGUF", 1 << 30)
    assert spec.image == "ghcr.io/ggml-org/llama.cpp:server-cuda13"
    assert spec.port == 8080
    assert spec.argv[:3] == ["/app/llama-server", "-hf", "ggml-org/gemma-3-1b-it-GGUF"]
    assert spec.argv.count("--metrics") == 1
    again = command_line("llamacpp", "/models/x.gguf", ["--metrics", "-c", "4096"])
    assert again[1:3] == ["-m", "/models/x.gguf"]
    assert again.count("--metrics") == 1


def test_sglang_launch_enables_metrics_on_30000() -> None:
    spec = launch_spec("d3", "big", "sglang", "Qwen/Qwen2.5-7B-Instruct", 1, ["--tp", "1"])
    assert spec.image == "lmsysorg/sglang"
    assert spec.port == 30000
    assert spec.argv[:5] == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "Qwen/Qwen2.5-7B-Instruct",
    ]
    assert "--enable-metrics" in spec.argv


def test_sim_launch_uses_the_configured_image_python_and_port() -> None:
    settings = EngineSettings(sim_image="local/sim:1", sim_python="/usr/bin/python3")
    spec = launch_spec(
        "d4", "fake", "sim", "m", 0, ["--flavour", "llamacpp"], port=9123, settings=settings
    )
    assert spec.image == "local/sim:1"
    assert spec.port == 9123
    assert spec.argv[:3] == ["/usr/bin/python3", "-m", "simulations.engine"]
    assert spec.argv.count("--flavour") == 1
    assert not spec.gpu


def test_image_overrides_and_extra_env_apply() -> None:
    settings = EngineSettings(
        images={"vllm": "vllm/vllm-openai:v0.11.0"}, extra_env={"HF_TOKEN": "t"}
    )
    spec = launch_spec("d1", "n", "vllm", "m", 1, settings=settings)
    assert spec.image == "vllm/vllm-openai:v0.11.0"
    assert spec.env["HF_TOKEN"] == "t"


def test_user_args_cannot_move_the_port_or_host() -> None:
    with pytest.raises(InvalidEngineArgs):
        launch_spec("d1", "n", "vllm", "m", 1, ["--port=9000"])
    with pytest.raises(InvalidEngineArgs):
        command_line("sglang", "m", ["--host", "1.2.3.4"])
    with pytest.raises(UnknownEngine):
        launch_spec("d1", "n", "tgi", "m", 1)


# --------------------------------------------------------------------------- probe


def test_http_probe_satisfies_the_engine_probe_port() -> None:
    probe: EngineProbe = HttpEngineProbe()
    assert probe is not None


async def states_until_ready(engine: str, port: int) -> list[Readiness]:
    """Distinct readiness states the probe sees, in order, until READY."""
    probe = HttpEngineProbe(timeout_s=2.0)
    seen: list[Readiness] = []

    async def ready() -> bool | None:
        state = await probe.readiness(engine, handle_for(port))
        if not seen or seen[-1] is not state:
            seen.append(state)
        return True if state is Readiness.READY else None

    await eventually(ready)
    return seen


@pytest.mark.parametrize(
    ("flavour", "expected"),
    [
        ("vllm", [Readiness.DOWN, Readiness.READY]),
        ("llamacpp", [Readiness.LOADING, Readiness.READY]),
        ("sglang", [Readiness.DOWN, Readiness.LOADING, Readiness.READY]),
    ],
)
def test_probe_follows_each_flavour_through_its_startup(
    flavour: str, expected: list[Readiness]
) -> None:
    async def body() -> None:
        opts = {"startup_delay_s": 0.4, "warmup_delay_s": 0.4, "metrics": True}
        async with sim(flavour=flavour, **opts) as server:
            assert await states_until_ready(flavour, server.port) == expected
            assert await states_until_ready("sim", server.port) == [Readiness.READY]

    run(body())


@pytest.mark.parametrize("flavour", ["vllm", "llamacpp", "sglang"])
def test_probe_reads_live_load_of_each_flavour(flavour: str) -> None:
    async def body() -> None:
        opts = {"metrics": True, "token_delay_s": 0.05, "tokens": 100, "max_running": 1}
        async with sim(flavour=flavour, tp_size=2, **opts) as server:
            probe = HttpEngineProbe()
            handle = handle_for(server.port)
            assert await probe.load(flavour, handle) == EngineLoad(0, 0)
            requests = [
                asyncio.create_task(
                    client.request(
                        "127.0.0.1",
                        server.port,
                        "POST",
                        "/v1/completions",
                        body=b'{"prompt": "x"}',
                        timeout_s=30,
                    )
                )
                for _ in range(3)
            ]

            async def busy() -> EngineLoad | None:
                load = await probe.load(flavour, handle)
                return load if load == EngineLoad(1, 2) else None

            assert await eventually(busy) == EngineLoad(1, 2)
            assert await probe.load("sim", handle) == EngineLoad(1, 2)
            for task in requests:
                task.cancel()
            await asyncio.gather(*requests, return_exceptions=True)

    run(body())


def test_probe_load_is_none_when_metrics_are_off() -> None:
    async def body() -> None:
        async with sim(flavour="llamacpp") as server:
            assert await HttpEngineProbe().load("llamacpp", handle_for(server.port)) is None

    run(body())


def test_probe_reads_vllm_sleep_state_and_false_elsewhere() -> None:
    async def body() -> None:
        probe = HttpEngineProbe()
        async with sim(flavour="vllm") as server:
            handle = handle_for(server.port)
            assert await probe.is_sleeping("vllm", handle) is False
            await client.request("127.0.0.1", server.port, "POST", "/sleep?level=1")
            assert await probe.is_sleeping("vllm", handle) is True
            assert await probe.is_sleeping("sim", handle) is True
            assert await probe.readiness("vllm", handle) is Readiness.READY
        async with sim(flavour="sglang") as server:
            assert await probe.is_sleeping("sglang", handle_for(server.port)) is False
            assert await probe.is_sleeping("sim", handle_for(server.port)) is False

    run(body())


def test_probe_wakes_a_vllm_engine_put_to_sleep_by_hand() -> None:
    async def body() -> None:
        probe = HttpEngineProbe()
        async with sim(flavour="vllm") as server:
            handle = handle_for(server.port)
            await client.request("127.0.0.1", server.port, "POST", "/sleep?level=1")
            assert await probe.is_sleeping("vllm", handle) is True
            await probe.wake_up("vllm", handle)
            assert await probe.is_sleeping("vllm", handle) is False
        async with sim(flavour="llamacpp") as server:
            await probe.wake_up("llamacpp", handle_for(server.port))  # no sleep mode: nothing

    run(body())


def free_port() -> int:
    """A loopback port nothing listens on (right now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_probe_on_a_closed_port_is_down_and_load_unreachable() -> None:
    async def body() -> None:
        probe = HttpEngineProbe()
        handle = handle_for(free_port())
        assert await probe.readiness("vllm", handle) is Readiness.DOWN
        with pytest.raises(EngineUnreachable):
            await probe.load("vllm", handle)
        with pytest.raises(EngineUnreachable):
            await probe.is_sleeping("vllm", handle)

    run(body())


def test_probe_on_a_silent_engine_is_down_after_its_timeout() -> None:
    async def body() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # never answers
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        probe = HttpEngineProbe(timeout_s=0.3)
        try:
            assert await probe.readiness("sglang", handle_for(port)) is Readiness.DOWN
            with pytest.raises(EngineUnreachable, match="no complete answer"):
                await probe.load("sglang", handle_for(port))
        finally:
            server.close()

    run(body())


def test_probe_maps_a_non_http_answer_to_engine_unreachable() -> None:
    async def body() -> None:
        async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(garbage, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(EngineUnreachable, match="invalid HTTP response"):
                await HttpEngineProbe().readiness("vllm", handle_for(port))
        finally:
            server.close()

    run(body())


def test_sim_started_from_its_launch_spec_becomes_ready() -> None:
    async def body() -> None:
        port = free_port()
        settings = EngineSettings(sim_python=sys.executable)
        args = ["--flavour", "sglang", "--startup-delay", "0.3", "--warmup-delay", "0.3"]
        spec = launch_spec("d9", "fake", "sim", "m", 0, args, settings=settings)
        proc = await asyncio.create_subprocess_exec(
            *expand_argv(spec.argv, host="127.0.0.1", port=port),
            cwd=ROOT,
            env={**os.environ, **spec.env, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            seen = await states_until_ready("sim", port)
            assert seen[-2:] == [Readiness.LOADING, Readiness.READY]
            load = await HttpEngineProbe().load("sim", handle_for(port))
            assert load == EngineLoad(0, 0)
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 5) == 0

    run(body())
