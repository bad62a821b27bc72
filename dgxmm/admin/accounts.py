"""Accounts and API tokens: the decisions (pure) and the admin API's routes for them.

Users: list, add, change role, reset password, remove; a user changes their own password.
Tokens: create (a name, an optional expiry, optionally the `metrics` role that reads
`/metrics` and nothing else), list (with the last use), revoke.  Every change is an event
of the `users` stream, so the audit trail records who did it.  The last admin can be
neither removed nor demoted: someone must be able to log in and manage the box.

`dgxmm user remove|passwd` and `dgxmm token create|list|revoke` (dgxmm/admin/accounts_cli.py)
use the same decisions on the log file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from dgxmm.admin import bodies
from dgxmm.admin.auth import ROLES, Auth, AuthError, Principal, check_password
from events import model as m
from events.state import UserRecord
from storage.errors import ConcurrencyError
from storage.eventlog import EventStore

# --- decisions (pure) -----------------------------------------------------------------------


def _admins(users: Mapping[str, UserRecord]) -> list[str]:
    return [u.name for u in users.values() if u.role == "admin"]


def _existing(users: Mapping[str, UserRecord], name: str) -> UserRecord:
    user = users.get(name)
    if user is None:
        raise AuthError(404, "user_not_found", f"no user {name}")
    return user


def user_removed(users: Mapping[str, UserRecord], name: str) -> m.UserRemoved:
    """The event that removes `name`; AuthError 404, or 409 for the last admin."""
    user = _existing(users, name)
    if user.role == "admin" and _admins(users) == [name]:
        raise AuthError(409, "last_admin", f"{name} is the last admin; add another admin first")
    return m.UserRemoved(name=name)


def role_changed(users: Mapping[str, UserRecord], name: str, role: Any) -> m.UserRoleChanged | None:
    """The event that gives `name` the role (None if it has it); AuthError 404/409/422."""
    if role not in ROLES:
        raise AuthError(422, "invalid_role", 'role: "admin" or "viewer"')
    user = _existing(users, name)
    if user.role == role:
        return None
    if user.role == "admin" and _admins(users) == [name]:
        raise AuthError(409, "last_admin", f"{name} is the last admin; add another admin first")
    return m.UserRoleChanged(name=name, role=role)


def token_revoked(users: Mapping[str, UserRecord], token_id: str) -> m.ApiTokenRevoked:
    """The event that revokes a token (by id); AuthError 404 if no user has it."""
    owner = next((u for u in users.values() if token_id in u.tokens), None)
    if owner is None:
        raise AuthError(404, "token_not_found", f"no API token {token_id}")
    return m.ApiTokenRevoked(name=owner.name, token_id=token_id)


def token_rows(
    users: Mapping[str, UserRecord], now: float, last_used: Mapping[str, float] | None = None
) -> list[dict[str, Any]]:
    """Every token (never its secret or hash), newest first."""
    rows = []
    for user in users.values():
        for token_id in user.tokens:
            info = user.token_info.get(token_id)
            used = info.last_used_at if info is not None else None
            seen = (last_used or {}).get(token_id)
            if seen is not None and (used is None or seen > used):
                used = seen
            expires = info.expires_at if info is not None else None
            rows.append(
                {
                    "token_id": token_id,
                    "user": user.name,
                    "name": info.label if info is not None else "",
                    "role": (info.role if info is not None else None) or user.role,
                    "created_at": info.created_at if info is not None else None,
                    "expires_at": expires,
                    "expired": expires is not None and now >= expires,
                    "last_used_at": used,
                }
            )
    rows.sort(key=lambda r: r["created_at"] or 0.0, reverse=True)
    return rows


def user_rows(users: Mapping[str, UserRecord]) -> list[dict[str, Any]]:
    """Every user (never a hash), by name."""
    return [
        {
            "name": u.name,
            "role": u.role,
            "created_at": u.created_at or None,
            "tokens": len(u.tokens),
        }
        for u in sorted(users.values(), key=lambda u: u.name)
    ]


async def append_users(
    store: EventStore, events: list[m.AnyEvent], actor: str, expected_version: int
) -> None:
    """Append to `users` if nobody else wrote since the decision; else AuthError 409."""
    try:
        await store.append(m.STREAM_USERS, events, actor=actor, expected_version=expected_version)
    except ConcurrencyError:
        raise AuthError(409, "conflict", "the users changed meanwhile; try again") from None


# --- the API's routes -----------------------------------------------------------------------
# What each route answers (`dgxmm.admin.openapi` documents these types); the rows are the
# dicts `token_rows` and `user_rows` give the CLI too, converted (so checked) on the way out.


class TokenRow(msgspec.Struct, kw_only=True):
    """One API token (never its secret or hash); `role`: the owner's, or `metrics`."""

    token_id: str
    user: str
    name: str
    role: str
    created_at: float | None
    expires_at: float | None
    expired: bool
    last_used_at: float | None


class TokenList(msgspec.Struct, kw_only=True):
    """`GET /tokens`: newest first."""

    tokens: list[TokenRow]


class TokenCreated(msgspec.Struct, kw_only=True):
    """`POST /tokens`: the token, shown only here (`role` null: the owner's)."""

    user: str
    token_id: str
    token: str
    name: str
    role: str | None
    expires_at: float | None


class TokenGone(msgspec.Struct, kw_only=True):
    """`DELETE /tokens/{id}`."""

    token_id: str
    user: str
    revoked: bool


class UserRow(msgspec.Struct, kw_only=True):
    """One user (never a hash) and how many tokens it has."""

    name: str
    role: str
    created_at: float | None
    tokens: int


class UserList(msgspec.Struct, kw_only=True):
    """`GET /users`: by name."""

    users: list[UserRow]


class UserAdded(msgspec.Struct, kw_only=True):
    """`POST /users`."""

    name: str
    role: str


class UserChanged(msgspec.Struct, kw_only=True):
    """`PATCH /users/{name}`: its role now, and whether its password was reset."""

    name: str
    role: str
    password_reset: bool


class UserGone(msgspec.Struct, kw_only=True):
    """`DELETE /users/{name}`: how many of its sessions ended."""

    name: str
    removed: bool
    sessions_ended: int


class OwnPasswordChanged(msgspec.Struct, kw_only=True):
    """`POST /session/password`: this session goes on, the user's others end."""

    name: str
    password_changed: bool


class Call(Protocol):
    """What a handler reads of the API's call."""

    principal: Principal | None
    params: dict[str, str]
    body: Any


class AccountRoutes:
    """Handlers of the users and tokens routes (wired into `AdminApi`'s route table)."""

    def __init__(self, auth: Auth, store: EventStore) -> None:
        self.auth = auth
        self.store = store

    def _who(self, call: Call) -> Principal:
        assert call.principal is not None
        return call.principal

    async def _decided(self) -> tuple[dict[str, UserRecord], int]:
        users = await self.auth.users()
        return users, await self.store.version(m.STREAM_USERS)

    async def list_users(self, call: Call) -> tuple[int, UserList]:
        """GET users."""
        rows = user_rows(await self.auth.users())
        return 200, UserList(users=msgspec.convert(rows, list[UserRow]))

    async def add_user(self, call: Call) -> tuple[int, UserAdded]:
        """POST users {name, role, password}."""
        body = bodies.decode(call.body, bodies.UserBody, bodies.ACCOUNT_RULES)
        await self.auth.add_user(body.name, body.role, body.password, self._who(call).actor)
        return 201, UserAdded(name=body.name, role=body.role)

    async def change_user(self, call: Call) -> tuple[int, UserChanged]:
        """PATCH users/{name} {role?, password?}: role change and password reset."""
        name = call.params["name"]
        body = bodies.decode(call.body, bodies.UserChangeBody, bodies.ACCOUNT_RULES)
        password = body.password
        if password is not None:
            check_password(password)
        users, version = await self._decided()
        events: list[m.AnyEvent] = []
        if body.role is not None:
            change = role_changed(users, name, body.role)
            if change is not None:
                events.append(change)
        _existing(users, name)
        if password is not None:
            encoded = await self.auth.hash(password)
            events.append(m.PasswordChanged(name=name, password_hash=encoded, reason="reset"))
        await append_users(self.store, events, self._who(call).actor, version)
        if password is not None:
            self.auth.end_sessions(name)  # a reset ends every session of the user
        user = _existing(await self.auth.users(), name)
        return 200, UserChanged(name=user.name, role=user.role, password_reset=password is not None)

    async def remove_user(self, call: Call) -> tuple[int, UserGone]:
        """DELETE users/{name}: the user, its sessions and its tokens stop working at once."""
        name = call.params["name"]
        users, version = await self._decided()
        await append_users(self.store, [user_removed(users, name)], self._who(call).actor, version)
        ended = self.auth.end_sessions(name)
        return 200, UserGone(name=name, removed=True, sessions_ended=ended)

    async def change_own_password(self, call: Call) -> tuple[int, OwnPasswordChanged]:
        """POST session/password {current, password}: a logged-in user's own password."""
        p = self._who(call)
        body = bodies.decode(call.body, bodies.PasswordBody, bodies.ACCOUNT_RULES)
        current, password = body.current, body.password
        check_password(password)
        if p.session is None:
            raise AuthError(403, "session_required", "log in to change your password")
        if not await self.auth.check_password_of(p.user, current):
            raise AuthError(403, "wrong_password", "current: not your password")
        version = await self.store.version(m.STREAM_USERS)
        encoded = await self.auth.hash(password)
        event = m.PasswordChanged(name=p.user, password_hash=encoded, reason="self")
        await append_users(self.store, [event], p.actor, version)
        p.session.password_hash = encoded  # this session goes on; the others end
        self.auth.end_sessions(p.user, keep=p.session)
        return 200, OwnPasswordChanged(name=p.user, password_changed=True)

    async def list_tokens(self, call: Call) -> tuple[int, TokenList]:
        """GET tokens."""
        users = await self.auth.users()
        now = self.auth.clock.wall()
        rows = token_rows(users, now, self.auth.token_uses())
        return 200, TokenList(tokens=msgspec.convert(rows, list[TokenRow]))

    async def create_token(self, call: Call) -> tuple[int, TokenCreated]:
        """POST tokens {user?, name?, expires_in_s?, role?}; the token is shown only here."""
        p = self._who(call)
        body = bodies.decode(call.body, bodies.TokenBody, bodies.ACCOUNT_RULES)
        user = body.user or p.user
        lifetime = body.expires_in_s
        expires_at = None if lifetime is None else self.auth.clock.wall() + lifetime
        token, token_id = await self.auth.create_token(
            user, p.actor, label=body.name, expires_at=expires_at, role=body.role
        )
        return 201, TokenCreated(
            user=user,
            token_id=token_id,
            token=token,
            name=body.name,
            role=body.role,
            expires_at=expires_at,
        )

    async def revoke_token(self, call: Call) -> tuple[int, TokenGone]:
        """DELETE tokens/{id}: it stops working at once."""
        users, version = await self._decided()
        event = token_revoked(users, call.params["id"])
        await append_users(self.store, [event], self._who(call).actor, version)
        return 200, TokenGone(token_id=event.token_id, user=event.name, revoked=True)
