"""Series of requests back to back and across keep-alive gaps, for the keep-alive race tests.

Each hop between a client and an engine keeps connections alive and closes idle ones on its
own timer (the engines' 5 s, LiteLLM's pool's 15 s, the gateway's 75 s): a request sent on a
connection that the other side closes at that moment is lost unless someone handles it.
`series` sends streamed and plain requests back to back (a stream followed at once by
another is where llama.cpp's `llama-server` ended connections under the gateway) and then
across gaps around the engines' 5 s keep-alive timeout, every transition between the two
kinds at every gap, and collects every answer that is not a complete 200.

Two clients: `fresh` opens a connection per request (as curl does); `Pooled` keeps one
alive without any retry (a plain integration), looking for the server's close before reuse
and dropping an idle connection after `IDLE_S` (as httpx and aiohttp do; below uvicorn's
5 s keep-alive, so that what is measured is the hops behind it, not its own race).
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.real_engine_support import call

# Around the engines' 5 s keep-alive timeout (llama.cpp's and uvicorn's), and well past it.
GAPS_S = (0.1, 4.9, 5.1, 10.0)
IDLE_S = 4.0  # a pooled client's idle expiry (httpx: 5 s)

Send = Callable[[bool], str | None]  # streamed or not; None when the answer was complete


def verdict(status: int, body: bytes, *, stream: bool) -> str | None:
    """None for a complete 200 answer, else what was wrong (kept short for the report)."""
    if status != 200:
        return f"{status} {body[:160]!r}"
    if stream:
        if not body.rstrip().endswith(b"data: [DONE]"):
            return f"stream without [DONE]: {body[-120:]!r}"
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:120]!r}"
    if not answer.get("choices"):
        return f"no choices: {body[:120]!r}"
    return None


def fresh(port: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> str | None:
    """One request on a new connection (`call`); its verdict (a connection error is one too)."""
    try:
        answer = call(port, "POST", path, body, headers, timeout_s=120)
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"
    return verdict(answer.status, answer.body, stream=bool(body.get("stream")))


class Kept:
    """One connection kept alive across requests, as the pools of httpx, urllib3 and aiohttp
    keep one: a new one only when none is open, when the kept one has been idle `idle_s`
    (None: no limit), or when it is readable before reuse (at EOF: the server closed it
    while it was idle; counted in `idle_closed`).  `watch` is a duplicate of its socket, to
    see the server's close after an answer."""

    def __init__(self, port: int, idle_s: float | None = None) -> None:
        self.port = port
        self.idle_s = idle_s
        self.conn: http.client.HTTPConnection | None = None
        self.watch: socket.socket | None = None
        self.idle_since = 0.0
        self.connections = 0
        self.idle_closed = 0

    def connection(self) -> http.client.HTTPConnection:
        """The kept connection, or a new one."""
        conn = self.conn
        if conn is not None and conn.sock is not None:
            idle = self.idle_s is not None and time.monotonic() - self.idle_since >= self.idle_s
            if not idle:
                if not select.select([conn.sock], [], [], 0)[0]:
                    return conn
                self.idle_closed += 1
        self.close()
        conn = self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.connect()
        assert conn.sock is not None
        self.watch = conn.sock.dup()
        self.connections += 1
        return conn

    def answered(self) -> None:
        """An answer was read whole: the connection is idle from now."""
        self.idle_since = time.monotonic()

    def close(self) -> None:
        """Close the kept connection, if any."""
        if self.conn is not None:
            self.conn.close()
        if self.watch is not None:
            self.watch.close()
        self.conn = self.watch = None


class Pooled:
    """One kept-alive connection (`Kept`, idle at most `IDLE_S`), no retry: a request that
    fails is the client's failure."""

    def __init__(self, port: int) -> None:
        self.kept = Kept(port, IDLE_S)
        self.lock = threading.Lock()

    @property
    def connections(self) -> int:
        """Connections opened so far."""
        return self.kept.connections

    def send(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> str | None:
        """One request on the kept connection (a new one only when it was closed or idle too
        long); its verdict."""
        with self.lock:
            conn = self.kept.connection()
            try:
                conn.request(
                    "POST", path, json.dumps(body), {"content-type": "application/json", **headers}
                )
                answer = conn.getresponse()
                data = answer.read()
            except (OSError, http.client.HTTPException) as exc:
                self.kept.close()
                return f"{type(exc).__name__}: {exc}"
            if answer.will_close:
                self.kept.close()
            self.kept.answered()
            return verdict(answer.status, data, stream=bool(body.get("stream")))

    def close(self) -> None:
        """Close the kept connection."""
        self.kept.close()


@dataclass
class Tally:
    """What one series sent and what failed (with where in the series)."""

    sent: int = 0
    failed: list[str] = field(default_factory=list)

    def note(self, where: str, outcome: str | None) -> None:
        """Count one answer."""
        self.sent += 1
        if outcome is not None:
            self.failed.append(f"{where}: {outcome}")

    def line(self, what: str) -> str:
        """One line for the `tried` summary."""
        return f"{what}: {self.sent} requests, {len(self.failed)} failed"


def series(send: Send, back_to_back: int, gaps: tuple[float, ...] = GAPS_S) -> Tally:
    """`back_to_back` streamed requests in a row, as many plain ones, then for each gap:
    plain, gap, streamed, gap, streamed, gap, plain (plain to streamed, streamed to
    streamed, streamed to plain, each across the gap).  The gaps are the traffic's shape:
    the behaviour under test is what a connection idle that long does."""
    tally = Tally()
    for stream in (True, False):
        kind = "streamed" if stream else "plain"
        for n in range(back_to_back):
            tally.note(f"{kind} #{n + 1} back to back", send(stream))
    for gap in gaps:
        for n, stream in enumerate((False, True, True, False)):
            if n:
                threading.Event().wait(gap)
            kind = "streamed" if stream else "plain"
            tally.note(f"{kind} after a {gap:g} s gap", send(stream))
    return tally
