"""Traffic and engine scenarios that drive the real actors on the virtual clock.

A `Scenario` is data: the box (usable memory, settings), its models (size, mode, idle
timeout, how long a cold start takes, how often a start fails or a ready engine dies), and
its traffic: open-loop arrivals drawn up front (Poisson streams, bursts), closed-loop
agents that wait for each answer before they think and ask again, and calls straight to an
engine's port that only its metrics show.  Everything random comes from `random.Random`
seeded by (scenario, seed), so a run is reproducible and two queue policies see the very
same arrivals and engines.

`simulate()` runs one on a fresh `Harness` (real controller, queue, broker and deployment
actors; simulated engines; a real SQLite log) and returns what happened.  A simulated hour
takes well under a second of real time; `python -m simulations.scenarios` measures it.

Over 600 lines because the named scenarios are data that belongs together: the traffic
generators, the seven scenarios and the engines they draw are one vocabulary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import msgspec
import structlog

from actors.deployment import Refusal
from actors.memory_broker import MemoryBroker
from actors.ports import LaunchSpec
from events import model as m
from simulations.harness import DirectCall, Harness, RequestResult
from simulations.runtime import EngineBehaviour

Policy = Literal["fifo-go-ahead", "fifo"]
POLICIES: tuple[Policy, ...] = ("fifo-go-ahead", "fifo")

START_FAILURE_LINE = "RuntimeError: CUDA error: out of memory (simulated start failure)"


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One deployment of the box and how its engine behaves."""

    name: str
    gib: float
    mode: m.Mode = "on_demand"
    role: m.Role = "model"
    idle_timeout_s: int | None = None  # None: the DGXMM default
    startup_s: tuple[float, float] = (20.0, 60.0)  # a cold start takes uniform(lo, hi)
    fail_p: float = 0.0  # chance that a start fails (the engine exits when it would be ready)
    mean_life_s: float | None = None  # a ready engine dies after exponential(mean) seconds


class Arrival(msgspec.Struct, frozen=True, kw_only=True):
    """An open-loop request: it arrives at `at_s` whatever happened before."""

    at_s: float
    model: str
    hold_s: float  # how long the answer takes once the model serves it
    hang_up_after_s: float | None = None  # the client gives up waiting after this long


class DirectLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A call straight to the engine's port (keeps it awake through its metrics only)."""

    at_s: float
    model: str
    duration_s: float


class Agent(msgspec.Struct, frozen=True, kw_only=True):
    """A closed-loop client: asks `models` in turn, waits for each answer, thinks, asks again."""

    name: str
    models: tuple[str, ...]
    start_s: float = 0.0
    think_s: tuple[float, float] = (5.0, 30.0)
    hold_s: tuple[float, float] = (10.0, 60.0)


class Scenario(msgspec.Struct, frozen=True, kw_only=True):
    """A box, its models and its traffic."""

    name: str
    description: str
    usable_gib: float
    models: tuple[ModelSpec, ...]
    duration_s: float
    arrivals: tuple[Arrival, ...] = ()
    direct: tuple[DirectLoad, ...] = ()
    agents: tuple[Agent, ...] = ()
    settings: dict[str, int] = {}
    cold: bool = True  # on-demand models are asleep when the traffic begins
    max_concurrent_starts: int = 1
    stop_s: float = 5.0  # an engine takes this long to stop and give its memory back

    def model(self, name: str) -> ModelSpec:
        """The model called `name`."""
        return next(spec for spec in self.models if spec.name == name)


# --- traffic generators ---------------------------------------------------------------------


def poisson(
    rng: random.Random,
    model: str,
    *,
    mean_gap_s: float,
    start_s: float,
    end_s: float,
    hold_s: tuple[float, float] = (2.0, 30.0),
    hang_up_p: float = 0.0,
    patience_s: tuple[float, float] = (30.0, 600.0),
) -> list[Arrival]:
    """A Poisson stream of requests for one model (exponential gaps of mean `mean_gap_s`)."""
    out: list[Arrival] = []
    t = start_s
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t >= end_s:
            return out
        hold = rng.uniform(*hold_s)
        hang_up = rng.uniform(*patience_s) if rng.random() < hang_up_p else None
        out.append(Arrival(at_s=t, model=model, hold_s=hold, hang_up_after_s=hang_up))


def burst(
    rng: random.Random,
    models: list[str],
    *,
    at_s: float,
    size: int,
    spread_s: float = 10.0,
    hold_s: tuple[float, float] = (5.0, 60.0),
) -> list[Arrival]:
    """`size` requests within `spread_s` seconds, each for a model drawn from `models`."""
    return [
        Arrival(
            at_s=at_s + rng.uniform(0.0, spread_s),
            model=rng.choice(models),
            hold_s=rng.uniform(*hold_s),
        )
        for _ in range(size)
    ]


def direct_loads(
    rng: random.Random, model: str, *, mean_gap_s: float, end_s: float, duration_s: float
) -> list[DirectLoad]:
    """Calls straight to one model's engine port, as a Poisson stream."""
    out: list[DirectLoad] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t >= end_s:
            return out
        out.append(DirectLoad(at_s=t, model=model, duration_s=rng.uniform(5.0, duration_s)))


# --- the named scenarios --------------------------------------------------------------------


def _startup(gib: float) -> tuple[float, float]:
    """Cold starts grow with the model: about 1.5 s per GiB, at least 15 s, 1.5x spread."""
    lo = max(15.0, 1.5 * gib)
    return (lo, 1.5 * lo)


def poisson_mix(seed: int, duration_s: float) -> Scenario:
    """Four on-demand models of different sizes with independent Poisson traffic."""
    rng = random.Random(f"poisson-mix/{seed}")
    models = (
        ModelSpec(name="decision", gib=8, mode="always_on", role="decision", startup_s=(15, 20)),
        ModelSpec(name="chat-8b", gib=16, startup_s=_startup(16)),
        ModelSpec(name="code-14b", gib=28, startup_s=_startup(28)),
        ModelSpec(name="vision-32b", gib=40, startup_s=_startup(40)),
        ModelSpec(name="reason-70b", gib=64, startup_s=_startup(64)),
    )
    gaps = {"chat-8b": 45.0, "code-14b": 240.0, "vision-32b": 600.0, "reason-70b": 600.0}
    arrivals: list[Arrival] = []
    for name, gap in gaps.items():
        arrivals += poisson(rng, name, mean_gap_s=gap, start_s=0.0, end_s=duration_s)
    return Scenario(
        name="poisson-mix",
        description="4 on-demand models (16/28/40/64 GiB) + an 8 GiB decision model on 112 "
        "GiB; Poisson traffic every 45 s / 4 / 10 / 10 min",
        usable_gib=112,
        models=models,
        duration_s=duration_s,
        arrivals=_sorted(arrivals),
    )


def hot_small_cold_large(seed: int, duration_s: float) -> Scenario:
    """Five small models in steady use and one large model asked for now and then."""
    rng = random.Random(f"hot-small-cold-large/{seed}")
    small = [f"small-{c}" for c in "abcde"]
    models = (
        *(ModelSpec(name=n, gib=16, idle_timeout_s=60, startup_s=_startup(16)) for n in small),
        ModelSpec(name="large-64g", gib=64, idle_timeout_s=120, startup_s=(120.0, 240.0)),
    )
    arrivals: list[Arrival] = []
    for name in small:
        arrivals += poisson(
            rng, name, mean_gap_s=90.0, start_s=0.0, end_s=duration_s, hold_s=(5.0, 30.0)
        )
    arrivals += poisson(
        rng, "large-64g", mean_gap_s=600.0, start_s=0.0, end_s=duration_s, hold_s=(30.0, 120.0)
    )
    return Scenario(
        name="hot-small-cold-large",
        description="5 small 16 GiB models (a request every ~90 s each, 1 min idle timeout) "
        "and a 64 GiB model (every ~10 min, 2 min idle timeout) on 96 GiB",
        usable_gib=96,
        models=models,
        duration_s=duration_s,
        arrivals=_sorted(arrivals),
    )


def agent_alternation(seed: int, duration_s: float) -> Scenario:
    """Agents that alternate between a planner and a coder that do not fit together."""
    rng = random.Random(f"agent-alternation/{seed}")
    models = (
        ModelSpec(name="planner-32b", gib=44, idle_timeout_s=60, startup_s=(60.0, 90.0)),
        ModelSpec(name="coder-32b", gib=48, idle_timeout_s=60, startup_s=(60.0, 90.0)),
        ModelSpec(name="chat-8b", gib=12, startup_s=_startup(12)),
    )
    agents = (
        Agent(name="agent-1", models=("planner-32b", "coder-32b"), start_s=0.0),
        Agent(name="agent-2", models=("coder-32b", "planner-32b"), start_s=rng.uniform(0, 300)),
    )
    arrivals = poisson(rng, "chat-8b", mean_gap_s=60.0, start_s=0.0, end_s=duration_s)
    return Scenario(
        name="agent-alternation",
        description="2 closed-loop agents alternating between a 44 GiB planner and a 48 GiB "
        "coder (1 min idle timeout) on 96 GiB, plus a 12 GiB chat model",
        usable_gib=96,
        models=models,
        duration_s=duration_s,
        arrivals=_sorted(arrivals),
        agents=agents,
    )


def bursts(seed: int, duration_s: float) -> Scenario:
    """Quiet traffic with a batch job every 10 minutes that asks six models at once."""
    rng = random.Random(f"bursts/{seed}")
    sizes = {"m-a": 16, "m-b": 20, "m-c": 24, "m-d": 32, "m-e": 40, "m-f": 48}
    models = tuple(
        ModelSpec(name=name, gib=gib, idle_timeout_s=180, startup_s=_startup(gib))
        for name, gib in sizes.items()
    )
    arrivals: list[Arrival] = []
    for name in sizes:
        arrivals += poisson(rng, name, mean_gap_s=900.0, start_s=0.0, end_s=duration_s)
    t = 300.0
    while t < duration_s:
        arrivals += burst(rng, list(sizes), at_s=t, size=rng.randint(12, 30))
        t += 600.0
    return Scenario(
        name="bursts",
        description="6 on-demand models (16-48 GiB) on 128 GiB; a burst of 12-30 requests "
        "every 10 min; at most 24 waiting, 10 min queue limit",
        usable_gib=128,
        models=models,
        duration_s=duration_s,
        arrivals=_sorted(arrivals),
        settings={"ondemand_max_queued": 24, "ondemand_queue_timeout_s": 600},
    )


def flaky_engines(seed: int, duration_s: float) -> Scenario:
    """Engines that fail to start or die, impatient clients, and direct calls to a port."""
    rng = random.Random(f"flaky-engines/{seed}")
    models = (
        ModelSpec(name="keep-8b", gib=16, mode="always_on", mean_life_s=3600.0),
        ModelSpec(name="od-a", gib=24, idle_timeout_s=120, fail_p=0.2, mean_life_s=1200.0),
        ModelSpec(name="od-b", gib=32, idle_timeout_s=120, fail_p=0.1),
        ModelSpec(name="od-c", gib=40, idle_timeout_s=180, fail_p=0.1, mean_life_s=2400.0),
    )
    arrivals: list[Arrival] = []
    for name, gap in (("od-a", 90.0), ("od-b", 120.0), ("od-c", 240.0)):
        arrivals += poisson(
            rng, name, mean_gap_s=gap, start_s=0.0, end_s=duration_s, hang_up_p=0.15
        )
    direct = direct_loads(rng, "od-b", mean_gap_s=600.0, end_s=duration_s, duration_s=120.0)
    return Scenario(
        name="flaky-engines",
        description="an always-on model and 3 on-demand models on 80 GiB; starts fail "
        "(10-20 %), engines die, 15 % of clients hang up, direct calls to od-b's port",
        usable_gib=80,
        models=models,
        duration_s=duration_s,
        arrivals=_sorted(arrivals),
        direct=tuple(direct),
    )


def three_two_fit(seed: int, duration_s: float) -> Scenario:
    """Three models of which two fit, asked in turn: every third request must swap one out."""
    rng = random.Random(f"three-two-fit/{seed}")
    models = tuple(ModelSpec(name=n, gib=40, startup_s=_startup(40)) for n in ("x", "y", "z"))
    agents = (
        Agent(name="rotate-1", models=("x", "y", "z"), start_s=0.0),
        Agent(name="rotate-2", models=("z", "y", "x"), start_s=rng.uniform(0, 300)),
    )
    return Scenario(
        name="three-two-fit",
        description="3 on-demand 40 GiB models on 96 GiB (two fit), 2 closed-loop clients "
        "asking them in turn (default 5 min idle timeout)",
        usable_gib=96,
        models=models,
        duration_s=duration_s,
        agents=agents,
    )


def agent_tools(seed: int, duration_s: float) -> Scenario:
    """An agent on one big model that calls small tool models in bursts between its turns."""
    rng = random.Random(f"agent-tools/{seed}")
    models = (
        ModelSpec(name="agent-64g", gib=64, startup_s=(90.0, 135.0)),
        ModelSpec(name="tool-16g", gib=16, startup_s=_startup(16)),
        ModelSpec(name="tool-24g", gib=24, startup_s=_startup(24)),
    )
    agents = (
        Agent(
            name="agent",
            models=("agent-64g", "tool-16g", "tool-24g", "tool-16g"),
            think_s=(1.0, 5.0),
            hold_s=(3.0, 40.0),
        ),
    )
    arrivals: list[Arrival] = []
    t = rng.uniform(60.0, 300.0)
    while t < duration_s:  # other clients' bursts of small tool calls
        arrivals += burst(
            rng, ["tool-16g", "tool-24g"], at_s=t, size=rng.randint(3, 8), hold_s=(1.0, 5.0)
        )
        t += rng.uniform(180.0, 420.0)
    return Scenario(
        name="agent-tools",
        description="a closed-loop agent on a 64 GiB model calling 16 and 24 GiB tool models "
        "(all three do not fit in 96 GiB), plus bursts of 3-8 tool calls every 3-7 min",
        usable_gib=96,
        models=models,
        duration_s=duration_s,
        arrivals=_sorted(arrivals),
        agents=agents,
    )


def _sorted(arrivals: Iterable[Arrival]) -> tuple[Arrival, ...]:
    return tuple(sorted(arrivals, key=lambda a: a.at_s))


SCENARIOS: dict[str, Callable[[int, float], Scenario]] = {
    "poisson-mix": poisson_mix,
    "hot-small-cold-large": hot_small_cold_large,
    "agent-alternation": agent_alternation,
    "bursts": bursts,
    "flaky-engines": flaky_engines,
    "three-two-fit": three_two_fit,
    "agent-tools": agent_tools,
}


def scenario(name: str, seed: int, duration_s: float = 3600.0) -> Scenario:
    """A named scenario; raises KeyError naming the known ones."""
    try:
        make = SCENARIOS[name]
    except KeyError:
        raise KeyError(f"no scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
    return make(seed, duration_s)


# --- engines --------------------------------------------------------------------------------


class EngineDraws:
    """The simulated runtime's behaviour: each launch draws its start-up time and fate."""

    def __init__(self, models: Iterable[ModelSpec], rng: random.Random) -> None:
        self._models = {spec.name: spec for spec in models}
        self._rng = rng
        self.fail_next: set[str] = set()  # names whose next start fails (tests force it)
        self.draws: list[tuple[str, EngineBehaviour]] = []

    def __call__(self, spec: LaunchSpec) -> EngineBehaviour:
        """Draw how this launch of `spec.name` behaves."""
        model = self._models.get(spec.name)
        if model is None:
            return EngineBehaviour()
        rng = self._rng
        startup = rng.uniform(*model.startup_s)
        fails = rng.random() < model.fail_p
        if spec.name in self.fail_next:
            self.fail_next.discard(spec.name)
            fails = True
        life = None if model.mean_life_s is None else rng.expovariate(1.0 / model.mean_life_s)
        behaviour = EngineBehaviour(
            startup_s=startup,
            fail_at_start=START_FAILURE_LINE if fails else None,
            die_after_s=None if fails else life,
        )
        self.draws.append((spec.name, behaviour))
        return behaviour


# --- running one ----------------------------------------------------------------------------


class Outcome(msgspec.Struct, kw_only=True):
    """What one simulated run produced."""

    scenario: Scenario
    seed: int
    policy: Policy
    ids: dict[str, str]  # model name -> deployment id
    results: list[RequestResult]
    records: list[m.Recorded]
    direct_calls: list[DirectCall]
    traffic_start: float  # virtual monotonic time the traffic began
    wall_offset: float  # clock.wall() - clock.now(): turns a record's ts into virtual time
    end: float  # virtual time at the end of the drain
    wall_s: float  # real seconds the run took
    harness_violations: list[str]

    @property
    def names(self) -> dict[str, str]:
        """Deployment id -> model name."""
        return {dep_id: name for name, dep_id in self.ids.items()}

    def at(self, rec: m.Recorded) -> float:
        """A record's time on the virtual monotonic clock."""
        return rec.ts - self.wall_offset


Hook = Callable[[Harness], Awaitable[None]]
Drive = Callable[[Harness, dict[str, str]], Awaitable[None]]


async def simulate(
    spec: Scenario,
    db_path: str | Path,
    *,
    seed: int,
    policy: Policy = "fifo-go-ahead",
    broker_cls: type[MemoryBroker] = MemoryBroker,
    attach: Callable[[Harness], None] | None = None,
    drive: Drive | None = None,
    drain: float | None = None,
    before_close: Hook | None = None,
    engines: EngineDraws | None = None,
) -> Outcome:
    """Run `spec` on a fresh box, then let every request end (`drain` seconds, by default
    `drain_s(spec)`).

    `attach` sees the harness before anything is deployed; `drive(h, ids)` runs once the
    models are deployed, alongside the scenario's traffic; `before_close` sees the box at
    the end, before it is shut down.
    """
    began = time.perf_counter()
    draws = engines or EngineDraws(spec.models, random.Random(f"{spec.name}/{seed}/engines"))
    h = await Harness.create(
        db_path,
        usable_gib=spec.usable_gib,
        behaviour=draws,
        settings=dict(spec.settings),
        max_concurrent_starts=spec.max_concurrent_starts,
        broker_cls=broker_cls,
        plain_fifo=policy == "fifo",
        stop_s=spec.stop_s,
    )
    try:
        if attach is not None:
            attach(h)
        ids = await _deploy(h, spec)
        t0 = h.clock.now()
        agents = [
            asyncio.get_running_loop().create_task(
                _agent(h, ids, agent, random.Random(f"{spec.name}/{seed}/{agent.name}"), t0, spec)
            )
            for agent in spec.agents
        ]
        for arrival in spec.arrivals:
            h.clock.call_later(arrival.at_s, _arrive(h, ids, arrival))
        for load in spec.direct:
            h.clock.call_later(load.at_s, _direct(h, ids, load))
        if drive is not None:
            await drive(h, ids)
        await h.advance(spec.duration_s)
        await h.advance(drain_s(spec) if drain is None else drain)
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
        records = await h.events()
        if before_close is not None:
            await before_close(h)
        return Outcome(
            scenario=spec,
            seed=seed,
            policy=policy,
            ids=ids,
            results=h.results,
            records=records,
            direct_calls=h.direct_calls,
            traffic_start=t0,
            wall_offset=h.clock.wall() - h.clock.now(),
            end=h.clock.now(),
            wall_s=time.perf_counter() - began,
            harness_violations=list(h.violations),
        )
    finally:
        await h.close()


def drain_s(spec: Scenario) -> float:
    """How long after the traffic every request has surely ended (deadline + answer)."""
    timeout = float(spec.settings.get("ondemand_queue_timeout_s", 900))
    hold = max(
        [a.hold_s for a in spec.arrivals] + [agent.hold_s[1] for agent in spec.agents] + [0.0]
    )
    startup = max(spec_.startup_s[1] for spec_ in spec.models)
    return math.ceil(timeout + hold + startup + 60.0)


async def _deploy(h: Harness, spec: Scenario) -> dict[str, str]:
    ids: dict[str, str] = {}
    # Always-on first, like a box that ran them before on-demand models were added.
    for model in sorted(spec.models, key=lambda s: s.mode != "always_on"):
        ids[model.name] = await h.deploy(
            model.name,
            model.gib,
            mode=model.mode,
            idle_timeout_s=model.idle_timeout_s,
            role=model.role,
        )
        await h.advance(0.001)
    await h.advance(max(s.startup_s[1] for s in spec.models) + 5.0)
    if spec.cold:
        for model in spec.models:
            if model.mode == "on_demand":
                with contextlib.suppress(Refusal):  # stopping or already stopped
                    await h.controller.stop(ids[model.name], "admin:scenario")
        await h.advance(1.0)
    return ids


def _arrive(h: Harness, ids: dict[str, str], arrival: Arrival) -> Callable[[], None]:
    def send() -> None:
        h.request(ids[arrival.model], arrival.hold_s, hang_up_after_s=arrival.hang_up_after_s)

    return send


def _direct(h: Harness, ids: dict[str, str], load: DirectLoad) -> Callable[[], None]:
    def send() -> None:
        h.direct_call(ids[load.model], load.duration_s)

    return send


async def _agent(
    h: Harness,
    ids: dict[str, str],
    agent: Agent,
    rng: random.Random,
    t0: float,
    spec: Scenario,
) -> None:
    await h.clock.sleep(agent.start_s)
    turn = 0
    while h.clock.now() < t0 + spec.duration_s:
        model = agent.models[turn % len(agent.models)]
        await h.call(ids[model], rng.uniform(*agent.hold_s))  # refusals end up in the result
        turn += 1
        await h.clock.sleep(rng.uniform(*agent.think_s))


# --- measuring the speed --------------------------------------------------------------------


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.scenarios",
        description="Run each named scenario for a simulated hour and print how long it took.",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    args = parser.parse_args(argv)
    quiet_logs()
    for name in SCENARIOS:
        spec = scenario(name, args.seed, args.duration)
        with tempfile.TemporaryDirectory() as tmp:
            out = asyncio.run(simulate(spec, Path(tmp) / "log.db", seed=args.seed))
        simulated = out.end - out.traffic_start
        print(
            f"{name:22} {len(out.results):5} requests  {len(out.records):6} events  "
            f"{simulated:7.0f} s simulated in {out.wall_s:5.2f} s "
            f"({simulated / max(out.wall_s, 1e-9):,.0f}x)"
        )
    return 0


def quiet_logs() -> None:
    """Only warnings and errors from the actors (a simulated hour logs a lot of info)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def describe(spec: Scenario) -> dict[str, Any]:
    """The scenario's shape, for reports."""
    return {
        "name": spec.name,
        "description": spec.description,
        "usable_gib": spec.usable_gib,
        "duration_s": spec.duration_s,
        "models": [msgspec.to_builtins(model) for model in spec.models],
        "arrivals": len(spec.arrivals),
        "agents": len(spec.agents),
        "direct_calls": len(spec.direct),
        "settings": spec.settings,
    }


if __name__ == "__main__":
    raise SystemExit(_main())
