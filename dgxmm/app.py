"""The composition root: builds every part from the configuration and runs them.

Only the entry points import `dgxmm`; this module is where the actors get their runtime,
engine probe, LiteLLM sync and memory source injected.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import structlog

from actors.controller import Controller, DeploymentSpec
from actors.deployment import StopDeployment
from actors.errors import ActorError, RuntimeFailure
from actors.memory_broker import GIB, MemoryBroker
from actors.ports import LaunchSpec, Runtime
from actors.runtime import SystemClock
from actors.watchdog import WatchdogActor
from dgxmm.config import Config
from dgxmm.demo import curl_label, demo_config, demo_notes, plan_front, stop_engines
from dgxmm.demo_litellm import DemoLiteLLM
from dgxmm.engines import adapters as engines
from dgxmm.engines.logs import launch_lines
from dgxmm.engines.memory import detect_gpu, detect_source, detect_total_bytes
from dgxmm.litellm.gateway_key import GatewayKeys
from dgxmm.private import auth_key, private_umask, secure_tree
from events import model as m
from events.state import DeploymentState, Lifecycle
from gateway.access import Access
from gateway.app import Gateway
from gateway.server import HTTPServer
from gateway.server import ServerConfig as HTTPConfig
from gateway.trace import TrafficTrace
from storage.errors import StorageError
from storage.eventlog import EventStore
from storage.lock import InstanceLock
from storage.snapshots import Snapshotter

log = structlog.get_logger("dgxmm.app")

PROJECT_DIR = Path(__file__).resolve().parent.parent
WEB_ROOT = Path(__file__).resolve().parent / "admin" / "web"

DEMO_TOTAL_GIB = 48.0
# At the demo's shutdown: the states whose engine runs, how long one stop may take to be
# recorded (the engine stops after), and the time beyond the runtime's stop timeout.
ENGINE_HOLDING = (Lifecycle.STARTING, Lifecycle.READY, Lifecycle.ASLEEP)
DEMO_STOP_ASK_S = 10.0
DEMO_STOP_MARGIN_S = 5.0
DEMO_DEPLOYMENTS = (
    DeploymentSpec(
        name="demo-always",
        engine="sim",
        model="demo/router-1b",
        memory_bytes=4 * GIB,
        mode="always_on",
        role="decision",
        args=["--flavour", "llamacpp"],
    ),
    DeploymentSpec(
        name="demo-chat",
        engine="sim",
        model="demo/chat-8b",
        memory_bytes=8 * GIB,
        mode="on_demand",
        args=["--startup-delay", "2", "--token-delay", "0.02"],
    ),
    DeploymentSpec(
        name="demo-large",
        engine="sim",
        model="demo/large-70b",
        memory_bytes=40 * GIB,
        mode="on_demand",
        args=["--startup-delay", "6", "--flavour", "vllm"],
    ),
)


class App:
    """Every running part of one DGXMM."""

    def __init__(self, config: Config, *, demo: bool = False, litellm: bool = True) -> None:
        # The demo puts its own LiteLLM in front, unless `--no-litellm` (litellm=False)
        self.front = (
            plan_front(config, PROJECT_DIR, no_litellm=not litellm, env=os.environ)
            if demo
            else None
        )
        self.config = demo_config(config, self.front) if demo else config
        self.demo = demo
        self.demo_litellm: DemoLiteLLM | None = None
        self.clock = SystemClock()
        self.store: EventStore | None = None
        self.runtime: Runtime | None = None
        self.controller: Controller | None = None
        self.gateway: Gateway | None = None
        self.gateway_keys: GatewayKeys | None = None
        self.admin: HTTPServer | None = None
        self.api: Any = None
        self.watchdog: WatchdogActor | None = None
        self.litellm: Any = None
        self.snapshotter: Snapshotter | None = None
        self.admin_password: str | None = None
        self.runtime_kind = ""
        self.lock: InstanceLock | None = None

    # --- building ------------------------------------------------------------------------

    async def _runtime(self) -> Runtime:
        from dgxmm.engines.runtimes.process import ProcessRuntime

        kind = self.config.runtime.kind
        data_dir = Path(self.config.server.data_dir)
        if kind == "auto" and not self.demo:
            kind = "docker" if await self._docker_answers() else "process"
        if kind == "docker":
            from dgxmm.engines.runtimes.docker import DockerRuntime

            self.runtime_kind = "docker"
            return DockerRuntime(
                url=self.config.runtime.docker_url, image_mounts=self.config.engines.image_mounts
            )
        self.runtime_kind = "process"
        return ProcessRuntime(data_dir / "engines", cwd=PROJECT_DIR)

    async def _docker_answers(self) -> bool:
        from dgxmm.engines.runtimes.docker import DockerRuntime

        probe = DockerRuntime(url=self.config.runtime.docker_url)
        try:
            await probe.ping()
        except RuntimeFailure:
            return False
        finally:
            await probe.close()
        return True

    def _engine_settings(self) -> engines.EngineSettings:
        cfg = self.config.engines
        kwargs: dict[str, Any] = {
            "images": cfg.images,
            "sim_image": cfg.sim_image,
            "startup_timeout_s": cfg.startup_timeout_s,
            "extra_env": cfg.extra_env,
            "gpu": cfg.gpu,
        }
        if cfg.cache_root:
            kwargs["cache_root"] = cfg.cache_root
        if self.runtime_kind == "process":
            kwargs["sim_python"] = sys.executable
            kwargs["local"] = True
            kwargs["programs"] = cfg.programs
        return engines.EngineSettings(**kwargs)

    async def start(self) -> None:
        """Open the log, fold it, reconcile, and start listening."""
        cfg = self.config
        data_dir, db = Path(cfg.server.data_dir), cfg.server.db_path
        await asyncio.to_thread(secure_tree, data_dir, db)
        # Before anything is written or any engine touched: one DGXMM per log and data dir.
        self.lock = InstanceLock.for_log(Path(db), data_dir)
        await asyncio.to_thread(self.lock.acquire)
        self.store = store = await EventStore.open(db)
        await asyncio.to_thread(secure_tree, data_dir, db)  # the -wal/-shm it just created
        self.runtime = runtime = await self._runtime()
        settings = self._engine_settings()

        def launch_spec(dep: DeploymentState) -> LaunchSpec:
            return engines.launch_spec_for(dep, settings)

        if cfg.memory.total_gib is not None:
            total, source = int(cfg.memory.total_gib * GIB), "configuration"
        elif self.demo:
            total, source = int(DEMO_TOTAL_GIB * GIB), "demo"
        else:
            total, source = await detect_total_bytes()
        reserve = 0 if self.demo else int(cfg.memory.reserve_gib * GIB)
        if reserve >= total:  # a budget of nothing: no deployment could ever start
            raise RuntimeFailure(
                f"memory.reserve_gib ({cfg.memory.reserve_gib}) must be less than the"
                f" memory total ({total / GIB:g} GiB, {source})"
            )
        usable = max(0, total - reserve)
        log.info("memory_budget", total_bytes=total, usable_bytes=usable, source=source)
        broker = MemoryBroker(usable, total, max_concurrent_starts=cfg.memory.max_concurrent_starts)
        self.controller = controller = Controller(
            store=store,
            clock=self.clock,
            runtime=runtime,
            probe=engines.HttpEngineProbe(),
            broker=broker,
            launch_spec=launch_spec,
            defaults=cfg.ondemand_defaults(),
            stop_timeout_s=cfg.runtime.stop_timeout_s,
            health_failure_window_s=cfg.runtime.health_failure_window_s,
            log_lines=launch_lines(runtime),
        )
        await controller.load()
        self.snapshotter = Snapshotter(store, lambda: controller.system)
        access = Access(loopback_open=cfg.server.gateway_auth == "loopback-open")
        self.gateway_keys = keys = GatewayKeys(
            data_dir, access, overlap_s=cfg.server.gateway_key_overlap_s
        )
        await asyncio.to_thread(keys.load)
        keys.start()
        self.gateway = Gateway(controller, access=access, named=_id_named(controller))
        self.gateway.trace = await _traffic_trace(
            store, usable, total, cfg.memory.max_concurrent_starts, cfg.ondemand_defaults()
        )
        server = await self.gateway.serve(
            cfg.server.gateway_host,
            cfg.server.gateway_port,
            _http_config(cfg, self.gateway.config.max_body_bytes),
        )
        if cfg.server.gateway_port == 0:  # an ephemeral port (tests): LiteLLM needs the real one
            self.config = cfg = msgspec.structs.replace(
                cfg, server=msgspec.structs.replace(cfg.server, gateway_port=server.port)
            )
        await self._start_litellm()
        await self._start_admin()
        if cfg.memory.watchdog_threshold_gib > 0:
            mem_source, _ = await detect_source()
            self.watchdog = WatchdogActor(
                clock=self.clock,
                source=mem_source,
                actors=lambda: list(controller.actors.values()),
                threshold_bytes=int(cfg.memory.watchdog_threshold_gib * GIB),
                every_s=cfg.memory.watchdog_every_s,
            )
            self.watchdog.start()
        if self.demo:
            await self._demo_deployments()

    async def _start_litellm(self) -> None:
        try:
            from dgxmm.litellm.bridge import LiteLLMBridge
        except ImportError:
            return
        assert self.controller is not None and self.store is not None
        keys = self.gateway_keys
        self.litellm = LiteLLMBridge(
            self.config, self.controller, self.store, self.clock,
            gateway_key=keys.current if keys is not None else None,
        )  # fmt: skip
        await self.litellm.start()

    async def _start_admin(self) -> None:
        try:
            from dgxmm.admin import openapi
            from dgxmm.admin.api import AdminApi
            from dgxmm.admin.auth import Auth, AuthConfig, ensure_admin
        except ImportError:
            return
        assert self.controller is not None and self.store is not None
        cfg = self.config
        self.admin_password = await ensure_admin(self.store, self.clock)
        if self.demo:
            self.admin_password = await asyncio.to_thread(self._demo_password, self.admin_password)
        secret = await asyncio.to_thread(auth_key, Path(cfg.server.data_dir))
        auth_config = AuthConfig(secure_cookie=cfg.server.cookie_secure)
        auth = Auth(self.controller, self.store, self.clock, auth_config, secret=secret)
        bridge = self.litellm
        gateway = self.gateway
        ops, latencies = self._operators()
        api = AdminApi(
            controller=self.controller,
            store=self.store,
            auth=auth,
            clock=self.clock,
            litellm_status=(bridge.status if bridge else None),
            litellm_sync_now=(bridge.sync_now if bridge else None),
            litellm_configure=(bridge.configure if bridge else None),
            web_root=WEB_ROOT if WEB_ROOT.is_dir() else None,
            gateway_statistics=(gateway.statistics if gateway else None),
            metrics_public=cfg.server.metrics_public,
            ops=ops,
            latencies=latencies,
            gateway_keys=self._key_rotation(),
            vendor_root=self._vendor_root(),
            gpu=await detect_gpu(),
            openapi_document=openapi.document,
        )
        ops.admin_server = lambda: api.server
        self.api = api
        self.admin = await api.serve(
            cfg.server.admin_host, cfg.server.admin_port, _http_config(cfg, api.max_body_bytes)
        )
        from dgxmm.admin.client import write_cli_file

        auth.local_token = await asyncio.to_thread(
            write_cli_file, Path(cfg.server.data_dir), cfg.server.admin_host, self.admin.port
        )

    def _key_rotation(self) -> Any:
        """What the admin API's gateway-key routes call: fingerprints, and a rotation that
        re-registers the new key in LiteLLM before the old one is refused."""
        from dgxmm.admin.gateway_key_api import KeyRoutes

        keys, bridge = self.gateway_keys, self.litellm
        if keys is None:
            return None
        return KeyRoutes(keys, bridge.register_key if bridge is not None else None)

    def _vendor_root(self) -> Path:
        """The chart library's directory; one warning when its files are missing."""
        from dgxmm.admin import vendor

        root = vendor.vendor_root(self.config.server.web_vendor_dir)
        if vendor.missing(root):
            log.warning(
                "web_vendor_missing", directory=str(vendor.uplot_dir(root)), hint=vendor.HINT
            )
        return root

    def _operators(self) -> tuple[Any, Any]:
        """Engine logs, start progress, the queue, /healthz, and the latency histograms."""
        from dgxmm.admin.histograms import Latencies
        from dgxmm.admin.ops import OpsApi
        from dgxmm.admin.phase_metrics import StartPhases
        from dgxmm.engines.logs import EngineLogs, Redactor

        controller, store, gateway = self.controller, self.store, self.gateway
        assert controller is not None and store is not None
        latencies = Latencies()
        store.add_listener(latencies.recorded)
        phases = StartPhases()
        store.add_listener(phases.recorded)
        latencies.extra.append(phases.histogram)
        if gateway is not None:
            gateway.on_first_byte = latencies.first_byte.observe

        def handle_of(deployment_id: str) -> Any:
            actor = controller.actors.get(deployment_id)
            return actor.engine_handle if actor is not None else None

        logs = None
        if self.runtime is not None:
            redactor = Redactor(self.config.engines.extra_env.values())
            logs = EngineLogs(self.runtime, redactor, handle_of=handle_of)
        cfg = self.config.server

        def gateway_address() -> tuple[str, int] | None:
            server = gateway.server if gateway is not None else None
            if server is None or server.closing:
                return None
            return cfg.gateway_host, server.port

        return OpsApi(controller, store, self.clock, logs, gateway_address=gateway_address), (
            latencies
        )

    def _demo_password(self, created: str | None) -> str | None:
        """The demo keeps its generated admin password in a private file, to print it again."""
        path = Path(self.config.server.data_dir) / "demo-admin-password"
        if created is not None:
            path.write_text(created + "\n", encoding="utf-8")
            path.chmod(0o600)
            return created
        if path.exists():
            return path.read_text(encoding="utf-8").strip() or None
        return None

    async def _demo_deployments(self) -> None:
        assert self.controller is not None
        existing = {a.state.name for a in self.controller.actors.values()}
        for spec in DEMO_DEPLOYMENTS:
            if spec.name not in existing:
                await self.controller.create(spec, actor="system")

    # --- running -------------------------------------------------------------------------

    def banner(self) -> str:
        """What `dgxmm serve` prints once it listens."""
        cfg = self.config.server
        assert self.controller is not None
        admin_port = self.admin.port if self.admin else cfg.admin_port
        lines = [
            "DGXMM is running.",
            f"  web UI and API : http://{cfg.admin_host}:{admin_port}/dgxmm/",
            f"  gateway        : {cfg.public_gateway_url}/d/<deployment>/v1",
            f"  event log      : {cfg.db_path}",
            f"  runtime        : {self.runtime_kind}",
        ]
        if self.admin_password:
            lines.append(f"  admin login    : admin / {self.admin_password}")
        for rec in self.controller.records():
            lines.append(f"  deployment     : {rec.name} ({rec.id}, {rec.mode}, {rec.state})")
        if self.demo:
            lines.extend(demo_notes(self.config, self.front))
        first = next(
            (r for r in self.controller.records() if r.name == "demo-chat"),
            None,
        )
        if first is not None:
            url = f"{cfg.public_gateway_url}/d/{first.id}/v1/chat/completions"
            lines.append(curl_label(self.front))
            message = '[{"role": "user", "content": "Hello"}]'
            body = f'{{"model": "{first.model}", "messages": {message}}}'
            # The key by reference: the banner (often in a log) never shows the key itself.
            key_file = (Path(cfg.data_dir) / "gateway.key").resolve()
            auth = f'-H "authorization: Bearer $(cat {key_file})"'
            lines.append(f"  curl -s {url} {auth} -H 'content-type: application/json' -d '{body}'")
        return "\n".join(lines)

    def start_demo_litellm(self) -> None:
        """The demo's LiteLLM, started once the banner is out: its lines come below it."""
        if self.front is not None:
            self.demo_litellm = DemoLiteLLM(self.front, lambda line: print(line, flush=True))
            self.demo_litellm.start()

    async def stop(self) -> None:
        """Stop listening, let answers finish, stop the actors (engines keep running).

        Every step runs even when an earlier one failed: the log must always be closed.
        Requests waiting for a model get 503 at once; streams may run for the grace
        (`[server] shutdown_grace_s`), then end with an error event and their terminator.
        """
        if self.controller is not None:
            self.controller.begin_shutdown()
        if self.demo_litellm is not None:  # its graceful stop runs beside the steps below
            self.demo_litellm.begin_stop()
        if self.api is not None:
            from dgxmm.admin.client import remove_cli_file

            await _step(
                "cli_file", asyncio.to_thread(remove_cli_file, Path(self.config.server.data_dir))
            )
            await _step("admin_api", self.api.close())  # ends the UI's streams, then the server
        elif self.admin is not None:
            await _step("admin_server", self.admin.shutdown(5.0))
        if self.gateway is not None:
            await _step("gateway", self.gateway.shutdown(self.config.server.shutdown_grace_s))
            if self.gateway.trace is not None:
                await _step("trace", self.gateway.trace.close())
        if self.gateway_keys is not None:
            await _step("gateway_keys", self.gateway_keys.close())
        if self.watchdog is not None:
            await _step("watchdog", self.watchdog.stop())
        if self.litellm is not None:
            await _step("litellm", self.litellm.stop())
        if self.demo_litellm is not None:
            await _step("demo_litellm", self.demo_litellm.stop())
        if self.demo and self.controller is not None:  # recorded, so not lost at the next start
            await _step("demo_engines", stop_engines(self.controller))
            await _step("demo_stops", self._demo_stops_recorded(self.controller))
        if self.controller is not None:
            await _step("controller", self.controller.close())
        if self.snapshotter is not None:  # orderly shutdown: the next start folds no tail
            await _step("snapshot", self.snapshotter.close())
        if self.demo and self.runtime is not None:
            # The demo's simulated engines are children of this process: none may outlive
            # it, not even one whose stop ran out of time or whose launch was under way.
            await _step("demo_leftovers", _stop_every_engine(self.runtime))
        if self.runtime is not None:
            await _step("runtime", self.runtime.close())
        if self.store is not None:
            await _step("store", self.store.close())
        if self.lock is not None:
            self.lock.release()

    async def _demo_stops_recorded(self, controller: Controller) -> None:
        """Stop what `stop_engines` leaves (engines starting or asleep), then wait until every
        stop is recorded: closing the controller earlier cancels the stops half-way, and the
        next start would find the always-on deployment still "stopping" and leave it stopped.

        Bounded by the runtime's stop timeout; what is left is stopped by the runtime."""
        changed = asyncio.Event()
        controller.add_listener(lambda _deployment, _what: changed.set())
        for actor in list(controller.actors.values()):
            if actor.state.lifecycle in ENGINE_HOLDING:
                with contextlib.suppress(ActorError, TimeoutError):
                    await asyncio.wait_for(
                        actor.ask(StopDeployment(reason="shutdown", actor="system")),
                        DEMO_STOP_ASK_S,
                    )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.runtime.stop_timeout_s + DEMO_STOP_MARGIN_S
        while True:
            changed.clear()
            left = stops_unfinished(actor.state for actor in controller.actors.values())
            if not left:
                return
            if loop.time() >= deadline:
                log.warning("demo_stops_unfinished", deployments=left)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), deadline - loop.time())


def stops_unfinished(states: Iterable[DeploymentState]) -> list[str]:
    """The deployments whose recorded stop has not finished (pure)."""
    return sorted(dep.name for dep in states if dep.lifecycle is Lifecycle.STOPPING)


def _id_named(controller: Controller) -> Callable[[str], str | None]:
    """The gateway's lookup of `/d/<name>/`: the id of the deployment of that name."""

    def id_named(name: str) -> str | None:
        actor = controller.find(name)
        return None if actor is None else actor.deployment_id

    return id_named


async def _stop_every_engine(runtime: Runtime) -> None:
    """Stop every engine the runtime still runs for this data dir (the demo's last step)."""
    for handle in await runtime.list_engines():
        await _step("demo_engine", runtime.stop(handle, DEMO_STOP_MARGIN_S))


async def _traffic_trace(
    store: EventStore, usable: int, total: int, starts: int, defaults: dict[str, Any]
) -> TrafficTrace:
    """The gateway's traffic trace (`gateway.trace`), written to the log, and the box's
    budget and configured defaults that a what-if needs and no other event says."""
    started = m.TraceStarted(
        usable_bytes=usable, total_bytes=total, max_concurrent_starts=starts, defaults=defaults
    )
    await store.append(m.STREAM_TRAFFIC, [started], actor="system")

    async def sink(event: m.TrafficRecorded) -> None:
        await store.append(m.STREAM_TRAFFIC, [event], actor="system")

    trace = TrafficTrace(sink)
    trace.start()
    return trace


def _http_config(cfg: Config, max_body_bytes: int) -> HTTPConfig:
    """The HTTP server settings of one listener, from `[server]`."""
    return HTTPConfig(
        max_body_bytes=max_body_bytes,
        body_timeout_s=cfg.server.body_timeout_s,
        fast_path=cfg.server.gateway_fast_path,
    )


async def _step(what: str, work: Awaitable[Any]) -> None:
    """Await one shutdown step; a failure is logged and the shutdown goes on."""
    try:
        await work
    except Exception:
        log.exception("shutdown_step_failed", step=what)


async def _serve(config: Config, demo: bool, litellm: bool = True) -> int:
    app = App(config, demo=demo, litellm=litellm)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await app.start()
    except (StorageError, RuntimeFailure, OSError) as exc:
        print(f"dgxmm: cannot start: {exc}", file=sys.stderr)
        await app.stop()
        return 2
    except Exception:
        # A bug: say so, and still close the log (its thread would keep the process alive).
        log.exception("start_failed")
        print("dgxmm: cannot start: internal error (see the log above)", file=sys.stderr)
        with contextlib.suppress(Exception):
            await app.stop()
        return 70
    if not stop.is_set():  # a Ctrl-C during the start: stop at once, with no banner
        print(app.banner(), flush=True)
        app.start_demo_litellm()
    await stop.wait()
    print("dgxmm: stopping", file=sys.stderr, flush=True)
    try:
        await app.stop()
    except Exception:
        log.exception("stop_failed")
        return 70
    return 0


class _SafeStream:
    """stdout/stderr that never raise: with a closed pipe (`dgxmm serve | head`) a log line
    must not crash an actor or a shutdown step, or DGXMM would never exit."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def serve_main(args: argparse.Namespace) -> int:
    """`dgxmm serve [--config FILE] [--demo]`, with the configuration `dgxmm.where` chose (its
    relative paths resolved against the file's directory, so the other commands agree)."""
    if not isinstance(sys.stdout, _SafeStream):
        sys.stdout = _SafeStream(sys.stdout)
    if not isinstance(sys.stderr, _SafeStream):
        sys.stderr = _SafeStream(sys.stderr)
    config: Config = args.loaded_config
    import uvloop

    private_umask()  # the log, engine logs and snapshots: 0600, directories 0700
    demo, litellm = bool(getattr(args, "demo", False)), not getattr(args, "no_litellm", False)
    return int(uvloop.run(_serve(config, demo, litellm)))
