"""Pure HTTP/1.1 protocol state for both ends of the gateway: bytes in, events and bytes out.

Nothing here touches a socket or awaits; `server.py` and `upstream.py` do the I/O and ask
these classes what the bytes mean and what to write.  h11 exceptions end here and come out
as the errors of `gateway.errors`.

Request heads from clients go first to the strict fast path of `gateway.request_head`, which
takes plainly valid ones; everything else is parsed by h11 (bounded, strict, smuggling
refused), as are chunked bodies.  With the fast path, a cycle that needs no h11 creates no
h11 connection.  Responses to
them are written here: h11's event machinery cost more than the rest of a relayed request,
and a response needs only its framing decided (RFC 9112 6.3, 9.6, the choices h11 makes, to
the byte) and its headers validated.  Each request cycle gets a fresh h11 connection that
starts with the bytes the previous one had not processed, because h11 can only start a
new cycle after it has sent a response itself.  The engine side is in `engine_protocol`.
"""

from __future__ import annotations

import enum
import http

import h11

from gateway.engine_protocol import ClientSession
from gateway.errors import BodyTooLarge, MalformedRequest, ResponseStateError
from gateway.messages import (
    CONTENT_LENGTH,
    CONTENT_LENGTH_DIGITS,
    FIELD_VALUE,
    HOP_BY_HOP,
    MEMO_MISSES,
    REASON,
    TOKEN,
    Headers,
    RequestHead,
    ResponseHead,
    Signal,
    comma_tokens,
    connection_tokens,
    header_value,
    strip_hop_by_hop,
)
from gateway.request_head import (
    FastHead,
    HeadMemo,
    may_complete,
    parse_head,
    parse_known_head,
    remember,
)

__all__ = [
    "HOP_BY_HOP",
    "REASON_PHRASES",
    "ClientSession",
    "Headers",
    "RequestHead",
    "ResponseHead",
    "ServerSession",
    "Signal",
    "header_value",
    "strip_hop_by_hop",
]

_EMPTY_BODY_STATUS = frozenset({204, 304})
# The standard reason phrase of each status (`HTTP/1.1 200 OK`): what the server puts in a
# status line given none (its own answers, and an engine's that came without one).
REASON_PHRASES = {s.value: s.phrase.encode() for s in http.HTTPStatus}
# h11 has it at the top level but leaves it out of `__all__`.
_CLIENT_DONE = (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL)  # type: ignore[attr-defined]
_Item = tuple[bytes, bytes, bytes]  # raw name, lower-case name, value
# Response header names whose values decide the framing or the connection's end.
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection", b"host"})
_LENGTH_LINE_START = b"\r\ncontent-length: "  # as `response_head` renders it


class _Out(enum.Enum):
    """Where our response to the current request is."""

    IDLE = "idle"  # nothing of a final response sent (a 100 Continue may have been)
    LENGTH = "length"  # body framed by Content-Length: `_remaining` bytes to go
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until_close"  # an HTTP/1.0 client: the body ends when we close
    DONE = "done"
    ERROR = "error"  # a send failed or the handler broke the framing: never reuse


_IDLE = _Out.IDLE
_LENGTH = _Out.LENGTH
_CHUNKED = _Out.CHUNKED
_DONE = _Out.DONE


class ServerSession:
    """One server-side connection's HTTP/1.1 state: h11 parses, we write the responses."""

    __slots__ = (
        "_body_ended",
        "_body_left",
        "_buf",
        "_conn",
        "_eof",
        "_expect_continue",
        "_fast",
        "_fed",
        "_keep_alive",
        "_max_body",
        "_max_head",
        "_memo",
        "_memo_misses",
        "_method",
        "_out",
        "_own_body",
        "_pending_head",
        "_plain",
        "_remaining",
        "_version",
        "body_bytes",
        "cycle_bytes",
        "known",
    )

    def __init__(
        self, *, max_header_bytes: int, max_body_bytes: int, fast_path: bool = True
    ) -> None:
        self._max_head = max_header_bytes
        self._fast = fast_path
        # With the fast path, h11 gets a connection only for a cycle the fast path leaves it.
        self._conn: h11.Connection | None = None if fast_path else self._new_h11()
        self._pending_head = fast_path  # bytes wait in `_buf` for `_fast_head`
        self._memo: HeadMemo | None = None  # the last head with a length
        self._memo_misses = 0  # heads in a row that were not the memo's
        # The memo of the head the fast path took last, when it has one (it came from the
        # memo, or the memo was made of it): its `derived` is the caller's to use.
        self.known: HeadMemo | None = None
        self._max_body = max_body_bytes
        self.body_bytes = 0
        self.cycle_bytes = 0
        self._out = _IDLE
        self._remaining = 0
        self._plain = False  # `response_head` made the last head the plain way (`template_of`)
        # What the request said about the response (None: no valid request line was seen).
        self._method: bytes | None = None
        self._version: bytes | None = None
        self._keep_alive = True
        # A Content-Length body (or none) is read here, not by h11: see `_take_body`.
        self._own_body = False
        self._buf = b""  # bytes after the head, while `_own_body`; the head's, while pending
        self._eof = False
        self._body_left = 0
        self._body_ended = False
        self._expect_continue = False
        self._fed = False  # h11 has been given bytes (or EOF) in this cycle

    # --- the request (h11 for heads and chunked bodies) ----------------------------------

    def receive(self, data: bytes) -> None:
        """Feed bytes read from the socket; b"" means the peer closed its side."""
        self.cycle_bytes += len(data)
        if self._own_body or self._pending_head:
            if not data:
                self._eof = True
            elif self._eof:
                raise MalformedRequest("data after end of stream")
            else:
                self._buf = self._buf + data if self._buf else data
            return
        self._fed = True
        assert self._conn is not None  # only the fast path's cycles go without h11
        try:
            self._conn.receive_data(data)
        except RuntimeError as exc:  # data after EOF: cannot happen with a real socket
            raise MalformedRequest(f"data after end of stream: {exc}") from exc

    def next_event(self) -> RequestHead | bytes | Signal:
        """The next thing the peer said; raises `MalformedRequest` or `BodyTooLarge`."""
        if self._own_body:
            return self._body_event()
        if self._pending_head:
            return self._fast_head()
        return self._h11_event()

    def _h11_event(self) -> RequestHead | bytes | Signal:
        if not self._fed:
            return Signal.NEED_DATA  # what h11 says with nothing to read, for less
        assert self._conn is not None
        try:
            event = self._conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise MalformedRequest(str(exc), exc.error_status_hint) from exc
        kind = type(event)
        if kind is h11.Data:
            data = bytes(event.data)  # type: ignore[union-attr]
            self.body_bytes += len(data)
            if self.body_bytes > self._max_body:
                raise BodyTooLarge(f"request body over {self._max_body} bytes")
            return data
        if kind is h11.EndOfMessage:
            return Signal.BODY_END
        if kind is h11.Request:
            return self._head(event)  # type: ignore[arg-type]
        if event is h11.NEED_DATA:
            return Signal.NEED_DATA
        if event is h11.PAUSED:
            return Signal.PAUSED
        return Signal.CLOSED

    def _fast_head(self) -> RequestHead | bytes | Signal:
        """The head from the fast path, or what h11 makes of the bytes it leaves."""
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if not self._eof and may_complete(buf, self._max_head):
                return Signal.NEED_DATA
            return self._to_h11()
        head = self._parse_head(buf, end)
        if head is None:
            return self._to_h11()
        return self._begin(head, buf)

    def _parse_head(self, buf: bytes, end: int) -> FastHead | None:
        """The fast path's head at the start of `buf` (a whole one: `end` is where its first
        CRLF CRLF is), or None for h11.  A head that is the previous one's but for its
        Content-Length digits is taken from a memo (see `LengthMemo`); a connection whose
        heads keep changing stops keeping memos, which would only cost it."""
        memo = self._memo
        if memo is not None:
            head = parse_known_head(memo, buf, end + 4, self._max_head)
            if head is not None:
                self._memo_misses = 0
                self.known = memo
                return head
            self._memo_misses += 1
            if self._memo_misses >= MEMO_MISSES:
                self._memo = memo = None  # kept no longer: not compared either
        self.known = None
        head = parse_head(buf, end + 4, self._max_head)
        if head is not None and self._memo_misses < MEMO_MISSES:
            known = remember(buf, head)
            if known is not None:
                self._memo = self.known = known
        return head

    def express_head(self, data: bytes) -> RequestHead | None:
        """The head at the start of `data`, when a cycle starts with nothing buffered and the
        fast path takes it whole with an acceptable body size (the express lane,
        `gateway.express`); None changes nothing: `data` is for `receive` as usual."""
        if not self._pending_head or self._buf or self._eof:
            return None
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = self._parse_head(data, end)
        if head is None or (
            head.content_length is not None and int(head.content_length) > self._max_body
        ):
            return None
        self.cycle_bytes += len(data)
        return self._begin(head, data)

    def whole_request(self, data: bytes) -> tuple[RequestHead, bytes] | None:
        """When a cycle starts with nothing buffered and `data`, just read, is exactly one
        whole request whose head is the memo's but for its Content-Length: its head and its
        body, the cycle read to the body's end (as `express_head` then `take_body` leave
        it).  None changes nothing: `data` is for `express_head` as usual.

        A keep-alive client's SDK sends each small request in one write with a head alike
        to its last (see `LengthMemo`): the express lane takes it in one call, without the
        fast path's head or the body's reads (`tests/perf/micro_gateway.py --instructions`:
        4-5 % of the gateway's instructions per exchange).  That is why the state `_begin`
        and `take_body` would leave is set here, not by calling them: a property test
        (`test_a_whole_request_is_taken_as_its_head_and_body_are`) holds every slot of the
        session to theirs.
        """
        memo = self._memo
        if memo is None or not self._pending_head or self._buf or self._eof:
            return None
        length = memo.whole(data)
        if length is None:
            return None
        size = int(length)
        end = len(data) - size
        head = memo.head
        if (
            size > self._max_body
            or end - 2 + len(head.headers) > self._max_head  # as in `parse_known_head`
        ):
            return None
        self._memo_misses = 0
        self.known = memo
        self.cycle_bytes += len(data)
        self.body_bytes = size
        self._method, self._version, self._keep_alive = head.method, b"1.1", head.keep_alive
        self._pending_head = False
        self._own_body = True  # with nothing left of it in `_buf`, empty as it was
        self._body_left = 0
        self._body_ended = True
        self._expect_continue = False
        has_body = length != b"0"  # as `_begin` says it
        request = RequestHead(head.method, head.target, memo.headers_with(length), b"1.1", has_body)
        return request, data[end:]

    def _begin(self, head: FastHead, buf: bytes) -> RequestHead:
        """Start the cycle of a head the fast path took from `buf` (body bytes follow it)."""
        method, length = head.method, head.content_length
        # As on the h11 path: the response is framed for this request even when refused.
        self._method, self._version, self._keep_alive = method, b"1.1", head.keep_alive
        size = int(length) if length is not None else 0
        if size > self._max_body:
            raise BodyTooLarge(f"request body over {self._max_body} bytes")
        self.body_bytes = 0
        self._pending_head = False
        self._own_body = True
        self._buf = buf[head.end :]
        self._body_left = size
        self._body_ended = False
        self._expect_continue = head.expect_continue
        # method, target, headers, http_version, has_body (positional: the faster call)
        has_body = length is not None and length != b"0"
        return RequestHead(method, head.target, head.headers, b"1.1", has_body)

    def _to_h11(self) -> RequestHead | bytes | Signal:
        """Leave this cycle to h11, with every byte buffered so far (and the EOF)."""
        conn = self._conn = self._new_h11()
        data, eof = self._buf, self._eof
        self._buf, self._eof, self._pending_head = b"", False, False
        try:
            if data:
                conn.receive_data(data)
            if eof:
                conn.receive_data(b"")
        except RuntimeError as exc:  # pragma: no cover - `receive` refuses data after EOF
            raise MalformedRequest(f"data after end of stream: {exc}") from exc
        self._fed = bool(data) or eof
        return self._h11_event()

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self._max_head)

    @property
    def fast_head(self) -> bool:
        """The current request's head came through the fast path (h11 never saw it)."""
        return self._conn is None and not self._pending_head

    def _head(self, event: h11.Request) -> RequestHead:
        method = bytes(event.method)
        version = bytes(event.http_version)
        headers = [(name.lower(), value) for name, value in event.headers.raw_items()]
        content_length: bytes | None = None
        chunked = False
        keep_alive = version >= b"1.1"
        expect = False
        # h11 bounds only heads that arrive in pieces; one read can bring a whole large head.
        size = len(method) + len(event.target) + 12
        for name, value in headers:
            size += len(name) + len(value) + 4
            if name == b"content-length":
                content_length = value
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"connection" and keep_alive:
                keep_alive = b"close" not in connection_tokens(((name, value),))
            elif name == b"expect":
                expect = expect or b"100-continue" in comma_tokens(value)
        # As h11 does: the response is framed for this request even when it is refused below.
        self._method, self._version, self._keep_alive = method, version, keep_alive
        if size > self._max_head:
            raise MalformedRequest("request head too large", 431)
        if chunked and content_length is not None:
            # h11 lets Transfer-Encoding win (RFC 9112 6.1 allows that); a proxy must not,
            # because the next hop might believe the Content-Length: request smuggling.
            raise MalformedRequest("both Content-Length and Transfer-Encoding")
        if content_length is not None and int(content_length) > self._max_body:
            raise BodyTooLarge(f"request body over {self._max_body} bytes")
        self.body_bytes = 0
        if not chunked:
            # h11's rule for 100-continue: HTTP/1.1 and the token in an Expect header.
            expect = expect and version >= b"1.1"
            self._take_body(int(content_length) if content_length else 0, expect)
        return RequestHead(
            method=method,
            target=bytes(event.target),
            headers=headers,
            http_version=version,
            has_body=chunked or (content_length is not None and content_length != b"0"),
        )

    def _take_body(self, length: int, expect_continue: bool) -> None:
        """Read a Content-Length body ourselves, from the bytes h11 has not processed.

        h11 has already decided the framing (and we refused Transfer-Encoding with it);
        what is left is counting bytes, which h11's event machinery made expensive.  The
        next cycle starts a new h11 connection anyway (see `start_next_cycle`).
        """
        assert self._conn is not None
        self._buf, self._eof = self._conn.trailing_data
        self._own_body = True
        self._body_left = length
        self._body_ended = False
        self._expect_continue = expect_continue  # the wait ends with any body byte

    def _body_event(self) -> bytes | Signal:
        """The next event of a body read by `_take_body` (as h11 would give it)."""
        left = self._body_left
        if left:
            buf = self._buf
            if not buf:
                if self._eof:
                    raise MalformedRequest(
                        "peer closed connection without sending complete message body"
                    )
                return Signal.NEED_DATA
            if len(buf) <= left:
                self._buf = b""
                data = buf
            else:
                data, self._buf = buf[:left], buf[left:]
            self._body_left = left - len(data)
            self._expect_continue = False
            self.body_bytes += len(data)
            return data
        if not self._body_ended:
            self._body_ended = True
            self._expect_continue = False
            return Signal.BODY_END
        if self._buf:
            return Signal.PAUSED
        return Signal.CLOSED if self._eof else Signal.NEED_DATA

    @property
    def body_buffered(self) -> bool:
        """The whole Content-Length body of the current request is buffered (see `take_body`)."""
        return self._own_body and not self._body_ended and len(self._buf) >= self._body_left

    def take_body(self) -> bytes:
        """The buffered body, read to its end at once (only when `body_buffered`)."""
        left, buf = self._body_left, self._buf
        data, self._buf = (buf, b"") if len(buf) == left else (buf[:left], buf[left:])
        self.body_bytes += left
        self._body_left = 0
        self._body_ended = True
        self._expect_continue = False
        return data

    @property
    def buffered(self) -> bool:
        """Bytes (or the end) of the next request are buffered, after `start_next_cycle` on
        the fast path."""
        return bool(self._buf) or self._eof

    @property
    def waiting_for_continue(self) -> bool:
        """The client sent `Expect: 100-continue` and waits for our go-ahead."""
        if self._out is not _IDLE:
            return False
        if self._own_body:
            return self._expect_continue
        return self._conn is not None and self._conn.they_are_waiting_for_100_continue

    def continue_bytes(self) -> bytes:
        """The `100 Continue` interim response."""
        if self._own_body:
            self._expect_continue = False
            return b"HTTP/1.1 100 Continue\r\n\r\n"  # h11's bytes for it, with its reason
        if self._conn is None:
            raise ResponseStateError("no request is waiting for 100 Continue")
        try:  # a chunked body: through h11, so that it stops waiting too
            out = self._conn.send(
                h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
            )
        except h11.LocalProtocolError as exc:
            raise ResponseStateError(str(exc)) from exc
        return out or b""

    @property
    def request_done(self) -> bool:
        """The client's request (head and body) has been fully received."""
        if self._own_body:
            return self._body_ended
        if self._conn is None:
            return False  # no head yet
        return self._conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)

    # --- the response (ours) ------------------------------------------------------------

    def response_head(
        self, status: int, headers: Headers, reason: bytes = b"", checked: bool = False
    ) -> bytes:
        """Bytes of a response head; raises `ResponseStateError` when out of order or invalid.

        `checked`: the headers came out of an HTTP parser, so they need not be validated
        again (framing headers are still interpreted).
        """
        if self._out is not _IDLE:
            raise self._error(f"cannot start a response in state {self._out.value}")
        self._plain = False
        if not 200 <= status < 1000:
            raise ResponseStateError(f"response status {status} out of range")
        if not checked:
            _validate(headers, reason)
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
        general = not self._keep_alive or self._version is None or self._method == b"CONNECT"
        length: bytes | None = None
        for name, value in headers:
            if name in _FRAMING or (not checked and name.lower() in _FRAMING):
                # Only one plain Content-Length stays on the fast path.
                if name != b"content-length" or length is not None:
                    general = True
                    break
                if not (value.isdigit() and len(value) <= CONTENT_LENGTH_DIGITS):
                    general = True
                    break
                length = value
            lines += (name, b": ", value, b"\r\n")
        if general:
            return self._framed(status, headers, lines[:1])
        # A keep-alive HTTP/1.1 client (HTTP/1.0 ones never keep alive) and no header that
        # h11 would rewrite.  It frames a HEAD answer as a GET one, without the body.
        if status in _EMPTY_BODY_STATUS:
            self._out, self._remaining = _LENGTH, 0
        elif length is not None:
            self._out = _LENGTH
            if self._method == b"HEAD":
                self._remaining = 0
            else:
                self._remaining = int(length)
                self._plain = True  # what `known_head` makes again
        else:
            lines.append(b"Transfer-Encoding: chunked\r\n")
            if self._method == b"HEAD":
                self._out, self._remaining = _LENGTH, 0
            else:
                self._out = _CHUNKED
        lines.append(b"\r\n")
        return b"".join(lines)

    # A head that `response_head` made the plain way (one plain Content-Length, a keep-alive
    # HTTP/1.1 request, neither HEAD nor CONNECT), split around the digits of its length and
    # without what the caller put last (`tail`, whole header lines) and the final CRLF: it can
    # be made again with other digits and another tail by joining bytes.  The express lane
    # keeps one with each memo of an engine's answer head (`LengthMemo.derived`), so that an
    # answer alike but for its length is relayed without building its head again.

    def template_of(self, head: bytes, digits: bytes, tail: bytes) -> tuple[bytes, bytes] | None:
        """(before the digits, after them up to `tail`) of `head`, which `response_head` just
        made with `digits` as its Content-Length and `tail` as its last header lines; None
        when it did not make it the plain way (then it cannot be made again by joining)."""
        if not self._plain or not head.endswith(b"%s\r\n" % tail):
            return None
        # Values hold no CR or LF, and the plain way renders one Content-Length: this line
        # is the only place where these bytes can be.
        at = head.find(b"%s%s\r\n" % (_LENGTH_LINE_START, digits))
        if at < 0:
            return None  # a name not lower-case: no template
        start = at + len(_LENGTH_LINE_START)
        return head[:start], head[start + len(digits) : len(head) - len(tail) - 2]

    def known_head(
        self, template: tuple[bytes, bytes], digits: bytes, tail: bytes, body: bytes | None = None
    ) -> bytes | None:
        """The head `template` stands for (see `template_of`) with `digits` (a plain length)
        as its Content-Length and `tail` last, framed as `response_head` would; None when
        this response would not take the plain way (then `response_head`).  With `body` (of
        that length): the whole response, as the head, `body` and `end` would make it."""
        method = self._method
        if (
            self._out is not _IDLE
            or not self._keep_alive
            or self._version is None
            or method == b"HEAD"
            or method == b"CONNECT"
        ):
            return None
        if body is None:
            self._out, self._remaining = _LENGTH, int(digits)
            body = b""
        else:
            self._out = _DONE  # as `end` leaves it
        before, after = template
        return b"".join((before, digits, after, tail, b"\r\n", body))

    def _framed(self, status: int, headers: Headers, lines: list[bytes]) -> bytes:
        """The general case: h11's `_clean_up_response_headers_for_sending`, to the byte."""
        items: list[_Item] = []
        length: bytes | None = None
        chunked = False
        for raw, value in headers:
            name = raw.lower()
            if name == b"content-length":
                values = {v.strip() for v in value.split(b",")}
                if len(values) != 1:
                    raise ResponseStateError("conflicting Content-Length headers")
                value = values.pop()
                if CONTENT_LENGTH.fullmatch(value) is None:
                    raise ResponseStateError("bad Content-Length")
                if length is not None:
                    if length != value:
                        raise ResponseStateError("conflicting Content-Length headers")
                    continue  # h11 keeps only the first of equal ones
                length = value
            elif name == b"transfer-encoding":
                value = value.lower()
                if chunked or value != b"chunked":
                    raise ResponseStateError("only Transfer-Encoding: chunked is supported")
                chunked = True
            items.append((raw, name, value))
        method = self._method
        need_close = False
        # A response to CONNECT that would switch protocols: we never tunnel, so it just ends.
        switch = method == b"CONNECT" and 200 <= status < 300
        empty = status in _EMPTY_BODY_STATUS or switch
        unknown_length = not empty and (chunked or length is None)
        if unknown_length:
            items = _without(items, b"content-length")
            if self._version is None or self._version < b"1.1":
                # No valid request, or an HTTP/1.0 client: no chunked, the close ends the body.
                items = _without(items, b"transfer-encoding")
                need_close = method != b"HEAD"
                framing = _Out.UNTIL_CLOSE
            else:
                items = [*_without(items, b"transfer-encoding"),
                         (b"Transfer-Encoding", b"transfer-encoding", b"chunked")]  # fmt: skip
                framing = _CHUNKED
        else:
            framing = _LENGTH
        if not self._keep_alive or need_close:
            tokens = connection_tokens((n, v) for _, n, v in items)
            tokens.discard(b"keep-alive")
            tokens.add(b"close")
            items = _without(items, b"connection")
            items += [(b"Connection", b"connection", t) for t in sorted(tokens)]
        keep_alive = (
            self._keep_alive
            and not switch
            and b"close" not in connection_tokens((n, v) for _, n, v in items)
        )
        if empty or method == b"HEAD":
            framing, self._remaining = _LENGTH, 0
        elif framing is _LENGTH:
            assert length is not None
            self._remaining = int(length)
        self._out, self._keep_alive = framing, keep_alive
        for raw, name, value in items:  # Host first, as h11 writes it
            if name == b"host":
                lines += (raw, b": ", value, b"\r\n")
        for raw, name, value in items:
            if name != b"host":
                lines += (raw, b": ", value, b"\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    @property
    def chunked_body(self) -> bool:
        """The response under way is framed in chunks (`body` writes each as one chunk)."""
        return self._out is _CHUNKED

    def body(self, data: bytes) -> bytes:
        """Bytes that carry `data` in the response body (framed as the head decided)."""
        out = self._out
        if out is _LENGTH:
            if len(data) > self._remaining:
                if self._method == b"HEAD":
                    return b""  # RFC 9110 9.3.2: the GET answer's head, without its body
                raise self._error("Too much data for declared Content-Length")
            self._remaining -= len(data)
            return data
        if out is _CHUNKED:
            return b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        if out is _Out.UNTIL_CLOSE:
            return data
        raise self._error(f"cannot send body data in state {out.value}")

    def end(self) -> bytes:
        """Bytes that end the response body."""
        out = self._out
        if out is _LENGTH:
            if self._remaining:
                raise self._error("Too little data for declared Content-Length")
            self._out = _DONE
            return b""
        if out is _CHUNKED:
            self._out = _DONE
            return b"0\r\n\r\n"
        if out is _Out.UNTIL_CLOSE:
            self._out, self._keep_alive = _DONE, False
            return b""
        raise self._error(f"cannot end the response in state {out.value}")

    def _error(self, reason: str) -> ResponseStateError:
        """A misuse while sending: like h11, the connection can no longer be used."""
        self._out, self._keep_alive = _Out.ERROR, False
        return ResponseStateError(reason)

    @property
    def can_send_error(self) -> bool:
        """Whether an error reply can still be sent (nothing of a response went out yet)."""
        return self._out is _IDLE

    def error_reply(self, status: int, headers: Headers, body: bytes) -> bytes:
        """A complete error response that also closes the connection."""
        head = [*headers, (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        reason = REASON_PHRASES.get(status, b"")
        return self.response_head(status, head, reason) + self.body(body) + self.end()

    def send_failed(self) -> None:
        """Bytes we produced never reached the peer: the connection must not be reused."""
        self._out, self._keep_alive = _Out.ERROR, False

    @property
    def reusable(self) -> bool:
        """Both sides finished a clean cycle and nobody asked to close."""
        if self._out is not _DONE or not self._keep_alive:
            return False
        if self._own_body:
            return self._body_ended
        if self._conn is None:
            return False  # no head yet
        # A client that proposed an Upgrade (or CONNECT) got a plain answer: that denies it.
        return self._conn.their_state in _CLIENT_DONE

    def start_next_cycle(self) -> None:
        """Reset for the next request on this connection (only when `reusable`).

        The bytes not processed yet go to the fast path, or to a new h11 connection: h11
        itself can start a new cycle only after it has sent the response.
        """
        if not self.reusable:
            raise ResponseStateError("connection is not reusable")
        if self._own_body:
            data, closed = self._buf, self._eof
            self._own_body, self._buf, self._eof = False, b"", False
        else:
            assert self._conn is not None
            data, closed = self._conn.trailing_data
        if self._fast:
            self._conn = None
            self._pending_head, self._buf, self._eof = True, data, closed
        else:
            conn = self._new_h11()
            if data:
                conn.receive_data(data)
            if closed:
                conn.receive_data(b"")
            self._conn = conn
            self._fed = bool(data) or closed
        self._out = _IDLE
        self._method = self._version = None
        self._keep_alive = True
        self.cycle_bytes = 0
        self.body_bytes = 0


def _without(items: list[_Item], name: bytes) -> list[_Item]:
    return [item for item in items if item[1] != name]


def _validate(headers: Headers, reason: bytes) -> None:
    """What h11 checks in headers it did not parse itself."""
    for name, value in headers:
        if TOKEN.fullmatch(name) is None:
            raise ResponseStateError(f"Illegal header name {name!r}")
        if FIELD_VALUE.fullmatch(value) is None:
            raise ResponseStateError(f"Illegal header value {value!r}")
    if REASON.fullmatch(reason) is None:
        raise ResponseStateError(f"Illegal reason phrase {reason!r}")
