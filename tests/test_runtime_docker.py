"""DockerRuntime against the real Docker engine, in the locally made `dgxmm-sim:local` image.

The containers run the host's Python (bind-mounted read-only, see scripts/make-sim-image).
Without a Docker engine these tests skip, except under CI=true, where that is a failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from actors.errors import RuntimeFailure
from actors.ports import EngineHandle, LaunchSpec
from dgxmm.engines.adapters import launch_spec
from dgxmm.engines.runtimes.docker import (
    SIM_IMAGE,
    DockerRuntime,
    container_name,
    docker_time,
    host_python_mounts,
    oom_line,
)
from tests.e2e_support import require_docker
from tests.runtime_support import http_status, poll_until, run

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def docker_engine() -> None:
    """Skip without Docker (with the reason) locally; under CI a missing engine fails."""
    require_docker()


def needs_docker(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test as needing the real Docker engine (and the sim image)."""
    marked: Callable[..., None] = pytest.mark.docker(pytest.mark.usefixtures("docker_engine")(test))
    return marked


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, deadline_s: float = DEADLINE_S
) -> None:
    """Poll `check` until it holds; fail the test with `what` at the deadline."""
    await poll_until(check, what, deadline_s)


def docker_inspect(name_or_id: str) -> dict[str, Any] | None:
    """`docker inspect` through the CLI (independent of aiodocker); None if there is none."""
    out = subprocess.run(
        ["docker", "inspect", name_or_id], capture_output=True, text=True, timeout=20, check=False
    )
    if out.returncode != 0:
        return None
    found: list[dict[str, Any]] = json.loads(out.stdout)
    return found[0] if found else None


def docker_kill(container_id: str) -> None:
    """Kill a container behind the runtime's back, through the CLI."""
    subprocess.run(["docker", "kill", container_id], capture_output=True, timeout=30, check=True)


@asynccontextmanager
async def docker_runtime(**kwargs: Any) -> AsyncIterator[DockerRuntime]:
    """A runtime (sim image: the host's Python, venv and project mounted); closed after."""
    runtime = DockerRuntime(**kwargs)
    try:
        yield runtime
    finally:
        await runtime.close()


def spec_for(argv: list[str], **overrides: Any) -> LaunchSpec:
    """A LaunchSpec for the sim image with a fresh deployment id."""
    fields: dict[str, Any] = {
        "deployment_id": f"t-{uuid.uuid4().hex[:8]}",
        "name": "test-model",
        "engine": "sim",
        "image": SIM_IMAGE,
        "argv": argv,
        "port": 8000,
        "env": {"PYTHONUNBUFFERED": "1"},
    }
    fields.update(overrides)
    return LaunchSpec(**fields)


def http_server_spec(**overrides: Any) -> LaunchSpec:
    """An engine stand-in: Python's http.server inside the container."""
    return spec_for(
        [sys.executable, "-m", "http.server", "--bind", "{host}", "{port}"], **overrides
    )


def script_spec(code: str, **overrides: Any) -> LaunchSpec:
    """An engine that runs `python -c code` inside the container."""
    return spec_for([sys.executable, "-c", code], **overrides)


@asynccontextmanager
async def launched(runtime: DockerRuntime, spec: LaunchSpec) -> AsyncIterator[EngineHandle]:
    """Launch, and always remove the container afterwards."""
    handle = await runtime.launch(spec)
    try:
        yield handle
    finally:
        await runtime.stop(handle, timeout_s=2)


async def answers_http(handle: EngineHandle) -> None:
    """Wait until the engine answers HTTP 200 on its published port."""

    async def ok() -> bool:
        return await http_status(handle.host, handle.port) == 200

    await eventually(ok, f"HTTP 200 on {handle.base_url}")


@needs_docker
def test_a_launched_container_is_labelled_answers_on_its_port_and_is_gone_after_stop() -> None:
    async def scenario() -> None:
        async with docker_runtime() as runtime:
            spec = http_server_spec()
            handle = await runtime.launch(spec)
            try:
                info = docker_inspect(handle.runtime_id)
                assert info is not None
                assert info["Name"] == f"/dgxmm-{spec.deployment_id}"
                labels = info["Config"]["Labels"]
                assert labels["dgxmm.deployment"] == spec.deployment_id
                assert labels["dgxmm.managed"] == "1"
                binding = info["HostConfig"]["PortBindings"]["8000/tcp"][0]
                assert (binding["HostIp"], binding["HostPort"]) == ("127.0.0.1", str(handle.port))
                assert handle.host == "127.0.0.1"
                assert await runtime.is_running(handle)
                await answers_http(handle)
            finally:
                await runtime.stop(handle, timeout_s=5)
            assert docker_inspect(handle.runtime_id) is None
            assert not await runtime.is_running(handle)
            assert await http_status(handle.host, handle.port) is None

    run(scenario())


@needs_docker
def test_a_container_killed_behind_our_back_is_not_running() -> None:
    async def scenario() -> None:
        async with docker_runtime() as runtime, launched(runtime, http_server_spec()) as handle:
            docker_kill(handle.runtime_id)

            async def stopped() -> bool:
                return not await runtime.is_running(handle)

            await eventually(stopped, "is_running turns False")
            assert handle not in await runtime.list_engines()

    run(scenario())


@needs_docker
def test_exited_at_is_none_while_running_and_the_exit_time_after_a_kill() -> None:
    """`exited_at` (issue 34): what proves a request sent after it never reached the engine."""

    async def scenario() -> None:
        async with docker_runtime() as runtime, launched(runtime, http_server_spec()) as handle:
            assert await runtime.exited_at(handle) is None
            before = time.time()
            docker_kill(handle.runtime_id)

            async def stopped() -> bool:
                return not await runtime.is_running(handle)

            await eventually(stopped, "is_running turns False")
            at = await runtime.exited_at(handle)
            assert at is not None and before - 1 < at <= time.time()

    run(scenario())


def test_docker_times_are_read_to_the_microsecond_and_the_zero_time_is_none() -> None:
    assert docker_time("2026-12-03T19:05:01.123456789Z") == pytest.approx(1796324701.123457)
    assert docker_time("2026-12-03T20:05:01+01:00") == 1796324701.0
    assert docker_time("0001-01-01T00:00:00Z") is None
    assert docker_time("") is None


@needs_docker
def test_a_new_runtime_adopts_a_still_running_container() -> None:
    async def scenario() -> None:
        async with docker_runtime() as first:
            handle = await first.launch(http_server_spec())
        # DGXMM went away (its runtime closed); the container did not.
        async with docker_runtime() as second:
            try:
                assert handle in await second.list_engines()
                await answers_http(handle)
            finally:
                await second.stop(handle, timeout_s=5)
            assert handle not in await second.list_engines()

    run(scenario())


@needs_docker
def test_a_failing_engines_log_tail_is_readable() -> None:
    code = (
        "import sys\n"
        "print('loading model', flush=True)\n"
        "sys.stderr.write('fatal: model not found: nope\\n')\n"
        "sys.exit(3)\n"
    )

    async def scenario() -> None:
        async with docker_runtime() as runtime:
            async with launched(runtime, script_spec(code)) as handle:

                async def exited() -> bool:
                    return not await runtime.is_running(handle)

                await eventually(exited, "the failing engine exits")
                tail = await runtime.logs_tail(handle, lines=5)
                # Docker copies stdout and stderr separately: their relative order is not kept.
                assert sorted(tail.splitlines()) == [
                    "fatal: model not found: nope",
                    "loading model",
                ]
                assert len((await runtime.logs_tail(handle, lines=1)).splitlines()) == 1
            assert await runtime.logs_tail(handle) == ""  # removed with its container

    run(scenario())


@needs_docker
def test_a_container_killed_for_its_memory_limit_says_so_at_the_end_of_its_log_tail() -> None:
    code = "print('loading model', flush=True)\nheld = bytearray(512 << 20)\n"
    spec = script_spec(code, memory_bytes=128 << 20)

    async def scenario() -> None:
        async with docker_runtime() as runtime, launched(runtime, spec) as handle:

            async def exited() -> bool:
                return not await runtime.is_running(handle)

            await eventually(exited, "the engine is killed")
            tail = (await runtime.logs_tail(handle, lines=5)).splitlines()
            assert tail == ["loading model", oom_line(128 << 20)]
            assert "limit of 0.125 GiB" in tail[-1]
            assert (await runtime.logs_tail(handle, lines=1)).splitlines() == [tail[-1]]

    run(scenario())


@needs_docker
def test_stop_kills_a_container_that_ignores_sigterm_after_the_timeout() -> None:
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('stubborn', flush=True)\n"
        "time.sleep(120)\n"
    )

    async def scenario() -> None:
        async with docker_runtime() as runtime, launched(runtime, script_spec(code)) as handle:

            async def stubborn() -> bool:
                return "stubborn" in await runtime.logs_tail(handle)

            await eventually(stubborn, "the engine ignores SIGTERM")
            started = time.monotonic()
            await runtime.stop(handle, timeout_s=1)
            assert time.monotonic() - started < 15
            assert docker_inspect(handle.runtime_id) is None

    run(scenario())


@needs_docker
def test_env_volumes_and_memory_reach_the_container(tmp_path: Path) -> None:
    code = (
        "import os, pathlib, time\n"
        "pathlib.Path('/data/env.txt').write_text(os.environ['ENGINE_URL'])\n"
        "print('written', flush=True)\n"
        "time.sleep(120)\n"
    )
    spec = script_spec(
        code,
        env={"PYTHONUNBUFFERED": "1", "ENGINE_URL": "http://{host}:{port}/v1"},
        volumes={str(tmp_path): "/data"},
        memory_bytes=256 * 1024 * 1024,
    )

    async def scenario() -> None:
        async with docker_runtime() as runtime, launched(runtime, spec) as handle:

            async def written() -> bool:
                return "written" in await runtime.logs_tail(handle)

            await eventually(written, "the engine wrote to its volume")
            assert (tmp_path / "env.txt").read_text() == "http://0.0.0.0:8000/v1"
            info = docker_inspect(handle.runtime_id)
            assert info is not None
            assert info["HostConfig"]["Memory"] == 256 * 1024 * 1024

    run(scenario())


@needs_docker
def test_a_stopped_leftover_container_is_replaced_and_a_running_one_refused() -> None:
    spec = http_server_spec()

    async def scenario() -> None:
        async with docker_runtime() as runtime, launched(runtime, spec) as first:
            with pytest.raises(RuntimeFailure, match="already has a running container"):
                await runtime.launch(spec)
            docker_kill(first.runtime_id)

            async def stopped() -> bool:
                return not await runtime.is_running(first)

            await eventually(stopped, "the first container stops")
            async with launched(runtime, spec) as second:
                assert second.runtime_id != first.runtime_id
                assert docker_inspect(first.runtime_id) is None
                await answers_http(second)
            assert docker_inspect(container_name(spec.deployment_id)) is None

    run(scenario())


@needs_docker
def test_a_missing_image_is_a_runtime_failure_when_pulling_is_off() -> None:
    spec = http_server_spec(image="dgxmm-no-such-image:never")

    async def scenario() -> None:
        async with docker_runtime(pull_missing=False) as runtime:
            with pytest.raises(RuntimeFailure, match="dgxmm-no-such-image:never is not present"):
                await runtime.launch(spec)
            assert docker_inspect(container_name(spec.deployment_id)) is None

    run(scenario())


def test_an_unreachable_docker_engine_is_a_runtime_failure(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = DockerRuntime(url=f"unix://{tmp_path}/no-docker.sock", api_timeout_s=5)
        try:
            with pytest.raises(RuntimeFailure, match="cannot reach the Docker engine"):
                await runtime.list_engines()
            with pytest.raises(RuntimeFailure, match="cannot reach the Docker engine"):
                await runtime.launch(http_server_spec())
        finally:
            await runtime.close()

    run(scenario())


@pytest.mark.parametrize("gpu", [True, False])
def test_the_gpu_is_requested_only_when_the_spec_asks(gpu: bool) -> None:
    spec = spec_for(["vllm", "serve", "m", "--port", "{port}"], image="vllm/vllm-openai", gpu=gpu)
    host_config = DockerRuntime().container_config(spec, host_port=41234)["HostConfig"]
    if gpu:
        assert host_config["DeviceRequests"] == [
            {"Driver": "nvidia", "Count": -1, "Capabilities": [["gpu"]]}
        ]
        assert host_config["IpcMode"] == "host"
        assert "ShmSize" not in host_config  # the host's /dev/shm
    else:
        assert "DeviceRequests" not in host_config
        assert "IpcMode" not in host_config
        assert host_config["ShmSize"] == 1 << 30  # vLLM's CPU build needs 160 MiB


def test_image_mounts_bind_host_paths_read_only_into_that_images_containers_only() -> None:
    runtime = DockerRuntime(image_mounts={"dgxmm-vllm:local": ["/opt/venv", "/usr"]})
    vllm = spec_for(["vllm", "serve", "m"], image="dgxmm-vllm:local", engine="vllm")
    other = spec_for(["vllm", "serve", "m"], image="vllm/vllm-openai", engine="vllm")
    binds = runtime.container_config(vllm, host_port=41234)["HostConfig"]["Binds"]
    assert "/opt/venv:/opt/venv:ro" in binds and "/usr:/usr:ro" in binds
    assert runtime.container_config(other, host_port=41234)["HostConfig"]["Binds"] == []


def test_argv_replaces_the_entrypoint_and_the_port_is_published_on_loopback() -> None:
    spec = spec_for(["vllm", "serve", "m", "--host", "{host}", "--port", "{port}"], image="v")
    config = DockerRuntime().container_config(spec, host_port=41234)
    assert config["Entrypoint"] == ["vllm"]
    assert config["Cmd"] == ["serve", "m", "--host", "0.0.0.0", "--port", "8000"]
    assert config["ExposedPorts"] == {"8000/tcp": {}}
    assert config["HostConfig"]["PortBindings"] == {
        "8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "41234"}]
    }


def test_only_the_sim_image_gets_the_hosts_python_mounted() -> None:
    runtime = DockerRuntime()
    real = runtime.container_config(spec_for(["vllm"], image="vllm/vllm-openai"), 41234)
    sim = runtime.container_config(spec_for(["python3"], image=SIM_IMAGE), 41234)
    assert real["HostConfig"]["Binds"] == []
    assert "WorkingDir" not in real
    assert not any(e.startswith("PATH=") for e in real["Env"])
    assert f"{ROOT}:{ROOT}:ro" in sim["HostConfig"]["Binds"]
    assert "/usr:/usr:ro" in sim["HostConfig"]["Binds"]
    assert sim["WorkingDir"] == str(ROOT)
    assert f"PATH={sys.prefix}/bin:" in " ".join(sim["Env"])


def test_host_python_mounts_cover_the_interpreter_and_the_project() -> None:
    mounts = host_python_mounts(ROOT, base_prefix="/opt/py", prefix="/srv/venv")
    binds = [m.bind() for m in mounts]
    assert binds[0] == "/usr:/usr:ro"
    assert "/opt/py:/opt/py:ro" in binds
    assert f"{ROOT}:{ROOT}:ro" in binds
    assert "/srv/venv:/srv/venv:ro" in binds
    inside = host_python_mounts(ROOT, base_prefix="/usr", prefix=f"{ROOT}/.venv")
    assert [m.host for m in inside if m.host not in ("/bin", "/lib", "/lib64")] == [
        "/usr",
        str(ROOT),
    ]


@needs_docker
def test_the_simulated_engine_from_its_adapter_serves_in_the_sim_image() -> None:
    # The adapter's default interpreter is `python3`: the sim image's PATH finds the venv's.
    spec = launch_spec(f"sim-{uuid.uuid4().hex[:8]}", "m", "sim", "sim-model", 0)

    async def scenario() -> None:
        async with docker_runtime() as runtime, launched(runtime, spec) as handle:

            async def ready() -> bool:
                return await http_status(handle.host, handle.port, "/v1/models") == 200

            await eventually(ready, "the simulated engine serves /v1/models")
            started = time.monotonic()
            await runtime.stop(handle, timeout_s=10)
            assert time.monotonic() - started < 5  # it handles SIGTERM (docker-init relays it)

    run(scenario())


@needs_docker
def test_a_simulated_engine_failing_at_start_leaves_its_reason_in_the_logs() -> None:
    args = ["--fail-at-start", "CUDA out of memory (simulated)"]
    spec = launch_spec(f"sim-{uuid.uuid4().hex[:8]}", "m", "sim", "sim-model", 0, args)

    async def scenario() -> None:
        async with docker_runtime() as runtime, launched(runtime, spec) as handle:

            async def exited() -> bool:
                return not await runtime.is_running(handle)

            await eventually(exited, "the failing simulated engine exits")
            assert "CUDA out of memory (simulated)" in await runtime.logs_tail(handle)

    run(scenario())
