"""The simulated vLLM writes its start-up lines with vLLM's prefix and the time they were
written, as a real vLLM does, not the placeholder "INFO 00-00 00:00:00" (issue 46, stumble 13):
the Logs tab shows the engine's lines as they are, so the placeholder was the cause."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time

from events.cold_start import milestone_of
from simulations.engine import vllm_prefix
from tests.test_sim_engine import subprocess_engine

VLLM_LINE = re.compile(r"^INFO (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[")


def test_the_simulated_vllm_stamps_its_start_up_lines_with_the_time_written() -> None:
    async def body() -> list[str]:
        async with subprocess_engine("--flavour", "vllm", "--startup-delay", "0.3") as (proc, _):
            assert proc.stderr is not None
            lines: list[str] = []
            while not any("Application startup complete" in line for line in lines):
                raw = await asyncio.wait_for(proc.stderr.readline(), 30)
                assert raw, lines
                lines.append(raw.decode().rstrip("\n"))
            return lines

    before = time.time()
    lines = asyncio.run(body())
    after = time.time()
    stamped = [line for line in lines if VLLM_LINE.match(line)]
    assert len(stamped) == 4, lines  # the four milestone lines
    for line in stamped:
        month, day, hour, minute, second = map(int, VLLM_LINE.match(line).groups())
        written = dt.datetime.fromtimestamp(before).replace(
            month=month, day=day, hour=hour, minute=minute, second=second, microsecond=0
        )
        assert int(before) - 1 <= written.timestamp() <= after + 1, line
    assert [milestone_of("vllm", line).name for line in stamped] == [
        "weights_loaded", "model_loaded", "engine_initialized", "server_listening",
    ]  # fmt: skip


def test_the_prefix_is_vllms_level_then_the_local_month_day_and_time() -> None:
    at = dt.datetime(2026, 12, 6, 21, 58, 43).timestamp()
    assert vllm_prefix(at) == "INFO 12-06 21:58:43"
