"""Gunicorn settings for LiteLLM 1.108.7 with hitless reloads (`kill -HUP <master>`).

Run LiteLLM's app under gunicorn with this file (from LiteLLM's own virtual environment, which
has gunicorn):

    LITELLM_CONFIG=/etc/litellm/dgxmm.json LITELLM_MASTER_KEY=sk-... \
        gunicorn -c /opt/dgxmm/docs/litellm-gunicorn.conf.py --bind 127.0.0.1:4000 --workers 2

On `SIGHUP` gunicorn starts new workers, each reading LiteLLM's config file as it boots, and
stops the old ones gracefully.  Why not `litellm --run_gunicorn`: its workers, like every
uvicorn server that shuts down, close at once the connections that are idle at that moment
(accepted and not yet read, or kept alive between two requests), and a client whose request
is on its way there sees a reset (measured: 8 resets in 12 reloads with a new connection per
request; reading the accepted connections first still lost 3-6 requests in 6 reloads of a
client that keeps its connection alive and does not retry, in each of 5 runs).  The worker
below instead stops accepting and leaves every connection it holds open: it answers whatever
arrives on one, with `Connection: close`, and closes an idle one only when the client does or
when it has been idle for `keepalive` seconds, longer than clients keep an idle connection.
Requests in flight get `GRACEFUL_SHUTDOWN_TIMEOUT`, as in LiteLLM's own worker.  Everything
else is what `litellm --run_gunicorn` sets: the app preloaded in the master, its timeouts, the
access log.  `docs/litellm.md` explains the setup and the numbers.
"""

import json
import math
import os
from typing import Any

from litellm.constants import GRACEFUL_SHUTDOWN_TEARDOWN_HEADROOM_SECONDS
from litellm.proxy.shutdown.graceful_shutdown_manager import GracefulShutdownManager
from uvicorn.protocols.http.flow_control import CLOSE_HEADER
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import Server
from uvicorn.workers import UvicornWorker

# How long a worker, running or stopping, keeps a connection open that has no request: longer
# than clients keep an idle pooled connection (httpx, and so the openai SDK: 5 s), so that the
# client, not the worker, gives it up and no request is ever sent on a connection being closed.
# Gunicorn's own default is 2 s, uvicorn's 5 s: both race with such clients.
KEEPALIVE_S = int(os.environ.get("LITELLM_KEEPALIVE_S", "7"))

# How long a stopping worker gives the requests in flight (LiteLLM's `GRACEFUL_SHUTDOWN_TIMEOUT`,
# 30 s), and at least the keep-alive time, so that its idle connections run out first.
GRACEFUL_S = max(GracefulShutdownManager.get_timeout(), KEEPALIVE_S + 1.0)

# The config file: LiteLLM's workers read it at boot (through WORKER_CONFIG, as its CLI does).
if os.environ.get("LITELLM_CONFIG"):
    os.environ["WORKER_CONFIG"] = json.dumps({"config": os.environ["LITELLM_CONFIG"]})


class DrainingServer(Server):
    """A uvicorn server whose every answer says `Connection: close` once it is stopping."""

    async def shutdown(self, sockets: Any = None) -> None:
        # uvicorn puts these headers on every answer that starts from now on (its main loop,
        # which renewed them every second for the Date, has ended); h11 reads the header and
        # closes the connection after the answer.
        state = self.server_state
        state.default_headers = [*state.default_headers, CLOSE_HEADER]
        await super().shutdown(sockets)  # stops listening, then `shutdown()` on each connection


class DrainingH11Protocol(H11Protocol):
    """uvicorn's h11 connection (what LiteLLM's worker runs: httptools is not installed with
    LiteLLM), except that a stopping worker leaves it open until the client closes it, its
    next answer has been sent, or it has been idle for `keepalive` seconds.

    uvicorn's own `shutdown()` closes an idle connection at once, and a request the client has
    sent on it meanwhile is lost; and it lets a busy one close after its answer without saying
    so (h11 writes `Connection: close` only when the answer's headers carry it), and a client
    that sends its next request before it sees the close loses that one."""

    def shutdown(self) -> None:
        """Called by the stopping server on each open connection, after it stopped listening."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.response_started:  # its answer says close, h11 closes after it
                cycle.default_headers = [*cycle.default_headers, CLOSE_HEADER]
            # An answer under way keeps its connection alive; the next one says close.
        elif self.timeout_keep_alive_task is None and not self.transport.is_closing():
            # Accepted, nothing read yet: no keep-alive timer runs, so start one.  An idle
            # connection's timer runs since its last answer.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )


class DrainingWorker(UvicornWorker):
    """What LiteLLM's graceful worker is (uvicorn's, with `timeout_graceful_shutdown`), serving
    with `DrainingServer` and `DrainingH11Protocol`."""

    CONFIG_KWARGS: dict[str, Any] = {  # noqa: RUF012 (declared so by uvicorn)
        **UvicornWorker.CONFIG_KWARGS,
        "http": DrainingH11Protocol,
        "timeout_graceful_shutdown": GRACEFUL_S,
    }

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
keepalive = KEEPALIVE_S  # uvicorn's `timeout_keep_alive` in each worker
graceful_timeout = math.ceil(GRACEFUL_S) + GRACEFUL_SHUTDOWN_TEARDOWN_HEADROOM_SECONDS
timeout = 600
accesslog = "-"
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s'


def on_starting(server: Any) -> None:
    """As LiteLLM's CLI does: the preloaded master only forks, never runs native routes."""
    from litellm.rust_bridge.fork_guard import reserve_process_for_forking

    reserve_process_for_forking("the gunicorn master")
