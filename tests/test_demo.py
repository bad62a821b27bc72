"""The README's first command: `dgxmm serve --demo` gives a newcomer a model to call at once."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.serve_support import banner_auth, start_demo, stop_demo

DEADLINE_S = 60.0


def test_the_demo_prints_a_login_and_a_curl_command_that_gets_a_chat_completion(
    tmp_path: Path,
) -> None:
    proc, banner = start_demo(tmp_path, DEADLINE_S)
    try:
        assert re.search(r"admin login    : admin / \S{12,}", banner)
        assert "web UI and API : http://127.0.0.1:" in banner
        url = re.search(r"curl -s (\S+)", banner)
        body = re.search(r"-d '(.+)'", banner)
        assert url is not None and body is not None
        # Without the key (a curl that skips LiteLLM): refused, nothing starts.
        refused = urllib.request.Request(
            url.group(1),
            data=body.group(1).encode(),
            headers={"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as no_key:
            urllib.request.urlopen(refused, timeout=DEADLINE_S)
        assert no_key.value.code == 401
        assert json.loads(no_key.value.read())["error"]["code"] == "invalid_api_key"
        request = urllib.request.Request(
            url.group(1),
            data=body.group(1).encode(),
            headers={"content-type": "application/json", **banner_auth(banner)},
        )
        # The model may still be loading: the gateway holds the request until it is ready.
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as answer:
            assert answer.status == 200
            reply = json.loads(answer.read())
        assert reply["object"] == "chat.completion"
        assert reply["choices"][0]["message"]["content"]
        assert (tmp_path / "dgxmm-data" / "dgxmm.db").exists()
    finally:
        stop_demo(proc)
