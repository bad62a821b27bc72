"""One DGXMM per event log: an exclusive lock held for the process's life.

Two instances on one log would each adopt, lose and restart the other's engines.  The lock is
`fcntl.flock` on a small file beside the database (`<db>.lock`) and one in the data dir
(`dgxmm.lock`), taken before anything is written or any engine is touched.  The kernel drops
it when the process dies, however it dies, so a SIGKILL never leaves a stale lock behind.
Each file holds the holder's pid, so the refusal can name it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from storage.errors import StorageError


class AlreadyRunning(StorageError):
    """Another process holds the lock; `pid` is its pid when the lock file names one."""

    def __init__(self, path: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid is not None else "another process"
        super().__init__(f"another DGXMM ({who}) is using {path}; stop it first")
        self.path = path
        self.pid = pid


class InstanceLock:
    """Exclusive locks on a set of lock files; `acquire` all or none, `release` all."""

    def __init__(self, paths: list[Path]) -> None:
        # One file once, even when the database lives in the data dir under the same name.
        self.paths = list(dict.fromkeys(p.resolve() for p in paths))
        self._fds: list[int] = []

    @classmethod
    def for_log(cls, db_path: Path, data_dir: Path) -> InstanceLock:
        """The locks of one DGXMM: beside its database and in its data dir."""
        return cls([db_path.with_name(db_path.name + ".lock"), data_dir / "dgxmm.lock"])

    @property
    def held(self) -> bool:
        """Whether this process holds the locks."""
        return bool(self._fds)

    def acquire(self) -> None:
        """Take every lock without waiting; raises AlreadyRunning (holding none) or StorageError."""
        if self._fds:
            return
        try:
            for path in self.paths:
                self._fds.append(_lock(path))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Drop the locks (the files stay; the next holder rewrites them)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the only descriptor releases the flock


def _lock(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StorageError(f"cannot open the lock file {path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise AlreadyRunning(path, pid) from None
    except OSError as exc:
        os.close(fd)
        raise StorageError(f"cannot lock {path}: {exc.strerror}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # policy: a full disk must not stop the lock from working; only the pid is lost
    return fd


def _read_pid(fd: int) -> int | None:
    try:
        raw = os.pread(fd, 32, 0)
    except OSError:
        return None
    text = raw.decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None
