"""What if: the box's own recorded traffic through the real actors, under other settings.

The entry point the CLI (`dgxmm whatif`, `dgxmm tune`) and the tests import from; the work
is done in three rooms, one per trade, each importing only the ones before it:

- `whatif_history`: reads the log.  `load_history` takes one window of it: the box at
  `since`, the administrators' changes after it, every traced request, each model's
  recorded launches, starts and stops.  `parse_overrides` checks an alternative's settings:
  global keys (`ondemand_make_room_after_s=30`) or a deployment's own
  (`coder.idle_timeout_s=600`, `chat.mode=always_on`, `chat.make_room_after_s=0`).
- `whatif_run`: runs it.  `simulate` replays that history on the virtual clock through the
  real controller (deployment actors, queue, broker) with simulated engines that take each
  model's recorded times, under the overrides.
- `whatif_measure`: measures it.  `measure_recorded` and `simulate` both yield a `Report`
  built by `build_report`, so the recorded column and the simulated ones are measured by
  the same code.
"""

from __future__ import annotations

from simulations.whatif_history import (
    DEFAULT_START_S,
    DEPLOYMENT_KEYS,
    Change,
    History,
    WhatIfError,
    launch_seconds,
    load_history,
    parse_overrides,
    start_seconds,
    stop_seconds,
)
from simulations.whatif_measure import (
    FATES,
    Fates,
    Figures,
    Report,
    build_report,
    fate,
    figures,
    measure_recorded,
)
from simulations.whatif_run import WARM_UP_S, on_probe_grid, simulate, tenths_then_seconds

__all__ = [
    "DEFAULT_START_S",
    "DEPLOYMENT_KEYS",
    "FATES",
    "WARM_UP_S",
    "Change",
    "Fates",
    "Figures",
    "History",
    "Report",
    "WhatIfError",
    "build_report",
    "fate",
    "figures",
    "launch_seconds",
    "load_history",
    "measure_recorded",
    "on_probe_grid",
    "parse_overrides",
    "simulate",
    "start_seconds",
    "stop_seconds",
    "tenths_then_seconds",
]
