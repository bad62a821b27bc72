"""`dgxmm tune` recommends only what is safe and says what it trades: a point that leaves a
model unable to start or fails a request the recorded box served is shown infeasible with
its reason and never recommended; one unit per figure; names as the operator wrote them;
follow-up commands that run as printed (issue 45; issue 46, stumble 10)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from simulations.tune import Goal, tune, unable_to_start
from simulations.whatif import load_history, parse_overrides
from tests.gateway_support import run
from tests.test_whatif import MODELS
from tests.test_whatif_fates import DEMO
from tests.whatif_support import write_log


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tune") / "log.db"
    run(write_log(path, DEMO, hours=1.0, usable_gib=48, defaults={"ondemand_make_room_after_s": 0}))
    return path


@pytest.fixture(scope="module")
def three_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two models that fit together beside a third that does not (tests/test_whatif.py)."""
    path = tmp_path_factory.mktemp("tune") / "three.db"
    run(write_log(path, MODELS, hours=1.0, usable_gib=100, defaults={}))
    return path


def _tune(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dgxmm", "tune", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_an_always_on_set_that_leaves_a_model_unable_to_start_is_never_recommended(
    demo_log: Path,
) -> None:
    done = _tune("--db", str(demo_log), "--json", "--goal", "p90<=60,cold_starts")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    pinned = [p for p in out["points"] if p["changes"] == ["demo-chat.mode=always_on"]]
    assert len(pinned) == 1
    assert not pinned[0]["feasible"] and pinned[0]["figures"] is None
    assert "demo-large (40 GiB) could never start" in pinned[0]["infeasible"]
    best = out["recommended"]
    assert best is not None and best["feasible"] and best["figures"]["fails_served"] == 0
    assert "demo-chat.mode=always_on" not in best["changes"]
    # Points that fail requests the recorded box served would have cost fewer cold starts:
    # the old objective would have taken one of them.
    unsafe = [p for p in out["points"] if p["figures"] and not p["feasible"]]
    assert unsafe and all("requests the recorded box served" in p["infeasible"] for p in unsafe)
    cheapest = min(p["figures"]["cold_starts_per_hour"] for p in unsafe)
    assert cheapest < best["figures"]["cold_starts_per_hour"]
    assert not any(p["pareto"] for p in out["points"] if not p["feasible"])


def test_the_check_that_a_model_can_start_counts_the_always_on_models_memory(
    demo_log: Path,
) -> None:
    history = run(load_history(demo_log))
    assert unable_to_start(history, {}) == ""
    pinned = parse_overrides(history, ["demo-chat.mode=always_on"])
    assert unable_to_start(history, pinned).startswith("demo-large (40 GiB) could never start")
    both = parse_overrides(history, ["demo-chat.mode=always_on", "demo-large.mode=always_on"])
    assert unable_to_start(history, both) == "the always-on models need 52 GiB of 48"


def test_the_text_says_what_it_trades_in_one_unit_with_the_operator_s_names(
    three_log: Path,
) -> None:
    done = _tune("--db", str(three_log), "--goal", "p99<=60,cold_starts")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "room seed" not in text and "idle as is" not in text
    # No deployment id (write_log's are d0, d1, d2), only names.
    assert not re.search(r"\bd[0-9]\b", text), text
    assert "as now:" in text and "recommended:" in text
    for line in text.splitlines():
        if line.startswith(("as now:", "recommended:")):
            assert "cold starts/h" in line and "idle GiB-hours/h" in line
            assert "worst model's p90" in line
    assert "trade-off (cold starts per hour against p99 wait" in text
    assert "saves:" in text and "costs:" in text
    assert "[infeasible: " in text


def test_the_follow_up_commands_run_as_printed(three_log: Path) -> None:
    done = _tune("--db", str(three_log), "--goal", "p99<=60,cold_starts")
    assert done.returncode == 0, done.stderr
    see = [line for line in done.stdout.splitlines() if line.strip().startswith("to see it:")]
    apply = [line for line in done.stdout.splitlines() if line.strip().startswith("to apply:")]
    assert len(see) == 1 and len(apply) == 1, done.stdout
    argv = shlex.split(see[0].split(":", 1)[1])
    assert argv[:4] == ["dgxmm", "whatif", "--db", str(three_log)]
    shown = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr
    assert "--db" in apply[0] and "--apply" in apply[0]


def test_a_goal_no_safe_point_meets_recommends_nothing(demo_log: Path) -> None:
    history = run(load_history(demo_log))
    result = run(tune(history, Goal(bound="p90", limit_s=0.0), workers=1), timeout=300)
    assert all(not (p.feasible and p.meets) for p in result.points)
    assert result.recommended is None


def test_apply_asks_first_and_without_a_terminal_to_ask_on_changes_nothing(
    three_log: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dgxmm", "tune", "--db", str(three_log), "--goal",
         "p99<=60,cold_starts", "--apply", "--url", "http://127.0.0.1:9", "--token", "x"],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "to apply:\n  ondemand_make_room_after_s=0\n" in done.stdout
    assert "add --yes" in done.stderr and "cannot reach" not in done.stderr
