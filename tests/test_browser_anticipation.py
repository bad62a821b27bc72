# ruff: noqa: F811  (the fixtures imported from tests/test_browser.py are test parameters here)
"""The learned policy (issue 44) in Debian's Chromium driven by Playwright, against a real
`dgxmm serve` started for this module: the Settings page's default policy, the deployment
page's policy in its Mode card, and what the policy learned from the model's traffic."""

from __future__ import annotations

import json
import re

import pytest

from tests.browser_support import Dgxmm, wait_for
from tests.test_browser import (  # noqa: F401  (fixtures)
    VIEWER,
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
    wait_state,
)

pytestmark = pytest.mark.browser

from playwright.sync_api import Browser, Page, expect  # noqa: E402  (skipped above when missing)


def test_settings_sets_the_default_policy_through_patch_settings(
    admin_page: Page, dgxmm: Dgxmm
) -> None:
    api = dgxmm.api()
    page = admin_page
    open_hash(page, dgxmm, "/settings")
    choice = page.locator("#set-policy")
    expect(choice).to_have_value("seed")
    choice.select_option("learned")
    page.get_by_role("button", name="Save defaults").click()
    expect(page.get_by_text("Defaults saved.")).to_be_visible()
    assert api.call("GET", "settings")["ondemand_policy"] == "learned"
    page.reload()
    expect(page.locator("#set-policy")).to_have_value("learned")
    page.locator("#set-policy").select_option("seed")
    page.get_by_role("button", name="Save defaults").click()
    expect(page.get_by_text("Defaults saved.")).to_be_visible()
    assert api.call("GET", "settings")["ondemand_policy"] == "seed"


def test_the_mode_card_sets_the_policy_and_the_page_shows_what_it_learned(
    admin_page: Page, browser: Browser, dgxmm: Dgxmm
) -> None:
    api = dgxmm.api()
    record = create(api, "habit", mode="on_demand")
    try:
        page = admin_page
        open_hash(page, dgxmm, f"/deployments/{record['id']}")
        policy = page.locator("#mode-policy")
        expect(policy).to_have_value("")
        expect(policy.locator("option").first).to_have_text("Default (Seed's rules (idle timeout))")
        expect(page.locator("#mode-learned")).to_be_hidden()  # the seed's: nothing learned
        policy.select_option("learned")
        page.locator("#mode-save").click()
        expect(page.get_by_text("Mode saved.")).to_be_visible()
        got = api.deployment("habit")
        assert (got["ondemand_policy"], got["effective_ondemand_policy"]) == ("learned", "learned")
        learned = page.locator("#mode-learned")
        expect(learned).to_have_text("Learned: no traffic recorded yet: the seed's rules apply")
        # A request through the gateway: the trace records it, and the policy learns from it.
        status, _ = dgxmm.chat(record["id"], "test/habit")
        assert status == 200
        words = wait_for(
            "the policy to hear the request",
            lambda: (
                w if (w := api.deployment("habit").get("learned", "")).startswith("keeps") else None
            ),
            30,
        )
        page.reload()
        expect(page.locator("#mode-learned")).to_have_text(f"Learned: {words}")
        # A viewer reads the policy and what it learned, and cannot change them.
        other = browser.new_context(viewport={"width": 1280, "height": 860})
        viewer = other.new_page()
        log_in(viewer, dgxmm, *VIEWER)
        open_hash(viewer, dgxmm, f"/deployments/{record['id']}")
        card = viewer.locator("#mode-card")
        expect(card.get_by_text("Learned from its traffic")).to_be_visible()
        expect(card.locator("#mode-learned")).to_have_text(f"Learned: {words}")
        expect(viewer.locator("#mode-policy")).to_have_count(0)
        other.close()
        # Back to the default.
        page.locator("#mode-policy").select_option("")
        page.locator("#mode-save").click()
        expect(page.get_by_text("Mode saved.")).to_be_visible()
        assert api.deployment("habit")["ondemand_policy"] is None
        expect(page.locator("#mode-learned")).to_be_hidden()
    finally:
        remove(api, "habit")


def test_the_timeline_draws_the_learned_policys_marks_with_their_legend(
    admin_page: Page, dgxmm: Dgxmm
) -> None:
    api = dgxmm.api()
    record = create(api, "marked", mode="on_demand")
    try:
        answer = api.call("GET", "timeline")
        at = (answer["since"] + answer["until"]) / 2
        titles = {
            "prewarm": "marked pre-warmed (next request expected in ~72 s: used every 15 min)",
            "kept_warm": "marked kept warm 48 s (its usual gaps), then slept",
            "prewarm_unused": "marked put to sleep: no request came to its pre-warm",
            "prewarm_abandoned": "marked: pre-warm abandoned for a queued request",
        }
        answer["marks"] = [
            {"kind": kind, "ts": at + i, "seq": 10_000 + i, "deployment_id": record["id"],
             "title": title, "actor": "ondemand"}
            for i, (kind, title) in enumerate(titles.items())
        ]  # fmt: skip
        # The real answer with the marks a learned policy's day would have (an hour of a
        # periodic model is too long for a test).
        page = admin_page
        page.route(
            re.compile(r"/dgxmm/api/timeline(\?|$)"),
            lambda route: route.fulfill(
                status=200, content_type="application/json", body=json.dumps(answer)
            ),
        )
        open_hash(page, dgxmm, "/")
        glyphs = {"prewarm": "◆", "kept_warm": "◐", "prewarm_unused": "◇", "prewarm_abandoned": "⊘"}
        for kind, title in titles.items():
            mark = page.locator(f"#dashboard-timeline .tl-mark.tl-{kind}")
            expect(mark).to_have_attribute("aria-label", title)
            expect(mark).to_have_text(glyphs[kind])
        legend = page.locator("#dashboard-timeline-legend")
        for glyph_words in (
            "◆Pre-warm",
            "◐Kept warm, then slept",
            "◇Pre-warm unused",
            "⊘Pre-warm abandoned",
        ):
            expect(legend.locator("li", has_text=glyph_words)).to_have_count(1)
        page.locator("#dashboard-timeline .tl-mark.tl-prewarm").hover()
        expect(page.locator("#dashboard-timeline-tip")).to_contain_text("used every 15 min")
    finally:
        remove(api, "marked")


def test_a_seed_box_s_legend_has_no_learned_marks(admin_page: Page, dgxmm: Dgxmm) -> None:
    page = admin_page
    open_hash(page, dgxmm, "/")
    legend = page.locator("#dashboard-timeline-legend")
    expect(legend).to_contain_text("Cold start")
    assert "Pre-warm" not in legend.inner_text() and "Kept warm" not in legend.inner_text()
