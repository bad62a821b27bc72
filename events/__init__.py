"""The events layer: every event DGXMM records, and the pure projections that fold them.

The events (`model`) and the traffic trace's rows (`traffic`); what is folded from them: the
system state (`state`), the audit trail and Events tab (`projections`), the timeline
(`timeline`) and cold starts' phases (`cold_start`).  No I/O; every other layer builds on it.
"""
