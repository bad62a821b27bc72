"""Users, passwords, sessions, CSRF tokens and API tokens for the admin API.

Users live in the event log (stream `users`): `UserCreated` carries an scrypt hash, never a
password, and `ApiTokenCreated` only a SHA-256 hash of the token's secret.  Sessions are kept
in memory (a restart logs everybody out).  A cookie session must send its CSRF token in
`x-csrf-token` with every mutating call; a Bearer token needs none (browsers never attach
it on their own).  A failed login answers the same way, in about the same time, whether
the user exists or not.

A session lasts while its user exists with the password it logged in with: removing the
user, or resetting the password, ends it at once.  Every authenticated call first folds
what the log's `users` stream got since the last call (one indexed read), so a change
written by another process (`dgxmm user remove`, `dgxmm token revoke`) applies at the
next request, not after a polling delay.

Failed logins slow the next attempt down exponentially, per name and per client address
(`Backoff`), without locking anyone out: a browser that logged in as a name before
carries a signed "known client" cookie, and the right password from it always passes.
A failure is recorded by the client's address (`client:ADDRESS`), with the name tried when it
is a user's.  docs/security.md states the policy.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import getpass
import hmac
import secrets
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from actors.runtime import Clock
from dgxmm.admin.credentials import (
    KNOWN_COOKIE as KNOWN_COOKIE,
)
from dgxmm.admin.credentials import (
    KNOWN_COOKIE_MAX_AGE_S as KNOWN_COOKIE_MAX_AGE_S,
)
from dgxmm.admin.credentials import (
    MIN_PASSWORD_LENGTH as MIN_PASSWORD_LENGTH,
)
from dgxmm.admin.credentials import (
    SALT_BYTES as SALT_BYTES,
)
from dgxmm.admin.credentials import (
    SCRYPT_DKLEN as SCRYPT_DKLEN,
)
from dgxmm.admin.credentials import (
    SCRYPT_MAXMEM as SCRYPT_MAXMEM,
)
from dgxmm.admin.credentials import (
    SCRYPT_N as SCRYPT_N,
)
from dgxmm.admin.credentials import (
    SCRYPT_P as SCRYPT_P,
)
from dgxmm.admin.credentials import (
    SCRYPT_R as SCRYPT_R,
)
from dgxmm.admin.credentials import (
    TOKEN_ROLES as TOKEN_ROLES,
)
from dgxmm.admin.credentials import (
    AuthError as AuthError,
)
from dgxmm.admin.credentials import (
    Backoff as Backoff,
)
from dgxmm.admin.credentials import (
    backoff_delay as backoff_delay,
)
from dgxmm.admin.credentials import (
    check_password as check_password,
)
from dgxmm.admin.credentials import (
    hash_password as hash_password,
)
from dgxmm.admin.credentials import (
    hash_token_secret as hash_token_secret,
)
from dgxmm.admin.credentials import (
    known_cookie_name as known_cookie_name,
)
from dgxmm.admin.credentials import (
    known_cookie_value as known_cookie_value,
)
from dgxmm.admin.credentials import (
    name_digest as name_digest,
)
from dgxmm.admin.credentials import (
    needs_rehash as needs_rehash,
)
from dgxmm.admin.credentials import (
    new_api_token as new_api_token,
)
from dgxmm.admin.credentials import (
    parse_api_token as parse_api_token,
)
from dgxmm.admin.credentials import (
    parse_cookies as parse_cookies,
)
from dgxmm.admin.credentials import (
    token_created as token_created,
)
from dgxmm.admin.credentials import (
    valid_user_name as valid_user_name,
)
from dgxmm.admin.credentials import (
    verify_password as verify_password,
)
from events import model as m
from events.state import EMPTY, SystemState, UserRecord, evolve
from storage.errors import StorageError
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.admin.auth")

SESSION_COOKIE = "dgxmm_session"
CSRF_HEADER = b"x-csrf-token"
DEFAULT_DB = Path("dgxmm-data") / "dgxmm.db"
ROLES = ("admin", "viewer")
INVALID_LOGIN = "invalid name or password"
LOCAL_USER = "local"  # the CLI on the box, through the token file of the running server


def fold_users(records: Iterable[m.Recorded]) -> dict[str, UserRecord]:
    """The users as the given records (of stream `users`, in order) leave them."""
    state: SystemState = EMPTY
    for rec in records:
        state = evolve(state, rec)
    return dict(state.users)


async def load_users(store: EventStore) -> dict[str, UserRecord]:
    """Every user the log knows."""
    return fold_users(await store.read(stream=m.STREAM_USERS))


def failed_login_actor(client_ip: str | None) -> str:
    """Who a failed login is recorded as: the client's address ("client:127.0.0.1"), since
    nobody logged in; the event names the account tried (`LoginFailed`)."""
    return f"client:{client_ip}" if client_ip else "client"


# --- sessions and principals -----------------------------------------------------------------


@dataclass
class Session:
    """A logged-in browser: the cookie's token and its CSRF token."""

    token: str
    csrf: str
    user: str
    created: float
    last_seen: float
    password_hash: str = ""  # the user's hash at login: a reset or a removal ends the session


@dataclass(frozen=True)
class Principal:
    """Who is calling, and how."""

    user: str
    role: str  # "admin" | "viewer" | "metrics" (a scrape token)
    via: str  # "session" | "token"
    session: Session | None = None
    token_id: str | None = None

    @property
    def is_admin(self) -> bool:
        """Whether the caller may change things."""
        return self.role == "admin"

    @property
    def is_metrics_only(self) -> bool:
        """A scrape token: it reads `/metrics` and nothing else."""
        return self.role == "metrics"

    @property
    def actor(self) -> str:
        """The actor recorded with the caller's changes."""
        return f"admin:{self.user}"


@dataclass(frozen=True)
class AuthConfig:
    """Session and throttling limits."""

    session_idle_s: float = 8 * 3600.0
    session_max_age_s: float = 7 * 24 * 3600.0
    max_sessions: int = 1000
    secure_cookie: bool = False  # set when DGXMM is reached over HTTPS only
    # Failed logins: free attempts, then a wait that doubles from 1 s up to the cap ...
    name_free_failures: int = 3  # ... per user name
    name_max_delay_s: float = 900.0
    ip_free_failures: int = 10  # ... and per client address (everyone behind a proxy)
    ip_max_delay_s: float = 60.0
    base_delay_s: float = 1.0
    forget_failures_after_s: float = 6 * 3600.0
    token_used_every_s: float = 300.0  # how often a token's last use is written to the log
    scrypt_n: int = SCRYPT_N  # for new hashes; a login rehashes a weaker one


class SystemView(Protocol):
    """What Auth reads of the controller: the folded state (kept for the wiring's sake)."""

    @property
    def system(self) -> SystemState:
        """The state folded from the log (kept current by the controller)."""
        ...


class Auth:
    """Who may call the admin API."""

    def __init__(
        self,
        controller: SystemView,
        store: EventStore,
        clock: Clock,
        config: AuthConfig | None = None,
        *,
        secret: bytes | None = None,
    ) -> None:
        self.controller = controller
        self.store = store
        self.clock = clock
        self.config = config or AuthConfig()
        # Signs "known client" cookies and keys the hashes of failed names; app.py keeps it
        # in the data directory so that both survive a restart.
        self.secret = secret or secrets.token_bytes(32)
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        # The users stream as the file has it: the truth, including what another process
        # (`dgxmm user remove` while serving) wrote.
        self._file_state: SystemState = EMPTY
        self._file_seq = 0
        self._lock = asyncio.Lock()
        # The running server's own CLI token (`dgxmm ps` and friends), kept in memory only.
        self.local_token: str | None = None
        self._dummy_hash = hash_password(secrets.token_urlsafe(16), n=self.config.scrypt_n)
        c = self.config
        self._by_name = Backoff(
            c.name_free_failures, c.base_delay_s, c.name_max_delay_s, c.forget_failures_after_s
        )
        self._by_ip = Backoff(
            c.ip_free_failures, c.base_delay_s, c.ip_max_delay_s, c.forget_failures_after_s
        )
        self._token_used: dict[str, float] = {}  # token id -> last use (wall), in memory
        self._token_written: dict[str, float] = {}  # token id -> last use written to the log
        self.on_session_end: list[Callable[[str], None]] = []  # e.g. close its event streams
        self.stats = {"logins": 0, "login_failures": 0, "throttled": 0, "token_auths": 0}

    # --- users --------------------------------------------------------------------------

    async def _refresh(self) -> None:
        """Fold the user records the file got since the last read."""
        async with self._lock:
            state = self._file_state
            async for rec in self.store.iterate(stream=m.STREAM_USERS, since_seq=self._file_seq):
                state = evolve(state, rec)
                self._file_seq = rec.seq
            self._file_state = state

    async def user(self, name: str, *, fresh: bool = True) -> UserRecord | None:
        """A user by name, as the log has it now (always fresh; `fresh` is kept for callers)."""
        await self._refresh()
        return self._file_state.users.get(name)

    async def users(self) -> dict[str, UserRecord]:
        """Every user, as the log has it now."""
        await self._refresh()
        return dict(self._file_state.users)

    async def add_user(self, name: str, role: str, password: str, actor: str) -> None:
        """Record a new user; raises AuthError(422/409) for a bad name, role or duplicate."""
        if not valid_user_name(name):
            raise AuthError(422, "invalid_name", "name: letters, digits and . _ @ - (1 to 64)")
        if role not in ROLES:
            raise AuthError(422, "invalid_role", 'role: "admin" or "viewer"')
        check_password(password)
        if name in await self.users():
            raise AuthError(409, "user_exists", f"user {name} exists")
        encoded = await self.hash(password)
        event = m.UserCreated(name=name, role=role, password_hash=encoded)  # type: ignore[arg-type]
        await self.store.append(m.STREAM_USERS, [event], actor=actor)

    async def hash(self, password: str) -> str:
        """The password's hash with the configured parameters (in a thread: it is slow)."""
        return await asyncio.to_thread(hash_password, password, n=self.config.scrypt_n)

    async def create_token(
        self, user: str, actor: str, *, label: str = "", expires_at: float | None = None,
        role: str | None = None,
    ) -> tuple[str, str]:  # fmt: skip
        """Issue an API token for `user`: (token, token id); only its hash is recorded."""
        token, event = token_created(
            await self.users(), user, label=label, expires_at=expires_at, role=role,
            now=self.clock.wall(),
        )  # fmt: skip
        await self.store.append(m.STREAM_USERS, [event], actor=actor)
        return token, event.token_id

    def end_sessions(self, user: str, *, keep: Session | None = None) -> int:
        """End every session of `user` (but `keep`); returns how many ended."""
        ended = [t for t, s in self._sessions.items() if s.user == user and s is not keep]
        for token in ended:
            self._end(token)
        return len(ended)

    def _end(self, token: str) -> None:
        self._sessions.pop(token, None)
        for listener in self.on_session_end:
            try:
                listener(token)
            except Exception:  # policy: a broken listener must not keep a session alive
                log.exception("session_end_listener_failed")

    # --- logging in and out -------------------------------------------------------------

    def known_client(self, headers: Iterable[tuple[bytes, bytes]], name: str) -> bool:
        """Whether the request carries a "known client" cookie for `name`."""
        value = parse_cookies(headers).get(KNOWN_COOKIE)
        return value is not None and known_cookie_name(self.secret, value) == name

    def known_cookie(self, name: str) -> bytes:
        """The Set-Cookie value that marks this browser as a known client of `name`."""
        secure = "; Secure" if self.config.secure_cookie else ""
        value = known_cookie_value(self.secret, name)
        return (
            f"{KNOWN_COOKIE}={value}; HttpOnly; SameSite=Strict; Path=/; "
            f"Max-Age={KNOWN_COOKIE_MAX_AGE_S}{secure}"
        ).encode()

    async def login(
        self, name: str, password: str, client_ip: str | None, *, known: bool = False
    ) -> Session:
        """Check the password and open a session; raises AuthError 401 or 429.

        `known`: the client showed a "known client" cookie for `name`; its right password
        passes whatever the backoff says (a wrong one still counts).
        """
        now = self.clock.now()
        keys = [(self._by_name, f"name:{name.strip().lower()}")]
        if client_ip:
            keys.append((self._by_ip, f"ip:{client_ip}"))
        waits = [w for b, k in keys if (w := b.retry_after(k, now)) is not None]
        if waits and not known:
            self.stats["throttled"] += 1
            raise AuthError(
                429,
                "too_many_attempts",
                "too many failed logins; wait a little and try again",
                retry_after=max(1.0, max(waits)),
            )
        user = await self.user(name)
        # An unknown name is checked against a dummy hash, so timing does not tell.
        encoded = user.password_hash if user is not None else self._dummy_hash
        matched = await asyncio.to_thread(verify_password, password, encoded)
        if user is None or not matched:
            for backoff, key in keys:
                backoff.failed(key, now)
            self.stats["login_failures"] += 1
            failed = m.LoginFailed(
                name=user.name if user is not None else "",
                name_hash=name_digest(self.secret, name),
            )
            await self._record(failed, failed_login_actor(client_ip))
            raise AuthError(401, "invalid_credentials", INVALID_LOGIN)
        if not waits:  # a known client let through an attack does not reset its backoff
            self._by_name.forget(keys[0][1])
        self.stats["logins"] += 1
        await self._record(m.UserLoggedIn(name=user.name), f"admin:{user.name}")
        if needs_rehash(user.password_hash, n=self.config.scrypt_n):
            rehashed = await self.hash(password)
            event = m.PasswordChanged(name=user.name, password_hash=rehashed, reason="rehash")
            await self._record(event, "system")
            user = await self.user(name) or user
        return self._open_session(user)

    async def _record(self, event: m.AnyEvent, actor: str) -> None:
        try:
            await self.store.append(m.STREAM_USERS, [event], actor=actor)
        except StorageError as exc:  # policy: a login is not refused because its audit failed
            log.error("login_record_failed", error=str(exc))

    def _open_session(self, user: UserRecord) -> Session:
        now = self.clock.now()
        self._expire(now)
        while len(self._sessions) >= self.config.max_sessions:
            self._sessions.popitem(last=False)  # the least recently used goes
        session = Session(
            token=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            user=user.name,
            created=now,
            last_seen=now,
            password_hash=user.password_hash,
        )
        self._sessions[session.token] = session
        return session

    def _expire(self, now: float) -> None:
        stale = [t for t, s in self._sessions.items() if not self._alive(s, now)]
        for token in stale:
            del self._sessions[token]

    def _alive(self, session: Session, now: float) -> bool:
        c = self.config
        return now - session.last_seen < c.session_idle_s and now - session.created < (
            c.session_max_age_s
        )

    def logout(self, session: Session) -> None:
        """End the session."""
        self._sessions.pop(session.token, None)

    def session_count(self) -> int:
        """Sessions currently open."""
        return len(self._sessions)

    def session_cookie(self, session: Session) -> bytes:
        """The Set-Cookie value that carries the session."""
        secure = "; Secure" if self.config.secure_cookie else ""
        return (
            f"{SESSION_COOKIE}={session.token}; HttpOnly; SameSite=Strict; Path=/{secure}"
        ).encode()

    def clear_cookie(self) -> bytes:
        """The Set-Cookie value that removes the session cookie."""
        secure = "; Secure" if self.config.secure_cookie else ""
        return f"{SESSION_COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0{secure}".encode()

    # --- each request -------------------------------------------------------------------

    async def authenticate(self, headers: Sequence[tuple[bytes, bytes]]) -> Principal:
        """Who sent these headers; raises AuthError(401)."""
        authorization = next((v for n, v in headers if n == b"authorization"), None)
        if authorization is not None:
            scheme, _, credentials = authorization.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                raise AuthError(401, "unauthenticated", "only Bearer API tokens are accepted")
            return await self._token_principal(credentials.strip())
        token = parse_cookies(headers).get(SESSION_COOKIE)
        if not token:
            raise AuthError(401, "unauthenticated", "log in, or send an API token")
        now = self.clock.now()
        session = self._sessions.get(token)
        if session is None or not self._alive(session, now):
            if session is not None:
                del self._sessions[token]
            raise AuthError(401, "session_expired", "the session has ended; log in again")
        user = await self.user(session.user)
        if user is None or not hmac.compare_digest(user.password_hash, session.password_hash):
            self._end(token)
            why = "no longer exists" if user is None else "has a new password"
            raise AuthError(401, "session_expired", f"the session's user {why}; log in again")
        session.last_seen = now
        self._sessions.move_to_end(token)
        return Principal(user=user.name, role=user.role, via="session", session=session)

    async def _token_principal(self, token: str) -> Principal:
        local = self.local_token
        if local is not None and hmac.compare_digest(token.encode(), local.encode()):
            self.stats["token_auths"] += 1
            return Principal(user=LOCAL_USER, role="admin", via="token", token_id="local")
        parsed = parse_api_token(token)
        if parsed is None:
            raise AuthError(401, "invalid_token", "the API token is not valid")
        token_id, secret = parsed
        await self._refresh()
        owner = self._token_owner(self._file_state.users, token_id)
        computed = hash_token_secret(secret)
        expected = owner.tokens[token_id] if owner is not None else hash_token_secret("")
        if not hmac.compare_digest(computed, expected) or owner is None:
            raise AuthError(401, "invalid_token", "the API token is not valid")
        info = owner.token_info.get(token_id)
        wall = self.clock.wall()
        if info is not None and info.expires_at is not None and wall >= info.expires_at:
            raise AuthError(401, "token_expired", "the API token has expired")
        self.stats["token_auths"] += 1
        await self._token_used_now(owner.name, token_id, wall)
        role = info.role if info is not None and info.role is not None else owner.role
        return Principal(user=owner.name, role=role, via="token", token_id=token_id)

    async def _token_used_now(self, owner: str, token_id: str, wall: float) -> None:
        """Remember the use; write it to the log at most every `token_used_every_s`."""
        self._token_used[token_id] = wall
        last = self._token_written.get(token_id)
        if last is not None and wall - last < self.config.token_used_every_s:
            return
        self._token_written[token_id] = wall
        await self._record(m.ApiTokenUsed(name=owner, token_id=token_id, at=wall), "system")

    def token_uses(self) -> dict[str, float]:
        """When each token was last used by this process (more recent than the log's)."""
        return dict(self._token_used)

    async def check_password_of(self, name: str, password: str) -> bool:
        """Whether `password` is `name`'s (for a change of one's own password)."""
        user = await self.user(name)
        encoded = user.password_hash if user is not None else self._dummy_hash
        matched = await asyncio.to_thread(verify_password, password, encoded)
        return user is not None and matched

    @staticmethod
    def _token_owner(users: Mapping[str, UserRecord], token_id: str) -> UserRecord | None:
        return next((u for u in users.values() if token_id in u.tokens), None)

    def check_csrf(self, principal: Principal, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """A cookie session's mutating call must carry its CSRF token; raises AuthError(403)."""
        if principal.session is None:
            return
        sent = next((v for n, v in headers if n == CSRF_HEADER), b"")
        if not hmac.compare_digest(sent, principal.session.csrf.encode()):
            raise AuthError(
                403, "csrf_failed", "missing or wrong CSRF token (send it in x-csrf-token)"
            )


# --- bootstrapping and the CLI ---------------------------------------------------------------


async def ensure_admin(store: EventStore, clock: Clock | None = None) -> str | None:
    """With no user in the log, create `admin` with a random password and return it."""
    if await load_users(store):
        return None
    password = secrets.token_urlsafe(12)
    encoded = await asyncio.to_thread(hash_password, password)
    await store.append(
        m.STREAM_USERS,
        [m.UserCreated(name="admin", role="admin", password_hash=encoded)],
        actor="system",
    )
    return password


class _Usage(Exception):
    """A problem with the command line or its input (exit 2)."""


def _read_password(from_stdin: bool, name: str) -> str:
    if from_stdin:
        line = sys.stdin.readline()
        password = line[:-1] if line.endswith("\n") else line
        password = password[:-1] if password.endswith("\r") else password
    elif sys.stdin.isatty():
        password = getpass.getpass(f"Password for {name}: ")
        if getpass.getpass("Repeat it: ") != password:
            raise _Usage("the passwords differ")
    else:
        raise _Usage("standard input is not a terminal; pipe the password with --password-stdin")
    if len(password) < MIN_PASSWORD_LENGTH:
        raise _Usage(f"the password needs at least {MIN_PASSWORD_LENGTH} characters")
    return password


def _error(message: str) -> None:
    sys.stderr.write(f"dgxmm: {message}\n")
    sys.stderr.flush()


async def add_user_main(args: argparse.Namespace) -> int:
    """`dgxmm user add NAME --role admin|viewer [--password-stdin] [--db FILE]`."""
    name: str = args.name
    role: str = args.role
    if not valid_user_name(name):
        _error(f"user add: {name!r} is not a valid name (letters, digits and . _ @ -)")
        return 2
    if role not in ROLES:
        _error(f"user add: role must be admin or viewer, not {role!r}")
        return 2
    try:
        password = _read_password(bool(args.password_stdin), name)
    except _Usage as exc:
        _error(f"user add: {exc}")
        return 2
    except (EOFError, KeyboardInterrupt):
        _error("user add: no password given")
        return 2
    db = Path(args.db) if args.db else DEFAULT_DB
    if not args.db or getattr(args, "db_from_config", False):
        await asyncio.to_thread(db.parent.mkdir, parents=True, exist_ok=True)
    try:
        store = await EventStore.open(db)
    except StorageError as exc:
        _error(str(exc))
        return 2
    try:
        if name in await load_users(store):
            _error(f"user add: user {name} exists in {db}")
            return 1
        encoded = await asyncio.to_thread(hash_password, password)
        event = m.UserCreated(name=name, role=role, password_hash=encoded)  # type: ignore[arg-type]
        await store.append(m.STREAM_USERS, [event], actor="system")
    except StorageError as exc:
        _error(str(exc))
        return 2
    finally:
        await store.close()
    sys.stdout.write(f"added {role} {name} to {db}\n")
    return 0
