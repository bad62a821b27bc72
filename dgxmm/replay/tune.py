"""`dgxmm tune`: recommend settings from the recorded traffic (`simulations.tune`).

It prints the goal, the recommendation (or that no point of the grid meets it) and the
trade-off curve: every grid point's objective against its bounded wait, the Pareto front
marked.  It changes nothing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import msgspec
import structlog

from dgxmm.replay.whatif import Progress, apart
from simulations.tune import Tuning, parse_goal, tune
from simulations.whatif import WhatIfError, load_history

EXIT_BAD = 2


def add_parser(sub: Any, common: argparse.ArgumentParser, time_type: Any) -> None:
    """The `tune` subcommand's arguments."""
    p = sub.add_parser(
        "tune", parents=[common], help="recommend settings from the recorded traffic (simulated)"
    )
    p.add_argument("--db", metavar="FILE", help="the event log (default: from the config)")
    p.add_argument("--since", metavar="TIME", type=time_type, help="window start (default: all)")
    p.add_argument("--until", metavar="TIME", type=time_type, help="window end (default: all)")
    p.add_argument(
        "--goal", default="p90<=30,cold_starts",
        help="BOUND<=SECONDS[,OBJECTIVE]: e.g. p90<=30,cold_starts (the default) or"
        " p99<=120,idle_gib_hours",
    )  # fmt: skip
    p.add_argument("--k", type=int, default=1, help="always-on for at most the k most used (1)")
    p.add_argument("--json", action="store_true", help="one JSON object")


async def tune_command(args: argparse.Namespace) -> int:
    """Run the grid; 2 for a bad goal or a log that cannot answer."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        goal = parse_goal(args.goal)
        if not 0 <= args.k <= 8:
            raise ValueError(f"--k {args.k}: 0 to 8")
        history = await load_history(args.db, since=args.since, until=args.until)
    except (ValueError, WhatIfError) as exc:
        sys.stderr.write(f"dgxmm: {exc}\n")
        return EXIT_BAD
    bar = Progress(sys.stderr, 1)
    result = await apart(tune(history, goal, k=args.k, progress=bar.update))
    bar.done()
    if args.json:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    else:
        sys.stdout.write(text(result))
    return 0


def text(result: Tuning) -> str:
    """The recommendation and the curve, as text."""
    goal = result.goal
    out = [f"goal: {goal.describe()}", ""]
    best = result.recommended
    if best is None:
        out.append("no point of the grid meets the goal; the curve shows the nearest")
    else:
        out.append(f"recommended: {best.label}")
        out.append(
            f"  {goal.bound} wait {getattr(best, goal.bound):.1f} s, cold starts"
            f" {best.cold_starts_per_hour:.1f}/h, evictions {best.evictions}, GiB-hours idle"
            f" {best.idle_gib_hours:.1f}"
        )
        settings = " ".join(f"--set {k}={_value(v)}" for k, v in sorted(best.settings.items()))
        out.append(f"  as a what-if: dgxmm whatif {settings}".rstrip())
    out.append("")
    out.append(f"trade-off ({goal.minimise} against {goal.bound} wait; * Pareto front, + meets):")
    ranked = sorted(result.points, key=lambda p: (getattr(p, goal.minimise), p.p90))
    for p in ranked:
        mark = ("*" if p.pareto else " ") + ("+" if p.meets else " ")
        figure, bounded = getattr(p, goal.minimise), getattr(p, goal.bound)
        out.append(f" {mark} {figure:>10.1f}  {goal.bound} {bounded:7.1f} s  {p.label}")
    return "\n".join(out) + "\n"


def _value(value: Any) -> str:
    return "null" if value is None else str(value)
