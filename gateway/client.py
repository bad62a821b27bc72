"""DGXMM's one small HTTP/1.1 client for its own outbound calls: engine probes and LiteLLM.

One request per connection (`Connection: close`): probes run every few milliseconds to
seconds and LiteLLM syncs are rare, so a pool would buy nothing and would add a reuse
decision to get wrong (the relay's pool is `gateway.upstream`).  It speaks through the same
strict response parser as the relay (`gateway.engine_protocol.ClientSession`), so an answer
DGXMM's probe accepts is one its relay accepts too.  Every wait has a deadline, the answer's
body has a bound, and socket or protocol exceptions never leave this module: callers see only
the `HttpClientError` family below, whose message names the request.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections.abc import Sequence

import msgspec

from gateway.engine_protocol import ClientSession
from gateway.errors import UpstreamClosed, UpstreamProtocolError
from gateway.messages import ResponseHead, Signal

MAX_HEAD_BYTES = 64 * 1024
READ_SIZE = 64 * 1024


class HttpClientError(Exception):
    """Base of every failure of `request`; the message says what went wrong and where."""


class ConnectionRefused(HttpClientError):
    """Nothing listens on that port (the engine is not up yet, or it is gone)."""


class ConnectionDropped(HttpClientError):
    """The peer reset or closed the connection before the whole response arrived."""


class RequestTimedOut(HttpClientError):
    """No complete response before the deadline."""


class BadResponse(HttpClientError):
    """The answer is not valid HTTP/1.1, or its body is larger than allowed."""


class TransportFailure(HttpClientError):
    """Any other socket-level failure (unreachable network, unknown host, TLS, ...)."""


class Response(msgspec.Struct, frozen=True):
    """A complete HTTP response."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: str) -> bytes | None:
        """The first value of header `name` (case-insensitive), or None."""
        wanted = name.lower().encode("ascii")
        for key, value in self.headers:
            if key == wanted:
                return value
        return None

    def json(self) -> object:
        """The body decoded as JSON, or None when it is not JSON."""
        try:
            return msgspec.json.decode(self.body)
        except msgspec.DecodeError:
            return None


class Origin(msgspec.Struct, frozen=True):
    """Where a base URL points: host, port, TLS or not, and the path requests go under."""

    host: str
    port: int
    tls: bool = False
    base_path: str = ""

    @classmethod
    def parse(cls, url: str) -> Origin:
        """`http://host:port/base` -> Origin; ValueError for anything but http(s) URLs."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        tls = parts.scheme == "https"
        try:
            port = parts.port or (443 if tls else 80)
        except ValueError as exc:
            raise ValueError(f"{url!r} has an invalid port") from exc
        return cls(parts.hostname, port, tls, parts.path.rstrip("/"))


async def request(
    host: str,
    port: int,
    method: str,
    target: str,
    *,
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    connect_timeout_s: float = 2.0,
    timeout_s: float = 5.0,
    max_body_bytes: int = 4 * 1024 * 1024,
    tls: bool = False,
) -> Response:
    """Send one request on a fresh connection and return the whole response."""
    scheme = "https" if tls else "http"
    where = f"{method} {scheme}://{host}:{port}{target}"
    try:
        async with asyncio.timeout(timeout_s):
            return await _exchange(
                host, port, tls, method, target, body, headers, connect_timeout_s, max_body_bytes
            )
    except TimeoutError as exc:
        raise RequestTimedOut(f"{where}: no complete answer within {timeout_s:g} s") from exc
    except HttpClientError as exc:
        raise type(exc)(f"{where}: {exc}") from exc.__cause__


async def request_url(
    origin: Origin,
    method: str,
    target: str,
    *,
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    timeout_s: float = 5.0,
    max_body_bytes: int = 4 * 1024 * 1024,
) -> Response:
    """`request` to `target` under a base URL (its path prefixed, TLS when https)."""
    return await request(
        origin.host,
        origin.port,
        method,
        origin.base_path + target,
        body=body,
        headers=headers,
        connect_timeout_s=timeout_s,
        timeout_s=timeout_s,
        max_body_bytes=max_body_bytes,
        tls=origin.tls,
    )


def _request_headers(
    host: str,
    port: int,
    tls: bool,
    method: str,
    body: bytes,
    headers: Sequence[tuple[str, str]],
) -> list[tuple[bytes, bytes]]:
    """Host first (bracketed for IPv6, port only when not the default), then the rest."""
    default_port = 443 if tls else 80
    name = f"[{host}]" if ":" in host and not host.startswith("[") else host
    host_value = name if port == default_port else f"{name}:{port}"
    head: list[tuple[bytes, bytes]] = [
        (b"host", host_value.encode("ascii")),
        (b"user-agent", b"dgxmm"),
        (b"connection", b"close"),
    ]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append((b"content-length", str(len(body)).encode("ascii")))
    head += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    return head


async def _exchange(
    host: str,
    port: int,
    tls: bool,
    method: str,
    target: str,
    body: bytes,
    headers: Sequence[tuple[str, str]],
    connect_timeout_s: float,
    max_body_bytes: int,
) -> Response:
    session = ClientSession(max_header_bytes=MAX_HEAD_BYTES)
    try:
        head_list = _request_headers(host, port, tls, method, body, headers)
        out = session.request(method.encode("ascii"), target.encode("latin-1"), head_list, body)
    except (UpstreamProtocolError, UnicodeEncodeError) as exc:
        raise BadResponse(f"cannot send this request: {exc}") from exc
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
        # that arrives as the connection is refused (a stop that then never ends).
        async with asyncio.timeout(connect_timeout_s):
            reader, writer = await asyncio.open_connection(
                host, port, limit=READ_SIZE, ssl=ssl.create_default_context() if tls else None
            )
    except ConnectionRefusedError as exc:
        raise ConnectionRefused("connection refused") from exc
    except TimeoutError as exc:
        raise RequestTimedOut(f"no connection within {connect_timeout_s:g} s") from exc
    except OSError as exc:  # ssl.SSLError is an OSError too
        raise TransportFailure(f"cannot connect: {exc}") from exc
    done = False
    try:
        writer.write(out)
        await writer.drain()
        head: ResponseHead | None = None
        chunks = bytearray()
        while True:
            event = session.next_event()
            if event is Signal.NEED_DATA:
                session.receive(await reader.read(READ_SIZE))
            elif isinstance(event, ResponseHead):
                head = event
            elif isinstance(event, bytes):
                if len(chunks) + len(event) > max_body_bytes:
                    raise BadResponse(f"response body larger than {max_body_bytes} bytes")
                chunks += event
            elif event is Signal.BODY_END and head is not None:
                done = True
                return Response(head.status, list(head.headers), bytes(chunks))
            else:
                raise ConnectionDropped("connection closed before a response")
    except UpstreamClosed as exc:
        raise ConnectionDropped(str(exc)) from exc
    except UpstreamProtocolError as exc:
        raise BadResponse(f"invalid HTTP response: {exc}") from exc
    except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as exc:
        raise ConnectionDropped(f"connection reset: {exc}") from exc
    except OSError as exc:
        raise TransportFailure(str(exc)) from exc
    finally:
        if done:
            writer.close()
        else:
            writer.transport.abort()
