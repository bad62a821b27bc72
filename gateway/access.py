"""The gateway's door: only a request carrying the gateway key (LiteLLM's) gets in.

DGXMM keeps a secret, the gateway key, and registers it as the `api_key` of every LiteLLM
entry that points at the gateway; LiteLLM sends it as `Authorization: Bearer <key>`.  `Access`
holds the keys accepted right now (one, or two while a rotation lets the old key overlap the
new one) and decides whether a request head may pass: one header lookup and a constant-time
comparison with each accepted key.  Every route needs it, probes and `GET /v1/models` too:
whoever reaches the gateway's port without the key gets 401 and nothing else (no engine, no
start, no model list).

`loopback_open` (`[server] gateway_auth = "loopback-open"`, for a single-user box): a client
on the loopback interface (127.0.0.0/8, ::1) gets in without a key, so anything running on
this box as any user can use every model; clients on other addresses still need the key.

Pure, no I/O: the key is `dgxmm`'s (`dgxmm.litellm.gateway_key`), which tells `Access` when
the keys change.  A key never appears in an answer: the 401 says only what is missing.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence

import msgspec

from gateway.messages import Headers, header_value

_BEARER = b"bearer "
UNAUTHORIZED_HEADERS: Headers = [
    (b"content-type", b"application/json"),
    (b"www-authenticate", b"Bearer"),
]
# OpenAI's own answer to a missing or wrong key: 401, type "invalid_request_error", code
# "invalid_api_key", so clients and SDKs treat it as OpenAI's.  A wrong key's message begins
# with OpenAI's words, "Incorrect API key provided": LiteLLM 1.108.7 maps any upstream body
# with "invalid_request_error" to a 400 BadRequestError unless it says exactly that, and then
# to an AuthenticationError (401), which tells an operator whose LiteLLM holds a stale key what
# is wrong.  (LiteLLM always sends a key, so the missing-key answer is for other callers.)
MISSING_KEY = (
    "the DGXMM gateway needs its key (Authorization: Bearer <key>); call the model through LiteLLM"
)
WRONG_KEY = (
    "Incorrect API key provided: not the DGXMM gateway's key; call the model through LiteLLM"
)


def unauthorized_body(message: str) -> bytes:
    """The OpenAI-style 401 body."""
    error = {"message": message, "type": "invalid_request_error", "param": None}
    return msgspec.json.encode({"error": {**error, "code": "invalid_api_key"}})


_MISSING_BODY = unauthorized_body(MISSING_KEY)
_WRONG_BODY = unauthorized_body(WRONG_KEY)


def is_loopback(peer: tuple[str, int] | None) -> bool:
    """Whether the peer's address is on the loopback interface (a Unix socket is not)."""
    if peer is None:
        return False
    host = peer[0]
    return host.startswith("127.") or host == "::1" or host.startswith("::ffff:127.")


class Access:
    """The keys the gateway accepts now, and whether loopback clients need one."""

    __slots__ = ("keys", "loopback_open")

    def __init__(self, keys: Iterable[str] = (), *, loopback_open: bool = False) -> None:
        # Replaced as a whole when the keys change: the express lane remembers which tuple
        # a connection's head was checked against (`Forwarding.checked`), by identity.
        self.keys: tuple[bytes, ...] = ()
        self.loopback_open = loopback_open
        self.set_keys(keys)

    def set_keys(self, keys: Iterable[str]) -> None:
        """Accept exactly these keys from now on (a rotation passes the old and the new)."""
        self.keys = tuple(key.encode() for key in keys if key)

    def allows(self, headers: Sequence[tuple[bytes, bytes]], peer: tuple[str, int] | None) -> bool:
        """Whether a request with these headers, from `peer`, may pass."""
        value = header_value(headers, b"authorization")
        if value is not None and value[:7].lower() == _BEARER:
            token = value[7:].strip(b" \t")
            accepted = False
            for key in self.keys:  # every key, whichever matches: no timing says which
                accepted |= hmac.compare_digest(token, key)
            if accepted:
                return True
        return self.loopback_open and is_loopback(peer)

    def refusal(self, headers: Sequence[tuple[bytes, bytes]]) -> tuple[int, Headers, bytes]:
        """The 401 for a request `allows` refused: status, headers, body."""
        missing = header_value(headers, b"authorization") is None
        return 401, list(UNAUTHORIZED_HEADERS), _MISSING_BODY if missing else _WRONG_BODY
