"""The timeline's API: the box over a window, and one request's story, for the web UI's chart.

- `GET /api/timeline?since=T&until=T` (or `from`/`to`): `events.timeline`'s projection of the window
  (default: the last hour up to now, from the log's first record when the log is younger,
  so the dashboard's live chart of a young box is readable; at most `MAX_WINDOW_S`), read through
  `storage.windows` (a snapshot plus the window's events, never the whole log), with the
  stacked pieces the chart draws and the usable memory of the running box.
- `GET /api/requests/{id}/story`: the `dgxmm replay --request` text of one request, which
  the chart opens when a queue wait is clicked.

Times are epoch seconds (`*_time`: ISO 8601 too).  Viewers may read both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from dgxmm.admin.errors import ApiError
from dgxmm.admin.routes import iso, parse_time_query
from dgxmm.replay import NotInLog
from dgxmm.replay.commands import render_story, story_view
from dgxmm.replay.logview import time_formatter
from events.timeline import Piece, Timeline, fitted_since, stack
from storage.eventlog import EventStore
from storage.windows import timeline_window

DEFAULT_WINDOW_S = 3600.0
MAX_WINDOW_S = 31 * 86400.0
MAX_REQUEST_ID = 200


class _Call(Protocol):
    params: dict[str, str]
    query: dict[str, str]


class TimelineWindow(Timeline, frozen=True, kw_only=True):
    """`GET /timeline`: the projection of the window, its ISO times and the stacked pieces
    the chart draws."""

    since_time: str
    until_time: str
    pieces: list[Piece]


class Story(msgspec.Struct, kw_only=True):
    """`GET /requests/{id}/story`: one request's story as `dgxmm replay --request` prints it."""

    request_id: str
    deployment_id: str | None
    deployment: str | None
    outcome: str
    text: str


def timeline_json(timeline: Timeline) -> TimelineWindow:
    """The projection as the API answers it: the timeline, its stacked pieces, ISO times."""
    return TimelineWindow(
        **msgspec.structs.asdict(timeline),
        since_time=iso(timeline.since),
        until_time=iso(timeline.until),
        pieces=stack(timeline),
    )


class TimelineRoutes:
    """The two routes; `now` is the wall clock, `usable_bytes` the box's budget now."""

    def __init__(
        self, store: EventStore, now: Callable[[], float], usable_bytes: Callable[[], int]
    ) -> None:
        self.store = store
        self.now = now
        self.usable_bytes = usable_bytes

    async def window(self, query: dict[str, str]) -> tuple[float, float]:
        """(since, until) from the query (`from`/`to` are aliases); ApiError 422 naming it.
        Without `since`: the hour before `until`, fitted to a younger log."""
        query = {"since": query.get("from", ""), "until": query.get("to", ""), **query}
        until = parse_time_query(query["until"], "until") if query.get("until") else self.now()
        if query.get("since"):
            since = parse_time_query(query["since"], "since")
        else:
            first = await self.store.read(limit=1)
            since = fitted_since(until, first[0].ts if first else None, DEFAULT_WINDOW_S)
        if since >= until:
            raise ApiError(422, "invalid_query", "since must be before until", param="since")
        if until - since > MAX_WINDOW_S:
            raise ApiError(
                422, "invalid_query", "a window of at most 31 days, please", param="since"
            )
        return since, until

    async def timeline(self, call: _Call) -> tuple[int, TimelineWindow]:
        """GET /api/timeline."""
        since, until = await self.window(call.query)
        found = await timeline_window(self.store, since, until, self.usable_bytes())
        return 200, timeline_json(found)

    async def story(self, call: _Call) -> tuple[int, Story]:
        """GET /api/requests/{id}/story."""
        request_id = call.params["id"]
        if len(request_id) > MAX_REQUEST_ID:
            raise ApiError(404, "not_found", "no such request in the log")
        try:
            view = await story_view(self.store, "", None, request_id, time_formatter(False))
        except NotInLog as exc:
            raise ApiError(404, "not_found", str(exc)) from None
        return 200, Story(
            request_id=view.request_id,
            deployment_id=view.deployment_id,
            deployment=view.deployment,
            outcome=view.outcome,
            text="\n".join(render_story(view)),
        )
