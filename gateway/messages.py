"""HTTP/1.1 message types and header rules shared by both ends of the gateway (pure, no I/O)."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from typing import Generic, Protocol, TypeVar

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
# The Content-Length line of a head that has one plain one (see `LengthMemo`).
_LENGTH_LINE = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)[ \t]*\r\n", re.IGNORECASE)
# Heads in a row unlike its memo after which a connection stops keeping one: its peer varies
# more than the Content-Length (a request id in a header, say), and memos would only cost it.
MEMO_MISSES = 3


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
# pool sets them), Expect (the body is already complete: no 100-continue upstream), the probe,
# and Authorization: the gateway key stops at the gateway (`gateway.access`), engines need none.
NOT_FORWARDED = HOP_BY_HOP | {
    b"host", b"content-length", b"expect", b"x-dgxmm-health-check", b"authorization",
}  # fmt: skip


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


class _Head(Protocol):
    @property
    def headers(self) -> Headers: ...


H = TypeVar("H", bound=_Head)
D = TypeVar("D")


class LengthMemo(Generic[H, D]):
    """A head parsed from a connection, kept to take the next one at a glance when it differs
    only in its Content-Length digits.

    A peer on a keep-alive connection usually sends the same head again with another length:
    a client's SDK the same request line and headers, an engine the same status line and
    headers (until its Date changes, once a second).  The bytes before the digits and after
    them, to the end of the head, must be the memo's, and the new digits what the parsers
    accept as a plain length (`CONTENT_LENGTH`): then parsing would make the memo's head of
    them with that length, so the caller builds it from the memo (`digits`, `headers_with`)
    instead.  The head must have had exactly one Content-Length, a plain one.
    """

    __slots__ = ("after", "before", "derived", "head", "index", "stop")

    def __init__(self, head: H, before: bytes, after: bytes, index: int) -> None:
        self.head = head
        self.before = before  # from the start of the head up to the digits
        self.after = after  # from the digits to the end of the head (its CRLF CRLF)
        self.stop = after[:1]  # what ends the digits: SP, HTAB or CR, never a digit
        self.index = index  # of Content-Length in the head's headers
        # What a user of the memo made of its head, to make it again for a head alike.  The
        # express lane keeps, with a client's head, its route and the engine request's head
        # (`gateway.express.Forwarding`) and, with an engine's answer head, the client's
        # answer head (`ServerSession.template_of`).
        self.derived: D | None = None

    @classmethod
    def of(cls, head: H, buf: bytes, start: int, end: int) -> LengthMemo[H, D] | None:
        """A memo of `head`, parsed from `buf[start:end]`; None without a Content-Length
        line."""
        match = _LENGTH_LINE.search(buf, start, end)
        if match is None:
            return None
        for index, (name, _) in enumerate(head.headers):
            if name == b"content-length":
                before, after = buf[start : match.start(1)], buf[match.end(1) : end]
                return cls(head, before, after, index)
        return None  # pragma: no cover - a line that field_lines would not name so

    def digits(self, buf: bytes, start: int) -> bytes | None:
        """The Content-Length digits of the head at `start` in `buf` when it is the memo's but
        for them; None when it is not (then parse it).  When they are, that head ends where
        `after` does: no CRLF CRLF comes before the last four bytes of `after`."""
        before = self.before
        if not buf.startswith(before, start):
            return None
        # What `CONTENT_LENGTH.match` takes, without the regex (this runs twice a request):
        # 1 to 19 digits, up to the first byte of `after`, which is not a digit.
        at = start + len(before)
        stop = buf.find(self.stop, at, at + CONTENT_LENGTH_DIGITS + 1)
        if stop < 0:
            return None
        digits = buf[at:stop]  # b"" when there are none: not `isdigit`
        if not digits.isdigit() or not buf.startswith(self.after, stop):
            return None
        return digits

    def whole(self, data: bytes) -> bytes | None:
        """The Content-Length digits when `data` is exactly one whole message whose head is
        the memo's but for them: that head, then as many bytes as they say, nothing after
        (not a part of the body, nor more than the message); None when not."""
        digits = self.digits(data, 0)  # then the head ends where `after` does
        if digits is None:
            return None
        if len(self.before) + len(digits) + len(self.after) + int(digits) != len(data):
            return None
        return digits

    def headers_with(self, digits: bytes) -> Headers:
        """A copy of the memo's headers with `digits` as the Content-Length value."""
        headers = self.head.headers.copy()
        headers[self.index] = (b"content-length", digits)
        return headers
