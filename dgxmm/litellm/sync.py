"""LiteLLM sync: the two ways to put DGXMM's model entries into LiteLLM, and the choice.

The entries are `dgxmm.litellm.entries`'s; this module chooses the back-end that writes them.

Two back-ends, both on `dgxmm.litellm.backend.Backend` (`status`, `sync`, `close`):

- `ApiSync` (here) talks to LiteLLM's model-management API (`/model/info`, `/model/new`,
  `PATCH /model/{id}/update`, `/model/delete`; LiteLLM needs its database for the writes).  It
  reads LiteLLM's live list on every sync, so it converges after either side restarts.  It adds
  before it removes: one LiteLLM process serves both lists in turn, so a mode switch never
  leaves the model name without an entry.
- `dgxmm.litellm.filesync.ConfigFileSync` rewrites LiteLLM's config file for a LiteLLM run with
  `--config FILE --reload`, at once, and checks in the background that LiteLLM loaded it.

Both only touch entries they own (ids with this box's prefix); every failure becomes
`actors.errors.SyncFailed` with a sentence an operator can act on.  `make_sync` picks one from
the settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec
import structlog

from actors.errors import SyncFailed
from actors.ports import ModelEntry
from dgxmm.litellm.backend import Backend, SyncStatus, error_text, refusal, refusal_kind
from dgxmm.litellm.entries import differs, id_of, owned_entries, rendered_entries
from dgxmm.litellm.filesync import ConfigFileSync

log = structlog.get_logger(__name__)

# The deploy wizard's hint when it preselects Always on (the seed's words).
HINT = "On demand needs LiteLLM (it starts models on requests that come through it)"


class LiteLLMSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How DGXMM reaches LiteLLM; the master key is read from an environment variable."""

    enabled: bool = False
    url: str = "http://127.0.0.1:4000"
    master_key_env: str = "LITELLM_MASTER_KEY"
    backend: Literal["api", "file"] = "api"
    config_path: str = ""  # backend "file": the file LiteLLM runs with (--config FILE --reload)
    box_id: str = ""


class ApiSync(Backend):
    """Keeps LiteLLM's database-backed model list equal to DGXMM's, through its API.

    A sync adds, then updates, then removes, so a mode switch never leaves a model name
    without an entry in the one LiteLLM process that serves both.
    """

    kind = "api"

    def __repr__(self) -> str:
        return f"ApiSync({self._client.url!r}, box_id={self._box_id!r})"

    async def _sync(self, entries: list[ModelEntry]) -> dict[str, int]:
        want = rendered_entries(entries, self._gateway_key())
        live = owned_entries(await self._client.list_entries(), self._box_id)
        added = [i for i in want if i not in live]
        changed = [i for i in want if i in live and differs(want[i], live[i])]
        removed = [i for i in live if i not in want]
        for model_id in [*changed, *removed]:
            if (live[model_id].get("model_info") or {}).get("db_model") is False:
                raise SyncFailed(
                    f"LiteLLM entry {model_id} comes from LiteLLM's config file, which the api "
                    "back-end cannot change; remove it from that file"
                )
        for model_id in added:
            await self._add(want[model_id])
        for model_id in changed:
            await self._client.update(want[model_id])
            log.info("litellm_entry_updated", model_id=model_id)
        for model_id in removed:
            await self._remove(model_id)
        return {"added": len(added), "updated": len(changed), "removed": len(removed)}

    async def _add(self, deployment: Mapping[str, Any]) -> None:
        model_id = id_of(deployment) or ""
        answer = await self._client.add(deployment)
        if answer.status == 200:
            log.info("litellm_entry_added", model_id=model_id)
            return
        failure = refusal(f"adding {model_id}", answer)
        if refusal_kind(answer) != "other":
            raise failure
        # The id may already be in LiteLLM's database (another LiteLLM worker had it, or an
        # earlier answer was lost): writing it in place makes the add idempotent.
        try:
            await self._client.update(deployment)
        except SyncFailed:
            raise failure from None
        log.info("litellm_entry_updated", model_id=model_id, after="add_refused")

    async def _remove(self, model_id: str) -> None:
        answer = await self._client.delete(model_id)
        if answer.status == 200:
            log.info("litellm_entry_removed", model_id=model_id)
        elif answer.status in (400, 404) and "not found" in error_text(answer).lower():
            log.info("litellm_entry_already_gone", model_id=model_id)
        else:
            raise refusal(f"removing {model_id}", answer)


class DisabledSync:
    """The LiteLLM integration is off: syncing does nothing."""

    def status(self) -> SyncStatus:
        """Always disabled."""
        return SyncStatus(enabled=False)

    async def sync(self, entries: list[ModelEntry]) -> None:
        """Do nothing."""

    async def close(self) -> None:
        """Nothing to stop."""


def make_sync(
    settings: LiteLLMSettings,
    environ: Mapping[str, str] | None = None,
    gateway_key: Callable[[], str] | None = None,
) -> ApiSync | ConfigFileSync | DisabledSync:
    """The back-end these settings ask for; the master key comes from `settings.master_key_env`,
    the gateway key (the gateway entries' `api_key`) from `gateway_key()` at every sync."""
    if not settings.enabled:
        return DisabledSync()
    env = os.environ if environ is None else environ
    key = env.get(settings.master_key_env) or None
    if settings.backend == "file":
        if not settings.config_path:
            raise SyncFailed("LiteLLM file back-end: no config_path set")
        return ConfigFileSync(
            settings.config_path,
            settings.url,
            key,
            box_id=settings.box_id,
            master_key_env=settings.master_key_env,
            gateway_key=gateway_key,
        )
    return ApiSync(
        settings.url,
        key,
        box_id=settings.box_id,
        master_key_env=settings.master_key_env,
        gateway_key=gateway_key,
    )
