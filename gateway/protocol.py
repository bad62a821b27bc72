"""Pure HTTP/1.1 protocol state for both ends of the gateway: bytes in, events and bytes out.

Nothing here touches a socket or awaits; `server.py` and `upstream.py` do the I/O and ask
these classes what the bytes mean and what to write.  h11 exceptions end here and come out
as the errors of `gateway.errors`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import h11

from gateway.errors import (
    BodyTooLarge,
    MalformedRequest,
    ResponseStateError,
    UpstreamClosed,
    UpstreamProtocolError,
)

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


class Signal(enum.Enum):
    """Non-data outcomes of `next_event`."""

    NEED_DATA = "need_data"  # read more bytes from the socket
    PAUSED = "paused"  # the peer finished its part; nothing to do until the next cycle
    BODY_END = "body_end"  # the message body is complete
    CLOSED = "closed"  # the peer closed cleanly between messages


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A parsed request line and headers (names lower-cased, as h11 gives them)."""

    method: bytes
    target: bytes
    headers: Headers
    http_version: bytes
    has_body: bool


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """A parsed response status line and headers (names lower-cased)."""

    status: int
    reason: bytes
    headers: Headers
    http_version: bytes


def strip_hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The headers minus hop-by-hop ones, including those the Connection header names."""
    items = list(headers)
    extra: set[bytes] = set()
    for name, value in items:
        if name == b"connection":
            extra.update(token.strip().lower() for token in value.split(b","))
    return [(n, v) for n, v in items if n not in HOP_BY_HOP and n not in extra]


class _RawHeaders(Protocol):
    def raw_items(self) -> list[tuple[bytes, bytes]]: ...


def _lowered(headers: _RawHeaders) -> Headers:
    """h11's headers as (lower-case name, value) pairs (faster than iterating the Sequence)."""
    return [(name.lower(), value) for name, value in headers.raw_items()]


def header_value(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lower-case), or None."""
    for n, v in headers:
        if n == name:
            return v
    return None


class ServerSession:
    """One server-side connection's HTTP/1.1 state (h11 underneath), with our extra rules."""

    __slots__ = ("_conn", "_max_body", "_max_head", "body_bytes", "cycle_bytes")

    def __init__(self, *, max_header_bytes: int, max_body_bytes: int) -> None:
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self._max_head = max_header_bytes
        self._max_body = max_body_bytes
        self.body_bytes = 0
        self.cycle_bytes = 0

    def receive(self, data: bytes) -> None:
        """Feed bytes read from the socket; b"" means the peer closed its side."""
        self.cycle_bytes += len(data)
        try:
            self._conn.receive_data(data)
        except RuntimeError as exc:  # data after EOF: cannot happen with a real socket
            raise MalformedRequest(f"data after end of stream: {exc}") from exc

    def next_event(self) -> RequestHead | bytes | Signal:
        """The next thing the peer said; raises `MalformedRequest` or `BodyTooLarge`."""
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
        if kind is h11.Request:
            return self._head(event)  # type: ignore[arg-type]
        if kind is h11.EndOfMessage:
            return Signal.BODY_END
        if event is h11.NEED_DATA:
            return Signal.NEED_DATA
        if event is h11.PAUSED:
            return Signal.PAUSED
        return Signal.CLOSED

    def _head(self, event: h11.Request) -> RequestHead:
        headers = _lowered(event.headers)
        content_length: bytes | None = None
        chunked = False
        # h11 bounds only heads that arrive in pieces; one read can bring a whole large head.
        size = len(event.method) + len(event.target) + 12
        for name, value in headers:
            size += len(name) + len(value) + 4
            if name == b"content-length":
                content_length = value
            elif name == b"transfer-encoding":
                chunked = True
        if size > self._max_head:
            raise MalformedRequest("request head too large", 431)
        if chunked and content_length is not None:
            # h11 lets Transfer-Encoding win (RFC 9112 6.1 allows that); a proxy must not,
            # because the next hop might believe the Content-Length: request smuggling.
            raise MalformedRequest("both Content-Length and Transfer-Encoding")
        if content_length is not None and int(content_length) > self._max_body:
            raise BodyTooLarge(f"request body over {self._max_body} bytes")
        self.body_bytes = 0
        return RequestHead(
            method=bytes(event.method),
            target=bytes(event.target),
            headers=headers,
            http_version=bytes(event.http_version),
            has_body=chunked or (content_length is not None and content_length != b"0"),
        )

    @property
    def waiting_for_continue(self) -> bool:
        """The client sent `Expect: 100-continue` and waits for our go-ahead."""
        return self._conn.they_are_waiting_for_100_continue

    def continue_bytes(self) -> bytes:
        """The `100 Continue` interim response."""
        return self._send(h11.InformationalResponse(status_code=100, headers=[]))

    def response_head(
        self, status: int, headers: Headers, reason: bytes = b"", checked: bool = False
    ) -> bytes:
        """Bytes of a response head; raises `ResponseStateError` when out of order or invalid.

        `checked`: the headers came out of an h11 parser, so h11 need not validate them again
        (framing headers are still interpreted).
        """
        try:
            event = h11.Response(
                status_code=status, headers=headers, reason=reason, _parsed=checked
            )
        except h11.LocalProtocolError as exc:
            raise ResponseStateError(str(exc)) from exc
        return self._send(event)

    def body(self, data: bytes) -> bytes:
        """Bytes that carry `data` in the response body (framed as the head decided)."""
        return self._send(h11.Data(data=data))

    def end(self) -> bytes:
        """Bytes that end the response body."""
        return self._send(h11.EndOfMessage())

    def _send(self, event: h11.Event) -> bytes:
        try:
            out = self._conn.send(event)
        except h11.LocalProtocolError as exc:
            raise ResponseStateError(str(exc)) from exc
        return out or b""

    @property
    def can_send_error(self) -> bool:
        """Whether an error reply can still be sent (nothing of a response went out yet)."""
        return self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    def error_reply(self, status: int, headers: Headers, body: bytes) -> bytes:
        """A complete error response that also closes the connection."""
        head = [*headers, (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        return self.response_head(status, head) + self.body(body) + self.end()

    def send_failed(self) -> None:
        """Bytes we produced never reached the peer: the connection must not be reused."""
        self._conn.send_failed()

    @property
    def request_done(self) -> bool:
        """The client's request (head and body) has been fully received."""
        return self._conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)

    @property
    def reusable(self) -> bool:
        """Both sides finished a clean cycle and nobody asked to close."""
        return self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE

    def start_next_cycle(self) -> None:
        """Reset for the next request on this connection (only when `reusable`)."""
        self._conn.start_next_cycle()
        self.cycle_bytes = 0
        self.body_bytes = 0


class ClientSession:
    """One upstream connection's HTTP/1.1 state as a client (h11 underneath)."""

    __slots__ = ("_conn", "eof", "received_any")

    def __init__(self, *, max_header_bytes: int) -> None:
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_header_bytes)
        self.received_any = False
        self.eof = False

    def request(
        self, method: bytes, target: bytes, headers: Headers, body: bytes, checked: bool = False
    ) -> bytes:
        """Bytes of a complete request with a Content-Length body (`checked`: see above)."""
        try:
            event = h11.Request(method=method, target=target, headers=headers, _parsed=checked)
            out = self._conn.send(event)
            if body:
                out += self._conn.send(h11.Data(data=body))
            return out + self._conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            raise UpstreamProtocolError(f"cannot send request: {exc}") from exc

    def receive(self, data: bytes) -> None:
        """Feed bytes read from the engine; b"" means it closed its side."""
        if data:
            self.received_any = True
        else:
            self.eof = True
        try:
            self._conn.receive_data(data)
        except RuntimeError as exc:
            raise UpstreamProtocolError(f"data after end of stream: {exc}") from exc

    def next_event(self) -> ResponseHead | bytes | Signal:
        """The next thing the engine said (interim 1xx responses are skipped)."""
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                if self.eof:
                    raise UpstreamClosed(
                        f"engine closed the connection: {exc}",
                        before_response=not self.received_any,
                    ) from exc
                raise UpstreamProtocolError(f"invalid answer from engine: {exc}") from exc
            kind = type(event)
            if kind is h11.Data:
                return bytes(event.data)  # type: ignore[union-attr]
            if kind is h11.Response:
                return ResponseHead(
                    status=event.status_code,  # type: ignore[union-attr]
                    reason=bytes(event.reason),  # type: ignore[union-attr]
                    headers=_lowered(event.headers),  # type: ignore[union-attr]
                    http_version=bytes(event.http_version),  # type: ignore[union-attr]
                )
            if kind is h11.InformationalResponse:
                continue
            if kind is h11.EndOfMessage:
                return Signal.BODY_END
            if event is h11.NEED_DATA:
                return Signal.NEED_DATA
            if event is h11.PAUSED:
                return Signal.PAUSED
            if kind is h11.ConnectionClosed:
                raise UpstreamClosed(
                    "engine closed the connection", before_response=not self.received_any
                )
            raise UpstreamProtocolError(f"unexpected event {event!r}")

    def send_failed(self) -> None:
        """The request bytes never reached the engine: never reuse this connection."""
        self._conn.send_failed()

    @property
    def reusable(self) -> bool:
        """Both sides are DONE and neither asked to close."""
        return self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE

    @property
    def clean(self) -> bool:
        """Nothing was received beyond the answer (bytes between answers mean: never reuse)."""
        return not self._conn.trailing_data[0]

    def start_next_cycle(self) -> None:
        """Reset for the next request (only when `reusable`)."""
        self._conn.start_next_cycle()
        self.received_any = False
