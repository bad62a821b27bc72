"""The admin API over real loopback sockets, on a simulated box with a virtual clock."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dgxmm.admin.auth import parse_api_token
from events import model as m
from events.projections import audit_rows
from tests.api_support import STARTUP_S, ApiClient, Box, error_of, run_box
from tests.gateway_support import raw_exchange

API = "/dgxmm/api"
GIB = 1 << 30


def spec(name: str = "alpha", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "engine": "sim", "model": f"org/{name}", "memory_gib": 10}
    body.update(extra)
    return body


async def create(client: ApiClient, name: str = "alpha", **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = await client.ok("POST", f"{API}/deployments", spec(name, **extra), 201)
    return data


async def audit(box: Box) -> list[Any]:
    return list(audit_rows(await box.events()))


# --- authentication and authorisation -----------------------------------------------------------


def test_a_call_without_credentials_gets_401_under_both_prefixes(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        anon = ApiClient(box.port)
        for target in (f"{API}/deployments", "/api/deployments", f"{API}/memory"):
            reply = await anon.get(target)
            assert reply.status == 401
            err = error_of(reply)
            assert (err["type"], err["code"]) == ("authentication_error", "unauthenticated")
            assert reply.header("www-authenticate") == 'Bearer realm="dgxmm"'

    run_box(tmp_path, t)


def test_a_viewer_reads_but_every_write_gets_403(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login("alice")
        dep = await create(alice)
        victor = await box.login("victor")
        assert (await victor.get(f"{API}/deployments")).status == 200
        assert (await victor.get(f"{API}/deployments/{dep['id']}")).status == 200
        writes = [
            ("POST", f"{API}/deployments", spec("beta")),
            ("POST", f"{API}/deployments/{dep['id']}/stop", None),
            ("POST", f"{API}/deployments/{dep['id']}/start", None),
            ("PATCH", f"{API}/deployments/{dep['id']}/mode", {"mode": "on_demand"}),
            ("DELETE", f"{API}/deployments/{dep['id']}", None),
            ("PATCH", f"{API}/settings", {"ondemand_idle_timeout_s": 600}),
            ("POST", f"{API}/litellm/sync", None),
        ]
        for method, target, body in writes:
            reply = await victor.call(method, target, body)
            assert reply.status == 403, (method, target)
            assert error_of(reply)["code"] == "forbidden"
        assert [
            r["name"] for r in (await alice.ok("GET", f"{API}/deployments"))["deployments"]
        ] == ["alpha"]

    run_box(tmp_path, t)


def test_a_cookie_mutation_without_or_with_a_wrong_csrf_token_gets_403(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login("alice")
        reply = await alice.call("POST", f"{API}/deployments", spec(), csrf=False)
        assert reply.status == 403
        assert error_of(reply)["code"] == "csrf_failed"
        reply = await alice.call(
            "POST", f"{API}/deployments", spec(), csrf=False, headers=[("x-csrf-token", "nope")]
        )
        assert reply.status == 403
        assert box.harness.controller.records() == []
        assert (await alice.call("POST", f"{API}/deployments", spec())).status == 201

    run_box(tmp_path, t)


def test_a_bad_password_and_an_unknown_user_get_the_same_401(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        anon = ApiClient(box.port)
        wrong = await anon.call("POST", f"{API}/login", {"name": "alice", "password": "nope-nope"})
        unknown = await anon.call("POST", f"{API}/login", {"name": "mallory", "password": "x" * 9})
        assert wrong.status == unknown.status == 401
        assert wrong.body == unknown.body
        assert error_of(wrong)["code"] == "invalid_credentials"
        assert wrong.header("set-cookie") is None
        rows = [r for r in await audit(box) if r.action == "login_failed"]
        # An existing account is named; a name that is no user's only as a keyed hash.
        assert [(r.actor, r.details["name"]) for r in rows] == [
            ("client:127.0.0.1", "alice"),
            ("client:127.0.0.1", None),
        ]
        assert len(rows[1].details["name_hash"]) == 16
        assert b"mallory" not in b"".join(m.encode_event(r.event) for r in await box.events())

    run_box(tmp_path, t)


def test_login_sets_a_strict_http_only_cookie_and_is_recorded(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        anon = ApiClient(box.port)
        reply = await anon.call(
            "POST", f"{API}/login", {"name": "alice", "password": "alice-password"}
        )
        assert reply.status == 200
        cookie = reply.header("set-cookie") or ""
        attrs = [a.strip() for a in cookie.split(";")]
        assert attrs[0].startswith("dgxmm_session=") and len(attrs[0]) > 40
        assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(attrs[1:])
        data = reply.json()
        assert data["user"] == "alice" and data["role"] == "admin" and data["csrf_token"]
        logins = [r for r in await audit(box) if r.action == "login"]
        assert [(r.actor, r.details["name"]) for r in logins] == [("admin:alice", "alice")]

    run_box(tmp_path, t)


def test_get_session_returns_the_user_role_and_csrf_token(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        victor = await box.login("victor")
        data = await victor.ok("GET", f"{API}/session")
        assert data == {
            "user": "victor",
            "role": "viewer",
            "via": "session",
            "csrf_token": victor.csrf,
        }

    run_box(tmp_path, t)


def test_a_login_from_another_origin_is_refused(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        reply = await ApiClient(box.port).call(
            "POST",
            f"{API}/login",
            {"name": "alice", "password": "alice-password"},
            headers=[("origin", "http://evil.example")],
        )
        assert reply.status == 403
        assert error_of(reply)["code"] == "cross_origin"

    run_box(tmp_path, t)


def test_a_bearer_token_works_without_csrf_and_carries_its_users_role(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        script = await box.token_client("alice")
        dep = await script.ok("POST", f"{API}/deployments", spec(), 201)
        assert dep["name"] == "alpha"
        created = [r for r in await audit(box) if r.action == "deployment_create"]
        assert [r.actor for r in created] == ["admin:alice"]
        tokens = [r for r in await audit(box) if r.action == "api_token_create"]
        assert tokens[0].details["name"] == "alice"
        viewer = await box.token_client("victor")
        assert (await viewer.get(f"{API}/deployments")).status == 200
        assert (await viewer.call("POST", f"{API}/deployments", spec("b"))).status == 403
        forged = ApiClient(box.port)
        assert script.bearer is not None
        forged.bearer = script.bearer[:-4] + "AAAA"
        reply = await forged.get(f"{API}/deployments")
        assert reply.status == 401
        assert error_of(reply)["code"] == "invalid_token"
        raw = await box.harness.store.read(stream=m.STREAM_USERS)
        parsed = parse_api_token(script.bearer)
        assert parsed is not None
        secret = parsed[1]  # the secret may itself contain "_": take it whole
        assert all(secret not in m.encode_event(r.event).decode() for r in raw)

    run_box(tmp_path, t)


def test_logout_ends_the_session(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login("alice")
        reply = await alice.call("POST", f"{API}/logout")
        assert reply.status == 200
        assert "Max-Age=0" in (reply.header("set-cookie") or "")
        again = await alice.get(f"{API}/session")
        assert again.status == 401
        assert error_of(again)["code"] == "session_expired"

    run_box(tmp_path, t)


# --- deployments ------------------------------------------------------------------------------


def test_the_api_defaults_to_always_on_and_on_demand_must_be_asked_for(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        plain = await create(alice, "plain")
        lazy = await create(alice, "lazy", mode="on_demand", idle_timeout_s=600, memory_gib=2.5)
        assert (plain["mode"], lazy["mode"]) == ("always_on", "on_demand")
        assert lazy["idle_timeout_s"] == 600 and lazy["memory_bytes"] == int(2.5 * GIB)
        assert lazy["memory_gib"] == 2.5
        assert plain["state"] == "starting"  # every deployment starts right away
        listed = (await alice.ok("GET", f"{API}/deployments"))["deployments"]
        assert [d["name"] for d in listed] == ["plain", "lazy"]
        by_id = await alice.ok("GET", f"/api/deployments/{lazy['id']}")
        by_name = await alice.ok("GET", f"{API}/deployments/lazy")
        assert by_id["id"] == by_name["id"] == lazy["id"]
        await box.advance(STARTUP_S * 2 + 2)
        got = await alice.ok("GET", f"{API}/deployments/{plain['id']}")
        assert got["state"] == "ready" and got["badge"] == "Ready"

    run_box(tmp_path, t)


BAD_SPECS = [
    ({"name": None}, "name"),
    ({"name": "bad name!"}, "name"),
    ({"engine": "tensorflow"}, "engine"),
    ({"model": ""}, "model"),
    ({"memory_gib": "ten"}, "memory_gib"),
    ({"memory_gib": 0}, "memory_gib"),
    ({"memory_gib": True}, "memory_gib"),
    ({"mode": "sometimes"}, "mode"),
    ({"idle_timeout_s": 59}, "idle_timeout_s"),
    ({"idle_timeout_s": 86401}, "idle_timeout_s"),
    ({"idle_timeout_s": "600"}, "idle_timeout_s"),
    ({"role": "boss"}, "role"),
    ({"args": "--x"}, "args"),
    ({"args": [1]}, "args"),
    ({"image": 3}, "image"),
    ({"colour": "blue"}, "colour"),
]


@pytest.mark.parametrize(("change", "field"), BAD_SPECS)
def test_a_bad_deployment_body_gets_422_naming_the_field(
    tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        body = {k: v for k, v in {**spec(), **change}.items() if v is not None}
        reply = await alice.call("POST", f"{API}/deployments", body)
        assert reply.status == 422, reply.body
        err = error_of(reply)
        assert err["param"] == field
        assert err["message"].startswith(f"{field}:")
        assert err["type"] == "invalid_request_error"
        assert box.harness.controller.records() == []

    run_box(tmp_path, t)


def test_bad_json_is_400_a_non_object_422_and_an_oversized_body_413(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        reply = await alice.call("POST", f"{API}/deployments", b"{not json")
        assert (reply.status, error_of(reply)["code"]) == (400, "invalid_json")
        reply = await alice.call("POST", f"{API}/deployments", [1, 2])
        assert (reply.status, error_of(reply)["code"]) == (422, "invalid_body")
        reply = await alice.call("POST", f"{API}/deployments", b'"' + b"x" * (1 << 20) + b'"')
        assert (reply.status, error_of(reply)["code"]) == (413, "request_too_large")

    run_box(tmp_path, t)


def test_unknown_ids_and_routes_get_404_and_wrong_methods_405(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        for method, target, body in [
            ("GET", f"{API}/deployments/nope", None),
            ("DELETE", f"{API}/deployments/nope", None),
            ("POST", f"{API}/deployments/nope/start", None),
            ("POST", f"{API}/deployments/nope/stop", None),
            ("POST", f"{API}/deployments/nope/switch-model", {"model": "x"}),
            ("PATCH", f"{API}/deployments/nope/mode", {"mode": "always_on"}),
            ("GET", f"{API}/deployments/nope/events", None),
            ("GET", f"{API}/nothing-here", None),
        ]:
            reply = await alice.call(method, target, body)
            assert reply.status == 404, (method, target)
            assert error_of(reply)["type"] == "not_found_error"
        reply = await alice.call("PUT", f"{API}/deployments")
        assert reply.status == 405
        assert reply.header("allow") == "GET, POST"

    run_box(tmp_path, t)


def test_stop_start_and_remove_are_recorded_with_the_admin_as_actor(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice)
        await box.advance(STARTUP_S + 2)
        stopped = await alice.ok("POST", f"{API}/deployments/{dep['id']}/stop")
        assert stopped["state"] in ("stopping", "stopped")
        await box.advance(5)
        started = await alice.ok("POST", f"{API}/deployments/alpha/start")
        assert started["state"] == "starting"
        await box.advance(STARTUP_S + 2)
        gone = await alice.ok("DELETE", f"{API}/deployments/{dep['id']}")
        assert gone == {"id": dep["id"], "name": "alpha", "removed": True}
        await box.advance(5)
        assert (await alice.get(f"{API}/deployments/{dep['id']}")).status == 404
        rows = [(r.action, r.actor) for r in await audit(box) if r.target.startswith("deployment:")]
        assert ("deployment_create", "admin:alice") in rows
        assert ("deployment_stop", "admin:alice") in rows
        assert ("deployment_start", "admin:alice") in rows
        assert ("deployment_remove", "admin:alice") in rows
        # a removed deployment's events can still be read
        events = await alice.ok("GET", f"{API}/deployments/{dep['id']}/events")
        assert events["events"][0]["title"] == "Removed"

    run_box(tmp_path, t)


def test_the_decision_model_cannot_be_created_on_demand(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        reply = await alice.call(
            "POST", f"{API}/deployments", spec("judge", role="decision", mode="on_demand")
        )
        assert reply.status == 409
        assert error_of(reply)["code"] == "decision_model_always_on"

    run_box(tmp_path, t)


def test_switch_model_keeps_the_mode(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, mode="on_demand")
        await box.advance(STARTUP_S + 2)
        got = await alice.ok(
            "POST",
            f"{API}/deployments/{dep['id']}/switch-model",
            {"model": "org/alpha-v2", "memory_gib": 12},
        )
        assert (got["model"], got["mode"], got["memory_bytes"]) == (
            "org/alpha-v2",
            "on_demand",
            12 * GIB,
        )
        reply = await alice.call(
            "POST", f"{API}/deployments/{dep['id']}/switch-model", {"mode": "x"}
        )
        assert reply.status == 422
        assert error_of(reply)["param"] == "mode"
        rows = [r for r in await audit(box) if r.action == "deployment_switch_model"]
        assert [(r.actor, r.details["model"]) for r in rows] == [("admin:alice", "org/alpha-v2")]

    run_box(tmp_path, t)


# --- PATCH .../mode -----------------------------------------------------------------------------


def test_patch_mode_null_means_the_default_and_omitted_keeps_the_timeout(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice)
        await box.advance(STARTUP_S + 2)
        url = f"{API}/deployments/{dep['id']}/mode"
        got = await alice.ok("PATCH", url, {"mode": "on_demand", "idle_timeout_s": 600})
        assert (got["mode"], got["idle_timeout_s"], got["effective_idle_timeout_s"]) == (
            "on_demand",
            600,
            600,
        )
        got = await alice.ok("PATCH", url, {"mode": "always_on"})
        assert (got["mode"], got["idle_timeout_s"]) == ("always_on", 600)  # omitted: kept
        got = await alice.ok("PATCH", url, {"mode": "on_demand", "idle_timeout_s": None})
        assert (got["mode"], got["idle_timeout_s"], got["effective_idle_timeout_s"]) == (
            "on_demand",
            None,
            300,
        )
        rows = [r for r in await audit(box) if r.action == "ondemand_mode"]
        assert [(r.actor, r.details["mode"], r.details["idle_timeout_s"]) for r in rows] == [
            ("admin:alice", "on_demand", 600),
            ("admin:alice", "always_on", 600),
            ("admin:alice", "on_demand", None),
        ]

    run_box(tmp_path, t)


@pytest.mark.parametrize(
    ("body", "field", "code"),
    [
        ({"mode": "on_demand", "idle_timeout_s": 59}, "idle_timeout_s", "invalid_idle_timeout"),
        ({"mode": "on_demand", "idle_timeout_s": 86401}, "idle_timeout_s", "invalid_idle_timeout"),
        ({"mode": "on_demand", "idle_timeout_s": True}, "idle_timeout_s", "invalid_idle_timeout"),
        ({"mode": "sometimes"}, "mode", "invalid_mode"),
        ({"mode": None}, "mode", "invalid_mode"),
        ({"idle_timeout_s": 600}, "mode", "missing_field"),
        ({"mode": "on_demand", "priority": 1}, "priority", "unknown_field"),
    ],
)
def test_patch_mode_rejects_bad_bodies_with_422(
    tmp_path: Path, body: dict[str, Any], field: str, code: str
) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice)
        reply = await alice.call("PATCH", f"{API}/deployments/{dep['id']}/mode", body)
        assert reply.status == 422
        err = error_of(reply)
        assert (err["param"], err["code"]) == (field, code)
        if field == "mode" and code == "invalid_mode":
            assert '"on_demand" or "always_on"' in err["message"]
        rec = await alice.ok("GET", f"{API}/deployments/{dep['id']}")
        assert (rec["mode"], rec["idle_timeout_s"]) == ("always_on", None)

    run_box(tmp_path, t)


def test_the_decision_model_cannot_be_switched_to_on_demand(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, "judge", role="decision")
        reply = await alice.call(
            "PATCH", f"{API}/deployments/{dep['id']}/mode", {"mode": "on_demand"}
        )
        assert reply.status == 409
        assert error_of(reply)["code"] == "decision_model_always_on"

    run_box(tmp_path, t)


def test_switching_a_sleeping_model_to_always_on_shows_pending_mode_while_it_starts(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, mode="on_demand", idle_timeout_s=60)
        await box.advance(STARTUP_S + 2 + 60 + 16)
        url = f"{API}/deployments/{dep['id']}"
        assert (await alice.ok("GET", url))["badge"] == "Sleeping (on demand)"
        got = await alice.ok("PATCH", f"{url}/mode", {"mode": "always_on"})
        assert (got["state"], got["mode"], got["pending_mode"]) == (
            "starting",
            "on_demand",
            "always_on",
        )
        assert (await alice.ok("GET", url))["pending_mode"] == "always_on"
        await box.advance(STARTUP_S + 2)
        got = await alice.ok("GET", url)
        assert (got["state"], got["mode"], got["pending_mode"]) == ("ready", "always_on", None)

    run_box(tmp_path, t)


def test_a_switch_to_always_on_that_does_not_fit_passes_409_insufficient_memory_through(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        await create(alice, "big", memory_gib=40)
        await box.advance(STARTUP_S + 2)
        small = await create(alice, "small", memory_gib=20, mode="on_demand")
        assert small["state"] == "stopped"  # did not fit at creation
        reply = await alice.call("PATCH", f"{API}/deployments/small/mode", {"mode": "always_on"})
        assert reply.status == 409
        assert error_of(reply)["code"] == "insufficient_memory"
        got = await alice.ok("GET", f"{API}/deployments/small")
        assert (got["mode"], got["pending_mode"], got["state"]) == ("on_demand", None, "stopped")

    run_box(tmp_path, t, usable_gib=50)


# --- events, audit, memory, settings, LiteLLM -------------------------------------------------


def test_the_events_endpoint_gives_the_events_tab_rows_newest_first(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, mode="on_demand")
        await box.advance(STARTUP_S + 2 + 300 + 16)
        data = await alice.ok("GET", f"{API}/deployments/{dep['id']}/events")
        rows = data["events"]
        titles = [r["title"] for r in rows]
        assert titles[0] == "Stopped"
        assert "Put to sleep after 5 min idle" in titles
        assert titles[-1] == "Created (on demand)"
        assert rows[-1]["actor"] == "admin:alice"
        sleep = next(r for r in rows if r["title"].startswith("Put to sleep"))
        assert sleep["actor"] == "ondemand"
        assert {"seq", "ts", "time", "actor", "title", "type"} <= set(rows[0])
        assert [r["seq"] for r in rows] == sorted((r["seq"] for r in rows), reverse=True)
        page = await alice.ok("GET", f"{API}/deployments/{dep['id']}/events?limit=2")
        assert [r["seq"] for r in page["events"]] == [r["seq"] for r in rows[:2]]
        assert page["next_before"] == rows[1]["seq"]
        rest = await alice.ok(
            "GET", f"{API}/deployments/{dep['id']}/events?before={page['next_before']}"
        )
        assert [r["seq"] for r in rest["events"]] == [r["seq"] for r in rows[2:]]

    run_box(tmp_path, t)


def test_audit_filters_paginates_and_shows_newest_first(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        a = await create(alice, "a", mode="on_demand")
        await create(alice, "b")
        await alice.ok(
            "PATCH",
            f"{API}/deployments/{a['id']}/mode",
            {"mode": "on_demand", "idle_timeout_s": 120},
        )
        everything = (await alice.ok("GET", f"{API}/audit"))["rows"]
        seqs = [r["seq"] for r in everything]
        assert seqs == sorted(seqs, reverse=True)
        mode_rows = (await alice.ok("GET", f"{API}/audit?action=ondemand_mode"))["rows"]
        assert [
            (r["actor"], r["deployment"], r["details"]["idle_timeout_s"]) for r in mode_rows
        ] == [("admin:alice", "a", 120)]
        of_a = (await alice.ok("GET", f"{API}/audit?deployment=a"))["rows"]
        assert {r["deployment_id"] for r in of_a} == {a["id"]}
        by_system = (await alice.ok("GET", f"{API}/audit?actor=system"))["rows"]
        assert {r["action"] for r in by_system} == {"user_create"}
        page = await alice.ok("GET", f"{API}/audit?limit=2")
        assert [r["seq"] for r in page["rows"]] == seqs[:2]
        nxt = await alice.ok("GET", f"{API}/audit?limit=2&before={page['next_before']}")
        assert [r["seq"] for r in nxt["rows"]] == seqs[2:4]
        later = everything[0]["ts"] + 1
        assert (await alice.ok("GET", f"{API}/audit?since={later}"))["rows"] == []
        assert len((await alice.ok("GET", f"{API}/audit?until={later}"))["rows"]) == len(everything)
        bad = await alice.call("GET", f"{API}/audit?since=yesterday-ish")
        assert (bad.status, error_of(bad)["param"]) == (422, "since")
        bad = await alice.call("GET", f"{API}/audit?limit=0")
        assert (bad.status, error_of(bad)["param"]) == (422, "limit")

    run_box(tmp_path, t)


def test_audit_shows_a_queue_timeout_at_most_once_a_minute_across_separate_appends(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        store = box.harness.store
        for i in range(7):  # seven timeouts of one deployment within the same minute
            await store.append(
                m.STREAM_QUEUE,
                [m.RequestLeftQueue(request_id=f"r{i}", deployment_id="d1", reason="timeout")],
                actor="ondemand",
            )
        alice = await box.login()
        rows = (await alice.ok("GET", f"{API}/audit?action=ondemand_queue_timeout"))["rows"]
        assert len(rows) == 1
        assert rows[0]["details"]["request_id"] == "r0"

    run_box(tmp_path, t)


def test_memory_shows_the_budget_and_what_always_on_holds(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        victor = await box.login("victor")
        before = await victor.ok("GET", f"{API}/memory")
        assert before["usable_bytes"] == 100 * GIB and before["free_bytes"] == 100 * GIB
        alice = await box.login()
        await create(alice, memory_gib=10)
        await box.advance(STARTUP_S + 2)
        after = await victor.ok("GET", f"{API}/memory")
        assert after["always_on_bytes"] == 10 * GIB
        assert after["free_bytes"] == 90 * GIB and after["free_gib"] == 90

    run_box(tmp_path, t)


def test_settings_are_read_by_viewers_and_changed_by_admins_with_validation(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        dep = await create(alice, mode="on_demand")
        victor = await box.login("victor")
        assert (await victor.ok("GET", f"{API}/settings"))["ondemand_idle_timeout_s"] == 300
        got = await alice.ok("PATCH", f"{API}/settings", {"ondemand_idle_timeout_s": 900})
        assert got["ondemand_idle_timeout_s"] == 900
        rec = await alice.ok("GET", f"{API}/deployments/{dep['id']}")
        assert rec["effective_idle_timeout_s"] == 900  # left at the default: follows it
        for body, field in [
            ({"ondemand_idle_timeout_s": 10}, "ondemand_idle_timeout_s"),
            ({"nope": 1}, "nope"),
        ]:
            reply = await alice.call("PATCH", f"{API}/settings", body)
            assert reply.status == 422
            assert error_of(reply)["param"] == field
        rows = [r for r in await audit(box) if r.action == "settings_change"]
        assert [(r.actor, r.details) for r in rows] == [
            ("admin:alice", {"ondemand_idle_timeout_s": 900})
        ]

    run_box(tmp_path, t)


def test_litellm_status_gives_the_wizard_default_and_the_hint(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        data = await alice.ok("GET", f"{API}/litellm")
        assert data["default_mode"] == "always_on"
        assert data["hint"] == (
            "On demand needs LiteLLM (it starts models on requests that come through it)"
        )
        box.litellm["status"].update(enabled=True, ok=True)
        data = await alice.ok("GET", f"{API}/litellm")
        assert (data["default_mode"], data["hint"], data["enabled"]) == ("on_demand", None, True)
        box.litellm["status"].update(ok=False)  # enabled, but the last sync failed
        assert (await alice.ok("GET", f"{API}/litellm"))["default_mode"] == "always_on"

    run_box(tmp_path, t)


def test_litellm_sync_and_settings_call_the_hooks_with_the_admin_as_actor(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        alice = await box.login()
        assert await alice.ok("POST", f"{API}/litellm/sync") == {"ok": True, "entries": 3}
        assert box.litellm["syncs"] == 1
        await alice.ok("PATCH", f"{API}/litellm", {"url": "http://127.0.0.1:4000"})
        assert box.litellm["configured"] == [({"url": "http://127.0.0.1:4000"}, "admin:alice")]
        reply = await alice.call("PATCH", f"{API}/litellm", {"url": "ftp://x"})
        assert (reply.status, error_of(reply)["code"]) == (422, "invalid_litellm_settings")

    run_box(tmp_path, t)


# --- static files -------------------------------------------------------------------------------


def make_web_root(tmp_path: Path) -> Path:
    root = tmp_path / "web"
    (root / "assets").mkdir(parents=True)
    (root / "index.html").write_text("<!doctype html><title>DGXMM</title>")
    (root / "assets" / "app.js").write_text("console.log('dgxmm')")
    (root / "assets" / "app.css").write_text("body{}")
    (tmp_path / "secret.txt").write_text("top secret")
    os.symlink(tmp_path / "secret.txt", root / "assets" / "link.txt")
    return root


def test_static_files_are_served_with_their_content_types(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        anon = ApiClient(box.port)
        index = await anon.get("/dgxmm/")
        assert index.status == 200
        assert index.header("content-type") == "text/html; charset=utf-8"
        assert b"<title>DGXMM</title>" in index.body
        js = await anon.get("/dgxmm/assets/app.js")
        assert (js.status, js.header("content-type")) == (200, "text/javascript; charset=utf-8")
        css = await anon.get("/dgxmm/assets/app.css")
        assert css.header("content-type") == "text/css; charset=utf-8"
        assert (await anon.get("/dgxmm/deployments/abc")).body == index.body  # a client route
        redirect = await anon.get("/dgxmm")
        assert (redirect.status, redirect.header("location")) == (308, "/dgxmm/")
        assert (await anon.get("/dgxmm/assets/missing.js")).status == 404

    run_box(tmp_path, t, web_root=make_web_root(tmp_path))


def test_static_serving_refuses_directory_traversal(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        for target in (
            "/dgxmm/../secret.txt",
            "/dgxmm/assets/../../secret.txt",
            "/dgxmm/%2e%2e/secret.txt",
            "/dgxmm/assets%2f..%2f..%2fsecret.txt",
            "/dgxmm/..%5csecret.txt",
            "/dgxmm/assets/link.txt",
            "/dgxmm/%00",
        ):
            data = await raw_exchange(
                box.port, f"GET {target} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
            )
            assert data.startswith(b"HTTP/1.1 404") or data.startswith(b"HTTP/1.1 400"), target
            assert b"top secret" not in data, target

    run_box(tmp_path, t, web_root=make_web_root(tmp_path))


def test_without_a_web_root_the_ui_paths_are_404(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        reply = await ApiClient(box.port).get("/dgxmm/")
        assert reply.status == 404

    run_box(tmp_path, t)


class StructStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A status object like the LiteLLM sync's, with `synced` as a property."""

    enabled: bool
    ok: bool

    @property
    def synced(self) -> bool:
        return self.enabled and self.ok


def test_litellm_status_may_be_a_struct_with_a_synced_property(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        box.api._litellm_status = lambda: StructStatus(enabled=True, ok=True)
        data = await (await box.login("victor")).ok("GET", f"{API}/litellm")
        assert (data["enabled"], data["default_mode"], data["hint"]) == (True, "on_demand", None)

    run_box(tmp_path, t)
