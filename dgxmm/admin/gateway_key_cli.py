"""`dgxmm gateway-key show|rotate`: the gateway key of the running server.

Both talk to the running server's admin API (found as `dgxmm ps` finds it): a rotation must
happen where the gateway checks keys and the LiteLLM sync writes them, so that LiteLLM has the
new key before the old one is refused.  Neither ever prints a key, only fingerprints; the key
itself is in `<data_dir>/gateway.key` (0600) for whoever runs DGXMM.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

from dgxmm.admin.client import AdminClient, find_server

ROTATE_TIMEOUT_S = 180.0  # the server waits up to 120 s for LiteLLM to load the new key


def add_parser(sub: Any, remote: argparse.ArgumentParser) -> None:
    """`gateway-key show|rotate`."""
    keys = sub.add_parser("gateway-key", help="the key only LiteLLM may call the gateway with")
    verbs = keys.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    verbs.add_parser("show", parents=[remote], help="the key's fingerprint (never the key)")
    verbs.add_parser(
        "rotate", parents=[remote], help="a new key: LiteLLM gets it before the old one is refused"
    )


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def main(args: argparse.Namespace) -> int:
    """Run `dgxmm gateway-key ...` against the running server."""
    target = find_server(args.loaded_config, args.url, args.token)
    client = AdminClient(target, timeout_s=ROTATE_TIMEOUT_S)
    out = sys.stdout
    if args.key_command == "show":
        data = client.call("GET", "/dgxmm/api/gateway-key")
        out.write(f"key id          : {data.get('key_id')}\n")
        if data.get("previous_key_id"):
            out.write(f"previous key id : {data['previous_key_id']} (accepted until")
            out.write(f" {_when(data.get('previous_until'))})\n")
        out.write(f"loopback open   : {'yes' if data.get('loopback_open') else 'no'}\n")
        return 0
    data = client.call("POST", "/dgxmm/api/gateway-key/rotate", {})
    out.write(f"new key id      : {data.get('key_id')}\n")
    out.write(f"old key id      : {data.get('previous_key_id')}")
    out.write(f" (refused from {_when(data.get('previous_until'))})\n")
    if data.get("error"):
        out.write(f"LiteLLM         : not re-registered: {data['error']}\n")
        return 1
    if not data.get("registered"):
        out.write("LiteLLM         : not seen serving the new key yet; the old key overlaps\n")
    return 0
