"""Calibration of `dgxmm whatif` on logs DGXMM really wrote.

Two real `dgxmm serve` (process runtime, simulated engines) get the same scripted Poisson
traffic at the same time: five on-demand models that do not all fit (3+3+3+2+2 GiB in 8),
each quiet often enough that a request for another may evict it, some requests streaming,
some waiting for memory; one box making room with a model idle for 20 s
(`ondemand_make_room_after_s = 20`), the other at once (`= 0`).  Then `whatif` replays the
first log with its recorded settings (the calibration: it should reproduce the first box,
its cold starts and evictions among them) and with make-room at once (the counterfactual:
it should predict the second box).  A third box runs under `ondemand_policy = "learned"`
with a periodically used model beside two irregular ones, and `whatif` replays its log with
its recorded settings: it should make the pre-warms the box made (below, `calibrate_learned`).

    python -m tests.whatif_calibration --minutes 20      # the table in docs/what-if.md

The test (`tests/test_whatif_calibration.py`) runs the 3-minute version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from actors.anticipation import lead_s
from events import model as m
from events.traffic import TrafficRecord, encode_batch
from simulations import whatif_run
from simulations.whatif import FATES, History, Report, load_history, measure_recorded, simulate
from simulations.whatif_measure import build_report
from storage.eventlog import EventStore
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


def write_config(root: Path, make_room_after_s: int | None, policy: str = "seed") -> Path:
    """A box of 8 GiB, idle timeouts of 60 s, the process runtime."""
    root.mkdir(parents=True, exist_ok=True)
    room = "" if make_room_after_s is None else f"ondemand_make_room_after_s = {make_room_after_s}"
    path = root / "dgxmm.toml"
    path.write_text(
        f"""
ondemand_idle_timeout_s = {IDLE_S}
ondemand_policy = "{policy}"
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
        ids = await create(serve, MODELS)
        await play(serve, ids, arrivals, time.monotonic())
    finally:
        await serve.terminate()
        serve.kill_engines()
    return serve.db


async def create(serve: Serve, models: tuple[TrafficModel, ...]) -> dict[str, str]:
    """The models' deployments (sim engines, on demand); name -> id."""
    api = serve.api
    assert api is not None
    ids: dict[str, str] = {}
    for model in models:
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
    return ids


async def play(serve: Serve, ids: dict[str, str], arrivals: list[Arrival], began: float) -> None:
    """Send each arrival at its time (`began`: the monotonic clock's time of 0); every one
    must be answered or time out in the queue."""
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


def prewarms_apart(
    done: dict[str, list[float]], predicted: dict[str, list[float]], tolerance_s: float
) -> list[str]:
    """The box's pre-warms (`done`, per model) the prediction began more than `tolerance_s`
    apart from.  The two sides are paired nearest first, each at most once: a model's
    pre-warms are a period apart, so an extra one on either side (which the counts allow)
    is left over and shifts no other pair."""
    out = []
    for name in sorted(set(done) & set(predicted)):
        ours, theirs = done[name], predicted[name]
        pairs = sorted((abs(a - b), i, j) for i, a in enumerate(ours) for j, b in enumerate(theirs))
        paired: dict[int, int] = {}
        taken: set[int] = set()
        for _, i, j in pairs:
            if i not in paired and j not in taken:
                paired[i] = j
                taken.add(j)
        for i, j in sorted(paired.items()):
            a, b = ours[i], theirs[j]
            if abs(a - b) > tolerance_s:
                out.append(f"pre-warm {i + 1} of {name} at {b:.1f} s vs {a:.1f} s")
    return out


@dataclass
class Comparison:
    """One simulated column against one recorded one."""

    label: str
    recorded: Report
    simulated: Report
    # The learned policy's: pre-warms per model name, and the job's requests that waited,
    # (recorded, simulated).
    prewarms: tuple[dict[str, int], dict[str, int]] | None = None
    job_waited: tuple[int, int] | None = None
    # When each pre-warm began (seconds into the window), per model name, both sides.
    prewarm_times: tuple[dict[str, list[float]], dict[str, list[float]]] | None = None

    def prewarm_timing(self) -> list[str]:
        """The box's pre-warms the prediction began at another time (`prewarms_apart`)."""
        if self.prewarm_times is None:
            return []
        return prewarms_apart(*self.prewarm_times, PREWARM_TIME_S)

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
        if self.prewarms is not None:
            # Pre-warms, per model: one either way.  A pre-warm due near the window's end
            # may be made on one side and not yet on the other; and the trace's batches
            # (every 10 s) are flushed on each side at its own phase.
            done, predicted = self.prewarms
            for name in sorted(set(done) | set(predicted)):
                a, b = done.get(name, 0), predicted.get(name, 0)
                if abs(a - b) > 1:
                    out.append(f"pre-warms of {name} {b} vs {a}")
        if self.job_waited is not None:
            # The pre-warmed model's requests that waited: one either way (the window's
            # last session, as above).
            a, b = self.job_waited
            if abs(a - b) > 1:
                out.append(f"job's requests that waited {b} vs {a}")
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
            *self._learned_rows(),
        ]

    def _learned_rows(self) -> list[str]:
        rows = []
        if self.prewarms is not None:
            done, predicted = self.prewarms
            for name in sorted(set(done) | set(predicted)):
                rows.append(
                    f"| {self.label} | pre-warms of {name} | {done.get(name, 0)}"
                    f" | {predicted.get(name, 0)} |"
                )
        if self.job_waited is not None:
            a, b = self.job_waited
            rows.append(f"| {self.label} | job's requests that waited | {a} | {b} |")
        if self.prewarm_times is not None:
            done, predicted = self.prewarm_times
            for name in sorted(set(done) | set(predicted)):
                a_s = ", ".join(f"{t:.1f}" for t in done.get(name, []))
                b_s = ", ".join(f"{t:.1f}" for t in predicted.get(name, []))
                rows.append(f"| {self.label} | pre-warms of {name} began at (s) | {a_s} | {b_s} |")
        return rows


async def calibrate(root: Path, seconds: float, seed: int = 1) -> list[Comparison]:
    """Both boxes for real, then both predictions from the first box's log."""
    arrivals = script(seconds, seed)
    first_db, now_db, learned = await asyncio.gather(
        record(root / f"room-after-{ROOM_AFTER_S}s", arrivals, ROOM_AFTER_S),
        record(root / "at-once", arrivals, 0),
        calibrate_learned(root / "learned", seconds, seed),
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
        learned,
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


# --- the learned policy (issue 44) ---------------------------------------------------------
#
# A third box, under `ondemand_policy = "learned"`: "job" is used in short sessions every
# `JOB_PERIOD_S` (a little jitter), "chat" and "coder" irregularly (Poisson); any two of the
# three fit.  A period needs five session beginnings more than the idle timeout apart (six
# minutes at least), longer than the 3-minute run: the box starts on a log that already
# holds `PRIOR_S` of the same traffic (the trace's batches, written before its start as its
# gateway would have written them), which it reads at start-up as it reads its last two
# weeks; the what-if starts from the same history (`History.prior`: the window begins after
# it).  Then the real traffic continues the pattern, and every job session should be
# pre-warmed, on the real box and in the prediction.

LEARNED_MODELS = (
    TrafficModel("job", 3, 0.0, 3.0),
    TrafficModel("chat", 3, 0.05, 2.0),
    TrafficModel("coder", 3, 0.02, 2.0),
)
JOB_PERIOD_S = 70.0  # its gaps (~65 s) are longer than the idle timeout: sessions apart
JOB_PHASE_S = 25.0  # its first session of the real traffic (the box has started by then)
JOB_JITTER_S = 1.5  # each session comes up to this much early or late
JOB_SESSION = (0.0, 3.0)  # a session: two requests, 3 s apart
PRIOR_S = 1800.0  # the traffic written into the log before the box starts
# The box starts again this long before the real traffic, and the prior ends a little before
# that (none of it in the box's future); the job's last session of the prior and its first of
# the real traffic are one period apart, so these add up to less than a period.
RESTART_S = 35.0
PRIOR_END_S = RESTART_S + 2.0
# The box must be up this long before the job's first pre-warm is due (about 8 s before its
# first session): it reads its history at start-up.
UP_BEFORE_S = 5.0
LEARNED_TOKENS = 20  # each answer: 1 s of service
# A pre-warm begins its lead before its predicted session (`lead_s`: the model's median
# cold start and 2 s, or 1.2 times that median where more, plus the sessions' spread): the
# prediction's starts are drawn from the box's recorded ones (3.2 to 4.2 s for the job
# here), so the median of its last few may differ from the box's by up to that spread, and
# the lead by as much.
PREWARM_TIME_S = 2.0


def learned_script(seconds: float, seed: int) -> list[Arrival]:
    """The third box's traffic from -`PRIOR_S` to `seconds` (0: the real traffic begins);
    none in (-`PRIOR_END_S`, 0), while the box starts again."""
    rng = random.Random(seed)
    out: list[Arrival] = []
    k = -math.ceil((PRIOR_S + JOB_PHASE_S) / JOB_PERIOD_S)
    while (begin := JOB_PHASE_S + k * JOB_PERIOD_S) < seconds:
        k += 1
        if begin < -PRIOR_S:
            continue
        begin += rng.uniform(-JOB_JITTER_S, JOB_JITTER_S)
        out.extend(Arrival(begin + d, "job", LEARNED_TOKENS, False) for d in JOB_SESSION)
    for model in LEARNED_MODELS[1:]:
        at = -PRIOR_S
        while (at := at + rng.expovariate(model.rate_per_s)) < seconds:
            out.append(Arrival(at, model.name, LEARNED_TOKENS, rng.random() < 0.33))
    return sorted(
        (a for a in out if a.at >= 0 or a.at <= -PRIOR_END_S),
        key=lambda a: a.at,
    )


async def write_prior(db: Path, ids: dict[str, str], arrivals: list[Arrival], t0: float) -> None:
    """The arrivals before the real traffic, as the trace's batches (served at once), in the
    log of a stopped box; `t0`: the epoch time of the real traffic's 0."""
    rows = [
        TrafficRecord(
            request_id=int((t0 - PRIOR_S) * 1_000_000) + n,
            deployment_id=ids[a.model],
            arrived=t0 + a.at,
            wait_s=0.0,
            ttfb_s=0.05,
            duration_s=a.tokens * TOKEN_DELAY_S,
            outcome="served",
            streamed=a.stream,
        )
        for n, a in enumerate(arrivals)
    ]
    store = await EventStore.open(db, create=False)
    try:
        for i in range(0, len(rows), 200):
            await store.append(m.STREAM_TRAFFIC, [encode_batch(rows[i : i + 200])], actor="system")
    finally:
        await store.close()


async def record_learned(root: Path, arrivals: list[Arrival]) -> tuple[Path, float]:
    """The third box: created, stopped, given its prior traffic, started again under the
    learned policy and sent the real traffic; its log and the window's start (epoch)."""
    config = write_config(root, ROOM_AFTER_S, policy="learned")
    serve = Serve(root, config)
    await serve.start()
    try:
        ids = await create(serve, LEARNED_MODELS)
    finally:
        await serve.terminate()
        serve.kill_engines()
    t0 = time.time() + RESTART_S + PRIOR_END_S
    await write_prior(serve.db, ids, [a for a in arrivals if a.at < 0], t0)
    began = time.monotonic() + (t0 - time.time())
    wait = began - RESTART_S - time.monotonic()
    if wait > 0:
        await asyncio.sleep(wait)  # the script's clock: the box starts at -RESTART_S
    await serve.start()  # the same data dir (its admin password from the first start)
    try:
        since = time.time()
        job_start_s = LEARNED_MODELS[0].startup_s + 1.0  # its launch and first probe
        if since > t0 + JOB_PHASE_S - lead_s(job_start_s, 2 * JOB_JITTER_S) - UP_BEFORE_S:
            raise RuntimeError(f"the box took {since - t0 + RESTART_S:.0f} s to start again")
        await play(serve, ids, [a for a in arrivals if a.at >= 0], began)
    finally:
        await serve.terminate()
        serve.kill_engines()
    return serve.db, since


def prewarms_of(records: Iterable[m.Recorded]) -> dict[str, list[float]]:
    """When each pre-warm began (epoch), per deployment id."""
    found: dict[str, list[float]] = {}
    for r in records:
        if isinstance(r.event, m.StartRequested) and r.event.reason == "prewarm":
            found.setdefault(r.stream.partition(":")[2], []).append(r.ts)
    return found


async def simulate_prewarms(
    history: History, overrides: dict[str, Any], label: str
) -> tuple[Report, dict[str, list[float]]]:
    """The what-if's column and its pre-warms per deployment (`Report` has none: they are
    read from the events `simulate` hands to `build_report`, which is watched, not changed)."""
    with mock.patch.object(whatif_run, "build_report", wraps=build_report) as spy:
        report = await simulate(history, overrides, label=label)
    return report, prewarms_of(spy.call_args.args[2])


async def calibrate_learned(root: Path, seconds: float, seed: int) -> Comparison:
    """The third box for real, then its prediction from its log with the recorded settings."""
    db, since = await record_learned(root, learned_script(seconds, seed))
    history = await load_history(db, since=since)
    report, predicted = await simulate_prewarms(history, {}, "learned")
    recorded = measure_recorded(history)
    names, done = history.names, prewarms_of(history.records)

    def since_start(found: dict[str, list[float]]) -> dict[str, list[float]]:
        return {names[d]: [t - since for t in ts] for d, ts in found.items()}

    return Comparison(
        "learned policy",
        recorded,
        report,
        prewarms=(
            {names[d]: len(ts) for d, ts in done.items()},
            {names[d]: len(ts) for d, ts in predicted.items()},
        ),
        job_waited=(job_waited(history, recorded), job_waited(history, report)),
        prewarm_times=(since_start(done), since_start(predicted)),
    )


def job_waited(history: History, report: Report) -> int:
    """The job's requests that waited, in a column."""
    job = {r.request_id for r in history.traffic if history.names[r.deployment_id] == "job"}
    return len(job & set(report.waited_ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--root",
        default="/tmp/dgxmm-whatif-calibration",
        help="each run's boxes go in a new directory under it (kept, for `dgxmm replay`)",
    )
    args = parser.parse_args()
    Path(args.root).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.root))
    print(f"the boxes' data: {run_dir}", flush=True)
    results = asyncio.run(calibrate(run_dir, args.minutes * 60, args.seed))
    print("| run | figure | recorded | whatif |")
    print("|---|---|---|---|")
    for c in results:
        print("\n".join(c.rows()))
    print(json.dumps({c.label: c.problems() + c.prewarm_timing() for c in results}))


if __name__ == "__main__":
    main()
