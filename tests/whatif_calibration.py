"""Calibration of `dgxmm whatif` on logs DGXMM really wrote.

Two real `dgxmm serve` (process runtime, simulated engines) get the same scripted Poisson
traffic at the same time: five on-demand models that do not all fit (3+3+3+2+2 GiB in 8),
each quiet often enough that a request for another may evict it, some requests streaming,
some waiting for memory; one box making room with a model idle for 20 s
(`ondemand_make_room_after_s = 20`), the other at once (`= 0`).  Then `whatif` replays the
first log with its recorded settings (the calibration: it should reproduce the first box,
its cold starts and evictions among them) and with make-room at once (the counterfactual:
it should predict the second box).

    python -m tests.whatif_calibration --minutes 20      # the table in docs/what-if.md

The test (`tests/test_whatif_calibration.py`) runs the 3-minute version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from simulations.whatif import FATES, History, Report, load_history, measure_recorded, simulate
from tests.gateway_support import Client
from tests.serve_support import Serve, chat_body

TOTAL_GIB = 8
IDLE_S = 60  # the smallest idle timeout DGXMM accepts: a 3-minute run sees models idle out
# The first box's rule for making room.  Under the seed's rule (the full idle timeout) a
# model idle that long stops by its idle timer, so that box evicts next to nothing and its
# replay would test no eviction at all; 20 s lets the requests evict idle models.
ROOM_AFTER_S = 20
TOKEN_DELAY_S = 0.05


@dataclass(frozen=True)
class TrafficModel:
    """One deployment and its Poisson traffic."""

    name: str
    gib: float
    rate_per_s: float
    startup_s: float


MODELS = (
    TrafficModel("chat", 3, 0.25, 2.0),
    TrafficModel("coder", 3, 0.08, 3.0),
    TrafficModel("vision", 3, 0.04, 4.0),
    TrafficModel("embed", 2, 0.06, 1.0),
    TrafficModel("rerank", 2, 0.04, 1.5),
)


@dataclass(frozen=True)
class Arrival:
    """One scripted request."""

    at: float  # seconds from the start of the traffic
    model: str
    tokens: int  # the answer's length: the service time is tokens * TOKEN_DELAY_S
    stream: bool


def script(seconds: float, seed: int) -> list[Arrival]:
    """Poisson arrivals per model; answers of 4 to 60 tokens; a third of them streamed."""
    rng = random.Random(seed)
    out: list[Arrival] = []
    for model in MODELS:
        at = 0.0
        while True:
            at += rng.expovariate(model.rate_per_s)
            if at >= seconds:
                break
            out.append(Arrival(at, model.name, rng.randint(4, 60), rng.random() < 0.33))
    return sorted(out, key=lambda a: a.at)


def write_config(root: Path, make_room_after_s: int | None) -> Path:
    """A box of 8 GiB, idle timeouts of 60 s, the process runtime."""
    root.mkdir(parents=True, exist_ok=True)
    room = "" if make_room_after_s is None else f"ondemand_make_room_after_s = {make_room_after_s}"
    path = root / "dgxmm.toml"
    path.write_text(
        f"""
ondemand_idle_timeout_s = {IDLE_S}
{room}

[server]
data_dir = "{root / "data"}"
admin_port = 0
gateway_port = 0
shutdown_grace_s = 5

[runtime]
kind = "process"
stop_timeout_s = 5.0

[memory]
total_gib = {TOTAL_GIB}
reserve_gib = 0
watchdog_threshold_gib = 0
""",
        encoding="utf-8",
    )
    return path


async def record(root: Path, arrivals: list[Arrival], make_room_after_s: int | None) -> Path:
    """Run one real box under the traffic; returns its log (after an orderly stop)."""
    serve = Serve(root, write_config(root, make_room_after_s))
    await serve.start()
    try:
        api = serve.api
        assert api is not None
        ids: dict[str, str] = {}
        for model in MODELS:
            body = {
                "name": model.name,
                "engine": "sim",
                "model": served(model.name),
                "memory_gib": model.gib,
                "mode": "on_demand",
                "args": ["--startup-delay", str(model.startup_s), "--token-delay",
                         str(TOKEN_DELAY_S), "--tokens", "64"],
            }  # fmt: skip
            created = await api.ok("POST", "/dgxmm/api/deployments", body, 201)
            ids[model.name] = created["id"]
        began = time.monotonic()
        tasks = []
        for arrival in arrivals:
            delay = began + arrival.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the script's clock: arrivals at their times
            tasks.append(
                asyncio.create_task(_send(serve.gateway_port, serve.gateway_key, ids, arrival))
            )
        statuses = await asyncio.wait_for(asyncio.gather(*tasks), timeout=900)
        # Anything but an answer or a queue timeout means the traffic did not do its work
        # (a request naming a model the engine does not serve is answered 404 at once).
        wrong = sorted(s for s in statuses if s not in (200, 503))
        if wrong:
            raise RuntimeError(f"{len(wrong)} of {len(statuses)} requests answered {wrong[:5]}")
    finally:
        await serve.terminate()
        serve.kill_engines()
    return serve.db


def served(name: str) -> str:
    """The model a deployment's engine serves, which a request's body must name."""
    return f"sim/{name}"


async def _send(port: int, key: str, ids: dict[str, str], arrival: Arrival) -> int:
    client = await Client.connect(port, key)
    try:
        reply = await client.request(
            "POST",
            f"/d/{ids[arrival.model]}/v1/chat/completions",
            chat_body(served(arrival.model), stream=arrival.stream, max_tokens=arrival.tokens),
            [("content-type", "application/json")],
        )
        return reply.status
    finally:
        client.close()


@dataclass
class Comparison:
    """One simulated column against one recorded one."""

    label: str
    recorded: Report
    simulated: Report

    def agreement(self) -> float:
        """Share of requests on which both agree whether they waited."""
        a, b = set(self.recorded.waited_ids), set(self.simulated.waited_ids)
        return 1.0 - len(a ^ b) / max(1, self.recorded.requests)

    def problems(self) -> list[str]:
        """The acceptance's tolerances that do not hold."""
        out = []
        r, s = self.recorded, self.simulated
        if abs(r.cold_starts - s.cold_starts) > 1:
            out.append(f"cold starts {s.cold_starts} vs {r.cold_starts}")
        if abs(r.evictions - s.evictions) > 1:
            out.append(f"evictions {s.evictions} vs {r.evictions}")
        # Every request's fate: the real box's refused, timed-out and stopped requests
        # against the prediction's (served is what is left of the same requests).
        for fate in FATES:
            a, b = getattr(r.fates, fate), getattr(s.fates, fate)
            if abs(a - b) > 1:
                out.append(f"{fate.replace('_', ' ')} {b} vs {a}")
        for q in ("p50", "p90"):
            a, b = getattr(r.waits, q), getattr(s.waits, q)
            if abs(a - b) > max(0.1 * a, 0.5):
                out.append(f"wait {q} {b:.2f} vs {a:.2f}")
        if self.agreement() < 0.95:
            out.append(f"waited agreement {self.agreement():.1%}")
        return out

    def rows(self) -> list[str]:
        """Markdown table rows."""
        r, s = self.recorded, self.simulated
        return [
            f"| {self.label} | requests | {r.requests} | {s.requests} |",
            f"| {self.label} | cold starts | {r.cold_starts} | {s.cold_starts} |",
            f"| {self.label} | evictions | {r.evictions} | {s.evictions} |",
            f"| {self.label} | wait p50 (s) | {r.waits.p50:.2f} | {s.waits.p50:.2f} |",
            f"| {self.label} | wait p90 (s) | {r.waits.p90:.2f} | {s.waits.p90:.2f} |",
            f"| {self.label} | wait p99 (s) | {r.waits.p99:.2f} | {s.waits.p99:.2f} |",
            *(
                f"| {self.label} | {fate.replace('_', ' ')} | {getattr(r.fates, fate)}"
                f" | {getattr(s.fates, fate)} |"
                for fate in FATES
            ),
            f"| {self.label} | requests that waited | {r.waited} | {s.waited} |",
            f"| {self.label} | waited: same requests | | {self.agreement():.1%} |",
        ]


async def calibrate(root: Path, seconds: float, seed: int = 1) -> list[Comparison]:
    """Both boxes for real, then both predictions from the first box's log."""
    arrivals = script(seconds, seed)
    first_db, now_db = await asyncio.gather(
        record(root / f"room-after-{ROOM_AFTER_S}s", arrivals, ROOM_AFTER_S),
        record(root / "at-once", arrivals, 0),
    )
    first_log: History = await load_history(first_db)
    at_once_log: History = await load_history(now_db)
    calibration = await simulate(first_log, {}, label="calibration")
    predicted = await simulate(
        first_log, {"ondemand_make_room_after_s": 0}, label="make room after 0 s"
    )
    at_once = measure_recorded(at_once_log)
    same = same_requests(at_once_log, first_log)
    at_once.waited_ids = sorted(same.get(i, -i) for i in at_once.waited_ids)
    return [
        Comparison("recorded settings", measure_recorded(first_log), calibration),
        Comparison("make room after 0 s", at_once, predicted),
    ]


def same_requests(box: History, other: History) -> dict[int, int]:
    """Request ids of `box` -> the same scripted request's id in `other`.  Each box numbers
    its requests from the second it started, so the boxes' ids differ; the n-th request to
    a model in one box is the n-th to it in the other."""

    def ranked(history: History) -> dict[tuple[str, int], int]:
        seen: dict[str, int] = {}
        out: dict[tuple[str, int], int] = {}
        for r in history.traffic:  # by arrival
            name = history.names[r.deployment_id]
            seen[name] = rank = seen.get(name, 0) + 1
            out[(name, rank)] = r.request_id
        return out

    theirs = ranked(other)
    return {rid: theirs[key] for key, rid in ranked(box).items() if key in theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--root", default="/tmp/dgxmm-whatif-calibration")
    args = parser.parse_args()
    results = asyncio.run(calibrate(Path(args.root), args.minutes * 60, args.seed))
    print("| run | figure | recorded | whatif |")
    print("|---|---|---|---|")
    for c in results:
        print("\n".join(c.rows()))
    print(json.dumps({c.label: c.problems() for c in results}))


if __name__ == "__main__":
    main()
