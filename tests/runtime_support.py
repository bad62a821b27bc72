"""Helpers the runtime and crash tests share (Docker, process, child Pythons)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


PROJECT_ROOT = Path(__file__).resolve().parent.parent


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one test's coroutine on a fresh event loop."""
    return asyncio.run(coro)


async def poll_until(check: Callable[[], Awaitable[bool]], what: str, deadline_s: float) -> None:
    """Poll `check` until it holds; fail the test with `what` at the deadline."""
    end = time.monotonic() + deadline_s
    while not await check():
        if time.monotonic() > end:
            pytest.fail(f"not within {deadline_s}s: {what}")
        await asyncio.sleep(0.05)


async def http_status(host: str, port: int, path: str = "/") -> int | None:
    """Status code of a GET on loopback, or None if nothing answers."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5.0)
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()
    parts = status_line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


def python_child(code: str, *args: str) -> subprocess.Popen[bytes]:
    """`python -c code args...` run from the project, stdout and stderr piped (crash tests)."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
        cwd=PROJECT_ROOT,
    )
