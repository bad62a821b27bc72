"""The `dgxmm` command line: its subcommands' arguments, and which code runs each.

The subcommands: serve, ps, start, stop, logs, user, token, replay, events, audit, archive.

Every command takes its configuration from `--config FILE`, else `DGXMM_CONFIG`, else the
current directory, else the one DGXMM this user runs (`dgxmm.where`), and says on stderr which
data dir or server it used; the database and the admin address follow from it, and `--db`
(or `--url`) names them instead.  `ps`, `start`, `stop` and `logs` talk to the running server
(see `dgxmm.admin.client`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import os
import re
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
    config_help = (
        "the TOML configuration file (default: $DGXMM_CONFIG, else ./dgxmm-data here, else the"
        " one DGXMM this user runs)"
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help=config_help)
    remote = argparse.ArgumentParser(add_help=False, parents=[common])
    remote.add_argument("--url", metavar="URL", help="the admin API (default: the running server)")
    remote.add_argument("--token", metavar="TOKEN", help="an API token (default: the server's)")

    serve = sub.add_parser(
        "serve", parents=[common], help="run DGXMM (gateway, admin API and UI, controllers)"
    )
    serve.add_argument("--demo", action="store_true", help="run with simulated engines")
    serve.add_argument(
        "--no-litellm",
        action="store_true",
        help="with --demo: DGXMM alone, without the LiteLLM the demo puts in front",
    )

    ps = sub.add_parser("ps", parents=[remote], help="the deployments of the running server")
    ps.add_argument("--json", action="store_true", help="JSON lines")
    for verb in ("start", "stop"):
        cmd = sub.add_parser(verb, parents=[remote], help=f"{verb} a deployment")
        cmd.add_argument("name", metavar="NAME", help="the deployment's name or id")
    logs = sub.add_parser("logs", parents=[remote], help="a deployment's engine log")
    logs.add_argument("name", metavar="NAME", help="the deployment's name or id")
    logs.add_argument("--tail", metavar="N", type=int, default=100, help="the last N lines")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    from dgxmm.admin.gateway_key_cli import add_parser as add_key_parser

    add_key_parser(sub, remote)

    user = sub.add_parser("user", help="manage users")
    user_sub = user.add_subparsers(dest="user_command", required=True, metavar="ACTION")
    add = user_sub.add_parser("add", parents=[common], help="add a user")
    add.add_argument("name")
    add.add_argument("--role", choices=["admin", "viewer"], required=True)
    add.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )
    add.add_argument("--db", metavar="FILE", help="the event log (default: from the config)")
    from dgxmm.admin.accounts_cli import add_parsers

    add_parsers(user_sub, sub)  # user remove|passwd|list, token create|list|revoke
    token_sub = next(
        a for a in sub.choices["token"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    for action in (*user_sub.choices.values(), *token_sub.choices.values()):
        if "--config" not in action._option_string_actions:
            action.add_argument("--config", metavar="FILE", help=config_help)

    when = (
        "ISO 8601 (naive = local time), a time of today (17:30), a time ago (-2h: s, m, h, d) "
        "or epoch seconds"
    )
    relative = "show times as distances from now"
    replay = sub.add_parser(
        "replay",
        parents=[common],
        help="each deployment's state at a moment, and the timeline that led there",
    )
    replay.add_argument("--db", metavar="FILE", help="the event log (default: from the config)")
    replay.add_argument("--until", metavar="TIME", type=_time, help=f"the moment ({when})")
    replay.add_argument("--deployment", metavar="NAME", help="only this deployment (name or id)")
    replay.add_argument("--request", metavar="ID", help="the story of one request instead")
    span = replay.add_mutually_exclusive_group()
    span.add_argument(
        "--last", metavar="N", type=int, help="the last N timeline lines per deployment (50)"
    )
    span.add_argument("--all", action="store_true", help="every timeline line (streamed)")
    replay.add_argument("--json", action="store_true", help="JSON lines, streamed")
    replay.add_argument(
        "--relative", action="store_true", help="show times as distances from --until (or now)"
    )
    replay.add_argument(
        "--timeline", action="store_true", help="draw the window's memory timeline (--out)"
    )
    replay.add_argument(
        "--since",
        metavar="TIME",
        type=_time,
        help="--timeline: from (1 h before, or the log's start)",
    )
    replay.add_argument("--out", metavar="FILE.svg", help="--timeline: the SVG file to write")
    replay.add_argument(
        "--usable-gib", type=float, help="--timeline: the usable memory (default: the log's)"
    )

    events = sub.add_parser(
        "events", parents=[common], help="the raw event log, one line per event"
    )
    events.add_argument("--db", metavar="FILE", help="the event log (default: from the config)")
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

    audit = sub.add_parser("audit", parents=[common], help="the audit trail")
    audit.add_argument("--db", metavar="FILE", help="the event log (default: from the config)")
    audit.add_argument("--deployment", metavar="NAME", help="only this deployment (name or id)")
    audit.add_argument("--since", metavar="TIME", type=_time, help=f"from this moment ({when})")
    audit.add_argument("--json", action="store_true", help="JSON lines")
    audit.add_argument("--relative", action="store_true", help=relative)

    archive = sub.add_parser(
        "archive",
        parents=[common],
        help="move old queue events to an archive file (the audit trail stays)",
    )
    archive.add_argument("--db", metavar="FILE", help="the event log (default: from the config)")
    archive.add_argument(
        "--before", metavar="TIME", type=_time, required=True, help=f"older than ({when})"
    )
    archive.add_argument("--to", metavar="FILE", help="the archive (default: FILE.archive.db)")

    from dgxmm.replay.whatif import add_parser as add_whatif

    add_whatif(sub, common, _time)
    from dgxmm.replay.tune import add_parser as add_tune

    add_tune(sub, common, _time)

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


def _configure(args: argparse.Namespace) -> str | None:
    """Choose the configuration (`dgxmm.where`) into `args.loaded_config`, its paths absolute,
    and fill `args.config`, `args.db` and `args.where` from it; the error message if none.

    `--db` or `--url` (`DGXMM_URL`) name what the command uses: then nothing else is looked
    for, and `args.where` is None (no line to print)."""
    from dgxmm import where
    from dgxmm.config import ConfigError

    flag = getattr(args, "config", None) or None
    url = getattr(args, "url", None) or (
        os.environ.get("DGXMM_URL") if hasattr(args, "url") else None
    )
    named = bool(getattr(args, "db", None) or url)
    creates = args.command == "serve" or getattr(args, "user_command", None) == "add"
    try:
        if named and not flag and not os.environ.get(where.ENV):
            choice = where.Choice(None, None, "the current directory")
        else:
            other = (
                "--db FILE" if hasattr(args, "db") else "--url URL" if hasattr(args, "url") else ""
            )
            choice = where.resolve(flag, creates=creates, other=other)
        args.loaded_config = where.config_of(choice)
    except (ConfigError, where.WhereError) as exc:
        return str(exc)
    args.config = choice.file
    args.where = None if named else choice
    args.db_from_config = hasattr(args, "db") and not args.db
    if args.db_from_config:
        args.db = str(args.loaded_config.server.db_path)
    return None


def _say_where(args: argparse.Namespace, url: str | None = None) -> None:
    """The line that names the data dir (or server) the command uses, and why that one."""
    from dgxmm.where import describe

    if args.where is not None:
        _error(describe(args.where, args.loaded_config, url=url))


def _remote(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    from dgxmm.admin.client import ClientError, find_server

    try:
        _say_where(args, find_server(args.loaded_config, args.url, args.token).url)
        return command(args)
    except ClientError as exc:
        _error(f"{args.command}: {exc.message}")
        return exc.status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dgxmm` console script."""
    from dgxmm.private import private_umask

    old_umask = private_umask()  # what a command creates (log, snapshots, ...) is 0600/0700
    try:
        return _main(argv)
    finally:
        os.umask(old_umask)  # for callers in the same process (tests)


# `--since -2h`: argparse takes a value that starts with "-" for an option unless it looks
# like a negative number, so a time ago is joined to its option before parsing.
_TIME_AGO = re.compile(r"-\d+(\.\d+)?[smhd]")


# The commands that talk to the running server: they name it (and its data dir) once found.
_REMOTE = ("ps", "start", "stop", "logs", "gateway-key")


def _times_ago_joined(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--since", "--until") and _TIME_AGO.fullmatch(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(_times_ago_joined(sys.argv[1:] if argv is None else argv))
    if args.command == "serve" and args.no_litellm and not args.demo:
        parser.error("--no-litellm goes with --demo (without it, [litellm] enabled decides)")
    problem = _configure(args)
    if problem is not None:
        _error(problem)
        return 2
    if args.command not in (*_REMOTE, "serve"):  # serve's banner names its event log
        _say_where(args)
    try:
        match args.command:
            case "serve":
                from dgxmm.where import registered

                with registered(args.loaded_config, args.config):
                    return _delegate("dgxmm.app", "serve_main", args)
            case "ps":
                from dgxmm.admin.client import ps_command

                return _remote(ps_command, args)
            case "start" | "stop":
                from dgxmm.admin.client import start_stop_command

                return _remote(start_stop_command, args)
            case "logs":
                from dgxmm.admin.client import logs_command

                return _remote(logs_command, args)
            case "gateway-key":
                from dgxmm.admin.gateway_key_cli import main as key_main

                return _remote(key_main, args)
            case "user" if args.user_command == "add":
                return _delegate("dgxmm.admin.auth", "add_user_main", args)
            case "user" | "token":
                return _delegate("dgxmm.admin.accounts_cli", "main", args)
            case "replay" if args.timeline:
                from dgxmm.engines.memory import detect_total_bytes
                from dgxmm.replay.timeline_svg import timeline_command

                args.detect_total = detect_total_bytes  # the usable memory, unless configured
                return _run(timeline_command, args)
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
            case "whatif":
                from dgxmm.replay.whatif import whatif_command

                return _run(whatif_command, args)
            case "tune":
                from dgxmm.replay.tune import tune_command
                from dgxmm.tune_apply import apply

                return _run(functools.partial(tune_command, apply=apply), args)
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
