"""docs/quickstart.md, run: its code blocks in order, as one shell script, against a demo.

The first block (`make demo`) is the demo itself, which this test starts the way the
Makefile does (`dgxmm serve --demo`), on free ports in a directory laid out as a clone (its
`.venv` and `.venv-litellm` linked); the one line that names the default ports is given the
demo's.  Python blocks run with the LiteLLM venv's Python, which has the `openai` package.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.browser_support import free_port
from tests.litellm_support import litellm_bin
from tests.serve_support import PROJECT, start_demo, stop_demo

pytestmark = pytest.mark.litellm

DOC = PROJECT / "docs" / "quickstart.md"
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
PORTS = "export ADMIN=http://127.0.0.1:8400 GATEWAY=http://127.0.0.1:8401 LITELLM_PORT=4000"
DEADLINE_S = 60.0  # for the demo to start
SCRIPT_S = 400  # for the quickstart's commands (they start LiteLLM, swap models, replay)
# pytest's own limit (300 s by default, pyproject.toml) must not stop the test before its
# deadlines do: the demo's start, the script, and stopping the demo (30 s) with LiteLLM.
TEST_TIMEOUT_S = DEADLINE_S + SCRIPT_S + 60


def blocks() -> list[tuple[str, str]]:
    """The page's code blocks: (language, text), in order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(DOC.read_text(encoding="utf-8"))]


def script(admin: str, gateway: str, litellm_port: int) -> str:
    """Every block after `make demo` as one bash script."""
    found = blocks()
    assert found[0] == ("sh", "make demo\n")
    assert sum(PORTS in text for _, text in found) == 1
    parts = ["set -euo pipefail"]
    for language, text in found[1:]:
        if language == "sh":
            ports = f"export ADMIN={admin} GATEWAY={gateway} LITELLM_PORT={litellm_port}"
            parts.append(text.replace(PORTS, ports))
        else:
            parts.append(f"\"$QUICKSTART_PYTHON\" - <<'PY'\n{text}PY")
    return "\n".join(parts) + "\n"


def test_the_makefile_demo_is_dgxmm_serve_demo() -> None:
    makefile = (PROJECT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo: venv\n\t\$\(VENV\)/bin/dgxmm serve --demo$", makefile, re.M)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_every_command_of_the_quickstart_runs_against_the_demo(tmp_path: Path) -> None:
    program = litellm_bin()
    if not program.exists() and not os.environ.get("CI"):  # in CI: a failure
        pytest.skip(f"the pinned LiteLLM is not installed ({program})")
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(PROJECT / ".venv")
    (clone / ".venv-litellm").symlink_to(program.parent.parent)
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    proc, banner = start_demo(clone, DEADLINE_S, env=env)
    litellm_port = free_port()
    try:
        admin = re.search(r"web UI and API : (http://\S+)/dgxmm/", banner)
        gateway = re.search(r"gateway        : (http://\S+)/d/", banner)
        assert admin and gateway, banner
        (clone / "quickstart.sh").write_text(script(admin.group(1), gateway.group(1), litellm_port))
        run_env = {**os.environ, **env, "QUICKSTART_PYTHON": str(program.parent / "python")}
        run_env.pop("LITELLM_MASTER_KEY", None)
        run_env.pop("DGXMM_CONFIG", None)
        done = subprocess.run(
            ["bash", "quickstart.sh"],
            cwd=clone, env=run_env, capture_output=True, text=True, timeout=SCRIPT_S,
            check=False, start_new_session=True,
        )  # fmt: skip
        log = (clone / "litellm.log").read_text() if (clone / "litellm.log").exists() else ""
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\nLiteLLM:\n{log[-3000:]}"
        out = done.stdout
        (clone / "quickstart.out").write_text(out)
        assert "demo-chat" in out and "demo-large" in out  # dgxmm ps
        assert "left the queue: served" in out  # replay --request, of the swap
        assert "demo-large       Put to sleep to make room for demo-chat" in out
        assert "reason=make_room for=demo-chat" in out  # audit
        assert "created my-sim" in out  # the API from a script
    finally:
        pid = clone / "litellm.pid"
        if pid.exists():  # the script stopped before its last LiteLLM step
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid.read_text()), signal.SIGTERM)
        stop_demo(proc)
