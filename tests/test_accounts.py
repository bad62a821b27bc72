"""Accounts, API tokens and login backoff through the admin API, on a real loopback server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.api_support import PASSWORDS, ApiClient, Box, SseReader, error_of, run_box

API = "/dgxmm/api"


async def login_reply(client: ApiClient, name: str, password: str) -> Any:
    return await client.call("POST", f"{API}/login", {"name": name, "password": password})


def cookies_of(reply: Any) -> dict[str, str]:
    found = {}
    for n, v in reply.headers:
        if n.lower() == b"set-cookie":
            key, _, value = v.decode().split(";")[0].partition("=")
            found[key] = value
    return found


async def audit_actions(box: Box) -> list[tuple[str, str, dict[str, Any]]]:
    admin = await box.login("alice")
    rows = (await admin.ok("GET", f"{API}/audit?limit=1000"))["rows"]
    return [(r["actor"], r["action"], r["details"]) for r in rows]


# --- login backoff ----------------------------------------------------------------------------


def test_failed_logins_slow_a_name_down_exponentially_and_never_lock_it(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        anon = ApiClient(box.port)
        for _ in range(3):  # free attempts
            assert (await login_reply(anon, "alice", "wrong-password")).status == 401
        waits = []
        for _ in range(4):
            throttled = await login_reply(anon, "alice", "wrong-password")
            assert throttled.status == 429
            assert error_of(throttled)["code"] == "too_many_attempts"
            waits.append(int(throttled.header("retry-after") or 0))
            await box.advance(waits[-1] + 0.01)
            assert (await login_reply(anon, "alice", "wrong-password")).status == 401
        assert waits == [1, 2, 4, 8]
        await box.advance(16.01)  # the wait ran out: the right password passes
        assert (await login_reply(anon, "alice", PASSWORDS["alice"])).status == 200

    run_box(tmp_path, t)


def test_the_right_password_from_a_known_client_passes_while_the_name_is_attacked(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        owner = ApiClient(box.port)
        first = await login_reply(owner, "alice", PASSWORDS["alice"])
        known = cookies_of(first)["dgxmm_known"]
        attacker = ApiClient(box.port)
        failures = 0
        while failures < 8:  # the attacker waits out every backoff
            reply = await login_reply(attacker, "alice", "guess-guess")
            if reply.status == 429:
                await box.advance(float(reply.header("retry-after") or 1))
            else:
                failures += 1
        stranger = await login_reply(ApiClient(box.port), "alice", PASSWORDS["alice"])
        assert stranger.status == 429  # even the right password waits from an unknown client
        owner.cookie = f"dgxmm_known={known}"
        assert (await login_reply(owner, "alice", PASSWORDS["alice"])).status == 200
        forged = ApiClient(box.port)
        forged.cookie = f"dgxmm_known={known[:-2]}xx"
        assert (await login_reply(forged, "alice", PASSWORDS["alice"])).status == 429
        victor_cookie = ApiClient(box.port)
        victor_cookie.cookie = f"dgxmm_known={known}"  # alice's cookie vouches for alice only
        assert (await login_reply(victor_cookie, "victor", "wrong-password")).status == 401

    run_box(tmp_path, t)


def test_failures_from_one_address_slow_it_down_for_at_most_a_minute(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        anon = ApiClient(box.port)
        for i in range(10):  # ten names, one address: the address's free attempts
            assert (await login_reply(anon, f"nobody{i}", "wrong-password")).status == 401
        for i in range(10, 20):
            reply = await login_reply(anon, f"nobody{i}", "wrong-password")
            if reply.status == 429:
                wait = int(reply.header("retry-after") or 0)
                assert 1 <= wait <= 60
                await box.advance(wait)
        blocked = await login_reply(anon, "victor", PASSWORDS["victor"])
        assert blocked.status == 429 and int(blocked.header("retry-after") or 0) <= 60
        await box.advance(60)
        assert (await login_reply(anon, "victor", PASSWORDS["victor"])).status == 200

    run_box(tmp_path, t)


# --- users ------------------------------------------------------------------------------------


def test_an_admin_lists_adds_changes_and_removes_users_and_each_change_is_audited(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        users = (await admin.ok("GET", f"{API}/users"))["users"]
        assert [(u["name"], u["role"]) for u in users] == [("alice", "admin"), ("victor", "viewer")]
        assert all("password_hash" not in u for u in users)
        body = {"name": "wendy", "role": "viewer", "password": "wendy-password"}
        await admin.ok("POST", f"{API}/users", body, status=201)
        await admin.ok("PATCH", f"{API}/users/wendy", {"role": "admin"})
        await admin.ok("PATCH", f"{API}/users/wendy", {"password": "another-password"})
        wendy = await box.login("wendy", "another-password")
        assert (await wendy.ok("GET", f"{API}/session"))["role"] == "admin"
        await admin.ok("DELETE", f"{API}/users/wendy")
        assert (await wendy.call("GET", f"{API}/session")).status == 401
        actions = [(a, act, d.get("name")) for a, act, d in await audit_actions(box)]
        for row in [
            ("admin:alice", "user_create", "wendy"),
            ("admin:alice", "user_role_change", "wendy"),
            ("admin:alice", "password_change", "wendy"),
            ("admin:alice", "user_remove", "wendy"),
        ]:
            assert row in actions

    run_box(tmp_path, t)


def test_a_removed_users_session_and_tokens_stop_working_at_once(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        victor = await box.login("victor")
        token = await box.token_client("victor")
        assert (await token.call("GET", f"{API}/deployments")).status == 200
        await admin.ok("DELETE", f"{API}/users/victor")
        for client in (victor, token):
            assert (await client.call("GET", f"{API}/deployments")).status == 401

    run_box(tmp_path, t)


def test_removing_a_user_ends_their_open_event_streams(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        stream = await SseReader.open(await box.login("victor"))
        await stream.until("snapshot")
        await admin.ok("DELETE", f"{API}/users/victor")
        assert await stream.ended()
        stream.close()

    run_box(tmp_path, t)


def test_a_password_reset_ends_the_users_sessions(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        victor = await box.login("victor")
        await admin.ok("PATCH", f"{API}/users/victor", {"password": "brand-new-password"})
        reply = await victor.call("GET", f"{API}/session")
        assert reply.status == 401 and error_of(reply)["code"] == "session_expired"
        assert (await box.login("victor", "brand-new-password")).cookie

    run_box(tmp_path, t)


def test_a_user_changes_their_own_password_and_keeps_only_this_session(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        here, elsewhere = await box.login("victor"), await box.login("victor")
        wrong = await here.call(
            "POST", f"{API}/session/password", {"current": "nope-nope", "password": "x" * 12}
        )
        assert wrong.status == 403 and error_of(wrong)["code"] == "wrong_password"
        short = await here.call(
            "POST", f"{API}/session/password", {"current": PASSWORDS["victor"], "password": "x"}
        )
        assert short.status == 422
        body = {"current": PASSWORDS["victor"], "password": "victors-new-password"}
        await here.ok("POST", f"{API}/session/password", body)
        assert (await here.call("GET", f"{API}/session")).status == 200
        assert (await elsewhere.call("GET", f"{API}/session")).status == 401
        assert (await login_reply(ApiClient(box.port), "victor", PASSWORDS["victor"])).status == 401
        assert (await box.login("victor", "victors-new-password")).cookie

    run_box(tmp_path, t)


def test_the_last_admin_can_be_neither_removed_nor_demoted(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        for method, body in (("DELETE", None), ("PATCH", {"role": "viewer"})):
            reply = await admin.call(method, f"{API}/users/alice", body)
            assert reply.status == 409 and error_of(reply)["code"] == "last_admin"
        missing = await admin.call("DELETE", f"{API}/users/nobody")
        assert missing.status == 404
        bad = await admin.call("PATCH", f"{API}/users/victor", {"role": "root"})
        assert bad.status == 422

    run_box(tmp_path, t)


def test_a_viewer_cannot_manage_users_or_tokens(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        victor = await box.login("victor")
        for method, target in (
            ("GET", f"{API}/users"),
            ("DELETE", f"{API}/users/alice"),
            ("PATCH", f"{API}/users/alice"),
            ("GET", f"{API}/tokens"),
            ("DELETE", f"{API}/tokens/0123456789abcdef"),
        ):
            assert (await victor.call(method, target, {})).status == 403, (method, target)

    run_box(tmp_path, t)


# --- tokens -----------------------------------------------------------------------------------


def test_a_token_has_a_name_an_expiry_and_a_last_use_and_a_revoked_one_stops_at_once(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        created = await admin.ok(
            "POST", f"{API}/tokens", {"name": "ci", "expires_in_s": 3600}, status=201
        )
        assert created["name"] == "ci" and created["expires_at"] > box.clock.wall()
        client = ApiClient(box.port)
        client.bearer = created["token"]
        listed = (await admin.ok("GET", f"{API}/tokens"))["tokens"]
        assert [(r["name"], r["last_used_at"]) for r in listed] == [("ci", None)]
        assert all("token" not in r and "token_hash" not in r for r in listed)
        assert (await client.call("GET", f"{API}/deployments")).status == 200
        listed = (await admin.ok("GET", f"{API}/tokens"))["tokens"]
        assert listed[0]["last_used_at"] == box.clock.wall()
        await admin.ok("DELETE", f"{API}/tokens/{created['token_id']}")
        reply = await client.call("GET", f"{API}/deployments")
        assert reply.status == 401 and error_of(reply)["code"] == "invalid_token"
        assert (await admin.ok("GET", f"{API}/tokens"))["tokens"] == []
        actions = [act for _, act, _ in await audit_actions(box)]
        assert "api_token_create" in actions and "api_token_revoke" in actions

    run_box(tmp_path, t)


def test_a_token_stops_working_when_it_expires_on_the_clock(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        created = await admin.ok("POST", f"{API}/tokens", {"expires_in_s": 600}, status=201)
        client = ApiClient(box.port)
        client.bearer = created["token"]
        await box.advance(599)
        assert (await client.call("GET", f"{API}/memory")).status == 200
        await box.advance(1)
        reply = await client.call("GET", f"{API}/memory")
        assert reply.status == 401 and error_of(reply)["code"] == "token_expired"
        bad = await admin.call("POST", f"{API}/tokens", {"expires_in_s": -5})
        assert bad.status == 422

    run_box(tmp_path, t)


def test_a_scrape_token_reads_metrics_and_nothing_else(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        created = await admin.ok(
            "POST", f"{API}/tokens", {"name": "prometheus", "role": "metrics"}, status=201
        )
        scraper = ApiClient(box.port)
        scraper.bearer = created["token"]
        metrics = await scraper.call("GET", "/metrics")
        assert metrics.status == 200 and b"dgxmm_" in metrics.body
        for method, target in (
            ("GET", f"{API}/deployments"),
            ("GET", f"{API}/session"),
            ("GET", f"{API}/audit"),
            ("GET", f"{API}/events/stream"),
            ("POST", f"{API}/deployments"),
            ("POST", f"{API}/tokens"),
            ("GET", f"{API}/users"),
        ):
            reply = await scraper.call(method, target, {})
            assert reply.status == 403, (method, target, reply.status)
        bad = await admin.call("POST", f"{API}/tokens", {"role": "admin"})
        assert bad.status == 422

    run_box(tmp_path, t)
