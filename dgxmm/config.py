"""Configuration: one TOML file, every key with a default; the seed's names are the keys.

```toml
ondemand_idle_timeout_s = 300
ondemand_queue_timeout_s = 900
ondemand_max_queued = 64

[server]
data_dir = "./dgxmm-data"

[litellm]
enabled = true
url = "http://127.0.0.1:4000"
```

`docs/configuration.md` lists every key with what it changes.
"""

from __future__ import annotations

import math
import os
import tomllib
import urllib.parse
from pathlib import Path
from typing import Annotated, Literal

import msgspec

PROGRAM_ENGINES = ("vllm", "llamacpp", "sglang")  # `[engines] programs` keys (the sim is Python)


class ConfigError(Exception):
    """The configuration file cannot be used; the message names the file and the key."""


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where DGXMM listens and keeps its data."""

    data_dir: str = "./dgxmm-data"
    db: str | None = None  # default: <data_dir>/dgxmm.db
    admin_host: str = "127.0.0.1"
    admin_port: int = 8400
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8401
    gateway_url: str | None = None  # how LiteLLM reaches the gateway; default from host/port
    box_id: str = "box"  # prefix of LiteLLM model_info.id when several boxes share a LiteLLM
    # Both listeners: a request's head and body must be in this long after its first byte.
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    gateway_fast_path: bool = True  # plainly valid request heads skip h11 (both listeners)
    cookie_secure: bool = False  # mark the session cookie Secure (DGXMM behind HTTPS)
    shutdown_grace_s: float = 30.0  # on SIGTERM, how long answers in flight may still run
    metrics_public: bool = False  # /metrics without a login, for clients on loopback only
    # The gateway key (docs/security.md): "loopback-open" lets 127.0.0.1 in without it (demo).
    gateway_auth: Literal["required", "loopback-open"] = "required"
    gateway_key_overlap_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 600.0
    web_vendor_dir: str | None = None  # the chart library; default $DGXMM_CACHE/web

    @property
    def db_path(self) -> Path:
        """The event log's file."""
        return Path(self.db) if self.db else Path(self.data_dir) / "dgxmm.db"

    @property
    def public_gateway_url(self) -> str:
        """The gateway's base URL as LiteLLM sees it."""
        if self.gateway_url:
            return self.gateway_url.rstrip("/")
        host = "127.0.0.1" if self.gateway_host in ("0.0.0.0", "") else self.gateway_host
        return f"http://{host}:{self.gateway_port}"


class MemoryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The budget and the watchdog."""

    total_gib: float | None = None  # default: detected (nvidia-smi, else MemTotal)
    reserve_gib: float = 8.0  # kept for the system, never given to engines
    max_concurrent_starts: int = 1  # the start-up queue
    watchdog_threshold_gib: float = 2.0  # 0 turns the watchdog off
    watchdog_every_s: float = 5.0


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which runtime starts engines."""

    kind: Literal["auto", "docker", "process"] = "auto"
    docker_url: str | None = None  # default: the local socket (DOCKER_HOST)
    stop_timeout_s: float = 30.0
    health_failure_window_s: float = 30.0  # a ready engine failing its health this long is lost


class EnginesConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Engine images and caches."""

    images: dict[str, str] = {}
    sim_image: str = "dgxmm-sim:local"
    cache_root: str | None = None  # default: ~/.cache
    startup_timeout_s: float = 1200.0
    extra_env: dict[str, str] = {}
    # Process runtime: engine -> program path or command (default: found on PATH).
    programs: dict[str, str | list[str]] = {}
    gpu: bool = True  # request the GPU for vllm/llamacpp/sglang containers
    # Docker runtime: image -> host paths bound read-only at the same path into its containers.
    image_mounts: dict[str, list[str]] = {}


class LiteLLMConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The LiteLLM integration (the master key comes from an environment variable)."""

    enabled: bool = False
    url: str = "http://127.0.0.1:4000"
    master_key_env: str = "LITELLM_MASTER_KEY"
    backend: Literal["file", "api"] = "file"
    config_path: str | None = None  # file back-end: default <data_dir>/litellm.yaml
    # file back-end: run after each write to reload LiteLLM (/bin/sh -c); unset: LiteLLM --reload
    reload_command: str | None = None
    reload_timeout_s: float = 60.0  # for the command, then again for the new list to be served


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole configuration."""

    ondemand_idle_timeout_s: int = 300
    ondemand_queue_timeout_s: int = 900
    ondemand_max_queued: int = 64
    # Quiet this long, an on-demand model may sleep for the queue's head; unset: its idle timeout.
    ondemand_make_room_after_s: int | None = None
    # "learned": each on-demand model is also governed by its own recorded traffic
    # (`actors.anticipation`); a deployment's own choice overrides it.
    ondemand_policy: Literal["seed", "learned"] = "seed"
    server: ServerConfig = ServerConfig()
    memory: MemoryConfig = MemoryConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    engines: EnginesConfig = EnginesConfig()
    litellm: LiteLLMConfig = LiteLLMConfig()

    def ondemand_defaults(self) -> dict[str, int | str | None]:
        """The on-demand defaults (settings changed in the UI override them)."""
        return {
            "ondemand_policy": self.ondemand_policy,
            "ondemand_idle_timeout_s": self.ondemand_idle_timeout_s,
            "ondemand_queue_timeout_s": self.ondemand_queue_timeout_s,
            "ondemand_max_queued": self.ondemand_max_queued,
            "ondemand_make_room_after_s": self.ondemand_make_room_after_s,
        }


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read the TOML file (or the defaults when `path` is None); raises ConfigError."""
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a TOML file (not UTF-8 text)") from None
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise ConfigError(_one_line(f"{path}: {exc}")) from None
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_one_line(f"{path}: {exc}")) from None
    _check(config, str(path))
    return config


def _one_line(text: str) -> str:
    return " ".join(text.split())


def http_url_problem(url: object) -> str | None:
    """Why `url` is not an http(s) URL with a host, or None when it is one."""
    if not isinstance(url, str):
        return "an http or https URL"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return "an http or https URL (this one does not parse)"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"an http or https URL, not {url[:80]!r}"
    if port == 0:
        return "an http or https URL with a port from 1 to 65535"
    return None


def _range(where: str, key: str, value: float | None, lo: float, hi: float, what: str) -> None:
    """Raise ConfigError unless lo <= value <= hi (a finite number); None passes."""
    if value is None:
        return
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ConfigError(f"{where}: {key} must be {what}, not {value}")


def _check(config: Config, where: str) -> None:
    if not 60 <= config.ondemand_idle_timeout_s <= 86400:
        raise ConfigError(f"{where}: ondemand_idle_timeout_s must be 60 to 86400")
    if config.ondemand_queue_timeout_s < 1:
        raise ConfigError(f"{where}: ondemand_queue_timeout_s must be at least 1")
    if config.ondemand_max_queued < 1:
        raise ConfigError(f"{where}: ondemand_max_queued must be at least 1")
    room = config.ondemand_make_room_after_s
    if room is not None and not 0 <= room <= 86400:
        raise ConfigError(f"{where}: ondemand_make_room_after_s must be 0 to 86400")
    if config.server.shutdown_grace_s < 0:
        raise ConfigError(f"{where}: server.shutdown_grace_s must be at least 0")
    if config.runtime.health_failure_window_s <= 0:
        raise ConfigError(f"{where}: runtime.health_failure_window_s must be more than 0")
    if not 0 < config.litellm.reload_timeout_s <= 3600:
        raise ConfigError(f"{where}: litellm.reload_timeout_s must be more than 0 and at most 3600")
    if config.memory.max_concurrent_starts < 1:
        raise ConfigError(f"{where}: memory.max_concurrent_starts must be at least 1")
    server, mem = config.server, config.memory
    for key in ("admin_port", "gateway_port"):  # 0: any free port (tests)
        _range(where, f"server.{key}", getattr(server, key), 0, 65535, "a port from 1 to 65535")
    for key, url in (
        ("server.gateway_url", server.gateway_url),
        ("litellm.url", config.litellm.url),
    ):
        problem = None if url is None else http_url_problem(url)
        if problem is not None:
            raise ConfigError(f"{where}: {key} must be {problem}")
    big = float(1 << 20)  # GiB: a million is no real box
    _range(where, "memory.total_gib", mem.total_gib, 1e-3, big, "a number of GiB above 0")
    _range(where, "memory.reserve_gib", mem.reserve_gib, 0, big, "a number of GiB, 0 or more")
    if mem.total_gib is not None and mem.reserve_gib >= mem.total_gib:
        raise ConfigError(
            f"{where}: memory.reserve_gib ({mem.reserve_gib}) must be less than"
            f" memory.total_gib ({mem.total_gib})"
        )
    _range(where, "memory.watchdog_threshold_gib", mem.watchdog_threshold_gib, 0, big, "0 or more")
    _range(where, "memory.watchdog_every_s", mem.watchdog_every_s, 0.1, 3600, "0.1 to 3600")
    _range(where, "runtime.stop_timeout_s", config.runtime.stop_timeout_s, 0, 3600, "0 to 3600")
    startup = config.engines.startup_timeout_s
    _range(where, "engines.startup_timeout_s", startup, 1, 7 * 86400, "1 to 604800")
    docker = config.runtime.docker_url
    if docker is not None and urllib.parse.urlsplit(docker).scheme not in (
        "unix", "tcp", "http", "https", "npipe",
    ):  # fmt: skip
        raise ConfigError(f"{where}: runtime.docker_url must be unix://, tcp:// or http(s)://")
    for image, paths in sorted(config.engines.image_mounts.items()):
        relative = [path for path in paths if not path.startswith("/")]
        if relative:
            raise ConfigError(
                f"{where}: engines.image_mounts.{image}: {relative[0]!r} is not an absolute path"
            )
    unknown = sorted(set(config.engines.programs) - set(PROGRAM_ENGINES))
    if unknown:
        raise ConfigError(
            f"{where}: engines.programs has no engine {', '.join(unknown)}; "
            f"expected {', '.join(PROGRAM_ENGINES)}"
        )
    empty = sorted(engine for engine, program in config.engines.programs.items() if not program)
    if empty:
        raise ConfigError(f"{where}: engines.programs.{empty[0]} names no program")


def with_absolute_paths(config: Config, base: Path) -> Config:
    """`config` with its relative data dir, log and LiteLLM file resolved against `base`: the
    configuration file's directory (the current one for the built-in configuration), so that
    `serve` and every other command given the same file mean the same paths."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else str((base / path).resolve())

    server = msgspec.structs.replace(
        config.server,
        data_dir=absolute(config.server.data_dir) or "",
        db=absolute(config.server.db),
    )
    litellm = msgspec.structs.replace(
        config.litellm, config_path=absolute(config.litellm.config_path)
    )
    return msgspec.structs.replace(config, server=server, litellm=litellm)
