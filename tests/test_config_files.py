"""Configuration ranges, garbled files, and the modes of what DGXMM writes."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from dgxmm.app import App
from dgxmm.config import ConfigError, http_url_problem, load_config
from dgxmm.private import auth_key, private_umask, secure_tree
from tests.test_cli import dgxmm


def config_error(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "dgxmm.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nadmin_port = 70000\n", "server.admin_port"),
        ("[server]\ngateway_port = -1\n", "server.gateway_port"),
        ("[memory]\ntotal_gib = -5\nreserve_gib = -100\n", "memory.total_gib"),
        ("[memory]\ntotal_gib = 0\n", "memory.total_gib"),
        ("[memory]\nreserve_gib = -1\n", "memory.reserve_gib"),
        ("[memory]\ntotal_gib = 64\nreserve_gib = 64\n", "memory.reserve_gib"),
        ("[memory]\ntotal_gib = nan\n", "memory.total_gib"),
        ("[memory]\nwatchdog_every_s = 0\n", "memory.watchdog_every_s"),
        ('[litellm]\nurl = "file:///etc/passwd"\n', "litellm.url"),
        ('[litellm]\nurl = "http://"\n', "litellm.url"),
        ('[server]\ngateway_url = "ftp://box:21"\n', "server.gateway_url"),
        ('[runtime]\ndocker_url = "file:///var/run/docker.sock"\n', "runtime.docker_url"),
        ("[runtime]\nstop_timeout_s = inf\n", "runtime.stop_timeout_s"),
        ('[server]\nadmin_port = "8400"\n', "server.admin_port"),
        ('[engines]\nimage_mounts = {"x:local" = ["venv"]}\n', "engines.image_mounts.x:local"),
    ],
)
def test_a_value_out_of_range_is_one_line_naming_the_key_and_the_file(
    tmp_path: Path, text: str, key: str
) -> None:
    assert key in config_error(tmp_path, text)


def test_a_binary_config_file_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    assert "not a TOML file" in config_error(tmp_path, b"\x89PNG\r\n\x1a\n\x00\xff\xfe garbage")
    assert "dgxmm.toml" in config_error(tmp_path, b"[server\nadmin_port = = 1\x00\n")


def test_serve_with_a_binary_config_exits_2_with_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "dgxmm.toml"
    cfg.write_bytes(os.urandom(512) + b"\xff\xfe")
    done = dgxmm("serve", "--config", str(cfg))
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def test_valid_edges_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text(
        "[server]\nadmin_port = 65535\ngateway_port = 1\ncookie_secure = true\n"
        '[memory]\ntotal_gib = 16\nreserve_gib = 0\n[litellm]\nurl = "https://lite.example:4000"\n'
    )
    config = load_config(path)
    assert config.server.cookie_secure and config.server.admin_port == 65535


def test_only_http_and_https_urls_with_a_host_pass() -> None:
    assert http_url_problem("http://127.0.0.1:4000") is None
    assert http_url_problem("https://lite.example/") is None
    for bad in ("file:///etc/passwd", "gopher://x", "http://", "javascript:alert(1)", 5, None,
                "http://[::1", "http://h:0/"):  # fmt: skip
        assert http_url_problem(bad) is not None, bad


# --- file modes -------------------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_serve_creates_the_data_dir_0700_and_the_log_with_wal_and_shm_0600(tmp_path: Path) -> None:
    data = tmp_path / "data"
    cfg = tmp_path / "dgxmm.toml"
    cfg.write_text(
        f'[server]\ndata_dir = "{data}"\nadmin_port = 0\ngateway_port = 0\ncookie_secure = true\n'
        "[memory]\ntotal_gib = 16\nreserve_gib = 1\nwatchdog_threshold_gib = 0\n"
        '[runtime]\nkind = "process"\n'
    )

    async def main() -> None:
        old = private_umask()
        app = App(load_config(cfg))
        try:
            await app.start()
            assert app.store is not None
            await app.store.append("settings", [], actor="system")
            assert app.api is not None and app.api.auth.config.secure_cookie  # cookie_secure
        finally:
            await app.stop()
            os.umask(old)

    asyncio.run(main())
    assert mode(data) == 0o700
    for name in ("dgxmm.db", "dgxmm.db-wal", "dgxmm.db-shm", "auth.key"):
        if (data / name).exists():
            assert mode(data / name) == 0o600, name
    assert mode(data / "dgxmm.db") == 0o600


def test_world_readable_files_left_by_an_older_version_are_tightened(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "engines").mkdir(parents=True)
    data.chmod(0o755)
    (data / "engines").chmod(0o755)
    db = data / "dgxmm.db"
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), data / "engines" / "x.log"):
        path.write_bytes(b"")
        path.chmod(0o644)
    secure_tree(data, db)
    assert mode(data) == 0o700 and mode(data / "engines") == 0o700
    assert {mode(p) for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"))} == {0o600}
    assert mode(data / "engines" / "x.log") == 0o600


def test_the_auth_key_is_created_once_0600(tmp_path: Path) -> None:
    key = auth_key(tmp_path)
    assert len(key) == 32 and auth_key(tmp_path) == key
    assert mode(tmp_path / "auth.key") == 0o600


def test_an_engine_log_is_0600_even_over_a_world_readable_one_and_with_a_loose_umask(
    tmp_path: Path,
) -> None:
    from dgxmm.engines.runtimes.process import ProcessRuntime
    from tests.runtime_support import run
    from tests.test_runtime_process import script_spec

    async def scenario() -> None:
        runtime = ProcessRuntime(tmp_path / "engines")
        spec = script_spec("print('api key: sk-123', flush=True)")
        old_log = runtime.log_path(spec.deployment_id)
        old_log.parent.mkdir(parents=True)
        old_log.write_text("left by an older version\n")
        old_log.chmod(0o644)
        old = os.umask(0o022)
        try:
            handle = await runtime.launch(spec)
        finally:
            os.umask(old)
        await runtime.stop(handle)
        assert mode(runtime.log_path(handle.deployment_id)) == 0o600

    run(scenario())


def test_a_log_created_by_the_cli_is_0600_even_with_a_loose_umask(tmp_path: Path) -> None:
    from tests.test_accounts_cli import dgxmm_stdin

    db = tmp_path / "new" / "dgxmm.db"
    db.parent.mkdir(mode=0o755)
    done = dgxmm_stdin("a-long-password\n", "user", "add", "ann", "--role", "admin",
                       "--password-stdin", "--db", str(db))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert mode(db) == 0o600


def test_the_cli_gives_an_in_process_caller_its_umask_back(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        from dgxmm import cli

        cli.main(["user", "list", "--db", str(tmp_path / "none.db")])
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(old)


def test_serve_refuses_a_reserve_as_large_as_the_memory_it_found(tmp_path: Path) -> None:
    cfg = tmp_path / "dgxmm.toml"
    cfg.write_text(
        f'[server]\ndata_dir = "{tmp_path / "data"}"\nadmin_port = 0\ngateway_port = 0\n'
        '[memory]\nreserve_gib = 100000\n[runtime]\nkind = "process"\n'
    )
    done = dgxmm("serve", "--config", str(cfg))
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert "memory.reserve_gib (100000.0) must be less than the memory total" in line
