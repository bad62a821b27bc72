"""Runtimes: what starts and stops engines (`actors.ports.Runtime`).

- `docker.DockerRuntime`: one labelled container per deployment (aiodocker).
- `process.ProcessRuntime`: a local subprocess per deployment, for hosts without Docker and for
  tests.

Both expand two placeholders in `LaunchSpec.argv` and in `LaunchSpec.env` values, so an engine
adapter can write one command line for either runtime:

- `{port}`: the port the engine must listen on.  Docker: `spec.port` (inside the container;
  Docker publishes it on a free host port).  Process: a free host port the runtime picks
  (`spec.port` is then ignored).  The handle's `port` is always the host port to connect to.
- `{host}`: the address the engine must bind.  Docker: `0.0.0.0` (the container's own
  interfaces; the host side is published on 127.0.0.1 only).  Process: the runtime's host,
  `127.0.0.1` by default.

Only these exact tokens are replaced (no `str.format`), so JSON arguments with braces pass
through untouched.  An argv without `{port}` is taken to listen on `spec.port`: the process
runtime then uses that port on its host as is (the caller picks it, e.g. with `free_port()`).
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Iterable, Mapping

from actors.errors import RuntimeFailure

PORT_PLACEHOLDER = "{port}"
HOST_PLACEHOLDER = "{host}"


def expand_argv(argv: Iterable[str], *, host: str, port: int) -> list[str]:
    """Replace `{host}` and `{port}` in every argument."""
    return [_expand(arg, host, port) for arg in argv]


def expand_env(env: Mapping[str, str], *, host: str, port: int) -> dict[str, str]:
    """Replace `{host}` and `{port}` in every value of an environment mapping."""
    return {key: _expand(value, host, port) for key, value in env.items()}


def uses_port_placeholder(argv: Iterable[str], env: Mapping[str, str]) -> bool:
    """Whether the command line or the environment asks for `{port}`."""
    return any(PORT_PLACEHOLDER in value for value in [*argv, *env.values()])


def free_port(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """A TCP port nothing listens on at `host` right now (the engine binds it a moment later)."""
    for _ in range(20):
        port = _bind_probe(host, 0)
        if port not in exclude:
            return port
    raise RuntimeFailure(f"no free TCP port on {host}")


def port_is_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host` right now."""
    try:
        _bind_probe(host, port)
    except RuntimeFailure:
        return False
    return True


def _bind_probe(host: str, port: int) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise RuntimeFailure(f"cannot bind {host}:{port}: {exc.strerror}") from exc
        return int(sock.getsockname()[1])


def _expand(value: str, host: str, port: int) -> str:
    return value.replace(PORT_PLACEHOLDER, str(port)).replace(HOST_PLACEHOLDER, host)


__all__ = [
    "HOST_PLACEHOLDER",
    "PORT_PLACEHOLDER",
    "expand_argv",
    "expand_env",
    "free_port",
    "port_is_free",
    "uses_port_placeholder",
]
