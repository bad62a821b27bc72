"""Which DGXMM a command works on: `--config`, then `DGXMM_CONFIG`, then the current directory,
then the one DGXMM this user runs; said on stderr, never guessed (issue 46, stumbles 2 and 7).

The CLI used to answer from whichever DGXMM the user had started last; `replay`, `audit` and
`whatif` run elsewhere failed with "dgxmm-data/dgxmm.db: no such file"; and a relative
`data_dir` meant the directory `serve` started in to `serve`, and the directory of the
command to every other command.  These run real `dgxmm serve` processes, each registered in
a state directory of the test's own.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from dgxmm.where import Choice, Served, WhereError, choose
from tests.serve_support import PROJECT

DEADLINE_S = 60.0

CONFIG = """
[server]
data_dir = "data"
admin_port = 0
gateway_port = 0

[runtime]
kind = "process"

[memory]
total_gib = 8
reserve_gib = 0
watchdog_threshold_gib = 0
"""


class Server:
    """`dgxmm serve --config <box>/dgxmm.toml` run from another directory, as a user would."""

    def __init__(self, box: Path, state: Path, cwd: Path) -> None:
        box.mkdir(parents=True, exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        self.config = box / "dgxmm.toml"
        self.config.write_text(CONFIG, encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dgxmm.cli", "serve", "--config", str(self.config)],
            cwd=cwd, env=environment(state), stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        banner = ""
        deadline = time.monotonic() + DEADLINE_S
        while "  runtime" not in banner:
            assert time.monotonic() < deadline, banner
            with contextlib.suppress(queue.Empty):
                line = lines.get(timeout=1.0)
                assert line is not None, f"dgxmm exited: {banner}"
                banner += line
        self.banner = banner

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=DEADLINE_S) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    with contextlib.suppress(Exception):
        for line in stream:
            lines.put(line)
    lines.put(None)


def environment(state: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "XDG_STATE_HOME": str(state), **extra}
    env.pop("DGXMM_CONFIG", None)
    env.pop("DGXMM_URL", None)
    env.update(extra)
    return env


def cli(cwd: Path, state: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`dgxmm ARGS` run in `cwd` as the user whose state directory is `state`."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "dgxmm", *args], capture_output=True, text=True, cwd=cwd,
        env=environment(state, **env), timeout=DEADLINE_S, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path, Path]]:
    """One DGXMM whose config says `data_dir = "data"`, started from another directory:
    (it, its box directory, the state directory it registered in)."""
    root = tmp_path_factory.mktemp("resolution")
    state = root / "state"
    server = Server(root / "box", state, root / "started-here")
    try:
        yield server, root / "box", state
    finally:
        server.stop()


# --- the order, decided ---------------------------------------------------------------------

ONE = Served(pid=101, data_dir="/srv/a/data", db="/srv/a/data/dgxmm.db", config="/srv/a/d.toml")
TWO = Served(pid=202, data_dir="/srv/b/data", db="/srv/b/data/dgxmm.db")


def test_the_flag_comes_first_then_the_environment_then_the_current_directory() -> None:
    def chosen(flag: str | None, env: str | None) -> Choice:
        return choose(flag=flag, env=env, here=True, running=[ONE], creates=False)

    assert chosen("a.toml", "b.toml") == Choice("a.toml", None, "--config a.toml")
    assert chosen(None, "b.toml") == Choice("b.toml", None, "DGXMM_CONFIG=b.toml")
    assert chosen(None, None) == Choice(None, None, "the current directory")


def test_the_one_running_server_is_taken_only_when_nothing_else_is_given() -> None:
    choice = choose(flag=None, env=None, here=False, running=[ONE], creates=False)
    assert choice.served == ONE
    assert choice.why == "the one DGXMM this user runs: pid 101, --config /srv/a/d.toml"


def test_two_running_servers_are_an_error_that_names_both() -> None:
    with pytest.raises(WhereError) as raised:
        choose(
            flag=None, env=None, here=False, running=[ONE, TWO], creates=False, other="--db FILE"
        )
    message = str(raised.value)
    assert "pid 101: /srv/a/data" in message and "pid 202: /srv/b/data" in message
    assert "--config FILE" in message and "--db FILE" in message


def test_a_command_that_creates_its_data_dir_takes_the_current_directory() -> None:
    choice = choose(flag=None, env=None, here=False, running=[ONE, TWO], creates=True)
    assert choice == Choice(None, None, "the current directory")


# --- real servers -----------------------------------------------------------------------------


def test_a_relative_data_dir_is_the_config_files_to_serve_and_to_ps(
    served: tuple[Server, Path, Path], tmp_path: Path
) -> None:
    server, box, state = served
    assert f"event log      : {box / 'data' / 'dgxmm.db'}\n" in server.banner
    done = cli(tmp_path / "elsewhere", state, "ps", "--config", str(box / "dgxmm.toml"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "no deployments\n"
    [line] = done.stderr.splitlines()
    assert re.fullmatch(
        rf"dgxmm: server http://127\.0\.0\.1:\d+ \(data dir {re.escape(str(box / 'data'))}; "
        rf"from --config {re.escape(str(box / 'dgxmm.toml'))}\)",
        line,
    ), line


def test_from_elsewhere_ps_and_the_log_commands_name_the_one_server_this_user_runs(
    served: tuple[Server, Path, Path], tmp_path: Path
) -> None:
    server, box, state = served
    why = f"from the one DGXMM this user runs: pid {server.proc.pid}, --config {box / 'dgxmm.toml'}"
    ps = cli(tmp_path, state, "ps")
    assert ps.returncode == 0, ps.stderr
    assert ps.stderr.endswith(f"(data dir {box / 'data'}; {why})\n"), ps.stderr
    for command in (["replay"], ["audit"], ["events"]):
        done = cli(tmp_path, state, *command)
        assert done.returncode == 0, (command, done.stderr)
        assert done.stderr.splitlines()[0] == f"dgxmm: data dir {box / 'data'} ({why})"
    assert str(box / "data" / "dgxmm.db") in cli(tmp_path, state, "replay").stdout


def test_two_servers_and_no_choice_is_an_error_that_names_both(
    served: tuple[Server, Path, Path], tmp_path: Path
) -> None:
    _, box, state = served
    second = Server(tmp_path / "box2", state, tmp_path / "started-there")
    try:
        for command in (["ps"], ["stop", "anything"], ["replay"], ["audit"]):
            done = cli(tmp_path / "elsewhere", state, *command)
            assert done.returncode == 2, (command, done)
            assert done.stdout == ""
            [line] = done.stderr.splitlines()
            assert "2 DGXMMs run as this user" in line, line
            assert str(box / "data") in line and str(tmp_path / "box2" / "data") in line, line
        chosen = cli(tmp_path / "elsewhere", state, "ps", "--config", str(second.config))
        assert chosen.returncode == 0, chosen.stderr
    finally:
        second.stop()


def test_the_current_directory_comes_before_the_running_server(
    served: tuple[Server, Path, Path], tmp_path: Path
) -> None:
    _, _, state = served
    (tmp_path / "dgxmm-data").mkdir()
    done = cli(tmp_path, state, "ps")
    assert done.returncode == 2
    first, second = done.stderr.splitlines()
    assert first.endswith(f"(data dir {tmp_path / 'dgxmm-data'}; from the current directory)")
    assert f"found no {tmp_path / 'dgxmm-data' / 'cli.json'}" in second


def test_dgxmm_config_comes_before_the_current_directory(
    served: tuple[Server, Path, Path], tmp_path: Path
) -> None:
    _, box, state = served
    (tmp_path / "dgxmm-data").mkdir()
    config = str(box / "dgxmm.toml")
    done = cli(tmp_path, state, "audit", DGXMM_CONFIG=config)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0] == (
        f"dgxmm: data dir {box / 'data'} (from DGXMM_CONFIG={config})"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["replay"],
        ["audit"],
        ["events"],
        ["whatif"],
        ["tune"],
        ["user", "list"],
        ["ps"],
        ["logs", "x"],
    ],
)
def test_with_nothing_to_find_a_command_says_what_to_give_not_no_such_file(
    tmp_path: Path, command: list[str]
) -> None:
    done = cli(tmp_path / "empty", tmp_path / "no-state", *command)
    assert done.returncode == 2, done
    [line] = done.stderr.splitlines()
    assert line.startswith("dgxmm: found no DGXMM: no dgxmm-data here and this user runs none;")
    assert "--config FILE" in line and "DGXMM_CONFIG" in line
    assert ("--url URL" if command[0] in ("ps", "logs") else "--db FILE") in line
    assert not (tmp_path / "empty" / "dgxmm-data").exists()


def test_a_file_named_on_the_command_line_is_used_without_a_line_about_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    done = cli(tmp_path, tmp_path / "no-state", "audit", "--db", str(missing))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"dgxmm: {missing}: no such file"]
