"""Process runtime: each engine is a local subprocess (hosts without Docker, and tests).

How it runs an engine:
- `spec.argv` is executed as is (no shell) after placeholder expansion (see `runtimes`); its
  program is looked up on PATH, and a missing one fails the launch with a message naming the
  `[engines] programs` key to set (`dgxmm.engines.adapters.program_problem`).  Placeholders:
  `{host}` becomes the runtime's host (127.0.0.1 by default); `{port}` a free TCP port the
  runtime picks there.  Without a `{port}` in argv or env, the engine is taken to listen on
  `spec.port` (the caller chose it, e.g. with `dgxmm.engines.runtimes.free_port()`), which must be
  free.  `image`, `gpu`, `volumes` and `memory_bytes` are ignored (the memory budget is the
  broker's job; an rlimit would break CUDA).  The environment is DGXMM's own plus `spec.env`.
- The engine gets its own session and process group (`setsid`), so stopping it reaches every
  worker it forked: SIGTERM to the group, SIGKILL to the group after `timeout_s`.
- Its stdout and stderr go to `<data_dir>/engine-logs/<deployment>.log`, written by the engine
  itself with O_APPEND (a pipe to DGXMM would break, SIGPIPE, when DGXMM restarts).  The file
  is truncated at each launch; once it uses more than `max_log_bytes` of disk, all but its
  last `keep_log_bytes` are deallocated in place (checked whenever the runtime looks at the
  engine), so it stays bounded while the engine writes.  `logs_tail` reads only its end.
- `<data_dir>/process-engines.json` records deployment, pid, port, argv and the process's start
  time (from /proc, which tells a reused pid apart).  A new `ProcessRuntime` on the same data
  dir, e.g. after a DGXMM restart, re-adopts every recorded engine whose pid is alive with the
  same start time and command line; it forgets the others.  One DGXMM per data dir.
- Every engine carries `DGXMM_ENGINE_OF=<state file>` in its environment.  DGXMM can be
  killed between starting an engine and recording it; such an engine was never told to anyone
  (no handle, no event), so `list_engines` stops every marked process of this data dir that the
  state file does not name (`unrecorded_engine_stopped`) instead of leaving it running beside
  the engine the restart launches.

Linux only (/proc).  Errors are `actors.errors.RuntimeFailure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

import msgspec
import structlog

from actors.errors import RuntimeFailure
from actors.ports import EngineHandle, LaunchSpec
from dgxmm.engines.adapters import program_problem
from dgxmm.engines.runtimes import (
    expand_argv,
    expand_env,
    free_port,
    port_is_free,
    uses_port_placeholder,
)

log = structlog.get_logger(__name__)

STATE_FILE = "process-engines.json"
MARKER = "DGXMM_ENGINE_OF"
LOG_DIR = "engine-logs"
_TAIL_READ_BYTES = 256 * 1024  # logs_tail never reads more than this from the file's end
_KILL_GRACE_S = 5.0  # how long to wait for the kernel after SIGKILL
_POLL_INTERVAL_S = 0.05  # only where pidfd_open is unavailable
_PUNCH_ALIGN = 4096  # trim the log in whole file-system blocks
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    """One engine this runtime started, as written to the state file."""

    deployment_id: str
    pid: int
    port: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a reused pid apart
    argv: list[str]
    log_path: str


class _State(msgspec.Struct, kw_only=True):
    version: int = 1
    engines: list[_Record] = []


_state_encoder = msgspec.json.Encoder()
_state_decoder = msgspec.json.Decoder(_State)


class ProcessRuntime:
    """Starts engines as local subprocesses; implements `actors.ports.Runtime`."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        cwd: str | os.PathLike[str] | None = None,
        max_log_bytes: int = 16 * 1024 * 1024,
        keep_log_bytes: int = 1024 * 1024,
    ) -> None:
        self._data_dir = Path(data_dir)
        self._host = host
        self._cwd = None if cwd is None else Path(cwd)
        self._max_log_bytes = max_log_bytes
        self._keep_log_bytes = min(keep_log_bytes, max_log_bytes)
        # Our own children, so we can reap them; adopted engines are not in here.
        self._children: dict[int, asyncio.subprocess.Process] = {}
        self._launching: set[str] = set()  # deployments between the check and the record

    @property
    def state_path(self) -> Path:
        """The JSON file that records the engines this runtime started."""
        return self._data_dir / STATE_FILE

    def log_path(self, deployment_id: str) -> Path:
        """Where the engine of `deployment_id` writes its stdout and stderr."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", deployment_id) or "_"
        return self._data_dir / LOG_DIR / f"{safe}.log"

    async def launch(self, spec: LaunchSpec) -> EngineHandle:
        """Start the engine's process; returns once it runs (not once it is ready)."""
        if not spec.argv:
            raise RuntimeFailure(f"deployment {spec.deployment_id}: empty command line")
        if spec.deployment_id in self._launching:
            raise RuntimeFailure(f"deployment {spec.deployment_id} is being launched already")
        self._launching.add(spec.deployment_id)
        try:
            return await self._launch(spec)
        finally:
            self._launching.discard(spec.deployment_id)

    async def _launch(self, spec: LaunchSpec) -> EngineHandle:
        live = self._live_records()
        for record in live:
            if record.deployment_id == spec.deployment_id:
                raise RuntimeFailure(
                    f"deployment {spec.deployment_id} already has a running engine "
                    f"(pid {record.pid}, port {record.port})"
                )
        if uses_port_placeholder(spec.argv, spec.env):
            port = free_port(self._host, exclude={r.port for r in live})
        elif spec.port <= 0:
            raise RuntimeFailure(
                f"deployment {spec.deployment_id}: no {{port}} in the command line and no port"
            )
        elif not port_is_free(self._host, spec.port):
            raise RuntimeFailure(
                f"deployment {spec.deployment_id}: port {spec.port} on {self._host} is in use"
            )
        else:
            port = spec.port
        argv = expand_argv(spec.argv, host=self._host, port=port)
        env = {**os.environ, **expand_env(spec.env, host=self._host, port=port)}
        env[MARKER] = str(self.state_path)
        problem = program_problem(spec.engine, argv[0], env.get("PATH", os.defpath))
        if problem is not None:
            raise RuntimeFailure(f"deployment {spec.deployment_id}: {problem}")
        log_path = self.log_path(spec.deployment_id)
        try:
            log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # O_APPEND: the engine always writes at the end, so trimming the file is safe.
            # 0600: an engine may echo secrets of its command line (dgxmm/private.py).
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            os.fchmod(log_fd, 0o600)  # O_TRUNC keeps the mode of a file that existed
        except OSError as exc:
            raise RuntimeFailure(f"cannot open engine log {log_path}: {exc.strerror}") from exc
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self._cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise RuntimeFailure(
                f"deployment {spec.deployment_id}: cannot run {argv[0]!r}: {exc.strerror or exc}"
            ) from exc
        finally:
            os.close(log_fd)
        self._children[proc.pid] = proc
        record = _Record(
            deployment_id=spec.deployment_id,
            pid=proc.pid,
            port=port,
            start_ticks=_start_ticks(proc.pid) or 0,
            argv=argv,
            log_path=str(log_path),
        )
        self._update_state(add=record)
        log.info("engine_launched", deployment=spec.deployment_id, pid=proc.pid, port=port)
        return _handle(record, self._host)

    async def stop(self, handle: EngineHandle, timeout_s: float = 30.0) -> None:
        """SIGTERM the engine's process group, SIGKILL it after `timeout_s`; idempotent.

        A pid this runtime has no record of (or whose start time differs) is left alone.
        """
        pid = _pid_of(handle)
        record = next((r for r in self._load_state().engines if r.pid == pid), None)
        if record is not None and _alive(record):
            _signal_group(pid, signal.SIGTERM)
            if not await self._wait_exit(record, timeout_s):
                log.warning("engine_kill", deployment=record.deployment_id, pid=pid)
                _signal_group(pid, signal.SIGKILL)
                if not await self._wait_exit(record, _KILL_GRACE_S):
                    raise RuntimeFailure(
                        f"deployment {record.deployment_id}: pid {pid} survived SIGKILL"
                    )
            # Workers the engine forked may outlive it; they are still in its group.
            _signal_group(pid, signal.SIGKILL)
            log.info("engine_stopped", deployment=record.deployment_id, pid=pid)
        await self._reap(pid)
        self._update_state(remove_pid=pid)

    async def is_running(self, handle: EngineHandle) -> bool:
        """Whether the engine's process still runs (a zombie does not)."""
        pid = _pid_of(handle)
        record = next((r for r in self._load_state().engines if r.pid == pid), None)
        if record is None:
            return False
        self._trim_log(Path(record.log_path))
        running = _alive(record)
        if not running:
            await self._reap(pid)
        return running

    async def wait_exited(self, handle: EngineHandle) -> None:
        """Return once the engine's process has exited: our child's exit, else its pidfd."""
        pid = _pid_of(handle)
        record = next((r for r in self._load_state().engines if r.pid == pid), None)
        if record is None:
            return
        proc = self._children.get(pid)
        if proc is not None:
            await proc.wait()
        else:
            await _wait_pid_exit(record)

    async def list_engines(self) -> list[EngineHandle]:
        """Engines started by this runtime (or a previous one on this data dir) still running."""
        live = self._live_records()
        known = {r.pid for r in live} | set(self._children)
        for pid in marked_pids(f"{MARKER}={self.state_path}".encode()) - known:
            log.warning("unrecorded_engine_stopped", pid=pid, cmdline=_cmdline(pid))
            _signal_group(pid, signal.SIGKILL)
        for record in live:
            self._trim_log(Path(record.log_path))
        return [_handle(record, self._host) for record in live]

    async def logs_tail(self, handle: EngineHandle, lines: int = 20) -> str:
        """The last `lines` lines the engine wrote to stdout/stderr ('' if none)."""
        path = self.log_path(handle.deployment_id)
        self._trim_log(path)
        return await asyncio.to_thread(_read_tail, path, lines)

    async def close(self) -> None:
        """Forget our child-process objects; the engines keep running."""
        self._children.clear()

    # -- internals -------------------------------------------------------------------------

    def _live_records(self) -> list[_Record]:
        """Records of engines alive with the same identity; the state file is pruned."""
        state = self._load_state()
        live = [r for r in state.engines if _alive(r) and _cmdline(r.pid) == r.argv]
        if len(live) != len(state.engines):
            gone = {r.pid for r in state.engines} - {r.pid for r in live}
            log.info("engines_forgotten", pids=sorted(gone))
            self._save_state(_State(engines=live))
        return live

    def _load_state(self) -> _State:
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return _State()
        except OSError as exc:
            raise RuntimeFailure(f"cannot read {self.state_path}: {exc.strerror}") from exc
        try:
            return _state_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            # A corrupt file must not stop DGXMM: it loses adoption of old engines, no more.
            log.warning("process_state_unreadable", path=str(self.state_path), error=str(exc))
            return _State()

    def _save_state(self, state: _State) -> None:
        try:
            self._data_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._data_dir, prefix=".process-engines.")
            with os.fdopen(fd, "wb") as f:
                f.write(_state_encoder.encode(state))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.state_path)
        except OSError as exc:
            raise RuntimeFailure(f"cannot write {self.state_path}: {exc.strerror}") from exc

    def _update_state(self, *, add: _Record | None = None, remove_pid: int | None = None) -> None:
        # Read-modify-write without an await in between: other runtimes on the same data dir
        # in this process (tests, a restart in place) see each other's changes.
        state = self._load_state()
        engines = [r for r in state.engines if r.pid != remove_pid]
        if add is not None:
            engines = [r for r in engines if r.pid != add.pid] + [add]
        if engines != state.engines:
            self._save_state(_State(engines=engines))

    async def _wait_exit(self, record: _Record, timeout_s: float) -> bool:
        """Wait until the process has exited; False when the deadline passed first."""
        proc = self._children.get(record.pid)
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                if proc is not None:
                    await proc.wait()
                    return True
                await _wait_pid_exit(record)
                return True
        except TimeoutError:
            return not _alive(record)

    async def _reap(self, pid: int) -> None:
        proc = self._children.pop(pid, None)
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_KILL_GRACE_S):
                    await proc.wait()

    def _trim_log(self, path: Path) -> None:
        """Keep the log's disk use under max_log_bytes without losing what the engine writes.

        The head of the file is deallocated in place (a hole, FALLOC_FL_PUNCH_HOLE): offsets
        stay valid for the engine's O_APPEND writes, so nothing written meanwhile is lost.
        Where the file system cannot punch holes, fall back to copy-and-truncate, which can
        drop what the engine writes during the copy (as logrotate's copytruncate).
        """
        try:
            st = path.stat()
            if st.st_blocks * 512 <= self._max_log_bytes:
                return
            cut = (st.st_size - self._keep_log_bytes) // _PUNCH_ALIGN * _PUNCH_ALIGN
            if cut <= 0:
                return
            with path.open("r+b") as f:
                if _punch_hole(f.fileno(), cut):
                    return
                f.seek(-self._keep_log_bytes, os.SEEK_END)
                kept = f.read(self._keep_log_bytes)
                kept = kept[kept.find(b"\n") + 1 :] if b"\n" in kept else kept
                f.truncate(0)
                f.write(b"[dgxmm: log trimmed]\n" + kept)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("engine_log_trim_failed", path=str(path), error=str(exc))


def _handle(record: _Record, host: str) -> EngineHandle:
    return EngineHandle(
        deployment_id=record.deployment_id,
        host=host,
        port=record.port,
        runtime_id=f"pid:{record.pid}",
    )


def _pid_of(handle: EngineHandle) -> int:
    kind, _, value = handle.runtime_id.partition(":")
    if kind != "pid" or not value.isdigit():
        raise RuntimeFailure(f"not a process-runtime handle: {handle.runtime_id!r}")
    return int(value)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc/<pid>/stat, None if no such pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[19])
    except (IndexError, ValueError):
        return None


def _start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def _alive(record: _Record) -> bool:
    """The recorded process exists, is not a zombie, and is the same process (start time)."""
    stat = _proc_stat(record.pid)
    if stat is None:
        return False
    state, ticks = stat
    if state in ("Z", "X", "x"):
        return False
    return record.start_ticks in (0, ticks)


def marked_pids(marker: bytes) -> set[int]:
    """Processes whose environment holds `marker` exactly (`NAME=value`); not zombies."""
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if marker in environ.split(b"\0"):
            stat = _proc_stat(pid)
            if stat is not None and stat[0] not in ("Z", "X", "x"):
                found.add(pid)
    return found


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="surrogateescape") for part in raw.split(b"\0")[:-1]]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the engine's process group (it leads one: setsid), or just the pid if not."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        # The leader is gone; its group may live on (forked workers) under the same id.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
    except PermissionError as exc:
        raise RuntimeFailure(f"not allowed to signal pid {pid}") from exc


async def _wait_pid_exit(record: _Record) -> None:
    """Wait for a process that is not our child to exit: pidfd if the kernel has it, else poll."""
    try:
        pidfd = os.pidfd_open(record.pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):
        while True:
            if not _alive(record):
                return
            await asyncio.sleep(_POLL_INTERVAL_S)
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    try:
        if not _alive(record):  # exited (or pid reused) before the pidfd was opened
            return
        loop.add_reader(pidfd, on_exit)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)


def _punch_hole(fd: int, length: int) -> bool:
    """Deallocate the file's first `length` bytes in place; False if unsupported here."""
    fallocate = getattr(_libc(), "fallocate64", None)
    if fallocate is None:
        return False
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    return int(fallocate(fd, mode, 0, length)) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _read_tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a file, reading at most _TAIL_READ_BYTES from its end."""
    if lines <= 0:
        return ""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - _TAIL_READ_BYTES)
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise RuntimeFailure(f"cannot read engine log {path}: {exc.strerror}") from exc
    cut = start > 0
    if data.startswith(b"\0"):  # the window reaches into the trimmed (punched) head
        data = data.lstrip(b"\0")
        cut = True
    all_lines = data.decode("utf-8", errors="replace").splitlines()
    if cut and all_lines:
        all_lines = all_lines[1:]  # the first line was cut by the read window or the trim
    return "\n".join(all_lines[-lines:])


__all__ = ["ProcessRuntime"]
