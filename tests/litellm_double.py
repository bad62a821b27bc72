"""A double of LiteLLM's model-management API (1.108.7), for testing `ApiSync` over real sockets.

It answers what `dgxmm.litellm.backend.LiteLLMClient` uses, with the status codes and bodies
LiteLLM 1.108.7 sends (read from
`litellm/proxy/management_endpoints/model_management_endpoints.py` and `proxy_server.py`, and
observed on a real proxy where no database was needed):

- `GET /health/liveliness` (no auth);
- `GET /model/info` and `/v1/model/info`, optionally `?litellm_model_id=`: the router's entries
  without `api_key`, each `model_info` with `db_model`; an unknown id is HTTP 400
  `{"detail": {"error": "Model id = X not found on litellm proxy"}}`;
- `POST /model/new`: stores the entry (id from `model_info.id`, else a fresh uuid) and answers
  the stored row; a duplicate id fails like LiteLLM's unique constraint does (HTTP 500 "Failed to
  add model to db");
- `PATCH /model/{id}/update`: merges `litellm_params` and `model_info` into the stored row;
- `POST /model/delete {"id"}`: HTTP 400 "Model with id=X not found in db" for an unknown id.

Writes need the database: with `db_connected=False` they answer HTTP 500 "No DB Connected", as a
LiteLLM without `DATABASE_URL` does.  Entries from LiteLLM's config file can be given with
`config_entries` or read from `config_path` on every request, as if LiteLLM reloaded at once
(listed with `db_model: false`; the API cannot change them).  The database survives
`stop()`/`start()`, like a LiteLLM restart with its database; `db.clear()` models a new database.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import urllib.parse
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h11
import msgspec

MAX_BODY_BYTES = 1024 * 1024
NO_DB = "{'error': \"No DB Connected. Here's how to do it - https://docs.litellm.ai/docs/proxy/virtual_keys\"}"


class RecordedCall(msgspec.Struct, frozen=True):
    """One request the double received."""

    method: str
    path: str  # without the query string
    query: dict[str, str]
    body: Any


def _proxy_error(
    status: int, message: str, kind: str, param: str | None = "None"
) -> tuple[int, Any]:
    return status, {
        "error": {"message": message, "type": kind, "param": param, "code": str(status)}
    }


class LiteLLMDouble:
    """Serves LiteLLM's model-management API on 127.0.0.1 from an in-memory "database"."""

    def __init__(
        self,
        master_key: str,
        *,
        db_connected: bool = True,
        config_entries: list[dict[str, Any]] | None = None,
        config_path: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.master_key = master_key
        self.db_connected = db_connected
        self.config_entries: list[dict[str, Any]] = config_entries or []
        self.config_path = None if config_path is None else Path(config_path)
        self.db: dict[str, dict[str, Any]] = {}
        self.calls: list[RecordedCall] = []
        self.host = host
        self.port = port
        self._failures: list[tuple[str, str, int, Any]] = []
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>` (the port is fixed after the first start)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> LiteLLMDouble:
        """Listen (again on the same port after a stop)."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening and drop open connections; the database is kept."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> LiteLLMDouble:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def fail_next(self, method: str, path: str, status: int, body: Any) -> None:
        """Answer the next `method path` request with `status` and `body` instead."""
        self._failures.append((method, path, status, body))

    def writes(self) -> list[tuple[str, str]]:
        """The write calls so far, as (method, path-or-id) in order: ("new", id), ("delete", id)."""
        out: list[tuple[str, str]] = []
        for call in self.calls:
            if call.path == "/model/new" and isinstance(call.body, dict):
                out.append(("new", str((call.body.get("model_info") or {}).get("id"))))
            elif call.path == "/model/delete" and isinstance(call.body, dict):
                out.append(("delete", str(call.body.get("id"))))
            elif call.method == "PATCH":
                out.append(("update", call.path.split("/")[2]))
        return out

    def add_entry(self, deployment: Mapping[str, Any]) -> None:
        """Put an entry straight into the database (as another writer would)."""
        row = copy.deepcopy(dict(deployment))
        self.db[str(row["model_info"]["id"])] = row

    # -- HTTP

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        try:
            while True:
                request = await self._read_request(conn, reader)
                if request is None:
                    return
                method, target, key, body = request
                status, answer = self._route(method, target, key, body)
                data = json.dumps(answer).encode()
                headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
                writer.write(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
                writer.write(conn.send(h11.Data(data=data)) or b"")
                writer.write(conn.send(h11.EndOfMessage()) or b"")
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (h11.ProtocolError, OSError, ValueError):
            return
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    @staticmethod
    async def _read_request(
        conn: h11.Connection, reader: asyncio.StreamReader
    ) -> tuple[str, str, str | None, bytes] | None:
        method = target = ""
        key: str | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(64 * 1024))
            elif isinstance(event, h11.Request):
                method, target = event.method.decode(), event.target.decode()
                for name, value in event.headers:
                    if name == b"authorization" and value.startswith(b"Bearer "):
                        key = value[len(b"Bearer ") :].decode()
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY_BYTES:
                    raise ValueError("request body too large")
            elif isinstance(event, h11.EndOfMessage):
                return method, target, key, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None

    def _route(self, method: str, target: str, key: str | None, raw: bytes) -> tuple[int, Any]:
        parts = urllib.parse.urlsplit(target)
        path = parts.path
        query = dict(urllib.parse.parse_qsl(parts.query))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return 422, {"detail": [{"type": "json_invalid", "msg": "JSON decode error"}]}
        self.calls.append(RecordedCall(method, path, query, body))
        for index, (f_method, f_path, status, answer) in enumerate(self._failures):
            if f_method == method and f_path == path:
                del self._failures[index]
                return status, answer
        if method == "GET" and path == "/health/liveliness":
            return 200, "I'm alive!"
        if key is None:
            return _proxy_error(401, "Authentication Error, No api key passed in.", "auth_error")
        if key != self.master_key:
            if not self.db_connected:  # virtual keys live in the database
                return _proxy_error(400, "No connected db.", "no_db_connection", None)
            message = "Authentication Error, Invalid proxy server token passed. valid_token=None."
            return _proxy_error(401, message, "auth_error")
        return self.handle(method, path, query, body)

    # -- the model-management endpoints (authenticated)

    def handle(
        self, method: str, path: str, query: Mapping[str, str], body: Any
    ) -> tuple[int, Any]:
        """Answer one authenticated model-management request."""
        if method == "GET" and path in ("/model/info", "/v1/model/info"):
            return self._info(query.get("litellm_model_id"))
        if method == "POST" and path == "/model/new":
            return self._new(body)
        if method == "POST" and path == "/model/delete":
            return self._delete(body)
        if method == "PATCH" and path.startswith("/model/") and path.endswith("/update"):
            return self._update(urllib.parse.unquote(path.split("/")[2]), body)
        return 404, {"detail": "Not Found"}

    def _config_items(self) -> list[dict[str, Any]]:
        items = list(self.config_entries)
        if self.config_path is not None:  # a LiteLLM that reloads its config file at once
            with contextlib.suppress(OSError, ValueError):
                document = json.loads(self.config_path.read_text())
                items += [e for e in document.get("model_list") or [] if isinstance(e, dict)]
        return items

    def _listing(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for item, db_model in [(e, False) for e in self._config_items()] + [
            (e, True) for e in self.db.values()
        ]:
            row = copy.deepcopy(item)
            row.get("litellm_params", {}).pop("api_key", None)
            row.setdefault("model_info", {})["db_model"] = db_model
            rows.append(row)
        return rows

    def _info(self, model_id: str | None) -> tuple[int, Any]:
        rows = self._listing()
        if model_id is None:
            return 200, {"data": rows}
        found = [r for r in rows if r["model_info"].get("id") == model_id]
        if not found:
            return 400, {"detail": {"error": f"Model id = {model_id} not found on litellm proxy"}}
        return 200, {"data": found}

    def _new(self, body: Any) -> tuple[int, Any]:
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("model_name"), str)
            or not isinstance((body.get("litellm_params") or {}).get("model"), str)
        ):
            return 422, {"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required"}]}
        if not self.db_connected:
            return _proxy_error(500, NO_DB, "auth_error")
        row = copy.deepcopy(body)
        info = row.setdefault("model_info", {})
        model_id = str(info.get("id") or uuid.uuid4())
        info["id"] = model_id
        if model_id in self.db:  # the table's primary key refuses it; LiteLLM logs and answers 500
            message = (
                "{'error': 'Failed to add model to db. Check your server logs for more details.'}"
            )
            return _proxy_error(500, message, "auth_error")
        self.db[model_id] = row
        return 200, self._row(row)

    @staticmethod
    def _row(row: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "model_id": row["model_info"]["id"],
            "model_name": row["model_name"],
            "litellm_params": row["litellm_params"],
            "model_info": row["model_info"],
            "blocked": False,
            "created_at": "2026-01-01T00:00:00Z",
            "created_by": "default_user_id",
            "updated_at": "2026-01-01T00:00:00Z",
            "updated_by": "default_user_id",
        }

    def _delete(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("id"), str):
            return 422, {
                "detail": [{"type": "missing", "loc": ["body", "id"], "msg": "Field required"}]
            }
        if not self.db_connected:
            return _proxy_error(500, NO_DB, "auth_error")
        model_id = body["id"]
        if self.db.pop(model_id, None) is None:
            message = f"{{'error': 'Model with id={model_id} not found in db'}}"
            return _proxy_error(400, message, "auth_error")
        return 200, {"message": f"Model: {model_id} deleted successfully"}

    def _update(self, model_id: str, body: Any) -> tuple[int, Any]:
        if not self.db_connected:
            return _proxy_error(500, "No DB Connected", "auth_error")
        row = self.db.get(model_id)
        if row is None:
            if any((e.get("model_info") or {}).get("id") == model_id for e in self._config_items()):
                message = "Cannot edit config-based model. Store model in DB via /model/new first."
                return _proxy_error(400, message, "validation_error", None)
            return _proxy_error(
                404, f"Model {model_id} not found on proxy.", "not_found_error", None
            )
        patch = body if isinstance(body, dict) else {}
        if isinstance(patch.get("model_name"), str):
            row["model_name"] = patch["model_name"]
        for section in ("litellm_params", "model_info"):
            if isinstance(patch.get(section), dict):
                row.setdefault(section, {}).update(copy.deepcopy(patch[section]))
        row["model_info"]["id"] = model_id
        return 200, self._row(row)
