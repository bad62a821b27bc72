"""The demo's LiteLLM: its venv made on the first run, then run under gunicorn until DGXMM stops.

`dgxmm serve --demo` prints its banner at once and starts this below it, so the banner never
waits for LiteLLM: the first run makes `.venv-litellm` with `scripts/bootstrap --litellm-only`
(the code `make test` uses; a minute or more), following pip's log to print its progress;
then gunicorn runs LiteLLM's app with `docs/litellm-gunicorn.conf.py` on 127.0.0.1, and one
line says when LiteLLM answers with the demo's master key.  A failure is one line with the
reason and the log, and DGXMM goes on alone.

gunicorn runs in a session of its own, so a Ctrl-C in the terminal reaches DGXMM only, which
stops it (SIGTERM: its workers finish what they serve); and it gets SIGTERM from the kernel
when DGXMM dies without stopping it (a parent-death signal set before it starts), so a killed
demo leaves no LiteLLM holding the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from dgxmm.demo import LITELLM_PIN, Front
from gateway import client

log = structlog.get_logger("dgxmm.demo_litellm")

CONF = Path(__file__).resolve().parent.parent / "docs" / "litellm-gunicorn.conf.py"
WORKERS = 2  # as docs/litellm.md runs it on a box
READY_DEADLINE_S = 180.0  # from gunicorn's start to LiteLLM's first answer (13-27 s measured)
POLL_S = 0.25  # how often LiteLLM is asked whether it answers yet
PROGRESS_S = 10.0  # a progress line while the venv is made, this often
STOP_DEADLINE_S = 20.0  # gunicorn's graceful stop took 6-8 s idle; then its group is killed
LOG_TAIL_LINES = 5

# Run by the venv's Python before gunicorn: SIGTERM when DGXMM dies (it survives the exec),
# and no start at all if DGXMM is already gone.
PARENT_DEATH_EXEC = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)
_DROPPED_ENV = ("DATABASE_URL", "PYTHONPATH", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def pip_progress(text: str) -> tuple[int, int | None]:
    """From pip's log: packages found so far, and how many it installs once it got them all."""
    found, installing = 0, None
    for line in text.splitlines():
        if line.startswith(("Collecting ", "Processing ")):
            found += 1
        elif line.startswith("Installing collected packages:"):
            installing = len(line.split(":", 1)[1].split(","))
    return found, installing


def installed_count(venv: Path) -> int:
    """Packages installed in the venv so far (pip writes a dist-info as it installs each)."""
    found = venv.glob("lib/python*/site-packages/*.dist-info")
    return sum(1 for d in found if not d.name.startswith(("pip-", "setuptools-")))


def progress_line(
    venv: str, found: int, installing: int | None, elapsed_s: float, installed: int = 0
) -> str:
    """One progress line while the venv is made."""
    if installing is not None:
        done = min(installed, installing)
        return f"LiteLLM: {venv}: installed {done} of {installing} packages ({elapsed_s:.0f} s)"
    if not found:  # `python -m venv`, or pip still reading the index
        return f"LiteLLM: {venv}: preparing ({elapsed_s:.0f} s)"
    return f"LiteLLM: {venv}: {found} packages fetched ({elapsed_s:.0f} s)"


def gunicorn_env(base: dict[str, str], front: Front, key: str) -> dict[str, str]:
    """LiteLLM's environment: DGXMM's, without what would send it elsewhere (a database, a
    proxy for its calls to the gateway, DGXMM's own import path), with its config and key."""
    env = {k: v for k, v in base.items() if k.upper() not in _DROPPED_ENV}
    no_proxy = ",".join(filter(None, (env.get("NO_PROXY"), "127.0.0.1,localhost")))
    env.update(
        LITELLM_CONFIG=front.config_path,
        LITELLM_MASTER_KEY=key,
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no download of the cost map at start
        NO_PROXY=no_proxy,
        PYTHONUNBUFFERED="1",
    )
    return env


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, joined for one message line."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " / ".join(kept[-lines:])


class DemoLiteLLM:
    """Makes the venv if needed, runs gunicorn, says when LiteLLM answers; `stop()` ends it."""

    def __init__(self, front: Front, say: Callable[[str], None]) -> None:
        self.front = front
        self._say = say  # one line of output (below the banner)
        self._task: asyncio.Task[None] | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._exited: asyncio.Future[int] | None = None  # the process's wait
        self._whole_group = False  # stop its whole group (bootstrap: bash, then pip)
        self._stopping = False

    def start(self) -> None:
        """Start in the background; never waits."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="demo-litellm")

    def begin_stop(self) -> None:
        """Ask gunicorn to stop (its workers finish their requests); `stop()` waits for it."""
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                # gunicorn's master stops its workers gracefully; bash would leave pip running
                (os.killpg if self._whole_group else os.kill)(process.pid, signal.SIGTERM)

    async def stop(self) -> None:
        """Stop LiteLLM (and a venv being made), killed if it outlives the deadline."""
        self.begin_stop()
        process, exited = self._process, self._exited
        if process is not None and exited is not None and not exited.done():
            try:
                await asyncio.wait_for(asyncio.shield(exited), STOP_DEADLINE_S)
            except TimeoutError:
                log.warning("demo_litellm_killed", deadline_s=STOP_DEADLINE_S)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # its workers too
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), STOP_DEADLINE_S)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self) -> None:
        try:
            if not await self._venv():
                return
            await self._serve()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not take DGXMM down: say so, go on alone
            log.exception("demo_litellm_failed")
            self._failed(f"{type(exc).__name__}: {exc}")

    def _failed(self, why: str) -> None:
        self._say(
            f"LiteLLM did not start: {why}. DGXMM goes on alone (the curl check above works;"
            " `dgxmm serve --demo --no-litellm` skips LiteLLM)."
        )

    # --- the venv ------------------------------------------------------------------------

    async def _venv(self) -> bool:
        """Make or check the venv with `scripts/bootstrap --litellm-only`; True when usable."""
        front = self.front
        gunicorn = Path(front.venv) / "bin" / "gunicorn"
        if front.bootstrap is None:
            if not gunicorn.exists():
                self._failed(
                    f"no LiteLLM in {front.venv} (pip install '{LITELLM_PIN}' in a venv of"
                    " its own and set LITELLM_BIN to its bin/litellm)"
                )
            return gunicorn.exists()
        began, started = time.monotonic(), time.time()
        process = await asyncio.create_subprocess_exec(
            front.bootstrap,
            "--litellm-only",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # a stop kills its pip too
        )
        exited = self._watch(process, whole_group=True)
        output: list[str] = []
        pip_log: list[Path] = []  # named by bootstrap's "preparing" line: pip makes the venv
        reader = asyncio.get_running_loop().create_task(self._bootstrap_lines(output, pip_log))
        while not exited.done():
            await asyncio.wait({exited}, timeout=PROGRESS_S)
            if not exited.done() and pip_log:
                # An older run's log stays until pip starts, after `python -m venv`.
                text = await asyncio.to_thread(_read, pip_log[0], since=started)
                found, installing = pip_progress(text)
                installed = await asyncio.to_thread(installed_count, Path(front.venv))
                elapsed = time.monotonic() - began
                self._say(progress_line(front.venv, found, installing, elapsed, installed))
        await reader
        if exited.result() != 0:
            if not self._stopping:
                said = " / ".join(output[-LOG_TAIL_LINES:])
                self._failed(f"scripts/bootstrap --litellm-only exited {exited.result()}: {said}")
            return False
        if pip_log:
            took = time.monotonic() - began
            self._say(f"LiteLLM: {front.venv} is ready ({took:.0f} s); starting LiteLLM.")
        return True

    async def _bootstrap_lines(self, output: list[str], pip_log: list[Path]) -> None:
        process = self._process
        assert process is not None and process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            output[:] = [*output[-(LOG_TAIL_LINES - 1) :], line]
            if "preparing" in line and "log: " in line:
                pip_log.append(Path(line.rsplit("log: ", 1)[1].rstrip(")")))
                self._say(
                    f"LiteLLM: first run: creating {self.front.venv} ({LITELLM_PIN}; about a"
                    " minute, once)..."
                )

    # --- LiteLLM -------------------------------------------------------------------------

    async def _serve(self) -> None:
        front = self.front
        workdir = Path(front.workdir)
        await asyncio.to_thread(_prepare, workdir, front.pidfile)
        key = (await asyncio.to_thread(_read, Path(front.key_file))).strip()
        if self._stopping:  # DGXMM stopped while the venv was made
            return
        venv_bin = Path(front.venv) / "bin"
        argv = [
            str(venv_bin / "python"), "-c", PARENT_DEATH_EXEC, str(os.getpid()),
            str(venv_bin / "gunicorn"), "-c", str(CONF),
            "--bind", f"127.0.0.1:{front.port}", "--workers", str(WORKERS),
            "--pid", str(front.pidfile),
        ]  # fmt: skip
        began = time.monotonic()
        with front.log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *argv,
                cwd=workdir,
                env=gunicorn_env(dict(os.environ), front, key),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal is DGXMM's to handle
            )
        exited = self._watch(process, whole_group=False)
        log.info("demo_litellm_started", pid=process.pid, port=front.port, log=str(front.log))
        if not await self._until_answers(exited, key, began):
            return
        code = await exited
        if not self._stopping:
            self._say(f"LiteLLM stopped (exit code {code}); its log: {front.log}")

    def _watch(
        self, process: asyncio.subprocess.Process, *, whole_group: bool
    ) -> asyncio.Future[int]:
        """Make `process` the one a stop ends; the future of its exit code."""
        self._process, self._whole_group = process, whole_group
        self._exited = asyncio.ensure_future(process.wait())
        return self._exited

    async def _until_answers(self, exited: asyncio.Future[int], key: str, began: float) -> bool:
        """Poll `GET /v1/models` with the master key until it answers 200; False on failure."""
        front = self.front
        origin = client.Origin.parse(front.url)
        auth = [("authorization", f"Bearer {key}")]
        deadline = began + READY_DEADLINE_S
        while not exited.done():
            with contextlib.suppress(client.HttpClientError):
                answer = await client.request_url(
                    origin, "GET", "/v1/models", headers=auth, timeout_s=5.0
                )
                if answer.status == 200:
                    took = time.monotonic() - began
                    self._say(
                        f"LiteLLM is ready on {front.url}/v1 (it answered after {took:.0f} s):"
                        " the openai example above works now."
                    )
                    return True
            if time.monotonic() > deadline:
                self._failed(
                    f"it did not answer within {READY_DEADLINE_S:.0f} s; its log: {front.log}"
                    f" ({log_tail(front.log)})"
                )
                return False
            await asyncio.wait({exited}, timeout=POLL_S)
        if not self._stopping:
            self._failed(
                f"gunicorn exited with {exited.result()}; its log: {front.log}"
                f" ({log_tail(front.log)})"
            )
        return False


def _read(path: Path, since: float = 0.0) -> str:
    """The file's text ("" when it is missing, or was last written before `since`)."""
    try:
        if path.stat().st_mtime < since:
            return ""
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _prepare(workdir: Path, pidfile: Path) -> None:
    """LiteLLM's working directory (0700), without a pidfile left by a killed run: gunicorn
    refuses to start while the pid in it is alive, and that pid may be another program's."""
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
