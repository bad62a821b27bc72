"""Docker runtime: one labelled container per deployment, through aiodocker.

What a container gets:
- name `dgxmm-<deployment_id>`; labels `dgxmm.managed=1`, `dgxmm.deployment=<id>`,
  `dgxmm.port=<container port>`, `dgxmm.engine`, `dgxmm.name`.  `list_engines` finds (adopts)
  running containers by `dgxmm.managed=1`, so engines survive a DGXMM restart.
- `spec.argv` is the whole command line: Entrypoint `[argv[0]]`, Cmd `argv[1:]` (the image's
  own entrypoint and command when argv is empty).  `{port}` becomes `spec.port` and `{host}`
  `0.0.0.0` (see `dgxmm.engines.runtimes`).
- `spec.port/tcp` published on `host_ip` (127.0.0.1) at a free host port the runtime picks;
  `list_engines` reads it back from the container.
- `spec.gpu`: a device request for every NVIDIA GPU, and the host's IPC namespace (vLLM and
  SGLang share tensors through /dev/shm); without it a /dev/shm of `SHM_BYTES` (Docker's
  64 MiB is too small for vLLM's CPU build, whose engine core needs a 160 MiB shared-memory
  ring buffer; tmpfs pages count against the memory limit only once written).
  `spec.memory_bytes`: the container's memory limit
  (`enforce_memory_limit=False` turns that off).  `spec.volumes`: read-write binds
  (host path or volume name -> container path), `spec.read_only_volumes` read-only ones (a
  model given by its host path); `extra_mounts` / `extra_env`: added to every
  container (e.g. a shared model directory).
- `image_overlays`: mounts, environment and working directory added to the containers of one
  image only.  By default `dgxmm-sim:local` (scripts/make-sim-image: a nearly empty image) gets
  `host_python_overlay()`: the host's Python, the venv and the project read-only, the venv's
  bin/ first on PATH (so `python3 -m simulations.engine ...` runs the simulated engine) and the
  project as working directory.  Real engine images never see the host's files, unless the
  operator names host paths for an image (`image_mounts`, `[engines] image_mounts`), bound
  read-only at the same path: `dgxmm-vllm:local` (scripts/make-vllm-image) runs the host's
  vLLM venv that way.
- `logs_tail` ends with `oom_line()` when the kernel killed a process of the container for its
  memory limit (Docker's `State.OOMKilled`): the engine's own last words rarely say so.
- docker-init as PID 1 (`Init`), so SIGTERM reaches engines that do not handle it as PID 1;
  json-file logs capped at 2 x 16 MiB; no restart policy (the deployment actor decides).
- An image missing locally is pulled within `spec.startup_timeout_s` (`pull_missing`).

Every aiodocker/aiohttp failure and every timeout becomes `actors.errors.RuntimeFailure` with a
readable message; nothing of aiodocker leaks out of this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.util
import math
import os
import re
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import aiodocker
import aiohttp
import msgspec
import structlog
from aiodocker.exceptions import DockerError

from actors.errors import RuntimeFailure
from actors.ports import EngineHandle, LaunchSpec
from dgxmm.engines.runtimes import expand_argv, expand_env, free_port

log = structlog.get_logger(__name__)

SIM_IMAGE = "dgxmm-sim:local"  # made by scripts/make-sim-image
LABEL_MANAGED = "dgxmm.managed"
LABEL_DEPLOYMENT = "dgxmm.deployment"
LABEL_PORT = "dgxmm.port"
LABEL_ENGINE = "dgxmm.engine"
LABEL_NAME = "dgxmm.name"
CONTAINER_HOST = "0.0.0.0"  # what `{host}` means inside a container
SHM_BYTES = 1 << 30  # /dev/shm of a container without the host's IPC namespace
_GPU_REQUEST = {"Driver": "nvidia", "Count": -1, "Capabilities": [["gpu"]]}
_LOG_CONFIG = {"Type": "json-file", "Config": {"max-size": "16m", "max-file": "2"}}
_PORT_RETRIES = 3  # a free port picked by us may be taken before Docker binds it
_MAX_LOG_LINES = 10_000
_AIODOCKER_CONNECT_FAILED = 900  # aiodocker's status for "could not connect to the engine"


class BindMount(msgspec.Struct, frozen=True):
    """A host path bind-mounted into every container at `container`."""

    host: str
    container: str
    read_only: bool = True

    def bind(self) -> str:
        """The Docker `Binds` entry, `host:container:ro|rw`."""
        return f"{self.host}:{self.container}:{'ro' if self.read_only else 'rw'}"


def host_python_mounts(
    project_dir: str | os.PathLike[str],
    *,
    base_prefix: str = sys.base_prefix,
    prefix: str = sys.prefix,
) -> list[BindMount]:
    """Read-only mounts that let the host's Python and the project run in `dgxmm-sim:local`.

    The same list as `scripts/make-sim-image --mounts` (which explains each): /usr, any of
    /bin, /lib, /lib64 that is a directory rather than a symlink into /usr, the Python
    installation (`sys.base_prefix`), the project dir (with its .venv), and the venv
    (`sys.prefix`) when it lives elsewhere.
    """
    project = str(Path(project_dir).resolve())
    mounts = [BindMount("/usr", "/usr")]
    for top in ("/bin", "/lib", "/lib64"):
        if os.path.isdir(top) and not os.path.islink(top):
            mounts.append(BindMount(top, top))
    if not _under(base_prefix, "/usr"):
        mounts.append(BindMount(base_prefix, base_prefix))
    mounts.append(BindMount(project, project))
    if prefix != base_prefix and not _under(prefix, project) and not _under(prefix, "/usr"):
        mounts.append(BindMount(prefix, prefix))
    return mounts


class ImageOverlay(msgspec.Struct, frozen=True, kw_only=True):
    """What the runtime adds to every container of one image."""

    mounts: list[BindMount] = []
    env: dict[str, str] = {}
    working_dir: str | None = None


_DOCKER_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def docker_time(text: str) -> float | None:
    """Epoch seconds of one of Docker's RFC 3339 times with nanoseconds; None for the zero
    time (year 1: never) or anything else."""
    found = _DOCKER_TIME.match(text)
    if found is None or text.startswith("0001-"):
        return None
    whole, fraction, zone = found.groups()
    zone = "+00:00" if zone == "Z" else zone
    at = datetime.datetime.fromisoformat(whole + zone).timestamp()
    return at + (float("0." + fraction) if fraction else 0.0)


def host_python_overlay(project_dir: str | os.PathLike[str] | None = None) -> ImageOverlay:
    """The overlay that runs this host's Python, venv and project in `dgxmm-sim:local`.

    `project_dir` defaults to the directory that holds the `simulations` package (the
    checkout for an editable install, site-packages otherwise).
    """
    if project_dir is None:
        found = importlib.util.find_spec("simulations")  # located, not imported
        if found is None or found.origin is None:
            raise RuntimeFailure("cannot locate the simulations package for the sim image")
        project_dir = Path(found.origin).resolve().parents[1]
    project = str(Path(project_dir).resolve())
    path = f"{sys.prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {"PATH": path}
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    return ImageOverlay(mounts=host_python_mounts(project), env=env, working_dir=project)


def oom_line(limit_bytes: int) -> str:
    """The line a log tail ends with when the kernel killed a process of the container."""
    limit = f" of {limit_bytes / (1 << 30):.3g} GiB" if limit_bytes > 0 else ""
    return (
        f"dgxmm: out of memory: the kernel killed a process of the container (its limit{limit}"
        " is the deployment's declared memory)"
    )


def container_name(deployment_id: str) -> str:
    """`dgxmm-<deployment_id>`, with characters Docker refuses in names replaced by `_`."""
    return "dgxmm-" + re.sub(r"[^A-Za-z0-9_.-]", "_", deployment_id)


class DockerRuntime:
    """Starts engines as Docker containers; implements `actors.ports.Runtime`."""

    def __init__(
        self,
        *,
        url: str | None = None,
        host_ip: str = "127.0.0.1",
        extra_mounts: Sequence[BindMount] = (),
        extra_env: Mapping[str, str] | None = None,
        image_overlays: Mapping[str, ImageOverlay] | None = None,
        image_mounts: Mapping[str, Sequence[str]] | None = None,
        pull_missing: bool = True,
        enforce_memory_limit: bool = True,
        api_timeout_s: float = 60.0,
    ) -> None:
        self._url = url
        self._host_ip = host_ip
        self._extra_mounts = list(extra_mounts)
        self._extra_env = dict(extra_env or {})
        # Computed on first use: the default overlay locates the `simulations` package.
        self._image_overlays = None if image_overlays is None else dict(image_overlays)
        self._image_mounts = {
            image: [BindMount(path, path) for path in paths]
            for image, paths in (image_mounts or {}).items()
        }
        self._pull_missing = pull_missing
        self._enforce_memory_limit = enforce_memory_limit
        self._api_timeout_s = api_timeout_s
        self._client: aiodocker.Docker | None = None

    @property
    def connect_host(self) -> str:
        """The address engines' published ports are reached on."""
        return "127.0.0.1" if self._host_ip in ("0.0.0.0", "") else self._host_ip

    async def ping(self) -> None:
        """Raise `RuntimeFailure` unless the Docker engine answers."""
        docker = self._docker()
        async with self._mapped("ping the Docker engine"):
            await docker.version()

    async def launch(self, spec: LaunchSpec) -> EngineHandle:
        """Create and start the container; returns once it runs (not once it is ready)."""
        name = container_name(spec.deployment_id)
        await self._remove_leftover(name, spec.deployment_id)
        for attempt in range(1, _PORT_RETRIES + 1):
            host_port = free_port(self.connect_host)
            config = self.container_config(spec, host_port)
            container = await self._create(name, config, spec)
            try:
                async with self._mapped(f"start container {name}"):
                    await container.start()
            except RuntimeFailure as exc:
                await self._force_remove(container.id)
                if _port_taken(str(exc)) and attempt < _PORT_RETRIES:
                    log.info("engine_port_taken", deployment=spec.deployment_id, port=host_port)
                    continue
                raise
            log.info(
                "engine_launched",
                deployment=spec.deployment_id,
                container=container.id[:12],
                port=host_port,
            )
            return EngineHandle(
                deployment_id=spec.deployment_id,
                host=self.connect_host,
                port=host_port,
                runtime_id=container.id,
            )
        raise AssertionError("unreachable")  # pragma: no cover

    async def stop(self, handle: EngineHandle, timeout_s: float = 30.0) -> None:
        """Stop (SIGTERM, SIGKILL after `timeout_s`) and remove the container; idempotent."""
        docker = self._docker()
        container = docker.containers.container(handle.runtime_id)
        wait_s = max(0, math.ceil(timeout_s))
        try:
            async with self._mapped(f"stop container {handle.runtime_id[:12]}", wait_s):
                await container.stop(t=wait_s)
        except _NotFound:
            return
        await self._force_remove(handle.runtime_id)
        log.info(
            "engine_stopped", deployment=handle.deployment_id, container=handle.runtime_id[:12]
        )

    async def is_running(self, handle: EngineHandle) -> bool:
        """Whether the container exists and runs."""
        info = await self._inspect(handle.runtime_id)
        return info is not None and bool(info.get("State", {}).get("Running"))

    async def exited_at(self, handle: EngineHandle) -> float | None:
        """When the container's process exited (`State.FinishedAt`, set by the daemon once it
        saw the exit, so never before it); None while it runs or once it is removed
        (`actors.ports.ExitTimes`)."""
        info = await self._inspect(handle.runtime_id)
        if info is None:
            return None
        state = info.get("State", {})
        if state.get("Running") or state.get("Restarting"):
            return None
        return docker_time(str(state.get("FinishedAt") or ""))

    async def wait_exited(self, handle: EngineHandle) -> None:
        """Return once the container has stopped or is gone (Docker's `wait` endpoint)."""
        container = self._docker().containers.container(handle.runtime_id)
        try:
            # No deadline of our own: the wait lasts as long as the engine runs.
            async with self._mapped(f"wait for container {handle.runtime_id[:12]}", math.inf):
                await container.wait(condition="not-running")
        except _NotFound:
            return

    async def list_engines(self) -> list[EngineHandle]:
        """Running containers labelled `dgxmm.managed=1`, with their published ports."""
        docker = self._docker()
        async with self._mapped("list containers"):
            containers = await docker.containers.list(
                filters={"label": [f"{LABEL_MANAGED}=1"], "status": ["running"]}
            )
        handles: list[EngineHandle] = []
        for container in containers:
            summary: dict[str, Any] = container._container
            labels: dict[str, str] = summary.get("Labels") or {}
            deployment_id = labels.get(LABEL_DEPLOYMENT)
            port = _published_port(summary.get("Ports") or [], labels.get(LABEL_PORT))
            if not deployment_id or port is None:
                log.warning("engine_unadoptable", container=container.id[:12], labels=labels)
                continue
            handles.append(
                EngineHandle(
                    deployment_id=deployment_id,
                    host=self.connect_host,
                    port=port,
                    runtime_id=container.id,
                )
            )
        return handles

    async def logs_tail(self, handle: EngineHandle, lines: int = 20) -> str:
        """The last `lines` lines of the container's stdout/stderr ('' if it is gone)."""
        if lines <= 0:
            return ""
        docker = self._docker()
        container = docker.containers.container(handle.runtime_id)
        try:
            async with self._mapped(f"read the logs of {handle.runtime_id[:12]}"):
                chunks = await container.log(
                    stdout=True, stderr=True, tail=min(lines, _MAX_LOG_LINES)
                )
        except _NotFound:
            return ""
        tail = "".join(chunks).splitlines()[-lines:]
        # A process the kernel killed for the memory limit writes nothing about it.
        info = await self._inspect(handle.runtime_id)
        if info is not None and info.get("State", {}).get("OOMKilled"):
            limit = int(info.get("HostConfig", {}).get("Memory") or 0)
            tail = [*tail[1 - lines :], oom_line(limit)] if lines > 1 else [oom_line(limit)]
        return "\n".join(tail)

    async def logs_follow(self, deployment_id: str, lines: int) -> AsyncIterator[str]:
        """The container's last `lines` lines, then what it writes, until it stops.

        Text comes in the pieces Docker sends (not always whole lines).  RuntimeFailure
        when there is no such container or the engine cannot be reached.
        """
        docker = self._docker()
        container = docker.containers.container(container_name(deployment_id))
        action = f"follow the logs of {container_name(deployment_id)}"
        stream = container.log(
            stdout=True, stderr=True, follow=True, tail=max(0, min(lines, _MAX_LOG_LINES))
        )
        try:
            async for piece in stream:  # no deadline: a quiet engine writes nothing for hours
                yield piece
        except DockerError as exc:
            if exc.status == 404:
                raise _NotFound(f"docker: {action}: {_docker_message(exc)}") from exc
            raise RuntimeFailure(f"docker: {action}: {_docker_message(exc)}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise RuntimeFailure(f"docker: {action}: {exc or type(exc).__name__}") from exc
        finally:
            await cast(AsyncGenerator[str, None], stream).aclose()

    async def close(self) -> None:
        """Close the connection to the Docker engine; containers keep running."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                await client.close()

    # -- internals -------------------------------------------------------------------------

    def _docker(self) -> aiodocker.Docker:
        # Made on first use, inside the running loop (aiohttp binds its session to it).
        if self._client is None:
            try:
                self._client = aiodocker.Docker(url=self._url)
            except (ValueError, OSError) as exc:
                raise RuntimeFailure(f"docker: no Docker engine to talk to: {exc}") from exc
        return self._client

    @contextlib.asynccontextmanager
    async def _mapped(self, action: str, extra_s: float = 0.0) -> AsyncIterator[None]:
        """Bound the call with a deadline; turn every library error into RuntimeFailure."""
        deadline = self._api_timeout_s + extra_s
        try:
            async with asyncio.timeout(None if math.isinf(deadline) else deadline):
                yield
        except DockerError as exc:
            if exc.status == 404:
                raise _NotFound(f"docker: {action}: {_docker_message(exc)}") from exc
            if exc.status == _AIODOCKER_CONNECT_FAILED:
                raise RuntimeFailure(
                    f"docker: {action}: cannot reach the Docker engine ({_docker_message(exc)})"
                ) from exc
            raise RuntimeFailure(
                f"docker: {action}: {_docker_message(exc)} (HTTP {exc.status})"
            ) from exc
        except TimeoutError as exc:
            raise RuntimeFailure(
                f"docker: {action}: the Docker engine did not answer within {deadline:.0f}s"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise RuntimeFailure(
                f"docker: {action}: cannot reach the Docker engine ({exc or type(exc).__name__})"
            ) from exc

    async def _inspect(self, container_id: str) -> dict[str, Any] | None:
        docker = self._docker()
        try:
            async with self._mapped(f"inspect container {container_id[:12]}"):
                container = await docker.containers.get(container_id)
        except _NotFound:
            return None
        info: dict[str, Any] = container._container
        return info

    async def _remove_leftover(self, name: str, deployment_id: str) -> None:
        """Remove a stopped container left with our name; refuse if one still runs."""
        info = await self._inspect(name)
        if info is None:
            return
        if info.get("State", {}).get("Running"):
            raise RuntimeFailure(
                f"deployment {deployment_id} already has a running container {name} "
                f"({str(info.get('Id', ''))[:12]})"
            )
        await self._force_remove(str(info.get("Id") or name))

    async def _force_remove(self, container_id: str) -> None:
        docker = self._docker()
        container = docker.containers.container(container_id)
        try:
            async with self._mapped(f"remove container {container_id[:12]}"):
                await container.delete(force=True, v=True)
        except _NotFound:
            return
        except RuntimeFailure as exc:
            if "already in progress" not in str(exc):
                raise

    async def _create(
        self, name: str, config: dict[str, Any], spec: LaunchSpec
    ) -> aiodocker.containers.DockerContainer:
        docker = self._docker()
        try:
            async with self._mapped(f"create container {name}"):
                return await docker.containers.create(config, name=name)
        except _NotFound as exc:
            if not self._pull_missing:
                raise RuntimeFailure(
                    f"docker: image {spec.image} is not present locally and pulling is off"
                ) from exc
        log.info("engine_image_pull", deployment=spec.deployment_id, image=spec.image)
        async with self._mapped(f"pull image {spec.image}", spec.startup_timeout_s):
            await docker.images.pull(spec.image)
        async with self._mapped(f"create container {name}"):
            return await docker.containers.create(config, name=name)

    def container_config(self, spec: LaunchSpec, host_port: int) -> dict[str, Any]:
        """The container's create body (Docker Engine API)."""
        port_key = f"{spec.port}/tcp"
        overlay = self._overlays().get(spec.image, ImageOverlay())
        argv = expand_argv(spec.argv, host=CONTAINER_HOST, port=spec.port)
        env = {
            **overlay.env,
            **self._extra_env,
            **expand_env(spec.env, host=CONTAINER_HOST, port=spec.port),
        }
        mounts = [*overlay.mounts, *self._image_mounts.get(spec.image, ()), *self._extra_mounts]
        binds = [m.bind() for m in mounts]
        binds += [f"{src}:{dst}:rw" for src, dst in spec.volumes.items()]
        binds += [f"{src}:{dst}:ro" for src, dst in spec.read_only_volumes.items()]
        host_config: dict[str, Any] = {
            "PortBindings": {port_key: [{"HostIp": self._host_ip, "HostPort": str(host_port)}]},
            "Binds": binds,
            "Init": True,
            "LogConfig": _LOG_CONFIG,
            "RestartPolicy": {"Name": "no"},
        }
        if spec.gpu:
            host_config["DeviceRequests"] = [_GPU_REQUEST]
            host_config["IpcMode"] = "host"
        else:
            host_config["ShmSize"] = SHM_BYTES
        if spec.memory_bytes > 0 and self._enforce_memory_limit:
            host_config["Memory"] = spec.memory_bytes
        config: dict[str, Any] = {
            "Image": spec.image,
            "Env": [f"{key}={value}" for key, value in env.items()],
            "Labels": {
                LABEL_MANAGED: "1",
                LABEL_DEPLOYMENT: spec.deployment_id,
                LABEL_PORT: str(spec.port),
                LABEL_ENGINE: spec.engine,
                LABEL_NAME: spec.name,
            },
            "ExposedPorts": {port_key: {}},
            "HostConfig": host_config,
        }
        if argv:
            config["Entrypoint"] = argv[:1]
            config["Cmd"] = argv[1:]
        if overlay.working_dir:
            config["WorkingDir"] = overlay.working_dir
        return config

    def _overlays(self) -> dict[str, ImageOverlay]:
        if self._image_overlays is None:
            self._image_overlays = {SIM_IMAGE: host_python_overlay()}
        return self._image_overlays


class _NotFound(RuntimeFailure):
    """Docker answered 404 (no such container or image); handled inside this module."""


def _docker_message(exc: DockerError) -> str:
    message = exc.message
    if isinstance(message, dict):  # some aiodocker paths keep the JSON body
        message = message.get("message", message)
    return str(message).strip()


def _port_taken(message: str) -> bool:
    return "port is already allocated" in message or "address already in use" in message


def _published_port(ports: list[dict[str, Any]], private: str | None) -> int | None:
    """The host port a container publishes for its engine port (from `docker ps` data)."""
    for entry in ports:
        if entry.get("Type") != "tcp" or "PublicPort" not in entry:
            continue
        if private is None or str(entry.get("PrivatePort")) == private:
            return int(entry["PublicPort"])
    return None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


__all__ = [
    "SIM_IMAGE",
    "BindMount",
    "DockerRuntime",
    "ImageOverlay",
    "container_name",
    "host_python_mounts",
    "host_python_overlay",
    "oom_line",
]
