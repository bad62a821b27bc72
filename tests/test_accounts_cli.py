"""`dgxmm user remove|passwd|list` and `dgxmm token create|list|revoke` against a serving box."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from dgxmm.admin.accounts_cli import parse_duration
from tests.api_support import PASSWORDS, ApiClient, Box, error_of, run_box
from tests.test_cli import dgxmm

API = "/dgxmm/api"


async def cli(box: Box, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    db = str(box.harness.store.path)
    if stdin is None:
        return await asyncio.to_thread(dgxmm, *args, "--db", db)
    return await asyncio.to_thread(dgxmm_stdin, stdin, *args, "--db", db)


def dgxmm_stdin(text: str, *args: str) -> subprocess.CompletedProcess[str]:
    import os
    import sys

    from tests.test_cli import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "dgxmm.cli", *args],
        input=text, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip


def test_user_remove_on_the_command_line_ends_the_session_at_the_servers_next_request(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        victor = await box.login("victor")
        assert (await victor.call("GET", f"{API}/session")).status == 200
        done = await cli(box, "user", "remove", "victor")
        assert done.returncode == 0, done.stderr
        reply = await victor.call("GET", f"{API}/session")
        assert reply.status == 401 and error_of(reply)["code"] == "session_expired"
        again = await cli(box, "user", "remove", "victor")
        assert again.returncode == 1 and again.stderr.splitlines() == [
            "dgxmm: user remove: no user victor"
        ]
        last = await cli(box, "user", "remove", "alice")
        assert last.returncode == 1 and "last admin" in last.stderr

    run_box(tmp_path, t)


def test_user_passwd_from_stdin_sets_the_password_and_ends_the_sessions(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        victor = await box.login("victor")
        done = await cli(
            box, "user", "passwd", "victor", "--password-stdin", stdin="new-secret-1\n"
        )
        assert done.returncode == 0, done.stderr
        assert (await victor.call("GET", f"{API}/session")).status == 401
        old = await ApiClient(box.port).call(
            "POST", f"{API}/login", {"name": "victor", "password": PASSWORDS["victor"]}
        )
        assert old.status == 401
        assert (await box.login("victor", "new-secret-1")).cookie
        short = await cli(box, "user", "passwd", "victor", "--password-stdin", stdin="short\n")
        assert short.returncode == 2 and len(short.stderr.splitlines()) == 1
        tty = await cli(box, "user", "passwd", "victor")  # no terminal, no --password-stdin
        assert tty.returncode == 2 and "--password-stdin" in tty.stderr

    run_box(tmp_path, t)


def test_a_metrics_token_made_on_the_command_line_reads_metrics_and_a_revoke_stops_it(
    tmp_path: Path,
) -> None:
    async def t(box: Box) -> None:
        made = await cli(box, "token", "create", "--role", "metrics", "--name", "prometheus",
                         "--expires-in", "30d")  # fmt: skip
        assert made.returncode == 0, made.stderr
        [token] = made.stdout.splitlines()
        scraper = ApiClient(box.port)
        scraper.bearer = token
        assert (await scraper.call("GET", "/metrics")).status == 200
        assert (await scraper.call("GET", f"{API}/deployments")).status == 403
        listed = await cli(box, "token", "list", "--json")
        [row] = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (row["user"], row["name"], row["role"]) == ("alice", "prometheus", "metrics")
        assert row["last_used_at"] is not None and token not in listed.stdout
        table = await cli(box, "token", "list")
        assert row["token_id"] in table.stdout and "prometheus" in table.stdout
        revoked = await cli(box, "token", "revoke", row["token_id"])
        assert revoked.returncode == 0, revoked.stderr
        assert (await scraper.call("GET", "/metrics")).status == 401
        unknown = await cli(box, "token", "revoke", "0123456789abcdef")
        assert unknown.returncode == 1 and len(unknown.stderr.splitlines()) == 1

    run_box(tmp_path, t)


def test_user_list_shows_names_and_roles_never_hashes(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        done = await cli(box, "user", "list", "--json")
        rows = [json.loads(line) for line in done.stdout.splitlines()]
        assert [(r["name"], r["role"]) for r in rows] == [("alice", "admin"), ("victor", "viewer")]
        assert "scrypt" not in done.stdout

    run_box(tmp_path, t)


def test_commands_on_a_missing_log_say_so_in_one_line_and_do_not_create_it(tmp_path: Path) -> None:
    db = tmp_path / "nope.db"
    for args in (("user", "remove", "x"), ("token", "list"), ("token", "revoke", "ab"),
                 ("user", "list")):  # fmt: skip
        done = dgxmm(*args, "--db", str(db))
        assert done.returncode == 2 and done.stderr.splitlines() == [f"dgxmm: {db}: no such file"]
    assert not db.exists()


def test_durations_take_seconds_minutes_hours_and_days() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "15m", "12h", "30d")] == [
        90, 90, 900, 43200, 2592000,
    ]  # fmt: skip
    for bad in ("", "-5", "1w", "5", "1e9", "99999999d"):
        try:
            parse_duration(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
