"""Helpers the runtime tests share (Docker and process)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


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
