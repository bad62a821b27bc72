"""`dgxmm tune`: recommend safe settings from the recorded traffic, and apply them.

It prints the goal, the search's size, the recommendation beside the settings as they are
(what it saves and what it costs: idle GiB-hours, cold starts per hour, the worst model's p90
wait), the commands that show it and apply it, and the trade-off curve: every point's
objective against its bounded wait, the Pareto front marked, the infeasible points with
their reason.  Every count is per hour of traffic.

`--apply` sends the recommendation to the running DGXMM (`POST /settings/tune/apply`, an
administrator's call, which changes the settings as the Settings page's Apply button does
and records one audited event holding the prediction); it shows the changes and asks first,
unless `--yes`.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from dgxmm.replay.whatif import Progress, apart
from simulations.tune import OBJECTIVE_WORDS, OBJECTIVES, Point, Tuning, parse_goal, tune
from simulations.whatif import Figures, WhatIfError, load_history

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
    p.add_argument("--k", type=int, default=1, help="always-on for at most k models at once (1)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument(
        "--apply", action="store_true",
        help="apply the recommendation to the running DGXMM (an administrator; asks first)",
    )  # fmt: skip
    p.add_argument("--yes", action="store_true", help="with --apply: do not ask")
    p.add_argument("--url", metavar="URL", help="with --apply: the admin API (default: the server)")
    p.add_argument("--token", metavar="TOKEN", help="with --apply: an API token")


async def tune_command(
    args: argparse.Namespace, apply: Callable[[argparse.Namespace, Tuning], int] | None = None
) -> int:
    """`dgxmm tune`; with --apply, `apply` sends the recommendation to the running DGXMM
    (`dgxmm.tune_apply`: the admin client is the application's, not the replay's)."""
    """Run the search; 2 for a bad goal or a log that cannot answer."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        goal = parse_goal(args.goal)
        if not 0 <= args.k <= 3:
            raise ValueError(f"--k {args.k}: 0 to 3")
        history = await load_history(args.db, since=args.since, until=args.until)
    except (ValueError, WhatIfError) as exc:
        sys.stderr.write(f"dgxmm: {exc}\n")
        return EXIT_BAD
    bar = Progress(sys.stderr, 1)
    result = await apart(tune(history, goal, k=args.k, progress=bar.update))
    bar.done()
    db = None if getattr(args, "db_from_config", False) else args.db
    if args.json:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    else:
        sys.stdout.write(text(result, db))
    if args.apply and apply is not None:
        return apply(args, result)
    return 0


def apply_body(result: Tuning) -> dict[str, Any]:
    """What `POST /settings/tune/apply` takes: the settings and the prediction."""
    best = result.recommended
    assert best is not None and best.figures is not None
    return {
        "settings": best.settings,
        "changes": best.changes,
        "label": best.label,
        "goal": result.goal.describe(),
        "prediction": msgspec.to_builtins(best.figures),
        "baseline": msgspec.to_builtins(result.baseline.figures),
    }


def _figures(f: Figures) -> str:
    worst = f" ({f.worst_model})" if f.worst_model else ""
    return (
        f"p90 wait {f.p90:.1f} s, worst model's p90 {f.worst_p90:.1f} s{worst},"
        f" {f.cold_starts_per_hour:.1f} cold starts/h, {f.idle_gib_hours_per_hour:.1f} idle"
        f" GiB-hours/h"
    )


def trade(now: Figures, then: Figures) -> str:
    """What the recommendation saves and what it costs against the settings as they are."""
    saves, costs = [], []
    for label, a, b, unit in (
        ("p90 wait", now.p90, then.p90, " s"),
        ("worst model's p90", now.worst_p90, then.worst_p90, " s"),
        ("cold starts", now.cold_starts_per_hour, then.cold_starts_per_hour, "/h"),
        ("idle GiB-hours", now.idle_gib_hours_per_hour, then.idle_gib_hours_per_hour, "/h"),
    ):
        if round(b - a, 1) < 0:
            saves.append(f"{label} {a - b:.1f}{unit}")
        elif round(b - a, 1) > 0:
            costs.append(f"{label} +{b - a:.1f}{unit}")
    return f"saves: {', '.join(saves) or 'nothing'}; costs: {', '.join(costs) or 'nothing'}"


def command(db: str | None, rest: list[str]) -> str:
    """A follow-up command line, as it runs (the log named when it was)."""
    head = ["dgxmm", *rest[:1], *(["--db", db] if db else []), *rest[1:]]
    return " ".join(shlex.quote(w) for w in head)


def text(result: Tuning, db: str | None = None) -> str:
    """The recommendation and the curve, as text."""
    goal = result.goal
    unit = OBJECTIVE_WORDS[goal.minimise]
    out = [
        f"goal: {goal.describe()}",
        f"traffic: {result.requests} requests over {result.hours:.2f} h;"
        f" searched {result.searched}",
        "",
    ]
    best, now = result.recommended, result.baseline.figures
    if now is not None:
        out.append(f"as now:       {_figures(now)}")
        if not result.baseline.feasible:
            out.append(f"  as now is not safe either: {result.baseline.infeasible}")
    if best is None or best.figures is None:
        out.append("no safe point meets the goal; the curve shows the nearest")
    elif not best.settings:
        out.append("recommended: keep the settings as they are")
    else:
        f = best.figures
        out.append(f"recommended:  {_figures(f)}")
        out.append(f"  {best.label}")
        if now is not None:
            out.append(f"  {trade(now, f)}")
        out.append(
            f"  every request the recorded box served is served ({f.fates.served} served,"
            f" {f.fates.refused} refused, {f.fates.timed_out} timed out, {f.fates.stopped}"
            " stopped)"
        )
        sets = [w for c in best.changes for w in ("--set", c)]
        out.append(f"  to see it:  {command(db, ['whatif', *sets])}")
        out.append(f"  to apply:   {command(db, ['tune', '--goal', goal_text(result), '--apply'])}")
    out.append("")
    out.append(
        f"trade-off ({unit} against {goal.bound} wait; * Pareto front, + meets the goal,"
        " x infeasible):"
    )
    simulated = [p for p in result.points if p.figures is not None]
    ranked = sorted(simulated, key=lambda p: (_obj(p, goal.minimise), _bound(p, goal.bound)))
    for p in ranked:
        mark = "x " if not p.feasible else ("*" if p.pareto else " ") + ("+" if p.meets else " ")
        figure, bounded = _obj(p, goal.minimise), _bound(p, goal.bound)
        line = f" {mark} {figure:>8.1f}  {goal.bound} {bounded:7.1f} s  {p.label}"
        out.append(line + (f"  [infeasible: {p.infeasible}]" if not p.feasible else ""))
    for p in result.points:
        if p.figures is None:
            out.append(
                f" x {'-':>8}  {goal.bound} {'-':>7}    {p.label}  [infeasible: {p.infeasible}]"
            )
    return "\n".join(out) + "\n"


def goal_text(result: Tuning) -> str:
    """The goal as `--goal` takes it."""
    g = result.goal
    return f"{g.bound}<={g.limit_s:g},{g.minimise}"


def _obj(p: Point, minimise: str) -> float:
    assert p.figures is not None
    return float(getattr(p.figures, OBJECTIVES[minimise]))


def _bound(p: Point, bound: str) -> float:
    assert p.figures is not None
    return float(getattr(p.figures, bound))
