"""Anticipation: what each on-demand model's own traffic says about its next request.

Under `ondemand_policy = "learned"` (issue 44) a model is governed by its recorded traffic,
after "Serverless in the Wild" (Shahrad et al., USENIX ATC 2020), which keeps a histogram of
each application's idle times and derives a keep-alive and a pre-warm window from it.  Two
decisions, both pure functions of one model's gaps (`Gaps`: idle as served, and in its
demand, `Traffic`):

- **keep-warm** (`keep_warm`): how long it stays warm after its last request.  It covers the
  gaps the model usually has up to its idle timeout, and stops sooner when a longer wait
  would only rarely be rewarded: of the gaps no longer than the idle timeout, at most
  `KEEP_EXTRA_COLD` times as many as the seed's own cold starts may fall beyond it (each
  becomes a cold start the seed would not have had).  The idle timeout stays the upper
  bound; fewer than `MIN_GAPS` gaps, or a keep-warm that would reach the idle timeout, is
  the seed's rule.
- **between sessions** (`between_sessions`): a model used every so often (`periodic`) need
  not keep its memory from one session to the next, since a pre-warm starts it again before
  the next one: it keeps warm for itself only through the gaps within its sessions, when
  the pause between them leaves it asleep for longer than the start a pre-warm takes (the
  pre-warm window and keep-alive window of Shahrad et al.), and then *lends* its memory
  (`KeepWarm.lends`): it stays warm until its idle timeout, but any model that needs the
  room may have it at once.  A job run every 15 minutes then holds its memory for its runs,
  and between them only while nobody else needs it.
- **next arrival** (`next_arrival`): a *session* begins with a request after a pause
  (one longer than the keep-warm in force, or than `SESSION_PAUSE_S`) in the model's
  demand, its requests' waits left out (`Traffic`).  Sessions are predictable
  when the last `PERIOD_GAPS` gaps between their beginnings agree within
  `PERIOD_TOLERANCE` (a job every 15 minutes: from its fifth run, in its second hour), or
  when they begin around the same time of day on each of the comparable days before
  (the last three weekdays, the last two weekend days, or the same weekday in the last two
  weeks).  Anything else is never predicted, so never pre-warmed.

`Anticipator` keeps each model's gaps (`Traffic`; bounded: `MAX_GAPS`, `HISTORY_S`), fed
with every request the traffic trace records (in a what-if, each replayed request when the
simulated box's trace would record it); the controller asks it and does the rest (memory,
the queue, the events).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Iterable, Sequence

import msgspec

from events.projections import duration_text
from events.traffic import TrafficRecord

DAY_S = 86_400.0
HISTORY_S = 15 * DAY_S  # two weeks and a day: the weekly pattern's two weeks
MAX_GAPS = 20_000  # per set of gaps (a model has two: `Traffic`); oldest forgotten first
GAP_FLOOR_S = 10.0  # shorter gaps are never worth sleeping through: not kept
MIN_GAPS = 8  # fewer kept gaps: too little to learn from (the seed's rule)
KEEP_FLOOR_S = 15.0  # never sleeps sooner after a request than this
KEEP_MARGIN = 1.25  # the keep-warm is this much longer than the longest gap it covers
KEEP_EXTRA_COLD = 0.03  # extra cold starts it may cause, as a share of the seed's own
PERIOD_GAPS = 4  # session beginnings' gaps that must agree (at most 5, by the issue)
PERIOD_TOLERANCE = 0.10  # ... within this share of their median
MAX_PERIOD_S = 12 * 3600.0  # longer periods are the time-of-day patterns' (`daily`)
DAY_WINDOW_S = 15 * 60.0  # beginnings this close in the day, on comparable days, agree
DAY_SLACK_S = 2 * 60.0  # a daily session may come this much beyond the spread it has shown
DAYS_LOOKED = 5  # comparable days looked back on (at most five gaps, by the issue) ...
DAYS_AGREE = 3  # ... of which this many at least, and all but one, must agree
# A time-of-day pattern must be this unlikely to be chance, given how many sessions a day
# the model begins (noise that begins one every hour matches any time of day somewhere).
CHANCE = 0.05
SESSION_PAUSE_S = 300.0  # a pause this long (or one it sleeps through) ends a session
LEAD_MARGIN = 1.2  # a pre-warm begins its median cold start times this before the arrival
# ... and at least this much more than the start: a start of a second or two (a small model's
# process) varies by about a second on a busy box, which a fifth of it does not cover.
LEAD_SLACK_S = 2.0
BETWEEN_REASON = "a pre-warm starts it again before its next session"
DEFAULT_START_S = 30.0  # a model never timed starting


class Gaps:
    """One model's idle gaps: (the arrival that ended it, its length), oldest first.

    Beside them, for the decisions asked after every request: the finite gaps in order
    (`keep_warm_sorted`) and the beginnings of sessions after the last pause asked for
    (`starts`), both kept as gaps come and go, each a bisection rather than a pass over up
    to `MAX_GAPS` gaps."""

    __slots__ = ("_ordered", "_pause", "_starts", "busy_until", "first_seen", "items")

    def __init__(self) -> None:
        self.items: deque[tuple[float, float]] = deque()
        self.busy_until = -math.inf  # the end of its latest request
        self.first_seen: float | None = None
        self._ordered: list[float] = []  # the finite gaps, shortest first
        self._pause: float | None = None  # the pause `_starts` was made for
        self._starts: deque[float] = deque()

    def observe(self, arrived: float, ended: float) -> bool:
        """One request; True when it began a session (no request for `GAP_FLOOR_S` or more),
        or, heard after a later one, changed the gaps.

        A box hears its requests as they end (the traffic trace's batches), not as they
        arrive: a session's first request, waiting out a cold start beside the next ones,
        may be heard after them.  The gaps are the holes of the union of the requests'
        spans, whatever the order they are heard in (`_heard_late`)."""
        if self.first_seen is None:
            self.first_seen = arrived
            self._add(arrived, math.inf)
            self.busy_until = ended
            return True
        if self.items and arrived < self.items[-1][0]:
            return self._heard_late(arrived, ended)
        began = False
        gap = arrived - self.busy_until
        if gap >= GAP_FLOOR_S:
            self._add(arrived, gap)
            began = True
        if ended > self.busy_until:
            self.busy_until = ended
        return began

    def _add(self, arrived: float, gap: float) -> None:
        if len(self.items) >= MAX_GAPS:
            self._drop_oldest()
        self.items.append((arrived, gap))
        if gap != math.inf:
            insort(self._ordered, gap)
        if self._pause is not None and gap > self._pause:
            self._starts.append(arrived)

    def _heard_late(self, arrived: float, ended: float) -> bool:
        """A request that arrived before the latest gaps ended: it takes its span out of
        each of them (a gap it splits leaves the pieces `GAP_FLOOR_S` or longer)."""
        later: list[tuple[float, float]] = []
        while self.items and self.items[-1][0] > arrived:
            at, gap = self.items.pop()
            if gap != math.inf:
                del self._ordered[bisect_left(self._ordered, gap)]
            if self._starts and self._starts[-1] == at:
                self._starts.pop()
            later.append((at, gap))
        for at, gap in reversed(later):
            began = at - gap  # -inf: the first request heard so far
            if ended <= began:
                self._add(at, gap)  # it ended before this gap began: no change
                continue
            if arrived > began:
                before = arrived - began
                if before >= GAP_FLOOR_S:
                    self._add(arrived, before)
            if at - ended >= GAP_FLOOR_S:
                self._add(at, at - ended)
        if self.first_seen is None or arrived < self.first_seen:
            self.first_seen = arrived
        self.busy_until = max(self.busy_until, ended)
        return True

    def _drop_oldest(self) -> None:
        at, gap = self.items.popleft()
        if gap != math.inf:
            del self._ordered[bisect_left(self._ordered, gap)]
        if self._starts and self._starts[0] == at:
            self._starts.popleft()

    def copy(self) -> Gaps:
        """Another with the same history (a what-if's box starts from the recorded one's)."""
        other = Gaps()
        other.items.extend(self.items)
        other._ordered = list(self._ordered)
        other.busy_until, other.first_seen = self.busy_until, self.first_seen
        return other

    def forget_before(self, when: float) -> None:
        """Drop the gaps that ended before `when` (`HISTORY_S` ago)."""
        while self.items and self.items[0][0] < when:
            self._drop_oldest()

    def keep_warm(self, idle_timeout_s: float) -> KeepWarm:
        """`keep_warm` of these gaps."""
        return keep_warm_sorted(self._ordered, idle_timeout_s)

    def between_sessions(self, pause_s: float, lead: float, keep: KeepWarm) -> KeepWarm:
        """`between_sessions` of these gaps."""
        return between_sessions(self._ordered, pause_s, lead, keep)

    def starts(self, pause_s: float) -> list[float]:
        """`session_starts` of these gaps after pauses longer than `pause_s`."""
        if pause_s != self._pause:
            self._pause = pause_s
            self._starts = deque(session_starts(self.items, pause_s))
        return list(self._starts)


def traced(rec: TrafficRecord) -> tuple[float, float, float]:
    """A request the traffic trace recorded, as `Traffic.observe` takes it: its arrival,
    its end, and its wait for its model (`TrafficRecord.waited_s`, not the row's wait)."""
    return rec.arrived, rec.arrived + rec.duration_s, rec.waited_s


class Traffic:
    """One model's requests, as two sets of gaps.

    - `idle`: between the requests as the box served them (each from its arrival to its
      end): how long the model sat idle, which its keep-warm is learned from.
    - `demand`: between the requests as if each had been served at once (from its arrival
      for its service, its wait left out): where its sessions begin, which its next
      arrival is predicted from.  A wait is the box's doing, not the traffic's: a run whose
      requests waited ten minutes for memory would otherwise seem to last until the next
      run, which would then begin no session, and the period would be lost."""

    __slots__ = ("demand", "idle")

    def __init__(self) -> None:
        self.idle = Gaps()
        self.demand = Gaps()

    def observe(self, arrived: float, ended: float, wait_s: float = 0.0) -> bool:
        """One request; True when either set of gaps changed what it says (`Gaps.observe`)."""
        idle = self.idle.observe(arrived, ended)
        demand = self.demand.observe(arrived, max(arrived, ended - wait_s))
        return idle or demand

    def copy(self) -> Traffic:
        """Another with the same history."""
        other = Traffic()
        other.idle, other.demand = self.idle.copy(), self.demand.copy()
        return other

    def forget_before(self, when: float) -> None:
        """Both sets' `Gaps.forget_before`."""
        self.idle.forget_before(when)
        self.demand.forget_before(when)


class KeepWarm(msgspec.Struct, frozen=True, kw_only=True):
    """The learned keep-warm: seconds (None: the seed's idle timeout) and why, in words."""

    seconds: float | None
    reason: str
    # Between sessions: after `seconds` it keeps its memory only while no other model needs
    # it (a make-room candidate at once, warm up to its idle timeout).
    lends: bool = False


class Prediction(msgspec.Struct, frozen=True, kw_only=True):
    """When the model's next session is expected (epoch seconds), how far off it may be,
    and the pattern that says so, in words."""

    at: float
    tolerance_s: float  # it may come this much later (a pre-warm waits that long)
    pattern: str
    early_s: float = 0.0  # ... or this much earlier (a pre-warm is ready by then)
    period_s: float | None = None  # sessions come this often (None: a time-of-day pattern)


def keep_warm(gaps: Iterable[float], idle_timeout_s: float) -> KeepWarm:
    """The learned keep-warm from a model's gaps (seconds, `inf` for its first request); pure."""
    return keep_warm_sorted(sorted(g for g in gaps if g != math.inf), idle_timeout_s)


def keep_warm_sorted(ordered: Sequence[float], idle_timeout_s: float) -> KeepWarm:
    """`keep_warm` of finite gaps given shortest first; pure."""
    n_short = bisect_right(ordered, idle_timeout_s)  # the gaps within the idle timeout
    long_ = len(ordered) - n_short
    if len(ordered) < MIN_GAPS:
        return KeepWarm(seconds=None, reason="too few pauses recorded yet")
    if not long_:
        return KeepWarm(seconds=None, reason="it is never idle for its whole idle timeout")
    seconds = _covering(ordered, n_short, int(KEEP_EXTRA_COLD * long_))
    if seconds >= idle_timeout_s:
        return KeepWarm(seconds=None, reason="its gaps need its whole idle timeout")
    reason = "its usual gaps" if n_short else "its next request is usually far away"
    return KeepWarm(seconds=seconds, reason=reason)


def _covering(ordered: Sequence[float], n: int, beyond: int) -> float:
    """A keep-warm covering the `n` shortest of `ordered` gaps but the `beyond` longest of
    them, plus a quarter; never under `KEEP_FLOOR_S`; whole seconds, as recorded."""
    covered = ordered[n - 1 - beyond] * KEEP_MARGIN if n > beyond else 0.0
    return float(math.ceil(max(KEEP_FLOOR_S, covered)))


def between_sessions(
    ordered: Sequence[float], pause_s: float, lead: float, keep: KeepWarm
) -> KeepWarm:
    """The keep-warm of a periodic model whose pre-warm starts it before each session
    (`lead` seconds ahead), from its finite gaps shortest first; pure.

    It covers the gaps within its sessions (those no longer than `pause_s`) as `keep_warm`
    covers gaps, and applies only where the pauses between its sessions (their median) leave
    it asleep for at least as long as the pre-warm's lead, and where it is shorter than
    `keep`, the keep-warm it would have otherwise."""
    n_within = bisect_right(ordered, pause_s)
    pauses = ordered[n_within:]
    if not pauses:
        return keep
    # As `keep_warm`: at most this share of its sessions pays a start within one (none
    # until `MIN_GAPS` gaps say how it pauses; with no gap within them, the floor).
    beyond = int(KEEP_EXTRA_COLD * len(pauses))
    seconds = _covering(ordered, n_within, min(n_within - 1, beyond) if n_within >= MIN_GAPS else 0)
    asleep = pauses[len(pauses) // 2] - seconds - lead
    if asleep < lead or (keep.seconds is not None and keep.seconds <= seconds):
        return keep
    return KeepWarm(seconds=seconds, reason=BETWEEN_REASON, lends=True)


def session_starts(items: Iterable[tuple[float, float]], keep_s: float) -> list[float]:
    """The arrivals that found the model asleep under a keep-warm of `keep_s`; pure."""
    return [at for at, gap in items if gap > keep_s]


def periodic(starts: Sequence[float], now: float) -> Prediction | None:
    """The next beginning of sessions that come every so often; pure."""
    if len(starts) < PERIOD_GAPS + 1:
        return None
    tail = starts[-(PERIOD_GAPS + 1) :]
    diffs = [b - a for a, b in itertools.pairwise(tail)]
    period = statistics.median(diffs)
    tolerance = PERIOD_TOLERANCE * period
    if not 0 < period <= MAX_PERIOD_S or any(abs(d - period) > tolerance for d in diffs):
        return None
    at = starts[-1] + period
    if now > at + tolerance:
        return None  # it did not come: the pattern is broken until it shows again
    spread = max(abs(d - period) for d in diffs)
    held = starts[-1]
    for a, b in zip(reversed(starts[:-1]), reversed(starts[1:]), strict=False):
        if abs(b - a - period) > tolerance:
            break
        held = a
    pattern = f"used every {duration_text(period)} for {duration_text(starts[-1] - held)}"
    return Prediction(
        at=at, tolerance_s=tolerance, pattern=pattern, early_s=spread, period_s=period
    )


_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _day_kinds(day: int, first_day: int) -> list[tuple[list[int], int, str]]:
    """The comparable days before `day` (days since the epoch, local; none before
    `first_day`, the first with data), how many must agree, and their words."""
    weekday = (day + 3) % 7  # 1970-01-01 was a Thursday
    weekend = weekday >= 5

    def previous(n: int, step: int, same_kind: bool) -> list[int]:
        found: list[int] = []
        d = day - step
        while len(found) < n and d >= first_day:
            if not same_kind or ((d + 3) % 7 >= 5) == weekend:
                found.append(d)
            d -= step
        return found

    kinds: list[tuple[list[int], int, str]] = []
    similar = previous(DAYS_LOOKED, 1, True)  # one day missed of four or five: still a habit
    if len(similar) >= DAYS_AGREE:
        kinds.append((similar, max(DAYS_AGREE, len(similar) - 1), _KIND_WORDS[weekend]))
    weekly = previous(3, 7, False)
    if len(weekly) >= 2:
        kinds.append((weekly, len(weekly), f"on {_WEEKDAYS[weekday]}s"))
    return kinds


_KIND_WORDS = {False: "on weekdays", True: "at weekends"}


def _chance(per_day: float, looked: int, agree: int) -> float:
    """How likely `agree` of `looked` days have a session near one time of day by chance,
    with `per_day` sessions a day beginning at random."""
    hit = 1.0 - math.exp(-per_day * 2 * DAY_WINDOW_S / DAY_S)
    return sum(
        math.comb(looked, k) * hit**k * (1 - hit) ** (looked - k) for k in range(agree, looked + 1)
    )


def daily(starts: Sequence[float], now: float, tz_offset_s: float) -> Prediction | None:
    """The next beginning of sessions that come at the same time of day on comparable days
    (weekdays, weekends, or one weekday each week); the soonest not yet past; pure."""
    if len(starts) < 2:
        return None
    local = [s + tz_offset_s for s in starts]
    first_day = int(local[0] // DAY_S)
    today = int((now + tz_offset_s) // DAY_S)
    best: Prediction | None = None
    for day in (today, today + 1):
        for days, agree, words in _day_kinds(day, first_day):
            begun = [
                local[bisect_left(local, d * DAY_S) : bisect_left(local, (d + 1) * DAY_S)]
                for d in days
            ]
            candidates = [t - d * DAY_S for d, on in zip(days, begun, strict=True) for t in on]
            per_day = len(candidates) / len(days)
            if not candidates or len(candidates) * _chance(per_day, len(days), agree) >= CHANCE:
                continue
            for tod in candidates:
                matched = [
                    near - d * DAY_S
                    for d in days
                    if (near := _near(local, d * DAY_S + tod, DAY_WINDOW_S)) is not None
                ]
                if len(matched) < agree:
                    continue
                middle = statistics.median(matched)
                at = day * DAY_S + middle - tz_offset_s
                late = max(matched) - middle + DAY_SLACK_S
                if now > at + late or (best is not None and at >= best.at):
                    continue
                shown = round((at + tz_offset_s) / 300) * 300  # "around": 5 minutes
                clock = time.strftime("%H:%M", time.gmtime(shown))
                best = Prediction(
                    at=at,
                    tolerance_s=late,
                    pattern=f"used around {clock} {words}",
                    early_s=middle - min(matched) + DAY_SLACK_S,
                )
    return best


def _near(sorted_times: Sequence[float], target: float, window: float) -> float | None:
    """The time in `sorted_times` nearest to `target`, if within `window`."""
    i = bisect_left(sorted_times, target)
    best = None
    for j in (i - 1, i):
        if not 0 <= j < len(sorted_times) or abs(sorted_times[j] - target) > window:
            continue
        if best is None or abs(sorted_times[j] - target) < abs(best - target):
            best = sorted_times[j]
    return best


def next_arrival(starts: Sequence[float], now: float, tz_offset_s: float) -> Prediction | None:
    """The soonest predicted beginning of a session, by any pattern; None: unpredictable."""
    found = [p for p in (periodic(starts, now), daily(starts, now, tz_offset_s)) if p]
    return min(found, key=lambda p: p.at) if found else None


def lead_s(median_start_s: float | None, early_s: float = 0.0) -> float:
    """How long before a predicted arrival a pre-warm begins: so that it is ready by the
    earliest the arrival has come (`early_s` before it)."""
    start = DEFAULT_START_S if median_start_s is None else median_start_s
    return max(LEAD_MARGIN * start, start + LEAD_SLACK_S) + early_s


def local_offset_s(at: float | None = None) -> float:
    """The box's local time's offset from UTC (for times of day)."""
    return float(time.localtime(at).tm_gmtoff)


class Learned(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy learned about one model, as the deployment page shows it."""

    keep: KeepWarm
    prediction: Prediction | None


class Anticipator:
    """Each model's gaps, and what they say (`learned`, kept until a session begins, its
    idle timeout changes or its prediction passes), for the controller."""

    def __init__(self, tz_offset_s: float | None = None) -> None:
        self.tz_offset_s = local_offset_s() if tz_offset_s is None else tz_offset_s
        self._traffic: dict[str, Traffic] = {}
        # (idle timeout, median start, until, what)
        self._cache: dict[str, tuple[float, float | None, float, Learned]] = {}

    def observe(
        self, deployment_id: str, arrived: float, ended: float, wait_s: float = 0.0
    ) -> None:
        """One recorded request (any outcome: each is demand), which waited `wait_s` of
        its arrival to its end for its model."""
        traffic = self._traffic.get(deployment_id)
        if traffic is None:
            traffic = self._traffic[deployment_id] = Traffic()
        if traffic.observe(arrived, ended, wait_s):
            self._cache.pop(deployment_id, None)

    def adopt(self, deployment_id: str, traffic: Traffic) -> None:
        """A history learned elsewhere (a what-if: the traffic before its window)."""
        self._traffic[deployment_id] = traffic.copy()
        self._cache.pop(deployment_id, None)

    def forget(self, deployment_id: str) -> None:
        """A removed deployment's history."""
        self._traffic.pop(deployment_id, None)
        self._cache.pop(deployment_id, None)

    def has_data(self, deployment_id: str) -> bool:
        """Whether any request of it was recorded."""
        return deployment_id in self._traffic

    def learned(
        self, deployment_id: str, idle_timeout_s: float, now: float, start_s: float | None = None
    ) -> Learned:
        """Its keep-warm and next predicted session, as of `now` (epoch seconds), for a model
        whose median cold start is `start_s` (None: never timed)."""
        cached = self._cache.get(deployment_id)
        if cached is not None and cached[:2] == (idle_timeout_s, start_s) and now < cached[2]:
            return cached[3]
        traffic = self._traffic.get(deployment_id)
        if traffic is None:
            return NO_DATA
        traffic.forget_before(now - HISTORY_S)
        gaps = traffic.idle
        keep = gaps.keep_warm(idle_timeout_s)
        # A session begins after a pause: one it would sleep through, or one of
        # `SESSION_PAUSE_S` (a model kept warm through its pauses, whose next session a
        # busier model's request may evict it before, is predicted all the same).
        kept = idle_timeout_s if keep.seconds is None else keep.seconds
        pause = min(kept, SESSION_PAUSE_S)
        starts = traffic.demand.starts(pause)
        prediction = next_arrival(starts, now, self.tz_offset_s)
        if prediction is not None and prediction.period_s is not None:
            # The sessions themselves still begin after the pauses above: a gap within a
            # session it sleeps through between them does not begin one.
            lead = lead_s(start_s, prediction.early_s)
            keep = gaps.between_sessions(pause, lead, keep)
        learned = Learned(keep=keep, prediction=prediction)
        # Computed again an hour on at the latest (the history moves), or once the
        # prediction has passed.
        until = now + 3600.0
        if prediction is not None:
            until = min(until, prediction.at + prediction.tolerance_s)
        self._cache[deployment_id] = (idle_timeout_s, start_s, until, learned)
        return learned


NO_DATA = Learned(keep=KeepWarm(seconds=None, reason="no traffic recorded yet"), prediction=None)
