"""Counters of what an endpoint did, kept from its signals."""

from __future__ import annotations

import threading
from typing import Any

from ..signals import SIGNAL_NAMES, EndpointSignals


class Counters:
    """Counts every signal of one endpoint; ``snapshot()`` returns the figures."""

    def __init__(self, signals: EndpointSignals) -> None:
        self._counts = dict.fromkeys(SIGNAL_NAMES, 0)
        self._lock = threading.Lock()
        self._receivers = []
        for name in SIGNAL_NAMES:
            receiver = self._counter_for(name)
            self._receivers.append(receiver)  # blinker holds receivers weakly
            getattr(signals, name).connect(receiver)

    def _counter_for(self, name: str) -> Any:
        def count(sender: object, **details: Any) -> None:
            with self._lock:
                self._counts[name] += 1

        return count

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts[name]
