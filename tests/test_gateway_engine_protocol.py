"""The engine side's own HTTP/1.1: request bytes, and a strict answer parser checked with h11."""

from __future__ import annotations

from collections.abc import Iterator

import h11
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway import engine_protocol
from gateway.engine_protocol import MAX_CHUNK_LINE, ClientSession
from gateway.errors import UpstreamClosed, UpstreamError, UpstreamProtocolError
from gateway.messages import LengthMemo, ResponseHead, Signal, field_lines

GET = (b"GET", b"/v1/models", [(b"host", b"e:1")], b"")


def sent(method: bytes = b"POST", max_head: int = 1024) -> ClientSession:
    """A session whose request went out."""
    c = ClientSession(max_header_bytes=max_head)
    body = b"{}" if method == b"POST" else b""
    headers = [(b"host", b"e:1"), (b"content-length", b"%d" % len(body))]
    c.request(method, b"/v1/x", headers, body)
    return c


def drain(c: ClientSession) -> tuple[ResponseHead | None, bytes, Signal]:
    """Head, body and the signal that stopped the events (no more bytes fed)."""
    head: ResponseHead | None = None
    body = b""
    while True:
        event = c.next_event()
        if isinstance(event, ResponseHead):
            head = event
        elif isinstance(event, bytes):
            body += event
        else:
            return head, body, event


def parse(raw: bytes, method: bytes = b"POST", pieces: int = 1) -> tuple[ResponseHead, bytes]:
    """Feed `raw` in `pieces` parts, then EOF; the head and whole body."""
    c = sent(method)
    head: ResponseHead | None = None
    body = b""
    step = max(1, len(raw) // pieces)
    chunks = [raw[i : i + step] for i in range(0, len(raw), step)] + [b""]
    for chunk in chunks:
        c.receive(chunk)
        h, b, signal = drain(c)
        head = head or h
        body += b
        if signal is Signal.BODY_END:
            break
    assert head is not None
    return head, body


# --- requests --------------------------------------------------------------------------


def test_request_bytes_put_host_first_and_keep_the_rest_in_order() -> None:
    c = ClientSession(max_header_bytes=1024)
    headers = [(b"x-a", b"1"), (b"host", b"e:1"), (b"content-length", b"2"), (b"x-b", b"2")]
    assert c.request(b"POST", b"/v1/x?q=1", headers, b"hi") == (
        b"POST /v1/x?q=1 HTTP/1.1\r\nhost: e:1\r\nx-a: 1\r\ncontent-length: 2\r\nx-b: 2\r\n\r\nhi"
    )


@pytest.mark.parametrize(
    ("method", "target", "headers", "body"),
    [
        (b"PO ST", b"/", [(b"host", b"e")], b""),
        (b"GET", b"/a b", [(b"host", b"e")], b""),
        (b"GET", b"/", [(b"host", b"e"), (b"bad name", b"x")], b""),
        (b"GET", b"/", [(b"host", b"e"), (b"x", b"a\r\nevil: 1")], b""),
        (b"GET", b"/", [(b"host", b"e"), (b"x", b" leading")], b""),
        (b"GET", b"/", [], b""),
        (b"POST", b"/", [(b"host", b"e")], b"body"),
        (b"POST", b"/", [(b"host", b"e"), (b"content-length", b"3")], b"body"),
        (b"POST", b"/", [(b"host", b"e"), (b"transfer-encoding", b"chunked")], b""),
    ],
)
def test_unchecked_requests_are_validated_like_h11(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    with pytest.raises(UpstreamProtocolError):
        ClientSession(max_header_bytes=1024).request(method, target, headers, body)


def test_a_second_request_before_the_answer_is_refused() -> None:
    c = sent()
    with pytest.raises(UpstreamProtocolError):
        c.request(*GET)


# --- answers ---------------------------------------------------------------------------


def test_content_length_answer_comes_out_whole_and_the_connection_is_reusable() -> None:
    c = sent()
    c.receive(b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nContent-Length: 5\r\n\r\nhello")
    head, body, signal = drain(c)
    assert head == ResponseHead(
        status=200,
        reason=b"OK",
        headers=[(b"content-type", b"a/b"), (b"content-length", b"5")],
        http_version=b"1.1",
    )
    assert (body, signal) == (b"hello", Signal.BODY_END)
    assert c.complete and c.reusable and c.clean
    assert c.next_event() is Signal.PAUSED
    c.start_next_cycle()
    c.request(*GET)
    c.receive(b"HTTP/1.1 204 \r\n\r\n")
    assert drain(c)[1:] == (b"", Signal.BODY_END)


def test_body_bytes_already_buffered_come_out_at_once_and_mark_the_answer_complete() -> None:
    c = sent()
    c.receive(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc")
    assert isinstance(c.next_event(), ResponseHead)
    assert c.next_event() == b"abc"
    assert c.complete and c.reusable


def test_chunked_answer_loses_its_framing_extensions_and_trailers() -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n1 \r\n,\r\n6\r\n world\r\n0\r\nx-checksum: 1\r\n\r\n"
    )
    for pieces in (1, 3, len(raw)):
        head, body = parse(raw, pieces=pieces)
        assert (head.status, body) == (200, b"hello, world")


def test_interim_answers_are_skipped() -> None:
    head, body = parse(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    )
    assert (head.status, body) == (200, b"ok")


@pytest.mark.parametrize(
    ("method", "status_line"),
    [
        (b"POST", b"HTTP/1.1 204 No Content"),
        (b"POST", b"HTTP/1.1 304 "),
        (b"HEAD", b"HTTP/1.1 200"),
    ],
)
def test_answers_without_a_body_end_after_their_head(method: bytes, status_line: bytes) -> None:
    c = sent(method)
    c.receive(status_line + b"\r\ncontent-length: 10\r\n\r\n")
    assert drain(c)[1:] == (b"", Signal.BODY_END)
    assert c.reusable


def test_an_answer_without_framing_ends_at_close_and_is_never_reused() -> None:
    c = sent()
    c.receive(b"HTTP/1.1 200 OK\r\n\r\nabc")
    assert drain(c)[1:] == (b"abc", Signal.NEED_DATA)
    c.receive(b"def")
    c.receive(b"")
    assert drain(c)[1:] == (b"def", Signal.BODY_END)
    assert c.complete and not c.reusable


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n",
    ],
)
def test_answers_that_close_are_never_reused(head: bytes) -> None:
    c = sent()
    c.receive(head)
    assert drain(c)[2] is Signal.BODY_END
    assert not c.reusable
    with pytest.raises(UpstreamProtocolError):
        c.start_next_cycle()


def test_bytes_after_the_answer_make_the_connection_unclean() -> None:
    c = sent()
    c.receive(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\naHTTP/1.1 200 OK\r\n")
    assert drain(c)[1] == b"a"
    assert c.reusable and not c.clean


def test_equal_repeated_content_lengths_are_one() -> None:
    head, body = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\ncontent-length: 2\r\n\r\nok")
    assert (head.status, body) == (200, b"ok")


@pytest.mark.parametrize(
    "raw",
    [
        b"SPDY/3 200\r\n\r\n",
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\ncontent-length: 0\n\n",
        b"HTTP/1.1 99 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\r\n folded\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx : a\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\x00b\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\rb\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n: a\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0x10\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10000000000000000\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\nbad trailer\r\n\r\n",
    ],
)
def test_malformed_answers_are_protocol_errors(raw: bytes) -> None:
    c = sent()
    c.receive(raw)
    with pytest.raises(UpstreamProtocolError):
        drain(c)
    assert not c.reusable
    with pytest.raises(UpstreamProtocolError):
        c.next_event()


def test_heads_over_the_bound_are_refused_complete_or_not() -> None:
    for raw in (
        b"HTTP/1.1 200 OK\r\nx: " + b"y" * 300,
        b"HTTP/1.1 200 OK\r\nx: " + b"y" * 300 + b"\r\n\r\n",
    ):
        c = sent(max_head=200)
        c.receive(raw)
        with pytest.raises(UpstreamProtocolError):
            c.next_event()


def test_endless_chunk_lines_and_trailers_are_refused() -> None:
    c = sent(max_head=200)
    c.receive(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1;" + b"x" * MAX_CHUNK_LINE)
    with pytest.raises(UpstreamProtocolError):
        drain(c)
    c = sent(max_head=200)
    c.receive(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n")
    assert drain(c)[2] is Signal.NEED_DATA
    with pytest.raises(UpstreamProtocolError):  # 20 trailer lines of 27 bytes: over 200
        for _ in range(20):
            c.receive(b"x-t: " + b"y" * 20 + b"\r\n")
            assert drain(c)[2] is Signal.NEED_DATA


def test_close_before_any_answer_byte_is_closed_before_response() -> None:
    c = sent()
    c.receive(b"")
    with pytest.raises(UpstreamClosed) as info:
        c.next_event()
    assert info.value.before_response


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\ncontent-le",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n",
    ],
)
def test_close_after_the_answer_began_is_closed_after_response(raw: bytes) -> None:
    c = sent()
    c.receive(raw)
    c.receive(b"")
    with pytest.raises(UpstreamClosed) as info:
        drain(c)
    assert not info.value.before_response
    assert not c.reusable


def test_data_after_eof_is_a_protocol_error() -> None:
    c = sent()
    c.receive(b"")
    with pytest.raises(UpstreamProtocolError):
        c.receive(b"x")


def test_a_failed_send_forbids_reuse() -> None:
    c = sent()
    c.send_failed()
    c.receive(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    drain(c)
    assert not c.reusable


# --- against h11 -------------------------------------------------------------------------

_TOKEN_CHARS = "!#$%&'*+-.^_`|~abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_names = (
    st.text(_TOKEN_CHARS, min_size=1, max_size=12)
    .map(str.encode)
    .filter(lambda n: n.lower() not in (b"content-length", b"transfer-encoding", b"connection"))
)
_values = st.binary(max_size=20).map(
    lambda v: bytes(b for b in v if b > 0x20 and b != 0x7F) or b"v"
)


def h11_parse(raw: bytes, method: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes]:
    """What h11 makes of an answer: status, reason, headers, body."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"e")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")
    response: h11.Response | None = None
    body = b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed) or event is h11.NEED_DATA:
            break
    assert response is not None
    headers = [(n.lower(), v) for n, v in response.headers.raw_items()]
    return response.status_code, bytes(response.reason), headers, body


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, bytes, int]:
    """A valid answer in one of the framings, and how many pieces to feed it in."""
    status = draw(st.sampled_from([200, 201, 204, 304, 400, 404, 500, 503]))
    reason = draw(st.sampled_from([b"", b"OK", b"Not Found", b"x\ty z"]))
    headers = draw(st.lists(st.tuples(_names, _values), max_size=5))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    head = b"HTTP/1.1 %d %s\r\n" % (status, reason)
    head += b"".join(
        n + b":" + draw(st.sampled_from([b" ", b"", b"\t "])) + v + b"\r\n" for n, v in headers
    )
    if status in (204, 304):
        body = b""
    if framing == "length":
        raw = head + b"content-length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
        raw = head + b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    else:
        raw = head + b"\r\n" + body
    return raw, body, draw(st.integers(1, 8))


@settings(max_examples=300, deadline=None)
@given(answer=answers(), method=st.sampled_from([b"GET", b"POST", b"HEAD"]))
def test_valid_answers_parse_as_h11_parses_them_however_they_are_split(
    answer: tuple[bytes, bytes, int], method: bytes
) -> None:
    raw, _, pieces = answer
    head, body = parse(raw, method, pieces)
    assert (head.status, head.reason, head.headers, body) == h11_parse(raw, method)


_PARTS = [
    b"HTTP/1.1 200 OK\r\n",
    b"HTTP/1.0 404 \r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"content-length: 3\r\n",
    b"content-length: 4\r\n",
    b"content-length: -1\r\n",
    b"transfer-encoding: chunked\r\n",
    b"transfer-encoding: identity\r\n",
    b"connection: close\r\n",
    b" folded\r\n",
    b"bad header\r\n",
    b"x:\x00\r\n",
    b"\r\n",
    b"\n",
    b"\r",
    b"abc",
    b"3\r\nabc\r\n",
    b"3;x=y\r\nabc\r\n",
    b"0\r\n\r\n",
    b"0\r\nx-t: 1\r\n\r\n",
    b"ffffffffffffffff\r\n",
    b"\x00\xff",
]


@settings(max_examples=500, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_PARTS), max_size=10),
    noise=st.binary(max_size=32),
    split=st.integers(1, 6),
)
def test_malformed_answers_raise_our_errors_and_never_accept_what_h11_refuses(
    parts: list[bytes], noise: bytes, split: int
) -> None:
    raw = b"".join(parts) + noise
    c = sent()
    step = max(1, len(raw) // split)
    head: ResponseHead | None = None
    body = b""
    ended = False
    try:
        for chunk in [raw[i : i + step] for i in range(0, len(raw), step)] + [b""]:
            c.receive(chunk)
            h, b, signal = drain(c)
            head, body = head or h, body + b
            if signal is Signal.BODY_END:
                ended = True
                break
    except UpstreamError:
        return
    if not ended:
        return
    assert head is not None
    # Whatever we accept as a whole answer, h11 accepts too and reads the same way (h11 stops
    # at the end of the first answer, as we do).
    assert h11_parse(raw, b"POST") == (head.status, head.reason, head.headers, body)


@pytest.mark.parametrize(
    "lengths",
    [
        b"content-length: 3\r\ncontent-length: 3\r\n",
        b"content-length: 3, 3\r\n",
        b"content-length: 3\r\nx-a: 1\r\ncontent-length: 3\r\n",
    ],
)
def test_equal_repeats_of_content_length_come_out_as_one_header_as_h11_makes_them(
    lengths: bytes,
) -> None:
    raw = b"HTTP/1.1 200 OK\r\n" + lengths + b"\r\nabc"
    session = ClientSession(max_header_bytes=65536)
    session.request(b"GET", b"/", [(b"host", b"x")], b"")
    session.receive(raw)
    head = session.next_event()
    assert isinstance(head, ResponseHead)
    assert head.headers == h11_parse(raw, b"GET")[2]
    assert session.next_event() == b"abc"


# --- whole chunks passed on as they are -------------------------------------------------------

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def streaming() -> ClientSession:
    """A session that read the head of a chunked answer."""
    c = sent()
    c.receive(STREAM_HEAD)
    head, body, signal = drain(c)
    assert head is not None and body == b"" and signal is Signal.NEED_DATA
    return c


def test_a_plain_whole_chunk_is_taken_as_it_is() -> None:
    c = streaming()
    chunk = b"1a\r\n" + b"x" * 26 + b"\r\n"
    assert c.whole_chunk(chunk) == 4
    assert c.next_event() is Signal.NEED_DATA  # nothing else was buffered
    c.receive(b"0\r\n\r\n")
    assert drain(c) == (None, b"", Signal.BODY_END)
    assert c.reusable


@pytest.mark.parametrize(
    "data",
    [
        b"1A\r\n" + b"x" * 26 + b"\r\n",  # upper-case hex: not as we would frame it
        b"01a\r\n" + b"x" * 26 + b"\r\n",  # a leading zero
        b"1a;ext=1\r\n" + b"x" * 26 + b"\r\n",  # an extension
        b"1a \r\n" + b"x" * 26 + b"\r\n",  # whitespace after the size
        b"1a\r\n" + b"x" * 25 + b"\r\n",  # shorter than its size
        b"1a\r\n" + b"x" * 26 + b"\r\n1\r\ny\r\n",  # two chunks
        b"1a\r\n" + b"x" * 26,  # the CRLF after the data still to come
        b"1a\r\n" + b"x" * 26 + b"\n\n",  # not a CRLF after the data
        b"0\r\n\r\n",  # the last chunk
        b"",
    ],
)
def test_anything_but_one_plain_whole_chunk_is_left_to_the_parser(data: bytes) -> None:
    c = streaming()
    assert c.whole_chunk(data) == 0
    assert c.next_event() is Signal.NEED_DATA  # unchanged


def test_no_whole_chunk_while_bytes_are_buffered_or_outside_a_chunked_body() -> None:
    c = streaming()
    c.receive(b"5\r\nab")
    assert c.next_event() == b"ab"
    assert c.whole_chunk(b"3\r\nxyz\r\n") == 0  # mid-chunk: these bytes end the one under way
    length = sent()
    length.receive(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    assert isinstance(length.next_event(), ResponseHead)
    assert length.whole_chunk(b"3\r\nxyz\r\n") == 0  # a Content-Length body


@given(data=st.binary(max_size=40), prefix=st.sampled_from([b"", b"3\r\nabc\r\n"]))
def test_a_whole_chunk_taken_is_what_the_parser_makes_of_the_same_bytes(
    data: bytes, prefix: bytes
) -> None:
    candidates = [data, b"%x\r\n%b\r\n" % (len(data), data) if data else data]
    for raw in candidates:
        c = streaming()
        if prefix:
            c.receive(prefix)
            drain(c)
        start = c.whole_chunk(raw)
        if raw is not data and not prefix:
            assert start  # a plain chunk as we frame one
        reference = streaming()
        if prefix:
            reference.receive(prefix)
            drain(reference)
        if not start:
            continue
        assert raw == b"%x\r\n%b\r\n" % (len(raw) - start - 2, raw[start:-2])  # as we frame
        reference.receive(raw)
        assert drain(reference) == (None, raw[start:-2], Signal.NEED_DATA)
        assert c.next_event() is Signal.NEED_DATA


# --- the memo of a connection's last answer head ----------------------------------------------

_ANSWER = (  # uvicorn's (vLLM, SGLang)
    b"HTTP/1.1 200 OK\r\nServer: uvicorn\r\nDate: Tue, 01 Dec 2026 18:00:00 GMT\r\n"
    b"Content-Length: %d\r\nContent-Type: application/json\r\n\r\n%s"
)
_LLAMA_CPP = (  # as llama-server (the build of scripts/build-llama-server) answers: no Date
    b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
    b"Content-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
    b"Keep-Alive: timeout=5, max=100\r\n\r\n%s"
)


def answered(c: ClientSession, raw: bytes) -> tuple[ResponseHead | None, bytes, Signal] | str:
    """What `c` makes of one answer, fed whole: head, body, last signal; or the error's name."""
    try:
        c.receive(raw)
        return drain(c)
    except UpstreamError as exc:
        return type(exc).__name__


def again(c: ClientSession, method: bytes = b"POST") -> None:
    """The next request on the connection (its previous answer was complete)."""
    c.start_next_cycle()
    c.request(method, b"/v1/x", [(b"host", b"e:1"), (b"content-length", b"0")], b"")


@pytest.mark.parametrize("answer", [_ANSWER, _LLAMA_CPP], ids=["uvicorn", "llama.cpp"])
def test_an_answer_head_that_differs_only_in_its_length_is_taken_from_the_memo(
    monkeypatch: pytest.MonkeyPatch, answer: bytes
) -> None:
    parsed: list[bytes] = []

    def spy(block: bytes) -> list[tuple[bytes, bytes]]:
        parsed.append(block)
        return field_lines(block)

    monkeypatch.setattr(engine_protocol, "field_lines", spy)
    c = sent()
    got = []
    for body in (b"{}", b'{"a":"bcde"}', b"", b"{}"):
        if got:
            again(c)
        got.append(answered(c, answer % (len(body), body)))
        assert c.reusable and c.clean
    assert len(parsed) == 1  # the others came from the memo
    monkeypatch.undo()
    for body, outcome in zip((b"{}", b'{"a":"bcde"}', b"", b"{}"), got, strict=True):
        assert outcome == answered(sent(), answer % (len(body), body))  # as a parse makes it
    assert (b"content-length", b"12") in got[1][0].headers  # type: ignore[index]


@pytest.mark.parametrize(
    ("value", "taken"),
    [
        (b"0", True),
        (b"9" * 19, True),  # the most a plain length has (`CONTENT_LENGTH_DIGITS`)
        (b"9" * 20, False),
        (b"", False),
        (b"+3", False),
        (b"3 ", False),  # then the memo's CR does not follow the digits
        (b"\xd9\xa3", False),  # bytes that are a digit elsewhere (Arabic-Indic three)
    ],
)
def test_the_memo_takes_what_a_plain_length_is(value: bytes, taken: bool) -> None:
    raw = _ANSWER % (2, b"")
    c = sent()
    c.receive(raw)
    head = c.next_event()
    assert isinstance(head, ResponseHead)
    memo = LengthMemo.of(head, raw, 0, len(raw))
    assert memo is not None
    again_raw = b"xx" + raw.replace(b"Length: 2", b"Length: " + value)
    assert memo.digits(again_raw, 2) == (value if taken else None)


def test_an_answer_to_head_is_never_taken_from_the_memo() -> None:
    c = sent()
    assert answered(c, _ANSWER % (2, b"{}"))[1:] == (b"{}", Signal.BODY_END)  # type: ignore[index]
    again(c, b"HEAD")
    head_only = _ANSWER % (2, b"")  # the same head, and no body after it
    assert answered(c, head_only) == answered(sent(b"HEAD"), head_only)
    assert c.reusable and c.clean
    again(c)
    assert answered(c, _ANSWER % (1, b"x"))[1:] == (b"x", Signal.BODY_END)  # type: ignore[index]


def memos_kept(monkeypatch: pytest.MonkeyPatch, raws: list[bytes]) -> int:
    """How many memos one connection keeps answering `raws`, each read as on a new one."""
    expected = [answered(sent(), raw) for raw in raws]
    kept: list[bytes] = []
    of = LengthMemo.of

    def spy(head: ResponseHead, buf: bytes, start: int, end: int) -> object:
        kept.append(buf[start:end])
        return of(head, buf, start, end)

    monkeypatch.setattr(LengthMemo, "of", spy)
    c = sent()
    for n, raw in enumerate(raws):
        if n:
            again(c)
        assert answered(c, raw) == expected[n]
    return len(kept)


def test_a_connection_whose_answers_keep_changing_stops_keeping_memos(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raws = [_ANSWER.replace(b"uvicorn", b"e-%d" % n) % (2, b"{}") for n in range(6)]
    # An engine that numbers its answers in a header: the first, then after one and two
    # misses; not after three.
    assert memos_kept(monkeypatch, raws) == 3


def test_a_connection_whose_answers_change_now_and_then_keeps_its_memo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its Date changes once a second: each new head misses once, then is the memo's.
    raws = [
        _ANSWER.replace(b"18:00:00", b"18:00:0%d" % (n // 2)) % (n % 3, b"x" * (n % 3))
        for n in range(10)
    ]
    assert memos_kept(monkeypatch, raws) == 5


_LENGTHS = [b"0", b"3", b"12", b"007", b"0" * 18 + b"3", b"0" * 19 + b"3", b"", b"+3", b"3 3",
            b"3,3", b" 3\t", b"0x3"]  # fmt: skip
_TWEAKS = [
    b"x-a: 1\r\n",
    b"content-length: 3\r\n",
    b"transfer-encoding: chunked\r\n",
    b"connection: close\r\n",
    b"Date: Tue, 01 Dec 2026 18:00:01 GMT\r\n",
]


_NO_BODY = (b"", None, 0, b"POST", b"", b"204 No Content", True)
_TWICE = (b"content-length: 3\r\n", 3, b"POST", b"", b"200 OK", True)  # two equal lengths
_BARE = (None, 0, b"POST", b"", b"200 OK", False)  # the body "abc", whatever the length


_ANSWER_LISTS = st.lists(
    st.tuples(
        st.sampled_from(_LENGTHS),
        st.sampled_from([None, None, None, *_TWEAKS]),  # a line the memo does not expect
        st.integers(0, 3),  # where it goes
        st.sampled_from([b"POST", b"POST", b"HEAD"]),
        st.sampled_from([b"", b"", b"HTTP/1.1 100 Continue\r\n\r\n"]),  # an interim answer
        st.sampled_from([b"200 OK", b"200 OK", b"404 Not Found", b"204 No Content"]),
        st.booleans(),  # the body as long as a plain length says, else "abc"
    ),
    min_size=1,
    max_size=6,
)
_Answer = tuple[bytes, bytes | None, int, bytes, bytes, bytes, bool]


def raw_answer(answer: _Answer) -> bytes:
    """The bytes of one of `_ANSWER_LISTS`' answers."""
    value, tweak, where, method, interim, status, fits = answer
    lines = [b"HTTP/1.1 " + status, b"Server: uvicorn", b"Content-Length: " + value, b"a: b"]
    if tweak is not None:
        lines.insert(1 + where, tweak[:-2])
    body = b"x" * int(value) if fits and value.isdigit() else b"abc"
    return interim + b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if method == b"HEAD" else body)


def one_connection(answers: list[_Answer]) -> Iterator[tuple[ClientSession, bytes, bytes]]:
    """Each answer's connection (one for all, the request for it just sent), method and bytes."""
    c: ClientSession | None = None
    for answer in answers:
        method = answer[3]
        if c is None:
            c = sent(method)
        else:
            again(c, method)
        yield c, method, raw_answer(answer)


@settings(max_examples=800, deadline=None)
@example(answers=[(b"0", *_NO_BODY[1:]), (b"3", *_NO_BODY[1:])])
@example(answers=[(b"3", *_TWICE), (b"12", *_TWICE)])
@given(answers=_ANSWER_LISTS)
def test_answers_that_differ_in_their_length_read_as_on_a_new_connection(
    answers: list[_Answer],
) -> None:
    """One connection's answers alike but for the Content-Length value (what the memo takes),
    now and then with another status or header line: each reads as it would on a connection
    that never saw another answer (the same head, body, reusability, or the same error)."""
    for c, method, raw in one_connection(answers):
        fresh = sent(method)
        assert answered(c, raw) == answered(fresh, raw)
        assert (c.reusable, c.clean) == (fresh.reusable, fresh.clean)
        if not (c.reusable and c.clean):
            return


_MADE = (b"client head up to the digits", b"after them")  # what a relay keeps with a memo


@settings(max_examples=800, deadline=None)
@example(answers=[(b"3", *_TWICE), (b"12", *_TWICE)], split=5, extra=b"x")
@example(answers=[(b"3", *_TWICE), (b"12", *_TWICE)], split=92, extra=b"")  # a byte short
@example(answers=[(b"3", *_BARE), (b"0", *_BARE)], split=61, extra=b"")  # then "abc"
@given(answers=_ANSWER_LISTS, split=st.integers(1, 200), extra=st.sampled_from([b"", b"H", b"x"]))
def test_a_whole_answer_alike_is_taken_as_the_parser_reads_it(
    answers: list[_Answer], split: int, extra: bytes
) -> None:
    """`alike_answer` takes exactly one whole answer alike to the memo's (a relay made
    something of): never a part of one, nor one with bytes after it, and what it takes reads
    as the parser reads it (the same length and body; the connection as reusable and as
    clean, with the memo in `known`)."""
    for c, method, raw in one_connection(answers):
        if c.alike_answer(raw[:split]) is not None and split < len(raw):
            # Bytes after an answer (a length of 0, then "abc"): only that answer is whole.
            part = sent(method)
            assert answered(part, raw[:split])[2:] == (Signal.BODY_END,) and part.clean
        assert c.alike_answer(raw + extra) is None or not extra
        fresh = sent(method)
        expected = answered(fresh, raw)
        alike = c.alike_answer(raw)
        if alike is None:
            assert answered(c, raw) == expected
        else:
            assert not isinstance(expected, str) and expected[0] is not None
            made, digits = alike
            assert made is _MADE
            length = dict(expected[0].headers)[b"content-length"]  # one, as the memo's
            assert (digits, raw[len(raw) - int(digits) :]) == (length, expected[1])
            assert expected[2] is Signal.BODY_END
            memo = c._memo
            c.take_alike()
            assert c.known is memo
        assert (c.reusable, c.clean) == (fresh.reusable, fresh.clean)
        if not (c.reusable and c.clean):
            return
        if c.known is not None:
            c.known.derived = _MADE


def test_a_whole_answer_is_taken_only_after_a_relay_made_something_of_its_memo() -> None:
    c = sent()
    first = _ANSWER % (2, b"{}")
    assert c.alike_answer(first) is None  # no memo yet
    assert answered(c, first)[1:] == (b"{}", Signal.BODY_END)  # type: ignore[index]
    again(c)
    second = _ANSWER % (3, b"abc")
    assert c.alike_answer(second) is None  # a memo, but nothing made of it
    assert c.known is not None
    c.known.derived = _MADE
    assert c.alike_answer(second) == (_MADE, b"3")
    assert c.alike_answer(second) == (_MADE, b"3")  # nothing changed
    c.take_alike()
    assert c.reusable and c.clean
    again(c, b"HEAD")
    assert c.alike_answer(_ANSWER % (3, b"")) is None  # an answer to HEAD has no body
