"""Private files: what DGXMM writes is readable by its own user only.

The event log holds scrypt hashes, token hashes and the audit trail; engine logs may echo
secrets from an engine's command line.  `dgxmm serve` and the commands that write the log
set the umask to 077 before they create anything (files 0600, directories 0700), and
tighten the modes of what an older version left world-readable: the data directory, the
log with its `-wal`/`-shm`, the engine log directory and its logs.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

import structlog

log = structlog.get_logger("dgxmm.private")

UMASK = 0o077
AUTH_KEY_FILE = "auth.key"
AUTH_KEY_BYTES = 32


def private_umask() -> int:
    """Set the umask to 077; returns the old one."""
    return os.umask(UMASK)


def _tighten(path: Path, mode: int) -> None:
    """chmod `path` to `mode` if it exists and is looser (never follows a symlink)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) & ~mode == 0:
        return
    try:
        path.chmod(mode)
    except OSError as exc:  # policy: say so and go on (e.g. a directory owned by root)
        log.warning("chmod_failed", path=str(path), error=str(exc))


def secure_tree(data_dir: Path, db: Path) -> None:
    """Create the data directory 0700 and tighten what exists under it and the log's files."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tighten(data_dir, 0o700)
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal")):
        _tighten(path, 0o600)
    if db.parent != data_dir:
        _tighten(db.parent, 0o700)
    engines = data_dir / "engines"
    if engines.is_dir():
        _tighten(engines, 0o700)
        with contextlib.suppress(OSError):
            for child in engines.rglob("*"):
                _tighten(child, 0o700 if child.is_dir() else 0o600)
    for name in (AUTH_KEY_FILE, "demo-admin-password", "gateway.key", "gateway.key.previous"):
        _tighten(data_dir / name, 0o600)


def auth_key(data_dir: Path) -> bytes:
    """The key that signs "known client" cookies (created 0600 on first use)."""
    path = data_dir / AUTH_KEY_FILE
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = b""
    if len(key) >= AUTH_KEY_BYTES:
        return key
    key = secrets.token_bytes(AUTH_KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key
