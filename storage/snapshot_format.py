"""The snapshot blob's format: what the store writes for a folded state and reads back.

The store is `storage.eventlog`; this module is the format alone.

A blob starts with the snapshot format, which changes by itself when `SystemState`'s schema
changes (a hash of its JSON schema) and by hand (`STATE_SEMANTICS`) when `evolve` changes
meaning: the store passes over blobs of another format, and `decode_snapshot` returns None for
one that does not decode, so an old or damaged snapshot costs a longer fold, never a start.
When snapshots are written and how start-up uses them is `storage.snapshots`' business.
"""

from __future__ import annotations

import hashlib

import msgspec

from events.state import SystemState

# Bump when `evolve` folds the same events into a different state.
STATE_SEMANTICS = 1

_schema = msgspec.json.encode(msgspec.json.schema(SystemState), order="sorted")
SNAPSHOT_FORMAT = f"dgxmm-state/{STATE_SEMANTICS}/{hashlib.sha256(_schema).hexdigest()[:16]}"
SNAPSHOT_PREFIX = SNAPSHOT_FORMAT.encode() + b"\n"  # a blob's first bytes
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SystemState)


def encode_snapshot(state: SystemState) -> bytes:
    """The blob stored for `state`: the format line, then the state's JSON."""
    return SNAPSHOT_PREFIX + _encoder.encode(state)


def decode_snapshot(blob: bytes) -> SystemState | None:
    """The state in `blob`, or None when it is of another format or damaged."""
    if not isinstance(blob, bytes) or not blob.startswith(SNAPSHOT_PREFIX):
        return None
    try:
        return _decoder.decode(blob[len(SNAPSHOT_PREFIX) :])
    except msgspec.DecodeError:
        return None
