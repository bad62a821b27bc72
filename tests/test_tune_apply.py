"""Applying tune's recommendation and undoing it: `POST /settings/tune/apply` changes the
settings through the controller's own calls and records one audited event holding the
prediction; `POST /settings/tune/undo` puts them back in one step (issue 45)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from events import model as m
from tests.api_support import Box, run_box

PREDICTION: dict[str, Any] = {
    "hours": 24.0, "requests": 1200, "p50": 0.0, "p90": 4.5, "p99": 9.0,
    "worst_model": "chat", "worst_p90": 6.0, "cold_starts_per_hour": 2.5,
    "evictions_per_hour": 2.0, "idle_gib_hours_per_hour": 3.0,
    "fates": {"served": 1200, "refused": 0, "timed_out": 0, "stopped": 0},
    "fates_per_model": {"chat": {"served": 1200, "refused": 0, "timed_out": 0, "stopped": 0}},
    "fails_served": 0, "fails_served_models": [],
}  # fmt: skip


async def _deployment(box: Box, name: str, mode: str = "on_demand") -> str:
    admin = await box.login("alice")
    body = {"name": name, "engine": "sim", "model": f"org/{name}", "memory_gib": 10, "mode": mode}
    created = await admin.ok("POST", "/dgxmm/api/deployments", body, 201)
    return str(created["id"])


def test_apply_changes_the_settings_and_records_one_audited_event_then_undo_puts_them_back(
    tmp_path: Path,
) -> None:
    async def test(box: Box) -> None:
        chat = await _deployment(box, "chat")
        coder = await _deployment(box, "coder")
        admin = await box.login("alice")
        body = {
            "settings": {
                "ondemand_make_room_after_s": 0,
                f"{chat}.idle_timeout_s": 900,
                f"{coder}.mode": "always_on",
            },
            "changes": [
                "chat.idle_timeout_s=900", "coder.mode=always_on", "ondemand_make_room_after_s=0",
            ],
            "label": "make room after 0 s; idle timeout 900 s for chat; always on: coder",
            "goal": "p90 wait <= 30 s with the fewest cold starts per hour",
            "prediction": PREDICTION,
            "baseline": {**PREDICTION, "p90": 40.0, "cold_starts_per_hour": 1.0},
        }  # fmt: skip
        applied = (await admin.ok("POST", "/dgxmm/api/settings/tune/apply", body))["applied"]
        assert applied["changes"] == body["changes"]
        assert applied["prediction"] == PREDICTION and applied["undone_at"] is None
        # What happened since is measured from the trace; this log has none yet.
        assert applied["since"] is None and "trace" in applied["since_error"]
        settings = await admin.ok("GET", "/dgxmm/api/settings")
        assert settings["ondemand_make_room_after_s"] == 0
        deps = {
            d["name"]: d for d in (await admin.ok("GET", "/dgxmm/api/deployments"))["deployments"]
        }
        # Always on takes effect once its engine is up (the deployment's pending mode).
        coder_dep = deps["coder"]
        assert deps["chat"]["idle_timeout_s"] == 900
        assert "always_on" in (coder_dep["mode"], coder_dep["pending_mode"])
        events = await box.events()
        tuned = [r for r in events if isinstance(r.event, m.TuneApplied)]
        assert len(tuned) == 1 and tuned[0].actor.endswith("alice")
        assert tuned[0].event.previous[f"{coder}.mode"] == "on_demand"
        audit = await admin.ok("GET", "/dgxmm/api/audit?action=tune_apply")
        assert len(audit["rows"]) == 1

        undone = (await admin.ok("POST", "/dgxmm/api/settings/tune/undo"))["applied"]
        assert undone["undone_at"] is not None and undone["since"] is None
        settings = await admin.ok("GET", "/dgxmm/api/settings")
        assert settings["ondemand_make_room_after_s"] is None
        deps = {
            d["name"]: d for d in (await admin.ok("GET", "/dgxmm/api/deployments"))["deployments"]
        }
        assert deps["chat"]["idle_timeout_s"] is None and deps["coder"]["mode"] == "on_demand"
        assert len((await admin.ok("GET", "/dgxmm/api/audit?action=tune_undo"))["rows"]) == 1
        again = await admin.call("POST", "/dgxmm/api/settings/tune/undo")
        assert again.status == 409 and again.json()["error"]["code"] == "nothing_to_undo"

    run_box(tmp_path, test)


def test_only_an_administrator_applies_and_a_wrong_setting_changes_nothing(tmp_path: Path) -> None:
    async def test(box: Box) -> None:
        chat = await _deployment(box, "chat")
        viewer = await box.login("victor")
        body = {"settings": {"ondemand_make_room_after_s": 0}, "prediction": PREDICTION}
        refused = await viewer.call("POST", "/dgxmm/api/settings/tune/apply", body)
        assert refused.status == 403
        admin = await box.login("alice")
        bad = {"settings": {"ondemand_make_room_after_s": 0, f"{chat}.colour": "red"}}
        reply = await admin.call(
            "POST", "/dgxmm/api/settings/tune/apply", {**bad, "prediction": PREDICTION}
        )
        assert reply.status == 422, reply.body
        settings = await admin.ok("GET", "/dgxmm/api/settings")
        assert settings["ondemand_make_room_after_s"] is None
        assert not any(isinstance(r.event, m.TuneApplied) for r in await box.events())
        none = await admin.ok("GET", "/dgxmm/api/settings/tune/applied")
        assert none == {"applied": None}

    run_box(tmp_path, test)
