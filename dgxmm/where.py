"""Which DGXMM a command works on: found in one written order, and said on stderr.

The CLI used to answer silently from whichever DGXMM the user had started last (issue 46):
`dgxmm ps` run elsewhere listed another instance's deployments, which makes `dgxmm stop`
risky.  Every command now takes its configuration (its data dir, event log and admin address)
from the first of:

1. `--config FILE`;
2. `$DGXMM_CONFIG`;
3. the current directory: the built-in configuration there (`./dgxmm-data`) when that
   directory exists.  `serve` and `user add`, which create it, always stop here;
4. the DGXMM this user runs: each `dgxmm serve` registers itself under
   `$XDG_STATE_HOME/dgxmm/servers/` (default `~/.local/state/dgxmm/servers/`) while it runs.
   Exactly one running is taken; two or more is an error that names them: never a guess.

Relative paths in a configuration file (`data_dir`, `db`, `[litellm] config_path`) are
relative to the file's directory, for `serve` and for every command given that file; the
built-in configuration's are relative to the current directory.  `dgxmm.cli` prints
`describe()` of the choice, one line on stderr, unless `--db` or `--url` named what the
command uses (or it is `serve`, whose banner names its event log and whose refusals are one
line).  `choose` decides; the rest reads and writes the files it decides on.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dgxmm.admin.client import CLI_FILE
from dgxmm.config import Config, load_config, with_absolute_paths

ENV = "DGXMM_CONFIG"


class WhereError(Exception):
    """No DGXMM to work on, or more than one equally good: the message says what to give."""


class Served(msgspec.Struct, frozen=True, kw_only=True):
    """One running `dgxmm serve`, as it registered itself."""

    pid: int
    data_dir: str
    db: str
    config: str | None = None  # its configuration file (absolute), if it had one


@dataclass(frozen=True)
class Choice:
    """Where the configuration comes from: a file, the current directory, or a running DGXMM;
    `why` says which, for the line on stderr."""

    file: str | None
    served: Served | None
    why: str


_HINT = "give --config FILE (or set DGXMM_CONFIG), or run in the directory that holds dgxmm-data"


def choose(
    *,
    flag: str | None,
    env: str | None,
    here: bool,
    running: list[Served],
    creates: bool,
    other: str = "",
) -> Choice:
    """The configuration to use (pure); raises WhereError when none or several are left.

    `here`: the current directory holds the built-in data dir; `creates`: the command makes
    the data dir (serve, user add), so the current directory is always good enough; `other`:
    the command's own way to name its target, for the hint (`--db FILE`)."""
    hint = _HINT + (f", or give {other}" if other else "")
    if flag:
        return Choice(flag, None, f"--config {flag}")
    if env:
        return Choice(env, None, f"{ENV}={env}")
    if here or creates:
        return Choice(None, None, "the current directory")
    if len(running) == 1:
        served = running[0]
        how = f", --config {served.config}" if served.config else ""
        return Choice(None, served, f"the one DGXMM this user runs: pid {served.pid}{how}")
    if running:
        listed = "; ".join(f"pid {s.pid}: {s.data_dir}" for s in running)
        raise WhereError(f"{len(running)} DGXMMs run as this user ({listed}); which one? {hint}")
    raise WhereError(f"found no DGXMM: no dgxmm-data here and this user runs none; {hint}")


def resolve(flag: str | None, *, creates: bool = False, other: str = "") -> Choice:
    """`choose` with what this process sees: the environment, the current directory and the
    registered servers that still run."""
    env = os.environ.get(ENV) or None
    here = (Path.cwd() / Config().server.data_dir).is_dir()
    looked = flag or env or here or creates
    return choose(
        flag=flag,
        env=env,
        here=here,
        running=[] if looked else running_servers(),
        creates=creates,
        other=other,
    )


def config_of(choice: Choice) -> Config:
    """The configuration `choice` names, its paths absolute; raises ConfigError."""
    base = Path.cwd()
    if choice.file is not None:
        path = base / choice.file
        return with_absolute_paths(load_config(path), path.parent)
    served = choice.served
    if served is None:
        return with_absolute_paths(Config(), base)
    config = Config()
    if served.config is not None:
        path = Path(served.config)
        config = with_absolute_paths(load_config(path), path.parent)
    server = msgspec.structs.replace(config.server, data_dir=served.data_dir, db=served.db)
    return msgspec.structs.replace(config, server=server)


def describe(choice: Choice, config: Config, *, url: str | None = None) -> str:
    """The line a command prints: what it works on, and why that one."""
    data_dir = config.server.data_dir
    if url is not None:
        return f"server {url} (data dir {data_dir}; from {choice.why})"
    return f"data dir {data_dir} (from {choice.why})"


# --- the register of running servers --------------------------------------------------------


def servers_dir() -> Path:
    """Where each running `dgxmm serve` of this user registers itself."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "dgxmm" / "servers"


@contextlib.contextmanager
def registered(config: Config, file: str | None) -> Iterator[None]:
    """Register this process as a running DGXMM for the CLI of the same user, until the block
    ends (best effort: without it, commands elsewhere need --config)."""
    path = servers_dir() / f"{os.getpid()}.json"
    entry = Served(
        pid=os.getpid(),
        data_dir=str(Path(config.server.data_dir).resolve()),
        db=str(config.server.db_path.resolve()),
        config=None if file is None else str(Path(file).resolve()),
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.json.encode(entry))
    except OSError:
        pass  # policy: the server runs all the same; the CLI elsewhere needs --config
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def running_servers() -> list[Served]:
    """The registered servers that still run: alive, and serving (their data dir's token file
    names them).  What a killed server left behind is removed."""
    found = []
    try:
        paths = sorted(servers_dir().glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            served = msgspec.json.decode(path.read_bytes(), type=Served)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        if not _alive(served.pid):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        if _serving_pid(Path(served.data_dir)) == served.pid:
            found.append(served)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _serving_pid(data_dir: Path) -> int | None:
    """The pid in the data dir's token file: the DGXMM that serves it now."""
    try:
        pid = json.loads((data_dir / CLI_FILE).read_text(encoding="utf-8")).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) else None
