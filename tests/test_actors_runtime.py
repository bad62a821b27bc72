"""The actor runtime: tell/ask, deadlines, bounded mailboxes, crashes, stop, clocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, assert_never

import msgspec
import pytest
import uvloop

from actors.errors import ActorCrashed, ActorStopped, AskTimeout, MailboxFull
from actors.runtime import Actor, Clock, SystemClock, VirtualClock

T = TypeVar("T")
DEADLINE_S = 5.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one test coroutine on a fresh asyncio loop."""
    return asyncio.run(coro)


async def eventually(condition: Callable[[], bool], deadline_s: float = DEADLINE_S) -> None:
    """Poll `condition` until it holds, failing after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}


class Add(msgspec.Struct, frozen=True):
    """Add n to the total; the reply is the new total."""

    n: int


class Get(msgspec.Struct, frozen=True):
    """Reply with the total."""


class Boom(msgspec.Struct, frozen=True):
    """Make the handler raise (after changing nothing)."""


class Block(msgspec.Struct, frozen=True):
    """Signal `entered`, then wait for `gate`."""

    entered: asyncio.Event
    gate: asyncio.Event


class Tick(msgspec.Struct, frozen=True):
    """A timer message."""

    label: str


Message = Add | Get | Boom | Block | Tick


class Counter(Actor):
    """A small actor that owns a total."""

    def __init__(self, clock: Clock, *, mailbox_size: int = 64) -> None:
        super().__init__("counter", clock, mailbox_size=mailbox_size)
        self.total = 0
        self.ticks: list[tuple[float, str]] = []
        self.ticked = asyncio.Event()
        self.crashes: list[Exception] = []

    async def handle(self, message: Message) -> Any:
        """Serve one message."""
        match message:
            case Add(n=n):
                self.total += n
                return self.total
            case Get():
                return self.total
            case Boom():
                raise RuntimeError("boom")
            case Block(entered=entered, gate=gate):
                entered.set()
                await gate.wait()
                return "opened"
            case Tick(label=label):
                self.ticks.append((self.clock.now(), label))
                self.ticked.set()
                return None
            case _:
                assert_never(message)

    async def on_crash(self, exc: Exception) -> None:
        """Record the crash (a real actor refolds its events here)."""
        self.crashes.append(exc)


def test_tell_is_served_in_order_and_ask_returns_the_reply() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        actor.start()
        actor.tell(Add(2))
        actor.tell(Add(3))
        assert await actor.ask(Add(10)) == 15
        assert await actor.ask(Get()) == 15
        assert actor.statistics()["handled"] == 4
        await actor.stop()

    run(scenario())


def test_an_unanswered_ask_raises_ask_timeout_and_the_actor_serves_on() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        actor.start()
        entered, gate = asyncio.Event(), asyncio.Event()
        with pytest.raises(AskTimeout):
            await actor.ask(Block(entered, gate), timeout=0.05)
        assert entered.is_set()
        gate.set()
        assert await actor.ask(Add(1), timeout=DEADLINE_S) == 1
        await actor.stop()

    run(scenario())


def test_an_ask_that_times_out_while_waiting_in_the_mailbox_is_never_served() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        actor.start()
        entered, gate = asyncio.Event(), asyncio.Event()
        blocked = asyncio.create_task(actor.ask(Block(entered, gate), timeout=None))
        await asyncio.wait_for(entered.wait(), DEADLINE_S)
        with pytest.raises(AskTimeout):
            await actor.ask(Add(100), timeout=0.01)
        gate.set()
        assert await blocked == "opened"
        assert await actor.ask(Get()) == 0  # the timed-out Add was dropped, not applied late
        await actor.stop()

    run(scenario())


def test_a_full_mailbox_refuses_tell_and_ask_with_mailbox_full() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock(), mailbox_size=2)  # not started: nothing drains it
        actor.tell(Add(1))
        actor.tell(Add(1))
        with pytest.raises(MailboxFull):
            actor.tell(Add(1))
        with pytest.raises(MailboxFull):
            await actor.ask(Get(), timeout=DEADLINE_S)
        actor.start()
        await eventually(lambda: actor.statistics()["mailbox"] == 0)
        assert await actor.ask(Get(), timeout=DEADLINE_S) == 2
        await actor.stop()

    run(scenario())


def test_a_raising_handler_fails_its_ask_with_actor_crashed_and_the_actor_keeps_its_state() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        actor.start()
        await actor.ask(Add(5))
        with pytest.raises(ActorCrashed) as caught:
            await actor.ask(Boom(), timeout=None)
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert len(actor.crashes) == 1
        assert await actor.ask(Get()) == 5
        assert await actor.ask(Add(1)) == 6
        assert actor.statistics()["crashes"] == 1
        await actor.stop()

    run(scenario())


def test_a_crash_on_a_told_message_is_survived() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        actor.start()
        actor.tell(Add(1))
        actor.tell(Boom())
        actor.tell(Add(1))
        assert await actor.ask(Get()) == 2
        assert len(actor.crashes) == 1
        await actor.stop()

    run(scenario())


def test_no_ask_hangs_when_handlers_keep_crashing() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        actor.start()
        asks = [actor.ask(Boom() if i % 2 else Add(1), timeout=None) for i in range(40)]
        results = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), DEADLINE_S)
        crashed = [r for r in results if isinstance(r, ActorCrashed)]
        assert len(crashed) == 20
        assert [r for r in results if isinstance(r, int)] == list(range(1, 21))
        await actor.stop()

    run(scenario())


def test_stop_fails_the_ask_in_progress_and_the_waiting_ones_with_actor_stopped() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        actor.start()
        entered, gate = asyncio.Event(), asyncio.Event()
        in_progress = asyncio.create_task(actor.ask(Block(entered, gate), timeout=None))
        waiting = [asyncio.create_task(actor.ask(Add(1), timeout=None)) for _ in range(3)]
        await asyncio.wait_for(entered.wait(), DEADLINE_S)
        await actor.stop()
        results = await asyncio.wait_for(
            asyncio.gather(in_progress, *waiting, return_exceptions=True), DEADLINE_S
        )
        assert all(isinstance(r, ActorStopped) for r in results), results
        assert not actor.running

    run(scenario())


def test_a_stopped_actor_refuses_tell_and_ask() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        actor.start()
        await actor.stop()
        await actor.stop()  # idempotent
        with pytest.raises(ActorStopped):
            actor.tell(Add(1))
        with pytest.raises(ActorStopped):
            await actor.ask(Get())

    run(scenario())


def test_stopping_an_actor_that_never_started_fails_its_queued_asks() -> None:
    async def scenario() -> None:
        actor = Counter(SystemClock())
        pending = asyncio.create_task(actor.ask(Get(), timeout=None))
        await asyncio.sleep(0)  # the ask is in the mailbox now
        await actor.stop()
        with pytest.raises(ActorStopped):
            await asyncio.wait_for(pending, DEADLINE_S)

    run(scenario())


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_virtual_timers_fire_in_order_only_when_the_clock_is_advanced(loop: str) -> None:
    async def scenario() -> None:
        clock = VirtualClock()
        actor = Counter(clock)
        actor.start()
        actor.schedule(30, Tick("c"))
        actor.schedule(10, Tick("a"))
        actor.schedule(20, Tick("b"))
        actor.schedule(25, Tick("cancelled")).cancel()
        await clock.settle()
        assert actor.ticks == []
        await clock.advance(15)
        assert actor.ticks == [(10.0, "a")]
        assert clock.now() == 15.0
        await clock.advance_to(30)
        assert actor.ticks == [(10.0, "a"), (20.0, "b"), (30.0, "c")]
        assert actor.statistics()["timers"] == 0
        await actor.stop()

    LOOPS[loop](scenario())


def test_a_timer_is_pending_until_it_fires_or_is_cancelled() -> None:
    async def scenario() -> None:
        clock = VirtualClock()
        actor = Counter(clock)
        actor.start()
        fires, cancelled = actor.schedule(10, Tick("a")), actor.schedule(10, Tick("b"))
        assert actor.pending(fires) and actor.pending(cancelled) and not actor.pending(None)
        cancelled.cancel()
        assert actor.pending(fires) and not actor.pending(cancelled)
        await clock.advance(10)
        assert not actor.pending(fires)  # fired, whatever the clock says
        await actor.stop()

    run(scenario())


def test_stop_cancels_the_actors_timers() -> None:
    async def scenario() -> None:
        clock = VirtualClock()
        actor = Counter(clock)
        actor.start()
        actor.schedule(5, Tick("never"))
        await actor.stop()
        await clock.advance(10)
        assert actor.ticks == []
        assert clock.next_deadline() is None

    run(scenario())


def test_virtual_sleep_returns_only_when_time_is_advanced_past_it() -> None:
    async def scenario() -> None:
        clock = VirtualClock(start=100.0, wall_start=1_000_000.0)
        assert clock.wall() == 1_000_000.0
        sleeper = asyncio.create_task(clock.sleep(60))
        await clock.advance(59)
        assert not sleeper.done()
        await clock.advance(1)
        assert sleeper.done()
        assert clock.now() == 160.0
        assert clock.wall() == 1_000_060.0

    run(scenario())


def test_the_system_clock_delivers_scheduled_messages_in_real_time() -> None:
    async def scenario() -> None:
        clock = SystemClock()
        actor = Counter(clock)
        actor.start()
        before = clock.now()
        actor.schedule(0.01, Tick("real"))
        await asyncio.wait_for(actor.ticked.wait(), DEADLINE_S)
        assert actor.ticks[0][1] == "real"
        assert actor.ticks[0][0] >= before + 0.01
        assert abs(clock.wall() - time.time()) < 1.0
        await actor.stop()

    run(scenario())


def test_the_system_clock_sleeps() -> None:
    async def scenario() -> None:
        clock = SystemClock()
        before = clock.now()
        await clock.sleep(0.01)
        assert clock.now() - before >= 0.01

    run(scenario())
