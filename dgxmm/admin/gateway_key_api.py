"""The admin API's gateway-key routes: the key's fingerprint, and a rotation.

`GET gateway-key` shows fingerprints only (`dgxmm.litellm.gateway_key.key_id`): the key itself is
never in an API answer.  `POST gateway-key/rotate` (what `dgxmm gateway-key rotate` calls)
makes a new key, re-registers LiteLLM's entries with it and answers once LiteLLM serves
them (or the wait ran out); the old key is refused `previous_until` at the latest.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from dgxmm.admin.errors import ApiError
from dgxmm.litellm.gateway_key import GatewayKeys, Rotation

REGISTER_WAIT_S = 120.0  # LiteLLM's worker restart takes 7-42 s; the API call must end


class KeyStatus(msgspec.Struct, kw_only=True):
    """`GET gateway-key`: the key's fingerprint, the previous one's while it is still
    accepted (until `previous_until`, wall clock), and whether loopback callers need none."""

    key_id: str
    previous_key_id: str | None
    previous_until: float | None
    loopback_open: bool


class KeyRoutes:
    """Handlers of the gateway-key routes (wired into `AdminApi`'s route table)."""

    def __init__(
        self, keys: GatewayKeys, register: Callable[[float], Awaitable[bool]] | None
    ) -> None:
        self.keys = keys
        self.register = register

    async def show(self, call: object) -> tuple[int, KeyStatus]:
        """GET gateway-key: fingerprints, the overlap, the mode."""
        return 200, msgspec.convert(self.keys.statistics(), KeyStatus)

    async def rotate(self, call: object) -> tuple[int, Rotation]:
        """POST gateway-key/rotate."""
        register = self.register

        async def bounded(timeout_s: float) -> bool:
            assert register is not None
            return await register(min(timeout_s, REGISTER_WAIT_S))

        rotation = await self.keys.rotate(bounded if register is not None else None)
        return 200, rotation


class NoKeyRoutes:
    """No gateway in this process: the routes answer 404."""

    async def show(self, call: object) -> tuple[int, KeyStatus]:
        """GET gateway-key."""
        raise ApiError(404, "no_gateway", "this DGXMM runs no gateway")

    async def rotate(self, call: object) -> tuple[int, Rotation]:
        """POST gateway-key/rotate."""
        raise ApiError(404, "no_gateway", "this DGXMM runs no gateway")
