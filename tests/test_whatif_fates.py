"""Every replayed request has a fate in every column of `dgxmm whatif` (served, refused,
timed out in the queue, stopped by an administrator), counted overall and per model, and a
column that fails a request the recorded box served is marked (issue 45)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulations.whatif import Report, load_history, measure_recorded, parse_overrides, simulate
from simulations.whatif_measure import recorded_outcome
from tests.gateway_support import run
from tests.whatif_support import Model, write_log

# The demo's box: 48 GiB usable, one always-on model of 4 GiB, an on-demand chat of 8 and a
# large model of 40.  Chat always on leaves 36 GiB for the large one: it can never start.
DEMO = [
    Model("demo-always", 4, 0.01, 1.0, mode="always_on"),
    Model("demo-chat", 8, 0.05, 2.0),
    Model("demo-large", 40, 0.004, 5.0),
]


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fates") / "log.db"
    run(write_log(path, DEMO, hours=1.0, usable_gib=48, defaults={"ondemand_make_room_after_s": 0}))
    return path


def _whatif(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dgxmm", "whatif", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _adds_up(report: Report) -> None:
    f = report.fates
    assert f.served + f.refused + f.timed_out + f.stopped == report.requests, report.label
    assert sum(m.total() for m in report.fates_per_model.values()) == report.requests
    assert sum(report.refused_by.values()) == f.refused


def test_an_always_on_set_that_leaves_a_model_unable_to_start_shows_its_requests_refused(
    demo_log: Path,
) -> None:
    done = _whatif("--db", str(demo_log), "--json", "--set", "demo-chat.mode=always_on")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    recorded, calibration, pinned = out["columns"]
    large = pinned["fates_per_model"]["demo-large"]
    asked = recorded["fates_per_model"]["demo-large"]["served"]
    assert asked > 0
    assert large == {"served": 0, "refused": asked, "timed_out": 0, "stopped": 0}
    assert pinned["refused_by"] == {"does_not_fit": asked}
    assert pinned["fates"]["refused"] == asked
    # The column is marked, with the count and the model; the others are not.
    assert pinned["fails_served"] == asked
    assert pinned["fails_served_models"] == ["demo-large"]
    assert recorded["fails_served"] == calibration["fails_served"] == 0
    assert [u["label"] for u in out["unsafe"]] == ["demo-chat.mode=always_on"]
    # A refused request has no wait: the large model's figure counts none.
    assert "demo-large" not in pinned["per_model"]


def test_the_text_table_counts_each_fate_and_marks_the_column(demo_log: Path) -> None:
    done = _whatif("--db", str(demo_log), "--set", "demo-chat.mode=always_on")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    head = next(line for line in lines if "recorded" in line and "calibration" in line)
    assert "! demo-chat.mode=always_on" in head
    rows = {line.split("  ")[0].strip(): line.split()[-3:] for line in lines if "  " in line}
    assert "served" in rows and "timed out in the queue" in rows
    assert "stopped by an administrator" in rows and "refused: does_not_fit" in rows
    refused = next(line for line in lines if line.startswith("demo-large refused"))
    assert refused.split()[-3:][:2] == ["0", "0"] and int(refused.split()[-1]) > 0
    warning = [line for line in lines if line.startswith("! demo-chat.mode=always_on:")]
    assert len(warning) == 1 and "(demo-large)" in warning[0], done.stdout


def test_a_model_that_can_never_fit_under_a_setting_has_its_requests_refused(
    tmp_path: Path,
) -> None:
    # Chat and coder always on hold 80 of 100 GiB: big (50) can never fit.
    models = [
        Model("chat", 40, 0.05, 2.0),
        Model("coder", 40, 0.02, 5.0),
        Model("big", 50, 0.01, 5.0),
    ]
    path = tmp_path / "log.db"

    async def main() -> Report:
        await write_log(path, models, hours=0.5, usable_gib=100, defaults={})
        history = await load_history(path)
        over = parse_overrides(history, ["chat.mode=always_on", "coder.mode=always_on"])
        return await simulate(history, over, label="both always on")

    report = run(main(), timeout=120)
    big = report.fates_per_model["big"]
    assert big.refused > 0 and big.served == big.timed_out == big.stopped == 0
    assert report.refused_by == {"does_not_fit": big.refused}
    assert report.fails_served == big.refused and report.fails_served_models == ["big"]
    _adds_up(report)


def test_queue_full_and_queue_timeout_are_counted_when_the_queue_is_small(tmp_path: Path) -> None:
    # Two models that do not fit together, asked in turn every 2 s, each start 20 s: with one
    # place in the queue and a 5 s deadline, requests are refused for a full queue and time out.
    models = [
        Model("one", 60, 0.5, 0.5, start_s=20.0),
        Model("two", 60, 0.5, 0.5, start_s=20.0),
    ]
    path = tmp_path / "log.db"

    async def main() -> Report:
        await write_log(path, models, hours=0.1, usable_gib=100, defaults={}, poisson=False)
        history = await load_history(path)
        over = parse_overrides(
            history,
            ["ondemand_make_room_after_s=0", "ondemand_max_queued=1", "ondemand_queue_timeout_s=5"],
        )
        return await simulate(history, over, label="small queue")

    report = run(main(), timeout=120)
    assert report.refused_by.get("ondemand_queue_full", 0) > 0
    assert report.queue_full == report.refused_by["ondemand_queue_full"]
    assert report.fates.timed_out > 0
    assert report.fates.timed_out == report.queue_timeouts
    assert report.fails_served == report.fates.refused + report.fates.timed_out
    assert sorted(report.fails_served_models) == ["one", "two"]
    _adds_up(report)


@pytest.mark.parametrize(
    ("traced", "left", "code"),
    [
        ("served", None, "served"),
        ("engine_error", None, "served"),
        ("client_gone", None, "served"),
        ("client_gone", "client_gone", "gave_up"),
        ("queue_full", None, "ondemand_queue_full"),
        ("queue_timeout", "timeout", "queue_timeout"),
        ("refused", "stopped", "stopped"),
        ("refused", "removed", "stopped"),
        ("refused", "start_failed", "start_failed"),
        ("refused", None, "refused"),
    ],
)
def test_a_recorded_request_s_fate_comes_from_its_trace_and_why_it_left_the_queue(
    traced: str, left: str | None, code: str
) -> None:
    assert recorded_outcome(traced, left) == code


# --- the property, over the real actors --------------------------------------------------------

MODEL = st.builds(
    Model,
    name=st.sampled_from(("a", "b", "c", "d")),
    gib=st.sampled_from((10, 30, 50, 70, 120)),
    rate_per_s=st.sampled_from((0.01, 0.05, 0.2)),
    service_s=st.sampled_from((0.5, 3.0, 20.0)),
    mode=st.sampled_from(("on_demand", "on_demand", "always_on")),
    start_s=st.sampled_from((None, 2.0, 15.0)),
)
SETTING = st.sampled_from(
    (
        "ondemand_make_room_after_s=0",
        "ondemand_make_room_after_s=30",
        "ondemand_max_queued=1",
        "ondemand_max_queued=3",
        "ondemand_queue_timeout_s=2",
        "ondemand_queue_timeout_s=20",
        "a.mode=always_on",
        "b.mode=always_on",
        "a.idle_timeout_s=60",
        "b.make_room_after_s=0",
    )
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    models=st.lists(MODEL, min_size=1, max_size=4, unique_by=lambda m: m.name),
    sets=st.lists(SETTING, max_size=3, unique=True),
    seed=st.integers(0, 1000),
)
def test_in_every_column_the_fates_add_up_to_the_requests(
    tmp_path_factory: pytest.TempPathFactory, models: list[Model], sets: list[str], seed: int
) -> None:
    path = tmp_path_factory.mktemp("prop") / "log.db"
    known = {m.name for m in models}
    wanted = [s for s in sets if "." not in s.split("=")[0] or s.split(".")[0] in known]

    async def main() -> list[Report]:
        await write_log(path, models, hours=0.1, usable_gib=100, seed=seed, defaults={})
        history = await load_history(path)
        over = parse_overrides(history, wanted)
        return [
            measure_recorded(history),
            await simulate(history, {}, label="calibration"),
            await simulate(history, over, label="alternative"),
        ]

    for report in run(main(), timeout=300):
        _adds_up(report)
