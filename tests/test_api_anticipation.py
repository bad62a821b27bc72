"""`ondemand_policy` through the admin API: settings, create and the mode endpoint (issue 44;
real sockets on loopback, real SQLite log; see tests/api_support.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.api_support import STARTUP_S, Box, error_of, run_box
from tests.test_api import API, create


def test_the_global_policy_is_seed_by_default_and_an_admin_sets_it(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        assert (await alice.ok("GET", f"{API}/settings"))["ondemand_policy"] == "seed"
        dep = await create(alice, mode="on_demand")
        assert (dep["ondemand_policy"], dep["effective_ondemand_policy"]) == (None, "seed")
        got = await alice.ok("PATCH", f"{API}/settings", {"ondemand_policy": "learned"})
        assert got["ondemand_policy"] == "learned"
        assert (await alice.ok("GET", f"{API}/settings"))["ondemand_policy"] == "learned"
        rec = await alice.ok("GET", f"{API}/deployments/{dep['id']}")
        assert rec["effective_ondemand_policy"] == "learned"
        assert rec["learned"] == "no traffic recorded yet: the seed's rules apply"

    run_box(tmp_path, t)


@pytest.mark.parametrize("value", ["clever", None, 1, ""])
def test_a_bad_global_policy_is_a_422_naming_it_and_changes_nothing(
    tmp_path: Path, value: Any
) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        reply = await alice.call("PATCH", f"{API}/settings", {"ondemand_policy": value})
        assert reply.status == 422
        err = error_of(reply)
        assert err["code"] == "invalid_policy" and "ondemand_policy" in err["message"]
        assert (await alice.ok("GET", f"{API}/settings"))["ondemand_policy"] == "seed"

    run_box(tmp_path, t)


def test_create_and_the_mode_endpoint_set_the_deployments_own_policy(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, mode="on_demand", ondemand_policy="learned")
        assert (dep["ondemand_policy"], dep["effective_ondemand_policy"]) == ("learned", "learned")
        await box.advance(STARTUP_S + 2)
        url = f"{API}/deployments/{dep['id']}/mode"
        got = await alice.ok("PATCH", url, {"mode": "on_demand", "ondemand_policy": "seed"})
        assert (got["ondemand_policy"], got["effective_ondemand_policy"]) == ("seed", "seed")
        got = await alice.ok("PATCH", url, {"mode": "on_demand", "idle_timeout_s": 600})
        assert (got["ondemand_policy"], got["idle_timeout_s"]) == ("seed", 600)  # left out: kept
        await alice.ok("PATCH", f"{API}/settings", {"ondemand_policy": "learned"})
        got = await alice.ok("PATCH", url, {"mode": "on_demand", "ondemand_policy": None})
        assert (got["ondemand_policy"], got["effective_ondemand_policy"]) == (None, "learned")

    run_box(tmp_path, t)


def test_a_bad_policy_on_create_or_the_mode_endpoint_is_a_422_and_changes_nothing(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, mode="on_demand", ondemand_policy="seed")
        url = f"{API}/deployments/{dep['id']}/mode"
        for bad in ("clever", 1, True):
            reply = await alice.call("PATCH", url, {"mode": "on_demand", "ondemand_policy": bad})
            assert reply.status == 422
            err = error_of(reply)
            assert (err["param"], err["code"]) == ("ondemand_policy", "invalid_policy")
        rec = await alice.ok("GET", f"{API}/deployments/{dep['id']}")
        assert rec["ondemand_policy"] == "seed"
        body = {"name": "beta", "engine": "sim", "model": "o/b", "memory_gib": 1}
        reply = await alice.call("POST", f"{API}/deployments", {**body, "ondemand_policy": "x"})
        assert reply.status == 422 and error_of(reply)["param"] == "ondemand_policy"
        names = [d["name"] for d in (await alice.ok("GET", f"{API}/deployments"))["deployments"]]
        assert names == ["alpha"]

    run_box(tmp_path, t)
