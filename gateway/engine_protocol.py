"""The engine side of the gateway's HTTP/1.1: request bytes out, a strict response parser in.

Written for the relay's hot path instead of h11 (which cost as much as everything else
together): the request head is joined from parts that came out of h11's parser on the client
side, and the answer is parsed by a small state machine over one buffer.  It is strict
where a proxy must be: CRLF line ends only, no obs-fold, no Content-Length together with
Transfer-Encoding, chunked as the only transfer coding, bounded heads, chunk lines and
trailers.  Body bytes come out as they arrive (chunked framing removed); a connection is
reusable only when its answer was read to the end, nothing followed it and neither side
asked to close.  Errors come out as `UpstreamProtocolError` and `UpstreamClosed`.
"""

from __future__ import annotations

import enum
import re

from gateway.errors import UpstreamClosed, UpstreamProtocolError
from gateway.messages import (
    CONTENT_LENGTH,
    CONTENT_LENGTH_DIGITS,
    FIELD_VALUE,
    MEMO_MISSES,
    TOKEN,
    Headers,
    LengthMemo,
    ResponseHead,
    Signal,
    comma_tokens,
    field_lines,
)

# A whole response head: status line, header lines, the empty line.  Inside a line anything
# but NUL, CR, LF, VT and FF (what h11 accepts); never a folded line, never a bare LF.
_HEAD = re.compile(
    rb"HTTP/1\.[01] [1-9][0-9][0-9](?: [^\x00\r\n\x0b\x0c]*)?\r\n"
    rb"(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+:[^\x00\r\n\x0b\x0c]*\r\n)*\r\n"
)
_TRAILER_LINE = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+:[^\x00\r\n\x0b\x0c]*")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:;[^\x00\r\n]*)?[ \t]*")
# A chunk's size line as `gateway.protocol.ServerSession.body` writes one (and h11, uvicorn,
# llama.cpp's server): lower-case hex without leading zeros or extensions.
_PLAIN_CHUNK_LINE = re.compile(rb"([1-9a-f][0-9a-f]{0,15})\r\n")
_TARGET = re.compile(rb"[\x21-\x7e]+")
MAX_CHUNK_LINE = 4096  # chunk size plus extensions
_NO_BODY_STATUS = frozenset({204, 304})


class _State(enum.Enum):
    """Where the parser is in the answer."""

    HEAD = "head"  # waiting for the status line and headers (interim answers skipped)
    LENGTH = "length"  # Content-Length body: `_remaining` bytes to go
    CHUNK_LINE = "chunk_line"
    CHUNK_DATA = "chunk_data"  # `_remaining` bytes of this chunk to go
    CHUNK_END = "chunk_end"  # the CRLF after a chunk's data
    TRAILERS = "trailers"
    UNTIL_CLOSE = "until_close"  # no framing: the body ends when the engine closes
    END = "end"  # the body is complete; BODY_END not yet reported
    DONE = "done"  # BODY_END reported
    ERROR = "error"


_S_HEAD = _State.HEAD
_S_LENGTH = _State.LENGTH
_S_CHUNK_LINE = _State.CHUNK_LINE
_S_CHUNK_DATA = _State.CHUNK_DATA
_S_CHUNK_END = _State.CHUNK_END
_S_END = _State.END
_S_DONE = _State.DONE

# The memo of an engine's answer head; a relay keeps with it what it made of the head for its
# own client, as (before the length's digits, after them): see `ServerSession.template_of`.
AnswerMemo = LengthMemo[ResponseHead, tuple[bytes, bytes]]


def forward_prefix(
    method: bytes, target: bytes, host: bytes, headers: Headers, drop: frozenset[bytes]
) -> bytes:
    """The head `ClientSession.forward` sends, up to the value of its Content-Length: the
    request line, our Host, the client's headers minus those named in `drop`."""
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for name, value in headers:
        if name not in drop:
            parts += (name, b": ", value, b"\r\n")
    parts.append(b"content-length: ")
    return b"".join(parts)


class ClientSession:
    """One engine connection's HTTP/1.1 state as a client: a request, then its answer."""

    __slots__ = (
        "_buf",
        "_head_only",
        "_keep_alive",
        "_max_head",
        "_memo",
        "_memo_misses",
        "_pos",
        "_remaining",
        "_sent",
        "_state",
        "_trailer_bytes",
        "chunked",
        "eof",
        "keep_alive_s",
        "known",
        "received_any",
    )

    def __init__(self, *, max_header_bytes: int) -> None:
        self._max_head = max_header_bytes
        self._buf = b""
        self._pos = 0  # bytes of `_buf` before this are consumed
        self._state = _S_HEAD
        self._remaining = 0
        self._trailer_bytes = 0
        self._keep_alive = True
        self._sent = False  # this cycle's request was produced
        self._head_only = False  # the request was HEAD: the answer has no body
        self.received_any = False
        self.eof = False
        # Of the last answer head: chunked (a stream, as engines send them), and the idle
        # timeout its Keep-Alive header announced (None: it named none).
        self.chunked = False
        self.keep_alive_s: float | None = None
        self._memo: AnswerMemo | None = None  # the last answer's head (`_head`)
        self._memo_misses = 0  # answer heads in a row that were not the memo's
        # The memo of the answer head `next_event` returned last, when it has one (it came
        # from the memo, or the memo was made of it): its `derived` is the caller's to use.
        self.known: AnswerMemo | None = None

    # --- the request -------------------------------------------------------------------

    def request(
        self, method: bytes, target: bytes, headers: Headers, body: bytes, checked: bool = False
    ) -> bytes:
        """Bytes of a complete request with a Content-Length body, in one piece.

        `headers` must hold Host and, with a body, a matching Content-Length.  `checked`:
        method, target and headers came out of an HTTP parser and the framing headers were
        set by the caller (skip revalidation).
        """
        if self._sent or self._state is not _S_HEAD or not self._keep_alive:
            raise UpstreamProtocolError("cannot send request: the connection is not idle")
        if not checked:
            _validate_request(method, target, headers, body)
        self._head_only = method == b"HEAD"
        self._sent = True
        parts = [method, b" ", target, b" HTTP/1.1\r\n"]
        later: list[bytes] = []
        for name, value in headers:  # h11's order: Host first (RFC 9112 3.2), then as given
            if name == b"host":
                parts += (name, b": ", value, b"\r\n")
            else:
                later += (name, b": ", value, b"\r\n")
        parts += later
        parts.append(b"\r\n")
        if body:
            parts.append(body)
        return b"".join(parts)

    def forward(
        self,
        method: bytes,
        target: bytes,
        host: bytes,
        headers: Headers,
        drop: frozenset[bytes],
        body: bytes,
        checked: bool = True,
    ) -> bytes:
        """Bytes of a request relayed from a client, in one piece: `request` with our Host
        first and our Content-Length last, the client's headers between them minus those
        named in `drop` (which must name Host and Content-Length when they may be there).
        `checked`: method, target and headers came out of an HTTP parser (not revalidated).
        """
        if not checked:  # (`forward_known` checks that the connection is idle)
            length = (b"content-length", b"%d" % len(body))
            _validate_request(method, target, [(b"host", host), *headers, length], body)
        return self.forward_known(forward_prefix(method, target, host, headers, drop), method, body)

    def forward_known(self, prefix: bytes, method: bytes, body: bytes) -> bytes:
        """What `forward` sends for a request whose head `forward_prefix` made `prefix` of
        (the express lane keeps it with the memo of the client's head, for the next request
        alike but for its body)."""
        if self._sent or self._state is not _S_HEAD or not self._keep_alive:
            raise UpstreamProtocolError("cannot send request: the connection is not idle")
        self._head_only = method == b"HEAD"
        self._sent = True
        return b"".join((prefix, b"%d" % len(body), b"\r\n\r\n", body))

    def send_failed(self) -> None:
        """The request bytes never reached the engine: never reuse this connection."""
        self._keep_alive = False

    # --- the answer --------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Feed bytes read from the engine; b"" means it closed its side."""
        if not data:
            self.eof = True
            return
        if self.eof:
            raise UpstreamProtocolError("data after end of stream")
        self.received_any = True
        if self._pos >= len(self._buf):
            self._buf = data
        else:
            self._buf = self._buf[self._pos :] + data
        self._pos = 0

    def whole_chunk(self, data: bytes) -> int:
        """Where the payload starts when `data`, just read, is exactly one whole chunk of the
        answer in its plain form (see `_PLAIN_CHUNK_LINE`), taken as if received and read
        out; 0 when not, and nothing changed: `receive` it as usual.

        An engine writes one chunk per event of a stream: a relay whose client gets the
        same framing passes these bytes on as they are (`gateway.express`).
        """
        if self._state is not _S_CHUNK_LINE or self._pos < len(self._buf) or self.eof:
            return 0
        # The check of `_chunked_body`'s first lines, for the plain form only: one match of
        # the size line and its CRLF (a `find` and a call less, on every stream event).
        match = _PLAIN_CHUNK_LINE.match(data)
        if match is None:
            return 0
        start = match.end()
        if start + int(match.group(1), 16) + 2 != len(data) or not data.endswith(b"\r\n"):
            return 0
        return start

    def alike_answer(self, data: bytes) -> tuple[tuple[bytes, bytes], bytes] | None:
        """When `data`, just read, is exactly one whole answer alike to the memo's but for its
        Content-Length, and the memo keeps what the caller made of it (`LengthMemo.derived`):
        that and the digits.  None when not.  Nothing changes either way: `take_alike` takes
        the answer as read, else `receive` it as usual.

        An engine answers a keep-alive client's requests with heads alike and sends each
        answer in one write: a relay that made the client's head of one of them makes the
        next of that, without the events of `next_event` (`gateway.express`).
        """
        memo = self._memo
        if (
            memo is None
            or self._state is not _S_HEAD
            or not self._sent
            or self._head_only
            or self._pos < len(self._buf)
            or self.eof
        ):
            return None
        derived = memo.derived
        if derived is None:
            return None
        digits = memo.whole(data)
        return None if digits is None else (derived, digits)

    def take_alike(self) -> None:
        """The answer `alike_answer` found whole is received and read to its end, as
        `next_event` would leave it after BODY_END (the head's memo in `known`)."""
        self._memo_misses = 0
        self.known = self._memo
        self.chunked = False
        self.received_any = True
        self._buf, self._pos = b"", 0
        self._remaining = 0
        self._state = _S_DONE

    def next_event(self) -> ResponseHead | bytes | Signal:
        """The next thing the engine said (interim 1xx answers are skipped).

        Body bytes come out as far as they are buffered, in one piece whatever the chunks.
        """
        state = self._state
        if state is _S_LENGTH:
            return self._length_body()
        if state is _S_HEAD:
            return self._head()
        if state is _S_END:
            self._state = _S_DONE
            return Signal.BODY_END
        if state is _S_DONE:
            return Signal.PAUSED
        if state is _State.UNTIL_CLOSE:
            return self._until_close_body()
        if state is _State.ERROR:
            raise UpstreamProtocolError("invalid answer from engine (already reported)")
        if self._pos >= len(self._buf) and not self.eof:
            return Signal.NEED_DATA  # between two pieces of a stream
        return self._chunked_body()

    @property
    def complete(self) -> bool:
        """The whole answer has been received."""
        state = self._state  # `is` tests: an Enum member hashes in Python code
        return state is _S_END or state is _S_DONE

    @property
    def reusable(self) -> bool:
        """The request went out, its answer was read to the end, and nobody asked to close."""
        return self._sent and self._keep_alive and self.complete

    @property
    def clean(self) -> bool:
        """Nothing was received beyond the answer (bytes between answers mean: never reuse)."""
        return self._pos >= len(self._buf)

    def start_next_cycle(self) -> None:
        """Reset for the next request (only when `reusable`)."""
        if not self.reusable:
            raise UpstreamProtocolError("connection is not reusable")
        self._state = _S_HEAD
        self._sent = False
        self._head_only = False
        self._trailer_bytes = 0
        self.received_any = False

    # --- parsing -----------------------------------------------------------------------

    def _head(self) -> ResponseHead | Signal:
        if self._pos >= len(self._buf) and not self.eof:
            return Signal.NEED_DATA  # the usual first call, before the answer arrived
        while True:
            buf, pos = self._buf, self._pos
            end = buf.find(b"\r\n\r\n", pos)
            if end < 0:
                if len(buf) - pos > self._max_head:
                    raise self._error("response head too large")
                if not _may_become_head(buf[pos:]):  # fail now, not at a timeout
                    raise self._error(f"malformed response head {buf[pos : pos + 80]!r}")
                if self.eof:
                    self._state = _State.ERROR
                    self._keep_alive = False
                    raise UpstreamClosed(
                        "engine closed the connection", before_response=not self.received_any
                    )
                return Signal.NEED_DATA
            end += 4
            if end - pos > self._max_head:
                raise self._error("response head too large")
            # An engine's answers on one connection differ mostly in their Content-Length
            # (and Date, once a second): a head that is the last one's but for its length is
            # taken from a memo (see `LengthMemo`).  Not for HEAD, whose answer has no body.
            self.known = None
            memo = self._memo
            if memo is not None and not self._head_only:
                digits = memo.digits(buf, pos)
                if digits is not None:
                    return self._known_head(memo, digits, end)
                self._memo_misses += 1
                if self._memo_misses >= MEMO_MISSES:
                    self._memo = None  # kept no longer: not compared either
            if _HEAD.fullmatch(buf, pos, end) is None:
                raise self._error(f"malformed response head {buf[pos : min(end, pos + 80)]!r}")
            self._pos = end
            status = int(buf[pos + 9 : pos + 12])
            if status >= 200:
                return self._final_head(buf, pos, end, status)
            if status == 101:
                raise self._error("unexpected protocol switch")
            # An interim answer (100 Continue, 103 Early Hints): the real one follows.

    def _final_head(self, buf: bytes, pos: int, end: int, status: int) -> ResponseHead:
        """Headers of a final answer, and the framing of its body (RFC 9112 6.3)."""
        version = buf[pos + 5 : pos + 8]
        line_end = buf.find(b"\r\n", pos)
        reason = buf[pos + 13 : line_end] if line_end > pos + 13 else b""
        headers: Headers = []
        length: int | None = None
        chunked = False
        keep_alive = version == b"1.1"
        unusual_length = False
        self.keep_alive_s = None
        if end - line_end > 4:
            headers = field_lines(buf[line_end + 2 : end - 4])
            for name, value in headers:
                if name == b"content-length":
                    if length is None and value.isdigit() and len(value) <= CONTENT_LENGTH_DIGITS:
                        length = int(value)  # the usual case: one plain value
                    else:
                        length = self._content_length(length, value)
                        unusual_length = True
                elif name == b"transfer-encoding":
                    if chunked or value.lower() != b"chunked":
                        raise self._error("only one Transfer-Encoding: chunked is supported")
                    chunked = True
                elif (
                    name == b"connection"
                    and value.lower() != b"keep-alive"  # the usual value, quickly
                    and b"close" in comma_tokens(value)
                ):
                    keep_alive = False
                elif name == b"keep-alive":
                    timeout, more = keep_alive_params(value)
                    self.keep_alive_s = timeout
                    if more == 0:  # no further request allowed (RFC 2068 19.7.1.1)
                        keep_alive = False
        if chunked and length is not None:
            raise self._error("both Content-Length and Transfer-Encoding")
        if unusual_length and length is not None:
            headers = _one_content_length(headers, length)
        if not keep_alive:
            self._keep_alive = False
        self.chunked = chunked
        head = ResponseHead(status=status, reason=reason, headers=headers, http_version=version)
        if status in _NO_BODY_STATUS or self._head_only:
            self._state = _S_END
        elif chunked:
            self._state = _S_CHUNK_LINE
        elif length is not None:
            self._remaining = length
            self._state = _S_LENGTH if length else _S_END
            if keep_alive and not unusual_length and self._memo_misses < MEMO_MISSES:
                # Framed by one plain Content-Length: what `_known_head` can make again.
                known: AnswerMemo | None = LengthMemo.of(head, buf, pos, end)
                if known is not None:
                    self._memo = self.known = known
        else:
            self._state = _State.UNTIL_CLOSE
            self._keep_alive = False
        return head

    def _known_head(self, memo: AnswerMemo, digits: bytes, end: int) -> ResponseHead:
        """The memo's head with `digits` as its length, as `_final_head` would parse it: one
        plain Content-Length frames the body; the connection stays keep-alive."""
        self._memo_misses = 0
        self.known = memo
        self.chunked = False
        self._pos = end
        length = int(digits)
        self._remaining = length
        self._state = _S_LENGTH if length else _S_END
        head = memo.head
        return ResponseHead(
            status=head.status,
            reason=head.reason,
            headers=memo.headers_with(digits),
            http_version=head.http_version,
        )

    def _content_length(self, seen: int | None, value: bytes) -> int:
        """The length a Content-Length value gives; equal repeats are allowed (RFC 9110 8.6)."""
        values = {v.strip() for v in value.split(b",")} if b"," in value else {value}
        if len(values) != 1:
            raise self._error("conflicting Content-Length values")
        text = values.pop()
        if CONTENT_LENGTH.fullmatch(text) is None:
            raise self._error(f"bad Content-Length {text[:40]!r}")
        length = int(text)
        if seen is not None and seen != length:
            raise self._error("conflicting Content-Length headers")
        return length

    def _length_body(self) -> bytes | Signal:
        buf, pos = self._buf, self._pos
        available = len(buf) - pos
        if available == 0:
            if self.eof:
                raise self._closed_mid_body()
            return Signal.NEED_DATA
        remaining = self._remaining
        if available <= remaining:
            data = buf if pos == 0 else buf[pos:]
            self._buf, self._pos = b"", 0
            remaining -= available
        else:
            data = buf[pos : pos + remaining]
            self._pos = pos + remaining
            remaining = 0
        self._remaining = remaining
        if not remaining:
            self._state = _S_END
        return data

    def _until_close_body(self) -> bytes | Signal:
        buf, pos = self._buf, self._pos
        if pos < len(buf):
            self._buf, self._pos = b"", 0
            return buf if pos == 0 else buf[pos:]
        if self.eof:
            self._state = _S_DONE
            return Signal.BODY_END
        return Signal.NEED_DATA

    def _chunked_body(self) -> bytes | Signal:
        """Every whole or partial chunk already buffered, as one piece of body."""
        buf, pos = self._buf, self._pos
        size = len(buf)
        state = self._state
        if state is _S_CHUNK_LINE:
            # A stream's usual read: exactly one whole chunk (an engine writes one per event).
            # Half the cost of the loop below, which does the same with any other buffer.
            end = buf.find(b"\r\n", pos, pos + MAX_CHUNK_LINE + 2)
            if end > pos:
                match = _CHUNK_LINE.fullmatch(buf, pos, end)
                if match is not None:
                    length = int(match.group(1), 16)
                    if length and end + length + 4 == size and buf.endswith(b"\r\n"):
                        self._buf, self._pos = b"", 0
                        return buf[end + 2 : size - 2]
        pieces: list[bytes] = []
        while True:
            if state is _S_CHUNK_DATA:
                take = min(self._remaining, size - pos)
                if take == 0:
                    break
                pieces.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                state = _S_CHUNK_END
            elif state is _S_CHUNK_LINE:
                end = buf.find(b"\r\n", pos, pos + MAX_CHUNK_LINE + 2)
                if end < 0:
                    if size - pos > MAX_CHUNK_LINE:
                        raise self._error("chunk size line too long")
                    break
                match = _CHUNK_LINE.fullmatch(buf, pos, end)
                if match is None:
                    raise self._error(f"bad chunk size line {buf[pos : min(end, pos + 40)]!r}")
                pos = end + 2
                self._remaining = int(match.group(1), 16)
                state = _S_CHUNK_DATA if self._remaining else _State.TRAILERS
            elif state is _S_CHUNK_END:
                if size - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise self._error("chunk data not followed by CRLF")
                pos += 2
                state = _S_CHUNK_LINE
            else:  # TRAILERS: header lines up to an empty one; checked, then dropped
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if self._trailer_bytes + size - pos > self._max_head:
                        raise self._error("trailers too large")
                    break
                if end == pos:  # the empty line: the answer is complete
                    pos += 2
                    state = _S_END
                    break
                self._trailer_bytes += end - pos + 2
                if self._trailer_bytes > self._max_head:
                    raise self._error("trailers too large")
                if _TRAILER_LINE.fullmatch(buf, pos, end) is None:
                    raise self._error("malformed trailer line")
                pos = end + 2
        self._state, self._pos = state, pos
        if pieces:
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if state is _S_END:
            self._state = _S_DONE
            return Signal.BODY_END
        if self.eof:
            raise self._closed_mid_body()
        return Signal.NEED_DATA

    def _closed_mid_body(self) -> UpstreamClosed:
        self._state = _State.ERROR
        self._keep_alive = False
        return UpstreamClosed("engine closed the connection before its answer was complete")

    def _error(self, reason: str) -> UpstreamProtocolError:
        self._state = _State.ERROR
        self._keep_alive = False
        return UpstreamProtocolError(f"invalid answer from engine: {reason}")


def keep_alive_params(value: bytes) -> tuple[float | None, int | None]:
    """The `timeout` (seconds) and `max` (further requests) of a Keep-Alive header value
    (RFC 2068 19.7.1.1; llama.cpp's and Apache's `timeout=5, max=100`); None where absent
    or not a number."""
    timeout: float | None = None
    more: int | None = None
    for part in value.split(b","):
        name, _, number = part.partition(b"=")
        name = name.strip().lower()
        number = number.strip()
        if not number.isdigit() or len(number) > 9:
            continue
        if name == b"timeout":
            timeout = float(int(number))
        elif name == b"max":
            more = int(number)
    return timeout, more


def _one_content_length(headers: Headers, length: int) -> Headers:
    """Equal repeats of Content-Length (`3, 3`, or the header twice) as one, where the first
    stood: what h11 makes of them, so both parsers hand the relay the same headers."""
    out: Headers = []
    seen = False
    for name, value in headers:
        if name == b"content-length":
            if seen:
                continue
            seen = True
            value = str(length).encode()
        out.append((name, value))
    return out


def _may_become_head(partial: bytes) -> bool:
    """Whether the start of a head can still become valid (no bare LF, begins as HTTP/1.)."""
    return partial[:7] == b"HTTP/1."[: len(partial)] and partial.count(b"\n") == partial.count(
        b"\r\n"
    )


def _validate_request(method: bytes, target: bytes, headers: Headers, body: bytes) -> None:
    """What h11 checks before it sends a request, for requests not built from parsed parts."""
    if TOKEN.fullmatch(method) is None:
        raise UpstreamProtocolError(f"cannot send request: bad method {method[:40]!r}")
    if _TARGET.fullmatch(target) is None:
        raise UpstreamProtocolError(f"cannot send request: bad target {target[:80]!r}")
    host = False
    length: bytes | None = None
    for name, value in headers:
        if TOKEN.fullmatch(name) is None or FIELD_VALUE.fullmatch(value) is None:
            raise UpstreamProtocolError(f"cannot send request: bad header {name[:40]!r}")
        lower = name.lower()
        if lower == b"host":
            host = True
        elif lower == b"content-length":
            if length is not None and length != value:
                raise UpstreamProtocolError("cannot send request: conflicting Content-Length")
            length = value
        elif lower == b"transfer-encoding":
            raise UpstreamProtocolError("cannot send request: only Content-Length bodies")
    if not host:
        raise UpstreamProtocolError("cannot send request: missing Host header")
    if (length is None and body) or (length is not None and length != str(len(body)).encode()):
        raise UpstreamProtocolError("cannot send request: Content-Length does not match body")
