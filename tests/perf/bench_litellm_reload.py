"""Which gunicorn reload of LiteLLM 1.108.7 is hitless: the experiment behind docs/litellm.md.

    python -m tests.perf.bench_litellm_reload {cli,conf,rolling} [--workers 2] [--reloads 12]

LiteLLM serves two entries of a recording upstream (`tests.litellm_support.RecordingUpstream`,
fast answers, so the request rate is high) to 4 clients, each sending chat completions on a
fresh connection, no retries.  Meanwhile an entry is added to the config file and LiteLLM is
reloaded, `--reloads` times, each once the previous entry is served:

- `cli`: `litellm --config F --run_gunicorn --num_workers N`, then `kill -HUP <master>`;
- `rolling`: the same, then `TTIN` once per worker, and `TTOU` as often once the entry is served;
- `conf`: `gunicorn -c docs/litellm-gunicorn.conf.py` (the draining worker), `kill -HUP`.

Reported per reload: seconds from the signal to the entry being served 5 times in a row; at the
end: requests answered, failures (with what the client saw), the slowest request.  Every wait
has a deadline; LiteLLM and the upstream are stopped at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.litellm_support import (
    REPO,
    LiteLLMProxy,
    RecordingUpstream,
    http_request,
    litellm_bin,
)

SERVED_S = 120.0
CLIENTS = 4


class Proxy(LiteLLMProxy):
    """LiteLLM under gunicorn, started one of the ways above."""

    def __init__(self, mode: str, workers: int, config_path: Path, workdir: Path) -> None:
        super().__init__(litellm_bin(), config_path, workdir, reload=False)
        self.mode, self.workers = mode, workers

    def argv(self) -> list[str]:
        if self.mode == "conf":
            conf = REPO / "docs" / "litellm-gunicorn.conf.py"
            bind = f"127.0.0.1:{self.port}"
            gunicorn = str(self.binary.parent / "gunicorn")
            return [gunicorn, "-c", str(conf), "--bind", bind, "--workers", str(self.workers)]
        return [*super().argv(), "--run_gunicorn", "--num_workers", str(self.workers)]

    def extra_env(self) -> dict[str, str]:
        return {"LITELLM_CONFIG": str(self.config_path)}


def entry(upstream: RecordingUpstream, name: str) -> dict[str, Any]:
    return {
        "model_name": name,
        "litellm_params": {
            "model": f"openai/{name}",
            "api_base": upstream.url + "/v1",
            "api_key": "none",
            "num_retries": 0,
        },
        "model_info": {"id": f"bench-{name}"},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["cli", "conf", "rolling"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reloads", type=int, default=12)
    args = parser.parse_args()
    upstream = RecordingUpstream().start()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "litellm.json"
        document = {
            "model_list": [entry(upstream, "a"), entry(upstream, "b")],
            "general_settings": {"disable_model_info_refresh": True},
        }
        config.write_text(json.dumps(document))
        proxy = Proxy(args.mode, args.workers, config, Path(tmp))
        try:
            run(proxy, upstream, document, args)
        finally:
            proxy.stop()
            upstream.close()


def run(proxy: Proxy, upstream: RecordingUpstream, document: dict[str, Any], args: Any) -> None:
    proxy.start()
    assert proxy.pid is not None
    ok: list[float] = []
    failed: list[str] = []
    stop = threading.Event()

    def client(n: int) -> None:
        index = n
        while not stop.is_set():
            body = {"model": "ab"[index % 2], "messages": [{"role": "user", "content": "hi"}]}
            index += 1
            started = time.monotonic()
            try:
                answer = http_request(
                    proxy.url, "POST", "/v1/chat/completions", body, proxy.auth, 120.0
                )
                if answer.status == 200:
                    ok.append(time.monotonic() - started)
                else:
                    failed.append(f"HTTP {answer.status}")
            except OSError as exc:
                failed.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        for k in range(args.reloads):
            document["model_list"].append(entry(upstream, f"new-{k}"))
            tmp = proxy.config_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(document))
            os.replace(tmp, proxy.config_path)
            signalled = time.monotonic()
            if args.mode == "rolling":
                for _ in range(args.workers):
                    os.kill(proxy.pid, signal.SIGTTIN)
            else:
                os.kill(proxy.pid, signal.SIGHUP)
            in_a_row = 0
            while in_a_row < 5:
                in_a_row = in_a_row + 1 if proxy.serves(f"bench-new-{k}") else 0
                if time.monotonic() - signalled > SERVED_S:
                    raise SystemExit(f"reload {k}: not served after {SERVED_S:.0f} s")
                time.sleep(0.1)  # poll interval; the deadline above bounds the wait
            took = time.monotonic() - signalled
            if args.mode == "rolling":
                for _ in range(args.workers):
                    os.kill(proxy.pid, signal.SIGTTOU)
            print(f"reload {k}: served after {took:.1f} s; {len(ok)} ok, {len(failed)} failed")
            time.sleep(2.0)  # traffic between reloads, as between deployments
    finally:
        stop.set()
        for thread in threads:
            thread.join(150)
    print(
        f"{args.mode}, {args.workers} workers, {args.reloads} reloads: {len(ok)} answered, "
        f"{len(failed)} failed {sorted(set(failed))}; slowest {max(ok, default=0):.1f} s"
    )


if __name__ == "__main__":
    main()
