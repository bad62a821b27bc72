"""What the gateway asks of the on-demand controller: admission of one request.

The gateway calls these from its connection tasks.  `try_acquire` is synchronous on
purpose: a request to a ready model must not wait for a mailbox round trip, and because
asyncio is single-threaded the check "ready, so count it in flight" cannot interleave with
an idle stop (the actor flips to `stopping` without awaiting in between).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import msgspec

from actors.ports import EngineHandle


class DeploymentView(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway needs to know about a deployment, read without a round trip."""

    deployment_id: str
    model_name: str  # the name clients use (and LiteLLM's model_name)
    served_model: str  # the model name the engine serves
    engine: str  # "vllm" | "llamacpp" | "sglang" | "sim"
    state: str  # lifecycle state value: stopped, starting, ready, stopping, failed, asleep
    mode: str  # "on_demand" | "always_on"
    created_at: float  # epoch seconds, for GET /v1/models
    # Where the engine answers while `state` is ready (None otherwise); the gateway relays
    # GET /v1/models/<id> there without a lease, because a lookup must not keep it awake.
    engine_handle: EngineHandle | None = None
    # Why the engine was lost (it died or hung), from then until it serves again: DGXMM
    # restarts an always-on one itself, the next request starts an on-demand one.
    lost: str | None = None


class Refused(Exception):
    """The request cannot be served; the gateway renders it as an OpenAI-style error."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


RETRY_AFTER_S = 60  # the seed's Retry-After for a full queue and a queue timeout


def queue_timeout(model: str) -> Refused:
    """The seed's error for a request still not served at its deadline."""
    return Refused(
        503, "ondemand_queue_timeout", f"model {model} is busy; try again later", RETRY_AFTER_S
    )


class Lease(Protocol):
    """A request admitted to a ready engine; counts as in flight until released."""

    @property
    def handle(self) -> EngineHandle:
        """Where the engine answers."""
        ...

    def release(self) -> None:
        """The request ended (answered, failed or client gone); idempotent."""
        ...


class Waiter(Protocol):
    """A request that waits for a start or for memory."""

    @property
    def queued(self) -> asyncio.Event:
        """Set when the request is really queued for memory (not when it only waits for a start)."""
        ...

    async def wait(self) -> Lease:
        """Resolves with a lease once the model is ready; raises `Refused` otherwise."""
        ...

    def cancel(self) -> None:
        """The client hung up: leave the queue; nothing starts just for this request."""
        ...

    def first_byte(self) -> None:
        """The engine's first byte is being relayed to it (recorded once: its wait ends)."""
        ...


class Controller(Protocol):
    """The on-demand controller as the gateway sees it."""

    def view(self, deployment_id: str) -> DeploymentView | None:
        """The deployment's record, or None when there is no such deployment."""
        ...

    def try_acquire(self, deployment_id: str) -> Lease | None:
        """A lease at once when the model is ready, else None (then call `enqueue`)."""
        ...

    def enqueue(self, deployment_id: str, request_id: str, *, waited_s: float = 0.0) -> Waiter:
        """Wait for the model; raises `Refused` at once (queue full, does not fit, ...).
        `waited_s`: how long ago the request arrived (one sent to an engine that it never
        reached waits again, and keeps its place for the queue's deadline)."""
        ...

    async def exited_before(self, handle: EngineHandle, wall: float) -> bool:
        """Whether the engine `handle` names had exited before `wall` (epoch seconds): a
        request sent after that cannot have reached it (False when it is not known)."""
        ...

    def engine_unreachable(self, deployment_id: str) -> None:
        """The gateway found the engine refusing or resetting a connection: check it now;
        until it is found serving, requests wait for it (`enqueue`) instead of reaching it."""
        ...
