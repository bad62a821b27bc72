"""The extra hop of always-on traffic with the file back-end: LiteLLM -> gateway -> engine.

    python -m tests.perf.bench_litellm_hop [--pairs N] [--raw-pairs N]

With the file back-end every LiteLLM entry points at the gateway (so that no state change or
mode switch rewrites LiteLLM's file), also for always-on deployments that the api back-end
points straight at the engine.  This measures what that costs, on loopback, at concurrency 1:

- raw: the same small chat completion straight to a simulated engine and through the gateway
  (a scripted ready controller, as in bench_gateway), taking turns request by request;
- through LiteLLM 1.108.7 (`LITELLM_BIN`): one LiteLLM with two entries for the same engine,
  one direct and one via the gateway (same settings otherwise), taking turns.

Reported: medians of each path and the median of the paired (same-turn) differences, which is
robust to the drift of a shared machine.  Every wait has a deadline; every process started here
is stopped at exit.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.litellm_support import LiteLLMProxy, SimEngineProcess, free_port, litellm_bin
from tests.perf.bench_gateway import MODEL, wait_port

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class KeepAlive:
    """One keep-alive HTTP/1.1 connection, as LiteLLM's and the gateway's clients keep them."""

    def __init__(self, port: int, headers: dict[str, str] | None = None) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self._headers = {"content-type": "application/json", **(headers or {})}

    def post(self, path: str, body: dict[str, object]) -> float:
        """Seconds for one complete answer (fails on anything but 200)."""
        started = time.perf_counter()
        self._conn.request("POST", path, json.dumps(body).encode(), self._headers)
        answer = self._conn.getresponse()
        data = answer.read()
        took = time.perf_counter() - started
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status} from {path}: {data[:200]!r}")
        return took

    def close(self) -> None:
        self._conn.close()


def turns(
    a: KeepAlive, path_a: str, body_a: dict[str, object],
    b: KeepAlive, path_b: str, body_b: dict[str, object], pairs: int,
) -> tuple[list[float], list[float]]:  # fmt: skip
    """`pairs` turns of one request each, alternating who goes first; after a warm-up."""
    for _ in range(min(50, pairs)):
        a.post(path_a, body_a)
        b.post(path_b, body_b)
    times_a, times_b = [], []
    for index in range(pairs):
        if index % 2:
            times_b.append(b.post(path_b, body_b))
            times_a.append(a.post(path_a, body_a))
        else:
            times_a.append(a.post(path_a, body_a))
            times_b.append(b.post(path_b, body_b))
    return times_a, times_b


def report(name: str, direct: list[float], hop: list[float]) -> None:
    """Medians in ms and the median of paired differences."""
    paired = statistics.median(h - d for d, h in zip(direct, hop, strict=True))
    print(
        f"{name}: {len(direct)} pairs; direct p50 {statistics.median(direct) * 1e3:.2f} ms, "
        f"via gateway p50 {statistics.median(hop) * 1e3:.2f} ms; added (median of paired "
        f"differences) {paired * 1e3:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=400, help="turns through LiteLLM")
    parser.add_argument("--raw-pairs", type=int, default=2000, help="turns without LiteLLM")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-litellm-hop-"))
    engine = SimEngineProcess(MODEL, workdir=workdir).start()
    gateway_port = free_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    gateway = subprocess.Popen(
        [sys.executable, "-m", "tests.perf.bench_gateway", "--serve-gateway",
         "--engines", str(engine.port), "--port", str(gateway_port), "--package-dir", ""],
        env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    proxy: LiteLLMProxy | None = None
    try:
        wait_port(gateway_port, gateway)
        direct, via = KeepAlive(engine.port), KeepAlive(gateway_port)
        raw = turns(
            direct, "/v1/chat/completions", BODY,
            via, "/d/d0/v1/chat/completions", BODY, args.raw_pairs,
        )  # fmt: skip
        report("raw (client -> engine vs client -> gateway -> engine)", *raw)

        common = {"api_key": "dgxmm-no-key", "num_retries": 0, "timeout": 1500.0}
        entries = [
            {
                "model_name": name,
                "litellm_params": {"model": f"openai/{MODEL}", "api_base": base, **common},
                "model_info": {"id": f"bench-{name}"},
            }
            for name, base in (
                ("hop-direct", f"{engine.url}/v1"),
                ("hop-gateway", f"http://127.0.0.1:{gateway_port}/d/d0/v1"),
            )
        ]
        config = workdir / "litellm.json"
        config.write_text(
            json.dumps(
                {"model_list": entries, "general_settings": {"disable_model_info_refresh": True}}
            )
        )
        proxy = LiteLLMProxy(litellm_bin(), config, workdir, reload=False).start()
        a, b = KeepAlive(proxy.port, proxy.auth), KeepAlive(proxy.port, proxy.auth)
        through = turns(
            a, "/v1/chat/completions", {**BODY, "model": "hop-direct"},
            b, "/v1/chat/completions", {**BODY, "model": "hop-gateway"}, args.pairs,
        )  # fmt: skip
        report("through LiteLLM (LiteLLM -> engine vs LiteLLM -> gateway -> engine)", *through)
    finally:
        if proxy is not None:
            proxy.stop()
        gateway.terminate()
        gateway.wait(10)
        engine.stop()


if __name__ == "__main__":
    main()
