"""An hour of per-minute figures, built by sampling the endpoints' status reports.

Status reports hold each process's counters since it started (and its handling-time
buckets, :mod:`idembus.runtime.timings`). The dashboard reads them every few seconds
(:class:`Sampler`): what an instance's counters grew by since the previous read is added to
the minute of this read (:class:`History`). Sixty minutes are kept per endpoint, the oldest
dropped as a new one begins, so memory stays the same however long the dashboard runs, and
nothing is written to the storage.

An instance seen for the first time counts from zero if it started after the dashboard
did (everything it did is new), and from what it reported otherwise (what it did before
the dashboard started belongs to no minute the dashboard saw). A counter that went down
(it cannot, within one process) counts as starting again from zero.
"""

from __future__ import annotations

import datetime
import threading
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..runtime.timings import KEYS, percentile
from ..storage.base import StatusReport

#: Minutes of history kept per endpoint.
MINUTES = 60

#: The counters the overview draws, with their titles.
CHARTED = (("received", "Received"), ("handled", "Handled"), ("duplicate", "Duplicates"),
           ("redispatched", "Redispatched"), ("failed", "Failed"),
           ("dead_lettered", "Dead-lettered"))

#: Percentiles of handling time drawn, as (fraction, label).
PERCENTILES = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))

_KEPT = frozenset(name for name, _ in CHARTED) | frozenset(KEYS)


def minute_of(moment: datetime.datetime) -> datetime.datetime:
    """The start of the minute ``moment`` falls in."""
    return moment.replace(second=0, microsecond=0)


@dataclass
class _Minute:
    start: datetime.datetime
    counts: Counter[str] = field(default_factory=Counter)


class History:
    """The last :data:`MINUTES` minutes of one endpoint's figures. Thread-safe."""

    def __init__(self) -> None:
        self._minutes: deque[_Minute] = deque(maxlen=MINUTES)
        self._lock = threading.Lock()

    def add(self, moment: datetime.datetime, amounts: Mapping[str, int]) -> None:
        """Add ``amounts`` (counter -> how much it grew) to the minute of ``moment``."""
        start = minute_of(moment)
        with self._lock:
            if not self._minutes or self._minutes[-1].start < start:
                self._minutes.append(_Minute(start))
            # (a clock that went back adds to the newest minute)
            self._minutes[-1].counts.update({key: value for key, value in amounts.items()
                                  if key in _KEPT and value > 0})

    def minutes(self, now: datetime.datetime) -> list[datetime.datetime]:
        """The starts of the last :data:`MINUTES` minutes up to ``now``'s, oldest first."""
        last = minute_of(now)
        return [last - datetime.timedelta(minutes=MINUTES - 1 - i) for i in range(MINUTES)]

    def series(self, name: str, now: datetime.datetime) -> list[int]:
        """Counter ``name`` per minute over the hour up to ``now`` (0 for a minute without
        data), oldest first."""
        counts = self._counts_by_minute()
        return [counts[start].get(name, 0) if start in counts else 0
                for start in self.minutes(now)]

    def percentiles(self, fraction: float, now: datetime.datetime) -> list[float | None]:
        """The handling time (ms) at ``fraction`` per minute (``None``: nothing handled)."""
        counts = self._counts_by_minute()
        return [percentile(counts[start], fraction) if start in counts else None
                for start in self.minutes(now)]

    def total(self, name: str, now: datetime.datetime) -> int:
        return sum(self.series(name, now))

    def __len__(self) -> int:
        with self._lock:
            return len(self._minutes)

    def _counts_by_minute(self) -> dict[datetime.datetime, Counter[str]]:
        with self._lock:
            return {minute.start: Counter(minute.counts) for minute in self._minutes}


class Sampler:
    """Turns successive reads of one endpoint's status reports into :class:`History`.

    ``since``: when the dashboard started (instances that started later count from 0)."""

    def __init__(self, since: datetime.datetime) -> None:
        self.history = History()
        self._since = since
        self._seen: dict[str, Mapping[str, int]] = {}
        #: The reports of the latest read, for the overview's table of instances.
        self.latest: Sequence[StatusReport] = ()
        self._lock = threading.Lock()

    def sample(self, reports: Iterable[StatusReport], now: datetime.datetime) -> None:
        """Add what each instance did since the previous read to the minute of ``now``."""
        reports = list(reports)
        grown: Counter[str] = Counter()
        with self._lock:
            for report in reports:
                before = self._seen.get(report.instance)
                if before is None:
                    before = {} if report.started_at >= self._since else report.counters
                for key in _KEPT:
                    now_count = int(report.counters.get(key, 0))
                    was = int(before.get(key, 0))
                    grown[key] += now_count - was if now_count >= was else now_count
                self._seen[report.instance] = dict(report.counters)
            present = {report.instance for report in reports}
            for gone in set(self._seen) - present:  # forgotten reports: keep memory flat
                del self._seen[gone]
            self.latest = tuple(reports)
        self.history.add(now, grown)
