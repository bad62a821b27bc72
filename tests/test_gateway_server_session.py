"""The server session: h11 parses request heads; Content-Length bodies and every response are
ours, and must come out exactly as with h11 alone (events, bytes, reuse)."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import ClientError, ResponseStateError
from gateway.protocol import REASON_PHRASES, RequestHead, ServerSession, Signal

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
    assert s.body(b"no") == b""  # RFC 9110 9.3.2: the GET answer's body is dropped
    assert s.end() == b""
    assert s.reusable


def test_a_head_answer_with_a_length_keeps_it_and_drops_the_body() -> None:
    s = session_after(b"HEAD / HTTP/1.1\r\nhost: a\r\n\r\n")
    head = s.response_head(200, [(b"content-length", b"5")])
    assert head == b"HTTP/1.1 200 \r\ncontent-length: 5\r\n\r\n"
    assert s.body(b"hello") + s.end() == b""
    assert s.reusable


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
            if raw.startswith(b"HEAD "):  # we drop a HEAD answer's body; h11 wants none
                out.append(b"")
                continue
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
            reason=REASON_PHRASES[status],
        )
    )
    assert expected is not None
    expected += theirs.send(h11.Data(data=body)) or b""
    expected += theirs.send(h11.EndOfMessage()) or b""
    assert ours.error_reply(status, headers, body) == expected


# --- request bodies against h11 ----------------------------------------------------------------

_REQUESTS = [
    b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n",
    b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello",
    b"POST /c HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
    b"POST /d HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\nabc",
    b"POST /e HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST /f HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi",
    b"GET /g HTTP/1.0\r\n\r\n",
    b"POST /h HTTP/1.1\r\nhost: x\r\ncontent-length: 4, 4\r\n\r\nabcd",
]


def _cut(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(raw)) for c in cuts})
    return [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True) if b > a]


def _ours(
    parts: list[bytes],
    eof: bool,
    *,
    fast_path: bool = True,
    max_head: int = 16 * 1024,
    statuses: bool = False,
) -> list[object]:
    """What a session makes of `parts` (with the refusal's status when `statuses`)."""
    s = ServerSession(max_header_bytes=max_head, max_body_bytes=1 << 20, fast_path=fast_path)
    seen: list[object] = []
    for part in [*parts, b""] if eof else parts:
        s.receive(part)
        while True:
            try:
                event = s.next_event()
            except ClientError as exc:
                return [*seen, ("error", exc.status) if statuses else "error"]
            if isinstance(event, RequestHead):
                seen.append((event.method, event.target, event.headers))
                if s.waiting_for_continue:
                    seen.append(s.continue_bytes())
            elif isinstance(event, bytes):
                seen.append(event)
            elif event is Signal.BODY_END:
                seen.append("end")
                seen.append(s.response_head(204, []) + s.end())
                if not s.reusable:
                    return [*seen, "close"]
                s.start_next_cycle()
            else:
                if event is Signal.CLOSED:
                    return [*seen, "closed"]
                break
    return seen


def _theirs(parts: list[bytes], eof: bool) -> list[object]:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
    seen: list[object] = []
    for part in [*parts, b""] if eof else parts:
        conn.receive_data(part)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return [*seen, "error"]
            if isinstance(event, h11.Request):
                headers = [(n.lower(), v) for n, v in event.headers.raw_items()]
                seen.append((event.method, event.target, headers))
                if conn.they_are_waiting_for_100_continue:
                    response = h11.InformationalResponse(
                        status_code=100, headers=[], reason=b"Continue"
                    )
                    seen.append(conn.send(response))
            elif isinstance(event, h11.Data):
                seen.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                seen.append("end")
                out = conn.send(h11.Response(status_code=204, headers=[])) or b""
                seen.append(out + (conn.send(h11.EndOfMessage()) or b""))
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return [*seen, "close"]
                conn.start_next_cycle()
            else:
                if isinstance(event, h11.ConnectionClosed):
                    return [*seen, "closed"]
                break
    return seen


def _merged(events: list[object]) -> list[object]:
    """Adjacent body pieces as one (how the bytes are split into events does not matter)."""
    out: list[object] = []
    for event in events:
        if (
            isinstance(event, bytes)
            and out
            and isinstance(out[-1], bytes)
            and not (event.startswith(b"HTTP/") or out[-1].startswith(b"HTTP/"))
        ):
            out[-1] += event
        else:
            out.append(event)
    return out


@settings(max_examples=400, deadline=None)
@given(
    requests=st.lists(st.sampled_from(_REQUESTS), min_size=1, max_size=4),
    noise=st.sampled_from([b"", b"GET / HTTP/1.1\r\nho", b"\x00garbage\r\n\r\n", b"x"]),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    eof=st.booleans(),
)
def test_requests_read_the_same_events_as_with_h11_however_they_arrive(
    requests: list[bytes], noise: bytes, cuts: list[int], eof: bool
) -> None:
    parts = _cut(b"".join(requests) + noise, cuts)
    assert _merged(_ours(parts, eof)) == _merged(_theirs(parts, eof))


def test_a_body_cut_short_by_the_client_is_malformed() -> None:
    s = ServerSession(max_header_bytes=4096, max_body_bytes=100)
    s.receive(b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\r\nab")
    assert isinstance(s.next_event(), RequestHead)
    assert s.next_event() == b"ab"
    assert s.next_event() is Signal.NEED_DATA
    s.receive(b"")
    with pytest.raises(ClientError):
        s.next_event()


def test_after_a_body_the_session_pauses_on_pipelined_bytes_and_reports_a_close() -> None:
    s = ServerSession(max_header_bytes=4096, max_body_bytes=100)
    s.receive(b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 1\r\n\r\nxGET")
    assert isinstance(s.next_event(), RequestHead)
    assert s.next_event() == b"x"
    assert s.next_event() is Signal.BODY_END
    assert s.next_event() is Signal.PAUSED
    s = ServerSession(max_header_bytes=4096, max_body_bytes=100)
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    assert isinstance(s.next_event(), RequestHead)
    s.receive(b"")
    assert s.next_event() is Signal.BODY_END
    assert s.next_event() is Signal.CLOSED
    s.response_head(204, [])
    s.end()
    s.start_next_cycle()  # as h11 does: a clean close after a complete exchange
    assert s.next_event() is Signal.CLOSED
