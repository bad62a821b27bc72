"""The web UI's static files: a path under the web root, never outside it, with its type.

A path without a file extension that names no file is a client-side route of the UI
(`/dgxmm/deployments/abc`): `index.html` answers it.
"""

from __future__ import annotations

import asyncio
import mimetypes
import urllib.parse
from pathlib import Path, PurePosixPath

from dgxmm.admin.errors import ApiError
from gateway.protocol import Headers

MAX_STATIC_BYTES = 32 * 1024 * 1024

_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".map": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".ico": "image/x-icon",
    ".webp": "image/webp",
    ".woff2": "font/woff2",
    ".txt": "text/plain; charset=utf-8",
}


async def read(root: Path, rel: str) -> tuple[bytes, Headers]:
    """The body and headers of the file `rel` (still percent-encoded) names; ApiError 404."""
    path = resolve_static(root, rel)
    if path is None:
        raise ApiError(404, "not_found", "not found")
    found = await asyncio.to_thread(_read_static, path)
    if found is None and "." not in PurePosixPath(rel).name:
        path = root / "index.html"
        found = await asyncio.to_thread(_read_static, path)
    if found is None:
        raise ApiError(404, "not_found", "not found")
    ctype = _CONTENT_TYPES.get(path.suffix.lower()) or (
        mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    )
    headers: Headers = [
        (b"content-type", ctype.encode()),
        (b"cache-control", b"no-cache"),
        (b"x-frame-options", b"DENY"),
        (b"referrer-policy", b"same-origin"),
    ]
    return found, headers


def resolve_static(root: Path, rel: str) -> Path | None:
    """The file under `root` that `rel` (still percent-encoded) names, or None; never outside."""
    try:
        decoded = urllib.parse.unquote(rel, errors="strict")
    except UnicodeDecodeError:
        return None
    if "\x00" in decoded or "\\" in decoded:
        return None
    parts = [p for p in decoded.split("/") if p]
    if any(p in (".", "..") or p.startswith(".") for p in parts):
        return None
    candidate = root.joinpath(*parts) if parts else root
    try:
        resolved = candidate.resolve()
    except (OSError, RuntimeError):
        return None
    if resolved != root and root not in resolved.parents:
        return None  # a symlink pointing out of the web root
    if resolved == root or not parts:
        return root / "index.html"
    return resolved


def _read_static(path: Path) -> bytes | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_STATIC_BYTES:
            return None
        return path.read_bytes()
    except OSError:
        return None
