"""Users, passwords, sessions, CSRF tokens and API tokens for the admin API.

Users live in the event log (stream `users`): `UserCreated` carries an scrypt hash, never a
password, and `ApiTokenCreated` only a SHA-256 hash of the token's secret.  Sessions are kept
in memory (a restart logs everybody out).  A cookie session must send its CSRF token in
`x-csrf-token` with every mutating call; a Bearer token needs none (browsers never attach
it on their own).  A failed login answers the same way, in about the same time, whether
the user exists or not.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import getpass
import hashlib
import hmac
import re
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from actors.runtime import Clock
from events import model as m
from events.state import EMPTY, SystemState, UserRecord, evolve
from storage.errors import StorageError
from storage.eventlog import EventStore

log = structlog.get_logger("dgxmm.admin.auth")

SESSION_COOKIE = "dgxmm_session"
CSRF_HEADER = b"x-csrf-token"
DEFAULT_DB = Path("dgxmm-data") / "dgxmm.db"
MIN_PASSWORD_LENGTH = 8
ROLES = ("admin", "viewer")

SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
SCRYPT_DKLEN = 32
SALT_BYTES = 16

_USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_TOKEN = re.compile(r"^dgxmm_([0-9a-f]{16})_([A-Za-z0-9_-]{20,128})$")
INVALID_LOGIN = "invalid name or password"


# --- passwords and tokens (pure) ------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_password(
    password: str, *, salt: bytes | None = None, n: int = SCRYPT_N, r: int = SCRYPT_R,
    p: int = SCRYPT_P,
) -> str:  # fmt: skip
    """`scrypt$n$r$p$salt$hash` (base64url): the parameters travel with the hash."""
    salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
    derived = hashlib.scrypt(
        password.encode(), salt=salt, n=n, r=r, p=p, dklen=SCRYPT_DKLEN, maxmem=64 * 1024 * 1024
    )
    return f"scrypt${n}${r}${p}${_b64(salt)}${_b64(derived)}"


def verify_password(password: str, encoded: str) -> bool:
    """Whether `password` matches `encoded`; a malformed hash never matches."""
    try:
        scheme, n_s, r_s, p_s, salt_s, hash_s = encoded.split("$")
        n, r, p = int(n_s), int(r_s), int(p_s)
        salt, expected = _unb64(salt_s), _unb64(hash_s)
    except ValueError:
        return False
    if scheme != "scrypt" or not (2 <= n <= 2**20 and 1 <= r <= 32 and 1 <= p <= 16):
        return False
    try:
        derived = hashlib.scrypt(
            password.encode(), salt=salt, n=n, r=r, p=p, dklen=len(expected) or 1,
            maxmem=256 * 1024 * 1024,
        )  # fmt: skip
    except (ValueError, MemoryError):
        return False
    return hmac.compare_digest(derived, expected)


def hash_token_secret(secret: str) -> str:
    """What the log keeps of an API token: `sha256$<hex>` (the secret has 256 random bits)."""
    return "sha256$" + hashlib.sha256(secret.encode()).hexdigest()


def new_api_token() -> tuple[str, str, str]:
    """(token as given to the user, token id, stored hash)."""
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    return f"dgxmm_{token_id}_{secret}", token_id, hash_token_secret(secret)


def parse_api_token(token: str) -> tuple[str, str] | None:
    """(token id, secret) of a well-formed token, else None."""
    found = _TOKEN.match(token)
    return None if found is None else (found.group(1), found.group(2))


def valid_user_name(name: str) -> bool:
    """Letters, digits and . _ @ - (1 to 64, starting with a letter or digit)."""
    return bool(_USER_NAME.match(name))


def parse_cookies(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The cookies of every `cookie` header; the first value of a name wins."""
    found: dict[str, str] = {}
    for name, value in headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, sep, val = part.strip().partition("=")
            if sep and key and key not in found:
                found[key] = val.strip().strip('"')
    return found


def fold_users(records: Iterable[m.Recorded]) -> dict[str, UserRecord]:
    """The users as the given records (of stream `users`, in order) leave them."""
    state: SystemState = EMPTY
    for rec in records:
        state = evolve(state, rec)
    return dict(state.users)


async def load_users(store: EventStore) -> dict[str, UserRecord]:
    """Every user the log knows."""
    return fold_users(await store.read(stream=m.STREAM_USERS))


# --- throttling -------------------------------------------------------------------------------


class Throttle:
    """At most `limit` failures per key within `window_s`; bounded in keys."""

    def __init__(self, limit: int, window_s: float, max_keys: int = 10_000) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_keys = max_keys
        self._failures: collections.OrderedDict[str, collections.deque[float]] = (
            collections.OrderedDict()
        )

    def retry_after(self, key: str, now: float) -> float | None:
        """Seconds until the key may try again, or None when it may now."""
        times = self._failures.get(key)
        if times is None:
            return None
        while times and now - times[0] >= self.window_s:
            times.popleft()
        if not times:
            del self._failures[key]
            return None
        if len(times) < self.limit:
            return None
        return max(0.0, times[0] + self.window_s - now)

    def failed(self, key: str, now: float) -> None:
        """Count a failure."""
        times = self._failures.get(key)
        if times is None:
            times = self._failures[key] = collections.deque(maxlen=self.limit)
            while len(self._failures) > self.max_keys:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(key)
        times.append(now)

    def forget(self, key: str) -> None:
        """Clear the key (a successful login)."""
        self._failures.pop(key, None)


# --- sessions and principals -----------------------------------------------------------------


class AuthError(Exception):
    """Authentication or authorisation failed; `status` and `code` are the API's answer."""

    def __init__(
        self, status: int, code: str, message: str, *, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


@dataclass
class Session:
    """A logged-in browser: the cookie's token and its CSRF token."""

    token: str
    csrf: str
    user: str
    created: float
    last_seen: float


@dataclass(frozen=True)
class Principal:
    """Who is calling, and how."""

    user: str
    role: str
    via: str  # "session" | "token"
    session: Session | None = None
    token_id: str | None = None

    @property
    def is_admin(self) -> bool:
        """Whether the caller may change things."""
        return self.role == "admin"

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
    name_failures: int = 5  # per user name ...
    ip_failures: int = 30  # ... and per client address ...
    failure_window_s: float = 300.0  # ... within this window
    refresh_every_s: float = 2.0  # unknown API tokens re-read the log at most this often


class SystemView(Protocol):
    """What Auth reads of the controller: the folded state, whose `users` it trusts first."""

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
    ) -> None:
        self.controller = controller
        self.store = store
        self.clock = clock
        self.config = config or AuthConfig()
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        # The users stream as the file has it, read on a miss: users that another process
        # (`dgxmm user add` while serving) wrote are in the file but not in the controller.
        self._file_state: SystemState = EMPTY
        self._file_seq = 0
        self._lock = asyncio.Lock()
        self._last_refresh: float | None = None
        self._dummy_hash = hash_password(secrets.token_urlsafe(16))
        c = self.config
        self._by_name = Throttle(c.name_failures, c.failure_window_s)
        self._by_ip = Throttle(c.ip_failures, c.failure_window_s)
        self.stats = {"logins": 0, "login_failures": 0, "throttled": 0, "token_auths": 0}

    # --- users --------------------------------------------------------------------------

    async def _refresh(self, *, force: bool) -> None:
        """Fold the user records the file got since the last read (at most so often)."""
        async with self._lock:
            now = self.clock.now()
            last = self._last_refresh
            if not force and last is not None and now - last < self.config.refresh_every_s:
                return
            self._last_refresh = now
            state = self._file_state
            async for rec in self.store.iterate(stream=m.STREAM_USERS, since_seq=self._file_seq):
                state = evolve(state, rec)
                self._file_seq = rec.seq
            self._file_state = state

    async def user(self, name: str, *, fresh: bool = False) -> UserRecord | None:
        """A user by name: the controller's view, else the file (re-read, rate-limited)."""
        found = self.controller.system.users.get(name)
        if found is None:
            await self._refresh(force=fresh)
            found = self._file_state.users.get(name)
        return found

    async def users(self) -> dict[str, UserRecord]:
        """Every user."""
        await self._refresh(force=True)
        return {**self._file_state.users, **self.controller.system.users}

    async def add_user(self, name: str, role: str, password: str, actor: str) -> None:
        """Record a new user; raises AuthError(422/409) for a bad name, role or duplicate."""
        if not valid_user_name(name):
            raise AuthError(422, "invalid_name", "name: letters, digits and . _ @ - (1 to 64)")
        if role not in ROLES:
            raise AuthError(422, "invalid_role", 'role: "admin" or "viewer"')
        if len(password) < MIN_PASSWORD_LENGTH:
            raise AuthError(
                422, "weak_password", f"password: at least {MIN_PASSWORD_LENGTH} characters"
            )
        if name in await self.users():
            raise AuthError(409, "user_exists", f"user {name} exists")
        encoded = await asyncio.to_thread(hash_password, password)
        event = m.UserCreated(name=name, role=role, password_hash=encoded)  # type: ignore[arg-type]
        await self.store.append(m.STREAM_USERS, [event], actor=actor)

    async def create_token(self, user: str, actor: str) -> tuple[str, str]:
        """Issue an API token for `user`: (token, token id); only its hash is recorded."""
        if user not in await self.users():
            raise AuthError(404, "user_not_found", f"no user {user}")
        token, token_id, token_hash = new_api_token()
        event = m.ApiTokenCreated(name=user, token_id=token_id, token_hash=token_hash)
        await self.store.append(m.STREAM_USERS, [event], actor=actor)
        return token, token_id

    # --- logging in and out -------------------------------------------------------------

    async def login(self, name: str, password: str, client_ip: str | None) -> Session:
        """Check the password and open a session; raises AuthError 401 or 429."""
        now = self.clock.now()
        keys = [("name", self._by_name, f"name:{name.lower()}")]
        if client_ip:
            keys.append(("ip", self._by_ip, f"ip:{client_ip}"))
        for _what, throttle, key in keys:
            wait = throttle.retry_after(key, now)
            if wait is not None:
                self.stats["throttled"] += 1
                raise AuthError(
                    429,
                    "too_many_attempts",
                    "too many failed logins; try again later",
                    retry_after=max(1.0, wait),
                )
        # A miss re-reads the file without a rate limit: logins are throttled and cost an
        # scrypt each, next to which this indexed read is nothing.
        user = await self.user(name, fresh=True)
        # An unknown name is checked against a dummy hash, so timing does not tell.
        encoded = user.password_hash if user is not None else self._dummy_hash
        matched = await asyncio.to_thread(verify_password, password, encoded)
        if user is None or not matched:
            for _what, throttle, key in keys:
                throttle.failed(key, now)
            self.stats["login_failures"] += 1
            await self._record(m.LoginFailed(name=name[:128]), "system")
            raise AuthError(401, "invalid_credentials", INVALID_LOGIN)
        self._by_name.forget(keys[0][2])
        self.stats["logins"] += 1
        await self._record(m.UserLoggedIn(name=name), f"admin:{name}")
        return self._open_session(name)

    async def _record(self, event: m.AnyEvent, actor: str) -> None:
        try:
            await self.store.append(m.STREAM_USERS, [event], actor=actor)
        except StorageError as exc:  # policy: a login is not refused because its audit failed
            log.error("login_record_failed", error=str(exc))

    def _open_session(self, user: str) -> Session:
        now = self.clock.now()
        self._expire(now)
        while len(self._sessions) >= self.config.max_sessions:
            self._sessions.popitem(last=False)  # the least recently used goes
        session = Session(
            token=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            user=user,
            created=now,
            last_seen=now,
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
        if user is None:
            del self._sessions[token]
            raise AuthError(401, "session_expired", "the session's user no longer exists")
        session.last_seen = now
        self._sessions.move_to_end(token)
        return Principal(user=user.name, role=user.role, via="session", session=session)

    async def _token_principal(self, token: str) -> Principal:
        parsed = parse_api_token(token)
        if parsed is None:
            raise AuthError(401, "invalid_token", "the API token is not valid")
        token_id, secret = parsed
        owner = self._token_owner(self.controller.system.users, token_id)
        if owner is None:
            await self._refresh(force=False)
            owner = self._token_owner(self._file_state.users, token_id)
        computed = hash_token_secret(secret)
        expected = owner.tokens[token_id] if owner is not None else hash_token_secret("")
        if not hmac.compare_digest(computed, expected) or owner is None:
            raise AuthError(401, "invalid_token", "the API token is not valid")
        self.stats["token_auths"] += 1
        return Principal(user=owner.name, role=owner.role, via="token", token_id=token_id)

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
    if not args.db:
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
