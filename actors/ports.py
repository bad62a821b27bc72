"""The small protocols the actors call; `dgxmm/` implements them, simulations fake them.

Everything that crosses from the actors to the outside world (containers, engine HTTP
endpoints, LiteLLM) goes through one of these.  Implementations map their library's
exceptions to the errors in `actors.errors` at the edge.
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import msgspec


class LaunchSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a runtime needs to start one engine for one deployment."""

    deployment_id: str
    name: str
    engine: str  # "vllm" | "llamacpp" | "sglang" | "sim"
    image: str  # container image (docker runtime); ignored by the process runtime
    argv: list[str]  # the engine's command line (inside the container, or the local process)
    port: int  # the port the engine listens on inside its container / process
    env: dict[str, str] = {}
    memory_bytes: int = 0
    gpu: bool = False  # request the GPU (docker: device request for all GPUs)
    volumes: dict[str, str] = {}  # host path -> container path (model caches)
    read_only_volumes: dict[str, str] = {}  # host path -> container path (a local model)
    startup_timeout_s: float = 1200.0


class EngineHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A running engine: where to reach it, and how the runtime names it."""

    deployment_id: str
    host: str
    port: int  # host port on which the engine answers HTTP
    runtime_id: str  # container id, or "pid:<n>" for the process runtime

    @property
    def base_url(self) -> str:
        """`http://host:port`, the engine's root (without `/v1`)."""
        return f"http://{self.host}:{self.port}"


@runtime_checkable
class ExitTimes(Protocol):
    """A runtime that knows when an engine's process exited (the Docker runtime does).

    The gateway asks, through the controller, whether an engine it sent a request to had
    exited before the request went out: through Docker's port proxy a connection to a dead
    container is accepted and then closed, and only this proves the request never reached
    the engine (docs/on-demand-gateway.md, "Resending")."""

    async def exited_at(self, handle: EngineHandle) -> float | None:
        """Epoch seconds at which the engine's process exited; None while it runs, or when
        it is not known (the container is gone)."""
        ...


class Runtime(Protocol):
    """Starts and stops engines.  `docker` (aiodocker) and `process` implement it."""

    async def launch(self, spec: LaunchSpec) -> EngineHandle:
        """Create and start the engine; returns once the container/process runs (not ready)."""
        ...

    async def stop(self, handle: EngineHandle, timeout_s: float = 30.0) -> None:
        """Stop (SIGTERM, then SIGKILL after timeout_s) and remove it; idempotent."""
        ...

    async def is_running(self, handle: EngineHandle) -> bool:
        """Whether the container/process still runs."""
        ...

    async def wait_exited(self, handle: EngineHandle) -> None:
        """Return once the engine has exited (at once if it is gone); cancel to stop waiting.

        Raises `actors.errors.RuntimeFailure` when the runtime cannot watch it.
        """
        ...

    async def list_engines(self) -> list[EngineHandle]:
        """Every engine this runtime started that still runs (docker: label dgxmm.deployment)."""
        ...

    async def logs_tail(self, handle: EngineHandle, lines: int = 20) -> str:
        """The last lines of the engine's output, for a failed start's reason."""
        ...

    async def close(self) -> None:
        """Release the runtime's own resources (does not stop engines)."""
        ...


class Readiness(enum.Enum):
    """What an engine's health endpoint says."""

    DOWN = "down"  # connection refused / no answer (vLLM, SGLang while loading)
    LOADING = "loading"  # HTTP up but not ready (llama.cpp 503 "Loading model", SGLang warm-up)
    READY = "ready"


class EngineLoad(msgspec.Struct, frozen=True):
    """Requests the engine itself reports, from its Prometheus metrics."""

    running: int
    waiting: int

    @property
    def busy(self) -> bool:
        """True when the engine reports any running or waiting request."""
        return self.running > 0 or self.waiting > 0


class EngineProbe(Protocol):
    """Talks to an engine's own endpoints directly (never through the gateway)."""

    async def readiness(self, engine: str, handle: EngineHandle) -> Readiness:
        """Probe `/health` the way this engine flavour answers it."""
        ...

    async def load(self, engine: str, handle: EngineHandle) -> EngineLoad | None:
        """Scrape `/metrics`; None when they cannot be read."""
        ...

    async def is_sleeping(self, engine: str, handle: EngineHandle) -> bool:
        """vLLM `GET /is_sleeping`; False for engines without sleep mode."""
        ...

    async def wake_up(self, engine: str, handle: EngineHandle) -> None:
        """vLLM `POST /wake_up` (a request woke an engine put to sleep by hand)."""
        ...


class ModelEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of LiteLLM's model list, as DGXMM wants it."""

    model_id: str  # stable model_info.id: "dgxmm-<deployment_id>" (or "...-gw" for gateway)
    model_name: str  # the name clients use
    api_base: str  # engine `http://h:p/v1` or gateway `http://h:p/d/<id>/v1`
    upstream_model: str  # the model name the engine serves
    via_gateway: bool
    timeout_s: float | None = None
    deployment_id: str = ""


class MemorySource(Protocol):
    """Real free memory, for the watchdog (MemAvailable, or the GPU's free memory)."""

    async def free_bytes(self) -> int:
        """Free memory right now, in bytes."""
        ...
