"""A minimal one-shot HTTP/1.1 client on asyncio + h11, for probing engines directly.

One connection per request (`Connection: close`): probes run every few seconds, so a pool
would buy nothing and would add a reuse decision to get wrong.  Every wait has a deadline,
the response body has a bound, and h11/OSError never leave this module: callers see only
the `HttpClientError` family below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import h11
import msgspec

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
    """Any other socket-level failure (unreachable network, unknown host, ...)."""


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
) -> Response:
    """Send one request on a fresh connection and return the whole response."""
    where = f"{method} http://{host}:{port}{target}"
    try:
        async with asyncio.timeout(timeout_s):
            return await _exchange(
                host, port, method, target, body, headers, connect_timeout_s, max_body_bytes
            )
    except TimeoutError as exc:
        raise RequestTimedOut(f"{where}: no complete answer within {timeout_s:g} s") from exc
    except HttpClientError as exc:
        raise type(exc)(f"{where}: {exc}") from exc.__cause__


async def _exchange(
    host: str,
    port: int,
    method: str,
    target: str,
    body: bytes,
    headers: Sequence[tuple[str, str]],
    connect_timeout_s: float,
    max_body_bytes: int,
) -> Response:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=READ_SIZE), connect_timeout_s
        )
    except ConnectionRefusedError as exc:
        raise ConnectionRefused("connection refused") from exc
    except TimeoutError as exc:
        raise RequestTimedOut(f"no connection within {connect_timeout_s:g} s") from exc
    except OSError as exc:
        raise TransportFailure(f"cannot connect: {exc}") from exc
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    eof = False
    done = False
    try:
        head: list[tuple[str, str]] = [
            ("host", f"{host}:{port}"),
            ("user-agent", "dgxmm-probe"),
            ("connection", "close"),
        ]
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(("content-length", str(len(body))))
        head.extend(headers)
        out = conn.send(h11.Request(method=method, target=target, headers=head))
        if body:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        writer.write(out)
        await writer.drain()
        status = 0
        response_headers: list[tuple[bytes, bytes]] = []
        chunks = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(READ_SIZE)
                eof = not data
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                response_headers = list(event.headers)
            elif isinstance(event, h11.Data):
                if len(chunks) + len(event.data) > max_body_bytes:
                    raise BadResponse(f"response body larger than {max_body_bytes} bytes")
                chunks += event.data
            elif isinstance(event, h11.EndOfMessage):
                done = True
                return Response(status=status, headers=response_headers, body=bytes(chunks))
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionDropped("connection closed before a response")
            # InformationalResponse (100 Continue): keep reading.
    except h11.RemoteProtocolError as exc:
        if eof:
            raise ConnectionDropped("connection closed in the middle of the response") from exc
        raise BadResponse(f"invalid HTTP response: {exc}") from exc
    except h11.LocalProtocolError as exc:
        raise BadResponse(f"cannot send this request: {exc}") from exc
    except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as exc:
        raise ConnectionDropped(f"connection reset: {exc}") from exc
    except OSError as exc:
        raise TransportFailure(str(exc)) from exc
    finally:
        if done:
            writer.close()
        else:
            writer.transport.abort()
