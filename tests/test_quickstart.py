"""docs/quickstart.md, run: its code blocks in order, as one shell script, against a demo.

The first block (`make demo`) is the demo itself, which this test starts the way the
Makefile does (`dgxmm serve --demo`, with the LiteLLM it puts in front), on free ports in a
directory laid out as a clone (its `.venv` and `.venv-litellm` linked); the one line that names
the default ports is given the demo's.  Then it does what the page tells the reader to do
before the second terminal: wait for the line that says LiteLLM answers.  Python blocks run
with the LiteLLM venv's Python, which has the `openai` package, as the page says.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.litellm_support import litellm_bin
from tests.serve_support import PROJECT, litellm_ready, start_demo, stop_demo

pytestmark = pytest.mark.litellm

DOC = PROJECT / "docs" / "quickstart.md"
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
PORTS = "export ADMIN=http://127.0.0.1:8400 GATEWAY=http://127.0.0.1:8401 LITELLM_PORT=4000"
DEADLINE_S = 60.0  # for the demo's banner
LITELLM_READY_S = 240.0  # for its LiteLLM to answer (13-40 s measured on a loaded box)
SCRIPT_S = 400  # for the quickstart's commands (they swap models through LiteLLM, replay)
# pytest's own limit (300 s by default, pyproject.toml) must not stop the test before its
# deadlines do: the demo's start, LiteLLM's, the script, and stopping the demo (30 s).
TEST_TIMEOUT_S = DEADLINE_S + LITELLM_READY_S + SCRIPT_S + 60


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
    proc, banner = start_demo(clone, DEADLINE_S, env=env, litellm=True)
    try:
        admin = re.search(r"web UI and API : (http://\S+)/dgxmm/", banner)
        gateway = re.search(r"gateway        : (http://\S+)/d/", banner)
        litellm = re.search(r"LiteLLM in front: starting on http://127\.0\.0\.1:(\d+)/v1", banner)
        assert admin and gateway and litellm, banner
        ready = litellm_ready(proc, LITELLM_READY_S)  # "Wait for the line that says ..."
        shown = re.search(r"^```text\n(LiteLLM is ready .*)\n```$", DOC.read_text(), re.M)
        assert shown is not None
        assert re.sub(r"\d+", "N", shown.group(1)) == re.sub(r"\d+", "N", ready.strip())
        text = script(admin.group(1), gateway.group(1), int(litellm.group(1)))
        (clone / "quickstart.sh").write_text(text)
        run_env = {**os.environ, **env, "QUICKSTART_PYTHON": str(program.parent / "python")}
        for name in ("LITELLM_MASTER_KEY", "DGXMM_CONFIG", "OPENAI_API_KEY", "OPENAI_BASE_URL"):
            run_env.pop(name, None)
        done = subprocess.run(
            ["bash", "quickstart.sh"],
            cwd=clone, env=run_env, capture_output=True, text=True, timeout=SCRIPT_S,
            check=False, start_new_session=True,
        )  # fmt: skip
        log = clone / "dgxmm-data" / "litellm" / "litellm.log"
        tail = log.read_text()[-3000:] if log.exists() else ""
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\nLiteLLM:\n{tail}"
        out = done.stdout
        (clone / "quickstart.out").write_text(out)
        assert "demo-chat" in out and "demo-large" in out  # dgxmm ps
        # The page says so: at the first start demo-chat runs already, demo-large sleeps.
        assert re.search(r"^demo-chat .* on demand  Ready ", out, re.M), out
        assert re.search(r"^demo-large .* on demand  Sleeping", out, re.M), out
        assert "demo-chat answered after" in out  # the swap, through LiteLLM
        assert "left the queue: served" in out  # replay --request, of the swap
        assert "demo-large       Put to sleep to make room for demo-chat" in out
        assert "reason=make_room for=demo-chat" in out  # audit
        assert '"object":"chat.completion"' in out.replace(" ", "")  # DGXMM alone
        assert "created my-sim" in out  # the API from a script
    finally:
        stop_demo(proc)
