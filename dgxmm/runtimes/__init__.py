"""Runtimes: what starts and stops engines (`actors.ports.Runtime`).

- `dgxmm.runtimes.docker.DockerRuntime`: one labelled container per deployment (aiodocker).
- `dgxmm.runtimes.process.ProcessRuntime`: a local subprocess per deployment, for hosts without
  Docker and for tests.

Both expand two placeholders in `LaunchSpec.argv` and in `LaunchSpec.env` values, so an engine
adapter can write one command line for either runtime:

- `{port}`: the port the engine must listen on.  Docker: `spec.port` (inside the container;
  Docker publishes it on a free host port).  Process: a free host port the runtime picks
  (`spec.port` is then ignored).  The handle's `port` is always the host port to connect to.
- `{host}`: the address the engine must bind.  Docker: `0.0.0.0` (the container's own
  interfaces; the host side is published on 127.0.0.1 only).  Process: the runtime's host,
  `127.0.0.1` by default.

Only these exact tokens are replaced (no `str.format`), so JSON arguments with braces pass
through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

PORT_PLACEHOLDER = "{port}"
HOST_PLACEHOLDER = "{host}"


def expand_argv(argv: Iterable[str], *, host: str, port: int) -> list[str]:
    """Replace `{host}` and `{port}` in every argument."""
    return [_expand(arg, host, port) for arg in argv]


def expand_env(env: Mapping[str, str], *, host: str, port: int) -> dict[str, str]:
    """Replace `{host}` and `{port}` in every value of an environment mapping."""
    return {key: _expand(value, host, port) for key, value in env.items()}


def _expand(value: str, host: str, port: int) -> str:
    return value.replace(PORT_PLACEHOLDER, str(port)).replace(HOST_PLACEHOLDER, host)


__all__ = ["HOST_PLACEHOLDER", "PORT_PLACEHOLDER", "expand_argv", "expand_env"]
