"""Engine adapters: how to launch vLLM, llama.cpp, SGLang and the simulated engine, and probe them.

A probe reads an engine's health, load and sleep state (facts in notes/engines.md).

The launch side and the parsers are pure functions; `HttpEngineProbe` is the only part that
does I/O, and it maps every transport failure to `actors.errors.EngineUnreachable`.

Command lines say `--host {host} --port {port}`: the runtimes fill those in (docker: 0.0.0.0
and `LaunchSpec.port` inside the container; process: 127.0.0.1 and a free port), see
`dgxmm.engines.runtimes`.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec

from actors.errors import EngineUnreachable
from actors.ports import EngineHandle, EngineLoad, LaunchSpec, Readiness
from dgxmm.engines.runtimes import HOST_PLACEHOLDER, PORT_PLACEHOLDER
from events.state import DeploymentState
from gateway import client

ENGINES = ("vllm", "llamacpp", "sglang", "sim")
DEFAULT_STARTUP_TIMEOUT_S = 1200.0
DEFAULT_CACHE_ROOT = os.path.join(os.path.expanduser("~"), ".cache")
CONTAINER_CACHE = "/root/.cache"


class UnknownEngine(ValueError):
    """The engine name is none of `ENGINES`."""


class InvalidEngineArgs(ValueError):
    """User arguments that would break what the adapter controls (host, port)."""


@dataclass(frozen=True)
class EngineAdapter:
    """What DGXMM knows about one engine, apart from its command line."""

    engine: str
    image: str  # default image; `EngineSettings.images` overrides it
    port: int  # where it listens inside its container (sim: the default, any port works)
    gpu: bool
    caches: tuple[str, ...]  # directories under /root/.cache kept on the host
    env: tuple[tuple[str, str], ...]
    sleep_mode: bool  # serves GET /is_sleeping (vLLM; the sim may be a vLLM)
    program: str  # argv[0] inside its image (docker runtime)
    local_program: str  # argv[0] looked up on PATH (process runtime), unless configured


ADAPTERS: dict[str, EngineAdapter] = {
    "vllm": EngineAdapter(
        engine="vllm",
        image="vllm/vllm-openai",
        port=8000,
        gpu=True,
        caches=("huggingface", "vllm"),
        env=(
            ("HF_HOME", f"{CONTAINER_CACHE}/huggingface"),
            ("VLLM_CACHE_ROOT", f"{CONTAINER_CACHE}/vllm"),
        ),
        sleep_mode=True,
        program="vllm",
        local_program="vllm",
    ),
    "llamacpp": EngineAdapter(
        engine="llamacpp",
        image="ghcr.io/ggml-org/llama.cpp:server-cuda13",
        port=8080,
        gpu=True,
        caches=("huggingface", "llama.cpp"),
        env=(
            ("HF_HOME", f"{CONTAINER_CACHE}/huggingface"),
            ("LLAMA_CACHE", f"{CONTAINER_CACHE}/llama.cpp"),
        ),
        sleep_mode=False,
        program="/app/llama-server",
        local_program="llama-server",
    ),
    "sglang": EngineAdapter(
        engine="sglang",
        image="lmsysorg/sglang",
        port=30000,
        gpu=True,
        caches=("huggingface",),
        env=(("HF_HOME", f"{CONTAINER_CACHE}/huggingface"),),
        sleep_mode=False,
        program="python3",
        local_program="python3",
    ),
    "sim": EngineAdapter(
        engine="sim",
        image="dgxmm-sim:local",
        port=8000,
        gpu=False,
        caches=(),
        env=(("PYTHONUNBUFFERED", "1"),),
        sleep_mode=True,
        program="python3",  # `EngineSettings.sim_python` decides
        local_program="python3",
    ),
}


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Host-wide launch settings (from the config file); every field has a default."""

    images: dict[str, str] = {}  # engine -> image, overriding the adapter's default
    sim_image: str = "dgxmm-sim:local"
    sim_python: str = "python3"  # the interpreter that runs `-m simulations.engine`
    sim_flavour: str = "vllm"  # used unless the user arguments pass --flavour
    cache_root: str = DEFAULT_CACHE_ROOT  # host directory holding huggingface/, vllm/, ...
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    extra_env: dict[str, str] = {}  # e.g. HF_TOKEN, added to every engine
    # Process runtime: engines run on this host, their programs found on PATH unless
    # `programs` names them (engine -> path, or a command, see `launcher`).  Docker: the
    # image's own path, always.
    local: bool = False
    programs: dict[str, str | list[str]] = {}
    gpu: bool = True  # False: no GPU request even for GPU engines (a host without one)


DEFAULT_SETTINGS = EngineSettings()


def program(engine: str, settings: EngineSettings = DEFAULT_SETTINGS) -> str:
    """The engine's argv[0]: its path in the image, or the configured / PATH-found program."""
    spec = adapter(engine)
    if engine == "sim":
        return settings.sim_python
    if not settings.local:
        return spec.program
    configured = settings.programs.get(engine)
    if isinstance(configured, list):
        return configured[0] if configured else spec.local_program
    return configured or spec.local_program


def launcher(engine: str, settings: EngineSettings = DEFAULT_SETTINGS) -> list[str] | None:
    """A configured command (process runtime) that launches the engine, the model's options
    following it, e.g. `["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]`;
    None when the engine's program is a path (or found on PATH) and the adapter adds its own
    words (`vllm serve MODEL`, `python3 -m sglang.launch_server`)."""
    configured = settings.programs.get(engine) if settings.local else None
    return list(configured) if isinstance(configured, list) and configured else None


def program_problem(engine: str, argv0: str, path: str | None = None) -> str | None:
    """Why `argv0` cannot run on this host (None if it can); says which key to set.

    `path` is the PATH it is looked up on (default: this process's).
    """
    found = shutil.which(argv0, path=path)
    if found is not None:
        return None
    key = f'[engines] programs = {{{engine} = "/path/to/{os.path.basename(argv0)}"}}'
    if os.sep in argv0:
        why = "not an executable file" if os.path.exists(argv0) else "no such file"
        return f"cannot run {argv0!r}: {why}; fix {key} in the configuration"
    return f"cannot run {argv0!r}: not found on PATH; install it or set {key} in the configuration"


def adapter(engine: str) -> EngineAdapter:
    """The adapter for `engine`; raises `UnknownEngine`."""
    try:
        return ADAPTERS[engine]
    except KeyError:
        raise UnknownEngine(f"unknown engine {engine!r}; expected one of {ENGINES}") from None


def _has_flag(args: Sequence[str], *flags: str) -> bool:
    return any(a in flags or a.split("=", 1)[0] in flags for a in args)


def command_line(
    engine: str,
    model: str,
    args: Sequence[str] = (),
    *,
    settings: EngineSettings = DEFAULT_SETTINGS,
) -> list[str]:
    """The engine's full command line (argv[0] included), with `{host}`/`{port}` placeholders."""
    adapter(engine)
    if not model:
        raise InvalidEngineArgs("a model is required")
    if _has_flag(args, "--port", "--host"):
        raise InvalidEngineArgs("--host and --port are set by DGXMM; remove them from the args")
    listen = ["--host", HOST_PLACEHOLDER, "--port", PORT_PLACEHOLDER]
    user = list(args)
    command = launcher(engine, settings)
    match engine:
        case "vllm":
            # `vllm serve MODEL`; a command (the OpenAI server module) takes `--model MODEL`.
            serve = [*command, "--model"] if command else [program(engine, settings), "serve"]
            return [*serve, model, *listen, *user]
        case "llamacpp":
            local = model.startswith(("/", "./")) or model.endswith(".gguf")
            metrics = [] if _has_flag(args, "--metrics") else ["--metrics"]
            argv0 = command or [program(engine, settings)]
            return [*argv0, "-m" if local else "-hf", model, *listen, *metrics, *user]
        case "sglang":
            metrics = [] if _has_flag(args, "--enable-metrics") else ["--enable-metrics"]
            launch = command or [program(engine, settings), "-m", "sglang.launch_server"]
            return [*launch, "--model-path", model, *listen, *metrics, *user]
        case _:
            flavour = (
                []
                if _has_flag(args, "--flavour", "--flavor")
                else [
                    "--flavour",
                    settings.sim_flavour,
                ]
            )
            metrics = [] if _has_flag(args, "--metrics", "--enable-metrics") else ["--metrics"]
            sim = [settings.sim_python, "-m", "simulations.engine", "--model", model]
            return [*sim, *flavour, *listen, *metrics, *user]


def launch_spec(
    deployment_id: str,
    name: str,
    engine: str,
    model: str,
    memory_bytes: int,
    args: Sequence[str] = (),
    *,
    port: int | None = None,
    image: str | None = None,
    settings: EngineSettings = DEFAULT_SETTINGS,
) -> LaunchSpec:
    """Everything a runtime needs to start `model` on `engine` for one deployment.

    `port` overrides the adapter's container port (docker); the process runtime picks its own.
    `image` (the deployment's own) overrides the configured and the default image.
    """
    spec = adapter(engine)
    env = dict(spec.env)
    if engine == "vllm" and _has_flag(args, "--enable-sleep-mode"):
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep, /wake_up, /is_sleeping
    env.update(settings.extra_env)
    if image is None:
        image = settings.sim_image if engine == "sim" else settings.images.get(engine, spec.image)
    volumes = {
        os.path.join(settings.cache_root, cache): f"{CONTAINER_CACHE}/{cache}"
        for cache in spec.caches
    }
    # A model given by its absolute host path is visible in the container at the same path.
    model_mount = {} if engine == "sim" or settings.local else _model_mount(model)
    return LaunchSpec(
        deployment_id=deployment_id,
        name=name,
        engine=engine,
        image=image,
        argv=command_line(engine, model, args, settings=settings),
        port=port or spec.port,
        env=env,
        memory_bytes=memory_bytes,
        gpu=spec.gpu and settings.gpu,
        volumes=volumes,
        read_only_volumes=model_mount,
        startup_timeout_s=settings.startup_timeout_s,
    )


def _model_mount(model: str) -> dict[str, str]:
    """The read-only bind that shows a host model path in a container: a file's directory
    (`/models/gemma.gguf` -> `/models`), or the model directory itself."""
    if not os.path.isabs(model):
        return {}  # a hub id or a path inside the image
    path = os.path.normpath(model)
    where = os.path.dirname(path) if os.path.splitext(path)[1] else path
    return {} if where == "/" else {where: where}


# --------------------------------------------------------------------------- parsers


def iter_samples(text: str, names: frozenset[str]) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus text whose name is in `names`."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        cut = len(line)
        for stop in ("{", " ", "\t"):
            found = line.find(stop)
            if found != -1:
                cut = min(cut, found)
        name = line[:cut]
        if name not in names:
            continue
        try:
            labels, rest = _labels(line, cut)
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue  # one malformed line does not hide the others
        if math.isfinite(value):
            yield name, labels, value


def _labels(line: str, at: int) -> tuple[dict[str, str], str]:
    if at >= len(line) or line[at] != "{":
        return {}, line[at:]
    labels: dict[str, str] = {}
    i = at + 1
    while True:
        while i < len(line) and line[i] in " ,":
            i += 1
        if i >= len(line):
            raise ValueError("unterminated label set")
        if line[i] == "}":
            return labels, line[i + 1 :]
        eq = line.index("=", i)
        key = line[i:eq].strip()
        if line[eq + 1] != '"':
            raise ValueError("label value must be quoted")
        i = eq + 2
        value: list[str] = []
        while line[i] != '"':
            if line[i] == "\\":
                i += 1
                value.append("\n" if line[i] == "n" else line[i])
            else:
                value.append(line[i])
            i += 1
        labels[key] = "".join(value)
        i += 1


def _count(value: float) -> int:
    return max(0, round(value))


_VLLM = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})
_LLAMACPP = frozenset({"llamacpp:requests_processing", "llamacpp:requests_deferred"})
_SGLANG = frozenset({"sglang:num_running_reqs", "sglang:num_queue_reqs"})


def _summed(text: str, running: str, waiting: str) -> EngineLoad | None:
    totals: dict[str, float] = {}
    for name, _, value in iter_samples(text, frozenset({running, waiting})):
        totals[name] = totals.get(name, 0.0) + value
    if running not in totals or waiting not in totals:
        return None
    return EngineLoad(running=_count(totals[running]), waiting=_count(totals[waiting]))


def _sglang(text: str) -> EngineLoad | None:
    # Each dp rank reports once per tp (and pp) rank, all the same number: max per dp rank,
    # then the sum over dp ranks.
    per_rank: dict[str, dict[str, float]] = {}
    for name, labels, value in iter_samples(text, _SGLANG):
        ranks = per_rank.setdefault(name, {})
        dp = labels.get("dp_rank", "")
        ranks[dp] = max(ranks.get(dp, value), value)
    if len(per_rank) != 2:
        return None
    running = sum(per_rank["sglang:num_running_reqs"].values())
    waiting = sum(per_rank["sglang:num_queue_reqs"].values())
    return EngineLoad(running=_count(running), waiting=_count(waiting))


def parse_load(engine: str, exposition: str) -> EngineLoad | None:
    """Running/waiting requests from an engine's /metrics text; None if they are not there."""
    adapter(engine)
    if engine == "vllm":
        return _summed(exposition, "vllm:num_requests_running", "vllm:num_requests_waiting")
    if engine == "llamacpp":
        return _summed(exposition, "llamacpp:requests_processing", "llamacpp:requests_deferred")
    if engine == "sglang":
        return _sglang(exposition)
    for flavour in ("vllm", "llamacpp", "sglang"):  # the sim speaks one of the three
        load = parse_load(flavour, exposition)
        if load is not None:
            return load
    return None


def readiness_from(engine: str, status: int | None, body: bytes) -> Readiness:
    """Readiness from GET /health's status (None: connection refused / no answer) and body."""
    adapter(engine)
    if status is None:
        return Readiness.DOWN
    if status == 200:
        return Readiness.READY
    if engine == "vllm":
        # vLLM only answers HTTP once loaded; a failing /health means its engine core died.
        return Readiness.DOWN
    if engine == "llamacpp" and status == 503 and b"no slot available" in body:
        return Readiness.READY  # old llama-server: loaded, every slot busy
    return Readiness.LOADING  # llama.cpp "Loading model", SGLang warm-up


def sleeping_from(status: int, body: bytes) -> bool:
    """vLLM's GET /is_sleeping answer; anything but 200 {"is_sleeping": true} is awake."""
    if status != 200:
        return False
    try:
        parsed = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(parsed, dict) and parsed.get("is_sleeping") is True


# --------------------------------------------------------------------------- probe


class HttpEngineProbe:
    """`actors.ports.EngineProbe` over HTTP/1.1, straight to the engine's port.

    readiness: DOWN when nothing answers (refused, reset, timed out), else from /health.
    load: None when /metrics is not 200 or lacks the series.  is_sleeping: False for
    engines without sleep mode or a non-200 answer.  Other transport failures (unknown
    host, garbage instead of HTTP, load/is_sleeping on an engine that does not answer)
    raise `EngineUnreachable`.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        timeout_s: float = 5.0,
        max_body_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._max_body_bytes = max_body_bytes

    async def readiness(self, engine: str, handle: EngineHandle) -> Readiness:
        """Probe `/health` the way this engine flavour answers it."""
        adapter(engine)
        try:
            response = await self._get(handle, "/health")
        except (
            client.ConnectionRefused,
            client.ConnectionDropped,
            client.RequestTimedOut,
        ):
            return Readiness.DOWN
        except client.HttpClientError as exc:
            raise EngineUnreachable(str(exc)) from exc
        return readiness_from(engine, response.status, response.body)

    async def load(self, engine: str, handle: EngineHandle) -> EngineLoad | None:
        """Scrape `/metrics`; None when they cannot be read."""
        adapter(engine)
        response = await self._fetch(handle, "/metrics")
        if response.status != 200:
            return None
        return parse_load(engine, response.body.decode("utf-8", "replace"))

    async def is_sleeping(self, engine: str, handle: EngineHandle) -> bool:
        """vLLM `GET /is_sleeping`; False for engines without sleep mode."""
        if not adapter(engine).sleep_mode:
            return False
        response = await self._fetch(handle, "/is_sleeping")
        return sleeping_from(response.status, response.body)

    async def wake_up(self, engine: str, handle: EngineHandle) -> None:
        """vLLM `POST /wake_up`; nothing for engines without sleep mode."""
        if not adapter(engine).sleep_mode:
            return
        response = await self._fetch(handle, "/wake_up", method="POST")
        if response.status >= 300:
            raise EngineUnreachable(f"{handle.base_url}/wake_up answered {response.status}")

    async def _fetch(
        self, handle: EngineHandle, target: str, method: str = "GET"
    ) -> client.Response:
        try:
            return await self._get(handle, target, method)
        except client.HttpClientError as exc:
            raise EngineUnreachable(str(exc)) from exc

    async def _get(self, handle: EngineHandle, target: str, method: str = "GET") -> client.Response:
        return await client.request(
            handle.host,
            handle.port,
            method,
            target,
            connect_timeout_s=self._connect_timeout_s,
            timeout_s=self._timeout_s,
            max_body_bytes=self._max_body_bytes,
        )


def launch_spec_for(
    dep: DeploymentState, settings: EngineSettings = DEFAULT_SETTINGS
) -> LaunchSpec:
    """The launch spec of a deployment as the event log describes it."""
    return launch_spec(
        dep.deployment_id,
        dep.name,
        dep.engine,
        dep.model,
        dep.memory_bytes,
        dep.args,
        image=dep.image,
        settings=settings,
    )
