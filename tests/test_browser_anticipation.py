# ruff: noqa: F811  (the fixtures imported from tests/test_browser.py are test parameters here)
"""The learned policy (issue 44) in Debian's Chromium driven by Playwright, against a real
`dgxmm serve` started for this module: the Settings page's default policy, the deployment
page's policy in its Mode card, and what the policy learned from the model's traffic."""

from __future__ import annotations

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
