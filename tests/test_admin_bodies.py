"""The admin API's bodies: msgspec Structs, and their errors as 422s naming the field; JSON
nested too deeply is a 400 naming the limit on every route that takes a body."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from dgxmm.admin import bodies
from dgxmm.admin.errors import ApiError
from dgxmm.admin.guards import MAX_JSON_DEPTH
from dgxmm.admin.routes import ROUTES, SAFE_METHODS
from tests.api_support import Box, error_of, run_box

API = "/dgxmm/api"

SPEC = {"name": "chat", "engine": "sim", "model": "m", "memory_gib": 8}


def refusal(
    body: Any, kind: type[Any], rules: dict[str, tuple[str, str]] = bodies.RULES
) -> ApiError:
    with pytest.raises(ApiError) as caught:
        bodies.decode(body, kind, rules)
    assert caught.value.status == 422
    return caught.value


def test_a_deployment_body_takes_the_defaults_of_what_it_leaves_out() -> None:
    body = bodies.decode(SPEC, bodies.DeploymentBody)
    assert (body.mode, body.role, body.args, body.image, body.gpu) == (
        "always_on",
        "model",
        [],
        None,
        False,
    )


@pytest.mark.parametrize(
    ("change", "code", "message"),
    [
        ({"name": None}, "missing_field", "name: required"),
        ({"name": "  "}, "invalid_field", "name: a non-empty string"),
        ({"memory_gib": -1}, "invalid_field", "memory_gib: a number of GiB greater than 0"),
        ({"memory_gib": True}, "invalid_field", "memory_gib: a number of GiB greater than 0"),
        (
            {"mode": "sometimes"},
            "invalid_mode",
            'mode: "on_demand" or "always_on", not "sometimes"',
        ),
        ({"role": "boss"}, "invalid_role", 'role: "model" or "decision"'),
        ({"args": ["x"] * 257}, "invalid_field", "args: a list of strings"),
        ({"args": ["x", 2]}, "invalid_field", "args: a list of strings"),
        (
            {"idle_timeout_s": 59},
            "invalid_idle_timeout",
            "idle_timeout_s: null or 60 to 86400 seconds",
        ),
        ({"colour": "blue"}, "unknown_field", "colour: unknown field"),
    ],
)
def test_a_bad_deployment_field_is_named_with_its_code_and_hint(
    change: dict[str, Any], code: str, message: str
) -> None:
    body = {k: v for k, v in {**SPEC, **change}.items() if v is not None}
    err = refusal(body, bodies.DeploymentBody)
    assert (err.code, err.message, err.param) == (code, message, message.split(":")[0])


def test_a_body_that_is_not_an_object_is_invalid_body() -> None:
    assert refusal([1, 2], bodies.DeploymentBody).code == "invalid_body"


def test_a_mode_change_tells_an_omitted_idle_timeout_from_a_null_one() -> None:
    assert bodies.decode({"mode": "on_demand"}, bodies.ModeBody).idle_timeout_s is msgspec.UNSET
    assert (
        bodies.decode({"mode": "on_demand", "idle_timeout_s": None}, bodies.ModeBody).idle_timeout_s
        is None
    )


@pytest.mark.parametrize("value", [59, 86401, 600.5])
def test_an_idle_timeout_is_whole_seconds_from_60_to_86400(value: float) -> None:
    with pytest.raises(ApiError) as caught:
        bodies.idle_timeout(value)
    assert caught.value.code == "invalid_idle_timeout"
    assert bodies.idle_timeout(600.0) == 600


def test_login_answers_required_for_any_bad_field() -> None:
    err = refusal({"name": "", "password": "x"}, bodies.LoginBody, bodies.LOGIN_RULES)
    assert (err.code, err.message) == ("missing_field", "name: required")
    err = refusal({"name": "a", "password": 3}, bodies.LoginBody, bodies.LOGIN_RULES)
    assert (err.code, err.message) == ("missing_field", "password: required")


def _nested(depth: int, shape: str) -> bytes:
    if shape == "arrays":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


# As deep as the body bound (1 MiB) lets each shape nest.
@pytest.mark.parametrize(("shape", "depth"), [("arrays", 200_000), ("objects", 100_000)])
def test_a_body_nested_far_too_deep_is_a_400_naming_the_limit_on_every_route_that_takes_one(
    tmp_path: Path, shape: str, depth: int
) -> None:
    deep = b'{"name":' + _nested(depth, shape) + b"}"
    targets = [
        "/".join((API, *("x" if part.startswith("{") else part for part in route.pattern)))
        for route in ROUTES
        if route.method not in SAFE_METHODS
    ]
    methods = [route.method for route in ROUTES if route.method not in SAFE_METHODS]

    async def t(box: Box) -> None:
        admin = await box.login("alice")
        for method, target in zip(methods, targets, strict=True):
            reply = await admin.call(method, target, deep)
            assert reply.status == 400, (method, target, reply.body[:200])
            error = error_of(reply)
            assert error["code"] == "invalid_json"
            assert error["message"] == f"the body nests deeper than {MAX_JSON_DEPTH} levels"
            assert b"ecursion" not in reply.body
        assert (await admin.call("GET", f"{API}/session")).status == 200  # nothing ran

    run_box(tmp_path, t)


def test_a_body_at_the_nesting_limit_is_read_and_one_level_more_is_not(tmp_path: Path) -> None:
    async def t(box: Box) -> None:
        admin = await box.login("alice")
        at_limit = b'{"name":' + _nested(MAX_JSON_DEPTH - 1, "arrays") + b"}"
        reply = await admin.call("POST", f"{API}/deployments", at_limit)
        assert (reply.status, error_of(reply)["param"]) == (422, "name")  # read, then judged
        reply = await admin.call("POST", f"{API}/deployments", b"[" + at_limit + b"]")
        assert (reply.status, error_of(reply)["code"]) == (400, "invalid_json")

    run_box(tmp_path, t)
