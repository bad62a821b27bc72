"""End to end over real sockets: two on-demand models that do not fit together.

Real parts: the SQLite log, the gateway on loopback, the process runtime running simulated
engines as subprocesses, the HTTP engine probe.  The controller's clock is virtual (see
tests/test_e2e_ondemand.py): idle timers run on virtual time while engines start for real.
With `ondemand_make_room_after_s = 0`, alternating requests A, B, A, B each cost one stop
and one cold start; unset, the seed's rule makes the second model wait for the first one's
idle timer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from events import model as m
from tests.test_e2e_ondemand import Box, chat, post

IDLE_S = 120  # Box.deploy's idle timeout


async def two_models(box: Box) -> tuple[str, str]:
    a = await box.deploy("a", 60, ["--startup-delay", "0.2"])
    b = await box.deploy("b", 60, ["--startup-delay", "0.2"])  # does not fit beside a
    await box.drive(lambda: box.state(a) == "ready", step=0.5)
    assert box.state(b) == "stopped"
    return a, b


async def ask(box: Box, dep_id: str, name: str) -> float:
    """One chat request through the gateway; the virtual seconds until it was answered."""
    start = box.clock.now()
    reply = asyncio.ensure_future(post(box.port, dep_id, chat(f"org/{name}", False)))
    await box.drive(reply.done, step=0.05, limit_s=IDLE_S * 3)
    answer = reply.result()
    assert answer.status == 200, answer.body
    assert answer.json()["choices"][0]["message"]["content"]
    return box.clock.now() - start


def test_with_zero_alternating_requests_cost_one_stop_and_one_cold_start_each(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        box = Box(tmp_path)
        await box.start()
        try:
            await box.controller.change_settings({"ondemand_make_room_after_s": 0}, "admin:t")
            a, b = await two_models(box)
            names = {a: "a", b: "b"}
            for target in (b, a, b, a):
                before = len(await box.store.read())
                waited = await ask(box, target, names[target])
                # served after one stop and one cold start, far from the 120 s idle timer
                assert waited < IDLE_S / 2, waited
                recs = (await box.store.read())[before:]
                sleeps = [
                    (r.stream, r.event.reason, r.event.for_deployment)
                    for r in recs
                    if isinstance(r.event, m.PutToSleep)
                ]
                other = a if target == b else b
                assert sleeps == [(m.deployment_stream(other), "make_room", target)]
                starts = [
                    r.stream
                    for r in recs
                    if isinstance(r.event, m.StartRequested) and r.event.reason == "request"
                ]
                assert starts == [m.deployment_stream(target)]
        finally:
            await box.stop()

    asyncio.run(main())


def test_unset_the_second_model_waits_for_the_first_ones_idle_timer(tmp_path: Path) -> None:
    async def main() -> None:
        box = Box(tmp_path)
        await box.start()
        try:
            a, b = await two_models(box)
            await ask(box, a, "a")
            start = box.clock.now()
            reply = asyncio.ensure_future(post(box.port, b, chat("org/b", False)))
            await box.drive(reply.done, step=1.0, limit_s=IDLE_S * 3)
            assert reply.result().status == 200
            assert box.clock.now() - start >= IDLE_S - 2  # a slept after its idle timeout
            sleeps = [
                r.event.reason
                for r in await box.store.read(stream=m.deployment_stream(a))
                if isinstance(r.event, m.PutToSleep)
            ]
            assert sleeps == ["idle"]
        finally:
            await box.stop()

    asyncio.run(main())
