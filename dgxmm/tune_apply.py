"""`dgxmm tune --apply`: the recommendation sent to the running DGXMM, after asking.

Its own module because it is the application's side of `dgxmm tune`: it talks to the admin
API through `dgxmm.admin.client`, which the replay commands (`dgxmm.replay`) never import.
"""

from __future__ import annotations

import argparse
import sys

from dgxmm.admin.client import AdminClient, ClientError, find_server
from dgxmm.replay.tune import apply_body
from simulations.tune import Tuning


def apply(args: argparse.Namespace, result: Tuning) -> int:
    """Send the recommendation to the running DGXMM, after asking (unless --yes)."""
    best = result.recommended
    if best is None:
        sys.stderr.write("dgxmm: tune --apply: nothing to apply (no safe point meets the goal)\n")
        return 1
    if not best.settings:
        sys.stderr.write("dgxmm: tune --apply: the settings as they are are the recommendation\n")
        return 0
    out = sys.stderr if args.json else sys.stdout
    out.write("\nto apply:\n" + "".join(f"  {c}\n" for c in best.changes))
    if not args.yes:
        if not sys.stdin.isatty():
            sys.stderr.write("dgxmm: tune --apply: not a terminal to ask on; add --yes\n")
            return 1
        answer = input("apply these settings? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            out.write("nothing changed\n")
            return 1
    try:
        client = AdminClient(
            find_server(
                args.loaded_config,
                args.url,
                args.token,
                configured=bool(getattr(args, "config", None)),
            )
        )
        applied = client.call("POST", "/dgxmm/api/settings/tune/apply", apply_body(result))
    except ClientError as exc:
        sys.stderr.write(f"dgxmm: tune --apply: {exc.message}\n")
        return exc.status
    seq = applied["applied"]["seq"]
    out.write(f"applied (audit #{seq}); see it and undo it on the Settings page\n")
    return 0
