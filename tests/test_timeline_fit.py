"""The timeline API's default window fits a young box (issue 46, stumble 4): without `since`,
the window runs from the log's first record when the log is younger than an hour, so the
dashboard's live chart fills its width instead of its rightmost sliver; an hour later it is
the last hour again.  A window the caller names is kept as it is."""

from __future__ import annotations

from pathlib import Path

from events.timeline import MIN_FITTED_S, fitted_since
from tests.api_support import STARTUP_S, Box, run_box

API = "/dgxmm/api"


def test_a_young_boxs_default_window_starts_at_its_first_record(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        await box.harness.deploy("model-a", 10)
        await box.advance(STARTUP_S + 5)
        first = (await box.events())[0].ts
        alice = await box.login()
        got = await alice.ok("GET", f"{API}/timeline")
        assert got["since"] == first
        assert abs(got["until"] - box.harness.clock.wall()) < 1
        assert got["until"] - got["since"] < 600
        # A window that is asked for stays as it is.
        named = await alice.ok("GET", f"{API}/timeline?since={got['until'] - 3600}")
        assert named["since"] == got["until"] - 3600
        await box.advance(3700)  # an hour exists now: the last hour
        older = await alice.ok("GET", f"{API}/timeline")
        assert older["until"] - older["since"] == 3600

    run_box(tmp_path, t)


def test_the_fitted_start_keeps_a_few_seconds_readable_and_ignores_an_older_log() -> None:
    assert fitted_since(1000.0, 900.0, 3600) == 900.0
    assert fitted_since(1000.0, 990.0, 3600) == 1000.0 - MIN_FITTED_S
    assert fitted_since(10_000.0, 100.0, 3600) == 10_000.0 - 3600
    assert fitted_since(1000.0, None, 3600) == 1000.0 - 3600
    assert fitted_since(1000.0, 2000.0, 3600) == 1000.0 - 3600  # the log began after the window
