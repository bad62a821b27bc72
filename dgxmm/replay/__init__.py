"""`dgxmm replay`, `dgxmm events`, `dgxmm audit` and `dgxmm archive`: the log after the fact.

`commands` holds the commands and what they print; `logview` the reading they share (times,
names, redaction, folding, timelines), all streamed, in memory independent of the log.
"""

from __future__ import annotations

from dgxmm.replay.commands import (
    archive_command,
    audit_command,
    events_command,
    replay_command,
)
from dgxmm.replay.logview import NotInLog, parse_time, redact, redact_record

__all__ = [
    "NotInLog",
    "archive_command",
    "audit_command",
    "events_command",
    "parse_time",
    "redact",
    "redact_record",
    "replay_command",
]
