"""Benchmark traffic for anticipation (issue 44): three seeded traces, generated, never stored.

The learned on-demand policy claims to cut cold-start waits where traffic has a pattern and
to cost nothing where it has none.  These generators make the traffic that claim is tested
on, the same for every run of a seed, so that the bench (`tests/perf/bench_anticipation.py`)
and its CI-sized check compare policies on identical requests:

- (a) `office_hours`: 5 on-demand models of which any 3 fit and no 4 do, weekday use only,
  each model with its own daily shape (sessions in fixed hours of the day, UTC, each start
  jittered by a few minutes and its end by a few more, a session skipped now and then);
- (b) `periodic_jobs`: one model used for 2 minutes every 15 minutes (each run within
  30 s of its slot) beside two chat models used at random, the three not fitting at once;
- (c) `noise`: single requests to four models, each a Poisson process: no pattern at all.

Within a session requests come every few seconds to minutes (log-normal gaps).  Every model
has a recorded cold start of 30 to 120 s, so that starting it early matters.  A `Trace`
holds the box (its usable memory), the deployments (ids `d0`, `d1`, ... in order, as
`tests.whatif_support.write_log` names them) and the requests as the traffic trace records
them (`events.traffic.TrafficRecord`, served without waiting: the policies' waits are the
what-if's to find).

Pure: a seed in, a `Trace` out; no clock, no I/O.  Each model draws from a generator seeded
by the seed and its own name, so a model's requests do not move when another is added.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from functools import partial

import msgspec

from events.traffic import TrafficRecord

# 2026-01-01 00:00 UTC, a Thursday: where the logs the bench writes begin
# (`tests.whatif_support.T0`), so that a trace's days are calendar days.
EPOCH = 1_767_225_600.0
DAY_S = 86_400.0
LEAD_S = 1_200.0  # (b) and (c) begin this long after the log's start: its deployments made
PERIOD_S = 900.0  # (b): the job's period
PERIOD_JITTER_S = 30.0  # (b): each run starts within this of its slot
JOB_S = 120.0  # (b): each run lasts this long
START_JITTER_S = 300.0  # (a): a session's start, either way
END_JITTER_S = 600.0  # (a): a session's end, either way
GAP_MIN_S, GAP_MAX_S = 2.0, 240.0  # a session's gaps between requests are clipped to these


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    """One on-demand model of a trace."""

    deployment_id: str
    name: str
    gib: float
    start_s: float  # its recorded cold start
    service_s: float  # its requests' mean service time


class Trace(msgspec.Struct, frozen=True, kw_only=True):
    """A generated trace: the box, its models and their requests in arrival order."""

    name: str
    seed: int
    usable_gib: float
    deployments: tuple[Deployment, ...]
    records: tuple[TrafficRecord, ...]
    begin: float  # epoch: the first instant requests may come
    end: float  # epoch: none come at or after it


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """A model of (a) and its day: sessions from/to (hours of the day, UTC)."""

    name: str
    gib: float
    start_s: float
    service_s: float
    gap_s: float  # the median gap between a session's requests
    sessions: tuple[tuple[float, float], ...]
    attendance: float = 0.9  # the chance that a session takes place on a weekday


# (a): at most 3 sessions overlap at any hour (jitter aside), and any 3 models fit in
# 100 GiB (32 + 30 + 28 = 90) where no 4 do (20 + 24 + 28 + 30 = 102).
# fmt: off
OFFICE: tuple[Shape, ...] = (
    Shape(name="assistant", gib=28, start_s=45, service_s=4.0, gap_s=20.0,
          sessions=((9.0, 12.0), (13.5, 17.5))),
    Shape(name="coder", gib=32, start_s=90, service_s=8.0, gap_s=40.0,
          sessions=((10.0, 12.0), (14.0, 16.0))),
    Shape(name="summariser", gib=24, start_s=30, service_s=6.0, gap_s=30.0,
          sessions=((8.5, 11.5),)),
    Shape(name="vision", gib=30, start_s=60, service_s=5.0, gap_s=60.0,
          sessions=((14.0, 17.0),)),
    Shape(name="reasoner", gib=20, start_s=120, service_s=20.0, gap_s=15.0,
          sessions=((9.25, 9.75), (16.25, 16.75))),
)
# fmt: on
OFFICE_USABLE_GIB = 100.0

PERIODIC_USABLE_GIB = 100.0
# (b): any two fit, the three do not (40 + 30 + 36 = 106).
JOB = Deployment(deployment_id="d0", name="batch", gib=40, start_s=90, service_s=3.0)
CHATS = (
    Deployment(deployment_id="d1", name="chat", gib=30, start_s=40, service_s=4.0),
    Deployment(deployment_id="d2", name="writer", gib=36, start_s=60, service_s=6.0),
)
CHAT_OFF_S = 2_700.0  # (b): a chat model's mean time between sessions (exponential)
CHAT_SESSION_S = 480.0  # (b): its mean session (exponential, at least a minute)
CHAT_GAP_S = 20.0  # (b): the median gap between a chat session's requests

NOISE_USABLE_GIB = 100.0
# (c): any three fit (30 + 30 + 38 = 98), the four do not; one request each `every` s.
NOISE: tuple[tuple[Deployment, float], ...] = (
    (Deployment(deployment_id="d0", name="alpha", gib=20, start_s=30, service_s=3.0), 120.0),
    (Deployment(deployment_id="d1", name="beta", gib=30, start_s=60, service_s=5.0), 300.0),
    (Deployment(deployment_id="d2", name="gamma", gib=30, start_s=90, service_s=8.0), 600.0),
    (Deployment(deployment_id="d3", name="delta", gib=38, start_s=120, service_s=10.0), 1200.0),
)


def _rng(seed: int, name: str) -> random.Random:
    # A str seed is hashed by SHA-512 (not by `hash`): the same in every process.
    return random.Random(f"{seed}:{name}")


def _gap(rng: random.Random, median_s: float) -> float:
    """A gap between a session's requests: log-normal around `median_s`, clipped."""
    return min(GAP_MAX_S, max(GAP_MIN_S, rng.lognormvariate(math.log(median_s), 1.0)))


def _session(rng: random.Random, dep: str, service_s: float, begin: float, end: float,
             gap: Callable[[], float]) -> list[TrafficRecord]:  # fmt: skip
    """Requests from `begin` (the first at it) until `end`, `gap()` apart."""
    out = []
    at = begin
    while at < end:
        out.append(_record(rng, dep, at, service_s))
        at += gap()
    return out


def _record(rng: random.Random, dep: str, at: float, service_s: float) -> TrafficRecord:
    duration = max(0.2, rng.expovariate(1 / service_s))
    return TrafficRecord(
        request_id=0,
        deployment_id=dep,
        arrived=at,
        wait_s=0.0,
        ttfb_s=min(0.1, duration),
        duration_s=duration,
        outcome="served",
        streamed=rng.random() < 0.5,
    )


def _numbered(records: Iterable[TrafficRecord]) -> tuple[TrafficRecord, ...]:
    """In arrival order (ties by deployment), numbered from 1."""
    ordered = sorted(records, key=lambda r: (r.arrived, r.deployment_id))
    return tuple(msgspec.structs.replace(r, request_id=i) for i, r in enumerate(ordered, 1))


def is_weekday(at: float) -> bool:
    """Monday to Friday, UTC."""
    return (math.floor(at / DAY_S) + 3) % 7 < 5  # 1970-01-01 was a Thursday


def office_hours(seed: int = 1, *, days: float = 14.0, start: float = EPOCH) -> Trace:
    """(a): `days` calendar days from `start` (a midnight, UTC), requests on weekdays only."""
    end = start + days * DAY_S
    deployments = []
    records: list[TrafficRecord] = []
    for i, shape in enumerate(OFFICE):
        dep = f"d{i}"
        deployments.append(
            Deployment(
                deployment_id=dep,
                name=shape.name,
                gib=shape.gib,
                start_s=shape.start_s,
                service_s=shape.service_s,
            )
        )
        rng = _rng(seed, shape.name)
        for day in range(math.ceil(days)):
            midnight = start + day * DAY_S
            for frm, to in shape.sessions:
                # Drawn whether or not the day counts: a day's draws never shift the next's.
                held = rng.random() < shape.attendance
                begin = midnight + frm * 3600 + rng.uniform(-START_JITTER_S, START_JITTER_S)
                stop = midnight + to * 3600 + rng.uniform(-END_JITTER_S, END_JITTER_S)
                session_rng = random.Random(rng.getrandbits(64))
                if not held or not is_weekday(midnight):
                    continue
                records.extend(
                    r
                    for r in _session(
                        session_rng,
                        dep,
                        shape.service_s,
                        begin,
                        stop,
                        partial(_gap, session_rng, shape.gap_s),
                    )
                    if r.arrived < end
                )
    return Trace(
        name="a",
        seed=seed,
        usable_gib=OFFICE_USABLE_GIB,
        deployments=tuple(deployments),
        records=_numbered(records),
        begin=start,
        end=end,
    )


def periodic_jobs(seed: int = 1, *, days: float = 3.0, start: float = EPOCH) -> Trace:
    """(b): from `LEAD_S` after `start` for `days`, the job's runs and two chat models'."""
    begin = start + LEAD_S
    end = begin + days * DAY_S
    records: list[TrafficRecord] = []
    rng = _rng(seed, JOB.name)
    slot = begin + PERIOD_JITTER_S
    while True:
        run = slot + rng.uniform(-PERIOD_JITTER_S, PERIOD_JITTER_S)
        if run >= end:
            break
        records.extend(
            r
            for r in _session(
                rng,
                JOB.deployment_id,
                JOB.service_s,
                run,
                run + JOB_S,
                partial(rng.uniform, 4.0, 12.0),
            )
            if r.arrived < end
        )
        slot += PERIOD_S
    for chat in CHATS:
        rng = _rng(seed, chat.name)
        at = begin + rng.expovariate(1 / CHAT_OFF_S)
        while at < end:
            length = max(60.0, rng.expovariate(1 / CHAT_SESSION_S))
            session = _session(
                rng,
                chat.deployment_id,
                chat.service_s,
                at,
                min(at + length, end),
                partial(_gap, rng, CHAT_GAP_S),
            )
            records.extend(session)
            at = session[-1].arrived + rng.expovariate(1 / CHAT_OFF_S)
    return Trace(
        name="b",
        seed=seed,
        usable_gib=PERIODIC_USABLE_GIB,
        deployments=(JOB, *CHATS),
        records=_numbered(records),
        begin=begin,
        end=end,
    )


def noise(seed: int = 1, *, days: float = 3.0, start: float = EPOCH) -> Trace:
    """(c): from `LEAD_S` after `start` for `days`, Poisson arrivals to each model."""
    begin = start + LEAD_S
    end = begin + days * DAY_S
    records: list[TrafficRecord] = []
    for dep, every in NOISE:
        rng = _rng(seed, dep.name)
        at = begin + rng.expovariate(1 / every)
        while at < end:
            records.append(_record(rng, dep.deployment_id, at, dep.service_s))
            at += rng.expovariate(1 / every)
    return Trace(
        name="c",
        seed=seed,
        usable_gib=NOISE_USABLE_GIB,
        deployments=tuple(dep for dep, _ in NOISE),
        records=_numbered(records),
        begin=begin,
        end=end,
    )


GENERATORS: dict[str, Callable[..., Trace]] = {
    "a": office_hours,
    "b": periodic_jobs,
    "c": noise,
}
DEFAULT_DAYS = {"a": 14.0, "b": 3.0, "c": 3.0}
