"""File descriptors and the connection cap: decisions here, the two system calls at the edge.

Every client connection holds a descriptor, and a relayed one a second for its engine
connection.  The soft limit is often 1,024 while the hard one is far higher, so a server
raises the soft limit to the hard one when it starts and derives its connection cap from
what it got, leaving `FD_RESERVE` for everything else of the process (engine processes'
pipes and logs, SQLite, the Docker socket, probes, LiteLLM).  Beyond the cap a connection
gets a 503 with Retry-After; running out of descriptors anyway (uvloop then drops new
connections without a word) is noticed by counting them now and then and is logged.
"""

from __future__ import annotations

import errno
import os
import resource

import structlog

log = structlog.get_logger("gateway.limits")

FD_RESERVE = 256
# Per capped connection: its own descriptor and an engine connection's, and a third so that
# the gateway's and the admin API's servers, capped alike, fit together.
FDS_PER_CONNECTION = 3
FD_CHECK_EVERY_S = 5.0  # how often a server counts its process's open descriptors
WARN_EVERY_S = 60.0  # one warning per this long for a condition that lasts


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else target
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("fd_limit_not_raised", soft=soft, hard=hard, error=repr(exc))
        return soft
    log.info("fd_limit_raised", soft=target, was=soft)
    return target


def connection_cap(configured: int, fd_limit: int) -> int:
    """The connections one server may hold: its configured cap, or less if descriptors are."""
    return max(1, min(configured, (fd_limit - FD_RESERVE) // FDS_PER_CONNECTION))


def fd_pressure(open_fds: int, fd_limit: int) -> str | None:
    """ "exhausted" when (nearly) no descriptor is left, "low" inside the reserve, else None."""
    if open_fds < 0:
        return None  # not countable here
    if open_fds >= fd_limit - 8:
        return "exhausted"
    if open_fds >= fd_limit - FD_RESERVE // 2:
        return "low"
    return None


def open_fds() -> int:
    """How many descriptors this process has open (-1 where /proc is not available)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return fd_limit()  # not even one left to count them with
        return -1


def fd_limit() -> int:
    """The soft limit on open files now."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class Every:
    """Says yes at most once per `interval` (loop time): for warnings about lasting states."""

    __slots__ = ("_next", "interval")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._next = float("-inf")

    def due(self, now: float) -> bool:
        """True (and the next one `interval` later) when the last yes is long enough ago."""
        if now < self._next:
            return False
        self._next = now + self.interval
        return True
