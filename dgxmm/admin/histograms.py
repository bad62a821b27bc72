"""Latency histograms for `/metrics`: cold starts, queue waits, gateway time to first byte.

Cold starts and queue waits are read from the events as they are recorded (a store
listener): a cold start is `StartRequested` to `EngineReady` of one deployment, a queue wait
is `RequestLeftQueue.waited_s`.  Time to first byte comes from the gateway's hook.  All
three are per deployment and count from this process's start, as Prometheus expects.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

from dgxmm.admin.metrics import escape_label
from events import model as m
from events.cold_start import ColdStarts

COLD_START_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0, 1200.0)
QUEUE_WAIT_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0)
TTFB_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0
)  # fmt: skip
MAX_SERIES = 1024  # label sets per histogram; deployments beyond it are not counted


class Histogram:
    """A Prometheus histogram with one label, `deployment`."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help = help_text
        self.buckets = tuple(buckets)
        self._series: dict[str, tuple[list[int], list[float]]] = {}  # counts, [sum]

    def observe(self, deployment: str, value: float) -> None:
        """Count one observation."""
        series = self._series.get(deployment)
        if series is None:
            if len(self._series) >= MAX_SERIES:
                return
            series = self._series[deployment] = ([0] * (len(self.buckets) + 1), [0.0])
        series[0][bisect.bisect_left(self.buckets, value)] += 1
        series[1][0] += value

    def count(self, deployment: str) -> int:
        """Observations of one deployment."""
        series = self._series.get(deployment)
        return sum(series[0]) if series is not None else 0

    def labels(self, key: str, name_of: Callable[[str], str]) -> str:
        """The label set of one series (`key` is its deployment id)."""
        return f'deployment="{escape_label(name_of(key))}",id="{key}"'

    def render(self, name_of: Callable[[str], str]) -> list[str]:
        """The exposition lines (cumulative buckets, +Inf, sum, count)."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, (counts, total) in sorted(self._series.items()):
            label = self.labels(key, name_of)
            running = 0
            for bound, n in zip(self.buckets, counts, strict=False):
                running += n
                lines.append(f'{self.name}_bucket{{{label},le="{bound:g}"}} {running}')
            running += counts[-1]
            lines.append(f'{self.name}_bucket{{{label},le="+Inf"}} {running}')
            lines.append(f"{self.name}_sum{{{label}}} {total[0]!r}")
            lines.append(f"{self.name}_count{{{label}}} {running}")
        return lines


def last_cold_start(records: Iterable[m.Recorded]) -> float | None:
    """The seconds of the last successful cold start among `records`, or None."""
    pairing = ColdStarts()
    last = None
    for rec in records:
        found = pairing.feed(rec)
        if found is not None:
            last = found[1]
    return last


class Latencies:
    """The three histograms, fed by the event log and the gateway."""

    def __init__(self) -> None:
        self.cold_start = Histogram(
            "dgxmm_cold_start_seconds",
            "Seconds from a start request to the engine answering ready.",
            COLD_START_BUCKETS,
        )
        self.queue_wait = Histogram(
            "dgxmm_queue_wait_seconds",
            "Seconds a request waited in the on-demand queue (for memory or a start).",
            QUEUE_WAIT_BUCKETS,
        )
        self.first_byte = Histogram(
            "dgxmm_gateway_time_to_first_byte_seconds",
            "Seconds from a request's arrival at the gateway to the engine's answer head.",
            TTFB_BUCKETS,
        )
        self._cold = ColdStarts()
        self.extra: list[Histogram] = []  # more histograms fed elsewhere (cold-start phases)

    def recorded(self, records: list[m.Recorded]) -> None:
        """A store listener: count what the new events tell."""
        for rec in records:
            event = rec.event
            if isinstance(event, m.RequestLeftQueue):
                self.queue_wait.observe(event.deployment_id, event.waited_s)
                continue
            found = self._cold.feed(rec)
            if found is not None:
                self.cold_start.observe(*found)

    def render(self, name_of: Callable[[str], str]) -> str:
        """The three histograms' exposition text."""
        lines: list[str] = []
        for histogram in (self.cold_start, self.queue_wait, self.first_byte, *self.extra):
            lines.extend(histogram.render(name_of))
        return "\n".join(lines) + "\n"
