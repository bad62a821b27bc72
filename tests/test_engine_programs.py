"""Engine binaries are found, not assumed: `[engines] programs`, PATH, and the image's own path."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec
import pytest

from actors.errors import RuntimeFailure
from dgxmm.config import ConfigError, load_config
from dgxmm.engines.adapters import (
    EngineSettings,
    command_line,
    launch_spec,
    program,
    program_problem,
)
from dgxmm.engines.runtimes.process import ProcessRuntime
from tests.real_engine_support import LlamaBuild, Serve
from tests.runtime_support import run

DOCKER = EngineSettings()
LOCAL = EngineSettings(local=True)


def test_in_a_container_each_engine_runs_its_images_own_program() -> None:
    assert [program(e, DOCKER) for e in ("vllm", "llamacpp", "sglang")] == [
        "vllm",
        "/app/llama-server",
        "python3",
    ]


def test_on_the_process_runtime_each_engine_runs_the_program_of_its_name_found_on_path() -> None:
    assert command_line("llamacpp", "/m/x.gguf", settings=LOCAL)[0] == "llama-server"
    assert command_line("vllm", "org/m", settings=LOCAL)[:2] == ["vllm", "serve"]
    assert command_line("sglang", "org/m", settings=LOCAL)[:3] == [
        "python3",
        "-m",
        "sglang.launch_server",
    ]


def test_engines_programs_names_the_program_on_the_process_runtime_only() -> None:
    programs: dict[str, str | list[str]] = {"llamacpp": "/opt/llama/llama-server"}
    local = EngineSettings(local=True, programs=programs)
    assert command_line("llamacpp", "/m/x.gguf", settings=local)[0] == "/opt/llama/llama-server"
    docker = EngineSettings(programs=programs)
    assert command_line("llamacpp", "/m/x.gguf", settings=docker)[0] == "/app/llama-server"


def test_a_program_not_on_path_is_explained_with_the_key_to_set() -> None:
    problem = program_problem("llamacpp", "llama-server", path="/nonexistent")
    assert problem == (
        "cannot run 'llama-server': not found on PATH; install it or set "
        '[engines] programs = {llamacpp = "/path/to/llama-server"} in the configuration'
    )


def test_a_configured_program_that_does_not_exist_or_cannot_run_is_explained(
    tmp_path: Path,
) -> None:
    missing = str(tmp_path / "llama-server")
    assert program_problem("llamacpp", missing) == (
        f"cannot run '{missing}': no such file; fix "
        '[engines] programs = {llamacpp = "/path/to/llama-server"} in the configuration'
    )
    Path(missing).write_text("#!/bin/sh\n")
    assert "not an executable file" in str(program_problem("llamacpp", missing))
    os.chmod(missing, stat.S_IRWXU)
    assert program_problem("llamacpp", missing) is None


def test_the_process_runtime_refuses_to_launch_a_missing_program_and_names_the_key(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        spec = launch_spec("d1", "small", "llamacpp", "/m/x.gguf", 1, settings=LOCAL)
        spec = msgspec.structs.replace(spec, env={"PATH": str(tmp_path)})
        runtime = ProcessRuntime(tmp_path / "data")
        with pytest.raises(RuntimeFailure, match=r"\[engines\] programs = \{llamacpp = "):
            await runtime.launch(spec)
        assert await runtime.list_engines() == []

    run(scenario())


def test_an_unknown_engine_in_engines_programs_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[engines]\nprograms = {llama = "/opt/llama-server"}\n')
    with pytest.raises(ConfigError, match=r"engines\.programs has no engine llama; expected vllm"):
        load_config(config)
    config.write_text('[engines]\nprograms = {llamacpp = "/opt/llama-server"}\n')
    assert load_config(config).engines.programs == {"llamacpp": "/opt/llama-server"}


def test_a_program_may_be_a_command_the_models_options_follow_on_the_process_runtime_only(
    tmp_path: Path,
) -> None:
    vllm = ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    local = EngineSettings(local=True, programs={"vllm": vllm, "llamacpp": ["/opt/ls", "-v"]})
    assert command_line("vllm", "/m/gemma", ["--enforce-eager"], settings=local) == [
        *vllm,
        *("--model", "/m/gemma", "--host", "{host}", "--port", "{port}", "--enforce-eager"),
    ]
    assert command_line("llamacpp", "/m/x.gguf", settings=local)[:4] == [
        "/opt/ls", "-v", "-m", "/m/x.gguf",
    ]  # fmt: skip
    assert program("vllm", local) == "/opt/vllm/bin/python"
    docker = EngineSettings(programs={"vllm": vllm})
    assert command_line("vllm", "/m/gemma", settings=docker)[:3] == ["vllm", "serve", "/m/gemma"]

    config = tmp_path / "c.toml"
    config.write_text(
        '[engines]\nprograms = {vllm = ["/opt/vllm/bin/python", "-m", '
        '"vllm.entrypoints.openai.api_server"]}\n'
    )
    assert load_config(config).engines.programs == {"vllm": vllm}
    config.write_text("[engines]\nprograms = {vllm = []}\n")
    with pytest.raises(ConfigError, match=r"engines\.programs\.vllm names no program"):
        load_config(config)


def test_a_model_given_by_its_host_path_is_mounted_read_only_into_its_container() -> None:
    spec = launch_spec("d1", "small", "llamacpp", "/var/cache/models/gemma.gguf", 1)
    assert spec.read_only_volumes == {"/var/cache/models": "/var/cache/models"}
    vllm = launch_spec("d2", "big", "vllm", "/data/models/Llama-3-8B", 1)
    assert vllm.read_only_volumes == {"/data/models/Llama-3-8B": "/data/models/Llama-3-8B"}
    assert launch_spec("d3", "hub", "vllm", "org/model", 1).read_only_volumes == {}
    local = launch_spec("d4", "small", "llamacpp", "/m/gemma.gguf", 1, settings=LOCAL)
    assert local.read_only_volumes == {}


def test_a_host_without_a_gpu_gets_no_gpu_request_and_a_deployments_image_wins() -> None:
    cpu = EngineSettings(gpu=False, images={"llamacpp": "configured:1"})
    spec = launch_spec("d1", "small", "llamacpp", "/m/x.gguf", 1, settings=cpu)
    assert (spec.gpu, spec.image) == (False, "configured:1")
    own = launch_spec("d1", "small", "llamacpp", "/m/x.gguf", 1, image="own:2", settings=cpu)
    assert own.image == "own:2"
    assert launch_spec("d1", "small", "llamacpp", "/m/x.gguf", 1).gpu is True


def test_a_llamacpp_deployment_without_its_program_fails_its_start_naming_the_key(
    tmp_path: Path,
) -> None:
    model = tmp_path / "x.gguf"
    model.write_bytes(b"GGUF")
    build = LlamaBuild(tmp_path / "absent", model)
    serve = Serve(tmp_path, "process", build, programs=False, path=f"{tmp_path}:/usr/bin:/bin")
    try:
        serve.start()
        serve.deploy("small", mode="always_on")
        failed = serve.wait_state("small", "failed", timeout_s=60)
        reason = str(failed["last_error"])
        assert "cannot run 'llama-server': not found on PATH" in reason
        assert '[engines] programs = {llamacpp = "/path/to/llama-server"}' in reason
        assert not [e for e in serve.events("small") if e["type"] == "EngineStarting"]
    finally:
        serve.close()
