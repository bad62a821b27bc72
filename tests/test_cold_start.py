"""Cold-start phases, pure: milestones read from real engine log lines, a request's phases
cut contiguously from its wait, and the expected start time from a deployment's history."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.cold_start import watch_milestones
from events import model as m
from events.cold_start import (
    MILESTONES,
    PHASES,
    Milestone,
    StartMarks,
    Victim,
    last_mark,
    marks_of,
    median_recent,
    milestone_of,
    phase_total,
    request_phases,
    start_phases,
)

T0 = 1_767_225_600.0

# Lines as real vLLM releases print them (0.8 .. 0.11, API server and engine-core processes).
VLLM_LINES = [
    (
        "(EngineCore_DP0 pid=1944) INFO 09-24 20:53:01 [default_loader.py:267] "
        "Loading weights took 31.27 seconds",
        Milestone("weights_loaded", 31.27),
    ),
    (
        "(EngineCore_DP0 pid=1944) INFO 09-24 20:53:02 [gpu_model_runner.py:2392] "
        "Model loading took 14.46 GiB and 32.104587 seconds",
        Milestone("model_loaded", 32.104587),
    ),
    (
        "INFO 05-02 10:11:12 [gpu_model_runner.py:1595] Model loading took 0.5064 GiB memory "
        "and 1.618823 seconds",
        Milestone("model_loaded", 1.618823),
    ),
    (
        "(EngineCore_DP0 pid=1944) INFO 09-24 20:54:36 [core.py:218] init engine (profile, "
        "create kv cache, warmup model) took 216.57 seconds",
        Milestone("engine_initialized", 216.57),
    ),
    (
        "INFO 07-24 11:08:25 [core.py:194] init engine (profile, create kv cache, warmup "
        "model) took 33.27 seconds",
        Milestone("engine_initialized", 33.27),
    ),
    ("INFO 01-01 00:00:00 [core.py:90] init engine took 22.78 seconds",
     Milestone("engine_initialized", 22.78)),
    (
        "(APIServer pid=460954) INFO 12-18 06:01:05 [api_server.py:1945] Starting vLLM API "
        "server 0 on http://0.0.0.0:8080",
        Milestone("server_listening"),
    ),
    (
        "INFO 04-30 17:52:43 [api_server.py:1090] Starting vLLM API server on "
        "http://0.0.0.0:8000",
        Milestone("server_listening"),
    ),
]  # fmt: skip

# Lines vLLM prints that are no milestone.
VLLM_OTHER = [
    "INFO 09-24 20:52:30 [gpu_model_runner.py:2338] Starting to load model /models/gemma...",
    "INFO 09-24 20:53:40 [gpu_worker.py:298] Available KV cache memory: 2.67 GiB",
    "INFO 09-24 20:54:37 [loggers.py:142] Engine 000: vllm cache_config_info with "
    "initialization after num_gpu_blocks is: 14834",
    "INFO:     Application startup complete.",
    'INFO:     127.0.0.1:53412 - "GET /health HTTP/1.1" 200 OK',
]

# llama.cpp's llama-server as it starts: the build of scripts/build-llama-server (its lines
# copied from a run), and the older `main: ...` wording.
LLAMA_LINES = [
    ("0.06.195.211 I srv  llama_server: model loaded", Milestone("model_loaded")),
    (
        "0.06.195.793 I srv  llama_server: listening on http://127.0.0.1:18977",
        Milestone("server_listening"),
    ),
    ("main: model loaded", Milestone("model_loaded")),
    (
        "main: server is listening on http://127.0.0.1:8080 - starting the main loop",
        Milestone("server_listening"),
    ),
]
LLAMA_OTHER = [
    "0.00.026.817 I srv    load_model: loading model '/models/gemma3-270m-q4_k_m-1.0.0.gguf'",
    "0.06.193.048 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 512",
    "main: loading model",
    "srv    load_model: loading model '/models/gemma3-270m-q4_k_m.gguf'",
    "llama_model_loader: loaded meta data with 39 key-value pairs",
    "srv  update_slots: all slots are idle",
]


@pytest.mark.parametrize(
    ("engine", "line", "expected"),
    [("vllm", *case) for case in VLLM_LINES] + [("llamacpp", *case) for case in LLAMA_LINES],
)
def test_milestones_are_read_from_the_engine_s_log_lines(
    engine: str, line: str, expected: Milestone
) -> None:
    assert milestone_of(engine, line) == expected


@pytest.mark.parametrize(
    ("engine", "line"),
    [("vllm", line) for line in VLLM_OTHER] + [("llamacpp", line) for line in LLAMA_OTHER],
)
def test_the_engine_s_other_lines_are_no_milestone(engine: str, line: str) -> None:
    assert milestone_of(engine, line) is None


def test_an_engine_reads_only_its_own_milestones() -> None:
    assert milestone_of("llamacpp", VLLM_LINES[0][0]) is None
    assert milestone_of("sglang", VLLM_LINES[0][0]) is None
    assert milestone_of("vllm", LLAMA_LINES[0][0]) is None


def test_an_endless_line_is_no_milestone() -> None:
    assert milestone_of("vllm", "x" * 5000 + " Loading weights took 1.00 seconds") is None


def test_a_queued_request_behind_a_victim_sees_every_phase_in_order() -> None:
    start = StartMarks(
        requested_at=T0 + 2,
        launch_began_at=T0 + 5,
        launched_at=T0 + 5.5,
        milestones=[
            ("engine_initialized", T0 + 70),
            ("weights_loaded", T0 + 30),
            ("model_loaded", T0 + 31),
            ("server_listening", T0 + 71),
        ],
        ready_at=T0 + 72,
        victims=[Victim(deployment_id="d9", name="small", drain_s=2.9)],
    )
    phases = request_phases(T0, T0 + 72.5, queued=True, start=start)
    assert [p.name for p in phases] == list(PHASES)
    assert [round(p.seconds, 6) for p in phases] == [2, 3, 0.5, 24.5, 1, 39, 1, 1, 0.5]
    assert phases[1].detail == "small 2.9 s"
    assert math.isclose(phase_total(phases), 72.5)


def test_a_request_that_joins_a_start_under_way_begins_in_the_phase_of_that_moment() -> None:
    start = StartMarks(
        requested_at=T0,
        launched_at=T0 + 1,
        milestones=[("model_loaded", T0 + 3)],
        ready_at=T0 + 4,
    )
    phases = request_phases(T0 + 2, T0 + 4.25, queued=False, start=start)
    assert [(p.name, p.seconds) for p in phases] == [
        ("loading_model", 1.0),
        ("ready", 1.0),
        ("first_byte", 0.25),
    ]


def test_without_victims_or_milestones_the_launch_runs_from_the_request_to_the_process() -> None:
    start = StartMarks(requested_at=T0 + 0.01, launched_at=T0 + 0.2, ready_at=T0 + 1.2)
    phases = request_phases(T0, T0 + 1.3, queued=False, start=start)
    assert [p.name for p in phases] == ["launch", "ready", "first_byte"]
    assert math.isclose(phases[0].seconds, 0.2, abs_tol=1e-6)


def test_a_start_s_own_phases_end_at_ready() -> None:
    start = StartMarks(requested_at=T0, launched_at=T0 + 1, ready_at=T0 + 9)
    assert [(p.name, p.seconds) for p in start_phases(start)] == [("launch", 1.0), ("ready", 8.0)]
    assert start_phases(StartMarks()) == []


moments = st.one_of(st.none(), st.floats(min_value=-50, max_value=400, allow_nan=False))


@given(
    arrival=st.floats(min_value=0, max_value=100, allow_nan=False),
    wait=st.floats(min_value=0, max_value=300, allow_nan=False),
    queued=st.booleans(),
    requested=moments,
    launch_began=moments,
    launched=moments,
    ready=moments,
    milestone_at=st.lists(moments, min_size=len(MILESTONES), max_size=len(MILESTONES)),
    victims=st.integers(min_value=0, max_value=2),
)
def test_phases_are_contiguous_never_negative_and_add_up_to_the_wait(
    arrival: float,
    wait: float,
    queued: bool,
    requested: float | None,
    launch_began: float | None,
    launched: float | None,
    ready: float | None,
    milestone_at: list[float | None],
    victims: int,
) -> None:
    start = StartMarks(
        requested_at=requested,
        launch_began_at=launch_began,
        launched_at=launched,
        milestones=[
            (n, at) for n, at in zip(MILESTONES, milestone_at, strict=True) if at is not None
        ],
        ready_at=ready,
        victims=[Victim(deployment_id=f"v{i}", name=f"v{i}", drain_s=1.0) for i in range(victims)],
    )
    phases = request_phases(T0 + arrival, T0 + arrival + wait, queued=queued, start=start)
    assert phases[0].began_at == T0 + arrival
    for before, after in itertools.pairwise(phases):
        assert math.isclose(before.began_at + before.seconds, after.began_at, abs_tol=1e-6)
    assert all(p.seconds >= 0 for p in phases)
    assert math.isclose(phase_total(phases), wait, abs_tol=1e-6)
    names = [p.name for p in phases]
    assert names[-1] == "first_byte"
    assert names == sorted(names, key=PHASES.index)  # in the order they happen
    assert len(set(names)) == len(names)


def test_the_estimate_is_the_median_of_the_last_five_starts() -> None:
    assert median_recent([]) is None
    assert median_recent([90.0]) == 90.0
    assert median_recent([500.0, 1.0, 80.0, 100.0, 90.0, 95.0]) == 90.0  # 500 s is too old
    assert median_recent([10.0, 20.0]) == 15.0


def test_the_watch_reports_each_milestone_once_and_ends_when_all_were_seen() -> None:
    lines = [line for line, _ in VLLM_LINES] + ["never read"]
    read: list[str] = []
    reported: list[tuple[str, float | None]] = []

    async def log() -> AsyncIterator[str]:
        for line in lines:
            read.append(line)
            yield line

    asyncio.run(watch_milestones(log(), "vllm", lambda name, took: reported.append((name, took))))
    assert reported == [
        ("weights_loaded", 31.27),
        ("model_loaded", 32.104587),
        ("engine_initialized", 216.57),
        ("server_listening", None),
    ]
    assert "never read" not in read


def _rec(seq: int, ts: float, event: m.AnyEvent) -> m.Recorded:
    return m.Recorded(seq=seq, ts=ts, stream="deployment:d1", version=seq, actor="x", event=event)


def test_the_last_start_s_marks_skip_a_failed_one_and_end_at_its_last_mark_while_under_way() -> (
    None
):
    records = [
        _rec(1, T0, m.StartRequested(reason="admin")),
        _rec(2, T0 + 1, m.EngineStarting(runtime_id="pid:1", host="h", port=1)),
        _rec(3, T0 + 2, m.EngineStartFailed(reason="boom", failures=1)),
        _rec(4, T0 + 100, m.StartRequested(reason="request", request_id="r")),
        _rec(5, T0 + 101, m.EngineStarting(runtime_id="pid:2", host="h", port=1,
                                           launch_began_at=T0 + 100.5)),
        _rec(6, T0 + 110, m.EngineMilestoneReached(milestone="weights_loaded", at=T0 + 109)),
    ]  # fmt: skip
    marks = marks_of(records)
    assert marks.requested_at == T0 + 100 and marks.launch_began_at == T0 + 100.5
    assert last_mark(marks) == T0 + 109
    assert [(p.name, p.seconds) for p in start_phases(marks)] == [
        ("launch", 1.0),
        ("loading_weights", 8.0),
    ]
    ready = marks_of([*records, _rec(7, T0 + 120, m.EngineReady())])
    assert [p.name for p in start_phases(ready)] == ["launch", "loading_weights", "ready"]
