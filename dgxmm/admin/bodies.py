"""The admin API's request bodies as msgspec Structs, and the one place their errors become 422s.

Decoding validates types, ranges and unknown fields; `decode` turns msgspec's validation error
into the API's answer naming the field: `missing_field` ("name: required"), `unknown_field`
("colour: unknown field"), or the field's own code and hint from `RULES` ("memory_gib: a
number of GiB greater than 0").  Rules that span fields or need the system (the
engine args, memory against the budget) stay with the controller.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from dgxmm.admin.errors import ApiError

T = TypeVar("T")

NonEmpty = Annotated[str, msgspec.Meta(pattern=r"\S")]
Gib = Annotated[float, msgspec.Meta(gt=0, le=1 << 20)]
Arg = Annotated[str, msgspec.Meta(max_length=4096)]
IdleTimeout = Annotated[float, msgspec.Meta(ge=60, le=86400)]
MakeRoomAfter = Annotated[float, msgspec.Meta(ge=0, le=86400)]
Mode = Literal["on_demand", "always_on"]
Role = Literal["model", "decision"]
Policy = Literal["seed", "learned"]  # ondemand_policy (`actors.anticipation`); null: the default

# field -> (code, hint) for a value of the wrong type or out of range.
RULES: dict[str, tuple[str, str]] = {
    "name": ("invalid_field", "a non-empty string"),
    "engine": ("invalid_field", "a non-empty string"),
    "model": ("invalid_field", "a non-empty string"),
    "user": ("invalid_field", "a non-empty string"),
    "memory_gib": ("invalid_field", "a number of GiB greater than 0"),
    "mode": ("invalid_mode", '"on_demand" or "always_on"'),
    "role": ("invalid_role", '"model" or "decision"'),
    "args": ("invalid_field", "a list of strings"),
    "image": ("invalid_field", "a non-empty string or null"),
    "gpu": ("invalid_field", "true or false"),
    "idle_timeout_s": ("invalid_idle_timeout", "null or 60 to 86400 seconds"),
    "make_room_after_s": ("invalid_make_room_after", "null or 0 to 86400 seconds"),
    "ondemand_policy": ("invalid_policy", '"seed", "learned" or null (the DGXMM default)'),
}
# Login answers one way whatever is wrong with a field: it is required.
LOGIN_RULES: dict[str, tuple[str, str]] = {
    "name": ("missing_field", "required"),
    "password": ("missing_field", "required"),
}


class DeploymentBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /deployments`."""

    name: NonEmpty
    engine: NonEmpty
    model: NonEmpty
    memory_gib: Gib
    mode: Mode = "always_on"
    idle_timeout_s: IdleTimeout | None = None
    role: Role = "model"
    args: Annotated[list[Arg], msgspec.Meta(max_length=256)] = msgspec.field(default_factory=list)
    image: NonEmpty | None = None
    gpu: bool = False
    make_room_after_s: MakeRoomAfter | None = None
    ondemand_policy: Policy | None = None  # None: follows the DGXMM default


class ModeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`PATCH /deployments/{id}/mode`: an omitted idle timeout, make-room-after or policy
    keeps the current one."""

    mode: Mode
    idle_timeout_s: float | msgspec.UnsetType | None = msgspec.UNSET
    make_room_after_s: float | msgspec.UnsetType | None = msgspec.UNSET  # omitted: kept
    ondemand_policy: Policy | msgspec.UnsetType | None = msgspec.UNSET  # null: the default


class SwitchModelBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /deployments/{id}/switch-model`."""

    model: NonEmpty
    memory_gib: Gib | None = None


class LoginBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /login`."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    password: str


class TokenBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /tokens`: for whom (default: the caller), what for, how long, which access."""

    user: NonEmpty | None = None
    name: Annotated[str, msgspec.Meta(max_length=64)] = ""
    expires_in_s: Annotated[float, msgspec.Meta(ge=60, le=10 * 366 * 86400)] | None = None
    role: Literal["metrics"] | None = None  # None: the owner's role


UserRole = Literal["admin", "viewer"]
Password = Annotated[str, msgspec.Meta(max_length=1024)]
# The accounts routes: "role" is a user's (or a token's) role there.
ACCOUNT_RULES: dict[str, tuple[str, str]] = {
    **RULES,
    "role": ("invalid_role", '"admin" or "viewer" ("metrics" or null for a token)'),
    "password": ("invalid_field", "a string of at most 1024 characters"),
    "current": ("invalid_field", "a string"),
    "name": ("invalid_field", "a string (at most 64 characters for a token)"),
    "expires_in_s": ("invalid_field", "seconds from 60 to 10 years, or null"),
}


class UserBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /users`."""

    name: NonEmpty
    role: UserRole = "viewer"
    password: Password


class UserChangeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`PATCH /users/{name}`: a new role, a password reset, or both."""

    role: UserRole | None = None
    password: Password | None = None


class PasswordBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /session/password`: one's own password."""

    current: Password
    password: Password


_MISSING = re.compile(r"Object missing required field `([^`]*)`")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
_AT_FIELD = re.compile(r" - at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_encoder = msgspec.json.Encoder()


def decode(body: Any, kind: type[T], rules: dict[str, tuple[str, str]] = RULES) -> T:
    """The decoded JSON `body` as `kind`; ApiError 422 naming the field at fault."""
    try:
        return msgspec.convert({} if body is None else body, kind)
    except msgspec.ValidationError as exc:
        raise invalid(str(exc), body, rules) from None


def invalid(message: str, body: Any, rules: dict[str, tuple[str, str]]) -> ApiError:
    """msgspec's validation message as the API's 422."""
    if found := _MISSING.match(message):
        name = found[1]
        return ApiError(422, "missing_field", f"{name}: required", param=name)
    if found := _UNKNOWN.match(message):
        name = found[1]
        return ApiError(422, "unknown_field", f"{name}: unknown field", param=name)
    if found := _AT_FIELD.search(message):
        name = found[1]
        code, hint = rules.get(name, ("invalid_field", "invalid value"))
        text = f"{name}: {hint}"
        if code == "invalid_mode" and isinstance(body, dict):
            text += f", not {_encoder.encode(body.get(name)).decode()[:40]}"
        return ApiError(422, code, text, param=name)
    return ApiError(422, "invalid_body", "the body must be a JSON object")


def idle_timeout(value: float | None) -> int | None:
    """An idle timeout: null, or whole seconds from 60 to 86400; else ApiError 422.

    Checked here as well as by the Struct: msgspec drops the range of a constrained float in
    a union with `UnsetType` (seen with msgspec 0.23 in `ModeBody`).
    """
    return _seconds(value, 60, "idle_timeout_s")


def make_room_after(value: float | None) -> int | None:
    """`make_room_after_s`: null (the DGXMM default), or whole seconds from 0 to 86400."""
    return _seconds(value, 0, "make_room_after_s")


def _seconds(value: float | None, lo: int, field: str) -> int | None:
    if value is None:
        return None
    if not float(value).is_integer() or not lo <= value <= 86400:
        code, hint = RULES[field]
        raise ApiError(422, code, f"{field}: {hint}", param=field)
    return int(value)
