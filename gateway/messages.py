"""HTTP/1.1 message types and header rules shared by both ends of the gateway (pure, no I/O)."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence

import msgspec

Headers = list[tuple[bytes, bytes]]

# RFC 9110 7.6.1 plus the historical ones proxies also drop; names listed in a message's own
# Connection header are dropped too (see `strip_hop_by_hop`).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# RFC 9110 5.1 and 5.5.  A value is what h11 accepts when it sends: no NUL, no CR/LF or other
# whitespace except single runs of SP/HTAB between visible characters, none at either end.
TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
FIELD_VALUE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
REASON = re.compile(rb"[^\x00\r\n\x0b\x0c]*")  # HTAB / SP / VCHAR / obs-text (and CTLs h11 lets by)
# A plain Content-Length: up to 19 digits (fits in 63 bits; more is never a real body).  Hot
# paths test `value.isdigit() and len(value) <= CONTENT_LENGTH_DIGITS`, the same rule.
CONTENT_LENGTH_DIGITS = 19
CONTENT_LENGTH = re.compile(rb"[0-9]{1,%d}" % CONTENT_LENGTH_DIGITS)


class Signal(enum.Enum):
    """Non-data outcomes of `next_event`."""

    NEED_DATA = "need_data"  # read more bytes from the socket
    PAUSED = "paused"  # the peer finished its part; nothing to do until the next cycle
    BODY_END = "body_end"  # the message body is complete
    CLOSED = "closed"  # the peer closed cleanly between messages


class RequestHead(msgspec.Struct, frozen=True, gc=False):
    """A parsed request line and headers (names lower-cased, as h11 gives them)."""

    method: bytes
    target: bytes
    headers: Headers
    http_version: bytes
    has_body: bool


class ResponseHead(msgspec.Struct, frozen=True, gc=False):
    """A parsed response status line and headers (names lower-cased)."""

    status: int
    reason: bytes
    headers: Headers
    http_version: bytes


# Request headers never passed to an engine: hop-by-hop ones, Host and Content-Length (the
# pool sets them), Expect (the body is already complete: no 100-continue upstream), the probe.
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"x-dgxmm-health-check"}


def field_lines(block: bytes) -> Headers:
    """(lower-case name, value without OWS) of CRLF-separated header lines already validated."""
    fields: Headers = []
    for line in block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        fields.append((name.lower(), value.strip(b" \t")))
    return fields


def comma_tokens(value: bytes) -> list[bytes]:
    """The lower-case elements of a comma-separated header value (RFC 9110 5.6.1)."""
    return [t.strip().lower() for t in value.split(b",")]


def connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """The lower-case tokens of every Connection header."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            tokens.update(comma_tokens(value))
    tokens.discard(b"")
    return tokens


def not_forwarded(
    headers: Sequence[tuple[bytes, bytes]], drop: frozenset[bytes] = HOP_BY_HOP
) -> frozenset[bytes]:
    """The names of `headers` not to pass on: `drop` (the hop-by-hop ones) and those the
    Connection header names."""
    for name, value in headers:
        # `Connection: keep-alive` (nginx, llama.cpp) names a header dropped anyway.
        if name == b"connection" and value.lower() != b"keep-alive":
            return drop | connection_tokens(headers)
    return drop


def strip_hop_by_hop(
    headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes] = HOP_BY_HOP
) -> Headers:
    """The headers minus `drop` (the hop-by-hop ones) and those the Connection header names."""
    items = headers if isinstance(headers, list) else list(headers)
    drop = not_forwarded(items, drop)
    return [(n, v) for n, v in items if n not in drop]


def header_value(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lower-case), or None."""
    for n, v in headers:
        if n == name:
            return v
    return None
