"""The CLI against the demo from any directory: `dgxmm serve` resolves its (relative) data
dir when it starts and leaves where it is for the CLI of the same user; when the CLI finds
no credentials, it names the file it looked for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve_support import PROJECT, start_demo, stop_demo

DEADLINE_S = 60.0


def cli(cwd: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`dgxmm ARGS` run in `cwd`, with no configuration, as the user whose state is `state`."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "XDG_STATE_HOME": str(state)}
    env.pop("DGXMM_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "dgxmm", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=DEADLINE_S, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    """The demo, started in its own directory: (that directory, the state home, banner)."""
    where = tmp_path_factory.mktemp("demo")
    state = tmp_path_factory.mktemp("state")
    proc, banner = start_demo(where, DEADLINE_S, env={"XDG_STATE_HOME": str(state)})
    try:
        yield where, state, banner
    finally:
        stop_demo(proc)


def test_the_banner_names_the_event_log_by_its_absolute_path(demo: tuple[Path, Path, str]) -> None:
    where, _, banner = demo
    found = re.search(r"event log      : (\S+)", banner)
    assert found is not None, banner
    assert found.group(1) == str(where.resolve() / "dgxmm-data" / "dgxmm.db")


def test_ps_works_against_the_demo_from_another_directory(
    demo: tuple[Path, Path, str], tmp_path: Path
) -> None:
    _, state, _ = demo
    done = cli(tmp_path, state, "ps")
    assert done.returncode == 0, done.stderr
    assert "demo-chat" in done.stdout and "demo-large" in done.stdout


def test_without_credentials_the_cli_names_the_file_it_looked_for(
    demo: tuple[Path, Path, str], tmp_path: Path
) -> None:
    _, _, banner = demo
    admin = re.search(r"web UI and API : (http://\S+)/dgxmm/", banner)
    assert admin is not None
    empty_state = tmp_path / "state"
    done = cli(tmp_path, empty_state, "ps", "--url", admin.group(1))
    assert done.returncode != 0
    assert str(tmp_path / "dgxmm-data" / "cli.json") in done.stderr, done.stderr
