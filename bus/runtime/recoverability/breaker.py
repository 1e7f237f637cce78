"""The circuit breaker: when message after message fails, stop taking messages for a while.

Spending every message's retries while a dependency is down only fills the error queue.
After ``threshold`` messages in a row exhausted their immediate retries, each consumer
pauses (with growing waits) after every failing message; one message that succeeds closes
the breaker again. Bad input does not count: it says nothing about the dependencies.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ...policies import Backoff

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BreakerPolicy:
    """After ``threshold`` failed messages in a row, pause by ``backoff``."""

    threshold: int = 10
    backoff: Backoff = Backoff((1.0, 2.0, 5.0, 10.0, 30.0))

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"breaker threshold must be at least 1, got {self.threshold}")


class CircuitBreaker:
    """Counts consecutive failed messages across an endpoint's consumers."""

    def __init__(self, policy: BreakerPolicy) -> None:
        self.policy = policy
        self._failures = 0
        self._lock = threading.Lock()

    def succeeded(self) -> None:
        if not self._failures:  # the common case, on every message: nothing to reset
            return  # (a failure counted meanwhile is as if it came after this success)
        with self._lock:
            if self._failures >= self.policy.threshold:
                log.info("a message succeeded again; the circuit breaker closes")
            self._failures = 0

    def failed(self) -> float:
        """Record a failed message; return how long to pause before the next (0: none)."""
        with self._lock:
            self._failures += 1
            over = self._failures - self.policy.threshold
        if over < 0:
            return 0.0
        return self.policy.backoff.delay(over)

    @property
    def open(self) -> bool:
        with self._lock:
            return self._failures >= self.policy.threshold
