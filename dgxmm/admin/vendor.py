"""The web UI's third-party files (the chart library, uPlot), served from outside the repository.

uPlot is not kept in git and no page loads it from a CDN: `scripts/fetch-web-vendor` takes
it from the npm registry (integrity checked) into `<vendor root>/uplot-<version>/`, and
DGXMM serves its three files at `/dgxmm/vendor/uplot/<file>`.  The vendor root is the
config key `server.web_vendor_dir`, else `$DGXMM_WEB_VENDOR`, else `$DGXMM_CACHE/web`
(`DGXMM_CACHE` defaults to `/var/cache/dgxmm`).  When the files are missing the URL answers
404 with a message saying how to fetch them; the page shows that message in place of the
chart, and `dgxmm serve` logs one warning (`missing`).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from dgxmm.admin.errors import ApiError
from gateway.protocol import Headers

UPLOT_VERSION = "1.6.32"
PREFIX = "vendor/uplot/"  # under /dgxmm/
FILES = {
    "uPlot.iife.min.js": b"text/javascript; charset=utf-8",
    "uPlot.min.css": b"text/css; charset=utf-8",
    "LICENSE": b"text/plain; charset=utf-8",
}
HINT = "run scripts/fetch-web-vendor (or scripts/bootstrap) on the server"


def vendor_root(configured: str | None = None) -> Path:
    """Where the vendored files live: the config key, $DGXMM_WEB_VENDOR, $DGXMM_CACHE/web."""
    if configured:
        return Path(configured)
    env = os.environ.get("DGXMM_WEB_VENDOR")
    if env:
        return Path(env)
    return Path(os.environ.get("DGXMM_CACHE") or "/var/cache/dgxmm") / "web"


def uplot_dir(root: Path) -> Path:
    """The directory of this uPlot version under the vendor root."""
    return root / f"uplot-{UPLOT_VERSION}"


def missing(root: Path) -> list[str]:
    """The uPlot files that are not under `root` (empty: all there)."""
    where = uplot_dir(root)
    return [name for name in FILES if not (where / name).is_file()]


async def read(root: Path | None, name: str) -> tuple[bytes, Headers]:
    """One vendored file by its name (only the three known ones); ApiError 404 otherwise."""
    if name not in FILES:
        raise ApiError(404, "not_found", "not found")
    if root is None:
        raise ApiError(404, "vendor_missing", f"the chart library is not installed: {HINT}")
    path = uplot_dir(root) / name
    try:
        body = await asyncio.to_thread(path.read_bytes)
    except OSError:
        raise ApiError(
            404, "vendor_missing", f"the chart library is not in {path.parent}: {HINT}"
        ) from None
    headers: Headers = [
        (b"content-type", FILES[name]),
        (b"cache-control", b"public, max-age=86400"),
        (b"x-frame-options", b"DENY"),
        (b"referrer-policy", b"same-origin"),
    ]
    return body, headers
