"""What `scripts/unused-code` (vulture) cannot see used: names called by name or by a framework.

vulture follows names, not strings: a route's handler found by `getattr`, a `dgxmm` command
delegated by its function's name, an asyncio or http.server callback, a pytest fixture used
through `usefixtures`.  Each is listed here once, with who calls it.  (Admin handlers
`_h_<route>`, http.server's `do_<METHOD>` and pytest hooks `pytest_*` are matched by pattern:
`[tool.vulture]` in pyproject.toml.)  This module is only read by vulture, never imported.
"""

from http.server import BaseHTTPRequestHandler

from dgxmm import app
from dgxmm.admin import auth
from dgxmm.admin.accounts import AccountRoutes
from dgxmm.admin.gateway_key_api import KeyRoutes, NoKeyRoutes
from gateway.transport import ByteStream
from storage.inline import InlineConnection
from tests import test_runtime_docker

CALLED_BY_NAME = (
    # Admin routes `accounts.<method>` and `keys.show` (dgxmm/admin/routes.py), looked up by
    # `AdminApi` with getattr.
    AccountRoutes.list_users,
    AccountRoutes.change_user,
    AccountRoutes.remove_user,
    AccountRoutes.change_own_password,
    AccountRoutes.list_tokens,
    AccountRoutes.revoke_token,
    KeyRoutes.show,
    NoKeyRoutes.show,
    # `dgxmm serve` and `dgxmm user add` (dgxmm/cli.py `_delegate(module, function)`).
    app.serve_main,
    auth.add_user_main,
    # asyncio.Protocol's callback; aiosqlite's method, overridden to run without its thread.
    ByteStream.eof_received,
    InlineConnection._execute,
    # pytest.mark.usefixtures("docker_engine").
    test_runtime_docker.docker_engine,
    # Overridden to keep the test upstream quiet (tests/litellm_support.py).
    BaseHTTPRequestHandler.log_message,
)
