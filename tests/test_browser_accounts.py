"""The Users page in Chromium: an admin removes a user and revokes a token, and both stop
working at once (the removed user's open tab, its API calls, and the token's calls)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from tests import test_browser as ui
from tests.browser_support import ApiClient, ApiFailure, Dgxmm
from tests.test_browser import EXPECT_MS, log_in, shot

# The UI tests' fixtures (a real `dgxmm serve`, the LiteLLM double, Chromium), for this module.
playwright, browser, context = ui.playwright, ui.browser, ui.context
litellm, dgxmm = ui.litellm, ui.dgxmm

pytestmark = pytest.mark.browser

from playwright.sync_api import BrowserContext, expect  # noqa: E402


def bearer_status(server: Dgxmm, token: str, path: str = "/dgxmm/api/deployments") -> int:
    req = urllib.request.Request(f"{server.base_url}{path}")
    req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_an_admin_removes_a_user_and_revokes_a_token_and_both_stop_at_once(
    context: BrowserContext, browser: object, dgxmm: Dgxmm
) -> None:
    admin_api = dgxmm.api()
    admin_api.call("POST", "users", {"name": "ursula", "role": "viewer", "password": "ursula-pass"})
    made = admin_api.call("POST", "tokens", {"name": "ci-bot", "expires_in_s": 86400})
    assert bearer_status(dgxmm, made["token"]) == 200

    # Ursula is logged in, in a browser of her own, and through the API.
    ursula_ctx = browser.new_context()  # type: ignore[attr-defined]
    ursula_ctx.set_default_timeout(EXPECT_MS)
    ursula_page = ursula_ctx.new_page()
    log_in(ursula_page, dgxmm, "ursula", "ursula-pass")
    ursula_api = ApiClient(dgxmm.base_url).login("ursula", "ursula-pass")
    assert ursula_api.call("GET", "session")["user"] == "ursula"

    page = context.new_page()
    log_in(page, dgxmm, "admin", dgxmm.admin_password)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Users").click()
    expect(page.get_by_role("heading", name="Users and API tokens")).to_be_visible()
    row = page.locator('#users tr[data-user="ursula"]')
    expect(row).to_be_visible()
    shot(page, "30-users")

    row.get_by_role("button", name="Remove").click()
    page.get_by_role("dialog").get_by_role("button", name="Remove user").click()
    expect(page.get_by_text("Removed ursula.")).to_be_visible()
    expect(row).to_have_count(0)
    # At once: no waiting, no polling.
    with pytest.raises(ApiFailure) as gone:
        ursula_api.call("GET", "session")
    assert gone.value.status == 401
    ursula_page.get_by_role("navigation", name="Main").get_by_role("link", name="Audit log").click()
    expect(ursula_page.get_by_role("heading", name="Log in to DGXMM")).to_be_visible()
    ursula_ctx.close()

    token_row = page.locator(f'#tokens tr[data-token="{made["token_id"]}"]')
    expect(token_row).to_contain_text("ci-bot")
    token_row.get_by_role("button", name="Revoke").click()
    page.get_by_role("dialog").get_by_role("button", name="Revoke token").click()
    expect(page.get_by_text("Token revoked.")).to_be_visible()
    assert bearer_status(dgxmm, made["token"]) == 401
    expect(token_row).to_have_count(0)
    shot(page, "31-users-after")

    # A scrape token made in the UI is shown once and reads /metrics and nothing else.
    page.get_by_label("Name", exact=True).last.fill("prometheus")
    page.get_by_label("Access").select_option("metrics")
    page.get_by_role("button", name="Create token").click()
    shown = page.locator("#new-token")
    expect(shown).to_be_visible()
    scrape = shown.input_value()
    page.get_by_role("dialog").get_by_role("button", name="Done").click()
    assert bearer_status(dgxmm, scrape, "/metrics") == 200
    assert bearer_status(dgxmm, scrape) == 403
    expect(page.locator("#tokens")).to_contain_text("metrics")

    audit = admin_api.call("GET", "audit", None)["rows"]
    actions = {(r["action"], r["details"].get("name")) for r in audit}
    assert ("user_remove", "ursula") in actions and ("api_token_revoke", "admin") in actions


def test_a_user_changes_their_own_password_on_my_account(
    context: BrowserContext, dgxmm: Dgxmm
) -> None:
    dgxmm.api().call("POST", "users", {"name": "yusuf", "role": "viewer", "password": "yusuf-pass"})
    page = context.new_page()
    log_in(page, dgxmm, "yusuf", "yusuf-pass")
    page.locator("#whoami").click()
    expect(page.get_by_role("heading", name="My account")).to_be_visible()
    page.get_by_label("Current password").fill("yusuf-pass")
    page.get_by_label("New password", exact=True).fill("yusuf-new-pass")
    page.get_by_label("New password again").fill("yusuf-new-pass")
    page.get_by_role("button", name="Change password").click()
    expect(page.get_by_text("Password changed.")).to_be_visible()
    assert ApiClient(dgxmm.base_url).login("yusuf", "yusuf-new-pass").csrf
    with pytest.raises(ApiFailure):
        ApiClient(dgxmm.base_url).login("yusuf", "yusuf-pass")
