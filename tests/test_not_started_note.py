"""The note on why a deployment did not start is true at every moment (issue 46, stumble 8).

At the demo's first boot, demo-large (40 GiB) is created while demo-chat is still starting:
it does not fit, and no idle model can make room.  Once demo-chat is ready and idle, it can:
the note must not keep saying it cannot.  The note is read from the budget as it is
(`MemoryBroker.no_room`, `Controller._not_started_now`) and pushed again when another
deployment's state or activity changes, or when an idle model becomes able to make room.
The demo's deployments run here on the real actors and the virtual clock
(`simulations.harness`), with a real SQLite log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.memory_broker import GIB, no_room_note
from dgxmm.admin.client import ps_lines
from simulations.harness import Harness
from simulations.runtime import EngineBehaviour

STARTUP_S = 2.0  # demo-chat's --startup-delay
NO_ROOM = (
    "demo-large needs 40 GiB but only 36 GiB are free and no idle on-demand model can make room"
)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def demo_box(tmp_path: Path, **settings: Any) -> Harness:
    """The demo's budget (48 GiB) and deployments, in the order the demo creates them."""
    return await Harness.create(
        tmp_path / "log.db",
        usable_gib=48,
        behaviour=lambda spec: EngineBehaviour(startup_s=STARTUP_S),
        settings=settings,
    )


async def demo_deployments(h: Harness) -> tuple[str, str]:
    await h.deploy("demo-always", 4, mode="always_on", role="decision")
    chat = await h.deploy("demo-chat", 8)
    large = await h.deploy("demo-large", 40)
    return chat, large


async def until_ready(h: Harness, dep_id: str, limit_s: float = 60) -> None:
    """Advance virtual time until the deployment is ready (virtual deadline)."""
    start = h.clock.now()
    while h.state(dep_id) != "ready":
        assert h.clock.now() - start < limit_s, h.state(dep_id)
        await h.advance(0.5)


def note(h: Harness, dep_id: str) -> str | None:
    """What the API (and `dgxmm ps`) say."""
    return h.controller.record(h.controller.actors[dep_id]).not_started


def test_the_note_is_present_tense_arithmetic_of_the_budget() -> None:
    assert no_room_note("x", 40 * GIB, 36 * GIB, []) == (
        "x needs 40 GiB but only 36 GiB are free and no idle on-demand model can make room"
    )
    assert no_room_note("x", 40 * GIB, 30 * GIB, [8 * GIB]) == (
        "x needs 40 GiB but only 30 GiB are free and the idle on-demand models can free only "
        "8 GiB more"
    )
    assert no_room_note("x", 40 * GIB, 36 * GIB, [8 * GIB]) is None  # 36 + 8 >= 40
    assert no_room_note("x", 40 * GIB, 40 * GIB, []) is None


def test_at_the_demos_first_boot_the_note_goes_once_demo_chat_is_idle_and_comes_back_while_busy(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        h = await demo_box(tmp_path, ondemand_make_room_after_s=0)  # as the demo runs
        try:
            chat, large = await demo_deployments(h)
            pushed: list[str] = []
            h.controller.add_listener(lambda dep_id, what: pushed.append(dep_id))
            assert h.state(chat) == "starting" and h.state(large) == "stopped"
            assert note(h, large) == NO_ROOM  # true: demo-chat is starting, not idle
            await until_ready(h, chat)  # after demo-always's start: one start at a time
            assert h.state(large) == "stopped"
            assert note(h, large) is None  # demo-chat, idle, can make room
            assert large in pushed  # the UI was given demo-large again when demo-chat changed
            assert not any("not now" in line for line in _ps(h))
            busy = h.request(chat, hold_s=30)
            await h.advance(1)
            assert busy.admitted_at is not None
            assert note(h, large) == NO_ROOM  # true again while demo-chat answers
            assert any(f"not now: {NO_ROOM}" in line for line in _ps(h))
            await h.advance(30)
            assert busy.outcome == "served" and note(h, large) is None
        finally:
            await h.close()

    run(main())


def test_the_note_goes_the_moment_an_idle_model_may_make_room_and_the_ui_is_told(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        h = await demo_box(tmp_path, ondemand_make_room_after_s=30)
        pushed: list[tuple[str, float]] = []
        try:
            chat, large = await demo_deployments(h)
            await until_ready(h, chat)
            ready_at = h.controller.actors[chat].activity.last_used  # its idle timer's start
            h.controller.add_listener(
                lambda dep_id, what: (
                    pushed.append((dep_id, h.clock.now())) if dep_id == large else None
                )
            )
            assert note(h, large) == NO_ROOM  # just ready: not a candidate for 30 s
            await h.advance(29)
            assert note(h, large) == NO_ROOM
            assert pushed == []
            await h.advance(1.5)
            assert note(h, large) is None
            # With no event of its own, the UI was pushed demo-large again at that moment.
            assert [at for _, at in pushed] == [pytest.approx(ready_at + 30)], (ready_at, pushed)
        finally:
            await h.close()

    run(main())


def test_a_request_across_the_moment_moves_the_push_to_30_s_after_its_end(tmp_path: Path) -> None:
    async def main() -> None:
        h = await demo_box(tmp_path, ondemand_make_room_after_s=30)
        pushed: list[float] = []
        try:
            chat, large = await demo_deployments(h)
            await until_ready(h, chat)
            await h.advance(25)
            busy = h.request(chat, hold_s=20)  # in flight when its first 30 s are up
            await h.advance(1)
            assert busy.admitted_at is not None
            h.controller.add_listener(
                lambda dep_id, what: pushed.append(h.clock.now()) if dep_id == large else None
            )
            await h.advance(19.5)
            assert busy.outcome == "served" and note(h, large) == NO_ROOM
            ended = h.controller.actors[chat].activity.last_used
            pushed.clear()
            await h.advance(29)
            assert note(h, large) == NO_ROOM and pushed == []
            await h.advance(1.5)
            assert note(h, large) is None
            assert pushed == [pytest.approx(ended + 30)]
        finally:
            await h.close()

    run(main())


def test_an_always_on_deployment_says_there_is_room_now_rather_than_none(tmp_path: Path) -> None:
    async def main() -> None:
        h = await demo_box(tmp_path, ondemand_make_room_after_s=0)
        try:
            await h.deploy("demo-always", 4, mode="always_on", role="decision")
            chat = await h.deploy("demo-chat", 8)
            big = await h.deploy("big", 40, mode="always_on")
            assert note(h, big) == NO_ROOM.replace("demo-large", "big")
            await until_ready(h, chat)
            assert (
                note(h, big) == "big found no room when it was started; there is room now: start it"
            )
        finally:
            await h.close()

    run(main())


def _ps(h: Harness) -> list[str]:
    """`dgxmm ps`'s lines for this box's records."""
    return ps_lines([msgspec.to_builtins(r) for r in h.controller.records()], h.clock.wall())
