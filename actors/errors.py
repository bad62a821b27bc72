"""Errors that cross the actors' boundary; library exceptions never leak past it."""

from __future__ import annotations


class ActorError(Exception):
    """Base of every error raised by the actor layer."""


class ActorStopped(ActorError):
    """The actor stopped (or was rebuilt) before it answered; the ask will never complete."""


class AskTimeout(ActorError):
    """The actor did not answer an ask before its deadline."""


class MailboxFull(ActorError):
    """The actor's bounded mailbox is full; the message was not delivered."""


class ActorCrashed(ActorError):
    """The handler raised while serving this ask; the actor was rebuilt from its events."""


class RuntimeFailure(ActorError):
    """A runtime (docker/process) could not do what was asked; message says why."""


class EngineUnreachable(ActorError):
    """An engine's HTTP endpoint could not be reached."""


class SyncFailed(ActorError):
    """LiteLLM sync failed; the message is shown to operators as the last sync error."""


class CommandRefused(ActorError):
    """A handler refused a command on purpose; the asker gets this error, it is no crash."""
