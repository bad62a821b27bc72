"""Gunicorn settings for LiteLLM 1.108.7 with hitless reloads (`kill -HUP <master>`).

Run LiteLLM's app under gunicorn with this file (from LiteLLM's own virtual environment, which
has gunicorn):

    LITELLM_CONFIG=/etc/litellm/dgxmm.json LITELLM_MASTER_KEY=sk-... \
        gunicorn -c /opt/dgxmm/docs/litellm-gunicorn.conf.py --bind 127.0.0.1:4000 --workers 2

On `SIGHUP` gunicorn starts new workers, each reading LiteLLM's config file as it boots, and
stops the old ones gracefully.  Why not `litellm --run_gunicorn`: its workers, like every
uvicorn server that shuts down, close the connections they have accepted but not yet read,
and the clients of those see a reset (measured: 8 resets in 12 reloads under load).  The worker
below first stops accepting, then reads what it accepted, and only then shuts down as LiteLLM's
own worker does (in-flight requests get `GRACEFUL_SHUTDOWN_TIMEOUT`).  Everything else is what
`litellm --run_gunicorn` sets: the app preloaded in the master, LiteLLM's graceful uvicorn
worker, its timeouts, the access log.  `docs/litellm.md` explains the setup.
"""

import asyncio
import json
import math
import os
import time
from typing import Any

from litellm.constants import GRACEFUL_SHUTDOWN_TEARDOWN_HEADROOM_SECONDS
from litellm.proxy.shutdown.graceful_shutdown_manager import GracefulShutdownManager
from litellm.proxy.shutdown.graceful_uvicorn_worker import build_graceful_shutdown_uvicorn_worker
from uvicorn.server import Server

# How long a stopping worker waits at most for the requests on connections it has accepted.
DRAIN_S = float(os.environ.get("LITELLM_DRAIN_S", "2"))

# The config file: LiteLLM's workers read it at boot (through WORKER_CONFIG, as its CLI does).
if os.environ.get("LITELLM_CONFIG"):
    os.environ["WORKER_CONFIG"] = json.dumps({"config": os.environ["LITELLM_CONFIG"]})


def _unread(server: Server) -> bool:
    """Whether a connection was accepted whose request has not been read yet."""
    return any(getattr(c, "cycle", True) is None for c in server.server_state.connections)


class DrainingServer(Server):
    """A uvicorn server that reads every accepted connection's request before it shuts down."""

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:
            server.close()  # the other workers (the new ones, after a HUP) take new connections
        deadline = time.monotonic() + DRAIN_S
        # uvicorn signals no event when a request has been read: look every 20 ms
        while time.monotonic() < deadline and _unread(self):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await super().shutdown(sockets)


_Graceful: Any = build_graceful_shutdown_uvicorn_worker(GracefulShutdownManager.get_timeout())


class DrainingWorker(_Graceful):  # type: ignore[misc, valid-type]
    """LiteLLM's graceful uvicorn worker, serving with `DrainingServer`."""

    async def _serve(self) -> None:
        self.config.app = self.wsgi
        server = DrainingServer(config=self.config)
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            raise SystemExit(3)  # gunicorn's WORKER_BOOT_ERROR


wsgi_app = "litellm.proxy.proxy_server:app"
worker_class = DrainingWorker
workers = 2
preload_app = True  # the master imports LiteLLM once; a new worker boots in about a second
graceful_timeout = (
    math.ceil(GracefulShutdownManager.get_timeout()) + GRACEFUL_SHUTDOWN_TEARDOWN_HEADROOM_SECONDS
)
timeout = 600
accesslog = "-"
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s'


def on_starting(server: Any) -> None:
    """As LiteLLM's CLI does: the preloaded master only forks, never runs native routes."""
    from litellm.rust_bridge.fork_guard import reserve_process_for_forking

    reserve_process_for_forking("the gunicorn master")
