# ruff: noqa: F811  (the fixtures imported from tests/test_browser.py are test parameters here)
"""What a new user met on a young box, in Debian's Chromium driven by Playwright, against a real
`dgxmm serve` started for this module (issue 46):

- stumble 4: the dashboard's live chart runs from the log's first record instead of a fixed
  hour that put everything in its rightmost 1 %, and zooms like the audit log's chart (the
  same code), then follows the box again;
- stumble 13: a failed login is shown by the client's address and the name tried, not "By:
  system"; a start's list on the Events tab puts a loading milestone read just after Ready
  under Ready."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from typing import Any

import pytest

from events.timeline import MIN_FITTED_S
from tests.browser_support import Dgxmm, wait_for
from tests.test_browser import (  # noqa: F401  (fixtures)
    admin_page,
    browser,
    context,
    create,
    dgxmm,
    litellm,
    log_in,
    open_hash,
    playwright,
    remove,
    shot,
    wait_state,
)

pytestmark = pytest.mark.browser

from playwright.sync_api import BrowserContext, Page, Route, expect  # noqa: E402  (skipped above when missing)


def drawn(page: Page) -> dict[str, Any] | None:
    """The data the chart drew last (None before its first drawing)."""
    data: dict[str, Any] | None = page.evaluate("window.dgxmmTimeline || null")
    return data


def first_record_ts(dgxmm: Dgxmm) -> float:
    """When the box's log begins."""
    with sqlite3.connect(f"file:{dgxmm.db_path}?mode=ro", uri=True) as db:
        (ts,) = db.execute("SELECT ts FROM events ORDER BY seq LIMIT 1").fetchone()
    return float(ts)


def test_the_live_chart_of_a_young_box_fits_its_data_and_zooms_then_follows_again(
    admin_page: Page, dgxmm: Dgxmm
) -> None:
    api = dgxmm.api()
    create(api, "young")
    try:
        wait_state(api, "young", "ready")
        ready_by = time.time()
        page = admin_page
        open_hash(page, dgxmm, "/")
        chart = page.locator("#dashboard-timeline")
        expect(chart.locator(".u-over")).to_be_visible()
        first = first_record_ts(dgxmm)
        data = wait_for(
            "a drawing after the model was ready",
            lambda: d if (d := drawn(page)) and d["until"] >= ready_by else None,
            20,
        )
        # The box is seconds old: the window starts at its log's first record, not an hour ago
        # (or 30 s before now, the narrowest window, if that is earlier).
        fitted = min(first, data["until"] - MIN_FITTED_S)
        assert abs(data["since"] - fitted) < 0.01, (data["since"], first, data["until"])
        assert data["until"] - data["since"] < 600
        assert abs(data["until"] - time.time()) < 30
        expect(chart.locator("#dashboard-timeline-mode")).to_contain_text(
            "since the box's first event"
        )
        live_button = chart.get_by_role("button", name="Live", exact=True)
        expect(live_button).to_have_attribute("aria-pressed", "true")
        # What the log holds takes a readable share of the width (all of it once the box is
        # 30 s old), where the fixed hour gave it well under 1 %; the model's stay is drawn.
        # The box is as old as its model took to be ready (a few seconds, less on a quick
        # machine: 6.6 s of the 30 s window once, a share of 0.22): a tenth is ten times 1 %.
        share = (data["until"] - first) / (data["until"] - data["since"])
        assert share > 0.1, (share, data["since"], data["until"], first)
        assert any(p["state"] == "ready" for p in data["pieces"]), data["segments"]
        shot(page, "50-dashboard-young-box")

        # Dragging across the chart zooms in, as on the audit log; the window stops following.
        box = chart.locator(".u-over").bounding_box()
        assert box is not None
        y = box["y"] + box["height"] / 2
        page.mouse.move(box["x"] + box["width"] * 0.25, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.5, y, steps=5)
        page.mouse.move(box["x"] + box["width"] * 0.75, y, steps=5)
        page.mouse.up()
        span = data["until"] - data["since"]
        picked = wait_for(
            "the dragged window",
            lambda: d if (d := drawn(page)) and d["until"] - d["since"] < span * 0.6 else None,
            15,
        )
        assert data["since"] < picked["since"] < picked["until"] < data["until"], picked
        expect(live_button).to_have_attribute("aria-pressed", "false")
        expect(chart.locator("#dashboard-timeline-mode")).to_contain_text("A window you picked")
        chart.get_by_role("button", name="Zoom out").click()
        wider = 1.5 * (picked["until"] - picked["since"])
        wait_for(
            "a longer window",
            lambda: True if (d := drawn(page) or {})["until"] - d["since"] > wider else None,
            15,
        )
        expect(live_button).to_have_attribute("aria-pressed", "false")
        shot(page, "51-dashboard-zoomed")

        # Live follows the box again, from its first record up to now.
        live_button.click()
        expect(live_button).to_have_attribute("aria-pressed", "true")
        expect(chart.locator("#dashboard-timeline-mode")).to_contain_text("Live")
        again = drawn(page) or {}
        assert abs(again["since"] - min(first, again["until"] - MIN_FITTED_S)) < 0.01, again
        assert abs(again["until"] - time.time()) < 30
    finally:
        remove(api, "young")


def test_a_failed_login_is_shown_by_the_clients_address_and_the_name_tried(
    context: BrowserContext, dgxmm: Dgxmm
) -> None:
    page = context.new_page()
    page.goto(dgxmm.ui_url)
    for name in ("admin", "nobody-here"):
        page.get_by_label("Name", exact=True).fill(name)
        page.get_by_label("Password", exact=True).fill("not-the-password")
        page.get_by_role("button", name="Log in").click()
        expect(page.locator("#login-error")).to_contain_text("do not match")
        page.locator("#login-error").evaluate("el => { el.textContent = '' }")
    log_in(page, dgxmm, "admin", dgxmm.admin_password)
    recent = page.locator("#recent-events tr", has_text="Login failed")
    expect(recent).to_have_count(2)
    # Newest first: the unknown name (kept only as a keyed hash), then the admin's.
    expect(recent.nth(1).locator("td").nth(3)).to_have_text("127.0.0.1, trying admin")
    expect(recent.nth(0).locator("td").nth(3)).to_have_text(
        "127.0.0.1, trying a name that is no user's"
    )
    shot(page, "52-dashboard-failed-login")
    open_hash(page, dgxmm, "/audit")
    audit = page.locator("tr", has_text="Login failed")
    expect(audit).to_have_count(2)
    expect(audit.nth(1).locator("td").nth(1)).to_have_text("127.0.0.1, trying admin")


def test_a_milestone_read_just_after_ready_is_listed_under_ready(
    admin_page: Page, dgxmm: Dgxmm
) -> None:
    api = dgxmm.api()
    rec = create(api, "ordered")
    try:
        wait_state(api, "ordered", "ready")
        t0 = time.time() - 60

        def row(seq: int, ts: float, title: str, kind: str) -> dict[str, Any]:
            return {
                "seq": seq,
                "ts": ts,
                "time": "",
                "actor": "system",
                "title": title,
                "type": kind,
            }

        # As the log records a start whose last loading line was read 0.2 s after Ready.
        events = [
            row(6, t0 + 10.2, "Loading: server listening", "EngineMilestoneReached"),
            row(5, t0 + 10.0, "Ready", "EngineReady"),
            row(4, t0 + 9.0, "Loading: engine initialized (4 s)", "EngineMilestoneReached"),
            row(3, t0 + 1.0, "Loading", "EngineStarting"),
            row(2, t0 + 0.5, "Started", "StartRequested"),
            row(1, t0, "Created (always on)", "DeploymentCreated"),
        ]
        answer = {"deployment_id": rec["id"], "events": events, "next_before": None}

        def fulfil(route: Route) -> None:
            route.fulfill(status=200, content_type="application/json", body=json.dumps(answer))

        page = admin_page
        page.route(re.compile(r"/dgxmm/api/deployments/[^/?]+/events(\?|$)"), fulfil)
        open_hash(page, dgxmm, f"/deployments/{rec['id']}/events")
        titles = page.locator("#events-table tbody td.title")
        expect(titles).to_have_count(6)
        assert titles.all_text_contents() == [
            "Ready",
            "Loading: server listening",
            "Loading: engine initialized (4 s)",
            "Loading",
            "Started",
            "Created (always on)",
        ]
        times = page.locator("#events-table tbody time")
        # The late milestone is shown at Ready's time, which its event's `at` says.
        assert times.nth(0).get_attribute("datetime") == times.nth(1).get_attribute("datetime")
        shot(page, "53-events-start-order")
    finally:
        remove(api, "ordered")
