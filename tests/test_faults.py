"""Issue 13's eight findings, one test (or a few) each: faults leave DGXMM correct.

Real parts throughout: SQLite files (on a small tmpfs for the full disk), the process runtime
running simulated engines, the real gateway on loopback, real `dgxmm serve` processes for
the lock and SIGTERM.  Time-dependent actor logic runs on a virtual clock where it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.admission import Refused
from actors.controller import DeploymentSpec
from actors.deployment import Refusal
from actors.memory_broker import GIB
from actors.runtime import VirtualClock
from events import model as m
from gateway.app import Gateway
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour
from storage.eventlog import EventStore
from storage.lock import AlreadyRunning, InstanceLock
from tests.e2e_support import Box, pid_of
from tests.gateway_support import Client, request_once
from tests.serve_support import Serve, chat_body, sim_spec, write_config

DEADLINE_S = 45.0


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def until(
    check: Callable[[], Awaitable[bool]], what: str, deadline_s: float = DEADLINE_S
) -> None:
    """Poll `check` (real time) until it holds; fail naming `what` after the deadline."""
    deadline = time.monotonic() + deadline_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


async def open_box(root: Path, *, virtual: bool = False, **options: Any) -> Box:
    clock = VirtualClock(wall_start=time.time()) if virtual else None
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    return await Box.open(root, "process", clock, controller_options=options or None)


def names(recs: list[m.Recorded]) -> list[str]:
    return [type(r.event).__name__ for r in recs]


@contextlib.contextmanager
def small_disk(path: Path, size: str = "16m") -> Iterator[Path]:
    """A tmpfs of `size` at `path` (we run as root); unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Fill the disk to the last byte; the file to delete to free it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


# --- 1. one bad request or one bad event must not stop DGXMM ------------------------------


def test_engine_args_dgxmm_sets_are_refused_at_creation_with_422_and_nothing_is_recorded(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        box = await open_box(tmp_path)
        try:
            spec = DeploymentSpec(
                name="bad", engine="sim", model="m", memory_bytes=2 * GIB, args=["--port", "9999"]
            )
            with pytest.raises(Refusal) as refused:
                await box.controller.create(spec, "admin:test")
            assert (refused.value.status, refused.value.code) == (422, "invalid_args")
            assert refused.value.message.startswith("args: ")
            assert await box.store.read() == []
            assert box.broker.held_total() == 0
        finally:
            await box.close()

    run(main())


def test_switch_and_reconfigure_refuse_engine_args_dgxmm_sets_with_422_and_change_nothing(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        box = await open_box(tmp_path)
        try:
            dep = await box.create("good")
            await box.wait_for_state(dep, "ready")
            before = await box.events(dep)
            for kwargs in ({"args": ["--host", "0.0.0.0"]}, {"model": "x", "args": ["--port=1"]}):
                with pytest.raises(Refusal) as refused:
                    await box.controller.reconfigure(dep, "admin:test", **kwargs)
                assert (refused.value.status, refused.value.code) == (422, "invalid_args")
            assert await box.events(dep) == before
            assert box.state(dep) == "ready"
        finally:
            await box.close()

    run(main())


async def _seed_log(db: Path, streams: dict[str, list[m.AnyEvent]]) -> None:
    store = await EventStore.open(db)
    try:
        for dep_id, events in streams.items():
            for event in events:
                await store.append(m.deployment_stream(dep_id), [event], actor="system")
    finally:
        await store.close()


def _created(dep_id: str, name: str, args: list[str]) -> m.DeploymentCreated:
    return m.DeploymentCreated(
        deployment_id=dep_id,
        name=name,
        engine="sim",
        model=f"sim/{name}",
        memory_bytes=1 * GIB,
        mode="always_on",
        idle_timeout_s=None,
        role="model",
        args=args,
        image=None,
        gpu=False,
    )


def test_a_deployment_left_starting_with_bad_args_is_failed_at_start_up_and_the_rest_serves(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        await _seed_log(
            tmp_path / "dgxmm.db",
            {
                "bad": [
                    _created("bad", "bad", ["--port", "9999"]),
                    m.StartRequested(reason="admin"),
                ],
                "good": [_created("good", "good", [])],
            },
        )
        box = await open_box(tmp_path)  # before the fix: ActorCrashed on Adopt, exit 70
        try:
            box.owned.update({"bad", "good"})
            await box.wait_for_state("good", "ready")
            assert box.state("bad") == "failed"
            record = box.controller.record(box.actor("bad"))
            assert record.last_error is not None and "--host and --port" in record.last_error
            assert box.broker.reserved_for("bad") == 0
        finally:
            await box.close()

    run(main())


def test_an_illegal_event_in_the_log_fails_only_its_deployment_visibly_and_dgxmm_starts(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        await _seed_log(
            tmp_path / "dgxmm.db",
            {
                "odd": [
                    _created("odd", "odd", []),
                    m.StartRequested(reason="admin"),
                    m.EngineStarting(runtime_id="pid:1", host="127.0.0.1", port=1),
                    m.EngineReady(),
                    m.EngineAwake(),  # cannot happen while ready
                ],
                "good": [_created("good", "good", [])],
            },
        )
        box = await open_box(tmp_path)
        try:
            box.owned.update({"odd", "good"})
            await box.wait_for_state("good", "ready")
            assert box.state("odd") == "failed"
            error = box.controller.record(box.actor("odd")).last_error
            assert error is not None and "cannot be folded" in error and "EngineAwake" in error
            # The operator starts it again from its page; a restart folds the same log alike.
            await box.controller.start("odd", "admin:test")
            await box.wait_for_state("odd", "ready")
            await box.restart()
            assert box.state("odd") == "ready"
        finally:
            await box.close()

    run(main())


# --- 2. a failed log write changes nothing ------------------------------------------------


def test_a_stop_that_cannot_be_recorded_answers_503_and_the_model_keeps_serving(
    tmp_path: Path,
) -> None:
    async def main(disk: Path) -> None:
        box = await open_box(disk / "box")
        try:
            dep = await box.create("full")
            await box.wait_for_state(dep, "ready")
            filler = fill(disk)
            with pytest.raises(Refusal) as refused:
                await box.controller.stop(dep, "admin:test")  # before the fix: accepting=False
            assert (refused.value.status, refused.value.code) == (503, "storage_unavailable")
            with pytest.raises(Refusal) as refused:
                await box.controller.remove(dep, "admin:test")
            assert refused.value.status == 503
            assert box.state(dep) == "ready"
            lease = box.controller.try_acquire(dep)  # still serving, not Ready-but-dead
            assert lease is not None
            lease.release()
            filler.unlink()
            await box.controller.stop(dep, "admin:test")
            await box.wait_for_state(dep, "stopped")
            await box.controller.start(dep, "admin:test")
            await box.wait_for_state(dep, "ready")
        finally:
            await box.close()

    with small_disk(tmp_path / "disk") as disk:
        run(main(disk))


def test_an_idle_sleep_that_cannot_be_recorded_keeps_the_model_serving_until_the_disk_frees(
    tmp_path: Path,
) -> None:
    async def main(disk: Path) -> None:
        box = await open_box(disk / "box", virtual=True)
        clock = box.clock
        assert isinstance(clock, VirtualClock)
        try:
            dep = await box.create("sleepy", mode="on_demand")
            await box.wait_for_state(dep, "ready")
            box.actor(dep)  # idle timeout: the default 300 s
            filler = fill(disk)
            await clock.advance(301)
            assert box.state(dep) == "ready"
            lease = box.controller.try_acquire(dep)
            assert lease is not None
            lease.release()  # ends a request: the idle timer starts again
            filler.unlink()
            await clock.advance(316)
            await box.wait_for_state(dep, "stopped")
            assert "PutToSleep" in names(await box.events(dep))
        finally:
            await box.close()

    with small_disk(tmp_path / "disk") as disk:
        run(main(disk))


# --- 4. one DGXMM per log -----------------------------------------------------------------


def test_two_locks_on_one_data_dir_exclude_each_other_and_name_the_holder(tmp_path: Path) -> None:
    first = InstanceLock.for_log(tmp_path / "a.db", tmp_path)
    first.acquire()
    try:
        second = InstanceLock.for_log(tmp_path / "elsewhere" / "b.db", tmp_path)
        with pytest.raises(AlreadyRunning) as held:
            second.acquire()
        assert held.value.pid == os.getpid()
        assert not second.held
    finally:
        first.release()
    again = InstanceLock.for_log(tmp_path / "a.db", tmp_path)
    again.acquire()
    again.release()


def test_a_second_dgxmm_on_the_same_log_exits_2_naming_the_first_ones_pid_and_touches_nothing(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        first = Serve(tmp_path, write_config(tmp_path))
        await first.start()
        try:
            assert first.api is not None
            dep = (await first.api.ok("POST", "/dgxmm/api/deployments", sim_spec("lock-a"), 201))[
                "id"
            ]
            await until(lambda: _state_is(first, dep, "ready"), "lock-a is ready")
            before = len(await first.records())
            engines = first.live_engine_pids()
            second = first.spawn(stdout=subprocess.DEVNULL)
            _, err = await asyncio.to_thread(second.communicate, None, 60)
            assert second.returncode == 2
            lines = err.strip().splitlines()
            assert len(lines) == 1 and f"pid {first.proc.pid}" in lines[0], err  # type: ignore[union-attr]
            assert len(await first.records()) == before
            assert first.live_engine_pids() == engines
        finally:
            first.kill()
            first.kill_engines()

    run(main())


async def _state_is(serve: Serve, dep: str, state: str) -> bool:
    assert serve.api is not None
    reply = await serve.api.get(f"/dgxmm/api/deployments/{dep}")
    return reply.status == 200 and reply.json()["state"] == state


# --- 5. a stop is an intent that survives a crash -----------------------------------------


def test_a_stop_recorded_before_a_crash_is_completed_at_start_up_not_adopted(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        box = await open_box(tmp_path)
        try:
            dep = await box.create("stopme")
            await box.wait_for_state(dep, "ready")
            handle = box.actor(dep).engine_handle
            assert handle is not None
            # The crash window: the stop is recorded, the engine has not had its SIGTERM.
            await box.store.append(
                m.deployment_stream(dep),
                [m.StopRequested(reason="admin")],
                actor="admin:test",
                expected_version=box.actor(dep).state.version,
            )
            await box.restart()
            assert box.state(dep) == "stopped"
            assert names(await box.events(dep))[-2:] == ["StopRequested", "EngineStopped"]
            assert not box.engine_exists(handle.runtime_id)
            assert box.broker.held_total() == 0
        finally:
            await box.close()

    run(main())


# --- 6. liveness from the engine's own answers --------------------------------------------


def test_a_hung_engine_is_lost_after_the_health_window_and_restarted(tmp_path: Path) -> None:
    async def main() -> None:
        box = await open_box(
            tmp_path, virtual=True, health_failure_window_s=5.0, stop_timeout_s=1.0
        )
        clock = box.clock
        assert isinstance(clock, VirtualClock)
        try:
            dep = await box.create("hung")
            await box.wait_for_state(dep, "ready")
            handle = box.actor(dep).engine_handle
            assert handle is not None
            os.killpg(pid_of(handle), signal.SIGSTOP)
            _, lost = await box.wait_for_event(dep, m.EngineLost, deadline_s=60)
            assert "health check" in lost.reason
            await box.wait_for_state(dep, "ready")  # restarted at once
            assert box.actor(dep).engine_handle != handle
        finally:
            await box.close()

    run(main())


def test_a_refused_connection_marks_the_engine_lost_at_once_and_the_request_waits(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        box = await open_box(tmp_path, virtual=True)
        clock = box.clock
        assert isinstance(clock, VirtualClock)
        gateway = Gateway(box.controller)
        server = await gateway.serve("127.0.0.1", 0)
        try:
            dep = await box.create("refuser")
            await box.wait_for_state(dep, "ready")
            handle = box.actor(dep).engine_handle
            assert handle is not None
            box.kill_behind_the_back(handle)
            await until(lambda: _process_gone(handle.runtime_id, box), "the engine is gone")
            now = clock.now()
            task = asyncio.create_task(
                request_once(
                    server.port, "POST", f"/d/{dep}/v1/chat/completions", chat_body("sim/refuser")
                )
            )

            async def lost() -> bool:
                return "EngineLost" in names(await box.events(dep))

            await until(lost, "the engine is recorded lost")  # without the 5-s monitor
            assert clock.now() == now
            # The request never reached the engine: it waits for the restart (issue 34).
            deadline = time.monotonic() + DEADLINE_S
            while not task.done():
                assert time.monotonic() < deadline, "the request was not answered"
                await clock.advance(0.25)
                await asyncio.sleep(0.02)
            reply = task.result()
            assert reply.status == 200, reply.body
            assert names(await box.events(dep))[-4:] == [
                "EngineLost", "StartRequested", "EngineStarting", "EngineReady",
            ]  # fmt: skip
        finally:
            await gateway.shutdown(2.0)
            await box.close()

    run(main())


async def _process_gone(runtime_id: str, box: Box) -> bool:
    return not box.engine_exists(runtime_id)


# --- 7. SIGTERM -------------------------------------------------------------------------------


def _events(body: bytes) -> list[bytes]:
    return [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]


def test_sigterm_answers_every_waiting_request_and_ends_every_stream_explicitly(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        serve = Serve(tmp_path, write_config(tmp_path, total_gib=4, grace_s=1.0))
        await serve.start()
        try:
            api = serve.api
            assert api is not None
            fast = (
                await api.ok(
                    "POST",
                    "/dgxmm/api/deployments",
                    sim_spec("term-fast", args=["--token-delay", "0.5", "--tokens", "200"]),
                    201,
                )
            )["id"]
            slow = (
                await api.ok(
                    "POST",
                    "/dgxmm/api/deployments",
                    sim_spec("term-slow", mode="on_demand", gib=2, args=["--startup-delay", "120"]),
                    201,
                )
            )["id"]
            big = (
                await api.ok(
                    "POST",
                    "/dgxmm/api/deployments",
                    sim_spec("term-big", mode="on_demand", gib=2),
                    201,
                )
            )["id"]
            await until(lambda: _state_is(serve, fast, "ready"), "term-fast is ready")
            port = serve.gateway_port

            streaming = await Client.connect(port, serve.gateway_key)
            await streaming.send(
                "POST",
                f"/d/{fast}/v1/chat/completions",
                chat_body("sim/term-fast", stream=True, max_tokens=200),
            )
            assert (await streaming.head())[0] == 200
            await streaming.read_until(b"data: ")
            queued = await Client.connect(port, serve.gateway_key)
            await queued.send(
                "POST", f"/d/{big}/v1/chat/completions", chat_body("sim/term-big", stream=True)
            )
            assert (await queued.head())[0] == 200
            await queued.read_until(b"queued")
            waiting = asyncio.ensure_future(
                request_once(
                    port,
                    "POST",
                    f"/d/{slow}/v1/chat/completions",
                    chat_body("sim/term-slow"),
                    key=serve.gateway_key,
                )
            )

            async def slow_has_waiter() -> bool:
                reply = await api.get(f"/dgxmm/api/deployments/{slow}")
                return bool(reply.json()["waiting_for_start"])

            await until(slow_has_waiter, "a request waits for term-slow")
            code = await serve.terminate()
            assert code == 0
            answer = await asyncio.wait_for(waiting, 10)
            assert answer.status == 503
            assert json.loads(answer.body)["error"]["code"] == "ondemand_stopped"
            for client in (queued, streaming):
                rest = b""
                while (data := await asyncio.wait_for(client.chunk(), 10)) is not None:
                    rest += data  # None: the chunked terminator arrived
                events = _events(rest)
                assert events[-1] == b"data: [DONE]", rest[-300:]
                assert b'"error"' in events[-2], rest[-300:]
        finally:
            serve.kill()
            serve.kill_engines()

    run(main())


def test_sigterm_exits_even_when_stdout_and_stderr_are_closed(tmp_path: Path) -> None:
    async def main() -> None:
        serve = Serve(tmp_path, write_config(tmp_path))
        await serve.start(pump=False)
        proc = serve.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        try:
            proc.stdout.close()  # what `dgxmm serve | head` leaves after head exits
            proc.stderr.close()
            assert serve.api is not None
            await serve.api.ok("POST", "/dgxmm/api/deployments", sim_spec("pipe"), 201)  # logs
            assert await serve.terminate(30) == 0
        finally:
            serve.kill()
            serve.kill_engines()

    run(main())


# --- 8. a stopped always-on deployment stays stopped --------------------------------------


def test_a_request_does_not_start_an_always_on_deployment_an_administrator_stopped(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        h = await Harness.create(
            tmp_path / "log.db", behaviour=lambda spec: EngineBehaviour(startup_s=5)
        )
        try:
            dep = await h.deploy("keep", 10, mode="always_on")
            await h.advance(7)
            await h.controller.stop(dep, "admin:alice")
            await h.advance(1)
            with pytest.raises(Refused) as refused:
                h.controller.enqueue(dep, "r1")
            assert (refused.value.status, refused.value.code) == (503, "deployment_stopped")
            assert "stopped by an administrator" in refused.value.message
            await h.advance(30)
            assert h.state(dep) == "stopped"
        finally:
            await h.close()

    run(main())
