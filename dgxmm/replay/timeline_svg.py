"""`dgxmm replay --timeline --since T --until T --out FILE.svg`: the timeline as an SVG file.

For incident reports, drawn from the log with no server running: the window is read like the
API reads it (`storage.windows`: a snapshot and the window's events) and projected by
`events.timeline`; this module only draws, in plain SVG written by hand (rectangles, lines,
text; no browser, no library): each deployment's memory stacked in its state's colour, the
usable-memory line, the marks (cold starts with their duration, sleeps, make-room evictions
with an arrow to the model they made room for, failures, the learned policy's pre-warms,
kept-warm sleeps, unused and abandoned pre-warms) with their event as a tooltip, and
the queue waits as bars under the chart, one row per model.  Every drawn element carries its
data in `data-*` attributes, so a test (or a script) can read the picture back.

PNG is not offered: no SVG rasteriser is installed with DGXMM (cairosvg needs the cairo C
library, and ImageMagick is not a dependency); `rsvg-convert FILE.svg -o FILE.png` or any
browser turns the SVG into a picture.

The usable memory is `--usable-gib`, else the budget the box recorded in its log (its
`TraceStarted`, written at each start: the newest at or before the window's end), else the
configuration's `memory.total_gib` less `memory.reserve_gib`, else the memory of the machine
the command runs on less the reserve.  The log comes first because the SVG is drawn for an
incident, often on another machine: a laptop's 16 GiB beside a box's 48 GiB log drew every
model over the line.

The default window is the last hour up to now, fitted to the log: a log that ended more than
an hour ago ends the window at its last record, and a log shorter than the window begins it
at its first (a young box's ten minutes fill the width instead of its rightmost sixth).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import time
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from actors.memory_broker import GIB
from events import model as m
from events.timeline import Piece, Timeline, fitted_since, stack
from storage.eventlog import EventStore
from storage.windows import timeline_window

WIDTH = 1200
LEFT, RIGHT, TOP = 120, 24, 44
PLOT_H = 300
ROW_H = 20
COLOURS = {  # fill, line: the web UI's light theme
    "starting": ("#fff1d6", "#8a5300"),
    "ready": ("#e3f4ea", "#157347"),
    "asleep": ("#e7ebf6", "#3d4f7a"),
    "stopping": ("#eceef2", "#5b6475"),
}
GLYPHS = {
    "cold_start": "▶",
    "idle_sleep": "☾",
    "sleep": "☾",
    "make_room": "⇢",
    "failure": "✕",
    # The learned policy's (issue 44): a pre-warm, a sleep after its keep-warm, a pre-warm
    # no request came to, one abandoned for a queued request.
    "prewarm": "◆",
    "kept_warm": "◐",
    "prewarm_unused": "◇",
    "prewarm_abandoned": "⊘",
}
LEGEND = (
    ("cold start", "▶"),
    ("sleep", "☾"),
    ("made room", "⇢"),
    ("failure", "✕"),
    ("pre-warm", "◆"),
    ("kept warm", "◐"),
    ("pre-warm unused", "◇"),
    ("pre-warm abandoned", "⊘"),
)
DEFAULT_WINDOW_S = 3600.0


def _attr(**data: object) -> str:
    return " ".join(f"data-{k.replace('_', '-')}={quoteattr(str(v))}" for k, v in data.items())


def _ticks(lo: float, hi: float, count: int) -> list[float]:
    """Round values between lo and hi, about `count` of them."""
    raw = (hi - lo) / max(1, count)
    if raw <= 0:
        return [lo]
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _time_ticks(since: float, until: float) -> list[float]:
    span = until - since
    steps = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200)
    step = next((s for s in steps if span / s <= 10), 86400)
    first = math.ceil(since / step) * step
    return [first + i * step for i in range(int((until - first) / step) + 1)]


def _clock(ts: float, span: float) -> str:
    local = dt.datetime.fromtimestamp(ts).astimezone()
    return local.strftime("%H:%M:%S" if span <= 600 else "%H:%M" if span <= 2 * 86400 else "%m-%d")


def default_window(
    since: float | None, until: float | None, log_span: tuple[float, float] | None, now: float
) -> tuple[float, float]:
    """The window drawn when `--since` or `--until` is left out.

    `log_span` is the (first, last) record's time (None: an empty log).  The end is now,
    unless the log ended more than an hour before (then its last record); the start is an
    hour before the end, but not before the log's first record when the log began after it.
    """
    if until is None:
        until = now if log_span is None or now - log_span[1] <= DEFAULT_WINDOW_S else log_span[1]
    if since is None:
        since = fitted_since(until, None if log_span is None else log_span[0], DEFAULT_WINDOW_S)
    return since, until


def render_svg(timeline: Timeline, width: int = WIDTH, usable_source: str = "") -> str:
    """The SVG document of `timeline` (`usable_source`: where its usable memory comes from)."""
    since, until = timeline.since, timeline.until
    span = max(until - since, 1e-9)
    plot_w = width - LEFT - RIGHT
    pieces = stack(timeline)
    top_bytes = max([timeline.usable_bytes, *(p.high_bytes for p in pieces), GIB]) * 1.1
    names = {lane.deployment_id: lane.name for lane in timeline.lanes}
    wait_rows = list(dict.fromkeys(w.deployment_id for w in timeline.waits))
    height = TOP + PLOT_H + 40 + ROW_H * len(wait_rows) + 76

    def x(ts: float) -> float:
        return LEFT + (min(max(ts, since), until) - since) / span * plot_w

    def y(n: float) -> float:
        return TOP + PLOT_H - n / top_bytes * PLOT_H

    def piece_at(dep_id: str, ts: float) -> Piece | None:
        best = None
        for p in pieces:
            if p.deployment_id == dep_id:
                if p.start <= ts <= p.end:
                    return p
                if best is None or abs(p.start - ts) < abs(best.start - ts):
                    best = p
        return best

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Liberation Sans, sans-serif"'
        f' font-size="12" {_attr(since=since, until=until, usable_bytes=timeline.usable_bytes)}'
        f" {_attr(usable_source=usable_source)}>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8"'
        ' markerHeight="8" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"'
        ' fill="#9a3412"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="24" font-size="15" font-weight="600">DGXMM memory timeline,'
        f" {escape(_clock(since, 1e9))} {escape(_clock(since, span))} –"
        f" {escape(_clock(until, 1e9))} {escape(_clock(until, span))}</text>",
    ]
    # Axes and grid.
    for gib in _ticks(0, top_bytes / GIB, 5):
        yy = y(gib * GIB)
        out.append(
            f'<line x1="{LEFT}" x2="{width - RIGHT}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#d9dde5"/>'
            f'<text x="{LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end" fill="#5b6475">'
            f"{gib:g} GiB</text>"
        )
    for ts in _time_ticks(since, until):
        xx = x(ts)
        out.append(
            f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{TOP}" y2="{TOP + PLOT_H}" stroke="#eceef2"/>'
            f'<text x="{xx:.1f}" y="{TOP + PLOT_H + 16}" text-anchor="middle" fill="#5b6475">'
            f"{escape(_clock(ts, span))}</text>"
        )
    # The lanes, stacked.
    for p in pieces:
        fill, line = COLOURS.get(p.state, COLOURS["stopping"])
        x0, x1 = x(p.start), max(x(p.end), x(p.start) + 1.5)
        y0, y1 = y(p.low_bytes), y(p.high_bytes)
        name = names.get(p.deployment_id, p.deployment_id)
        data = _attr(
            deployment=p.deployment_id, name=name, state=p.state,
            start=p.start, end=p.end, low=p.low_bytes, high=p.high_bytes,
        )  # fmt: skip
        out.append(
            f'<rect class="piece" {data}'
            f' x="{x0:.2f}" y="{y1:.2f}" width="{x1 - x0:.2f}" height="{y0 - y1:.2f}"'
            f' fill="{fill}" stroke="{line}" stroke-width="1.2">'
            f"<title>{escape(name)}: {p.state}, {(p.high_bytes - p.low_bytes) / GIB:.1f} GiB"
            "</title></rect>"
        )
        if x1 - x0 > 80 and y0 - y1 > 16:
            out.append(
                f'<text x="{x0 + 5:.1f}" y="{(y0 + y1) / 2 + 4:.1f}" fill="{line}">'
                f"{escape(name)}</text>"
            )
    usable_y = y(timeline.usable_bytes)
    out.append(
        f'<line class="usable" x1="{LEFT}" x2="{width - RIGHT}" y1="{usable_y:.1f}"'
        f' y2="{usable_y:.1f}" stroke="#b42318" stroke-width="1.5" stroke-dasharray="6 4"/>'
        f'<text x="{width - RIGHT}" y="{usable_y - 4:.1f}" text-anchor="end" fill="#b42318">'
        f"usable {timeline.usable_bytes / GIB:.0f} GiB</text>"
    )
    # Make-room arrows, then the marks.
    for mark in timeline.marks:
        if mark.kind != "make_room" or mark.for_deployment is None:
            continue
        start = next(
            (
                k
                for k in timeline.marks
                if k.kind == "cold_start" and k.deployment_id == mark.for_deployment
                and k.ts >= mark.ts
            ),
            None,
        )  # fmt: skip
        to_ts = start.ts if start is not None else mark.ts
        src, dst = piece_at(mark.deployment_id, mark.ts), piece_at(mark.for_deployment, to_ts)
        y0 = y((src.low_bytes + src.high_bytes) / 2) if src else y(0)
        y1 = y((dst.low_bytes + dst.high_bytes) / 2) if dst else y(0)
        x0, x1 = x(mark.ts), max(x(to_ts), x(mark.ts) + 20)
        out.append(
            f'<line class="arrow" {_attr(source=mark.deployment_id, target=mark.for_deployment)}'
            f' x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}" stroke="#9a3412"'
            ' stroke-width="1.8" stroke-dasharray="5 3" marker-end="url(#arrow)"/>'
        )
    for mark in timeline.marks:
        at = mark.end if mark.kind == "cold_start" and mark.end else mark.ts
        under = piece_at(mark.deployment_id, at)
        yy = y(under.high_bytes) if under else y(0)
        text = mark.title
        if mark.event is not None:
            text += f" ({type(mark.event).__name__}, event {mark.seq})"
        duration = "" if mark.duration_s is None else mark.duration_s
        data = _attr(
            kind=mark.kind, deployment=mark.deployment_id, ts=mark.ts,
            duration=duration, for_deployment=mark.for_deployment or "",
        )  # fmt: skip
        out.append(
            f'<g class="mark" {data}>'
            f"<title>{escape(text)}</title>"
            f'<text x="{x(mark.ts):.1f}" y="{yy - 4:.1f}" text-anchor="middle" font-size="13"'
            f' fill="#1d2330">{GLYPHS.get(mark.kind, "•")}</text></g>'
        )
    # Queue waits, one row per model.
    row_top = TOP + PLOT_H + 30
    for i, dep_id in enumerate(wait_rows):
        yy = row_top + i * ROW_H
        out.append(
            f'<text x="{LEFT - 6}" y="{yy + 13}" text-anchor="end" fill="#5b6475" font-size="11">'
            f"queue {escape(names.get(dep_id, dep_id)[:18])}</text>"
            f'<rect x="{LEFT}" y="{yy + 2}" width="{plot_w}" height="{ROW_H - 4}" fill="#f5f6f8"/>'
        )
        for w in (w for w in timeline.waits if w.deployment_id == dep_id):
            x0 = x(w.start)
            x1 = max(x(w.end), x0 + 3)
            data = _attr(
                request=w.request_id, deployment=w.deployment_id,
                start=w.start, end=w.end, outcome=w.outcome,
            )  # fmt: skip
            out.append(
                f'<rect class="wait" {data}'
                f' x="{x0:.2f}" y="{yy + 4}" width="{x1 - x0:.2f}" height="{ROW_H - 8}"'
                ' fill="#ffe6d5" stroke="#9a3412">'
                f"<title>request {escape(w.request_id)}: waited {w.end - w.start:.1f} s,"
                f" {escape(w.outcome)}</title></rect>"
            )
    # Legend.
    ly = height - 38
    lx = float(LEFT)
    for state, (fill, line) in COLOURS.items():
        out.append(
            f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{fill}" stroke="{line}"/>'
            f'<text x="{lx + 16}" y="{ly}">{state}</text>'
        )
        lx += 90
    for i, (kind, glyph) in enumerate(LEGEND):
        if i == 4:  # the learned policy's marks: a row of their own, under the others
            lx, ly = float(LEFT), ly + 16
        out.append(f'<text class="legend-mark" x="{lx}" y="{ly}">{glyph} {kind}</text>')
        lx += 40 + 7 * len(kind)
    if timeline.waits_omitted:
        out.append(
            f'<text x="{lx}" y="{ly}" fill="#5b6475">'
            f"{timeline.waits_omitted} shorter waits not drawn</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


async def _recorded_budget(store: EventStore, until: float) -> int | None:
    """The usable memory the box recorded: its newest `TraceStarted` at or before `until`,
    else its first (the window is older than the trace); None if the log has none."""
    kind = ("TraceStarted",)
    newest = store.iterate(
        stream=m.STREAM_TRAFFIC, types=kind, until_ts=until, descending=True, limit=1
    )
    found = [rec async for rec in newest]
    found = found or await store.read(stream=m.STREAM_TRAFFIC, types=kind, limit=1)
    for rec in found:
        if isinstance(rec.event, m.TraceStarted):
            return rec.event.usable_bytes
    return None


async def _usable_bytes(args: argparse.Namespace, recorded: int | None) -> tuple[int, str]:
    """The usable memory to draw, and where it comes from (see the module's doc)."""
    if getattr(args, "usable_gib", None) is not None:
        return int(args.usable_gib * GIB), "--usable-gib"
    if recorded is not None:
        return recorded, "recorded in the log"
    config = getattr(args, "loaded_config", None)
    memory = getattr(config, "memory", None)
    reserve = float(getattr(memory, "reserve_gib", 8.0))
    total_gib = getattr(memory, "total_gib", None)
    if total_gib is not None:
        return max(0, int((total_gib - reserve) * GIB)), "the configuration's memory.total_gib"
    # `dgxmm.cli` hands in dgxmm.engines.memory's detection (replay does not import engines).
    total, _ = await args.detect_total()
    return max(0, int(total) - int(reserve * GIB)), "this machine's memory (the log records none)"


async def _log_span(store: EventStore) -> tuple[float, float] | None:
    """The time of the log's first and last records (None: an empty log)."""
    first = await store.read(limit=1)
    last = [rec async for rec in store.iterate(descending=True, limit=1)]
    return (first[0].ts, last[0].ts) if first and last else None


async def timeline_command(args: argparse.Namespace) -> int:
    """Write the window's timeline to `--out` (SVG)."""
    out = Path(args.out) if args.out else None
    if out is None or out.suffix.lower() != ".svg":
        from dgxmm.replay import NotInLog

        why = (
            "PNG is not offered (no SVG rasteriser is installed; convert the SVG instead)"
            if out is not None and out.suffix.lower() == ".png"
            else "--timeline writes an SVG file: give --out FILE.svg"
        )
        raise NotInLog(why)
    store = await EventStore.open(args.db, create=False, readonly=True)
    try:
        span = None if args.since is not None and args.until is not None else await _log_span(store)
        since, until = default_window(args.since, args.until, span, time.time())
        if since >= until:
            from dgxmm.replay import NotInLog

            raise NotInLog("--since must be before --until")
        usable, source = await _usable_bytes(args, await _recorded_budget(store, until))
        timeline = await timeline_window(store, since, until, usable)
    finally:
        await store.close()
    out.write_text(render_svg(timeline, usable_source=source), encoding="utf-8")
    print(
        f"{out}: {len(timeline.lanes)} deployments, {len(timeline.marks)} marks,"
        f" {len(timeline.waits)} queue waits; usable {usable / GIB:.0f} GiB ({source});"
        f" {_clock(since, 1e9)} {_clock(since, 0)} – {_clock(until, 1e9)} {_clock(until, 0)}"
    )
    return 0
