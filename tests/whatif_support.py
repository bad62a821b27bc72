"""Synthesised logs for the what-if (`simulations.whatif`): a box, its deployments and a
Poisson trace, written as `dgxmm serve` would write them."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

from actors.memory_broker import GIB
from events import model as m
from events.traffic import TrafficRecord, encode_batch
from storage.eventlog import EventStore

T0 = 1_767_225_600.0


@dataclass(frozen=True)
class Model:
    """One synthesised deployment and its traffic."""

    name: str
    gib: float
    rate_per_s: float  # Poisson arrivals
    service_s: float  # mean (exponential)
    mode: m.Mode = "on_demand"
    idle_timeout_s: int | None = None
    start_s: float | None = None  # its recorded cold start (None: the log times none)


async def write_log(
    path: str | os.PathLike[str],
    models: Sequence[Model],
    *,
    hours: float,
    usable_gib: float = 100.0,
    seed: int = 1,
    start_s: float = 20.0,
    batch_s: float = 10.0,
    defaults: dict[str, object] | None = None,
    poisson: bool = True,
    traffic: Sequence[TrafficRecord] | None = None,
) -> int:
    """A log with a trace of `hours` of traffic in which nothing ever waited (the recorded
    column is not calibrated here: only the simulated ones are read); returns the requests.
    Not `poisson`: each model's requests come every 1 / rate seconds, the models' in turn.
    `traffic`: these requests instead of the models' rates (deployment ids d0, d1, ... in
    the models' order, epoch arrivals after the deployments are made and before `hours`
    after that; renumbered in arrival order)."""
    rng = random.Random(seed)
    now = [T0]
    store = await EventStore.open(path, wall=lambda: now[0])
    box = m.TraceStarted(
        usable_bytes=int(usable_gib * GIB), total_bytes=int(usable_gib * GIB),
        defaults=dict(defaults or {}),
    )  # fmt: skip
    await store.append(m.STREAM_TRAFFIC, [box], actor="system")
    for i, model in enumerate(models):
        dep = f"d{i}"
        created = m.DeploymentCreated(
            deployment_id=dep, name=model.name, engine="sim", model=f"org/{model.name}",
            memory_bytes=int(model.gib * GIB), mode=model.mode,
            idle_timeout_s=model.idle_timeout_s,
        )  # fmt: skip
        await store.append(m.deployment_stream(dep), [created], actor="admin:test")
        now[0] += 0.001
        await store.append(
            m.deployment_stream(dep), [m.StartRequested(reason="admin")], actor="admin:test"
        )
        if model.start_s is not None:  # the engine launched at once: its start is timed
            starting = m.EngineStarting(runtime_id=f"sim:{dep}", host="127.0.0.1", port=20000 + i)
            await store.append(m.deployment_stream(dep), [starting], actor="ondemand")
        now[0] += start_s if model.start_s is None else model.start_s
        await store.append(m.deployment_stream(dep), [m.EngineReady()], actor="ondemand")
    records: list[TrafficRecord] = list(traffic or ())
    begin = now[0] + 1
    end = begin + hours * 3600
    if any(not begin <= r.arrived < end for r in records):
        raise ValueError(f"traffic outside the trace's {begin:.0f} to {end:.0f}")
    for i, model in enumerate(models if traffic is None else ()):
        every = 1 / model.rate_per_s
        at = begin if poisson else begin + i * every / len(models)
        while True:
            at += rng.expovariate(model.rate_per_s) if poisson else every
            if at >= end:
                break
            records.append(
                TrafficRecord(
                    request_id=0, deployment_id=f"d{i}", arrived=at, wait_s=0.0, ttfb_s=0.1,
                    duration_s=rng.expovariate(1 / model.service_s), outcome="served",
                    streamed=rng.random() < 0.5,
                )
            )  # fmt: skip
    records.sort(key=lambda r: r.arrived)
    rid = int(begin * 1_000_000)
    numbered = []
    for r in records:
        rid += 1
        numbered.append(
            TrafficRecord(
                request_id=rid, deployment_id=r.deployment_id, arrived=r.arrived,
                wait_s=r.wait_s, ttfb_s=r.ttfb_s, duration_s=r.duration_s,
                outcome=r.outcome, streamed=r.streamed,
            )
        )  # fmt: skip
    batch: list[TrafficRecord] = []
    edge = begin + batch_s
    for r in numbered:
        if r.arrived >= edge and batch:
            now[0] = edge
            await store.append(m.STREAM_TRAFFIC, [encode_batch(batch)], actor="system")
            batch = []
            while edge <= r.arrived:
                edge += batch_s
        batch.append(r)
    if batch:
        now[0] = end
        await store.append(m.STREAM_TRAFFIC, [encode_batch(batch)], actor="system")
    await store.close()
    return len(numbered)
