"""The storage layer: the append-only event log in SQLite, its read models and snapshots.

The log and its one writer (`eventlog`), the read models written beside it (`readmodels`),
snapshots (`snapshots`, `snapshot_format`), the timeline's windows (`windows`), the archive
(`archive`), the lock that keeps one DGXMM per log (`lock`) and a connection that runs each
statement at once (`inline`).  sqlite3 and aiosqlite exceptions never leave it (`errors`).
"""
