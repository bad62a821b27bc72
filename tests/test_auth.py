"""Passwords, tokens, sessions and `dgxmm user add`, on real log files."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.runtime import VirtualClock
from dgxmm.admin.auth import (
    Auth,
    AuthConfig,
    AuthError,
    Backoff,
    backoff_delay,
    ensure_admin,
    hash_password,
    load_users,
    needs_rehash,
    new_api_token,
    parse_api_token,
    parse_cookies,
    verify_password,
)
from events import model as m
from events.state import EMPTY
from storage.eventlog import EventStore
from tests.api_support import TEST_SCRYPT_N, password_hash

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30.0


# --- pure functions -----------------------------------------------------------------------------


def test_a_password_hash_is_scrypt_with_its_parameters_and_a_random_salt() -> None:
    one, two = hash_password("correct horse"), hash_password("correct horse")
    assert one.startswith("scrypt$131072$8$1$")  # N = 2**17, as OWASP recommends
    assert one != two  # different salts
    assert "correct horse" not in one
    assert verify_password("correct horse", one) and verify_password("correct horse", two)
    assert not verify_password("correct horsE", one)


@pytest.mark.parametrize(
    "encoded",
    [
        "",
        "scrypt$1$2",
        "md5$16384$8$1$AAAA$AAAA",
        "scrypt$x$8$1$AAAA$AAAA",
        "scrypt$1048576$99$1$A$A",
    ],
)
def test_a_malformed_hash_never_matches(encoded: str) -> None:
    assert not verify_password("anything", encoded)


def test_an_api_token_is_parsed_back_and_only_its_hash_is_kept() -> None:
    token, token_id, stored = new_api_token()
    parsed = parse_api_token(token)
    assert parsed is not None and parsed[0] == token_id
    assert stored.startswith("sha256$") and parsed[1] not in stored
    assert parse_api_token("dgxmm_xyz_secret") is None
    assert parse_api_token(token + "!") is None


def test_cookies_are_parsed_from_every_cookie_header() -> None:
    headers = [(b"cookie", b"a=1; dgxmm_session=abc"), (b"cookie", b"b=2; a=9")]
    assert parse_cookies(headers) == {"a": "1", "dgxmm_session": "abc", "b": "2"}


def test_the_backoff_waits_double_after_the_free_failures_and_never_lock() -> None:
    assert [backoff_delay(n, 3, 1.0, 900.0) for n in range(7)] == [0, 0, 0, 1, 2, 4, 8]
    assert backoff_delay(40, 3, 1.0, 900.0) == 900.0  # capped: a wait, never a lockout
    assert backoff_delay(10**6, 3, 1.0, 900.0) == 900.0


def test_the_backoff_counts_failures_in_a_row_and_forgets_them_after_a_quiet_time() -> None:
    b = Backoff(free=2, base_s=1.0, cap_s=60.0, forget_after_s=600.0)
    for now in (0.0, 0.1):
        assert b.retry_after("k", now) is None
        b.failed("k", now)
    assert b.retry_after("k", 0.5) == pytest.approx(0.6)  # 1 s after the last failure
    b.failed("k", 1.1)
    assert b.retry_after("k", 2.1) == pytest.approx(1.0)  # now 2 s
    assert b.retry_after("k", 3.2) is None
    assert b.retry_after("k", 700.0) is None and b.failures("k") == 0  # forgotten
    b.failed("k", 701.0)
    b.forget("k")
    assert b.retry_after("k", 701.0) is None


def test_a_hash_with_weaker_parameters_needs_a_rehash() -> None:
    weak = hash_password("correct horse", n=2**14)
    assert needs_rehash(weak)
    assert not needs_rehash(weak, n=2**14)
    assert needs_rehash("garbage")


# --- Auth over a real log -----------------------------------------------------------------------


class LogOnly:
    """No controller: every user comes from the file, as for one written by another process."""

    system = EMPTY


async def open_auth(
    path: Path, config: AuthConfig | None = None
) -> tuple[Auth, EventStore, VirtualClock]:
    clock = VirtualClock()
    store = await EventStore.open(path, wall=clock.wall)
    for name, role in (("alice", "admin"), ("victor", "viewer")):
        await store.append(
            m.STREAM_USERS,
            [m.UserCreated(name=name, role=role, password_hash=password_hash(name))],  # type: ignore[arg-type]
            actor="system",
        )
    config = dataclasses.replace(config or AuthConfig(), scrypt_n=TEST_SCRYPT_N)
    return Auth(LogOnly(), store, clock, config), store, clock


def cookie_headers(auth: Auth, token: str) -> list[tuple[bytes, bytes]]:
    return [(b"cookie", f"dgxmm_session={token}".encode())]


def test_a_session_expires_after_its_idle_time_on_the_clock(tmp_path: Path) -> None:
    async def main() -> None:
        auth, store, clock = await open_auth(tmp_path / "log.db", AuthConfig(session_idle_s=600))
        try:
            session = await auth.login("alice", "alice-password", "127.0.0.1")
            headers = cookie_headers(auth, session.token)
            await clock.advance(599)
            assert (await auth.authenticate(headers)).user == "alice"  # use renews it
            await clock.advance(599)
            assert (await auth.authenticate(headers)).role == "admin"
            await clock.advance(601)
            with pytest.raises(AuthError) as err:
                await auth.authenticate(headers)
            assert (err.value.status, err.value.code) == (401, "session_expired")
        finally:
            await store.close()

    asyncio.run(main())


def test_the_csrf_check_applies_to_sessions_only(tmp_path: Path) -> None:
    async def main() -> None:
        auth, store, clock = await open_auth(tmp_path / "log.db")
        try:
            session = await auth.login("victor", "victor-password", None)
            principal = await auth.authenticate(cookie_headers(auth, session.token))
            with pytest.raises(AuthError) as err:
                auth.check_csrf(principal, [])
            assert err.value.status == 403
            auth.check_csrf(principal, [(b"x-csrf-token", session.csrf.encode())])
            token, _ = await auth.create_token("victor", "admin:alice")
            await clock.advance(2)  # with no controller, the file is re-read at most every 2 s
            bearer = await auth.authenticate([(b"authorization", f"Bearer {token}".encode())])
            assert (bearer.user, bearer.role, bearer.via) == ("victor", "viewer", "token")
            auth.check_csrf(bearer, [])  # no CSRF for a Bearer token
        finally:
            await store.close()

    asyncio.run(main())


def test_an_unknown_user_is_checked_against_a_dummy_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dgxmm.admin.auth

    checked: list[str] = []
    real = dgxmm.admin.auth.verify_password

    def spy(password: str, encoded: str) -> bool:
        checked.append(encoded)
        return real(password, encoded)

    async def main() -> None:
        auth, store, _ = await open_auth(tmp_path / "log.db")
        monkeypatch.setattr(dgxmm.admin.auth, "verify_password", spy)
        try:
            with pytest.raises(AuthError) as err:
                await auth.login("mallory", "whatever-it-is", None)
            assert err.value.message == "invalid name or password"
            assert len(checked) == 1 and checked[0].startswith("scrypt$16384$8$1$")
        finally:
            await store.close()

    asyncio.run(main())


def test_a_user_added_by_another_process_can_log_in_without_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "log.db"

    async def main() -> None:
        auth, store, _ = await open_auth(db)
        try:
            assert set(await auth.users()) == {"alice", "victor"}
            done = await asyncio.to_thread(
                dgxmm, "user", "add", "carol", "--role", "viewer", "--password-stdin",
                "--db", str(db), stdin="carol-password\n",
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            session = await auth.login("carol", "carol-password", None)
            assert session.user == "carol"
        finally:
            await store.close()

    asyncio.run(main())


def test_ensure_admin_creates_admin_once_with_a_random_password(tmp_path: Path) -> None:
    async def main() -> None:
        store = await EventStore.open(tmp_path / "log.db")
        try:
            password = await ensure_admin(store, VirtualClock())
            assert password is not None and len(password) >= 12
            assert await ensure_admin(store, VirtualClock()) is None
            users = await load_users(store)
            assert list(users) == ["admin"] and users["admin"].role == "admin"
            assert verify_password(password, users["admin"].password_hash)
        finally:
            await store.close()

    asyncio.run(main())


# --- dgxmm user add -----------------------------------------------------------------------------


def dgxmm(
    *args: str, stdin: str | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=DEADLINE_S,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def read_users(db: Path) -> dict[str, object]:
    async def main() -> dict[str, object]:
        store = await EventStore.open(db, readonly=True, create=False)
        try:
            return dict(await load_users(store))
        finally:
            await store.close()

    return asyncio.run(main())


def test_user_add_writes_user_created_with_a_hash_and_refuses_a_duplicate(tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    done = dgxmm("user", "add", "alice", "--role", "admin", "--password-stdin", "--db", str(db),
                 stdin="s3cret-passw0rd\n")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "alice" in done.stdout
    users = read_users(db)
    alice = users["alice"]
    assert alice.role == "admin"  # type: ignore[attr-defined]
    assert verify_password("s3cret-passw0rd", alice.password_hash)  # type: ignore[attr-defined]
    assert b"s3cret-passw0rd" not in db.read_bytes()
    again = dgxmm("user", "add", "alice", "--role", "viewer", "--password-stdin", "--db", str(db),
                  stdin="another-password\n")  # fmt: skip
    assert again.returncode == 1
    assert again.stderr.strip() == f"dgxmm: user add: user alice exists in {db}"


def test_user_add_writes_to_the_default_log_under_the_working_directory(tmp_path: Path) -> None:
    done = dgxmm("user", "add", "bob", "--role", "viewer", "--password-stdin",
                 stdin="bob-password", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert list(read_users(tmp_path / "dgxmm-data" / "dgxmm.db")) == ["bob"]


def test_user_add_with_a_bad_file_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("these are not the events you are looking for\n" * 100)
    done = dgxmm("user", "add", "alice", "--role", "admin", "--password-stdin", "--db", str(bad),
                 stdin="s3cret-passw0rd\n")  # fmt: skip
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("dgxmm: ")
    assert bad.read_text().startswith("these are not")


@pytest.mark.parametrize(
    ("args", "stdin"),
    [
        (["alice", "--role", "admin", "--password-stdin"], "short\n"),
        (["alice", "--role", "admin"], None),  # no terminal to prompt on
        (["bad name", "--role", "admin", "--password-stdin"], "long-enough-password\n"),
    ],
)
def test_user_add_refuses_bad_input_with_exit_2(
    tmp_path: Path, args: list[str], stdin: str | None
) -> None:
    db = tmp_path / "log.db"
    done = dgxmm("user", "add", *args, "--db", str(db), stdin=stdin)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1
    assert not db.exists()


def test_a_login_with_a_weaker_hash_rehashes_it_once_and_the_password_still_works(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        config = AuthConfig(scrypt_n=2**15)  # stronger than the users' 2**14 hashes
        auth, store, _clock = await open_auth(tmp_path / "log.db", config)
        auth.config = dataclasses.replace(auth.config, scrypt_n=2**15)
        try:
            await auth.login("alice", "alice-password", "127.0.0.1")
            await auth.login("alice", "alice-password", "127.0.0.1")
            changed = [r.event for r in await store.read(stream=m.STREAM_USERS)
                       if isinstance(r.event, m.PasswordChanged)]  # fmt: skip
            assert [(e.name, e.reason) for e in changed] == [("alice", "rehash")]
            assert changed[0].password_hash.startswith("scrypt$32768$")
            assert (await auth.user("alice")) is not None
        finally:
            await store.close()

    asyncio.run(main())


def test_cookies_are_marked_secure_when_configured(tmp_path: Path) -> None:
    async def main() -> None:
        auth, store, _clock = await open_auth(tmp_path / "log.db", AuthConfig(secure_cookie=True))
        try:
            session = await auth.login("alice", "alice-password", "127.0.0.1")
            for cookie in (auth.session_cookie(session), auth.known_cookie("alice")):
                assert cookie.endswith(b"; Secure") or b"; Secure" in cookie
        finally:
            await store.close()

    asyncio.run(main())
