"""What `dgxmm serve --demo` does differently from a real install, and its banner lines.

The demo swaps at once: `ondemand_make_room_after_s = 0`, so a model asked for puts an idle
one to sleep without waiting for its idle timeout (the seed's default, which real installs
keep, waits for it).

On-demand models only work through LiteLLM, so the demo puts the pinned LiteLLM in front of
itself, run as a box should run it (`plan_front`, `dgxmm.demo_litellm` starts it): under
gunicorn with `docs/litellm-gunicorn.conf.py`, on 127.0.0.1 only, on the config file DGXMM
writes (the `file` back-end), reloaded by DGXMM's `reload_command` after each write, so a
deploy does not interrupt it.  Its master key is one key kept in the data dir (0600): LiteLLM,
DGXMM's sync, the banner and `docs/quickstart.md` all read that file, so they never disagree
and a restart keeps it.  `--no-litellm` runs DGXMM alone, and a configuration that enables
`[litellm]` itself keeps its own LiteLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import stat
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

import msgspec

from actors.controller import Controller
from actors.deployment import StopDeployment
from actors.errors import ActorError
from dgxmm.config import Config
from events.state import Lifecycle

MAKE_ROOM_AFTER_S = 0
LITELLM_PIN = "litellm[proxy]==1.108.7"  # what `scripts/bootstrap` installs in .venv-litellm
MASTER_KEY_FILE = "litellm-master-key"
LITELLM_DIR = "litellm"  # under the data dir: LiteLLM's working directory, pidfile and log
# A reload waits this long for LiteLLM to serve the new list: at the first start LiteLLM is
# not up until its venv is made (a minute or more) and it has booted.
RELOAD_TIMEOUT_S = 300.0
STOP_WAIT_S = 10.0  # per engine at shutdown; the runtime stops what is left


class Front(msgspec.Struct, frozen=True, kw_only=True):
    """The LiteLLM the demo runs in front of DGXMM: where it listens and what it runs with."""

    port: int  # it listens on 127.0.0.1:port only
    venv: str  # its virtual environment (.venv-litellm): gunicorn, LiteLLM, the openai client
    bootstrap: str | None  # this checkout's scripts/bootstrap, which makes the venv
    workdir: str  # its working directory (no *.py files), with its pidfile and log
    key_file: str  # the master key, 0600
    config_path: str  # the file DGXMM writes and LiteLLM reads

    @property
    def url(self) -> str:
        """Its base URL (clients add `/v1`)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        """The gunicorn master's pid (gunicorn `--pid`), what the reload command signals."""
        return Path(self.workdir) / "gunicorn.pid"

    @property
    def log(self) -> Path:
        """gunicorn's and LiteLLM's output, of the current run."""
        return Path(self.workdir) / "litellm.log"


def plan_front(
    config: Config, project_dir: Path, *, no_litellm: bool, env: Mapping[str, str]
) -> Front | None:
    """The demo's LiteLLM, or None: `--no-litellm`, or a configuration that enables
    `[litellm]` itself (its own LiteLLM, which the demo leaves as configured)."""
    if no_litellm or config.litellm.enabled:
        return None
    data_dir = Path(config.server.data_dir)
    bootstrap = project_dir / "scripts" / "bootstrap"
    venv = project_dir / ".venv-litellm"
    if not bootstrap.is_file():  # not a checkout: a LiteLLM installed by hand
        program = env.get("LITELLM_BIN")
        if program:
            venv = Path(program).parent.parent
    port = urllib.parse.urlsplit(config.litellm.url).port or 80
    config_path = config.litellm.config_path or str(config.server.db_path.parent / "litellm.yaml")
    return Front(
        port=port,
        venv=str(venv),
        bootstrap=str(bootstrap) if bootstrap.is_file() else None,
        workdir=str(data_dir / LITELLM_DIR),
        key_file=str(data_dir / MASTER_KEY_FILE),
        config_path=config_path,
    )


def demo_config(config: Config, front: Front | None) -> Config:
    """The configuration the demo runs with: swaps at once (unless the given configuration
    sets that itself) and, with its own LiteLLM, syncs to it with the kept master key, which
    goes into this process's environment for DGXMM's sync to read."""
    room = config.ondemand_make_room_after_s
    litellm = config.litellm
    if front is not None:
        os.environ[litellm.master_key_env] = master_key(Path(front.key_file))
        litellm = msgspec.structs.replace(
            litellm,
            enabled=True,
            backend="file",
            url=front.url,
            config_path=front.config_path,
            reload_command=reload_command(front.pidfile),
            reload_timeout_s=max(litellm.reload_timeout_s, RELOAD_TIMEOUT_S),
        )
    return msgspec.structs.replace(
        config,
        ondemand_make_room_after_s=MAKE_ROOM_AFTER_S if room is None else room,
        litellm=litellm,
    )


def master_key(path: Path) -> str:
    """The demo's LiteLLM master key: the one in `path`, else a new one written there (0600)."""
    with contextlib.suppress(FileNotFoundError):
        key = path.read_text(encoding="utf-8").strip()
        if key:
            if stat.S_IMODE(path.stat().st_mode) & 0o077:  # left readable by others: tighten
                path.chmod(0o600)
            return key
    key = "sk-demo-" + secrets.token_hex(16)  # LiteLLM refuses a key without the sk- prefix
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    return key


def reload_command(pidfile: Path) -> str:
    """`kill -HUP` of the demo's gunicorn master, through its pidfile.  Before LiteLLM runs
    (its venv is being made, it is booting) there is nothing to signal: the command succeeds,
    and DGXMM's reload waits for LiteLLM, which reads the file as it starts.  A pid whose
    command line does not name this pidfile (a stale file, the pid since reused by another
    program) is never signalled."""
    f = shlex.quote(str(pidfile))
    return (
        f"pid=$(cat {f} 2>/dev/null) || exit 0; "
        f'grep -qsF -- {f} "/proc/$pid/cmdline" || exit 0; '
        f'kill -HUP "$pid"'
    )


def demo_notes(config: Config, front: Front | None) -> list[str]:
    """The banner's lines on what the demo does differently, and on LiteLLM in front of it."""
    lines = [
        "The demo differs from a real install: simulated engines and memory, and",
        f"  ondemand_make_room_after_s = {config.ondemand_make_room_after_s} (a model asked for "
        "puts an idle one to sleep at once; a real install waits for its idle timeout).",
    ]
    if front is None:
        if config.litellm.enabled:
            lines.append(f"LiteLLM: the one your configuration names, {config.litellm.url}.")
        else:
            lines.append(
                "No LiteLLM in front (--no-litellm): DGXMM alone; `dgxmm serve --demo` puts one"
                " in front."
            )
        return lines
    lines += [
        f"LiteLLM in front: starting on {front.url}/v1 (gunicorn with"
        " docs/litellm-gunicorn.conf.py;",
        "  DGXMM reloads it after each change). A line below says when it answers.",
    ]
    if not (Path(front.venv) / "bin" / "gunicorn").exists():
        lines.append(
            f"  First run: it creates {front.venv} first ({LITELLM_PIN};"
            " about a minute, progress below)."
        )
    lines += [
        f"  Its master key, which clients send as their API key: {front.key_file}",
        "Try it through LiteLLM, with the openai client (installed beside LiteLLM):",
        f"  {openai_example(front)}",
    ]
    return lines


def openai_example(front: Front) -> str:
    """A shell line that asks demo-chat through LiteLLM with the `openai` client (the key by
    reference: the banner, often in a log, never shows it)."""
    python = shlex.quote(str(Path(front.venv) / "bin" / "python"))
    code = (
        "from openai import OpenAI; print(OpenAI().chat.completions.create(model='demo-chat',"
        " messages=[{'role': 'user', 'content': 'Hello'}]).choices[0].message.content)"
    )
    return (
        f"OPENAI_BASE_URL={front.url}/v1 OPENAI_API_KEY=$(cat {shlex.quote(front.key_file)}) "
        f'{python} -c "{code}"'
    )


def curl_label(front: Front | None) -> str:
    """What the banner says of its `curl` straight to the gateway."""
    if front is None:
        return "Try it, straight to DGXMM's gateway (with the gateway key):"
    return "Check DGXMM alone, without LiteLLM: straight to its gateway (with the gateway key):"


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
