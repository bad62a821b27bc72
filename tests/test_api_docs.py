"""The OpenAPI document covers every admin route and body field, documents each answer as
the type its handler returns, and docs/api.md is the rendering of the current document
(scripts/gen-api-docs).  The answers built from another layer's dicts keep every key."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import msgspec

from actors.controller import DEFAULT_SETTINGS
from actors.memory_broker import GIB, MemoryBroker
from dgxmm.admin import accounts, api, bodies, errors, openapi, sse
from dgxmm.admin.gateway_key_api import KeyStatus
from dgxmm.admin.openapi import JSON, SCHEMA_REF, document
from dgxmm.admin.ops import MemoryBytes
from dgxmm.admin.routes import ROUTES
from dgxmm.admin.sse import memory_json
from dgxmm.admin.tuning import Tuned
from dgxmm.config import load_config
from dgxmm.litellm import bridge
from dgxmm.litellm.gateway_key import GatewayKeys
from events.state import SystemState, TokenInfo, UserRecord
from gateway.access import Access
from simulations.tune import Goal, Point, Tuning
from simulations.whatif import Fates, Figures

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000.0


def test_every_admin_route_is_documented_with_its_error_answer() -> None:
    doc = document()
    _, components = msgspec.json.schema_components([errors.Error], ref_template=SCHEMA_REF)
    assert {name: doc["components"]["schemas"][name] for name in components} == components
    paths = doc["paths"]
    for route in ROUTES:
        op = paths["/dgxmm/api/" + "/".join(route.pattern)][route.method.lower()]
        assert op["responses"]["default"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Error"
        }


def test_the_body_of_a_new_deployment_is_documented_field_by_field() -> None:
    schema = document()["components"]["schemas"]["DeploymentBody"]
    assert set(schema["properties"]) == set(bodies.DeploymentBody.__struct_fields__)
    assert schema["properties"]["memory_gib"]["exclusiveMinimum"] == 0
    assert set(schema["required"]) == {"name", "engine", "model", "memory_gib"}


def test_docs_api_md_is_the_rendering_of_the_current_document() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-api-docs"), "--check"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def _ok(op: dict[str, Any]) -> dict[str, Any]:
    return next(answer for status, answer in op["responses"].items() if status != "default")


def test_every_admin_answer_is_documented_as_the_type_its_handler_returns() -> None:
    doc = document()
    untyped = []
    for route in ROUTES:
        op = doc["paths"]["/dgxmm/api/" + "/".join(route.pattern)][route.method.lower()]
        kind = openapi._answer(route.handler)
        content = _ok(op)["content"]
        if kind is None:  # a stream only: the UI's, each event the type the hub sends it as
            assert set(content) == {"text/event-stream"}, route.handler
            events = content["text/event-stream"]["schema"]["oneOf"]
            sent = {e["properties"]["event"]["const"]: e["properties"]["data"] for e in events}
            assert {name: data["contentSchema"] for name, data in sent.items()} == {
                name: {"$ref": SCHEMA_REF.format(name=kind.__name__)}
                for name, kind in sse.EVENTS.items()
            }
            continue
        if kind is Any or content[JSON]["schema"] == {"type": "object"}:
            untyped.append(route.handler)
            continue
        (schema,), components = msgspec.json.schema_components([kind], ref_template=SCHEMA_REF)
        assert content[JSON]["schema"] == schema, route.handler
        for name, component in components.items():
            assert doc["components"]["schemas"][name] == component, (route.handler, name)
    assert untyped == ["openapi"]  # the document itself


def test_no_answer_leaves_a_field_out_for_having_its_default_value() -> None:
    # The UI and the CLI read a null as null; `omit_defaults` would drop it.
    for route in ROUTES:
        kind = openapi._answer(route.handler)
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            assert not kind.__struct_config__.omit_defaults, route.handler


def _same_json(data: Any, kind: Any) -> None:
    """`data` answered as `kind` is the same JSON (no key lost, none added)."""
    answered = msgspec.json.encode(msgspec.convert(data, kind))
    assert json.loads(answered) == json.loads(msgspec.json.encode(data))


def test_the_dicts_answered_through_a_struct_lose_no_key(tmp_path: Path) -> None:
    broker = MemoryBroker(usable_bytes=100 * GIB, total_bytes=120 * GIB)
    _same_json(broker.snapshot(), MemoryBytes)
    _same_json({**memory_json(broker.snapshot()), "gpu": True}, api.Memory)
    sample = {"enabled": True, "url": "http://127.0.0.1:4000", "backend": "file"}
    sample |= {"config_path": "/srv/litellm.yaml", "master_key_env": "LITELLM_MASTER_KEY"}
    litellm = {f"litellm.{key}": sample[key] for key in bridge._SETTING_KEYS}
    _same_json({**load_config(None).ondemand_defaults(), **litellm}, api.Settings)
    _same_json({**DEFAULT_SETTINGS}, api.Settings)
    queue = {"waiting": 1, "max_queued": 64, "counters": {"served": 3, "waiting": 1}}
    _same_json(queue, sse.QueueCounts)
    _same_json(GatewayKeys(tmp_path, Access()).statistics(), KeyStatus)
    controller = types.SimpleNamespace(system=SystemState())
    status = bridge.LiteLLMBridge(load_config(None), controller, None, None).status()  # type: ignore[arg-type]
    _same_json(status, api.LiteLLMIntegration)
    _same_json({**status, "synced": False}, api.LiteLLMIntegration)
    info = TokenInfo(label="ci", created_at=T0, expires_at=T0 + 60, role="metrics")
    user = UserRecord(
        name="alice", role="admin", password_hash="x", tokens={"t1": "h"},
        token_info={"t1": info}, created_at=T0,
    )  # fmt: skip
    _same_json(
        accounts.token_rows({"alice": user}, T0 + 30, {"t1": T0 + 10}), list[accounts.TokenRow]
    )
    _same_json(accounts.user_rows({"alice": user}), list[accounts.UserRow])


def test_the_tune_answer_has_every_field_dgxmm_tune_prints() -> None:
    fates = Fates(served=10, refused=1, timed_out=0, stopped=0)
    f = Figures(
        hours=2.0, requests=11, p50=1.0, p90=2.5, p99=9.0, worst_model="chat", worst_p90=3.0,
        cold_starts_per_hour=0.5, evictions_per_hour=0.5, idle_gib_hours_per_hour=2.0,
        fates=fates, fates_per_model={"chat": fates}, fails_served=1,
        fails_served_models=["chat"],
    )  # fmt: skip
    point = Point(
        settings={"ondemand_make_room_after_s": 30}, changes=["ondemand_make_room_after_s=30"],
        label="make room after 30 s", stage="make room and idle timeouts", figures=f,
        feasible=False, infeasible="1 request", meets=True, pareto=True,
    )  # fmt: skip
    printed = msgspec.json.decode(
        msgspec.json.encode(
            Tuning(
                goal=Goal(), points=[point], recommended=point, baseline=point, hours=2.0,
                requests=11, searched="1 point",
            )
        )
    )  # fmt: skip
    _same_json({**printed, "goal_text": "p90<=30", "since": T0, "until": T0 + 86400}, Tuned)
