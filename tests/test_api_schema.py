"""The OpenAPI document against both listeners of a real `dgxmm serve --demo`, with
schemathesis (property-based, on hypothesis): every documented answer matches its schema
(status, content type, body) and no input gets a 5xx.  Its counts go to the run's
summary of what was tried (tests/conftest.py), so they show in CI's log.

The gateway is tested first, against the demo's always-on deployment once it is ready (the
seed's 503s of a model that does not run, such as `ondemand_not_ready`, answer a state, not
an input; tests/test_gateway_app.py holds them) and a deployment that does not exist; then
the admin API's two streams (the UI's server-sent events and the engine log with
`follow=1`): a stream never ends, so schemathesis reads each answer up to its first whole
event (`max-stream-events`) and checks that event against the document, the log's against
the always-on deployment and one that does not exist; then the rest of the admin API with
an administrator's API token (its fuzzing removes and reconfigures deployments).
`response_schema_conformance` checks every answer's body against its operation's schema,
the error answers' too.

The answers fuzzing seldom gets right (a login with the password, a new user and what is
done to it, one's own new password, a new deployment, a request's story) are then asked
for once each with good input, and checked against the same document.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema_rs

from tests.serve_support import banner_auth, start_demo, stop_demo

DEADLINE_S = 60.0
EXAMPLES = 10  # per operation: about 400 requests, under a minute
CHECKS = ",".join(
    ("not_a_server_error", "status_code_conformance", "content_type_conformance",
     "response_schema_conformance")
)  # fmt: skip
STREAMS = ("event_stream", "deployment_logs")
# A stream is read up to its first whole event, or for 5 s when none comes (a log followed
# from `tail=0`), then closed: schemathesis checks what it read and calls it cut short.
STREAMS_CONFIG = "".join(
    f'[[operations]]\ninclude-operation-id = "{op}"\nmax-stream-events = 1\nrequest-timeout = 5\n'
    for op in STREAMS
)


def call(
    url: str, body: Any = None, headers: dict[str, str] | None = None, method: str | None = None
) -> Any:
    """One JSON call."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as answer:
        return json.loads(answer.read()), answer.headers


def admin_token(admin: str, password: str) -> str:
    """Log in as the script of docs/api.md does, and create an API token."""
    login, headers = call(f"{admin}/dgxmm/api/login", {"name": "admin", "password": password})
    cookie = headers["set-cookie"].split(";", 1)[0]
    token, _ = call(
        f"{admin}/dgxmm/api/tokens",
        {"name": "schemathesis"},
        {"cookie": cookie, "x-csrf-token": login["csrf_token"]},
    )
    return str(token["token"])


def answer(
    url: str, body: Any = None, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, Any, Any]:
    """One JSON call, whatever its status: (status, body, headers)."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as got:
            return got.status, json.loads(got.read()), got.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def check_answer(doc: dict[str, Any], path: str, method: str, status: int, body: Any) -> None:
    """The answer matches the schema its operation documents for `status` (or `default`)."""
    responses = doc["paths"][path][method.lower()]["responses"]
    schema = responses.get(str(status), responses["default"])["content"]["application/json"]
    jsonschema_rs.validator_for(
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            **schema["schema"],
            "components": doc["components"],
        }
    ).validate(body)


def good_answers(
    doc: dict[str, Any], admin: str, password: str, auth: dict[str, str], request_id: str
) -> list[str]:
    """Ask once, with good input, for what fuzzing seldom gets right; check each answer
    against the document: the operations answered, as `<status> <method> <path>`."""
    api = "/dgxmm/api"
    done = []

    def ask(
        method: str, path: str, route: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Any:
        status, data, answered = answer(admin + api + path, body, headers or auth, method)
        assert status < 300, (method, path, status, data)
        check_answer(doc, api + route, method, status, data)
        done.append(f"{status} {method} {api}{route}")
        return data, answered

    login = {"name": "admin", "password": password}
    ask("POST", "/login", "/login", login, {})
    probe, first, second = "probe", "probe-password-0001", "probe-password-0002"
    ask("POST", "/users", "/users", {"name": probe, "role": "viewer", "password": first})
    ask("PATCH", f"/users/{probe}", "/users/{name}", {"role": "admin"})
    session, headers = ask("POST", "/login", "/login", {"name": probe, "password": first}, {})
    cookie = {
        "cookie": headers["set-cookie"].split(";", 1)[0],
        "x-csrf-token": session["csrf_token"],
    }
    change = {"current": first, "password": second}
    ask("POST", "/session/password", "/session/password", change, cookie)
    ask("DELETE", f"/users/{probe}", "/users/{name}")
    body = {"name": "probe-model", "engine": "sim", "model": "probe", "memory_gib": 1}
    ask("POST", "/deployments", "/deployments", {**body, "mode": "on_demand"})
    ask("GET", f"/requests/{request_id}/story", "/requests/{id}/story")
    return done


def schemathesis(
    schema: Path, base: str, *extra: str, config: Path | None = None
) -> tuple[int, str]:
    """`schemathesis run`, bounded: the exit status and its output (its cache stays in the
    schema's directory, out of the checkout)."""
    program = Path(sys.executable).with_name("schemathesis")
    top = [] if config is None else ["--config-file", str(config)]
    done = subprocess.run(
        [
            str(program), *top, "run", str(schema), "--url", base, "-n", str(EXAMPLES),
            "-c", CHECKS, "--phases", "examples,fuzzing", "--request-timeout", "20",
            "--seed", "32", *extra,
        ],
        capture_output=True, text=True, timeout=600, check=False, cwd=schema.parent,
        env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def counts(output: str) -> str:
    """The summary lines with schemathesis' counts."""
    keep = re.compile(r"^\s*(Selected|Tested|\d+ generated|Operations:|Seed:)")
    return "; ".join(line.strip() for line in output.splitlines() if keep.match(line))


def answers(har: Path) -> dict[str, collections.Counter[str]]:
    """Per operation (its path's last word), the answers schemathesis got, by status and
    content type, from its HAR report."""
    seen: dict[str, collections.Counter[str]] = {}
    for entry in json.loads(har.read_text())["log"]["entries"]:
        headers = {h["name"].lower(): h["value"] for h in entry["response"]["headers"]}
        kind = headers.get("content-type", "none").split(";")[0]
        path = entry["request"]["url"].split("?")[0]
        seen.setdefault(path.rsplit("/", 1)[1], collections.Counter())[
            f"{entry['response']['status']} {kind}"
        ] += 1
    return seen


def test_both_listeners_answer_as_their_openapi_document_says(
    tmp_path: Path, tried: Callable[[str], None]
) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    (tmp_path / "demo").mkdir()
    proc, banner = start_demo(tmp_path / "demo", DEADLINE_S, env=env)
    try:
        admin = re.search(r"web UI and API : (http://\S+)/dgxmm/", banner)
        gateway = re.search(r"gateway        : (http://\S+)/d/", banner)
        password = re.search(r"admin login    : admin / (\S+)", banner)
        ready = re.search(r"deployment     : demo-always \((\w+),", banner)
        assert admin and gateway and password and ready, banner
        token = admin_token(admin.group(1), password.group(1))
        auth = {"authorization": f"Bearer {token}"}
        deadline = time.monotonic() + DEADLINE_S
        while True:  # the always-on model ready, so that the gateway relays to an engine
            listed, _ = call(f"{admin.group(1)}/dgxmm/api/deployments", headers=auth)
            if any(d["state"] == "ready" for d in listed["deployments"]):
                break
            assert time.monotonic() < deadline, listed
            time.sleep(0.2)
        doc, _ = call(f"{admin.group(1)}/dgxmm/api/openapi.json")
        assert doc["openapi"].startswith("3.1")

        gateway_doc = {**doc, "paths": {}}
        for path, item in doc["paths"].items():
            if path.startswith("/d/"):
                for op in item.values():
                    op.pop("servers", None)
                    for param in op["parameters"]:
                        if param["name"] == "deployment":  # ready, and none
                            param["schema"] = {"type": "string", "enum": [ready.group(1), "nope"]}
                gateway_doc["paths"][path] = item
        admin_doc = {
            **doc,
            "paths": {p: i for p, i in doc["paths"].items() if p.startswith("/dgxmm/")},
        }
        (tmp_path / "gateway.json").write_text(json.dumps(gateway_doc))
        (tmp_path / "admin.json").write_text(json.dumps(admin_doc))
        streams_doc = json.loads(json.dumps(admin_doc))  # a deep copy
        for param in streams_doc["paths"]["/dgxmm/api/deployments/{id}/logs"]["get"]["parameters"]:
            if param["name"] == "id":  # ready, and none
                param["schema"] = {"type": "string", "enum": [ready.group(1), "nope"]}
                param["example"] = ready.group(1)
            if param["name"] == "follow":  # the examples phase follows the log once
                param["example"] = "1"
        (tmp_path / "streams.json").write_text(json.dumps(streams_doc))
        (tmp_path / "streams.toml").write_text(STREAMS_CONFIG)

        key = banner_auth(banner)["authorization"]
        status_gw, out_gw = schemathesis(
            tmp_path / "gateway.json", gateway.group(1), "-H", f"Authorization: {key}"
        )
        ready_model = next(d["model"] for d in listed["deployments"] if d["state"] == "ready")
        chat = {"model": ready_model, "messages": [{"role": "user", "content": "hi"}]}
        status, _, answered = answer(
            f"{gateway.group(1)}/d/{ready.group(1)}/v1/chat/completions",
            chat,
            {"authorization": key},
            "POST",
        )
        assert status == 200, status
        good = good_answers(
            doc, admin.group(1), password.group(1), auth, answered["x-dgxmm-request-id"]
        )
        status_streams, out_streams = schemathesis(
            tmp_path / "streams.json", admin.group(1), "-H", f"Authorization: Bearer {token}",
            *(arg for op in STREAMS for arg in ("--include-operation-id", op)),
            "--report", "har", "--report-har-path", str(tmp_path / "streams.har"),
            config=tmp_path / "streams.toml",
        )  # fmt: skip
        streamed = answers(tmp_path / "streams.har")
        # The admin run rotates the gateway key; with LiteLLM enabled (the demo's file
        # back-end) a rotation waits for a LiteLLM that the demo does not run.
        call(f"{admin.group(1)}/dgxmm/api/litellm", {"enabled": False}, auth, "PATCH")
        skip = [arg for op in STREAMS for arg in ("--exclude-operation-id", op)]
        status_admin, out_admin = schemathesis(
            tmp_path / "admin.json", admin.group(1), "-H", f"Authorization: Bearer {token}", *skip
        )
        tried(f"schemathesis, gateway: {counts(out_gw)}")
        tried(f"schemathesis, admin API streams: {counts(out_streams)}")
        for name, seen in sorted(streamed.items()):
            tried(f"  {name}: " + ", ".join(f"{n} x {a}" for a, n in sorted(seen.items())))
        tried(f"schemathesis, admin API: {counts(out_admin)}")
        tried("asked with good input, answers as documented: " + ", ".join(good))
        assert status_gw == 0, out_gw[-6000:]
        assert status_streams == 0, out_streams[-6000:]
        assert status_admin == 0, out_admin[-6000:]
        # Each stream was read as a stream (its first event checked), not only refused.
        assert streamed["stream"]["200 text/event-stream"] > 0, streamed
        assert streamed["logs"]["200 text/event-stream"] > 0, streamed
        assert streamed["logs"]["200 application/json"] > 0, streamed  # without follow
        documented = sum(len(item) for item in doc["paths"].values())
        tested = sum(
            int(n)
            for n in re.findall(
                r"^\s*Tested: (\d+)", out_gw + out_streams + out_admin, re.MULTILINE
            )
        )
        assert tested == documented
    finally:
        stop_demo(proc)
