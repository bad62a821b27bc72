"""The `dgxmm` command: serve, user, token, replay, events, audit, archive."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import uvloop

from storage.errors import StorageError

PROG = "dgxmm"


def _time(text: str) -> float:
    from dgxmm.replay import parse_time

    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="DGXMM: a model manager for one DGX-class box."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run DGXMM (gateway, admin API and UI, controllers)")
    serve.add_argument("--config", metavar="FILE", help="the TOML configuration file")
    serve.add_argument("--demo", action="store_true", help="run with simulated engines")

    user = sub.add_parser("user", help="manage users")
    user_sub = user.add_subparsers(dest="user_command", required=True, metavar="ACTION")
    add = user_sub.add_parser("add", help="add a user")
    add.add_argument("name")
    add.add_argument("--role", choices=["admin", "viewer"], required=True)
    add.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )
    add.add_argument("--db", metavar="FILE", help="the event log (default: from the config)")
    from dgxmm.admin.accounts_cli import add_parsers

    add_parsers(user_sub, sub)  # user remove|passwd|list, token create|list|revoke

    when = "ISO 8601 (naive = local time) or epoch seconds"
    relative = "show times as distances (from --until, or from now)"
    replay = sub.add_parser(
        "replay", help="each deployment's state at a moment, and the timeline that led there"
    )
    replay.add_argument("--db", metavar="FILE", required=True, help="the event log")
    replay.add_argument("--until", metavar="TIME", type=_time, help=f"the moment ({when})")
    replay.add_argument("--deployment", metavar="NAME", help="only this deployment (name or id)")
    replay.add_argument("--request", metavar="ID", help="the story of one request instead")
    span = replay.add_mutually_exclusive_group()
    span.add_argument(
        "--last", metavar="N", type=int, help="the last N timeline lines per deployment (50)"
    )
    span.add_argument("--all", action="store_true", help="every timeline line (streamed)")
    replay.add_argument("--json", action="store_true", help="JSON lines, streamed")
    replay.add_argument("--relative", action="store_true", help=relative)

    events = sub.add_parser("events", help="the raw event log, one line per event")
    events.add_argument("--db", metavar="FILE", required=True, help="the event log")
    events.add_argument(
        "--follow", action="store_true", help="print new events as they come (from now)"
    )
    events.add_argument("--since", metavar="TIME", type=_time, help=f"from this moment ({when})")
    events.add_argument("--deployment", metavar="NAME", help="only this deployment (name or id)")
    events.add_argument(
        "--type", metavar="TYPE", action="append", help="only these event types (repeatable, a,b)"
    )
    events.add_argument("--json", action="store_true", help="JSON lines")
    events.add_argument("--relative", action="store_true", help=relative)

    audit = sub.add_parser("audit", help="the audit trail")
    audit.add_argument("--db", metavar="FILE", required=True, help="the event log")
    audit.add_argument("--deployment", metavar="NAME", help="only this deployment (name or id)")
    audit.add_argument("--since", metavar="TIME", type=_time, help=f"from this moment ({when})")
    audit.add_argument("--json", action="store_true", help="JSON lines")
    audit.add_argument("--relative", action="store_true", help=relative)

    archive = sub.add_parser(
        "archive", help="move old queue events to an archive file (the audit trail stays)"
    )
    archive.add_argument("--db", metavar="FILE", required=True, help="the event log")
    archive.add_argument(
        "--before", metavar="TIME", type=_time, required=True, help=f"older than ({when})"
    )
    archive.add_argument("--to", metavar="FILE", help="the archive (default: FILE.archive.db)")

    return parser


def _error(message: str) -> None:
    sys.stderr.write(f"{PROG}: {message}\n")
    sys.stderr.flush()


def _delegate(module: str, function: str, args: argparse.Namespace) -> int:
    """Call `module.function(args)`, written elsewhere; exit 2 if that module is not built."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        _error(f"{args.command}: not available in this build ({module} is missing)")
        return 2
    entry: Callable[[argparse.Namespace], Any] = getattr(mod, function)
    result = entry(args)
    if asyncio.iscoroutine(result):
        result = uvloop.run(result)
    return result if isinstance(result, int) else 0


def _run(command: Callable[[argparse.Namespace], Coroutine[Any, Any, int]], args: Any) -> int:
    from dgxmm.replay import NotInLog

    try:
        return uvloop.run(command(args))
    except StorageError as exc:
        _error(str(exc))
        return 2
    except NotInLog as exc:
        _error(str(exc))
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dgxmm` console script."""
    from dgxmm.private import private_umask

    old_umask = private_umask()  # what a command creates (log, snapshots, ...) is 0600/0700
    try:
        return _main(argv)
    finally:
        os.umask(old_umask)  # for callers in the same process (tests)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        match args.command:
            case "serve":
                return _delegate("dgxmm.app", "serve_main", args)
            case "user" if args.user_command == "add":
                return _delegate("dgxmm.admin.auth", "add_user_main", args)
            case "user" | "token":
                return _delegate("dgxmm.admin.accounts_cli", "main", args)
            case "replay":
                from dgxmm.replay import replay_command

                return _run(replay_command, args)
            case "events":
                from dgxmm.replay import events_command

                return _run(events_command, args)
            case "audit":
                from dgxmm.replay import audit_command

                return _run(audit_command, args)
            case "archive":
                from dgxmm.replay import archive_command

                return _run(archive_command, args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining
        # about the unflushed stdout on exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    raise AssertionError(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
