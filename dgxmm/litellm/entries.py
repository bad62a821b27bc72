"""What DGXMM wants in LiteLLM: an entry per deployment, rendered as LiteLLM reads it.

`desired_entries` is the pure decision.  For the api back-end (a change costs LiteLLM nothing)
it follows the seed: always-on deployments that are ready point at their engine, on-demand ones
(in any state but failed) at the gateway, failed ones are absent; each path has its own stable
`model_info.id`, so a mode switch replaces one entry by another.  For the file back-end, where
every write restarts LiteLLM's worker, the entries are *stable*: every deployment, whatever its
mode and state, has its gateway entry, so only creating, removing or reconfiguring a deployment
changes the file.  `litellm_deployment` renders an entry the way LiteLLM 1.108.7 reads it;
`differs` compares a rendered entry with LiteLLM's, and `owned_entries` picks this box's out of
LiteLLM's list.  Both back-ends (`dgxmm.litellm.sync`, `dgxmm.litellm.filesync`) build on these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

from actors.ports import ModelEntry
from dgxmm.litellm.gateway_key import key_id

READY = "ready"  # Registration.state of a deployment whose engine serves
FAILED = "failed"  # a deployment whose start failed: removed from LiteLLM (api back-end)
GATEWAY_TIMEOUT_MARGIN_S = 600.0  # LiteLLM's timeout = queue limit + this (cold start, answer)
HEALTH_CHECK_HEADER = "x-dgxmm-health-check"
# Engine entries: LiteLLM's openai client insists on a key, and engines check none.  Gateway
# entries carry the gateway key (`dgxmm.litellm.gateway_key`), which the gateway requires.
UPSTREAM_API_KEY = "dgxmm-no-key"
KEY_ID_FIELD = "dgxmm_key_id"  # model_info: the gateway key's fingerprint (never the key)
ID_STEM = "dgxmm-"
GATEWAY_ID_SUFFIX = "-gw"


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """What the sync needs to know about one deployment."""

    deployment_id: str
    model_name: str  # the name clients use in LiteLLM
    served_model: str  # the model name the engine serves
    mode: Literal["on_demand", "always_on"]
    state: str  # the deployment's lifecycle state; READY and FAILED matter here
    engine_url: str | None = None  # `http://host:port` of the running engine
    box_id: str = ""  # prefix that keeps model_info.id unique when boxes share one LiteLLM


def id_prefix(box_id: str) -> str:
    """The prefix of every `model_info.id` this box owns."""
    return f"{box_id}-{ID_STEM}" if box_id else ID_STEM


def entry_id(box_id: str, deployment_id: str, via_gateway: bool) -> str:
    """The stable `model_info.id` of a deployment's engine entry or gateway entry."""
    suffix = GATEWAY_ID_SUFFIX if via_gateway else ""
    return f"{id_prefix(box_id)}{deployment_id}{suffix}"


def gateway_timeout_s(queue_timeout_s: float) -> float:
    """LiteLLM's timeout for gateway entries: the queue limit plus a margin (1500 s by default)."""
    return queue_timeout_s + GATEWAY_TIMEOUT_MARGIN_S


def desired_entries(
    regs: Iterable[Registration],
    gateway_url: str,
    queue_timeout_s: float,
    *,
    stable: bool = False,
) -> list[ModelEntry]:
    """The LiteLLM entries DGXMM wants for these deployments, sorted by `model_id`.

    `stable` (the file back-end): every deployment gets its gateway entry, whatever its mode and
    state, so that nothing but creating, removing or reconfiguring a deployment changes the list.
    """
    gateway = gateway_url.rstrip("/")
    entries: list[ModelEntry] = []
    for reg in regs:
        if stable or (reg.mode == "on_demand" and reg.state != FAILED):
            entries.append(
                ModelEntry(
                    model_id=entry_id(reg.box_id, reg.deployment_id, via_gateway=True),
                    model_name=reg.model_name,
                    api_base=f"{gateway}/d/{reg.deployment_id}/v1",
                    upstream_model=reg.served_model,
                    via_gateway=True,
                    timeout_s=gateway_timeout_s(queue_timeout_s),
                    deployment_id=reg.deployment_id,
                )
            )
        elif reg.mode == "always_on" and reg.state == READY and reg.engine_url:
            entries.append(
                ModelEntry(
                    model_id=entry_id(reg.box_id, reg.deployment_id, via_gateway=False),
                    model_name=reg.model_name,
                    api_base=f"{reg.engine_url.rstrip('/')}/v1",
                    upstream_model=reg.served_model,
                    via_gateway=False,
                    deployment_id=reg.deployment_id,
                )
            )
    return sorted(entries, key=lambda e: e.model_id)


def litellm_deployment(entry: ModelEntry, gateway_key: str = "") -> dict[str, Any]:
    """One entry as LiteLLM's `model_list` item and `/model/new` body.

    A gateway entry's `api_key` is `gateway_key`, and its `model_info` names the key's
    fingerprint: LiteLLM's `/model/info` hides keys, the fingerprint shows which one it holds.

    `openai/` makes LiteLLM strip the prefix, send `"model": upstream_model`, forward the
    Responses API natively and translate Anthropic `/v1/messages` to the Responses API.  Gateway
    entries turn LiteLLM's retries off (`num_retries`, which the router reads per entry; the
    gateway already waits) and mark health probes with a header the gateway answers itself.
    """
    params: dict[str, Any] = {
        "model": f"openai/{entry.upstream_model}",
        "api_base": entry.api_base,
        "api_key": UPSTREAM_API_KEY,
    }
    info: dict[str, Any] = {"id": entry.model_id, "dgxmm_deployment_id": entry.deployment_id}
    if entry.via_gateway and gateway_key:
        params["api_key"] = gateway_key
        info[KEY_ID_FIELD] = key_id(gateway_key)
    if entry.timeout_s is not None:
        params["timeout"] = entry.timeout_s
        params["stream_timeout"] = entry.timeout_s
    if entry.via_gateway:
        params["num_retries"] = 0
        info["health_check_params"] = {"extra_headers": {HEALTH_CHECK_HEADER: "1"}}
    return {"model_name": entry.model_name, "litellm_params": params, "model_info": info}


def id_of(item: Mapping[str, Any]) -> str | None:
    """The `model_info.id` of a LiteLLM entry, if it has one."""
    info = item.get("model_info")
    model_id = info.get("id") if isinstance(info, Mapping) else None
    return model_id if isinstance(model_id, str) else None


def _same_value(want: object, have: object) -> bool:
    if isinstance(want, int | float) and isinstance(have, int | float):
        return float(want) == float(have)
    return want == have


def differs(want: Mapping[str, Any], have: Mapping[str, Any]) -> bool:
    """Whether LiteLLM's entry `have` lacks something of the rendered entry `want`."""
    if want.get("model_name") != have.get("model_name"):
        return True
    want_params, have_params = want["litellm_params"], have.get("litellm_params") or {}
    for key, value in want_params.items():
        if key != "api_key" and not _same_value(value, have_params.get(key)):
            return True
    have_info = have.get("model_info") or {}
    if want["model_info"].get(KEY_ID_FIELD) != have_info.get(KEY_ID_FIELD):
        return True  # registered with another gateway key (a rotation)
    want_hc = want["model_info"].get("health_check_params") or None
    have_hc = have_info.get("health_check_params") or None
    return bool(want_hc != have_hc)


def owned_entries(items: Iterable[Mapping[str, Any]], box_id: str) -> dict[str, Mapping[str, Any]]:
    """The entries of `items` this box owns (its id prefix), by `model_info.id`."""
    prefix = id_prefix(box_id)
    owned: dict[str, Mapping[str, Any]] = {}
    for item in items:
        model_id = id_of(item)
        if model_id is not None and model_id.startswith(prefix):
            owned[model_id] = item
    return owned


def rendered_entries(
    entries: Iterable[ModelEntry], gateway_key: str = ""
) -> dict[str, dict[str, Any]]:
    """`entries` rendered as LiteLLM reads them (`litellm_deployment`), by id, in id order."""
    ordered = sorted(entries, key=lambda e: e.model_id)
    return {e.model_id: litellm_deployment(e, gateway_key) for e in ordered}
