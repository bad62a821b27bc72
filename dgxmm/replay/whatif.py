"""`dgxmm whatif`: the recorded traffic under other settings, side by side with what happened.

It prints, per column: what really happened (from the log and its traffic trace), the
calibration (the simulation with the settings as recorded: its distance from the first
column is the tool's error), and one simulation per `--set` group (each `--set` adds to
the one alternative; `--alt` starts another).  The engine is `simulations.whatif`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, TextIO, TypeVar

import msgspec
import structlog

from simulations.whatif import (
    Fates,
    History,
    Report,
    WhatIfError,
    figures,
    load_history,
    measure_recorded,
    parse_overrides,
    simulate,
)

EXIT_BAD = 2
T = TypeVar("T")


def add_parser(sub: Any, common: argparse.ArgumentParser, time_type: Any) -> None:
    """The `whatif` subcommand's arguments."""
    p = sub.add_parser(
        "whatif",
        parents=[common],
        help="replay the recorded traffic under other settings (simulated)",
    )
    p.add_argument("--db", metavar="FILE", help="the event log (default: from the config)")
    p.add_argument("--since", metavar="TIME", type=time_type, help="window start (default: all)")
    p.add_argument("--until", metavar="TIME", type=time_type, help="window end (default: all)")
    p.add_argument("--deployment", metavar="NAME", help="only this deployment's traffic")
    p.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
        help="a setting of the alternative (repeatable): ondemand_make_room_after_s=30,"
        " NAME.idle_timeout_s=600, NAME.mode=always_on, NAME.make_room_after_s=0",
    )  # fmt: skip
    p.add_argument(
        "--alt", action="append_const", const="--alt", dest="sets",
        help="start another alternative (the --set after it belong to it)",
    )  # fmt: skip
    p.add_argument(
        "--recorded-only", action="store_true",
        help="only what really happened (no simulation): the Settings page's 'since applied'",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object")


def alternatives(sets: list[str]) -> list[list[str]]:
    """The `--set` groups, split at each `--alt`."""
    groups: list[list[str]] = [[]]
    for item in sets:
        if item == "--alt":
            groups.append([])
        else:
            groups[-1].append(item)
    return [g for g in groups if g]


async def whatif_command(args: argparse.Namespace) -> int:
    """Run it; 2 for a bad setting or a log that cannot answer."""
    # The simulated actors' own logs are not the output: errors only, on stderr.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        history = await load_history(
            args.db, since=args.since, until=args.until, deployment=args.deployment
        )
        groups = alternatives(args.sets)
        overrides = [parse_overrides(history, g) for g in groups]
    except WhatIfError as exc:
        sys.stderr.write(f"dgxmm: {exc}\n")
        return EXIT_BAD
    columns = [measure_recorded(history)]
    if not getattr(args, "recorded_only", False):
        bar = Progress(sys.stderr, 1 + len(groups))
        calibration = simulate(history, {}, label="calibration", progress=bar.update)
        columns.append(await apart(calibration))
        for group, over in zip(groups, overrides, strict=True):
            bar.next()
            run = simulate(history, over, label=" ".join(group), progress=bar.update)
            columns.append(await apart(run))
        bar.done()
    if args.json:
        sys.stdout.write(msgspec.json.encode(as_json(history, columns)).decode() + "\n")
    else:
        sys.stdout.write(table(history, columns))
    return 0


def apart(coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """Run a simulation on asyncio's own loop in a thread: the what-if's clock settles in one
    round where the loop shows its ready queue, which uvloop's (the CLI's) does not."""
    return asyncio.to_thread(asyncio.run, coro)


def as_json(history: History, columns: list[Report]) -> dict[str, Any]:
    """The `--json` object."""
    return {
        "since": history.since,
        "until": history.until,
        "requests": len(history.traffic),
        "dropped_requests": history.dropped_requests,
        "cold_start_method": "median of each model's recorded starts",
        "columns": [
            {k: v for k, v in msgspec.structs.asdict(c).items() if k != "waited_ids"}
            for c in columns
        ],
        "figures": [figures(c) for c in columns],  # one unit each, counts per hour
        "waited_agreement": [agreement(columns[0], c) for c in columns[1:]],
        "unsafe": [
            {
                "label": c.label,
                "fails_served": c.fails_served,
                "models": c.fails_served_models,
                "words": unsafe_words(c),
            }
            for c in columns
            if c.fails_served
        ],
    }


def agreement(a: Report, b: Report) -> float:
    """Share of requests on which two columns agree whether they waited."""
    if not a.requests:
        return 1.0
    differ = len(set(a.waited_ids) ^ set(b.waited_ids))
    return 1.0 - differ / a.requests


def table(history: History, columns: list[Report]) -> str:
    """The text table: one row per figure, one column per run."""
    hours = (history.until - history.since) / 3600
    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(c.requests) for c in columns]),
        *fate_rows("", [c.fates for c in columns], [c.refused_by for c in columns]),
        ("wait p50 (s)", [f"{c.waits.p50:.1f}" for c in columns]),
        ("wait p90 (s)", [f"{c.waits.p90:.1f}" for c in columns]),
        ("wait p99 (s)", [f"{c.waits.p99:.1f}" for c in columns]),
        ("requests that waited", [str(c.waited) for c in columns]),
        ("... same as recorded", ["", *(f"{agreement(columns[0], c):.1%}" for c in columns[1:])]),
        ("cold starts / hour", [f"{c.cold_starts_per_hour:.1f}" for c in columns]),
        ("cold starts", [str(c.cold_starts) for c in columns]),
        ("evictions", [str(c.evictions) for c in columns]),
        ("queue timeouts", [str(c.queue_timeouts) for c in columns]),
        ("queue-full refusals", [str(c.queue_full) for c in columns]),
        ("GiB-hours idle", [f"{c.idle_gib_hours:.1f}" for c in columns]),
        ("Jain's index", [f"{c.jain:.2f}" for c in columns]),
    ]
    models = sorted({name for c in columns for name in (*c.per_model, *c.fates_per_model)})
    for name in models:
        per = [c.fates_per_model.get(name, Fates()) for c in columns]
        rows.extend(fate_rows(f"{name} ", per, None))
        for q in ("p50", "p90", "p99"):
            values = [c.per_model.get(name) for c in columns]
            rows.append((f"{name} {q} (s)", [f"{getattr(v, q):.1f}" if v else "-" for v in values]))
    head = [("! " if c.fails_served else "") + c.label for c in columns]
    width0 = max(len(r[0]) for r in rows)
    widths = [max(len(h), *(len(r[1][i]) for r in rows)) for i, h in enumerate(head)]
    out = [
        f"window {_when(history.since)} .. {_when(history.until)} ({hours:.2f} h),"
        f" {len(history.traffic)} requests traced"
        + (f", {history.dropped_requests} dropped" if history.dropped_requests else ""),
        "cold starts: the median of each model's recorded starts",
        "",
        " " * width0 + "  " + "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)),
    ]
    for label, texts in rows:
        line = "  ".join(t.rjust(w) for t, w in zip(texts, widths, strict=True))
        out.append(label.ljust(width0) + "  " + line)
    warnings = [unsafe_words(c) for c in columns if c.fails_served]
    if warnings:
        out.append("")
        out.extend(f"! {w}" for w in warnings)
    return "\n".join(out) + "\n"


FATE_WORDS = {
    "served": "served",
    "refused": "refused",
    "timed_out": "timed out in the queue",
    "stopped": "stopped by an administrator",
}


def fate_rows(
    prefix: str, fates: list[Fates], refused_by: list[dict[str, int]] | None
) -> list[tuple[str, list[str]]]:
    """Each fate's row (overall: every fate, and a row per refusal's code; per model: served,
    and the others where a column has any)."""
    rows: list[tuple[str, list[str]]] = []
    for key, words in FATE_WORDS.items():
        counts = [getattr(f, key) for f in fates]
        if refused_by is not None or key == "served" or any(counts):
            rows.append((f"{prefix}{words}", [str(n) for n in counts]))
        if key == "refused" and refused_by is not None:
            for code in sorted({c for by in refused_by for c in by}):
                rows.append((f"refused: {code}", [str(by.get(code, 0)) for by in refused_by]))
    return rows


def unsafe_words(column: Report) -> str:
    """What marks a column that fails requests the recorded box served."""
    return (
        f"{column.label}: {column.fails_served} requests the recorded box served would be"
        f" refused or time out ({', '.join(column.fails_served_models)})"
    )


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + "Z"


class Progress:
    """A bar on a terminal for runs that take more than a second; nothing otherwise."""

    def __init__(self, out: TextIO, runs: int) -> None:
        self.out = out
        self.runs = runs
        self.run = 0
        self.began = time.monotonic()
        self.tty = out.isatty()
        self.shown = False

    def next(self) -> None:
        self.run += 1

    def update(self, fraction: float) -> None:
        if not self.tty or time.monotonic() - self.began < 1.0:
            return
        total = (self.run + fraction) / self.runs
        filled = int(total * 30)
        self.out.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {total:4.0%}")
        self.out.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            self.out.write("\r" + " " * 40 + "\r")
            self.out.flush()
