"""The CLI's side of the admin API: find the running server, call it, follow its streams.

How the CLI finds the server and authenticates, first match wins:
1. `--url` / `DGXMM_URL` and `--token` / `DGXMM_TOKEN` (an API token; for another box);
2. `<data_dir>/cli.json`, which `dgxmm serve` writes at start-up (mode 0600: only the owner
   of the data dir reads it) with its admin address and a token of its own; the data dir is
   the configuration's, which `dgxmm.where` chose and the command named on stderr;
3. the admin address of the configuration (then a token must be given, and the errors name
   the file that was not there).

Blocking `http.client` on purpose: a command makes one call (or follows one stream).
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgxmm.config import Config

CLI_FILE = "cli.json"


class ClientError(Exception):
    """A call failed; the message is for the operator (exit status in `status`)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Target:
    """Where the admin API is, the token to send, and the token file looked for when none
    was found (for the error texts)."""

    url: str
    token: str | None
    missing: Path | None = None


def _cli_file(config: Config) -> Path:
    """The token file of the configuration's data dir."""
    return Path(config.server.data_dir).absolute() / CLI_FILE


def find_server(
    config: Config, url: str | None, token: str | None, *, configured: bool = True
) -> Target:
    """The server to talk to (see the module docstring).  `configured` is accepted for older
    callers: the data dir is always the configuration's (`dgxmm.where` chose it)."""
    del configured
    url = url or os.environ.get("DGXMM_URL") or None
    token = token or os.environ.get("DGXMM_TOKEN") or None
    path = _cli_file(config)
    saved: dict[str, Any] = {}
    missing: Path | None = None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        missing = path
    except PermissionError:
        if token is None:
            raise ClientError(
                f"{path} is readable only by the user that runs DGXMM: run this as that user "
                "(or root), or give --token",
                2,
            ) from None
    except (OSError, ValueError):
        saved = {}
    if url is None:
        url = saved.get("url") or _config_url(config)
        if token is None:
            token = saved.get("token")
    return Target(url=str(url).rstrip("/"), token=token, missing=missing)


def _config_url(config: Config) -> str:
    return _http_url(config.server.admin_host, config.server.admin_port)


def _http_url(host: str, port: int) -> str:
    """The URL to reach a listener bound to host:port from this box."""
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def write_cli_file(data_dir: Path, host: str, port: int) -> str:
    """Write `<data_dir>/cli.json` (mode 0600): the admin address and a fresh token for the
    CLI on this box (`dgxmm ps`, `start`, `stop`, `logs`); returns the token.

    Only the owner of the data dir (root, or the service user) can read it, so an operator
    on the box needs no login; the token lives in this file and in memory, never in the log,
    and a restart replaces it.
    """
    token = "dgxmm_local_" + secrets.token_urlsafe(32)
    body = json.dumps({"url": _http_url(host, port), "token": token, "pid": os.getpid()})
    path = data_dir / CLI_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, body.encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


class AdminClient:
    """Calls of the admin API with a Bearer token."""

    def __init__(self, target: Target, timeout_s: float = 30.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        parts = urllib.parse.urlsplit(target.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"not an http(s) URL: {target.url}", 2)
        self._parts = parts

    def _connection(self, timeout_s: float | None) -> http.client.HTTPConnection:
        p = self._parts
        cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        return cls(p.hostname or "", p.port, timeout=timeout_s)

    def _headers(self) -> dict[str, str]:
        headers = {"accept": "application/json"}
        if self.target.token:
            headers["authorization"] = f"Bearer {self.target.token}"
        return headers

    def _send(
        self, method: str, path: str, body: Any, timeout_s: float | None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connection(timeout_s)
        headers = self._headers()
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        try:
            conn.request(method, self._parts.path.rstrip("/") + path, body=data, headers=headers)
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ClientError(
                f"cannot reach DGXMM at {self.target.url} ({exc or type(exc).__name__}); "
                f"is `dgxmm serve` running with this configuration?{self._no_file()}",
                2,
            ) from None

    def _no_file(self) -> str:
        missing = self.target.missing
        return "" if missing is None else f" (found no {missing})"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One JSON call; ClientError with the API's own message when it refuses."""
        conn, resp = self._send(method, path, body, self.timeout_s)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ClientError(f"the answer from {self.target.url} broke off: {exc}", 2) from None
        finally:
            conn.close()
        if resp.status >= 400:
            raise ClientError(_error_text(resp.status, raw, self.target))
        return json.loads(raw) if raw else None

    def events(self, path: str) -> Iterator[tuple[str, str]]:
        """Follow an SSE stream: (event, data) per message, until the server ends it."""
        conn, resp = self._send("GET", path, None, None)
        try:
            if resp.status >= 400:
                raise ClientError(_error_text(resp.status, resp.read(), self.target))
            event, data = "message", list[str]()
            while True:
                raw = resp.readline()
                if not raw:
                    return
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if not line:
                    if data:
                        yield event, "\n".join(data)
                    event, data = "message", []
                elif line.startswith(":"):
                    continue
                else:
                    name, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "event":
                        event = value
                    elif name == "data":
                        data.append(value)
        except (OSError, http.client.HTTPException) as exc:
            raise ClientError(f"the stream from {self.target.url} broke off: {exc}", 2) from None
        finally:
            conn.close()


def _error_text(status: int, raw: bytes, target: Target) -> str:
    try:
        message = str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", errors="replace").strip()[:200] or f"HTTP {status}"
    if status == 401 and target.token is None:
        found = "" if target.missing is None else f"found no {target.missing}; "
        message += f" (no token: {found}run as the user that runs DGXMM, or give --token)"
    return message


def remove_cli_file(data_dir: Path) -> None:
    """Remove `cli.json` at shutdown if this process wrote it."""
    path = data_dir / CLI_FILE
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass  # policy: a stale file only makes the CLI try a dead address


# --- the commands ---------------------------------------------------------------------------

_GIB = 1024**3


def _ago(now: float, then: float | None) -> str:
    if then is None:
        return "never"
    from dgxmm.admin.ops import human_duration

    return human_duration(now - then) + " ago"


def ps_lines(deployments: list[dict[str, Any]], now: float) -> list[str]:
    """`dgxmm ps` as a table, then a line for each deployment with a problem (pure)."""
    header = (
        "NAME", "ENGINE", "MODE", "STATE", "MEMORY", "IN FLIGHT", "QUEUED", "START (EST.)",
        "LAST USED",
    )  # fmt: skip
    rows = [header]
    notes = []
    for d in deployments:
        name = str(d.get("name", ""))
        if d.get("not_started") and d.get("mode") == "on_demand":
            if d.get("state") == "stopped":
                notes.append(f"{name}: starts on its next request (not now: {d['not_started']})")
        elif d.get("not_started"):
            notes.append(f"{name}: not started: {d['not_started']}")
        elif d.get("state") == "failed" and d.get("last_error"):
            notes.append(f"{name}: failed: {d['last_error']}")
        rows.append(
            (
                name,
                str(d.get("engine", "")),
                str(d.get("mode", "")).replace("_", " "),
                str(d.get("badge") or d.get("state", "")),
                f"{d.get('memory_bytes', 0) / _GIB:g} GiB",
                str(d.get("in_flight", 0)),
                str(d.get("queued", 0) + d.get("waiting_for_start", 0)),
                estimate_text(d.get("expected_start_s")),
                _ago(now, d.get("last_used_at")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    table = [
        "  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    ]
    return table + notes


def estimate_text(seconds: float | None) -> str:
    """An expected start time, labelled as the estimate it is ("-" without history)."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"est. {seconds:.1f}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"est. {minutes}m{rest:02d}s"


def _client(args: Any) -> AdminClient:
    config: Config = args.loaded_config
    return AdminClient(find_server(config, args.url, args.token))


def _path_id(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def ps_command(args: Any) -> int:
    """`dgxmm ps`: every deployment, one line each."""
    import sys
    import time

    data = _client(args).call("GET", "/dgxmm/api/deployments")
    deployments = data.get("deployments", [])
    if args.json:
        for d in deployments:
            sys.stdout.write(json.dumps(d) + "\n")
        return 0
    if not deployments:
        sys.stdout.write("no deployments\n")
        return 0
    sys.stdout.write("\n".join(ps_lines(deployments, time.time())) + "\n")
    return 0


def start_stop_command(args: Any) -> int:
    """`dgxmm start NAME` / `dgxmm stop NAME`."""
    import sys

    verb = args.command
    record = _client(args).call("POST", f"/dgxmm/api/deployments/{_path_id(args.name)}/{verb}")
    state = record.get("badge") or record.get("state")
    sys.stdout.write(f"{record.get('name', args.name)}: {state}\n")
    return 0


def logs_command(args: Any) -> int:
    """`dgxmm logs NAME [--tail N] [-f]`."""
    import sys

    client = _client(args)
    path = f"/dgxmm/api/deployments/{_path_id(args.name)}/logs?tail={args.tail}"
    if not args.follow:
        data = client.call("GET", path)
        lines = data.get("lines", [])
        if lines:
            sys.stdout.write("\n".join(lines) + "\n")
        return 0
    for event, data in client.events(path + "&follow=1"):
        if event == "line":
            sys.stdout.write(json.loads(data) + "\n")
            sys.stdout.flush()
    return 0
