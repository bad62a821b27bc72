# ruff: noqa: F811  (the fixtures imported from tests/test_browser.py are test parameters here)
"""The dashboard's live chart on a young box, in Debian's Chromium driven by Playwright, against
a real `dgxmm serve` started for this module (issue 46, stumble 4): the window runs from the
log's first record instead of a fixed hour that put everything in its rightmost 1 %, and the
dashboard zooms like the audit log's chart (the same code), then follows the box again."""

from __future__ import annotations

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
    open_hash,
    playwright,
    remove,
    shot,
    wait_state,
)

pytestmark = pytest.mark.browser

from playwright.sync_api import Page, expect  # noqa: E402  (skipped above when missing)


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
        share = (data["until"] - first) / (data["until"] - data["since"])
        assert share > 0.25, (share, data["since"], data["until"], first)
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
