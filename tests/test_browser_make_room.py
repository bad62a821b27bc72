# ruff: noqa: F811  (the fixtures imported from tests/test_browser.py are test parameters here)
"""`ondemand_make_room_after_s` in the web UI: the Settings field, the wizard's Mode step and
the Mode card, in Debian's Chromium driven by Playwright against a real `dgxmm serve`
(the fixtures of tests/test_browser.py)."""

from __future__ import annotations

import pytest

from tests.browser_support import ApiClient, Dgxmm, wait_for
from tests.test_browser import (  # noqa: F401  (fixtures)
    admin_page,
    browser,
    context,
    dgxmm,
    litellm,
    open_hash,
    playwright,
    wait_state,
)

pytestmark = pytest.mark.browser

from playwright.sync_api import Page, expect  # noqa: E402  (skipped above when missing)

LABEL = "Make room after (seconds)"


@pytest.fixture(scope="module")
def admin_api(dgxmm: Dgxmm) -> ApiClient:
    # tests/test_browser.py's fixture of the same name calls dgxmm.admin, which Dgxmm lacks
    return dgxmm.api()


def test_the_settings_page_sets_and_clears_the_make_room_default(
    admin_page: Page, dgxmm: Dgxmm, admin_api: ApiClient
) -> None:
    page = admin_page
    open_hash(page, dgxmm, "/settings")
    room = page.get_by_label(LABEL)
    expect(room).to_have_value("")  # unset: the seed's rule
    try:
        room.fill("1.5")
        page.get_by_role("button", name="Save defaults").click()
        expect(page.locator("#defaults-form .error")).to_contain_text("a whole number")
        assert admin_api.call("GET", "settings")["ondemand_make_room_after_s"] is None
        room.fill("0")
        page.get_by_role("button", name="Save defaults").click()
        expect(page.get_by_role("status").filter(has_text="Defaults saved.")).to_be_visible()
        assert admin_api.call("GET", "settings")["ondemand_make_room_after_s"] == 0
        expect(page.get_by_label(LABEL)).to_have_value("0")
        page.get_by_label(LABEL).fill("")
        page.get_by_role("button", name="Save defaults").click()
        wait_for(
            "the setting to be unset",
            lambda: admin_api.call("GET", "settings")["ondemand_make_room_after_s"] is None or None,
            10,
        )
        expect(page.get_by_label(LABEL)).to_have_value("")
    finally:
        admin_api.call("PATCH", "settings", {"ondemand_make_room_after_s": None})


def test_the_wizard_and_the_mode_card_set_a_deployments_own_make_room_time(
    admin_page: Page, dgxmm: Dgxmm, admin_api: ApiClient
) -> None:
    name = "room-wizard"
    page = admin_page
    open_hash(page, dgxmm, "/deploy")
    page.get_by_label("Name", exact=True).fill(name)
    page.get_by_label("Engine", exact=True).select_option("sim")
    page.get_by_label("Model", exact=True).fill("test/room")
    page.get_by_label("Memory (GiB)").fill("1")
    page.get_by_role("button", name="Next").click()
    room = page.get_by_label(LABEL)
    expect(room).to_be_visible()  # on demand is preselected with LiteLLM synced
    room.fill("30")
    page.get_by_role("button", name="Deploy").click()
    expect(page.get_by_role("heading", name=name, exact=True)).to_be_visible()
    rec = admin_api.deployment(name)
    assert rec["mode"] == "on_demand" and rec["make_room_after_s"] == 30
    wait_state(admin_api, name, "ready")

    card = page.locator("#mode-card")
    card_room = card.get_by_label(LABEL)
    expect(card_room).to_have_value("30")
    card_room.fill("-1")
    card.get_by_role("button", name="Save mode").click()
    expect(card.locator(".error")).to_contain_text("0 to 86400")
    assert admin_api.deployment(name)["make_room_after_s"] == 30
    card_room.fill("0")
    card.get_by_role("button", name="Save mode").click()
    expect(page.get_by_role("status").filter(has_text="Mode saved.")).to_be_visible()
    saved = admin_api.deployment(name)
    assert saved["make_room_after_s"] == 0 and saved["idle_timeout_s"] is None  # idle kept
    card_room.fill("")
    card.get_by_role("button", name="Save mode").click()
    wait_for(
        "the deployment to follow the default again",
        lambda: admin_api.deployment(name)["make_room_after_s"] is None or None,
        10,
    )
    expect(card_room).to_have_value("")
    open_hash(page, dgxmm, f"/deployments/{rec['id']}/events")
    expect(page.locator("#events-table tbody")).to_contain_text("Mode changed to on demand")
