"""The OpenAPI document covers every admin route and body field, and docs/api.md is the
rendering of the current document (scripts/gen-api-docs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dgxmm.admin import bodies
from dgxmm.admin.openapi import document
from dgxmm.admin.routes import ROUTES

ROOT = Path(__file__).resolve().parent.parent


def test_every_admin_route_is_documented_with_its_error_answer() -> None:
    paths = document()["paths"]
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
