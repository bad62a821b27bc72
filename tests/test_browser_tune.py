# ruff: noqa: F811  (the fixtures imported from tests/test_browser.py are test parameters here)
"""The Settings page's recommendation in a real browser (issue 45; issue 46, stumble 11):
`dgxmm tune --apply --yes` changes the settings and records one audited event, the page's
"Since applied" puts the prediction beside what happened since, Undo puts the settings back;
and at 1400 px the LiteLLM column keeps its address whole, the goal's drop-down is not cut
off, and no restart of a LiteLLM that is not answering is claimed.  Debian's Chromium driven
by Playwright against a real `dgxmm serve` (the fixtures of tests/test_browser.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.browser_support import PROJECT_DIR, ApiClient, Dgxmm, free_port, wait_for
from tests.test_browser import (  # noqa: F401  (fixtures)
    admin_page,
    browser,
    context,
    create,
    dgxmm,
    litellm,
    open_hash,
    playwright,
    shot,
    wait_state,
)

pytestmark = pytest.mark.browser

from playwright.sync_api import Page, expect  # noqa: E402  (skipped above when missing)


@pytest.fixture(scope="module")
def admin_api(dgxmm: Dgxmm) -> ApiClient:
    return dgxmm.api()


def _recorded(dgxmm: Dgxmm, *args: str) -> dict[str, Any] | None:
    """`dgxmm whatif --recorded-only --json` on the box's log (None: no traced request yet)."""
    done = subprocess.run(
        [sys.executable, "-m", "dgxmm", "whatif", "--db", str(dgxmm.db_path), "--json",
         "--recorded-only", *args],
        capture_output=True, text=True, cwd=PROJECT_DIR, timeout=120, check=False,
    )  # fmt: skip
    return json.loads(done.stdout) if done.returncode == 0 else None


def test_tune_apply_then_since_applied_shows_the_prediction_beside_what_happened_then_undo(
    admin_page: Page, dgxmm: Dgxmm, admin_api: ApiClient
) -> None:
    name = "tune-chat"
    rec = create(admin_api, name, mode="on_demand")
    wait_state(admin_api, name, "ready")
    # One request, the model sleeps after its idle timeout (60 s), the next one starts it:
    # a cold start a longer idle timeout would have saved.
    assert dgxmm.chat(rec["id"], rec["model"])[0] == 200
    wait_state(admin_api, name, "stopped", 120)
    assert dgxmm.chat(rec["id"], rec["model"])[0] == 200
    wait_for(
        "the trace's batch",
        lambda: True if (r := _recorded(dgxmm)) and r["columns"][0]["requests"] >= 2 else None,
        60,
    )
    token = admin_api.call("POST", "tokens", {"name": "tune-cli", "expires_in_s": 3600})["token"]
    done = subprocess.run(
        [sys.executable, "-m", "dgxmm", "tune", "--db", str(dgxmm.db_path), "--apply", "--yes",
         "--url", dgxmm.base_url, "--token", token],
        capture_output=True, text=True, cwd=PROJECT_DIR, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{name}.idle_timeout_s=120" in done.stdout and "applied (audit #" in done.stdout
    assert admin_api.deployment(name)["idle_timeout_s"] == 120
    audit = admin_api.call("GET", "audit?action=tune_apply")["rows"]
    assert len(audit) == 1 and audit[0]["actor"].endswith("admin")

    # Traffic after it, measured as the recorded column is.
    assert dgxmm.chat(rec["id"], rec["model"])[0] == 200
    wait_for(
        "the traffic since applied",
        lambda: (
            True if admin_api.call("GET", "settings/tune/applied")["applied"]["since"] else None
        ),
        60,
    )
    page = admin_page
    open_hash(page, dgxmm, "/settings")
    table = page.locator("#tune-since-table")
    expect(table).to_be_visible()
    expect(table.locator("thead")).to_contain_text("Predicted")
    expect(table.locator("thead")).to_contain_text("Since applied")
    cold = table.locator("tr", has_text="Cold starts")
    expect(cold.locator("td")).to_have_count(2)
    expect(cold.locator("td").nth(0)).to_contain_text("per hour")
    expect(cold.locator("td").nth(1)).to_contain_text("per hour")
    expect(page.locator("#tune-since")).to_contain_text("requests over")
    # Each model's fates, predicted and since.
    model = page.locator("#tune-since-models tr", has_text=name)
    expect(model.locator("td").nth(0)).to_contain_text("served")
    expect(model.locator("td").nth(1)).to_contain_text("1 served")
    shot(page, "40-settings-since-applied")

    page.get_by_role("button", name="Undo").click()
    expect(page.locator("#tune-undone")).to_be_visible()
    assert admin_api.deployment(name)["idle_timeout_s"] is None
    assert len(admin_api.call("GET", "audit?action=tune_undo")["rows"]) == 1


def test_settings_at_1400_px_keeps_the_address_whole_the_goal_readable_and_claims_no_restart(
    admin_page: Page, dgxmm: Dgxmm, admin_api: ApiClient
) -> None:
    page = admin_page
    page.set_viewport_size({"width": 1400, "height": 900})
    config_path = dgxmm.data_dir / "tune-litellm.json"
    before = admin_api.call("GET", "litellm")
    try:
        # The file back-end with a LiteLLM that is not running (nothing listens there).
        dead = f"http://127.0.0.1:{free_port()}"
        admin_api.call(
            "PATCH", "litellm", {"backend": "file", "config_path": str(config_path), "url": dead}
        )
        wait_for(
            "a write of the file",
            lambda: True if admin_api.call("GET", "litellm")["config_writes"] >= 1 else None,
            30,
        )
        open_hash(page, dgxmm, "/settings")
        facts = page.locator("#litellm-facts")
        expect(facts).to_contain_text("Writes of LiteLLM's config")
        expect(facts).not_to_contain_text("restarts caused")
        address = facts.locator("dd .nowrap")
        expect(address).to_have_text(dead)
        lines = address.evaluate("el => el.getClientRects().length")
        assert lines == 1, "the address broke across lines"
        goal = page.locator("#tune-goal")
        shown, needed = goal.evaluate(
            """s => {
              const span = document.createElement("span");
              span.style.font = getComputedStyle(s).font;
              span.style.whiteSpace = "nowrap";
              span.textContent = s.options[s.selectedIndex].text;
              document.body.append(span);
              const width = span.getBoundingClientRect().width;
              span.remove();
              return [s.clientWidth, width];
            }"""
        )
        assert shown >= needed + 16, (shown, needed)  # its text, the padding and the arrow
        shot(page, "41-settings-1400px")
    finally:
        admin_api.call("PATCH", "litellm", {"backend": before["backend"], "url": before["url"]})
