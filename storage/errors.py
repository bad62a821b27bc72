"""Errors of the storage layer; sqlite3 and aiosqlite exceptions never escape it."""

from __future__ import annotations


class StorageError(Exception):
    """Base of every storage error; the message is one line an operator can act on."""


class ConcurrencyError(StorageError):
    """An append expected another version of the stream (optimistic concurrency)."""

    def __init__(self, stream: str, expected: int, actual: int) -> None:
        super().__init__(f"stream {stream} is at version {actual}, not {expected}")
        self.stream = stream
        self.expected = expected
        self.actual = actual


class LogNotFound(StorageError):
    """There is no file at that path."""


class NotAnEventLog(StorageError):
    """The file is an SQLite database, but not a DGXMM event log."""


class LogCorrupt(StorageError):
    """The file is not a readable SQLite database."""


class LogLocked(StorageError):
    """Another process holds a lock on the database for too long."""


class StoreClosed(StorageError):
    """The store was closed; nothing more can be appended."""
