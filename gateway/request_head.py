"""The fast path for request heads: a strict parser for the common, well-formed case.

h11 parsing a client's request head was the largest single cost of a relayed request
(about 39 % of the gateway's CPU).  Most heads are plain: HTTP/1.1, CRLF line ends, one
Host, no body or one Content-Length.  This parser takes those with one regular expression
over the whole head and a split; anything else (HTTP/1.0, obs-fold, bare LF, chunked or
repeated framing headers, Upgrade, CONNECT, an incomplete head h11 would already refuse,
heads near the size bound) is left to h11, which stays the judge of everything that is
not plainly valid.  The differential tests (`tests/test_gateway_request_head.py`) hold both
to the same outcome on every input: the same request or the same refusal.

Pure functions over bytes; `gateway.protocol.ServerSession` decides when to call them.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.messages import (
    CONTENT_LENGTH_DIGITS,
    Headers,
    LengthMemo,
    comma_tokens,
    field_lines,
)

# A whole head of an HTTP/1.1 request: request line, header lines, the empty line.  A line
# holds anything but NUL, CR, LF, VT and FF (what h11 accepts: OWS, field-content, OWS);
# never a folded line, never a bare CR or LF.  Token and target classes are h11's.
_HEAD = re.compile(
    rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+ [\x21-\x7e]+ HTTP/1\.1\r\n"
    rb"(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+:[^\x00\r\n\x0b\x0c]*\r\n)*\r\n"
)
_SIZE = 12  # per request line in the head-size estimate `ServerSession` applies (see below)
# The headers this parser looks at; any other is passed on as it is.
_FRAMING = frozenset(
    {b"content-length", b"host", b"transfer-encoding", b"upgrade", b"connection", b"expect"}
)


class FastHead(msgspec.Struct, frozen=True, gc=False):
    """A request head the fast path accepted (a struct: made in C, with no Python call)."""

    method: bytes
    target: bytes
    headers: Headers  # (lower-case name, value without OWS), in order
    content_length: bytes | None  # digits only, when the request has one
    keep_alive: bool
    expect_continue: bool
    end: int  # where the head ends in the buffer (the body starts)


# The memo of a client's request head; what its user keeps with it is the user's (the express
# lane's: `gateway.express.Forwarding`).
HeadMemo = LengthMemo[FastHead, Any]


def may_complete(buf: bytes, max_head: int) -> bool:
    """Whether waiting for more bytes is what h11 would do with `buf` (no complete head yet).

    h11 refuses at once a first byte below 0x21, ends a head at a blank line made of bare
    LFs too, and refuses more than `max_head` bytes without a complete head: in all these
    cases h11 must see the bytes now.
    """
    return (
        len(buf) <= max_head
        and (not buf or buf[0] > 0x20)
        and b"\n\n" not in buf
        and b"\n\r\n" not in buf
    )


def parse_head(buf: bytes, end: int, max_head: int) -> FastHead | None:
    """The head in `buf[:end]` (`end` just past its first CRLF CRLF), or None for h11.

    None means only "not plainly valid": h11 decides whether it is a request or an error.
    """
    if _HEAD.fullmatch(buf, 0, end) is None:
        return None
    line_end = buf.find(b"\r\n")
    space = buf.find(b" ")
    method = buf[:space]
    if method == b"CONNECT":
        return None  # a protocol switch in h11's state machine
    target = buf[space + 1 : line_end - 9]
    headers: Headers = []
    length: bytes | None = None
    hosts = 0
    expect = False
    close = False
    if end - line_end > 4:
        headers = field_lines(buf[line_end + 2 : end - 4])
    for name, value in headers:
        if name not in _FRAMING:
            continue
        if name == b"content-length":
            if length is not None or not (value.isdigit() and len(value) <= CONTENT_LENGTH_DIGITS):
                return None  # repeated, a list or not a plain number: h11's rules
            length = value
        elif name == b"host":
            hosts += 1
        elif name == b"transfer-encoding" or name == b"upgrade":
            return None  # chunked bodies and protocol switches go through h11
        elif name == b"connection":
            close = close or b"close" in comma_tokens(value)
        elif name == b"expect":
            expect = expect or b"100-continue" in comma_tokens(value)
    if hosts != 1:
        return None
    # The same estimate of the head's size as for heads from h11: a head near the bound is
    # refused or not by the same arithmetic, so it goes to h11 and that arithmetic.  The
    # estimate is at most `end - 2` plus one per header line, so most heads need no sum.
    if end - 2 + len(headers) > max_head:
        size = len(method) + len(target) + _SIZE
        size += sum(len(name) + len(value) + 4 for name, value in headers)
        if size > max_head:
            return None
    return FastHead(method, target, headers, length, not close, expect, end)


def remember(buf: bytes, head: FastHead) -> HeadMemo | None:
    """A memo of `head`, just parsed from `buf`, when it has a Content-Length (see
    `LengthMemo`: a keep-alive client's next request usually has the same request line and
    headers, the same SDK, key and route, and another body)."""
    if head.content_length is None:
        return None
    return LengthMemo.of(head, buf, 0, head.end)


def parse_known_head(memo: HeadMemo, buf: bytes, end: int, max_head: int) -> FastHead | None:
    """What `parse_head` makes of the head `buf[:end]` when it is the memo's but for its
    Content-Length digits; None when it is not (then parse it)."""
    length = memo.digits(buf, 0)
    if length is None:
        return None
    head = memo.head
    if end - 2 + len(head.headers) > max_head:  # near the bound: `parse_head` does the sum
        return None
    return FastHead(
        head.method,
        head.target,
        memo.headers_with(length),
        length,
        head.keep_alive,
        head.expect_continue,
        end,
    )
