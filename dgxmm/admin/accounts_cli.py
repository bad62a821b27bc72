"""`dgxmm user remove|passwd|list` and `dgxmm token create|list|revoke`, on the log file.

They write the same events as the admin API (dgxmm/admin/accounts.py decides), with the
actor `system`; a running server applies them at its next request.  Exit codes: 0 done,
1 refused (no such user or token, the last admin), 2 usage or an unusable log file.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import re
import sys
import time
from pathlib import Path

import msgspec

from dgxmm.admin.accounts import token_revoked, token_rows, user_removed, user_rows
from dgxmm.admin.auth import (
    DEFAULT_DB,
    AuthError,
    _read_password,
    _Usage,
    check_password,
    hash_password,
    load_users,
    token_created,
)
from events import model as m
from events.state import UserRecord
from storage.errors import ConcurrencyError, StorageError
from storage.eventlog import EventStore

_DURATION = re.compile(r"^(\d{1,7})([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `12h`, `30d` as seconds; ValueError otherwise."""
    found = _DURATION.match(text.strip().lower())
    if found is None:
        raise ValueError(f"{text!r} is not a duration (e.g. 3600, 90m, 12h, 30d)")
    seconds = int(found.group(1)) * _UNIT_S[found.group(2)]
    if not 60 <= seconds <= 10 * 366 * 86400:
        raise ValueError("a token lives from 1 minute to 10 years")
    return float(seconds)


def _error(message: str) -> None:
    sys.stderr.write(f"dgxmm: {message}\n")
    sys.stderr.flush()


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M")


async def _open(args: argparse.Namespace) -> EventStore:
    db = Path(args.db) if getattr(args, "db", None) else DEFAULT_DB
    return await EventStore.open(db, create=False)


async def _users(store: EventStore) -> tuple[dict[str, UserRecord], int]:
    return await load_users(store), await store.version(m.STREAM_USERS)


async def _append(store: EventStore, event: m.AnyEvent, version: int) -> None:
    try:
        await store.append(m.STREAM_USERS, [event], actor="system", expected_version=version)
    except ConcurrencyError:
        raise AuthError(409, "conflict", "the users changed meanwhile; run it again") from None


async def _run(what: str, args: argparse.Namespace) -> int:
    try:
        store = await _open(args)
    except StorageError as exc:
        _error(str(exc))
        return 2
    try:
        return await _COMMANDS[what](store, args)
    except AuthError as exc:
        _error(f"{what}: {exc.message}")
        return 2 if exc.status == 422 else 1
    except _Usage as exc:
        _error(f"{what}: {exc}")
        return 2
    except (EOFError, KeyboardInterrupt):
        _error(f"{what}: no password given")
        return 2
    except StorageError as exc:
        _error(str(exc))
        return 2
    finally:
        await store.close()


async def _user_remove(store: EventStore, args: argparse.Namespace) -> int:
    users, version = await _users(store)
    await _append(store, user_removed(users, args.name), version)
    sys.stdout.write(f"removed {args.name}; their sessions and API tokens no longer work\n")
    return 0


async def _user_passwd(store: EventStore, args: argparse.Namespace) -> int:
    users, _ = await _users(store)
    if args.name not in users:
        raise AuthError(404, "user_not_found", f"no user {args.name}")
    password = _read_password(bool(args.password_stdin), args.name)
    check_password(password)
    encoded = await asyncio.to_thread(hash_password, password)
    _, version = await _users(store)
    event = m.PasswordChanged(name=args.name, password_hash=encoded, reason="reset")
    await _append(store, event, version)
    sys.stdout.write(f"password of {args.name} changed; their sessions have ended\n")
    return 0


async def _user_list(store: EventStore, args: argparse.Namespace) -> int:
    rows = user_rows(await load_users(store))
    if args.json:
        for row in rows:
            sys.stdout.write(msgspec.json.encode(row).decode() + "\n")
        return 0
    sys.stdout.write(f"{'NAME':24} {'ROLE':8} {'TOKENS':>6}  CREATED\n")
    for row in rows:
        created = _when(row["created_at"])
        sys.stdout.write(f"{row['name']:24} {row['role']:8} {row['tokens']:>6}  {created}\n")
    return 0


async def _token_create(store: EventStore, args: argparse.Namespace) -> int:
    users, version = await _users(store)
    owner = args.user
    if owner is None:  # the first admin the log knows owns tokens made without --user
        owner = next((u.name for u in users.values() if u.role == "admin"), None)
        if owner is None:
            raise AuthError(404, "user_not_found", "no admin in the log; name one with --user")
    try:
        lifetime = parse_duration(args.expires_in) if args.expires_in else None
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    now = time.time()
    expires_at = None if lifetime is None else now + lifetime
    token, event = token_created(
        users, owner, label=args.name or "", expires_at=expires_at, role=args.role, now=now
    )
    await _append(store, event, version)
    role = args.role or f"{users[owner].role} (as {owner})"
    sys.stderr.write(
        f"created API token {event.token_id} ({role}, expires {_when(expires_at)});"
        " it is shown only now:\n"
    )
    sys.stdout.write(token + "\n")
    return 0


async def _token_list(store: EventStore, args: argparse.Namespace) -> int:
    rows = token_rows(await load_users(store), time.time())
    if args.json:
        for row in rows:
            sys.stdout.write(msgspec.json.encode(row).decode() + "\n")
        return 0
    head = f"{'TOKEN ID':16}  {'USER':16} {'NAME':16} {'ROLE':8} {'CREATED':16}  "
    sys.stdout.write(head + f"{'EXPIRES':16}  LAST USED\n")
    for r in rows:
        expires = "expired" if r["expired"] else _when(r["expires_at"])
        sys.stdout.write(
            f"{r['token_id']:16}  {r['user']:16} {r['name'] or '-':16} {r['role']:8} "
            f"{_when(r['created_at']):16}  {expires:16}  {_when(r['last_used_at'])}\n"
        )
    return 0


async def _token_revoke(store: EventStore, args: argparse.Namespace) -> int:
    users, version = await _users(store)
    event = token_revoked(users, args.token_id)
    await _append(store, event, version)
    sys.stdout.write(f"revoked API token {event.token_id} of {event.name}\n")
    return 0


_COMMANDS = {
    "user remove": _user_remove,
    "user passwd": _user_passwd,
    "user list": _user_list,
    "token create": _token_create,
    "token list": _token_list,
    "token revoke": _token_revoke,
}


def add_parsers(user_sub: argparse._SubParsersAction, sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `user remove|passwd|list` to `user_sub` and the `token` command to `sub`."""
    db_help = "the event log (default: dgxmm-data/dgxmm.db)"
    remove = user_sub.add_parser("remove", help="remove a user (sessions and tokens end)")
    remove.add_argument("name")
    remove.add_argument("--db", metavar="FILE", help=db_help)
    passwd = user_sub.add_parser("passwd", help="set a user's password (sessions end)")
    passwd.add_argument("name")
    passwd.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )
    passwd.add_argument("--db", metavar="FILE", help=db_help)
    users = user_sub.add_parser("list", help="list users")
    users.add_argument("--db", metavar="FILE", help=db_help)
    users.add_argument("--json", action="store_true", help="JSON lines")

    token = sub.add_parser("token", help="manage API tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    create = token_sub.add_parser("create", help="issue a token (printed once)")
    create.add_argument("--user", metavar="NAME", help="its owner (default: the first admin)")
    create.add_argument("--name", metavar="LABEL", help="what it is for, e.g. prometheus")
    create.add_argument("--expires-in", metavar="DURATION", help="e.g. 90d, 12h (default: never)")
    create.add_argument(
        "--role", choices=["metrics"], help="metrics: reads /metrics and nothing else"
    )
    create.add_argument("--db", metavar="FILE", help=db_help)
    listing = token_sub.add_parser("list", help="list tokens (never their secrets)")
    listing.add_argument("--db", metavar="FILE", help=db_help)
    listing.add_argument("--json", action="store_true", help="JSON lines")
    revoke = token_sub.add_parser("revoke", help="revoke a token (it stops working at once)")
    revoke.add_argument("token_id", metavar="TOKEN_ID")
    revoke.add_argument("--db", metavar="FILE", help=db_help)


def main(args: argparse.Namespace) -> int:
    """Run `dgxmm user remove|passwd|list` or `dgxmm token ...`."""
    import structlog
    import uvloop

    # Standard output carries what scripts read (a new token, JSON lines): the log's own
    # messages (e.g. the store catching its read models up) go to standard error.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

    action = args.user_command if args.command == "user" else args.token_command
    return int(uvloop.run(_run(f"{args.command} {action}", args)))
