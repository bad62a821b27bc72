"""The file back-end's reload command (`dgxmm.litellm.reload`): coalesced, serialised, bounded.

The reloader's scheduling runs on the virtual clock against a fake LiteLLM whose workers take a
known time to boot after each command; the shell runner and `ConfigFileSync` with a command run
real processes, against the LiteLLM double, whose "reload" is the command copying the written
file to the one the double serves.  The whole path through a real LiteLLM under gunicorn is in
test_litellm_reload_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from actors.runtime import VirtualClock
from dgxmm.admin.metrics import litellm_families, render
from dgxmm.config import ConfigError, load_config
from dgxmm.litellm.entries import READY, Registration, desired_entries
from dgxmm.litellm.filesync import ConfigFileSync
from dgxmm.litellm.reload import (
    SETTLE_S,
    CommandReloader,
    ReloadFailed,
    run_shell,
    stop_task,
)
from tests.litellm_double import LiteLLMDouble

BOOT_S = 3.0  # the fake LiteLLM's new workers serve the file this long after the command
TIMEOUT_S = 20.0
KEY = "sk-" + secrets.token_hex(8)


class FakeLiteLLM:
    """Two workers that serve what they read, `BOOT_S` (then `stagger` more for the second)
    after the reload command ran; each look at the list reaches the workers in turn."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.file: Any = None  # what was last written
        self.workers: list[Any] = [None, None]  # what each worker serves
        self.runs: list[float] = []  # when each command ran (virtual seconds)
        self.booting = 0
        self.overlapped = False  # a command ran while the previous one's workers were booting
        self.fail_next = 0
        self.boots = True
        self.reads_when_booted = False  # the workers read the file as they finish booting
        self.stagger = 0.0
        self._turn = 0

    @property
    def serving(self) -> Any:
        """What every worker serves ("mixed" when they differ)."""
        first, second = self.workers
        return first if first is second else "mixed"

    @serving.setter
    def serving(self, value: Any) -> None:
        self.workers = [value, value]

    async def run(self, command: str, timeout_s: float) -> None:
        self.runs.append(self.clock.now())
        if self.fail_next:
            self.fail_next -= 1
            raise ReloadFailed("the reload command exited with 1: " + command)
        self.overlapped |= self.booting > 0
        self.booting = len(self.workers)
        read = self.file

        def booted(index: int) -> None:
            self.booting -= 1
            if self.boots:
                self.workers[index] = self.file if self.reads_when_booted else read

        for index in range(len(self.workers)):
            self.clock.call_later(BOOT_S + index * self.stagger, lambda i=index: booted(i))

    async def serves(self, wants: Any) -> bool:
        self._turn = (self._turn + 1) % len(self.workers)
        return any(self.workers[self._turn] is want for want in wants)


def reloader_for(fake: FakeLiteLLM) -> CommandReloader:
    return CommandReloader(
        "reload-litellm",
        timeout_s=TIMEOUT_S,
        serves=fake.serves,
        clock=fake.clock,
        run=fake.run,
    )


def write(fake: FakeLiteLLM, reloader: CommandReloader, name: str) -> Any:
    """A write of the file (a new list object each time), then the reload request."""
    fake.file = {"list": name}
    reloader.request(fake.file)
    return fake.file


def on_virtual_clock(body: Callable[[VirtualClock, FakeLiteLLM], Awaitable[None]]) -> None:
    async def main() -> None:
        clock = VirtualClock()
        await body(clock, FakeLiteLLM(clock))

    asyncio.run(main())


def test_writes_during_a_reload_share_the_next_one_and_reloads_never_overlap() -> None:
    async def body(clock: VirtualClock, fake: FakeLiteLLM) -> None:
        reloader = reloader_for(fake)
        try:
            write(fake, reloader, "a")
            await clock.advance(1.0)
            write(fake, reloader, "b")  # while a's workers boot
            await clock.advance(0.5)
            last = write(fake, reloader, "c")
            assert reloader.status().pending is True
            await clock.advance(10.0)
            assert fake.serving is last
            # One run for a, one for b and c together, the second only once a was served.
            # The second once a was seen served on every look for SETTLE_S.
            assert fake.runs == [0.0, pytest.approx(BOOT_S + SETTLE_S, abs=0.3)]
            assert fake.overlapped is False
            status = reloader.status()
            assert status.reloads == 2 and status.failures == 0 and status.pending is False
            # Write to first seen served: a at 0 -> 3 s; b at 1 (c rode along) -> 7.5 - 1 s.
            durations = [r.duration_s for r in status.recent]
            assert durations == [
                pytest.approx(BOOT_S, abs=0.3),
                pytest.approx(2 * BOOT_S + SETTLE_S - 1.0, abs=0.3),
            ]
            assert status.last_duration_s == durations[-1]
            assert status.durations_sum_s == pytest.approx(sum(durations))
        finally:
            await reloader.close()

    on_virtual_clock(body)


def test_a_failing_command_is_retried_with_backoff_and_reported_until_it_succeeds() -> None:
    async def body(clock: VirtualClock, fake: FakeLiteLLM) -> None:
        reloader = reloader_for(fake)
        fake.fail_next = 3
        try:
            last = write(fake, reloader, "a")
            await clock.advance(0.5)
            status = reloader.status()
            assert status.failing is True and status.pending is True
            assert status.last_error == "the reload command exited with 1: reload-litellm"
            # Backoff 1, 2, 4 s between the runs, then the fourth run works.
            await clock.advance(20.0)
            assert fake.runs == [0.0, 1.0, 3.0, 7.0]
            assert fake.serving is last
            status = reloader.status()
            assert status.failures == 3 and status.failing is False and status.reloads == 1
            assert status.last_error is not None  # kept, with its time, after the recovery
            assert status.recent[-1].attempts == 4
            assert status.recent[-1].duration_s == pytest.approx(7.0 + BOOT_S, abs=0.3)
        finally:
            await reloader.close()

    on_virtual_clock(body)


def test_a_list_not_served_in_time_fails_and_a_retry_first_looks_whether_it_is_served() -> None:
    async def body(clock: VirtualClock, fake: FakeLiteLLM) -> None:
        reloader = reloader_for(fake)
        fake.boots = False  # the command "works" but LiteLLM never reads the file
        try:
            last = write(fake, reloader, "a")
            await clock.advance(TIMEOUT_S + 0.5)
            status = reloader.status()
            assert status.failing is True and status.failures == 1
            assert "did not serve the new model list within 20 s" in (status.last_error or "")
            # LiteLLM is restarted another way meanwhile: the retry runs nothing.
            fake.serving = last
            await clock.advance(5.0)
            assert len(fake.runs) == 1
            status = reloader.status()
            assert status.reloads == 1 and status.failing is False and status.pending is False
        finally:
            await reloader.close()

    on_virtual_clock(body)


def test_a_failing_reload_never_delays_later_requests_and_the_newest_list_is_reloaded() -> None:
    async def body(clock: VirtualClock, fake: FakeLiteLLM) -> None:
        reloader = reloader_for(fake)
        fake.fail_next = 2
        try:
            write(fake, reloader, "a")
            await clock.advance(0.5)
            last = write(fake, reloader, "b")  # returns at once although the reloads fail
            await clock.advance(10.0)
            assert fake.serving is last
            assert fake.runs == [0.0, 1.0, 3.0]  # the retry after a failure takes the newest
            assert reloader.status().reloads == 1
        finally:
            await reloader.close()

    on_virtual_clock(body)


def test_workers_that_read_a_later_write_serve_it_after_one_more_reload() -> None:
    async def body(clock: VirtualClock, fake: FakeLiteLLM) -> None:
        reloader = reloader_for(fake)
        fake.reads_when_booted = True
        try:
            write(fake, reloader, "a")
            await clock.advance(1.0)
            last = write(fake, reloader, "b")  # before a's workers read the file
            await clock.advance(15.0)
            assert fake.serving is last
            # a's workers read b; one more reload (after they booted) so that all surely do.
            assert fake.runs == [0.0, pytest.approx(BOOT_S + SETTLE_S, abs=0.3)]
            assert fake.overlapped is False
            status = reloader.status()
            assert status.reloads == 2 and status.failures == 0 and status.pending is False
            later = write(fake, reloader, "c")  # its time is measured from its own write
            await clock.advance(10.0)
            assert fake.serving is later
            assert reloader.status().recent[-1].duration_s == pytest.approx(BOOT_S, abs=0.3)
        finally:
            await reloader.close()

    on_virtual_clock(body)


def test_workers_that_booted_on_either_side_of_a_write_are_made_to_agree() -> None:
    async def body(clock: VirtualClock, fake: FakeLiteLLM) -> None:
        reloader = reloader_for(fake)
        fake.reads_when_booted = True
        fake.stagger = 1.0  # the second worker reads the file a second after the first
        try:
            write(fake, reloader, "a")
            await clock.advance(BOOT_S + 0.5)
            last = write(fake, reloader, "b")  # between the two workers' reads
            await clock.advance(0.6)
            assert fake.workers[0] is not fake.workers[1]  # mixed: one serves a, one b
            await clock.advance(20.0)
            assert fake.serving is last  # both
            assert len(fake.runs) == 2 and fake.overlapped is False
            assert reloader.status().pending is False
        finally:
            await reloader.close()

    on_virtual_clock(body)


def test_a_file_written_before_dgxmm_started_is_reloaded_only_if_litellm_serves_another() -> None:
    async def body(clock: VirtualClock, fake: FakeLiteLLM) -> None:
        reloader = reloader_for(fake)
        try:
            fake.file = fake.serving = {"list": "old"}  # LiteLLM read the file as it is
            reloader.request(fake.file)
            await clock.advance(10.0)
            assert fake.runs == []
            status = reloader.status()
            assert status.reloads == 0 and status.pending is False
            fake.serving = {"list": "older"}  # a reload was lost (DGXMM stopped before it)
            reloader.request(fake.file)
            await clock.advance(10.0)
            assert fake.runs == [10.0] and fake.serving is fake.file
            assert reloader.status().reloads == 1
        finally:
            await reloader.close()

    on_virtual_clock(body)


def test_a_poller_that_swallows_a_cancellation_is_still_stopped() -> None:
    """As `asyncio.wait_for` in Python 3.11 may when a connection is refused as it is cancelled."""

    async def poller() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # swallowed: the loop goes on
            await asyncio.sleep(3600)
        for _ in range(100_000):  # polls "forever" (a bound, should it never be cancelled)
            await asyncio.sleep(0.05)

    async def main() -> None:
        task = asyncio.create_task(poller())
        await asyncio.sleep(0)
        async with asyncio.timeout(5.0):
            await stop_task(task)
        assert task.done()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------
# The shell runner (real processes)


def test_a_command_that_fails_is_reported_with_its_exit_code_and_output() -> None:
    with pytest.raises(ReloadFailed, match=r"exited with 3: .*\(no such pidfile\)"):
        asyncio.run(run_shell("echo no such pidfile >&2; exit 3", 10.0))


def test_a_command_that_hangs_is_killed_with_its_process_group_at_the_timeout(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "child.pid"
    command = f"sleep 60 & echo $! > {pidfile}; wait"
    started = time.monotonic()
    with pytest.raises(ReloadFailed, match=r"did not finish within 0.5 s \(killed\)"):
        asyncio.run(run_shell(command, 0.5))
    assert time.monotonic() - started < 5.0
    _wait_gone(int(pidfile.read_text()))


def test_a_command_running_when_dgxmm_stops_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"

    async def main() -> None:
        task = asyncio.create_task(run_shell(f"sleep 60 & echo $! > {pidfile}; wait", 60.0))
        async with asyncio.timeout(10.0):
            while not pidfile.exists() or not pidfile.read_text().strip():  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # poll interval; the timeout bounds the wait
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_gone(int(pidfile.read_text()))


def _wait_gone(child: int) -> None:
    """Wait until the command's child process has exited (gone or a zombie)."""
    deadline = time.monotonic() + 5.0
    while Path(f"/proc/{child}").exists() and _state(child) != "Z":
        assert time.monotonic() < deadline, f"the command's child {child} survived"
        time.sleep(0.02)  # poll interval; the deadline bounds the wait


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_a_command_that_succeeds_returns() -> None:
    asyncio.run(run_shell("true", 10.0))


# --------------------------------------------------------------------------------------------
# ConfigFileSync with a reload command, against the LiteLLM double


def _entries(*names: str) -> Any:
    regs = [
        Registration(
            deployment_id=n,
            model_name=f"model-{n}",
            served_model=f"org/{n}",
            mode="on_demand",
            state=READY,
            engine_url=None,
        )
        for n in names
    ]
    return desired_entries(regs, "http://127.0.0.1:8401", 900, stable=True)


def _real_clock() -> Any:
    from actors.runtime import SystemClock

    return SystemClock()


def test_each_write_runs_the_command_and_the_reload_time_runs_to_the_new_list_served(
    tmp_path: Path,
) -> None:
    written, served = tmp_path / "litellm.json", tmp_path / "served.json"
    served.write_text(json.dumps({"model_list": []}))
    runs = tmp_path / "runs"

    async def main() -> None:
        async with LiteLLMDouble(KEY, db_connected=False, config_path=served) as double:
            sync = ConfigFileSync(written, double.url, KEY, check_first_s=0.05, check_max_s=0.2)
            # The double serves served.json: the command is what makes it "reload".
            sync.use_reload_command(
                f"echo run >> {runs}; cp {written} {served}", 10.0, _real_clock()
            )
            try:
                assert sync.reload_status().mode == "command"
                await sync.sync(_entries("a"))
                await sync.wait_until_loaded(10.0)
                await _until(lambda: sync.reload_status().reloads == 1)
                await sync.sync(_entries("a", "b"))
                await sync.wait_until_loaded(10.0)
                await _until(lambda: sync.reload_status().reloads == 2)
                await sync.sync(_entries("a", "b"))  # unchanged: no write, no reload
                status = sync.reload_status()
                assert status.failures == 0 and status.pending is False
                assert all(0 <= r.duration_s < 10 for r in status.recent)
            finally:
                await sync.close()
        assert runs.read_text().splitlines() == ["run", "run"]

    asyncio.run(main())


def test_a_hanging_command_never_blocks_later_writes_and_is_reported(tmp_path: Path) -> None:
    written = tmp_path / "litellm.json"

    async def main() -> None:
        async with LiteLLMDouble(KEY, db_connected=False) as double:
            sync = ConfigFileSync(written, double.url, KEY)
            sync.use_reload_command("sleep 60", 0.3, _real_clock())
            try:
                async with asyncio.timeout(2.0):  # each sync only writes
                    await sync.sync(_entries("a"))
                    await sync.sync(_entries("a", "b"))
                    await sync.sync(_entries("b"))
                document = json.loads(written.read_text())
                assert [i["model_name"] for i in document["model_list"]] == ["model-b"]
                assert sync.load_status().config_writes == 3
                await _until(lambda: sync.reload_status().failing)
                status = sync.reload_status()
                assert status.failures >= 1 and status.reloads == 0 and status.pending
                assert "did not finish within 0.3 s (killed): sleep 60" in (status.last_error or "")
            finally:
                await sync.close()

    asyncio.run(main())


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 (a status, not an event)
            await asyncio.sleep(0.02)  # poll interval; the timeout bounds the wait


def test_without_a_command_the_mode_is_watch_and_loads_seen_are_reloads(tmp_path: Path) -> None:
    path = tmp_path / "litellm.json"

    async def main() -> None:
        async with LiteLLMDouble(KEY, db_connected=False, config_path=path) as double:
            sync = ConfigFileSync(path, double.url, KEY, check_first_s=0.05, check_max_s=0.2)
            try:
                await sync.sync(_entries("a"))
                await sync.wait_until_loaded(10.0)
                status = sync.reload_status()
                assert status.mode == "watch" and status.reloads == 1
            finally:
                await sync.close()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------
# Settings and /metrics


def test_metrics_show_the_reload_mode_count_time_and_failures() -> None:
    status = {
        "enabled": True,
        "ok": True,
        "backend": "file",
        "config_writes": 3,
        "loaded": True,
        "reload": {
            "mode": "command",
            "reloads": 2,
            "failures": 1,
            "failing": False,
            "last_duration_s": 4.5,
            "durations_sum_s": 8.0,
        },
    }
    text = render(litellm_families(status))
    assert 'dgxmm_litellm_reload_mode{mode="command"} 1' in text
    assert 'dgxmm_litellm_reload_mode{mode="watch"} 0' in text
    assert "dgxmm_litellm_reloads_total 2" in text
    assert "dgxmm_litellm_reload_seconds_total 8" in text
    assert "dgxmm_litellm_reload_failures_total 1" in text
    assert "dgxmm_litellm_reload_failing 0" in text
    assert "dgxmm_litellm_reload_last_seconds 4.5" in text


def test_a_reload_timeout_out_of_range_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dgxmm.toml"
    path.write_text('[litellm]\nreload_command = "true"\nreload_timeout_s = 0\n')
    with pytest.raises(ConfigError, match=r"litellm\.reload_timeout_s"):
        load_config(path)
    path.write_text('[litellm]\nreload_command = "systemctl reload litellm"\n')
    config = load_config(path)
    assert config.litellm.reload_command == "systemctl reload litellm"
    assert config.litellm.reload_timeout_s == 60.0
