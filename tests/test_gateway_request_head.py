"""The fast path for request heads, held to h11: the same request or the same refusal.

The oracle is the session without the fast path (h11 parses every head, plus the gateway's
own refusals: Content-Length with Transfer-Encoding, the head-size estimate, the body cap),
and for inputs without those extras h11 alone (`test_gateway_server_session`, whose sessions
have the fast path on as everywhere by default).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import protocol
from gateway.errors import BodyTooLarge, MalformedRequest
from gateway.messages import header_value
from gateway.protocol import RequestHead, ServerSession, Signal
from gateway.request_head import FastHead, may_complete, parse_head, remember
from tests.test_gateway_app import _HEADERS as GATEWAY_HEADERS
from tests.test_gateway_server import _REQUEST_PARTS as SERVER_PARTS
from tests.test_gateway_server_session import _REQUESTS, _cut, _merged, _ours


def events(parts: list[bytes], eof: bool, *, fast: bool, max_head: int = 16 * 1024) -> list[object]:
    """What a session makes of `parts`: heads, 100-continues, body, ends, the refusal's status.

    Each complete request gets a 204 and the next cycle starts, as the server does.
    """
    return _ours(parts, eof, fast_path=fast, max_head=max_head, statuses=True)


def same_outcome(raw: bytes, cuts: list[int], eof: bool, max_head: int = 16 * 1024) -> None:
    parts = _cut(raw, cuts)
    fast = events(parts, eof, fast=True, max_head=max_head)
    oracle = events(parts, eof, fast=False, max_head=max_head)
    assert _merged(fast) == _merged(oracle)


# --- examples ------------------------------------------------------------------------------


def head_of(raw: bytes) -> tuple[ServerSession, RequestHead]:
    s = ServerSession(max_header_bytes=4096, max_body_bytes=1000)
    s.receive(raw)
    event = s.next_event()
    assert isinstance(event, RequestHead)
    return s, event


def test_a_plain_request_head_takes_the_fast_path() -> None:
    s, head = head_of(
        b"POST /d/a/v1/chat/completions?x=1 HTTP/1.1\r\nHost: gw\r\n"
        b"Content-Type:  application/json \r\ncontent-length: 2\r\n\r\n{}"
    )
    assert s.fast_head
    assert head == RequestHead(
        method=b"POST",
        target=b"/d/a/v1/chat/completions?x=1",
        headers=[(b"host", b"gw"), (b"content-type", b"application/json"),
                 (b"content-length", b"2")],
        http_version=b"1.1",
        has_body=True,
    )  # fmt: skip
    assert s.next_event() == b"{}"
    assert s.next_event() is Signal.BODY_END


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.0\r\n\r\n",  # HTTP/1.0: keep-alive rules, Host optional
        b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: a\r\nx: 1\r\n  folded\r\n\r\n",  # obs-fold
        b"GET / HTTP/1.1\nhost: a\n\n",  # bare LF
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 2, 2\r\n\r\nab",
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nab",
        b"GET / HTTP/1.1\r\nhost: a\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        b"CONNECT a:443 HTTP/1.1\r\nhost: a:443\r\n\r\n",
    ],
)
def test_heads_that_are_not_plainly_valid_go_to_h11(raw: bytes) -> None:
    s, _ = head_of(raw)
    assert not s.fast_head
    same_outcome(raw, [], eof=False)


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: a\r\nbad line\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: a\r\nx : y\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: a\r\nx: \x00\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: a\r\nx: a\rb\r\n\r\n",
        b"GET /a b HTTP/1.1\r\nhost: a\r\n\r\n",
        b"\r\nGET / HTTP/1.1\r\nhost: a\r\n\r\n",
        b" GET / HTTP/1.1\r\n",
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: +2\r\n\r\nab",
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 2000000\r\n\r\n",  # over the cap
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 99999999999999999999\r\n\r\n",
        b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
    ],
)
def test_malformed_and_smuggling_heads_get_the_same_refusal(raw: bytes) -> None:
    parts = [raw]
    fast = events(parts, True, fast=True)
    assert fast == events(parts, True, fast=False)
    assert isinstance(fast[-1], tuple) and fast[-1][0] == "error"


def test_an_incomplete_head_waits_only_while_h11_would_wait() -> None:
    assert may_complete(b"GET / HTTP/1.1\r\nhost: a\r\n", 4096)
    assert not may_complete(b"GET / HTTP/1.1\nhost: a\n\n", 4096)  # complete for h11
    assert not may_complete(b"\x00GET", 4096)  # h11 refuses at once
    assert not may_complete(b"GET /" + b"a" * 5000, 4096)  # over the bound: 431 now


def test_a_head_near_the_size_bound_goes_to_h11() -> None:
    raw = b"GET / HTTP/1.1\r\nhost: a\r\n" + b"x:\r\n" * 20 + b"\r\n"
    assert parse_head(raw, len(raw), len(raw)) is None  # the estimate counts 4 per header
    assert parse_head(raw, len(raw), 4 * len(raw)) is not None


def test_the_size_bound_is_the_estimate_to_the_byte() -> None:
    raw = b"GET /a HTTP/1.1\r\nhost:a\r\nx-y:zz\r\n\r\n"
    estimate = len(b"GET") + len(b"/a") + 12 + (4 + 1 + 4) + (3 + 2 + 4)
    assert estimate == len(raw) - 2 + 2  # no OWS: the raw length less 2, plus 1 per header
    assert parse_head(raw, len(raw), estimate) is not None
    assert parse_head(raw, len(raw), estimate - 1) is None


# --- generated ---------------------------------------------------------------------------

_METHODS = [b"GET", b"POST", b"HEAD", b"PUT", b"OPTIONS", b"CONNECT", b"get", b"P\x00ST", b""]
_TARGETS = [b"/", b"/d/a/v1/chat/completions?x=1", b"*", b"http://h/x", b"/\x7f", b"/a b", b""]
_VERSIONS = [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"http/1.1", b"HTTP/1.1 x"]
_HEADER_LINES = [
    b"host: a",
    b"Host:a",
    b"HOST: a ",
    b"host:\ta\t",
    b"content-length: 3",
    b"Content-Length: 0",
    b"content-length: 00",
    b"content-length: 3, 3",
    b"content-length: 1001",
    b"content-length: +3",
    b"content-length: 3 3",
    b"content-length: 0x3",
    b"transfer-encoding: chunked",
    b"Transfer-Encoding: Chunked",
    b"transfer-encoding: identity",
    b"connection: close",
    b"Connection: keep-alive, Close",
    b"connection: upgrade",
    b"upgrade: h2c",
    b"expect: 100-continue",
    b"Expect: foo, 100-Continue",
    b"x-a:",
    b"x-a: b  c",
    b"x-a: \x80\xff",
    b"x-a: \x01",
    b"x-a: b\x00",
    b"x-a : b",
    b" x-a: b",
    b"x-a b",
    b":b",
    b"x-a: " + b"v" * 300,
]
_ENDS = [b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r"]
_BODIES = [b"", b"abc", b"3\r\nabc\r\n0\r\n\r\n", b"0\r\n\r\n"]


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A request head (mostly plausible, often subtly wrong) and some bytes after it."""
    end = draw(st.sampled_from(_ENDS)) if draw(st.integers(0, 4)) == 0 else b"\r\n"
    line = b" ".join(
        (
            draw(st.sampled_from(_METHODS)),
            draw(st.sampled_from(_TARGETS)),
            draw(st.sampled_from(_VERSIONS)),
        )
    )
    lines = [line, *draw(st.lists(st.sampled_from(_HEADER_LINES), max_size=6))]
    head = b"".join(item + end for item in lines) + end
    return head + draw(st.sampled_from(_BODIES))


@settings(max_examples=1500, deadline=None)
@given(
    reqs=st.lists(requests(), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 600), max_size=4),
    eof=st.booleans(),
    max_head=st.sampled_from([16 * 1024, 128]),
)
def test_generated_requests_read_the_same_with_and_without_the_fast_path(
    reqs: list[bytes], cuts: list[int], eof: bool, max_head: int
) -> None:
    same_outcome(b"".join(reqs), cuts, eof, max_head)


@settings(max_examples=600, deadline=None)
@given(
    base=st.sampled_from(_REQUESTS),
    at=st.integers(0, 200),
    insert=st.binary(min_size=0, max_size=3),
    drop=st.integers(0, 2),
    cuts=st.lists(st.integers(0, 300), max_size=3),
    eof=st.booleans(),
)
def test_mutated_requests_read_the_same_with_and_without_the_fast_path(
    base: bytes, at: int, insert: bytes, drop: int, cuts: list[int], eof: bool
) -> None:
    at = min(at, len(base))
    same_outcome(base[:at] + insert + base[at + drop :], cuts, eof)


@settings(max_examples=400, deadline=None)
@given(
    parts=SERVER_PARTS,
    noise=st.binary(max_size=32),
    cuts=st.lists(st.integers(0, 400), max_size=3),
    eof=st.booleans(),
)
def test_the_servers_adversarial_corpus_reads_the_same_with_and_without_the_fast_path(
    parts: list[bytes], noise: bytes, cuts: list[int], eof: bool
) -> None:
    same_outcome(b"".join(parts) + noise, cuts, eof)


@settings(max_examples=400, deadline=None)
@given(
    method=st.sampled_from([b"POST", b"GET", b"PUT", b"HEAD", b"P\x00ST"]),
    headers=GATEWAY_HEADERS,
    body=st.sampled_from([b"", b"{}", b"2\r\n{}\r\n0\r\n\r\n", b"\xff\xfe"]),
    version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 x"]),
    eof=st.booleans(),
)
def test_the_gateways_smuggling_corpus_reads_the_same_with_and_without_the_fast_path(
    method: bytes, headers: list[bytes], body: bytes, version: bytes, eof: bool
) -> None:
    raw = method + b" /d/a/v1/chat/completions " + version + b"\r\n" + b"".join(headers)
    same_outcome(raw + b"\r\n" + body, [], eof)


def test_without_the_fast_path_every_head_goes_to_h11() -> None:
    s = ServerSession(max_header_bytes=4096, max_body_bytes=1000, fast_path=False)
    s.receive(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    assert isinstance(s.next_event(), RequestHead)
    assert not s.fast_head


# --- the memo of a connection's last head -----------------------------------------------------

_BASE = (
    b"POST /d/a/v1/chat/completions HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\n"
    b"Content-Length: 2\r\nuser-agent: sdk\r\n\r\n{}"
)


def cycles(s: ServerSession, raw: bytes) -> list[RequestHead]:
    """The heads of the whole requests in `raw`, each answered with a 204."""
    s.receive(raw)
    heads = []
    while True:
        event = s.next_event()
        if isinstance(event, RequestHead):
            heads.append(event)
        elif event is Signal.BODY_END:
            s.response_head(204, [])
            s.end()
            s.start_next_cycle()
        elif event is Signal.NEED_DATA:
            return heads


def test_a_head_that_differs_only_in_its_length_is_taken_from_the_memo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[bytes] = []

    def spy(buf: bytes, end: int, max_head: int) -> object:
        parsed.append(buf[:end])
        return parse_head(buf, end, max_head)

    monkeypatch.setattr(protocol, "parse_head", spy)
    s = ServerSession(max_header_bytes=4096, max_body_bytes=1000)
    longer = _BASE.replace(b"Length: 2", b"Length: 12").replace(b"{}", b'{"a":"bcde"}')
    heads = cycles(s, _BASE + longer + _BASE)
    assert len(parsed) == 1  # the others came from the memo
    assert [header_value(h.headers, b"content-length") for h in heads] == [b"2", b"12", b"2"]
    assert heads[1] == head_of(longer)[1]  # what a parse makes of it


def test_a_connection_whose_heads_keep_changing_stops_keeping_memos(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    remembered: list[int] = []

    def spy(buf: bytes, head: FastHead) -> object:
        remembered.append(head.end)
        return remember(buf, head)

    monkeypatch.setattr(protocol, "remember", spy)
    s = ServerSession(max_header_bytes=4096, max_body_bytes=1000)
    unique = [_BASE.replace(b"sdk", b"sdk-%d" % n) for n in range(6)]
    heads = cycles(s, b"".join(unique))
    assert [h.headers[-1][1] for h in heads] == [b"sdk-%d" % n for n in range(6)]
    assert len(remembered) == 3  # the first, then after one and two misses; not after three


@settings(max_examples=800, deadline=None)
@given(
    digits=st.lists(
        st.sampled_from(
            [
                b"0",
                b"3",
                b"12",
                b"007",
                b"1001",
                b"9" * 19,
                b"9" * 20,
                b"",
                b"+3",
                b"3 3",
                b"3,3",
                b"0x3",
                b"\t3\t",
                b" 3 ",
            ]
        ),
        min_size=1,
        max_size=4,
    ),
    tweak=st.sampled_from([b"", b"x-a: 1\r\n", b"content-length: 3\r\n", b"host: b\r\n"]),
    where=st.integers(0, 3),
    body=st.sampled_from([b"", b"abc", b"x" * 12]),
    max_head=st.sampled_from([16 * 1024, 120, 130, 140]),
)
def test_heads_that_differ_in_their_length_read_the_same_with_and_without_the_fast_path(
    digits: list[bytes], tweak: bytes, where: int, body: bytes, max_head: int
) -> None:
    """A connection's requests alike but for the Content-Length digits (what the memo
    takes), now and then with another header line added where the memo would not expect it."""
    lines = [b"POST /d/a/v1/chat/completions HTTP/1.1", b"Host: gw", b"content-type: x"]
    raw = b""
    for n, value in enumerate(digits):
        head = [*lines, b"Content-Length: " + value, b"user-agent: sdk"]
        if n == where and tweak:
            head.insert(2, tweak[:-2])
        raw += b"\r\n".join(head) + b"\r\n\r\n" + body
    same_outcome(raw, [], False, max_head)


# --- a whole request alike to the last, taken in one call (the express lane) -----------------


def answered(s: ServerSession) -> None:
    s.response_head(204, [])
    s.end()
    s.start_next_cycle()


def test_a_whole_request_alike_to_the_last_is_taken_in_one_call() -> None:
    s = ServerSession(max_header_bytes=4096, max_body_bytes=1000)
    assert s.whole_request(_BASE) is None  # no memo yet
    cycles(s, _BASE)
    longer = _BASE.replace(b"Length: 2", b"Length: 12").replace(b"{}", b'{"a":"bcde"}')
    assert s.whole_request(longer[:-1]) is None  # a part of the body
    assert s.whole_request(longer + b"P") is None  # more than the request
    assert s.whole_request(_BASE.replace(b"sdk", b"sdk2")) is None  # not alike
    taken = s.whole_request(longer)
    assert taken == (head_of(longer)[1], b'{"a":"bcde"}')
    assert not s.body_buffered  # read to its end
    assert s.next_event() is Signal.NEED_DATA
    assert s.cycle_bytes == len(longer) and s.body_bytes == 12
    answered(s)
    assert s.whole_request(_BASE) == (head_of(_BASE)[1], b"{}")
    answered(s)
    s.receive(b"POST")  # a part of a head, buffered: the next read is not a request's start
    assert s.whole_request(_BASE) is None
    s = ServerSession(max_header_bytes=4096, max_body_bytes=1000)
    cycles(s, _BASE)
    s.receive(b"")  # the client closed its side
    assert s.whole_request(_BASE) is None
    s = ServerSession(max_header_bytes=4096, max_body_bytes=1000)
    cycles(s, _BASE)
    carrier = _BASE.replace(b"Length: 2", b"Length: %d" % len(_BASE))[:-2]
    assert cycles(s, carrier) == [head_of(carrier + _BASE)[1]]  # its body comes next
    assert s.whole_request(_BASE) is None  # a body, not a request


def lane(reads: list[bytes], *, whole: bool, max_head: int, max_body: int) -> list[object]:
    """What the express lane's calls make of a connection's `reads` (each request answered
    with a 204 once read): a request's head and body taken at once (`whole_request`, when
    `whole`), else its head (`express_head`) and then its body once buffered (`take_body`),
    else the usual events; the session's whole state after each step; a refusal ends it."""
    s = ServerSession(max_header_bytes=max_head, max_body_bytes=max_body)
    seen: list[object] = []
    head: RequestHead | None = None  # `express_head` took it, its body is not whole yet
    try:
        for data in reads:
            if head is not None:
                s.receive(data)
            elif whole and (taken := s.whole_request(data)) is not None:
                seen += (*taken, state(s))
                answered(s)
            else:
                head = s.express_head(data)
                if head is None:
                    s.receive(data)
            if head is not None and s.body_buffered:
                seen += (head, s.take_body(), state(s))
                head = None
                answered(s)
            if head is None:  # what the connection's task reads: the usual events
                while (event := s.next_event()) is not Signal.NEED_DATA:
                    seen.append(event)
                    if event is Signal.BODY_END:
                        answered(s)
            seen.append(state(s))
    except (MalformedRequest, BodyTooLarge) as exc:
        seen.append(exc.status)
    return seen


def state(s: ServerSession) -> dict[str, object]:
    """Every slot of the session, its memo by what it holds (two sessions, alike)."""
    out: dict[str, object] = {}
    for name in ServerSession.__slots__:
        value = getattr(s, name)
        if name == "_conn":
            value = value is None
        elif name in ("_memo", "known") and value is not None:
            value = (value.head, value.before, value.after, value.index)
        out[name] = value
    return out


@settings(max_examples=600, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.sampled_from([b"0", b"3", b"12", b"007", b"00", None]), st.booleans()),
        min_size=1,
        max_size=5,
    ),
    data=st.data(),
    max_head=st.sampled_from([16 * 1024, 104, 105, 106, 112, 113]),  # around the heads' sizes
    max_body=st.sampled_from([1000, 11]),
)
def test_a_whole_request_is_taken_as_its_head_and_body_are(
    requests: list[tuple[bytes | None, bool]], data: st.DataObject, max_head: int, max_body: int
) -> None:
    """A connection's requests, alike but for their lengths, now and then with a header more
    or a GET between, in reads cut anywhere (most at a request's end): taken whole or head
    then body, the same requests, the same refusals and the session in the same state."""
    raw = b""
    ends = []
    for digits, more in requests:
        if digits is None:
            raw += b"GET /d/a/v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
            ends.append(len(raw))
            continue
        lines = [b"POST /d/a/v1/chat/completions HTTP/1.1", b"Host: gw", b"content-type: x"]
        lines += [b"Content-Length: " + digits, b"user-agent: sdk"]
        if more:
            lines.insert(2, b"x-a: 1")
        raw += b"\r\n".join(lines) + b"\r\n\r\n" + b"x" * int(digits)
        ends.append(len(raw))
    at_ends = [end for end in ends if data.draw(st.integers(0, 3), label="cut") > 0]
    anywhere = data.draw(st.lists(st.integers(1, len(raw)), max_size=2), label="cuts")
    reads = _cut(raw, at_ends + anywhere)
    taken = lane(reads, whole=True, max_head=max_head, max_body=max_body)
    assert taken == lane(reads, whole=False, max_head=max_head, max_body=max_body)
