"""The on-demand gateway: LiteLLM reaches deployment <id> at `<gateway_url>/d/<id>/v1/...`.

Modules: `server` (generic HTTP/1.1 server on h11, also used by the admin API), `upstream`
(engine connection pools), `protocol` (pure h11 wrappers), `classify` and `queued`/`health`
(pure rules and bytes), `app` (the gateway handler), `errors`, `deadlines`.
"""

from gateway.app import Gateway, GatewayConfig
from gateway.server import HTTPServer, Request, Responder, ServerConfig
from gateway.upstream import UpstreamConfig, UpstreamPool

__all__ = [
    "Gateway",
    "GatewayConfig",
    "HTTPServer",
    "Request",
    "Responder",
    "ServerConfig",
    "UpstreamConfig",
    "UpstreamPool",
]
