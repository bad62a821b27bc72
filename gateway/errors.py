"""Errors of the gateway layer; h11 and OSError exceptions are mapped to these at the edge."""

from __future__ import annotations


class GatewayError(Exception):
    """Base of every error the gateway layer raises."""


# --- server side (the client connection) ------------------------------------------------


class ClientError(GatewayError):
    """The client's side of a request failed; `status` is the reply it should get, if any."""

    status = 400


class ClientDisconnected(ClientError):
    """The client hung up, or bytes could not be written to it; nothing more can be sent."""

    status = 499


class MalformedRequest(ClientError):
    """The client sent something that is not acceptable HTTP/1.1; `status` is the reply."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class BodyTooLarge(ClientError):
    """The request body is larger than the server's cap."""

    status = 413


class BodyTimeout(ClientError):
    """The client stopped sending its request body."""

    status = 408


# msgspec decodes nested JSON recursively, within Python's recursion limit (1,000 frames)
# less the frames below the decode: on the gateway's handler path a body nested about 980
# levels deep decodes (measured), a deeper one raises RecursionError.  This many always do.
JSON_DEPTH = 900


class BodyTooDeep(ClientError):
    """The request body's JSON nests arrays and objects deeper than the gateway decodes:
    `gateway.classify` turns msgspec's RecursionError into this (a 400, not a 500)."""

    status = 400

    def __init__(self) -> None:
        super().__init__(
            f"the request body's JSON nests arrays and objects more than {JSON_DEPTH} levels "
            f"deep; the gateway reads up to {JSON_DEPTH}"
        )


class ResponseStateError(GatewayError):
    """The handler used its responder out of order (e.g. `send` before `start`)."""


# --- upstream side (engine connections) -------------------------------------------------


class UpstreamError(GatewayError):
    """A request to an engine failed; `detail` says how, for the error shown to clients.

    `unsent`: the request provably never reached the engine (no connection, or the
    connection was seen closed before the first byte of the request was handed to the
    kernel), so it may be sent again; see "Resending" in docs/on-demand-gateway.md.
    """

    unsent = False

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class UpstreamConnectError(UpstreamError):
    """The engine could not be connected to (refused, unreachable, connect timeout): the
    request never reached it, unless `unsent` says otherwise (the pool was closed)."""

    def __init__(self, detail: str, *, unsent: bool = True) -> None:
        super().__init__(detail)
        self.unsent = unsent


class UpstreamTimeout(UpstreamError):
    """The engine did not send anything within the read or write timeout."""


class UpstreamClosed(UpstreamError):
    """The engine closed or reset the connection before its answer was complete."""

    def __init__(self, detail: str, *, before_response: bool = False, unsent: bool = False) -> None:
        super().__init__(detail)
        self.before_response = before_response
        self.unsent = unsent


class UpstreamProtocolError(UpstreamError):
    """The engine sent something that is not valid HTTP/1.1."""


class UpstreamPoolExhausted(UpstreamError):
    """Every connection slot to this engine stayed busy for the whole connect timeout."""
