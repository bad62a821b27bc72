"""What `dgxmm serve --demo` does differently from a real install, and its banner lines.

The demo swaps at once: `ondemand_make_room_after_s = 0`, so a model asked for puts an idle
one to sleep without waiting for its idle timeout (the seed's default, which real installs
keep, waits for it).  It writes LiteLLM's config file (the `file` back-end) into its data
dir, so that one command puts a real LiteLLM in front of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
from pathlib import Path

import msgspec

from actors.controller import Controller
from actors.deployment import StopDeployment
from actors.errors import ActorError
from dgxmm.config import Config
from events.state import Lifecycle

MAKE_ROOM_AFTER_S = 0
LITELLM_PORT = 4000
LITELLM_PIN = "litellm[proxy]==1.108.7"
STOP_WAIT_S = 10.0  # per engine at shutdown; the runtime stops what is left


def demo_config(config: Config) -> Config:
    """The configuration the demo runs with: swaps at once, LiteLLM's file written (unless
    the given configuration sets these itself).  LiteLLM refuses to start without a master
    key: unless the environment has one, a fresh one goes into this process's environment,
    so that DGXMM checks what LiteLLM loaded with the key the banner prints."""
    room = config.ondemand_make_room_after_s
    litellm = config.litellm
    os.environ.setdefault(litellm.master_key_env, "sk-demo-" + secrets.token_hex(16))
    if not litellm.enabled:
        litellm = msgspec.structs.replace(litellm, enabled=True, backend="file")
    return msgspec.structs.replace(
        config,
        ondemand_make_room_after_s=MAKE_ROOM_AFTER_S if room is None else room,
        litellm=litellm,
    )


def litellm_program(project_dir: Path) -> str | None:
    """The pinned LiteLLM of this checkout (`make test` installs it), else $LITELLM_BIN."""
    own = project_dir / ".venv-litellm" / "bin" / "litellm"
    if own.exists():
        return str(own)
    return os.environ.get("LITELLM_BIN") or None


def demo_notes(config: Config, project_dir: Path) -> list[str]:
    """The banner's lines on what the demo does differently, and LiteLLM in front of it."""
    data_dir = Path(config.server.data_dir)
    litellm_file = config.litellm.config_path or str(data_dir / "litellm.yaml")
    program = litellm_program(project_dir)
    key_env = config.litellm.master_key_env
    key = os.environ.get(key_env, "")
    run = (
        f"cd {shlex.quote(str(data_dir))} && {key_env}={shlex.quote(key)} "
        f"{shlex.quote(program or 'litellm')} --config {shlex.quote(litellm_file)} "
        f"--port {LITELLM_PORT} --reload"
    )
    lines = [
        "The demo differs from a real install: simulated engines and memory, and",
        f"  ondemand_make_room_after_s = {config.ondemand_make_room_after_s} (a model asked for "
        "puts an idle one to sleep at once; a real install waits for its idle timeout).",
        "LiteLLM in front (then call http://127.0.0.1:4000/v1 with the deployment's name and",
        "  that key as the API key):",
        f"  {run}",
    ]
    if program is None:
        lines.append(f"  (no LiteLLM here: pip install '{LITELLM_PIN}' in a venv of its own)")
    return lines


async def stop_engines(controller: Controller) -> None:
    """Stop the demo's engines (children of its process, they cannot outlive it) through
    their deployments, so that the log records the stop (reason `shutdown`): the next start
    finds them stopped as recorded, not lost, and starts the always-on one again."""
    for actor in list(controller.actors.values()):
        # A starting engine is left to the runtime's own stop: its actor is busy with the
        # start, so an ask would wait behind it.
        if actor.engine_handle is not None and actor.state.lifecycle is Lifecycle.READY:
            with contextlib.suppress(ActorError, TimeoutError):
                await asyncio.wait_for(
                    actor.ask(StopDeployment(reason="shutdown", actor="system")), STOP_WAIT_S
                )
