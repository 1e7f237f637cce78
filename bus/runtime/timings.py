"""How long an endpoint takes to handle a message, kept as a fixed histogram and reported
with its counters (:mod:`idembus.runtime.status`), so that a reader of the status reports — the
dashboard — can draw handling-time percentiles without OpenTelemetry.

Every endpoint has one :class:`HandlingTimes` in its default middleware
(:func:`idembus.runtime.endpoint.default_middleware`); it watches the endpoint's ``settled``
signal (:mod:`idembus.signals`): the time from the arrival of a delivery until it is
settled, for each delivery whose outcome is ``handled`` (every handler handled it, found it
a duplicate or skipped it). The processor measures that time once, for every observer: the
``idembus.message.handling.duration`` histogram of :mod:`idembus.observability.metrics`
records the same figure. The counts go into the status report under one key per bucket
(:func:`bucket_key`); memory and report size stay the same whatever the traffic.
:func:`percentile` reads a percentile back from bucket counts (added up, or the difference
of two reports).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..pipeline import Middleware

#: Upper bounds of the buckets, in milliseconds; one more bucket holds what is slower.
BOUNDS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000)
#: Status-report key of the bucket above the last bound.
SLOWER = f"handling_ms_gt_{BOUNDS_MS[-1]}"


def bucket_key(index: int) -> str:
    """The status-report key of bucket ``index`` (``len(BOUNDS_MS)``: :data:`SLOWER`)."""
    return SLOWER if index == len(BOUNDS_MS) else f"handling_ms_le_{BOUNDS_MS[index]}"


#: Every bucket's key, fastest first.
KEYS = tuple(bucket_key(index) for index in range(len(BOUNDS_MS) + 1))


class HandlingTimes(Middleware):
    """Counts handled deliveries by how long they took (see the module docstring).

    A middleware only to be set up and closed with its endpoint: it overrides no hook, so
    the pipeline never calls it per message; it observes the ``settled`` signal."""

    def __init__(self) -> None:
        self._counts = [0] * len(KEYS)
        self._lock = threading.Lock()
        #: (signal, receiver) pairs to disconnect on close.
        self._connected: list[tuple[Any, Callable[..., None]]] = []

    def setup(self, endpoint: Any) -> None:
        """Watch the endpoint's ``settled`` signal."""
        signal = endpoint.signals.settled
        signal.connect(self.settled, weak=False)
        self._connected.append((signal, self.settled))

    def close(self) -> None:
        for signal, receiver in self._connected:
            signal.disconnect(receiver)
        self._connected.clear()

    def settled(self, endpoint: str, *, outcome: str | None = None, seconds: float = 0.0,
                **details: Any) -> None:
        """The ``settled`` receiver: count a ``handled`` delivery in its bucket."""
        if outcome == "handled":
            self.record(seconds * 1000)

    def record(self, milliseconds: float) -> None:
        """Count one delivery handled in ``milliseconds``."""
        index = bisect.bisect_left(BOUNDS_MS, milliseconds)
        lock = self._lock
        lock.acquire()  # not a with block: no __enter__ and __exit__ looked up each time
        try:
            self._counts[index] += 1
        finally:
            lock.release()

    def snapshot(self) -> dict[str, int]:
        """The count of every bucket, by its status-report key."""
        with self._lock:
            return dict(zip(KEYS, self._counts, strict=True))


def percentile(counts: Mapping[str, int], fraction: float) -> float | None:
    """The handling time (ms) below which ``fraction`` (0.5, 0.95, ...) of the deliveries
    counted in ``counts`` (bucket key -> count) fall, interpolated linearly inside its
    bucket; ``None`` if nothing was counted. In the last bucket, which has no upper bound,
    it is the last bound: "more than a minute"."""
    values = [max(0, int(counts.get(key, 0))) for key in KEYS]
    total = sum(values)
    if total == 0:
        return None
    rank = fraction * total
    seen = 0
    for index, count in enumerate(values):
        if count and seen + count >= rank:
            if index == len(BOUNDS_MS):
                return float(BOUNDS_MS[-1])
            low = 0 if index == 0 else BOUNDS_MS[index - 1]
            return low + (BOUNDS_MS[index] - low) * max(0.0, rank - seen) / count
        seen += count
    return float(BOUNDS_MS[-1])
