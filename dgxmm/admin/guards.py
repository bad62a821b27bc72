"""Guards of the admin API against hostile input, and secrets kept from viewers (pure).

- JSON bodies: at most `MAX_JSON_DEPTH` levels of nesting, checked before decoding (a
  decoder recurses; 200k levels used to end in RecursionError and a 500).
- Memory: a deployment asking more than the box's usable total can never start; it is
  refused at creation with both numbers.
- Redaction: engine arguments carry secrets (`--api-key sk-...`, `--hf-token=...`,
  `HF_TOKEN=...`).  Viewers see `***` in their place; admins see them as they are.  A
  name is secret when one of its words (split on `-`, `_`, `.`) is token, key, secret,
  password, passwd, apikey, auth, credential(s) — so `--max-num-batched-tokens` stays
  visible while `--hf-token` does not.
"""

from __future__ import annotations

import re
from typing import Any

MAX_JSON_DEPTH = 64
REDACTED = "***"
GIB = 1024**3

_SECRET_WORDS = frozenset(
    {"token", "key", "secret", "password", "passwd", "apikey", "auth", "credential",
     "credentials"}
)  # fmt: skip
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_WORDS = re.compile(r"[-_.]+")


def json_too_deep(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays/objects deeper than `max_depth` (strings skipped)."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False  # the common case, without a scan
    depth = 0
    for found in _JSON_TOKENS.finditer(raw):
        token = found.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


def secret_name(name: str) -> bool:
    """Whether an option or variable name names a secret (`--api-key`, `HF_TOKEN`)."""
    words = [w for w in _WORDS.split(name.strip("-").lower()) if w]
    return any(w in _SECRET_WORDS for w in words) or name.lower().strip("-") in _SECRET_WORDS


def redact_args(args: list[str]) -> list[str]:
    """Engine arguments with the values of secret options and variables replaced."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next and not (arg.startswith("--") and len(arg) > 2):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        name, eq, _value = arg.partition("=")
        if eq and name and secret_name(name):
            out.append(f"{name}={REDACTED}")
        elif arg.startswith("-") and not eq and secret_name(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(arg)
    return out


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Environment variables with secret values replaced."""
    return {k: REDACTED if secret_name(k) else v for k, v in env.items()}


def redact_record(data: dict[str, Any]) -> dict[str, Any]:
    """A deployment record (as JSON) for a viewer."""
    out = dict(data)
    if isinstance(out.get("args"), list):
        out["args"] = redact_args(out["args"])
    if isinstance(out.get("env"), dict):
        out["env"] = redact_env(out["env"])
    return out


def memory_problem(memory_bytes: int | None, usable_bytes: int, total_bytes: int) -> str | None:
    """Why a deployment of this size can never start here, or None."""
    if memory_bytes is None or memory_bytes <= usable_bytes:
        return None
    return (
        f"memory_gib: {memory_bytes / GIB:g} GiB is more than the {usable_bytes / GIB:g} GiB"
        f" usable on this box ({total_bytes / GIB:g} GiB total, less the reserve)"
    )
