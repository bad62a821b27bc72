"""Nothing bypasses LiteLLM by accident: engines listen on loopback only, on both runtimes.

The gateway requires its key, but an engine port reachable from the network would be a door
around it (and around LiteLLM).  Each runtime starts the simulated engine from its adapter
(as DGXMM does), then the kernel's own table of listening sockets (`/proc/net/tcp`,
`/proc/net/tcp6`) must show the engine's host port bound to 127.0.0.1 and nothing wider,
and the port must refuse a connection to this host's non-loopback address while it answers
on 127.0.0.1.  The Docker runtime's test holds `/tmp/dgxmm-docker.lock` when run beside
other users of the engine (see the common brief).
"""

from __future__ import annotations

import socket
import sys
import uuid
from pathlib import Path

import pytest

from actors.ports import EngineHandle, Runtime
from dgxmm.engines import adapters
from dgxmm.engines.runtimes.process import ProcessRuntime
from tests.e2e_support import require_docker
from tests.runtime_support import http_status, poll_until, run

PROJECT = Path(__file__).resolve().parent.parent
DEADLINE_S = 60.0
WIDE = {"0.0.0.0", "::", "::ffff:0.0.0.0"}


def _address(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} (little-endian hex words) as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    text = socket.inet_ntop(socket.AF_INET6, words)
    return text


def listeners(port: int) -> set[str]:
    """The local addresses of every socket listening on `port` on this host (any netns the
    test can see: this one)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(_address(addr))
    return found


def outside_address() -> str | None:
    """An address of this host that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, a route is chosen
        except OSError:
            return None
        addr: str = probe.getsockname()[0]
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def refuses(host: str, port: int) -> bool:
    """Whether a TCP connection to host:port fails."""
    try:
        with socket.create_connection((host, port), timeout=3):
            return False
    except OSError:
        return True


async def check_loopback_only(runtime: Runtime, settings: adapters.EngineSettings) -> None:
    spec = adapters.launch_spec(
        f"bind-{uuid.uuid4().hex[:8]}", "bind", "sim", "sim-model", 0, settings=settings
    )
    handle: EngineHandle = await runtime.launch(spec)
    try:

        async def serving() -> bool:
            return await http_status(handle.host, handle.port, "/v1/models") == 200

        await poll_until(serving, "the engine serves on 127.0.0.1", DEADLINE_S)
        assert handle.host == "127.0.0.1"
        bound = listeners(handle.port)
        assert not bound & WIDE, f"an engine port open to the network: {bound}"
        if bound:  # a userland proxy or the engine itself (iptables-only NAT shows none)
            assert bound <= {"127.0.0.1", "::ffff:127.0.0.1"}, bound
        outside = outside_address()
        if outside is not None:
            assert refuses(outside, handle.port), f"{outside}:{handle.port} answers"
    finally:
        await runtime.stop(handle, 10.0)
        await runtime.close()


def test_an_engine_on_the_process_runtime_listens_on_loopback_only(tmp_path: Path) -> None:
    settings = adapters.EngineSettings(sim_python=sys.executable, local=True)
    run(check_loopback_only(ProcessRuntime(tmp_path / "engines", cwd=PROJECT), settings))


@pytest.mark.docker
def test_an_engine_on_the_docker_runtime_is_published_on_loopback_only() -> None:
    require_docker()
    from dgxmm.engines.runtimes.docker import DockerRuntime

    run(check_loopback_only(DockerRuntime(), adapters.EngineSettings()))
