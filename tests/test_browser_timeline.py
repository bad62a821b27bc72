# ruff: noqa: F811  (the fixtures imported from tests/test_browser.py are test parameters here)
"""The timeline in Debian's Chromium, driven by Playwright, against a real `dgxmm serve` (the
fixtures of tests/test_browser.py): the dashboard, already open, follows a scripted swap live
(A used, then B queued, A put to sleep to make room, B started) and shows it in order; the
marks' hover, a wait's story, and the audit log's window picker.  Asserted on the DOM and on
the data the page draws (`window.dgxmmTimeline`); screenshots go to artifacts/screenshots/."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import re
from typing import Any

import pytest

from tests.browser_support import ApiClient, Dgxmm, wait_for
from tests.test_browser import (  # noqa: F401  (fixtures)
    admin_page,
    browser,
    context,
    create,
    dgxmm,
    free_gib,
    litellm,
    open_hash,
    others_asleep,
    playwright,
    remove,
    shot,
    wait_state,
)

pytestmark = pytest.mark.browser

from playwright.sync_api import Page, expect  # noqa: E402  (skipped above when missing)

B_STARTUP_S = 2


@pytest.fixture(scope="module")
def admin_api(dgxmm: Dgxmm) -> ApiClient:
    return dgxmm.api()


def local_input(ts: float, offset_s: float) -> str:
    """A datetime-local value for epoch `ts` in the browser's zone (`offset_s`: UTC - local)."""
    moment = dt.datetime.fromtimestamp(int(ts) - offset_s, dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S")


def drawn(page: Page) -> dict[str, Any]:
    """The data the chart drew last."""
    data: dict[str, Any] = page.evaluate("window.dgxmmTimeline")
    return data


def test_the_dashboard_timeline_follows_a_swap_live_in_order(
    admin_page: Page, dgxmm: Dgxmm, admin_api: ApiClient
) -> None:
    others_asleep(admin_api)
    big = round(free_gib(admin_api) - 2, 1)  # A leaves 2 GiB: B (4 GiB) must wait for room
    a = create(admin_api, "tl-a", mode="on_demand", memory_gib=big, make_room_after_s=0)
    delay = ["--startup-delay", str(B_STARTUP_S)]
    b = create(admin_api, "tl-b", mode="on_demand", memory_gib=4, args=delay)
    try:
        wait_state(admin_api, "tl-a", "ready")
        assert b["not_started"], b
        page = admin_page
        open_hash(page, dgxmm, "/")
        chart = page.locator("#dashboard-timeline")
        expect(chart.locator(".u-over")).to_be_visible()  # uPlot drew, from DGXMM's own copy
        expect(chart.locator(".tl-wait[data-name='tl-b']")).to_have_count(0)
        # The swap, while the dashboard is open: the chart must follow through the stream.
        status, body = dgxmm.chat(a["id"], "test/tl-a")  # A used
        assert status == 200, body
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(dgxmm.chat, b["id"], "test/tl-b")  # B queued
            status, body = answer.result(timeout=60)
        assert status == 200, body
        wait_state(admin_api, "tl-a", "stopped")

        room = chart.locator(f".tl-mark[data-kind='make_room'][data-deployment='{a['id']}']")
        expect(room).to_have_count(1, timeout=20_000)
        expect(room).to_have_attribute("data-for", b["id"])
        expect(room).to_have_attribute("data-for-name", "tl-b")
        wait_bar = chart.locator(f".tl-wait[data-deployment='{b['id']}']")
        expect(wait_bar).to_have_count(1)
        expect(wait_bar).to_have_attribute("data-outcome", "served")
        start_b = chart.locator(f".tl-mark[data-kind='cold_start'][data-deployment='{b['id']}']")
        expect(start_b).to_have_count(1)
        expect(start_b).to_have_attribute("data-duration", re.compile(r"^\d+(\.\d+)?$"))
        expect(room).to_be_visible()
        expect(start_b).to_be_visible()
        expect(wait_bar).to_be_visible()

        # In order: A's lane ends with the make-room mark pointing at B; B's queue bar spans
        # it and B's start, which has its duration. The two are one decision (the queue
        # reserves A's memory for B, tells A to sleep and B to start), recorded by two actors:
        # either may be committed first, in the same batch (one ts) or the next.
        room_ts = float(room.get_attribute("data-ts") or "nan")
        bar_start = float(wait_bar.get_attribute("data-start") or "nan")
        bar_end = float(wait_bar.get_attribute("data-end") or "nan")
        b_ts = float(start_b.get_attribute("data-ts") or "nan")
        b_duration = float(start_b.get_attribute("data-duration") or "nan")
        assert bar_start <= min(room_ts, b_ts), (bar_start, room_ts, b_ts)
        assert max(room_ts, b_ts) <= bar_end, (room_ts, b_ts, bar_end)
        assert abs(room_ts - b_ts) < 1.0, (room_ts, b_ts)
        assert B_STARTUP_S <= b_duration < B_STARTUP_S + 10, b_duration
        data = drawn(page)
        a_lane = [s for s in data["segments"] if s["deployment_id"] == a["id"]]
        assert a_lane, data["segments"]
        ready = [s for s in a_lane if s["state"] == "ready"]
        assert ready[-1]["end"] == room_ts  # A was ready until the make-room mark
        assert a_lane[-1]["state"] == "stopping" and a_lane[-1]["end"] <= b_ts + b_duration
        b_lane = [s for s in data["segments"] if s["deployment_id"] == b["id"]]
        assert [s["state"] for s in b_lane][-2:] == ["starting", "ready"], b_lane
        assert {"from": a["id"], "to": b["id"], "started": True}.items() <= next(
            x for x in data["arrows"] if x["from"] == a["id"]
        ).items()
        # The DOM shows the marks in time order from left to right (one place for one ts).
        xs = [el.bounding_box()["x"] for el in (room, start_b)]  # type: ignore[index]
        assert (xs[1] - xs[0]) * (b_ts - room_ts) >= 0, (xs, room_ts, b_ts)

        shot(page, "40-dashboard-timeline")
        # Hovering a mark shows its event; clicking the wait opens the request's story.
        room.hover()
        tip = chart.locator(".tl-tip")
        expect(tip).to_be_visible()
        expect(tip).to_contain_text("tl-a put to sleep to make room for tl-b")
        expect(tip).to_contain_text("reason: make_room")
        shot(page, "41-dashboard-timeline-hover")
        wait_bar.click()
        story = page.locator("#dashboard-timeline-story")
        expect(story).to_be_visible()
        expect(story.locator("pre")).to_contain_text(
            re.compile(r"request \S+ for tl-b: left the queue")
        )
        expect(story.locator("pre")).to_contain_text("tl-a")
        shot(page, "42-dashboard-timeline-story")
        story.get_by_role("button", name="Close").click()
        expect(story).to_be_hidden()
        # The same swap in the audit log's picker, a minute around it: the shape is readable.
        open_hash(page, dgxmm, "/audit")
        audit = page.locator("#audit-timeline")
        expect(audit.locator(".u-over")).to_be_visible()
        offset_s = 60 * float(page.evaluate("new Date().getTimezoneOffset()"))
        audit.get_by_label("Timeline from").fill(local_input(room_ts - 25, offset_s))
        audit.get_by_label("Timeline to").fill(local_input(room_ts + 15, offset_s))
        audit.get_by_role("button", name="Show", exact=True).click()
        wait_for(
            "the picked window",
            lambda: True if abs(drawn(page)["since"] - (int(room_ts) - 25)) < 1 else None,
            15,
        )
        expect(audit.locator(f".tl-wait[data-deployment='{b['id']}']")).to_have_count(1)
        shot(page, "43-audit-timeline-swap")
    finally:
        remove(admin_api, "tl-b", "tl-a")


def test_the_audit_log_and_events_tab_pick_a_window(
    admin_page: Page, dgxmm: Dgxmm, admin_api: ApiClient
) -> None:
    rec = create(admin_api, "tl-events")
    try:
        wait_state(admin_api, "tl-events", "ready")
        page = admin_page
        open_hash(page, dgxmm, "/audit")
        chart = page.locator("#audit-timeline")
        expect(chart.locator(".u-over")).to_be_visible()
        wait_for("the chart's data", lambda: drawn(page) or None, 15)
        first = drawn(page)
        span = first["until"] - first["since"]
        assert abs(span - 3600) < 1
        chart.get_by_role("button", name="Zoom in").click()
        wait_for(
            "a window half as long",
            lambda: True if abs((d := drawn(page))["until"] - d["since"] - span / 2) < 1 else None,
            15,
        )
        chart.get_by_role("button", name="Earlier").click()
        wait_for(
            "the window moved earlier",
            lambda: True if drawn(page)["until"] < first["until"] - 1 else None,
            15,
        )
        shot(page, "44-audit-timeline")
        open_hash(page, dgxmm, f"/deployments/{rec['id']}/events")
        tab = page.locator("#events-timeline")
        start = tab.locator(f".tl-mark[data-kind='cold_start'][data-deployment='{rec['id']}']")
        expect(start).to_have_count(1)
        expect(tab.locator("#events-timeline-from")).not_to_have_value("")
    finally:
        remove(admin_api, "tl-events")
