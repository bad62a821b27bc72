"""ProcessRuntime against real subprocesses, real sockets on loopback and a real data dir."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.errors import RuntimeFailure
from actors.ports import EngineHandle, LaunchSpec
from dgxmm.engines.adapters import EngineSettings, launch_spec
from dgxmm.engines.runtimes import expand_argv, expand_env, free_port
from dgxmm.engines.runtimes.process import ProcessRuntime
from tests.runtime_support import http_status, poll_until, run

DEADLINE_S = 15.0


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, deadline_s: float = DEADLINE_S
) -> None:
    """Poll `check` until it holds; fail the test with `what` at the deadline."""
    await poll_until(check, what, deadline_s)


def spec_for(argv: list[str], **overrides: Any) -> LaunchSpec:
    """A LaunchSpec with a fresh deployment id."""
    fields: dict[str, Any] = {
        "deployment_id": f"t-{uuid.uuid4().hex[:8]}",
        "name": "test-model",
        "engine": "sim",
        "image": "ignored",
        "argv": argv,
        "port": 8000,
        "env": {"PYTHONUNBUFFERED": "1"},
    }
    fields.update(overrides)
    return LaunchSpec(**fields)


def http_server_spec(**overrides: Any) -> LaunchSpec:
    """An engine stand-in: Python's http.server on the allocated host and port."""
    argv = [sys.executable, "-m", "http.server", "--bind", "{host}", "{port}"]
    return spec_for(argv, **overrides)


def script_spec(code: str, **overrides: Any) -> LaunchSpec:
    """An engine that runs `python -c code` (with its port in sys.argv[1])."""
    return spec_for([sys.executable, "-c", code, "{port}"], **overrides)


def pid_of(handle: EngineHandle) -> int:
    """The engine's pid from a process-runtime handle."""
    return int(handle.runtime_id.removeprefix("pid:"))


def pid_exists(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # the latter: reaped while we read
        return False
    return stat[stat.rfind(")") + 2] != "Z"


async def wait_for_log(runtime: ProcessRuntime, handle: EngineHandle, text: str) -> str:
    """Poll the engine's log until it contains `text`; returns the tail."""
    tail = ""

    async def check() -> bool:
        nonlocal tail
        tail = await runtime.logs_tail(handle, lines=200)
        return text in tail

    await eventually(check, f"engine log shows {text!r}")
    return tail


def test_placeholders_are_replaced_and_other_braces_pass_through() -> None:
    argv = ["serve", "--port", "{port}", "--host", "{host}", '{"temperature": 0.5}']
    assert expand_argv(argv, host="127.0.0.1", port=4321) == [
        "serve",
        "--port",
        "4321",
        "--host",
        "127.0.0.1",
        '{"temperature": 0.5}',
    ]
    assert expand_env({"URL": "http://{host}:{port}/v1"}, host="h", port=1) == {
        "URL": "http://h:1/v1"
    }


def test_a_launched_engine_answers_on_its_host_port_until_stopped(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        handle = await runtime.launch(http_server_spec())
        try:
            assert handle.host == "127.0.0.1"
            assert handle.runtime_id == f"pid:{pid_of(handle)}"
            assert await runtime.is_running(handle)
            assert handle in await runtime.list_engines()

            async def answers() -> bool:
                return await http_status(handle.host, handle.port) == 200

            await eventually(answers, "the engine answers HTTP 200")
        finally:
            await runtime.stop(handle, timeout_s=10)
        assert not await runtime.is_running(handle)
        assert not pid_exists(pid_of(handle))
        assert await http_status(handle.host, handle.port) is None
        assert await runtime.list_engines() == []
        await runtime.close()

    run(scenario())


def test_an_engine_killed_behind_our_back_is_not_running(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        handle = await runtime.launch(http_server_spec())
        try:
            os.killpg(pid_of(handle), signal.SIGKILL)

            async def stopped() -> bool:
                return not await runtime.is_running(handle)

            await eventually(stopped, "is_running turns False")
            assert await runtime.list_engines() == []
        finally:
            await runtime.stop(handle)

    run(scenario())


def test_a_new_runtime_on_the_same_data_dir_adopts_a_running_engine(tmp_path: Path) -> None:
    async def scenario() -> None:
        first = ProcessRuntime(tmp_path)
        handle = await first.launch(http_server_spec())
        await first.close()  # DGXMM went away; the engine did not
        second = ProcessRuntime(tmp_path)
        try:
            assert await second.list_engines() == [handle]
            assert await second.is_running(handle)

            async def answers() -> bool:
                return await http_status(handle.host, handle.port) == 200

            await eventually(answers, "the adopted engine answers HTTP 200")
        finally:
            await second.stop(handle, timeout_s=10)
        assert not pid_exists(pid_of(handle))
        assert await ProcessRuntime(tmp_path).list_engines() == []

    run(scenario())


def test_an_engine_launched_but_never_recorded_is_stopped_when_a_runtime_looks(
    tmp_path: Path,
) -> None:
    # DGXMM killed between starting an engine and recording it: the state file forgets it, but
    # its environment still says whose it is.
    async def scenario() -> None:
        first = ProcessRuntime(tmp_path)
        handle = await first.launch(http_server_spec())
        await first.close()
        first.state_path.write_bytes(msgspec.json.encode({"version": 1, "engines": []}))
        pid = pid_of(handle)
        other_dir = tmp_path / "other"
        assert await ProcessRuntime(other_dir).list_engines() == []
        assert pid_exists(pid), "another data dir's runtime leaves it alone"
        assert await ProcessRuntime(tmp_path).list_engines() == []

        async def gone() -> bool:
            return not pid_exists(pid)

        await eventually(gone, "the unrecorded engine is stopped")

    run(scenario())


def test_a_recorded_pid_that_now_belongs_to_another_process_is_not_adopted(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        # Our own pid stands for a reused pid: alive, but another start time and command line.
        record = {
            "deployment_id": "ghost",
            "pid": os.getpid(),
            "port": 1,
            "start_ticks": 1,
            "argv": ["vllm", "serve", "m"],
            "log_path": str(tmp_path / "ghost.log"),
        }
        runtime.state_path.write_bytes(msgspec.json.encode({"version": 1, "engines": [record]}))
        assert await runtime.list_engines() == []
        assert b"ghost" not in runtime.state_path.read_bytes()

    run(scenario())


def test_a_failing_engines_log_tail_is_readable(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "print('loading model', flush=True)\n"
        "sys.stderr.write('fatal: model not found: nope\\n')\n"
        "sys.exit(3)\n"
    )

    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        handle = await runtime.launch(script_spec(code))

        async def exited() -> bool:
            return not await runtime.is_running(handle)

        await eventually(exited, "the failing engine exits")
        tail = await runtime.logs_tail(handle, lines=5)
        assert tail.splitlines() == ["loading model", "fatal: model not found: nope"]
        assert await runtime.logs_tail(handle, lines=1) == "fatal: model not found: nope"
        await runtime.stop(handle)
        assert "fatal" in await runtime.logs_tail(handle)  # kept after stop, for the reason

    run(scenario())


def test_stop_kills_an_engine_that_ignores_sigterm_after_the_timeout(tmp_path: Path) -> None:
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('stubborn', flush=True)\n"
        "time.sleep(120)\n"
    )

    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        handle = await runtime.launch(script_spec(code))
        await wait_for_log(runtime, handle, "stubborn")
        started = time.monotonic()
        await runtime.stop(handle, timeout_s=0.5)
        elapsed = time.monotonic() - started
        assert not pid_exists(pid_of(handle))
        assert 0.4 <= elapsed < 5.0

    run(scenario())


def test_stop_also_ends_the_workers_the_engine_forked(tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print('worker', worker.pid, flush=True)\n"
        "time.sleep(120)\n"
    )

    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        handle = await runtime.launch(script_spec(code))
        tail = await wait_for_log(runtime, handle, "worker ")
        worker_pid = int(tail.split("worker ")[1].split()[0])
        assert pid_exists(worker_pid)
        await runtime.stop(handle, timeout_s=5)

        async def worker_gone() -> bool:
            return not pid_exists(worker_pid)

        await eventually(worker_gone, "the forked worker is gone too")

    run(scenario())


def test_stop_is_idempotent(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        handle = await runtime.launch(http_server_spec())
        await runtime.stop(handle)
        await runtime.stop(handle)
        assert not await runtime.is_running(handle)

    run(scenario())


def test_a_second_launch_for_a_running_deployment_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        spec = http_server_spec()
        handle = await runtime.launch(spec)
        try:
            with pytest.raises(RuntimeFailure, match="already has a running engine"):
                await runtime.launch(spec)
        finally:
            await runtime.stop(handle)

    run(scenario())


def test_a_missing_program_is_a_runtime_failure(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        with pytest.raises(RuntimeFailure, match="cannot run '/nonexistent/engine'"):
            await runtime.launch(spec_for(["/nonexistent/engine", "--port", "{port}"]))
        assert await runtime.list_engines() == []

    run(scenario())


def test_env_placeholders_reach_the_engine(tmp_path: Path) -> None:
    code = (
        "import os; print('url', os.environ['ENGINE_URL'], flush=True); import time; time.sleep(60)"
    )

    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        spec = script_spec(code, env={"ENGINE_URL": "http://{host}:{port}/v1"})
        handle = await runtime.launch(spec)
        try:
            tail = await wait_for_log(runtime, handle, "url ")
            assert f"url http://127.0.0.1:{handle.port}/v1" in tail
        finally:
            await runtime.stop(handle)

    run(scenario())


def test_the_engine_log_is_trimmed_to_its_cap(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "for i in range(2000): print('line', i, 'x' * 40)\n"
        "print('last line', flush=True)\n"
        "time.sleep(60)\n"
    )

    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path, max_log_bytes=20_000, keep_log_bytes=2_000)
        handle = await runtime.launch(script_spec(code))
        try:
            await wait_for_log(runtime, handle, "last line")
            # Trimmed to (about) its last 2000 bytes whenever it used more than 20000 bytes
            # of disk; nothing the engine wrote meanwhile was lost (the last line is there).
            st = runtime.log_path(handle.deployment_id).stat()
            assert st.st_blocks * 512 <= 20_000
            assert st.st_size > 100_000  # trimmed in place: the offsets are all still there
            tail = await runtime.logs_tail(handle, lines=2)
            assert tail.splitlines() == ["line 1999 " + "x" * 40, "last line"]
        finally:
            await runtime.stop(handle)

    run(scenario())


def test_without_a_port_placeholder_the_engine_listens_on_the_specs_port(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        port = free_port()
        argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
        handle = await runtime.launch(spec_for(argv, port=port))
        try:
            assert handle.port == port

            async def answers() -> bool:
                return await http_status(handle.host, port) == 200

            await eventually(answers, "the engine answers on the port the spec chose")
        finally:
            await runtime.stop(handle)

    run(scenario())


def test_a_fixed_port_already_in_use_is_a_runtime_failure(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            argv = [sys.executable, "-m", "http.server", str(port)]
            with pytest.raises(RuntimeFailure, match=f"port {port} on 127.0.0.1 is in use"):
                await runtime.launch(spec_for(argv, port=port))
        assert await runtime.list_engines() == []

    run(scenario())


def test_the_simulated_engine_from_its_adapter_serves_and_stops(tmp_path: Path) -> None:
    settings = EngineSettings(sim_python=sys.executable)
    spec = launch_spec(
        "sim-1", "m", "sim", "sim-model", 0, ["--startup-delay", "0.2"], settings=settings
    )

    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        handle = await runtime.launch(spec)
        try:

            async def ready() -> bool:
                return await http_status(handle.host, handle.port, "/v1/models") == 200

            await eventually(ready, "the simulated engine serves /v1/models")
        finally:
            await runtime.stop(handle, timeout_s=10)
        assert not pid_exists(pid_of(handle))

    run(scenario())


def test_a_simulated_engine_failing_at_start_leaves_its_reason_in_the_log(tmp_path: Path) -> None:
    settings = EngineSettings(sim_python=sys.executable)
    args = ["--fail-at-start", "CUDA out of memory (simulated)"]
    spec = launch_spec("sim-2", "m", "sim", "sim-model", 0, args, settings=settings)

    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path)
        handle = await runtime.launch(spec)

        async def exited() -> bool:
            return not await runtime.is_running(handle)

        await eventually(exited, "the failing simulated engine exits")
        assert "CUDA out of memory (simulated)" in await runtime.logs_tail(handle)
        await runtime.stop(handle)

    run(scenario())
