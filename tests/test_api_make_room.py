"""`ondemand_make_room_after_s` through the admin API: settings, create and the mode endpoint
(real sockets on loopback, real SQLite log; see tests/api_support.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from events.projections import audit_rows
from tests.api_support import STARTUP_S, Box, error_of, run_box
from tests.test_api import API, create


def test_the_setting_is_unset_by_default_set_by_admins_and_null_unsets_it(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, mode="on_demand", idle_timeout_s=600)
        assert (await alice.ok("GET", f"{API}/settings"))["ondemand_make_room_after_s"] is None
        rec = await alice.ok("GET", f"{API}/deployments/{dep['id']}")
        assert (rec["make_room_after_s"], rec["effective_make_room_after_s"]) == (None, 600)
        got = await alice.ok("PATCH", f"{API}/settings", {"ondemand_make_room_after_s": 30})
        assert got["ondemand_make_room_after_s"] == 30
        rec = await alice.ok("GET", f"{API}/deployments/{dep['id']}")
        assert rec["effective_make_room_after_s"] == 30
        got = await alice.ok("PATCH", f"{API}/settings", {"ondemand_make_room_after_s": None})
        assert got["ondemand_make_room_after_s"] is None
        victor = await box.login("victor")
        reply = await victor.call("PATCH", f"{API}/settings", {"ondemand_make_room_after_s": 0})
        assert reply.status == 403
        rows = [r.details for r in audit_rows(await box.events()) if r.action == "settings_change"]
        assert rows == [{"ondemand_make_room_after_s": 30}, {"ondemand_make_room_after_s": None}]

    run_box(tmp_path, t)


@pytest.mark.parametrize("value", [-1, 86401, 2.5, "30", True])
def test_a_bad_setting_is_refused_with_422_and_changes_nothing(tmp_path: Path, value: Any) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        body = {"ondemand_make_room_after_s": value}
        reply = await alice.call("PATCH", f"{API}/settings", body)
        assert reply.status == 422
        assert "ondemand_make_room_after_s" in error_of(reply)["message"]
        assert (await alice.ok("GET", f"{API}/settings"))["ondemand_make_room_after_s"] is None

    run_box(tmp_path, t)


def test_create_and_the_mode_endpoint_set_the_deployments_own_value(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, mode="on_demand", make_room_after_s=0)
        assert dep["make_room_after_s"] == 0 and dep["effective_make_room_after_s"] == 0
        await box.advance(STARTUP_S + 2)
        url = f"{API}/deployments/{dep['id']}/mode"
        got = await alice.ok("PATCH", url, {"mode": "on_demand", "make_room_after_s": 45})
        assert (got["make_room_after_s"], got["idle_timeout_s"]) == (45, None)
        got = await alice.ok("PATCH", url, {"mode": "on_demand", "idle_timeout_s": 600})
        assert (got["make_room_after_s"], got["idle_timeout_s"]) == (45, 600)  # omitted: kept
        got = await alice.ok("PATCH", url, {"mode": "on_demand", "make_room_after_s": None})
        assert (got["make_room_after_s"], got["effective_make_room_after_s"]) == (None, 600)
        for bad in (-1, 86401, 1.5, True):
            body = {"mode": "on_demand", "make_room_after_s": bad}
            reply = await alice.call("PATCH", url, body)
            assert reply.status == 422
            err = error_of(reply)
            assert (err["param"], err["code"]) == ("make_room_after_s", "invalid_make_room_after")
        body = {"name": "beta", "engine": "sim", "model": "o/b", "memory_gib": 1}
        reply = await alice.call("POST", f"{API}/deployments", {**body, "make_room_after_s": -5})
        assert reply.status == 422 and error_of(reply)["param"] == "make_room_after_s"
        rows = [r.details for r in audit_rows(await box.events()) if r.action == "ondemand_mode"]
        assert [d.get("make_room_after_s", "kept") for d in rows] == [45, "kept", None]

    run_box(tmp_path, t)
