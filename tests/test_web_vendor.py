"""The chart library's files: served from the vendor root, a clear 404 when missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgxmm.admin import vendor
from tests.api_support import Box, error_of, run_box

BASE = "/dgxmm/vendor/uplot/"


def _install(root: Path) -> None:
    where = vendor.uplot_dir(root)
    where.mkdir(parents=True)
    (where / "uPlot.iife.min.js").write_text("var uPlot=function(){};")
    (where / "uPlot.min.css").write_text(".uplot{}")
    (where / "LICENSE").write_text("MIT")


def test_serves_the_three_files_with_their_types(tmp_path: Path) -> None:
    root = tmp_path / "web"
    _install(root)
    assert vendor.missing(root) == []

    async def test(box: Box) -> None:
        client = await box.login("victor")
        js = await client.get(BASE + "uPlot.iife.min.js")
        assert js.status == 200 and js.body == b"var uPlot=function(){};"
        assert js.header("content-type") == "text/javascript; charset=utf-8"
        css = await client.get(BASE + "uPlot.min.css")
        assert css.status == 200 and css.header("content-type") == "text/css; charset=utf-8"
        lic = await client.get(BASE + "LICENSE")
        assert lic.status == 200 and lic.body == b"MIT"
        for name in ("uPlot.js", "..%2F..%2Fetc%2Fpasswd", "../uplot-1.6.32/LICENSE", ""):
            reply = await client.get(BASE + name)
            assert reply.status == 404, name
        post = await client.call("POST", BASE + "LICENSE")
        assert post.status == 405

    run_box(tmp_path, test, vendor_root=root)


def test_missing_files_answer_how_to_fetch_them(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    assert vendor.missing(root) == list(vendor.FILES)

    async def test(box: Box) -> None:
        client = await box.login("victor")
        reply = await client.get(BASE + "uPlot.iife.min.js")
        assert reply.status == 404
        err = error_of(reply)
        assert err["code"] == "vendor_missing"
        assert "scripts/fetch-web-vendor" in err["message"]

    run_box(tmp_path, test, vendor_root=root)


def test_vendor_root_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DGXMM_WEB_VENDOR", raising=False)
    monkeypatch.delenv("DGXMM_CACHE", raising=False)
    assert vendor.vendor_root() == Path("/var/cache/dgxmm/web")
    monkeypatch.setenv("DGXMM_CACHE", "/c")
    assert vendor.vendor_root() == Path("/c/web")
    monkeypatch.setenv("DGXMM_WEB_VENDOR", "/v")
    assert vendor.vendor_root() == Path("/v")
    assert vendor.vendor_root("/k") == Path("/k")
