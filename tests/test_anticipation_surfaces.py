"""The learned policy where people look (issue 44): /metrics, the timeline's marks (the API's
projection and the SVG), `dgxmm replay` and `dgxmm replay --request`, from real actors on the
virtual clock writing a real SQLite log."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from pathlib import Path
from typing import Any

import msgspec

from dgxmm import cli
from dgxmm.admin.metrics import prewarm_families, render
from dgxmm.replay.commands import render_story, story_view
from dgxmm.replay.logview import time_formatter
from dgxmm.replay.timeline_svg import render_svg
from events import model as m
from events.state import EMPTY
from events.timeline import project
from events.traffic import TrafficRecord, encode_batch
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour
from storage.eventlog import EventStore
from tests.test_anticipation import START_S, abandon_a_starting_pre_warm, job_runs, until

GIB = 1 << 30
LEARNED = {"ondemand_policy": "learned"}


class Scene(msgspec.Struct, kw_only=True):
    """What a scenario left behind: its log, ids and what it measured while running."""

    db: Path
    job: str
    metrics: str
    waited_request: str = ""  # a request that waited for its model's pre-warm to finish
    served_at_once: int = 0  # a numeric (gateway) id, in the trace, that found it pre-warmed
    prewarmed_ago_s: float = 0.0


def scene(tmp_path: Path, usable_gib: float, play: Any) -> Scene:
    tmp_path.mkdir(parents=True, exist_ok=True)

    async def main() -> Scene:
        db = tmp_path / "log.db"
        h = await Harness.create(
            db,
            behaviour=lambda spec: EngineBehaviour(startup_s=START_S),
            usable_gib=usable_gib,
            settings=LEARNED,
        )
        h.controller.prewarmer.anticipator.tz_offset_s = 0.0
        try:
            found: Scene = await play(h, db)
            assert h.violations == []
            return found
        finally:
            await h.close()

    return asyncio.run(main())


async def used_then_unused(h: Harness, db: Path) -> Scene:
    """A job every 15 minutes: pre-warmed and used (runs 6 and 7), a request that comes while
    its pre-warm is still starting (run 8), and a pre-warm no request comes to (run 9)."""
    job = await h.deploy("job", 10, idle_timeout_s=300)
    await h.advance(START_S + 5)
    results = await job_runs(h, job, 7)
    offset = h.clock.wall() - h.clock.now()
    sixth = results[10]
    assert sixth.admitted_at is not None and sixth.admitted_at - sixth.arrived < 1
    learned = h.controller.prewarmer.learned(h.controller.actors[job].state)
    assert learned is not None and learned.prediction is not None
    await until(h, learned.prediction.at - 40)
    assert h.state(job) == "starting"  # pre-warming
    early = h.request(job, hold_s=2)
    await h.advance(START_S + 10)
    assert early.outcome == "served"
    learned = h.controller.prewarmer.learned(h.controller.actors[job].state)
    assert learned is not None and learned.prediction is not None
    await until(h, learned.prediction.at + 3600)  # nothing comes
    recs = await h.events()
    prewarms = [
        r for r in recs if isinstance(r.event, m.StartRequested) and r.event.reason == "prewarm"
    ]
    # The sixth run's first request, as the gateway's trace records it, with a gateway id.
    first_ts = recs[0].ts
    rid = int(first_ts) * 1_000_000 + 7
    arrived = sixth.arrived + offset
    row = TrafficRecord(
        request_id=rid, deployment_id=job, arrived=arrived, wait_s=0.0, ttfb_s=0.1,
        duration_s=2.0, outcome="served", streamed=False,
    )  # fmt: skip
    failed = msgspec.structs.replace(row, request_id=rid + 1, outcome="engine_error")
    await h.store.append(m.STREAM_TRAFFIC, [encode_batch([row, failed])], actor="system")
    before = [r.ts for r in prewarms if r.ts <= arrived]
    return Scene(
        db=db,
        job=job,
        metrics=render(prewarm_families(h.controller)),
        waited_request=early.request_id,
        served_at_once=rid,
        prewarmed_ago_s=arrived - before[-1],
    )


async def abandoned(h: Harness, db: Path) -> Scene:
    """The job's pre-warm is still starting when another model's request needs its memory."""
    job, r = await abandon_a_starting_pre_warm(h)
    return Scene(db=db, job=job, metrics=render(prewarm_families(h.controller)),
                 waited_request=r.request_id)  # fmt: skip


def sample(metrics: str, name: str, **labels: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in\n{metrics}")


async def read(db: Path) -> list[m.Recorded]:
    store = await EventStore.open(db, create=False, readonly=True)
    try:
        return await store.read()
    finally:
        await store.close()


async def story(db: Path, request_id: str) -> list[str]:
    store = await EventStore.open(db, create=False, readonly=True)
    try:
        view = await story_view(store, str(db), None, request_id, time_formatter(False, None))
    finally:
        await store.close()
    return list(render_story(view))


def timeline_of(recs: list[m.Recorded]) -> Any:
    return project(EMPTY, recs, recs[0].ts - 1, recs[-1].ts + 1, 40 * GIB)


# --- /metrics ------------------------------------------------------------------------------------


def test_metrics_count_each_deployments_pre_warms_used_wasted_and_abandoned(tmp_path: Path) -> None:
    one = scene(tmp_path / "a", 40, used_then_unused)
    labels = {"deployment": "job", "id": one.job}
    assert sample(one.metrics, "dgxmm_ondemand_prewarms_started_total", **labels) == 4
    assert sample(one.metrics, "dgxmm_ondemand_prewarms_total", **labels, outcome="used") == 3
    assert sample(one.metrics, "dgxmm_ondemand_prewarms_total", **labels, outcome="wasted") == 1
    assert "# TYPE dgxmm_ondemand_prewarms_total counter" in one.metrics
    two = scene(tmp_path / "b", 15, abandoned)
    job = {"deployment": "job", "id": two.job}
    assert sample(two.metrics, "dgxmm_ondemand_prewarms_total", **job, outcome="abandoned") == 1
    other = [ln for ln in two.metrics.splitlines() if 'deployment="other"' in ln]
    assert other and all(ln.endswith(" 0") for ln in other)  # never pre-warmed: zeros


# --- the timeline --------------------------------------------------------------------------------


def test_the_timeline_marks_pre_warms_kept_warm_sleeps_unused_and_abandoned_pre_warms(
    tmp_path: Path,
) -> None:
    one = scene(tmp_path / "a", 40, used_then_unused)
    marks = timeline_of(asyncio.run(read(one.db))).marks
    kinds = [k.kind for k in marks if k.deployment_id == one.job]
    assert kinds.count("prewarm") == 4 and kinds.count("prewarm_unused") == 1
    assert "kept_warm" in kinds
    pre = next(k for k in marks if k.kind == "prewarm")
    assert re.fullmatch(
        r"job pre-warmed \(next request expected in ~\d+ s: used every 15 min for 60 min\)",
        pre.title,
    ), pre.title
    assert pre.actor == "ondemand" and isinstance(pre.event, m.StartRequested)
    kept = next(k for k in marks if k.kind == "kept_warm")
    # Before its period is known, its gaps keep it warm a while; once it is, it lends its
    # memory between its runs (nobody takes it here: it sleeps at its idle timeout, 5 min),
    # and a pre-warm starts it before each.
    assert re.fullmatch(r"job kept warm \d+ s \(its usual gaps\), then slept", kept.title)
    assert "job put to sleep after 300 s idle" in [k.title for k in marks if k.kind == "idle_sleep"]
    svg = render_svg(timeline_of(asyncio.run(read(one.db))))
    for kind, glyph in (("prewarm", "◆"), ("kept_warm", "◐"), ("prewarm_unused", "◇")):
        assert re.search(rf'<g class="mark" data-kind="{kind}"[^>]*><title>[^<]*</title>'
                         rf'<text[^>]*>{glyph}</text>', svg), kind  # fmt: skip
    assert "◆ pre-warm" in svg and "⊘ pre-warm abandoned" in svg  # the legend
    two = scene(tmp_path / "b", 15, abandoned)
    marks = timeline_of(asyncio.run(read(two.db))).marks
    gone = [k for k in marks if k.kind == "prewarm_abandoned"]
    assert [k.title for k in gone] == ["job: pre-warm abandoned for a queued request"]
    assert 'data-kind="prewarm_abandoned"' in render_svg(timeline_of(asyncio.run(read(two.db))))


# --- replay ------------------------------------------------------------------------------------


def test_a_request_story_says_its_model_was_pre_warmed_before_it(tmp_path: Path) -> None:
    one = scene(tmp_path, 40, used_then_unused)
    waited = asyncio.run(story(one.db, one.waited_request))
    notes = [ln for ln in waited if "pre-warmed" in ln and "before this request" in ln]
    assert notes and re.fullmatch(r"  the model was pre-warmed \d+ s before this request", notes[0])
    at_once = asyncio.run(story(one.db, str(one.served_at_once)))
    assert at_once[0].startswith(f"request {one.served_at_once} for job: served at once")
    ago = round(one.prewarmed_ago_s)
    assert at_once[1:] == [f"  the model was pre-warmed {ago} s before this request"]
    failed = asyncio.run(story(one.db, str(one.served_at_once + 1)))
    assert failed[0] == (
        f"request {one.served_at_once + 1} for job:"
        " did not wait; the traffic trace records it as engine_error"
    )


def test_a_queued_requests_story_shows_the_pre_warm_abandoned_for_it(tmp_path: Path) -> None:
    two = scene(tmp_path, 15, abandoned)
    lines = asyncio.run(story(two.db, two.waited_request))
    assert any(ln.endswith("Pre-warm abandoned for a queued request") for ln in lines), lines


def test_plain_replay_shows_the_learned_policys_titles(tmp_path: Path) -> None:
    one = scene(tmp_path, 40, used_then_unused)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["replay", "--db", str(one.db), "--all"]) == 0
    text = out.getvalue()
    assert "Pre-warmed (next request expected in ~" in text
    assert re.search(r"Kept warm \d+ s \(its usual gaps\)", text)
    assert "Put to sleep: no request came to its pre-warm" in text


def test_plain_replay_names_a_deployments_own_policy(tmp_path: Path) -> None:
    async def play(h: Harness, db: Path) -> Scene:
        job = await h.deploy("job", 10, idle_timeout_s=300)
        await h.controller.change_mode(
            job, "on_demand", 300, False, "admin:test", ondemand_policy="seed"
        )
        return Scene(db=db, job=job, metrics="")

    one = scene(tmp_path, 40, play)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["replay", "--db", str(one.db)]) == 0
    assert "  mode       on demand, idle timeout 300 s, its own policy seed" in out.getvalue()
