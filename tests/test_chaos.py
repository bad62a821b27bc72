"""Chaos: kill, hang and starve real `dgxmm serve` processes, then check that DGXMM is correct.

Each test runs real `dgxmm serve` processes (process runtime, simulated engines, loopback
sockets, SQLite files; the full-disk test puts the data dir on a small tmpfs) under streaming
and admin load, injects faults, and then checks what must always hold:

- the log has no gaps in `seq` and every stream's versions are contiguous;
- the state is coherent: once starts and stops settle, every ready deployment answers through
  the gateway (no model Ready-but-dead), a stopped or failed one has no engine;
- no engine is orphaned or duplicated, and the engines alive never hold more memory than the
  budget (sampled all along);
- every change the admin API acknowledged is in the log;
- every client saw a complete answer or an explicit error (a stream's final error event and
  `[DONE]`), except the ones whose server was SIGKILLed under them.

The random choices come from a seeded `random.Random` (the seed is printed), so a failing run
can be repeated.  Each test prints what it tried and what held.  Marked `chaos`; it runs by
default and takes a few minutes in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import pytest

from events import model as m
from tests.e2e_support import remove_containers_of, require_docker
from tests.gateway_support import Client, Reply
from tests.serve_support import (
    PROJECT,
    Serve,
    chat_body,
    engine_processes,
    sim_spec,
    write_config,
)
from tests.test_faults import fill, small_disk

pytestmark = pytest.mark.chaos

SEED = int(os.environ.get("DGXMM_CHAOS_SEED", "0")) or random.randrange(1, 1_000_000)
SETTLE_S = 60.0
CLIENT_DEADLINE_S = 60.0
Acked = dict[str, int]  # stream -> its version right after the API acknowledged a change


# --- what happened, and what held ---------------------------------------------------------


@dataclass
class Report:
    """What a chaos run tried and what held; printed at the end of the test."""

    title: str
    tried: Counter[str] = field(default_factory=Counter)
    held: Counter[str] = field(default_factory=Counter)
    clients: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        """Count a check that held, or record it as a violation."""
        if ok:
            self.held[what.split(":")[0]] += 1
        else:
            self.violations.append(what)

    def print(self, tried: Callable[[str], None]) -> None:
        """Its lines for the run's summary (tests/conftest.py)."""
        tried(f"[chaos] {self.title} (seed {SEED})")
        tried("  tried   : " + ", ".join(f"{k} {v}" for k, v in sorted(self.tried.items())))
        tried("  clients : " + ", ".join(f"{k} {v}" for k, v in sorted(self.clients.items())))
        tried("  held    : " + ", ".join(f"{k} x{v}" for k, v in sorted(self.held.items())))
        for note in self.notes:
            tried(f"  measured: {note}")
        for v in self.violations[:20]:
            tried(f"  VIOLATED: {v}")


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


# --- clients ----------------------------------------------------------------------------------


def _events(body: bytes) -> list[bytes]:
    return [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]


async def client_call(port: int, dep: str, model: str, stream: bool, key: str) -> str:
    """One request through the gateway: "complete", "error" (explicit), "cut" (the
    connection dropped without an explicit end), "hung" or "bad" (a malformed answer)."""
    client: Client | None = None
    try:
        client = await Client.connect(port, key)
        await client.send(
            "POST", f"/d/{dep}/v1/chat/completions", chat_body(model, stream=stream, max_tokens=12)
        )
        status, _ = await asyncio.wait_for(client.head(), CLIENT_DEADLINE_S)
        body = b""
        while (data := await asyncio.wait_for(client.chunk(), CLIENT_DEADLINE_S)) is not None:
            body += data
    except TimeoutError:
        return "hung"
    except (OSError, h11.RemoteProtocolError, AssertionError):
        return "cut"
    finally:
        if client is not None:
            client.close()
    if status != 200:
        try:
            return "error" if "error" in json.loads(body) else "bad"
        except ValueError:
            return "bad"
    if not stream or not body.startswith(b"data:"):
        try:
            json.loads(body)
        except ValueError:
            return "bad"
        return "complete"
    events = _events(body)
    if not events or events[-1] != b"data: [DONE]":
        return "bad"
    return "error" if any(e.startswith(b'data: {"error"') for e in events) else "complete"


class Load:
    """Clients calling random deployments until stopped; outcomes counted."""

    def __init__(self, serve: Serve, deps: dict[str, str], rng: random.Random, clients: int):
        self.serve = serve
        self.deps = deps  # id -> model
        self.rng = rng
        self.outcomes: Counter[str] = Counter()
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        while not self._stop.is_set():
            dep = self.rng.choice(sorted(self.deps))
            outcome = await client_call(
                self.serve.gateway_port,
                dep,
                self.deps[dep],
                self.rng.random() < 0.6,
                self.serve.gateway_key,
            )
            self.outcomes[outcome] += 1
            if outcome in ("cut", "error"):
                await asyncio.sleep(0.05)  # do not spin against a dead server

    async def stop(self) -> Counter[str]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes


class MemorySampler:
    """Samples the engines alive (from /proc) and the memory they hold, all along."""

    def __init__(self, token: str, gib_of: dict[str, float], total_gib: float) -> None:
        self.token = token
        self.gib_of = gib_of  # model -> GiB
        self.total = total_gib
        self.samples = 0
        self.worst = 0.0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            engines = await asyncio.to_thread(engine_processes, self.token)
            held = sum(self.gib_of.get(model, 0.0) for model in engines.values())
            self.worst = max(self.worst, held)
            self.samples += 1
            await asyncio.sleep(0.2)

    async def stop(self, report: Report) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        report.check(
            self.worst <= self.total,
            f"memory within budget: at most {self.worst:g} of {self.total:g} GiB "
            f"over {self.samples} samples",
        )


# --- the invariants -------------------------------------------------------------------------


async def deployments(serve: Serve) -> list[dict[str, Any]]:
    assert serve.api is not None
    reply = await serve.api.get("/dgxmm/api/deployments")
    assert reply.status == 200, reply.body
    data = reply.json()
    return list(data["deployments"] if isinstance(data, dict) else data)


async def settle(serve: Serve) -> list[dict[str, Any]]:
    """The deployments once no start or stop is under way (bounded)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        deps = await deployments(serve)
        if all(d["state"] not in ("starting", "stopping") for d in deps):
            return deps
        if time.monotonic() > deadline:
            return deps
        await asyncio.sleep(0.1)


async def check_invariants(
    serve: Serve, report: Report, token: str, total_gib: float, acked: Acked
) -> None:
    """Everything that must hold after a fault (see the module docstring)."""
    recs = await serve.records()
    seqs = [r.seq for r in recs]
    report.check(seqs == list(range(1, len(seqs) + 1)), f"log without gaps: {len(seqs)} events")
    versions: dict[str, list[int]] = {}
    for r in recs:
        versions.setdefault(r.stream, []).append(r.version)
    bad = [s for s, v in versions.items() if v != list(range(1, len(v) + 1))]
    report.check(not bad, f"contiguous stream versions: {bad or len(versions)}")
    for stream, version in acked.items():
        found = len(versions.get(stream, []))
        report.check(found >= version, f"acknowledged changes kept: {stream} at {found}/{version}")

    deps = await settle(serve)
    engines = await asyncio.to_thread(engine_processes, token)
    per_model = Counter(engines.values())
    models = {d["model"] for d in deps}
    orphans = [m_ for m_ in per_model if m_ not in models]
    report.check(not orphans, f"no orphaned engine: {orphans}")
    held = 0.0
    for d in deps:
        n = per_model.get(d["model"], 0)
        report.check(n <= 1, f"no duplicated engine: {d['name']} has {n}")
        if d["state"] == "ready":
            held += d["memory_bytes"] / 2**30
            outcome = await client_call(
                serve.gateway_port, d["id"], d["model"], False, serve.gateway_key
            )
            report.check(
                outcome == "complete" and n == 1,
                f"ready deployment serves: {d['name']} answered {outcome} with {n} engine",
            )
        elif d["state"] in ("stopped", "failed"):
            report.check(n == 0, f"stopped deployment has no engine: {d['name']} has {n}")
        else:
            report.check(False, f"settled: {d['name']} still {d['state']}")
    report.check(held <= total_gib, f"memory within budget after restart: {held:g} GiB")


# --- set-up ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serving(root: Path, total_gib: float) -> AsyncIterator[Serve]:
    """A started `dgxmm serve` on `root`; killed, with its engines, afterwards."""
    serve = Serve(root, write_config(root, total_gib=total_gib))
    try:
        await serve.start()
        yield serve
    finally:
        serve.kill()
        serve.kill_engines()


async def create(serve: Serve, name: str, **kwargs: Any) -> tuple[str, str]:
    assert serve.api is not None
    rec = await serve.api.ok("POST", "/dgxmm/api/deployments", sim_spec(name, **kwargs), 201)
    return str(rec["id"]), str(rec["model"])


async def admin_action(serve: Serve, rng: random.Random, deps: list[str], acked: Acked) -> str:
    """One random admin command; acknowledged ones are remembered."""
    assert serve.api is not None
    dep = rng.choice(deps)
    action = rng.choice(["stop", "start", "mode"])
    if action == "mode":
        body = {"mode": rng.choice(["on_demand", "always_on"])}
        reply = await serve.api.call("PATCH", f"/dgxmm/api/deployments/{dep}/mode", body)
    else:
        reply = await serve.api.call("POST", f"/dgxmm/api/deployments/{dep}/{action}")
    if reply.status == 200:
        await remember(serve, dep, acked)
    return f"{action}:{reply.status}"


async def remember(serve: Serve, dep: str, acked: Acked) -> None:
    """The API acknowledged a change of `dep`: what the log holds now must survive."""
    stream = m.deployment_stream(dep)
    version = max((r.version for r in await serve.records() if r.stream == stream), default=0)
    acked[stream] = max(acked.get(stream, 0), version)


# --- the tests ------------------------------------------------------------------------------


def test_sigkill_of_dgxmm_at_random_and_aimed_moments_under_load_leaves_it_correct(
    tmp_path: Path, tried: Callable[[str], None]
) -> None:
    rng = random.Random(SEED)
    token = f"ck{SEED}"
    total = 8.0
    report = Report("SIGKILL of dgxmm serve under streaming and admin load")

    async def main() -> None:
        async with serving(tmp_path, total) as serve:
            specs = {
                f"{token}-a": {"gib": 2, "args": ["--token-delay", "0.02"]},
                f"{token}-b": {"gib": 3, "mode": "on_demand", "args": ["--startup-delay", "0.5"]},
                f"{token}-c": {"gib": 4, "mode": "on_demand", "args": ["--token-delay", "0.01"]},
            }
            ids: dict[str, str] = {}
            gib_of: dict[str, float] = {}
            for name, kw in specs.items():
                dep, model = await create(serve, name, **kw)
                ids[dep] = model
                gib_of[model] = float(kw["gib"])  # type: ignore[arg-type]
            acked: Acked = {}
            sampler = MemorySampler(token, gib_of, total)
            rounds = [("random", None)] * 3 + [
                ("aimed", "stop"), ("aimed", "start"), ("aimed", "mode"), ("aimed", "stop")
            ]  # fmt: skip
            for kind, aim in rounds:
                load = Load(serve, ids, rng, clients=4)
                if kind == "random":
                    deadline = time.monotonic() + rng.uniform(0.5, 2.5)
                    while time.monotonic() < deadline:
                        report.tried[await admin_action(serve, rng, sorted(ids), acked)] += 1
                        await asyncio.sleep(rng.uniform(0.05, 0.4))
                    report.tried["kill at a random moment"] += 1
                else:
                    # Aimed at the window between the command's event and its effect.
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
                    dep = rng.choice(sorted(ids))
                    assert serve.api is not None
                    target = f"/dgxmm/api/deployments/{dep}"
                    call = (
                        serve.api.call("PATCH", target + "/mode", {"mode": "always_on"})
                        if aim == "mode"
                        else serve.api.call("POST", f"{target}/{aim}")
                    )
                    pending = asyncio.ensure_future(call)
                    await asyncio.sleep(rng.choice([0.0, 0.002, 0.005, 0.01, 0.03]))
                    report.tried[f"kill aimed after {aim}"] += 1
                    serve.kill()
                    with contextlib.suppress(Exception):
                        reply = await pending
                        if reply.status == 200:
                            await remember(serve, dep, acked)
                serve.kill()
                outcomes = await load.stop()
                report.clients.update(outcomes)
                report.check(outcomes["hung"] == 0, f"no client hung: {outcomes['hung']}")
                report.check(outcomes["bad"] == 0, f"no malformed answer: {outcomes['bad']}")
                await serve.start()
                await check_invariants(serve, report, token, total, acked)
                await _check_stop_intents(serve, report)
            await sampler.stop(report)

    try:
        run(main())
    finally:
        report.print(tried)
    assert report.violations == []


async def _check_stop_intents(serve: Serve, report: Report) -> None:
    """A deployment whose last intent in the log is an admin stop is stopped, not adopted."""
    recs = await serve.records()
    last_intent: dict[str, m.Event] = {}
    for r in recs:
        if isinstance(r.event, m.StopRequested | m.StartRequested | m.EngineAdopted):
            last_intent[r.stream] = r.event
    for d in await deployments(serve):
        event = last_intent.get(m.deployment_stream(d["id"]))
        if isinstance(event, m.StopRequested) and event.reason == "admin":
            report.check(d["state"] == "stopped", f"stop intent kept: {d['name']} is {d['state']}")


def test_engines_killed_or_hung_under_streaming_load_end_every_answer_explicitly(
    tmp_path: Path, tried: Callable[[str], None]
) -> None:
    rng = random.Random(SEED + 1)
    token = f"ce{SEED}"
    total = 8.0
    report = Report("engine SIGKILL and SIGSTOP under streaming load")

    async def main() -> None:
        async with serving(tmp_path, total) as serve:
            dep, model = await create(
                serve, f"{token}-a", gib=2, args=["--token-delay", "0.05", "--tokens", "40"]
            )
            ids = {dep: model}
            sampler = MemorySampler(token, {model: 2.0}, total)
            for fault in ["SIGKILL", "SIGKILL", "SIGSTOP", "SIGKILL"]:
                await _until_ready(serve, dep)
                load = Load(serve, ids, rng, clients=5)
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                engines = await asyncio.to_thread(engine_processes, token)
                assert len(engines) == 1, engines
                pid = next(iter(engines))
                os.killpg(pid, signal.SIGKILL if fault == "SIGKILL" else signal.SIGSTOP)
                report.tried[f"engine {fault}"] += 1
                started = time.monotonic()
                await _until_ready(serve, dep, functools.partial(_replaced, pid, token))
                elapsed = time.monotonic() - started
                # SIGSTOP: the health window (6 s), probe timeouts (5 s), the stop (SIGTERM,
                # then SIGKILL after 5 s), then a fresh start; all on two loaded cores.
                bound = 20.0 if fault == "SIGKILL" else 45.0
                report.check(elapsed < bound, f"recovered after {fault}: in {elapsed:.1f} s")
                report.notes.append(f"ready again {elapsed:.1f} s after engine {fault}")
                outcomes = await load.stop()
                report.clients.update(outcomes)
                report.check(
                    outcomes["cut"] == outcomes["hung"] == outcomes["bad"] == 0,
                    f"every client saw a complete answer or an explicit error: {dict(outcomes)}",
                )
            await sampler.stop(report)
            await check_invariants(serve, report, token, total, {})

    try:
        run(main())
    finally:
        report.print(tried)
    assert report.violations == []


def _replaced(pid: int, token: str) -> bool:
    """A new engine runs in place of `pid`."""
    engines = engine_processes(token)
    return pid not in engines and len(engines) == 1


async def _until_ready(serve: Serve, dep: str, also: Callable[[], bool] = lambda: True) -> None:
    assert serve.api is not None
    deadline = time.monotonic() + SETTLE_S
    while True:
        reply = await serve.api.get(f"/dgxmm/api/deployments/{dep}")
        if reply.status == 200 and reply.json()["state"] == "ready" and also():
            return
        assert time.monotonic() < deadline, f"{dep} not ready again: {reply.json()}"
        await asyncio.sleep(0.1)


def test_a_data_dir_that_fills_and_frees_loses_nothing_and_leaves_no_model_ready_but_dead(
    tmp_path: Path, tried: Callable[[str], None]
) -> None:
    rng = random.Random(SEED + 2)
    token = f"cd{SEED}"
    total = 8.0
    report = Report("the data dir on a small tmpfs that fills and frees")

    async def main(disk: Path) -> None:
        root = disk / "box"
        await asyncio.to_thread(root.mkdir)
        async with serving(root, total) as serve:
            assert serve.api is not None
            a, model_a = await create(serve, f"{token}-a", gib=2)
            b, model_b = await create(serve, f"{token}-b", gib=2, mode="on_demand")
            ids = {a: model_a, b: model_b}
            await _until_ready(serve, a)
            await _until_ready(serve, b)
            acked: Acked = {}
            for _ in range(2):
                filler = await asyncio.to_thread(fill, disk)
                report.tried["disk filled"] += 1
                load = Load(serve, ids, rng, clients=3)
                for _ in range(6):
                    answer = await admin_action(serve, rng, sorted(ids), acked)
                    report.tried[answer] += 1
                    report.check(
                        not answer.endswith(":500"), f"a failed write never answers 500: {answer}"
                    )
                    await asyncio.sleep(0.1)
                outcomes = await load.stop()
                report.clients.update(outcomes)
                report.check(
                    outcomes["cut"] == outcomes["hung"] == outcomes["bad"] == 0,
                    f"every client saw a complete answer or an explicit error: {dict(outcomes)}",
                )
                await asyncio.to_thread(filler.unlink)
                report.tried["disk freed"] += 1
                # Once the disk is free, commands work again and nothing is Ready-but-dead.
                for dep in ids:
                    await settle(serve)
                    reply = await serve.api.call("POST", f"/dgxmm/api/deployments/{dep}/stop")
                    report.check(reply.status == 200, f"stop works once freed: {reply.status}")
                    await remember(serve, dep, acked)
                    await settle(serve)
                    reply = await serve.api.call("POST", f"/dgxmm/api/deployments/{dep}/start")
                    report.check(reply.status == 200, f"start works once freed: {reply.status}")
                    await remember(serve, dep, acked)
                await check_invariants(serve, report, token, total, acked)
            serve.kill()
            await serve.start()
            await check_invariants(serve, report, token, total, acked)

    try:
        with small_disk(tmp_path / "disk", "48m") as disk:
            run(main(disk))
    finally:
        report.print(tried)
    assert report.violations == []


# --- an engine lost while nobody looked (issue 34), on both runtimes ------------------------

ROUNDS = int(os.environ.get("DGXMM_CHAOS_ROUNDS", "3"))


@pytest.fixture(params=["process", pytest.param("docker", marks=pytest.mark.docker)])
def runtime(request: pytest.FixtureRequest) -> str:
    """Each runtime in turn (docker: run under `flock /tmp/dgxmm-docker.lock`)."""
    if request.param == "docker":
        require_docker()
    return str(request.param)


class _LoggedServe(Serve):
    """`Serve` whose stderr (DGXMM's log) goes to `root/dgxmm.err`, never to a pipe nobody
    reads (a full pipe would stop DGXMM); printed when a check fails."""

    def spawn(self, *, stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
        with (self.root / "dgxmm.err").open("a") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "dgxmm.cli", "serve", "--config", str(self.config)],
                cwd=self.root,
                env={**os.environ, "PYTHONPATH": str(PROJECT)},
                stdout=stdout,
                stderr=err,
                text=True,
            )

    def log_tail(self, lines: int = 40) -> str:
        path = self.root / "dgxmm.err"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@contextlib.asynccontextmanager
async def serving_on(root: Path, runtime: str, total_gib: float = 8.0) -> AsyncIterator[Serve]:
    """`serving` on the named runtime; docker containers of its deployments removed after."""
    serve = _LoggedServe(root, write_config(root, total_gib=total_gib, runtime=runtime))
    try:
        await serve.start()
        yield serve
    finally:
        deps = []
        if runtime == "docker" and serve.api is not None:
            with contextlib.suppress(Exception):
                deps = [d["id"] for d in await deployments(serve)]
        serve.kill()
        serve.kill_engines()
        if deps:
            await asyncio.to_thread(remove_containers_of, deps)


def _engines(token: str) -> list[int]:
    """The engine processes of this test, without a container's docker-init (PID 1 there,
    its argv names the engine's command too)."""
    found = []
    for pid in engine_processes(token):
        with contextlib.suppress(OSError):
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            if not argv0.endswith(b"docker-init"):
                found.append(pid)
    return found


async def engine_pid(token: str) -> int:
    """The one engine process of this test (a container's process, seen from the host)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        engines = await asyncio.to_thread(_engines, token)
        if len(engines) == 1:
            return engines[0]
        assert time.monotonic() < deadline, f"not one engine: {engines}"
        await asyncio.sleep(0.05)


async def signal_engine(
    token: str, sig: signal.Signals, serve: Serve | None = None, dep: str = ""
) -> int:
    """Send `sig` to the engine; for SIGKILL, return once its process is gone and, on the
    Docker runtime (`serve` and `dep` given), once Docker saw its container stop (a request
    sent before Docker knows cannot be proven never to have reached it: its port proxy
    accepts it; docs/on-demand-gateway.md, "Resending")."""
    container = await _container_of(serve, dep) if serve is not None else None
    pid = await engine_pid(token)
    os.kill(pid, sig)
    if sig is signal.SIGKILL:
        deadline = time.monotonic() + SETTLE_S
        while not await asyncio.to_thread(_exited, pid) or (
            container is not None and await asyncio.to_thread(_running, container)
        ):
            assert time.monotonic() < deadline, f"engine {pid} survived SIGKILL"
            await asyncio.sleep(0.02)
    return pid


async def _container_of(serve: Serve, dep: str) -> str | None:
    """The container id of the deployment's engine (None on the process runtime)."""
    starts = [
        r.event.runtime_id
        for r in await serve.records()
        if r.stream == m.deployment_stream(dep) and isinstance(r.event, m.EngineStarting)
    ]
    return starts[-1] if starts and not starts[-1].startswith("pid:") else None


def _running(container: str) -> bool:
    done = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Running}}", container],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return done.returncode == 0 and done.stdout.strip() == "true"


def _exited(pid: int) -> bool:
    """Every thread of `pid` exited (its sockets are closed only then: its main thread can
    show as a zombie while others still run), or it is reaped."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        try:
            state = (task / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            return False
    return True


async def chat(client: Client, dep: str, model: str, max_tokens: int = 8) -> Reply:
    """A non-streaming chat completion on `client`'s connection (bounded)."""
    body = chat_body(model, stream=False, max_tokens=max_tokens)
    await client.send("POST", f"/d/{dep}/v1/chat/completions", body)
    reply: Reply = await asyncio.wait_for(client.reply(), CLIENT_DEADLINE_S)
    return reply


def answered(reply: Reply) -> bool:
    """A whole chat completion (not an error)."""
    try:
        return reply.status == 200 and "choices" in json.loads(reply.body)
    except ValueError:
        return False


async def ready_on_demand(serve: Serve, token: str) -> tuple[str, str]:
    """An on-demand sim deployment of this test, once ready: its id and model."""
    dep, model = await create(serve, f"{token}-od", mode="on_demand")
    await _until_ready(serve, dep)
    return dep, model


def checked(
    main: Awaitable[None], report: Report, tried: Callable[[str], None], deadline_s: float
) -> None:
    """Run a chaos case within its deadline; print its report; fail on any violation."""
    try:
        run(asyncio.wait_for(main, deadline_s))
    finally:
        report.print(tried)
    assert report.violations == []


def starts_and_losses(records: list[m.Recorded], dep: str) -> Counter[str]:
    """The deployment's losses and starts by reason, from the log."""
    out: Counter[str] = Counter()
    for r in records:
        if r.stream != m.deployment_stream(dep):
            continue
        if isinstance(r.event, m.EngineLost):
            out["EngineLost"] += 1
        elif isinstance(r.event, m.StartRequested):
            out[f"start:{r.event.reason}"] += 1
    return out


def test_an_idle_engine_killed_then_a_request_is_answered_after_one_cold_start(
    tmp_path: Path, tried: Callable[[str], None], runtime: str
) -> None:
    """SIGKILL an idle on-demand engine (as the OOM killer would), then send a request at
    once, on a new client connection: it never reached the dead engine, so it waits for
    one cold start instead of failing.  `DGXMM_CHAOS_ROUNDS` rounds (the acceptance: 20)."""
    token = f"ik{SEED}{runtime[0]}"
    report = Report(f"idle engine SIGKILL, then a request ({runtime}, {ROUNDS} rounds)")

    async def main() -> None:
        async with serving_on(tmp_path, runtime) as serve:
            dep, model = await ready_on_demand(serve, token)
            waits = []
            for n in range(ROUNDS):
                await _until_ready(serve, dep)
                await signal_engine(token, signal.SIGKILL, serve, dep)
                report.tried["engine SIGKILL while idle"] += 1
                started = time.monotonic()
                client = await Client.connect(serve.gateway_port, serve.gateway_key)
                try:
                    reply = await chat(client, dep, model)
                finally:
                    client.close()
                waits.append(time.monotonic() - started)
                report.clients["answered" if answered(reply) else f"HTTP {reply.status}"] += 1
                report.check(answered(reply), f"round {n} answered: {reply.status} {reply.body!r}")
                if not answered(reply):
                    break  # the model may be stopped now: the next round would find no engine
            got = starts_and_losses(await serve.records(), dep)
            report.notes.append(
                "answered after " + ", ".join(f"{w:.2f}" for w in waits) + " s; log: "
                + ", ".join(f"{k} {v}" for k, v in sorted(got.items()))
            )  # fmt: skip
            report.check(got["EngineLost"] == ROUNDS, f"a loss per round: {got}")
            # One cold start per round, for the request (plus the creation's).
            report.check(got["start:request"] == ROUNDS, f"one start per round: {got}")

    checked(main(), report, tried, 60 + ROUNDS * 30)


def test_an_engine_killed_between_requests_on_a_keep_alive_connection(
    tmp_path: Path, tried: Callable[[str], None], runtime: str
) -> None:
    """One client connection, kept alive: answered, engine SIGKILLed, the next request on
    the same connection (whose engine connection in the pool the kill closed) answered too."""
    token = f"kk{SEED}{runtime[0]}"
    report = Report(f"engine SIGKILL between requests on a keep-alive connection ({runtime})")

    async def main() -> None:
        async with serving_on(tmp_path, runtime) as serve:
            dep, model = await ready_on_demand(serve, token)
            client = await Client.connect(serve.gateway_port, serve.gateway_key)
            try:
                for n in range(ROUNDS):
                    first = await chat(client, dep, model)
                    report.check(answered(first), f"round {n} before: {first.status}")
                    await signal_engine(token, signal.SIGKILL, serve, dep)
                    report.tried["engine SIGKILL between requests"] += 1
                    started = time.monotonic()
                    second = await chat(client, dep, model)
                    report.notes.append(
                        f"round {n}: answered {time.monotonic() - started:.2f} s after the kill"
                    )
                    report.clients["answered" if answered(second) else f"HTTP {second.status}"] += 1
                    report.check(
                        answered(second), f"round {n} after: {second.status} {second.body!r}"
                    )
            finally:
                client.close()
            got = starts_and_losses(await serve.records(), dep)
            report.check(got["EngineLost"] == ROUNDS, f"a loss per round: {got}")

    checked(main(), report, tried, 60 + ROUNDS * 30)


def test_an_always_on_engine_stopped_beyond_its_health_window_is_named_and_restarted(
    tmp_path: Path, tried: Callable[[str], None], runtime: str
) -> None:
    """SIGSTOP an always-on engine under a request, past its health window (6 s): the request
    in flight gets an error naming the hang and the restart (503 engine_lost, not "start it
    from its page"); the next request waits for the restart and is answered."""
    token = f"hs{SEED}{runtime[0]}"
    report = Report(f"always-on engine SIGSTOP beyond the health window ({runtime})")

    async def main() -> None:
        async with serving_on(tmp_path, runtime) as serve:
            assert serve.api is not None
            dep, model = await create(
                serve, f"{token}-ao", args=["--token-delay", "0.05", "--tokens", "400"]
            )
            await _until_ready(serve, dep)
            client = await Client.connect(serve.gateway_port, serve.gateway_key)
            body = chat_body(model, stream=False, max_tokens=400)
            await client.send("POST", f"/d/{dep}/v1/chat/completions", body)
            deadline = time.monotonic() + SETTLE_S
            while (await serve.api.ok("GET", f"/dgxmm/api/deployments/{dep}"))["in_flight"] < 1:
                assert time.monotonic() < deadline, "the request never got to the engine"
                await asyncio.sleep(0.05)
            stopped_at = time.monotonic()
            await signal_engine(token, signal.SIGSTOP)
            report.tried["engine SIGSTOP under a request"] += 1
            try:
                reply = await asyncio.wait_for(client.reply(), CLIENT_DEADLINE_S)
            finally:
                client.close()
            error = json.loads(reply.body).get("error", {}) if reply.status != 200 else {}
            message = str(error.get("message", ""))
            report.notes.append(
                f"in flight: HTTP {reply.status} {error.get('code')} after "
                f"{time.monotonic() - stopped_at:.1f} s: {message}"
            )
            report.check(
                reply.status == 503 and error.get("code") == "engine_lost",
                f"the in-flight request's error: {reply.status} {reply.body!r}",
            )
            report.check(
                "health check" in message and "restarting" in message,
                f"it names the hang and the restart: {message}",
            )
            report.check("start it from its page" not in message, f"no action asked: {message}")
            client = await Client.connect(serve.gateway_port, serve.gateway_key)
            try:
                started = time.monotonic()
                after = await chat(client, dep, model)
            finally:
                client.close()
            report.notes.append(
                f"next request: HTTP {after.status} in {time.monotonic() - started:.1f} s"
            )
            report.clients["next answered" if answered(after) else f"next HTTP {after.status}"] += 1
            report.check(
                answered(after), f"the next request succeeds: {after.status} {after.body!r}"
            )
            got = starts_and_losses(await serve.records(), dep)
            report.check(got["EngineLost"] == 1 and got["start:restart"] == 1, f"log: {got}")

    checked(main(), report, tried, 180)
