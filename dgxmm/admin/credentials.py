"""Passwords, API tokens, cookies, login backoff and account rules: pure, no I/O.

Passwords are scrypt hashes that carry their parameters (`scrypt$n$r$p$salt$hash`), so
stronger parameters apply to new hashes and old ones are rehashed at the next login
(`needs_rehash`).  API tokens are `dgxmm_<id>_<secret>`; the log keeps only a SHA-256 of
the secret (it has 256 random bits; a slow hash would add nothing).
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from events import model as m
from events.state import UserRecord

SCRYPT_N = 2**17  # OWASP's recommendation; older hashes are rehashed at the next login
SCRYPT_R = 8
SCRYPT_P = 1
SCRYPT_DKLEN = 32
SALT_BYTES = 16
MIN_PASSWORD_LENGTH = 8
SCRYPT_MAXMEM = 256 * 1024 * 1024
KNOWN_COOKIE = "dgxmm_known"
KNOWN_COOKIE_MAX_AGE_S = 400 * 24 * 3600  # browsers cap cookie lifetimes at 400 days
TOKEN_ROLES = ("metrics",)

_USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_TOKEN = re.compile(r"^dgxmm_([0-9a-f]{16})_([A-Za-z0-9_-]{20,128})$")


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
        password.encode(), salt=salt, n=n, r=r, p=p, dklen=SCRYPT_DKLEN, maxmem=SCRYPT_MAXMEM
    )
    return f"scrypt${n}${r}${p}${_b64(salt)}${_b64(derived)}"


def needs_rehash(encoded: str, n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P) -> bool:
    """Whether a (matching) hash was made with weaker parameters than the current ones."""
    try:
        _scheme, n_s, r_s, p_s, _salt, _hash = encoded.split("$")
        return int(n_s) < n or int(r_s) < r or int(p_s) < p
    except ValueError:
        return True


def name_digest(key: bytes, name: str) -> str:
    """What a failed login records of a name that is no user's: a keyed hash (16 hex)."""
    return hmac.new(key, name.strip().lower().encode(), hashlib.sha256).hexdigest()[:16]


def known_cookie_value(key: bytes, name: str) -> str:
    """The "known client" cookie for `name`: the name (base64url) and its HMAC."""
    mac = hmac.new(key, b"known:" + name.encode(), hashlib.sha256).digest()
    return f"{_b64(name.encode())}.{_b64(mac[:18])}"


def known_cookie_name(key: bytes, value: str) -> str | None:
    """The name a "known client" cookie vouches for, or None when it is not ours."""
    encoded, sep, _ = value.partition(".")
    if not sep or len(value) > 256:
        return None
    try:
        name = _unb64(encoded).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return name if hmac.compare_digest(value, known_cookie_value(key, name)) else None


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
            maxmem=SCRYPT_MAXMEM,
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


# --- throttling -------------------------------------------------------------------------------


def backoff_delay(failures: int, free: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait after `failures` failures in a row: 0 for the first `free`, then
    `base_s` doubling with each further failure, never more than `cap_s`."""
    if failures < free:
        return 0.0
    return min(cap_s, base_s * 2.0 ** min(failures - free, 64))


@dataclass
class _Strikes:
    count: int
    last: float


class Backoff:
    """Failures in a row per key, and how long the key must wait; bounded in keys.

    Nothing is ever locked: the wait after a failure doubles (up to `cap_s`), and a key
    with no failure for `forget_after_s` starts afresh.
    """

    def __init__(
        self, free: int, base_s: float, cap_s: float, forget_after_s: float,
        max_keys: int = 10_000,
    ) -> None:  # fmt: skip
        self.free = free
        self.base_s = base_s
        self.cap_s = cap_s
        self.forget_after_s = forget_after_s
        self.max_keys = max_keys
        self._strikes: collections.OrderedDict[str, _Strikes] = collections.OrderedDict()

    def retry_after(self, key: str, now: float) -> float | None:
        """Seconds until the key may try again, or None when it may now."""
        strikes = self._strikes.get(key)
        if strikes is None:
            return None
        if now - strikes.last >= self.forget_after_s:
            del self._strikes[key]
            return None
        wait = strikes.last + backoff_delay(strikes.count, self.free, self.base_s, self.cap_s)
        return wait - now if wait > now else None

    def failed(self, key: str, now: float) -> None:
        """Count a failure."""
        strikes = self._strikes.get(key)
        if strikes is None or now - strikes.last >= self.forget_after_s:
            self._strikes[key] = _Strikes(1, now)
            while len(self._strikes) > self.max_keys:
                self._strikes.popitem(last=False)
        else:
            strikes.count += 1
            strikes.last = now
        self._strikes.move_to_end(key)

    def failures(self, key: str) -> int:
        """Failures in a row counted for the key."""
        strikes = self._strikes.get(key)
        return 0 if strikes is None else strikes.count

    def forget(self, key: str) -> None:
        """Clear the key (a successful login)."""
        self._strikes.pop(key, None)


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


# --- account decisions (pure; the API and the CLI share them) --------------------------------


def check_password(password: str) -> None:
    """Raises AuthError(422) for a password too short (or absurdly long)."""
    if len(password) < MIN_PASSWORD_LENGTH:
        raise AuthError(
            422, "weak_password", f"password: at least {MIN_PASSWORD_LENGTH} characters"
        )
    if len(password) > 1024:
        raise AuthError(422, "invalid_password", "password: at most 1024 characters")


def token_created(
    users: Mapping[str, UserRecord], user: str, *, label: str, expires_at: float | None,
    role: str | None, now: float,
) -> tuple[str, m.ApiTokenCreated]:  # fmt: skip
    """A new token for `user` and the event that records it; raises AuthError 404/422."""
    if user not in users:
        raise AuthError(404, "user_not_found", f"no user {user}")
    if role is not None and role not in TOKEN_ROLES:
        raise AuthError(422, "invalid_role", 'role: "metrics" or null (the owner\'s role)')
    if len(label) > 64 or any(not ch.isprintable() for ch in label):
        raise AuthError(422, "invalid_field", "name: at most 64 printable characters")
    if expires_at is not None and expires_at <= now:
        raise AuthError(422, "invalid_field", "expires_at: a moment in the future")
    token, token_id, token_hash = new_api_token()
    event = m.ApiTokenCreated(
        name=user, token_id=token_id, token_hash=token_hash, label=label,
        expires_at=expires_at, role=role,  # type: ignore[arg-type]
    )  # fmt: skip
    return token, event
