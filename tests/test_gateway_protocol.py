"""The pure protocol layer: bytes in, events and exact bytes out, no sockets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import (
    BodyTooLarge,
    MalformedRequest,
    ResponseStateError,
    UpstreamClosed,
    UpstreamProtocolError,
)
from gateway.protocol import (
    ClientSession,
    RequestHead,
    ServerSession,
    Signal,
    strip_hop_by_hop,
)


def session(max_body: int = 100, max_head: int = 1024) -> ServerSession:
    """A fresh server session."""
    return ServerSession(max_header_bytes=max_head, max_body_bytes=max_body)


def events(s: ServerSession) -> list[object]:
    """Every event available without more bytes."""
    out: list[object] = []
    while True:
        event = s.next_event()
        out.append(event)
        if event in (Signal.NEED_DATA, Signal.PAUSED, Signal.CLOSED):
            return out


def test_request_head_body_and_end_come_out_in_order() -> None:
    s = session()
    s.receive(b"POST /x?q=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc")
    head, body, end, _ = events(s)
    assert head == RequestHead(
        method=b"POST",
        target=b"/x?q=1",
        headers=[(b"host", b"a"), (b"content-length", b"3")],
        http_version=b"1.1",
        has_body=True,
    )
    assert (body, end) == (b"abc", Signal.BODY_END)
    assert s.request_done


def test_response_bytes_are_exact_and_the_cycle_restarts() -> None:
    s = session()
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    events(s)
    out = s.response_head(200, [(b"content-length", b"2")]) + s.body(b"hi") + s.end()
    assert out == b"HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\nhi"
    assert s.reusable
    s.start_next_cycle()
    s.receive(b"GET /2 HTTP/1.1\r\nhost: a\r\n\r\n")
    assert isinstance(s.next_event(), RequestHead)


def test_chunked_framing_is_used_without_a_length() -> None:
    s = session()
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    events(s)
    out = s.response_head(200, []) + s.body(b"data") + s.end()
    assert out == b"HTTP/1.1 200 \r\nTransfer-Encoding: chunked\r\n\r\n4\r\ndata\r\n0\r\n\r\n"


def test_content_length_with_transfer_encoding_is_refused() -> None:
    s = session()
    s.receive(
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    with pytest.raises(MalformedRequest) as info:
        s.next_event()
    assert info.value.status == 400


def test_a_complete_but_oversized_head_is_431() -> None:
    s = session(max_head=200)
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\nx: " + b"y" * 300 + b"\r\n\r\n")
    with pytest.raises(MalformedRequest) as info:
        s.next_event()
    assert info.value.status == 431


def test_an_incomplete_oversized_head_is_431() -> None:
    s = session(max_head=200)
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\nx: " + b"y" * 300)
    with pytest.raises(MalformedRequest) as info:
        s.next_event()
    assert info.value.status == 431


def test_declared_length_over_the_cap_is_refused_before_the_body() -> None:
    s = session(max_body=10)
    s.receive(b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 11\r\n\r\n")
    with pytest.raises(BodyTooLarge):
        s.next_event()


def test_chunked_body_is_counted_while_it_streams() -> None:
    s = session(max_body=10)
    s.receive(b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n")
    assert isinstance(s.next_event(), RequestHead)
    s.receive(b"6\r\nabcdef\r\n")
    assert s.next_event() == b"abcdef"
    s.receive(b"6\r\nghijkl\r\n")
    with pytest.raises(BodyTooLarge):
        s.next_event()


def test_error_reply_closes_and_is_allowed_only_before_the_response() -> None:
    s = session()
    s.receive(b"BROKEN\r\n\r\n")
    with pytest.raises(MalformedRequest):
        s.next_event()
    assert s.can_send_error
    out = s.error_reply(400, [(b"content-type", b"text/plain")], b"bad")
    assert out == (
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 3\r\n"
        b"connection: close\r\n\r\nbad"
    )
    assert not s.can_send_error and not s.reusable


def test_responding_twice_is_a_response_state_error() -> None:
    s = session()
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    events(s)
    s.response_head(200, [(b"content-length", b"0")])
    with pytest.raises(ResponseStateError):
        s.response_head(200, [])


def test_invalid_header_from_a_handler_is_a_response_state_error() -> None:
    s = session()
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    events(s)
    with pytest.raises(ResponseStateError):
        s.response_head(200, [(b"bad header", b"x")])


def test_failed_send_forbids_reuse() -> None:
    s = session()
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    events(s)
    s.response_head(200, [(b"content-length", b"0")])
    s.end()
    s.send_failed()
    assert not s.reusable


def test_client_connection_close_means_no_reuse() -> None:
    s = session()
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
    events(s)
    s.response_head(200, [(b"content-length", b"0")])
    s.end()
    assert s.request_done and not s.reusable


def test_client_session_request_bytes_and_response_events() -> None:
    c = ClientSession(max_header_bytes=1024)
    out = c.request(b"POST", b"/v1/x", [(b"host", b"e:1"), (b"content-length", b"2")], b"hi")
    assert out == b"POST /v1/x HTTP/1.1\r\nhost: e:1\r\ncontent-length: 2\r\n\r\nhi"
    c.receive(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    head = c.next_event()
    assert not isinstance(head, bytes | Signal) and head.status == 200
    assert c.next_event() == b"ok"
    assert c.next_event() is Signal.BODY_END
    assert c.reusable and c.clean


def test_client_session_eof_before_any_answer_is_closed_before_response() -> None:
    c = ClientSession(max_header_bytes=1024)
    c.request(b"GET", b"/", [(b"host", b"e")], b"")
    c.receive(b"")
    with pytest.raises(UpstreamClosed) as info:
        c.next_event()
    assert info.value.before_response


def test_client_session_eof_mid_answer_is_closed_after_response_began() -> None:
    c = ClientSession(max_header_bytes=1024)
    c.request(b"GET", b"/", [(b"host", b"e")], b"")
    c.receive(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab")
    c.next_event()
    c.next_event()
    c.receive(b"")
    with pytest.raises(UpstreamClosed) as info:
        c.next_event()
    assert not info.value.before_response


def test_client_session_garbage_is_a_protocol_error() -> None:
    c = ClientSession(max_header_bytes=1024)
    c.request(b"GET", b"/", [(b"host", b"e")], b"")
    c.receive(b"SPDY/3 200\r\n\r\n")
    with pytest.raises(UpstreamProtocolError):
        c.next_event()


def test_hop_by_hop_headers_and_those_named_by_connection_are_stripped() -> None:
    headers = [
        (b"connection", b"keep-alive, X-Trace"),
        (b"keep-alive", b"timeout=5"),
        (b"transfer-encoding", b"chunked"),
        (b"x-trace", b"1"),
        (b"te", b"trailers"),
        (b"upgrade", b"h2c"),
        (b"proxy-authorization", b"x"),
        (b"content-type", b"application/json"),
        (b"x-request-id", b"7"),
    ]
    assert strip_hop_by_hop(headers) == [
        (b"content-type", b"application/json"),
        (b"x-request-id", b"7"),
    ]


# --- answer heads made again from a template (the express lane's relayed heads) ----------------

_CYCLES = [  # a request, as the server session read it (the template's use depends on it)
    b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 0\r\n\r\n",
    b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n",
    b"HEAD /x HTTP/1.1\r\nhost: a\r\n\r\n",
    b"GET /x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n",
    b"GET /x HTTP/1.0\r\nhost: a\r\n\r\n",
    b"GET /x HTTP/1.0\r\nhost: a\r\nconnection: keep-alive\r\n\r\n",
]
_OTHERS = [  # headers of the engine's answer besides its length
    [],
    [(b"content-type", b"application/json"), (b"server", b"uvicorn")],
    [(b"date", b"Tue, 01 Dec 2026 18:00:00 GMT"), (b"x-a", b"content-length: 3")],
    [(b"connection", b"keep-alive")],  # h11's way, not the plain one
    [(b"host", b"e")],
    [(b"transfer-encoding", b"chunked")],
]


def at_response(request: bytes) -> ServerSession:
    """A server session that read `request` and may answer it."""
    s = session()
    s.receive(request)
    events(s)
    return s


def made(s: ServerSession, status: int, headers: list[tuple[bytes, bytes]]) -> object:
    """The response head `s` makes, and what it then makes of a body as long as it says;
    or the error's name."""
    try:
        head = s.response_head(status, headers, b"OK", True)
        length = next((int(v) for n, v in headers if n == b"content-length"), 2)
        return head, s.body(b"x" * length), s.end(), s.reusable
    except ResponseStateError as exc:
        return type(exc).__name__


@settings(max_examples=400, deadline=None)
@given(
    first=st.sampled_from(_CYCLES),
    then=st.sampled_from(_CYCLES),
    others=st.sampled_from(_OTHERS),
    where=st.integers(0, 2),
    name=st.sampled_from([b"content-length", b"content-length", b"Content-Length"]),
    status=st.sampled_from([200, 200, 404, 204]),
    lengths=st.tuples(*[st.sampled_from([b"0", b"2", b"12", b"007"])] * 2),
    ids=st.tuples(*[st.sampled_from([None, 7, 1234])] * 2),
)
def test_a_template_makes_again_what_response_head_makes(
    first: bytes,
    then: bytes,
    others: list[tuple[bytes, bytes]],
    where: int,
    name: bytes,
    status: int,
    lengths: tuple[bytes, bytes],
    ids: tuple[int | None, int | None],
) -> None:
    """A head made by joining a template of an answer alike (another length, another request
    id last) is the one `response_head` makes, and frames the body the same way; when it
    cannot be made so, the session is left as it was."""

    def answer(digits: bytes, request_id: int | None) -> tuple[list[tuple[bytes, bytes]], bytes]:
        headers = [*others[:where], (name, digits), *others[where:]]
        if request_id is None:
            return headers, b""
        return [*headers, (b"x-id", b"%d" % request_id)], b"x-id: %d\r\n" % request_id

    s = at_response(first)
    headers, tail = answer(lengths[0], ids[0])
    try:
        head = s.response_head(status, headers, b"OK", True)
    except ResponseStateError:
        return
    template = s.template_of(head, lengths[0], tail)
    if template is None:
        return
    # Only the plain way makes templates.
    assert first in _CYCLES[:2] and status != 204 and name == b"content-length"
    assert not {n for n, _ in others} & {b"connection", b"host", b"transfer-encoding"}
    headers, tail = answer(lengths[1], ids[1])
    s = at_response(then)
    again = s.known_head(template, lengths[1], tail)
    expected = made(at_response(then), status, headers)
    if again is None:
        assert then not in _CYCLES[:2]
        assert made(s, status, headers) == expected  # left as it was: the usual way
        return
    length = int(lengths[1])
    assert (again, s.body(b"x" * length), s.end(), s.reusable) == expected
    # With the body: the whole answer, in one piece, and the session where `end` leaves it.
    s = at_response(then)
    whole = s.known_head(template, lengths[1], tail, b"x" * length)
    assert (whole, s.reusable) == (b"".join(expected[:3]), expected[3])  # type: ignore[index]


def test_the_plain_way_makes_a_template() -> None:
    s = at_response(_CYCLES[0])
    headers = [(b"server", b"uvicorn"), (b"content-length", b"12"), (b"x-id", b"1")]
    head = s.response_head(200, headers, b"OK", True)
    assert s.template_of(head, b"12", b"x-id: 1\r\n") == (
        b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-length: ",
        b"\r\n",
    )
