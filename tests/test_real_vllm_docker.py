"""A real vLLM (the CPU build, Gemma 3 270M) on the Docker runtime, through a real `dgxmm serve`.

`dgxmm-vllm:local` (scripts/make-vllm-image) runs the vLLM venv of scripts/build-vllm, bound in
read-only through `[engines] image_mounts`; the model folder is bound at its host path as any
model given by its path.  DGXMM runs it as an operator would configure it: `[engines] images
= {vllm = "dgxmm-vllm:local"}`, the CPU build's environment in `extra_env`, and
`--max-model-len 1024 --enforce-eager` in the deployment's args; the adapter's own command
line (`vllm serve MODEL --host 0.0.0.0 --port 8000 ARGS`) runs unchanged.

One cold start (1.5-4 minutes here): a streaming request to the sleeping on-demand deployment
is held through the whole start and gets real tokens; the container is then SIGKILLed and no
process of it is left.  Run it under `flock /tmp/dgxmm-docker.lock` (reconcile stops
containers it does not know).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real_engine_support import call, chat_body, poll
from tests.vllm_support import (
    COLD_S,
    NO_LLAMA,
    SMALL_GIB,
    VLLM_DOCKER_GIB,
    VLLM_IMAGE,
    VllmServe,
    require_vllm,
    require_vllm_image,
    sse_events,
)

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.timeout(900)]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[VllmServe]:
    """DGXMM on the Docker runtime with `vllm` (6 GiB, on demand) created asleep."""
    vllm = require_vllm()
    mounts = require_vllm_image()
    started = VllmServe(
        tmp_path,
        "docker",
        NO_LLAMA,
        total_gib=VLLM_DOCKER_GIB + SMALL_GIB - 1,  # the filler and vLLM do not fit together
        vllm=vllm,
        image_mounts=mounts,
    )
    try:
        started.start()
        started.create_vllm_asleep(VLLM_DOCKER_GIB)
        yield started
    except BaseException:
        print(f"--- dgxmm log ---\n{started.log_tail(80)}")
        raise
    finally:
        started.close()


def inspect(container: str) -> dict[str, object]:
    """`docker inspect` of one container."""
    out = subprocess.run(
        ["docker", "inspect", container], capture_output=True, text=True, timeout=60, check=True
    )
    found: list[dict[str, object]] = json.loads(out.stdout)
    return found[0]


def host_pids(container: str) -> list[int]:
    """The host pids of every process in the container."""
    out = subprocess.run(
        ["docker", "top", container, "-eo", "pid"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [int(line) for line in out.stdout.split()[1:]]


def running_containers(deployment_id: str) -> list[str]:
    """Running containers labelled with this deployment."""
    out = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=dgxmm.deployment={deployment_id}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.split()


def test_a_cold_request_waits_out_a_real_vllm_container_start_and_sigkill_leaves_nothing(
    serve: VllmServe,
) -> None:
    assert serve.vllm is not None
    model = str(serve.vllm.model)
    sent = time.monotonic()
    answer = call(
        serve.gateway_port,
        "POST",
        serve.gateway_path("vllm"),
        chat_body(model, stream=True, max_tokens=8),
        serve.gateway_auth,
        timeout_s=COLD_S,
    )
    waited = time.monotonic() - sent

    # Held through the whole start: real tokens, then [DONE].
    assert answer.status == 200, answer.body
    events = [data for _, data in sse_events(answer.body)]
    assert events[-1] == "[DONE]", events[-3:]
    text = "".join(
        (choice.get("delta") or {}).get("content") or ""
        for event in events
        if isinstance(event, dict)
        for choice in event.get("choices", [])
    )
    assert text.strip(), events
    started = [e for e in serve.events("vllm") if e["type"] == "EngineStarting"]
    ready = [e for e in serve.events("vllm") if e["type"] == "EngineReady"]
    assert len(started) == len(ready) == 1
    cold_s = float(ready[0]["ts"]) - float(started[0]["ts"])
    assert cold_s > 20.0 and waited > cold_s
    print(f"\ncold start on the Docker runtime: {cold_s:.1f} s; the request waited {waited:.1f} s")

    # The container as configured: the adapter's `vllm serve` in the local image, the declared
    # memory as its limit, room in /dev/shm, the port published on loopback only.
    container = serve.engine_runtime_id("vllm")
    info = inspect(container)
    config, host = info["Config"], info["HostConfig"]
    assert isinstance(config, dict) and isinstance(host, dict)
    assert config["Image"] == VLLM_IMAGE
    assert config["Entrypoint"] == ["vllm"] and config["Cmd"][:2] == ["serve", model]
    assert "VLLM_CPU_KVCACHE_SPACE=1" in config["Env"]
    assert host["Memory"] == int(VLLM_DOCKER_GIB * (1 << 30))
    assert host["ShmSize"] >= 160 << 20
    bindings = [b for port in host["PortBindings"].values() for b in port]
    assert bindings and all(b["HostIp"] == "127.0.0.1" for b in bindings)
    stats = subprocess.run(
        ["docker", "stats", "--no-stream", "--format", "{{.MemUsage}}", container],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    print(f"container memory once ready: {stats.stdout.strip()}")

    # SIGKILL of the container: DGXMM sees the engine lost; no process of it is left.
    pids = host_pids(container)
    assert len(pids) >= 2  # docker-init and vLLM's processes
    serve.kill_engine("vllm")
    serve.wait_state("vllm", "stopped", "failed", timeout_s=120)
    poll(lambda: not running_containers(serve.deployments["vllm"]), "no running container")
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not alive, alive
