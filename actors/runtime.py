"""The actor runtime: bounded mailboxes, tell/ask, timers from an injectable clock, supervision.

An actor owns its state and handles one message at a time.  `tell` never waits (a full
mailbox is an error the caller sees); `ask` waits for the reply up to a deadline.  A handler
that raises is logged, the ask that carried the message fails with `ActorCrashed`, the actor's
`on_crash` hook restores its state from its events, and the next message is served.  When an
actor stops, every pending ask fails with `ActorStopped`: no ask ever hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from actors.errors import ActorCrashed, ActorStopped, AskTimeout, CommandRefused, MailboxFull

log = structlog.get_logger("dgxmm.actors")

DEFAULT_MAILBOX = 1024
DEFAULT_ASK_TIMEOUT_S = 30.0


class TimerHandle(Protocol):
    """A scheduled callback that can be cancelled."""

    def cancel(self) -> None:
        """Cancel the callback if it has not run yet."""
        ...


class Clock(Protocol):
    """Where time comes from.  Decisions never read time any other way."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wall(self) -> float:
        """Epoch seconds (timestamps of events)."""
        ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerHandle:
        """Run `callback` after `delay` seconds."""
        ...

    async def sleep(self, delay: float) -> None:
        """Wait `delay` seconds of this clock's time."""
        ...


class SystemClock:
    """The real clock: the running loop's monotonic time and the system's wall time."""

    def now(self) -> float:
        """Monotonic seconds of the running loop."""
        return asyncio.get_running_loop().time()

    def wall(self) -> float:
        """Epoch seconds."""
        return time.time()

    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerHandle:
        """Schedule on the running loop."""
        return asyncio.get_running_loop().call_later(max(0.0, delay), callback)

    async def sleep(self, delay: float) -> None:
        """asyncio.sleep."""
        await asyncio.sleep(delay)


class _VirtualTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """A clock that only moves when told to; timers fire in order as it advances.

    `advance()` runs every due timer at its own instant, and after each lets the event loop
    run until nothing is ready, so the actors react before time moves on.  A simulated hour
    runs in as long as the work it causes.
    """

    def __init__(self, start: float = 0.0, wall_start: float = 1_767_225_600.0) -> None:
        self._now = start
        self._wall0 = wall_start - start
        self._heap: list[tuple[float, int, _VirtualTimer]] = []
        self._seq = itertools.count()
        self._busy_checks: list[Callable[[], bool]] = []

    @property
    def busy_checks(self) -> tuple[Callable[[], bool], ...]:
        """The checks `settle` waits on."""
        return tuple(self._busy_checks)

    def add_busy_check(self, check: Callable[[], bool]) -> None:
        """Before time moves, also wait while `check()` is true (work off the loop, e.g. I/O)."""
        self._busy_checks.append(check)

    async def settle(self) -> None:
        """Let the loop run until nothing is ready and no busy check holds."""
        while True:
            await settle()
            if not any(check() for check in self._busy_checks):
                return
            await asyncio.sleep(0.0002)  # work runs in a thread: give it real time

    def now(self) -> float:
        """Virtual monotonic seconds."""
        return self._now

    def wall(self) -> float:
        """Virtual epoch seconds."""
        return self._wall0 + self._now

    def call_later(self, delay: float, callback: Callable[[], None]) -> TimerHandle:
        """Schedule at now + delay (virtual)."""
        timer = _VirtualTimer(self._now + max(0.0, delay), callback)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    async def sleep(self, delay: float) -> None:
        """Wait until the clock has been advanced past now + delay."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        timer = self.call_later(delay, wake)
        try:
            await fut
        finally:
            timer.cancel()

    def next_deadline(self) -> float | None:
        """When the next live timer fires, or None."""
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def jump_to(self, target: float) -> None:
        """Move time forward to `target` without running the loop; only when no timer falls
        due before it (`simulations.whatif` moves between its own events so)."""
        when = self.next_deadline()
        if when is not None and when < target:
            raise ValueError(f"a timer falls due at {when} before {target}")
        self._now = max(self._now, target)

    async def step(self) -> None:
        """Fire the next live timer at its instant (time moves to it), then settle once."""
        when = self.next_deadline()
        if when is None:
            return
        _, _, timer = heapq.heappop(self._heap)
        self._now = max(self._now, when)
        timer.callback()
        await self.settle()

    async def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, firing every timer due on the way."""
        await self.advance_to(self._now + seconds)

    async def advance_to(self, target: float) -> None:
        """Move time forward to `target`, firing every timer due on the way."""
        await self.settle()
        while True:
            when = self.next_deadline()
            if when is None or when > target:
                break
            _, _, timer = heapq.heappop(self._heap)
            self._now = max(self._now, when)
            timer.callback()
            await self.settle()
        self._now = max(self._now, target)
        await self.settle()


async def settle(max_rounds: int = 10_000) -> None:
    """Let the running loop run until no callback is ready (a few rounds in a row)."""
    loop = asyncio.get_running_loop()
    quiet = 0
    for _ in range(max_rounds):
        await asyncio.sleep(0)
        ready = getattr(loop, "_ready", None)
        if ready is not None and len(ready) > 0:
            quiet = 0
            continue
        quiet += 1
        if quiet >= 3:
            return


class _Envelope:
    __slots__ = ("future", "message")

    def __init__(self, message: Any, future: asyncio.Future[Any] | None) -> None:
        self.message = message
        self.future = future


class _ScheduledMessage:
    """A message due later; leaves the actor's timer set when it fires or is cancelled."""

    __slots__ = ("actor", "handle", "message")

    def __init__(self, actor: Actor, message: Any) -> None:
        self.actor = actor
        self.message = message
        self.handle: TimerHandle | None = None

    def fire(self) -> None:
        self.actor._timers.discard(self)
        if not self.actor._stopped:
            try:
                self.actor.tell(self.message)
            except MailboxFull:
                log.warning(
                    "timer_dropped", actor=self.actor.name, message=type(self.message).__name__
                )

    def cancel(self) -> None:
        """Cancel delivery (an actor re-arming its idle timer must not pile up handles)."""
        self.actor._timers.discard(self)
        if self.handle is not None:
            self.handle.cancel()


class Actor:
    """Base class: subclasses implement `handle(message)` and optionally `on_crash()`."""

    def __init__(self, name: str, clock: Clock, *, mailbox_size: int = DEFAULT_MAILBOX) -> None:
        self.name = name
        self.clock = clock
        self._mailbox: asyncio.Queue[_Envelope] = asyncio.Queue(mailbox_size)
        self._task: asyncio.Task[None] | None = None
        self._timers: set[TimerHandle] = set()
        self._stopped = False
        self._current: _Envelope | None = None
        self._actor_stats = {"handled": 0, "crashes": 0}

    # --- life ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start serving the mailbox on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Stop: cancel timers, fail every pending ask with ActorStopped."""
        if self._stopped:
            return
        self._stopped = True
        for timer in list(self._timers):
            timer.cancel()
        self._timers.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_pending()

    def _fail_pending(self) -> None:
        current, self._current = self._current, None
        if current is not None and current.future is not None and not current.future.done():
            current.future.set_exception(ActorStopped(f"{self.name} stopped"))
        while not self._mailbox.empty():
            env = self._mailbox.get_nowait()
            if env.future is not None and not env.future.done():
                env.future.set_exception(ActorStopped(f"{self.name} stopped"))

    @property
    def running(self) -> bool:
        """Whether the actor serves its mailbox."""
        return self._task is not None and not self._stopped

    @property
    def busy(self) -> bool:
        """Whether a handler is under way (it may be awaiting I/O or a timer)."""
        return self._current is not None

    # --- messaging -----------------------------------------------------------------------

    def tell(self, message: Any) -> None:
        """Deliver without waiting; raises MailboxFull or ActorStopped."""
        if self._stopped:
            raise ActorStopped(f"{self.name} stopped")
        try:
            self._mailbox.put_nowait(_Envelope(message, None))
        except asyncio.QueueFull:
            raise MailboxFull(f"{self.name}: mailbox full") from None

    async def ask(self, message: Any, timeout: float | None = DEFAULT_ASK_TIMEOUT_S) -> Any:
        """Deliver and wait for the reply; raises what the handler raised, or AskTimeout."""
        if self._stopped:
            raise ActorStopped(f"{self.name} stopped")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            self._mailbox.put_nowait(_Envelope(message, fut))
        except asyncio.QueueFull:
            raise MailboxFull(f"{self.name}: mailbox full") from None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            fut.cancel()
            raise AskTimeout(f"{self.name} did not answer within {timeout} s") from None

    def schedule(self, delay: float, message: Any) -> TimerHandle:
        """Deliver `message` to this actor after `delay` seconds of its clock."""
        timer = _ScheduledMessage(self, message)
        timer.handle = self.clock.call_later(delay, timer.fire)
        self._timers.add(timer)
        return timer

    def pending(self, timer: TimerHandle | None) -> bool:
        """Whether `timer` (from `schedule`) has neither fired nor been cancelled: known
        from the timer itself, not from the clock (a loop may fire a timer a moment before
        its time: uvloop's have millisecond resolution)."""
        return timer is not None and timer in self._timers

    # --- serving -------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            env = await self._mailbox.get()
            if env.future is not None and env.future.cancelled():
                continue
            self._current = env
            try:
                result = await self.handle(env.message)
            except asyncio.CancelledError:
                # stop() cancelled us mid-message; `finally` below forgets the envelope before
                # stop() can fail it, so fail its ask here or it would hang.
                if env.future is not None and not env.future.done():
                    env.future.set_exception(ActorStopped(f"{self.name} stopped"))
                raise
            except CommandRefused as exc:
                if env.future is not None and not env.future.done():
                    env.future.set_exception(exc)
            except Exception as exc:
                self._actor_stats["crashes"] += 1
                log.exception(
                    "actor_handler_crashed", actor=self.name, message=type(env.message).__name__
                )
                if env.future is not None and not env.future.done():
                    crashed = ActorCrashed(f"{self.name} failed on {type(env.message).__name__}")
                    crashed.__cause__ = exc
                    env.future.set_exception(crashed)
                try:
                    await self.on_crash(exc)
                except Exception:  # policy: a failing rebuild is logged; the actor serves on
                    log.exception("actor_rebuild_failed", actor=self.name)
            else:
                if env.future is not None and not env.future.done():
                    env.future.set_result(result)
            finally:
                self._current = None
                self._actor_stats["handled"] += 1

    async def handle(self, message: Any) -> Any:
        """Serve one message; the return value answers an ask."""
        raise NotImplementedError

    async def on_crash(self, exc: Exception) -> None:
        """Restore the state from the actor's events after a handler raised."""

    def statistics(self) -> dict[str, int]:
        """Counters: handled, crashes, mailbox size, timers."""
        return {**self._actor_stats, "mailbox": self._mailbox.qsize(), "timers": len(self._timers)}
