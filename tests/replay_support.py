"""Test support: `dgxmm replay --json` output (JSON lines) put back into one document."""

from __future__ import annotations

import json
from typing import Any


def replay_document(text: str) -> dict[str, Any]:
    """The head line with its deployments (each with its timeline) and queue lines inside."""
    lines = [json.loads(line) for line in text.splitlines()]
    head: dict[str, Any] = lines[0]
    assert head.pop("line") == "replay"
    head["deployments"], head["queue"] = [], []
    by_id: dict[str, dict[str, Any]] = {}
    for line in lines[1:]:
        kind = line.pop("line")
        if kind == "deployment":
            by_id[line["deployment_id"]] = {**line, "timeline": []}
            head["deployments"].append(by_id[line["deployment_id"]])
        elif kind == "timeline":
            by_id[line["deployment_id"]]["timeline"].append(line)
        else:
            assert kind == "queue", kind
            head["queue"].append(line)
    return head
