"""POST /api/settings/tune: the Settings page's recommendation, `dgxmm tune` run apart on
the last 24 hours (dgxmm/admin/tuning.py)."""

from __future__ import annotations

from pathlib import Path

from dgxmm.admin.tuning import TuneRunner
from tests.api_support import Box, run_box
from tests.whatif_support import T0, Model, write_log


def test_a_log_without_traffic_in_the_last_day_gets_409_saying_so(tmp_path: Path) -> None:
    async def test(box: Box) -> None:
        admin = await box.login("alice")
        reply = await admin.call("POST", "/dgxmm/api/settings/tune", {})
        assert reply.status == 409, reply.body
        assert reply.json()["error"]["code"] == "tune_unavailable"
        assert "trace" in reply.json()["error"]["message"]

    run_box(tmp_path, test)


def test_the_recommendation_and_its_curve_come_from_the_last_day(tmp_path: Path) -> None:
    async def test(box: Box) -> None:
        log = tmp_path / "traced.db"
        models = [
            Model("chat", 40, 0.05, 2.0),
            Model("coder", 40, 0.02, 5.0),
            Model("big", 50, 0.004, 10.0),
        ]
        await write_log(log, models, hours=1.0, usable_gib=100)
        box.api.tuning = TuneRunner(str(log), wall=lambda: T0 + 7200)
        admin = await box.login("alice")
        reply = await admin.call(
            "POST", "/dgxmm/api/settings/tune", {"goal": "p99<=60,cold_starts"}
        )
        assert reply.status == 200, reply.body
        out = reply.json()
        assert len(out["points"]) >= 15
        assert out["recommended"]["figures"]["p99"] <= 60 and out["recommended"]["feasible"]
        viewer = await box.login("victor")
        refused = await viewer.call("POST", "/dgxmm/api/settings/tune", {})
        assert refused.status == 403

    run_box(tmp_path, test)
