"""The server side writes its responses itself; byte for byte what h11 would have written."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import ResponseStateError
from gateway.protocol import ServerSession, Signal

Headers = list[tuple[bytes, bytes]]


def session_after(raw: bytes) -> ServerSession:
    """A server session that has read one whole request."""
    s = ServerSession(max_header_bytes=4096, max_body_bytes=1 << 20)
    s.receive(raw)
    while s.next_event() not in (Signal.NEED_DATA, Signal.PAUSED, Signal.CLOSED):
        pass
    return s


def h11_after(raw: bytes) -> h11.Connection:
    """The same, with h11 alone."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    while conn.next_event() not in (h11.NEED_DATA, h11.PAUSED):
        pass
    return conn


def test_a_head_answer_is_framed_as_for_get_but_carries_no_body() -> None:
    s = session_after(b"HEAD / HTTP/1.1\r\nhost: a\r\n\r\n")
    assert s.response_head(200, [(b"x", b"1")]) == (
        b"HTTP/1.1 200 \r\nx: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    with pytest.raises(ResponseStateError):
        s.body(b"no")
    assert not s.can_send_error and not s.reusable


def test_an_http_1_0_client_gets_a_body_ended_by_the_close() -> None:
    s = session_after(b"GET / HTTP/1.0\r\n\r\n")
    head = s.response_head(200, [(b"content-type", b"text/plain")])
    assert head == b"HTTP/1.1 200 \r\ncontent-type: text/plain\r\nConnection: close\r\n\r\n"
    assert s.body(b"abc") == b"abc"
    assert s.end() == b""
    assert not s.reusable


def test_a_client_asking_to_close_gets_connection_close() -> None:
    s = session_after(b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
    head = s.response_head(200, [(b"connection", b"keep-alive"), (b"content-length", b"0")])
    assert head == b"HTTP/1.1 200 \r\ncontent-length: 0\r\nConnection: close\r\n\r\n"


def test_a_handler_asking_to_close_ends_the_connection() -> None:
    s = session_after(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    s.response_head(200, [(b"content-length", b"0"), (b"connection", b"close")])
    s.end()
    assert not s.reusable


def test_too_little_body_for_the_length_is_a_state_error_and_forbids_reuse() -> None:
    s = session_after(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    s.response_head(200, [(b"content-length", b"5")])
    s.body(b"abc")
    with pytest.raises(ResponseStateError):
        s.end()
    assert not s.reusable


def test_invalid_headers_leave_the_error_reply_possible() -> None:
    s = session_after(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    for bad in ([(b"x", b"a\r\nb")], [(b"content-length", b"1, 2")], [(b"te", b" x")]):
        with pytest.raises(ResponseStateError):
            s.response_head(200, bad)
    with pytest.raises(ResponseStateError):
        s.response_head(99, [])
    assert s.can_send_error


def test_the_next_cycle_starts_with_pipelined_bytes() -> None:
    s = ServerSession(max_header_bytes=4096, max_body_bytes=100)
    s.receive(b"GET /1 HTTP/1.1\r\nhost: a\r\n\r\nGET /2 HTTP/1.1\r\nhost: a\r\n\r\n")
    assert s.next_event() is not Signal.NEED_DATA
    assert s.next_event() is Signal.BODY_END
    assert s.next_event() is Signal.PAUSED
    s.response_head(204, [])
    s.end()
    s.start_next_cycle()
    head = s.next_event()
    assert not isinstance(head, bytes | Signal) and head.target == b"/2"


def test_a_denied_upgrade_keeps_the_connection() -> None:
    s = session_after(b"GET / HTTP/1.1\r\nhost: a\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n")
    s.response_head(404, [(b"content-length", b"0")])
    s.end()
    assert s.reusable
    s.start_next_cycle()


def test_starting_a_cycle_that_is_not_done_is_refused() -> None:
    s = session_after(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    with pytest.raises(ResponseStateError):
        s.start_next_cycle()


# --- against h11 -------------------------------------------------------------------------

_names = st.sampled_from([b"x-a", b"Content-Type", b"server", b"X-Request-Id", b"Host", b"host"])
_framing = st.sampled_from(
    [
        (b"content-length", b"{n}"),
        (b"Content-Length", b"{n}"),
        (b"content-length", b" {n} , {n}"),
        (b"transfer-encoding", b"chunked"),
        (b"Transfer-Encoding", b"Chunked"),
        (b"connection", b"close"),
        (b"Connection", b"keep-alive, X-Trace"),
        (b"connection", b"upgrade"),
    ]
)


@st.composite
def exchanges(draw: st.DrawFn) -> tuple[bytes, int, Headers, list[bytes]]:
    """A request, and a response to it: status, headers, body pieces."""
    method = draw(st.sampled_from([b"GET", b"POST", b"HEAD"]))
    version = draw(st.sampled_from([b"1.1", b"1.1", b"1.0"]))
    request = b"%s / HTTP/%s\r\n" % (method, version)
    request += draw(st.sampled_from([b"host: a\r\n", b""])) if version == b"1.0" else b"host: a\r\n"
    request += draw(
        st.sampled_from(
            [
                b"",
                b"connection: close\r\n",
                b"Connection: keep-alive\r\n",
                b"connection: x, Close\r\n",
            ]
        )
    )
    request += b"content-length: 2\r\n\r\nhi" if method == b"POST" else b"\r\n"
    pieces = draw(st.lists(st.binary(max_size=20), max_size=3))
    size = sum(len(p) for p in pieces) + draw(st.sampled_from([0, 0, 0, 1]))
    headers: Headers = [
        (name, value.replace(b"{n}", b"%d" % size))
        for name, value in draw(
            st.lists(st.one_of(st.tuples(_names, st.just(b"v")), _framing), max_size=4)
        )
    ]
    status = draw(st.sampled_from([200, 201, 204, 304, 404, 500]))
    return request, status, headers, pieces


def _run_ours(raw: bytes, status: int, headers: Headers, pieces: list[bytes]) -> list[object]:
    s = session_after(raw)
    out: list[object] = []
    try:
        out.append(s.response_head(status, headers))
        for piece in pieces:
            out.append(s.body(piece))
        out.append(s.end())
    except ResponseStateError:
        out.append("error")
    out.append((s.reusable, s.can_send_error))
    return out


def _run_h11(raw: bytes, status: int, headers: Headers, pieces: list[bytes]) -> list[object]:
    conn = h11_after(raw)
    out: list[object] = []
    try:
        try:
            response = h11.Response(status_code=status, headers=headers)
        except h11.LocalProtocolError:
            out.append("error")
            raise
        out.append(conn.send(response) or b"")
        for piece in pieces:
            out.append(conn.send(h11.Data(data=piece)) or b"")
        out.append(conn.send(h11.EndOfMessage()) or b"")
    except h11.LocalProtocolError:
        if out[-1:] != ["error"]:
            out.append("error")
    reusable = conn.our_state is h11.DONE and conn.their_state is h11.DONE
    out.append((reusable, conn.our_state in (h11.IDLE, h11.SEND_RESPONSE)))
    return out


@settings(max_examples=600, deadline=None)
@given(exchange=exchanges())
def test_responses_are_written_as_h11_writes_them(
    exchange: tuple[bytes, int, Headers, list[bytes]],
) -> None:
    raw, status, headers, pieces = exchange
    assert _run_ours(raw, status, headers, pieces) == _run_h11(raw, status, headers, pieces)


@settings(max_examples=200, deadline=None)
@given(
    raw=st.sampled_from(
        [
            b"BROKEN\r\n\r\n",
            b"GET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nhost: a\r\nbad line\r\n\r\n",
        ]
    ),
    status=st.sampled_from([400, 408, 413, 431]),
    body=st.binary(max_size=30),
)
def test_error_replies_after_a_refused_request_are_written_as_h11_writes_them(
    raw: bytes, status: int, body: bytes
) -> None:
    ours = ServerSession(max_header_bytes=4096, max_body_bytes=100)
    ours.receive(raw)
    with pytest.raises(Exception):  # noqa: B017 - MalformedRequest, whatever the cause
        ours.next_event()
    theirs = h11.Connection(h11.SERVER)
    theirs.receive_data(raw)
    with pytest.raises(h11.RemoteProtocolError):
        theirs.next_event()
    headers = [(b"content-type", b"text/plain")]
    expected = theirs.send(
        h11.Response(
            status_code=status,
            headers=[*headers, (b"content-length", b"%d" % len(body)), (b"connection", b"close")],
        )
    )
    assert expected is not None
    expected += theirs.send(h11.Data(data=body)) or b""
    expected += theirs.send(h11.EndOfMessage()) or b""
    assert ours.error_reply(status, headers, body) == expected
