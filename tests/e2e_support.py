"""One DGXMM wired as `dgxmm.app.App` wires it, minus the HTTP servers, for end-to-end tests.

`Box` holds a real event log (SQLite in a tmp dir), a real runtime (docker or process), the
real `HttpEngineProbe`, a `MemoryBroker` and the `Controller`, with the launch specs of
`dgxmm.engines.adapters` for the `sim` engine.  Tests drive the controller the way the admin API
does, restart DGXMM on the same log and data dir, and kill engines behind its back.

The clock is the system clock, or a `VirtualClock` that `Box.until` moves forward while it
polls: the real engines and Docker then run in real time while the actors' timers (metrics
every 5 s, the 60 s restart backoff) run on virtual time.

Docker is shared with other tests (and other engineers' runs): a box adopts, and stops as
orphans, only the containers of deployments its own log knows (`OwnedDockerRuntime`).
Without a Docker engine the docker tests skip; under CI=true that is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import pytest

from actors.controller import Controller, DeploymentSpec
from actors.deployment import DeploymentActor
from actors.memory_broker import GIB, MemoryBroker
from actors.ports import EngineHandle, LaunchSpec, Runtime
from actors.runtime import Clock, SystemClock, VirtualClock
from dgxmm.engines import adapters as engines
from dgxmm.engines.runtimes.docker import LABEL_DEPLOYMENT, SIM_IMAGE, DockerRuntime
from dgxmm.engines.runtimes.process import ProcessRuntime
from events import model as m
from events.state import DeploymentState
from gateway import client
from storage.eventlog import EventStore

RuntimeKind = Literal["docker", "process"]
E = TypeVar("E", bound=m.Event)
PROJECT_DIR = Path(__file__).resolve().parents[1]
DEADLINE_S = 45.0
POLL_S = 0.05  # real seconds between two looks while polling
VIRTUAL_STEP_S = 0.25  # virtual seconds a poll moves a VirtualClock forward


# --- Docker: is it there, and whose containers are these ---------------------------------


def docker_problem() -> str | None:
    """Why the Docker tests cannot run here, or None when they can."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        info = subprocess.run(
            ["docker", "info"], capture_output=True, text=True, timeout=20, check=False
        )
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 20 s"
    if info.returncode != 0:
        return f"no Docker engine answers `docker info`: {info.stderr.strip()[:200]}"
    image = subprocess.run(
        ["docker", "image", "inspect", SIM_IMAGE], capture_output=True, timeout=20, check=False
    )
    if image.returncode != 0:
        return f"image {SIM_IMAGE} is missing (scripts/make-sim-image makes it)"
    return None


def require_docker() -> None:
    """Skip without Docker (with the reason) locally; under CI a missing engine fails."""
    problem = docker_problem()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI needs a Docker engine: {problem} (scripts/bootstrap starts one)")
    pytest.skip(f"{problem}; run scripts/bootstrap")


def docker_inspect(name_or_id: str) -> dict[str, Any] | None:
    """`docker inspect` through the CLI (independent of aiodocker); None if there is none."""
    out = subprocess.run(
        ["docker", "inspect", name_or_id], capture_output=True, text=True, timeout=20, check=False
    )
    if out.returncode != 0:
        return None
    found: list[dict[str, Any]] = json.loads(out.stdout)
    return found[0] if found else None


def docker_containers_of(deployment_id: str) -> list[str]:
    """Ids of every container (running or not) labelled for `deployment_id`."""
    out = subprocess.run(
        [
            "docker",
            "ps",
            "-aq",
            "--no-trunc",
            "--filter",
            f"label={LABEL_DEPLOYMENT}={deployment_id}",
        ],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    return out.stdout.split()


def remove_containers_of(deployment_ids: Iterable[str]) -> None:
    """`docker rm -f` every container (running or not) of these deployments."""
    for dep_id in deployment_ids:
        for container in docker_containers_of(dep_id):
            subprocess.run(
                ["docker", "rm", "-f", container], capture_output=True, timeout=60, check=False
            )


class OwnedDockerRuntime(DockerRuntime):
    """The real docker runtime, seeing only the containers of deployments this box knows.

    The Docker engine is shared: without this, a test's reconciliation would adopt or stop
    as orphans the containers of tests running beside it.
    """

    def __init__(self, owned: Callable[[], Iterable[str]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._owned = owned

    async def list_engines(self) -> list[EngineHandle]:
        """Running containers of this box's deployments."""
        owned = set(self._owned())
        return [h for h in await super().list_engines() if h.deployment_id in owned]


# --- processes -------------------------------------------------------------------------


def pid_of(handle: EngineHandle) -> int:
    """The engine's pid from a process-runtime handle."""
    return int(handle.runtime_id.removeprefix("pid:"))


def process_identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time in clock ticks) of a live, non-zombie process; None otherwise."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X", b"x"):
        return None
    return pid, int(fields[19])


# --- one DGXMM -------------------------------------------------------------------------


class Box:
    """One DGXMM on `root` (log, engine data), with a real runtime; restartable in place."""

    def __init__(
        self,
        root: Path,
        kind: RuntimeKind,
        clock: Clock,
        *,
        usable_gib: float = 8.0,
        controller_options: dict[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.controller_options = controller_options or {}  # e.g. health_failure_window_s
        self.kind = kind
        self.clock = clock
        self.usable_bytes = int(usable_gib * GIB)
        self.owned: set[str] = set()
        self._store: EventStore | None = None
        self._runtime: Runtime | None = None
        self._controller: Controller | None = None
        self._broker: MemoryBroker | None = None
        self.settings = engines.EngineSettings(
            # As App does for the process runtime; the sim image finds python3 on its PATH.
            sim_python=sys.executable if kind == "process" else "python3",
            startup_timeout_s=120.0,
        )

    @classmethod
    async def open(
        cls, root: Path, kind: RuntimeKind, clock: Clock | None = None, **kwargs: Any
    ) -> Box:
        """Start a DGXMM on an empty `root`."""
        box = cls(root, kind, clock or SystemClock(), **kwargs)
        await box.start()
        return box

    # --- the parts -----------------------------------------------------------------------

    @property
    def store(self) -> EventStore:
        """The event log."""
        assert self._store is not None, "the box is not running"
        return self._store

    @property
    def runtime(self) -> Runtime:
        """The engine runtime."""
        assert self._runtime is not None, "the box is not running"
        return self._runtime

    @property
    def controller(self) -> Controller:
        """The controller."""
        assert self._controller is not None, "the box is not running"
        return self._controller

    @property
    def broker(self) -> MemoryBroker:
        """The memory broker."""
        assert self._broker is not None, "the box is not running"
        return self._broker

    def launch_spec(self, dep: DeploymentState) -> LaunchSpec:
        """The real launch spec, as `dgxmm.app.App` builds it."""
        return engines.launch_spec_for(dep, self.settings)

    def _make_runtime(self) -> Runtime:
        if self.kind == "docker":
            return OwnedDockerRuntime(lambda: self.owned)
        return ProcessRuntime(self.root / "engines", cwd=PROJECT_DIR)

    async def start(self) -> None:
        """Open the log, fold it, reconcile with the runtime (what `dgxmm serve` does)."""
        wall = self.clock.wall
        self._store = store = await EventStore.open(self.root / "dgxmm.db", wall=wall)
        if isinstance(self.clock, VirtualClock):
            self.clock.add_busy_check(store.busy)
        for rec in await store.read():
            if isinstance(rec.event, m.DeploymentCreated):
                self.owned.add(rec.event.deployment_id)
        self._runtime = self._make_runtime()
        self._broker = MemoryBroker(self.usable_bytes, self.usable_bytes)
        self._controller = Controller(
            store=store,
            clock=self.clock,
            runtime=self._runtime,
            probe=engines.HttpEngineProbe(),
            broker=self._broker,
            launch_spec=self.launch_spec,
            **self.controller_options,
        )
        await self._controller.load()

    async def stop(self) -> None:
        """Stop DGXMM (as `dgxmm serve` does on SIGTERM): engines keep running."""
        controller, self._controller = self._controller, None
        runtime, self._runtime = self._runtime, None
        store, self._store = self._store, None
        self._broker = None
        if controller is not None:
            await controller.close()
        if runtime is not None:
            await runtime.close()
        if store is not None:
            await store.close()

    async def restart(self) -> Controller:
        """Stop DGXMM and start a new one on the same log and data dir."""
        await self.stop()
        await self.start()
        return self.controller

    async def close(self) -> None:
        """Stop DGXMM and remove every engine of this box's deployments."""
        await self.stop()
        await asyncio.to_thread(self._remove_engines)

    def _remove_engines(self) -> None:
        if self.kind == "docker":
            remove_containers_of(self.owned)
            return
        state = self.root / "engines" / "process-engines.json"
        if not state.exists():
            return
        for record in msgspec.json.decode(state.read_bytes()).get("engines", []):
            pid = int(record["pid"])
            if process_identity(pid) is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)

    # --- driving -------------------------------------------------------------------------

    async def create(
        self,
        name: str,
        *,
        args: list[str] | None = None,
        mode: m.Mode = "always_on",
        memory_gib: float = 1.0,
    ) -> str:
        """Create a sim deployment through the controller (it starts at once); its id."""
        record = await self.controller.create(
            DeploymentSpec(
                name=name,
                engine="sim",
                model=f"sim/{name}",
                memory_bytes=int(memory_gib * GIB),
                mode=mode,
                args=list(args or []),
            ),
            actor="admin:test",
        )
        self.owned.add(record.id)
        return record.id

    def actor(self, deployment_id: str) -> DeploymentActor:
        """The deployment's actor in the running controller."""
        return self.controller.actors[deployment_id]

    def state(self, deployment_id: str) -> str:
        """The deployment's lifecycle state."""
        return self.actor(deployment_id).state.lifecycle.value

    async def events(self, deployment_id: str) -> list[m.Recorded]:
        """The deployment's stream, oldest first."""
        return await self.store.read(stream=m.deployment_stream(deployment_id))

    async def event_names(self, deployment_id: str) -> list[str]:
        """The type names of the deployment's events, oldest first."""
        return [type(rec.event).__name__ for rec in await self.events(deployment_id)]

    async def until(
        self,
        check: Callable[[], bool | Awaitable[bool]],
        what: str,
        deadline_s: float = DEADLINE_S,
    ) -> None:
        """Poll `check` until it holds (moving a virtual clock on); fail at the deadline."""
        end = time.monotonic() + deadline_s
        while True:
            result = check()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            if time.monotonic() > end:
                pytest.fail(f"not within {deadline_s:g} s: {what}")
            if isinstance(self.clock, VirtualClock):
                await self.clock.advance(VIRTUAL_STEP_S)
            await asyncio.sleep(POLL_S)

    async def wait_for_state(
        self, deployment_id: str, state: str, deadline_s: float = DEADLINE_S
    ) -> None:
        """Wait until the deployment is in `state`."""
        await self.until(
            lambda: self.state(deployment_id) == state,
            f"{deployment_id} {state} (it is {self.state(deployment_id)}, "
            f"last error {self.actor(deployment_id).state.last_error!r})",
            deadline_s,
        )

    async def wait_for_event(
        self, deployment_id: str, kind: type[E], deadline_s: float = DEADLINE_S
    ) -> tuple[m.Recorded, E]:
        """Wait until the deployment's stream has an event of `kind`; the first such."""
        found: list[tuple[m.Recorded, E]] = []

        async def recorded() -> bool:
            found[:] = [
                (rec, rec.event)
                for rec in await self.events(deployment_id)
                if isinstance(rec.event, kind)
            ]
            return bool(found)

        await self.until(recorded, f"{deployment_id} records {kind.__name__}", deadline_s)
        return found[0]

    def kill_behind_the_back(self, handle: EngineHandle) -> None:
        """Kill the engine without DGXMM knowing: `docker kill`, or SIGKILL to the process."""
        if self.kind == "docker":
            subprocess.run(
                ["docker", "kill", handle.runtime_id], capture_output=True, timeout=30, check=True
            )
        else:
            os.killpg(pid_of(handle), signal.SIGKILL)

    def engine_identity(self, handle: EngineHandle) -> tuple[str, str] | None:
        """What tells one run of an engine from another: (container id, start time) or
        (pid, start ticks); None when it does not run."""
        if self.kind == "docker":
            info = docker_inspect(handle.runtime_id)
            if info is None or not info["State"]["Running"]:
                return None
            return str(info["Id"]), str(info["State"]["StartedAt"])
        ident = process_identity(pid_of(handle))
        return None if ident is None else (str(ident[0]), str(ident[1]))

    def engine_exists(self, runtime_id: str) -> bool:
        """Whether anything of the engine is left (a container, even exited; a process)."""
        if self.kind == "docker":
            return docker_inspect(runtime_id) is not None
        return process_identity(int(runtime_id.removeprefix("pid:"))) is not None


# --- talking to an engine ---------------------------------------------------------------


async def chat_completion(handle: EngineHandle, model: str) -> dict[str, Any]:
    """POST /v1/chat/completions straight to the engine; the decoded answer (asserts 200)."""
    body = msgspec.json.encode(
        {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    )
    response = await client.request(
        handle.host,
        handle.port,
        "POST",
        "/v1/chat/completions",
        body=body,
        headers=[("content-type", "application/json")],
        timeout_s=10.0,
    )
    assert response.status == 200, (response.status, response.body[:300])
    answer: dict[str, Any] = msgspec.json.decode(response.body)
    return answer
