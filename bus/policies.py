"""Retry policies: immediate retries of failing handlers, optimistic retries of lost races,
and the backoff while a broker or database is unreachable."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pydantic

from bus.errors import MessageError, RoutingError


@dataclass(frozen=True)
class RetryPolicy:
    """Immediate retries of a failing handler before its message goes to the error queue.

    Exceptions of the ``unrecoverable`` types skip the retries: no attempt could fix them.
    """

    immediate_retries: int = 5
    unrecoverable: tuple[type[BaseException], ...] = field(
        default=(MessageError, RoutingError, pydantic.ValidationError)
    )

    def __post_init__(self) -> None:
        if self.immediate_retries < 0:
            raise ValueError(f"immediate_retries cannot be negative, got {self.immediate_retries}")

    def should_retry(self, error: BaseException, attempts: int) -> bool:
        return not isinstance(error, self.unrecoverable) and attempts <= self.immediate_retries


@dataclass(frozen=True)
class ConflictPolicy:
    """How often and how patiently a handler is re-run after losing an optimistic race."""

    attempts: int = 10
    base_delay: float = 0.001
    max_delay: float = 0.05

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"conflict attempts must be at least 1, got {self.attempts}")

    def pause(self, attempt: int) -> None:
        """Full jitter: a random wait below an exponentially growing cap."""
        time.sleep(random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt)))


@dataclass(frozen=True)
class Backoff:
    """Growing waits between attempts to reach infrastructure that is down.

    Outages are not the message's fault: they never use up a message's retries.
    """

    delays: tuple[float, ...] = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0)

    def __post_init__(self) -> None:
        if not self.delays or any(delay < 0 for delay in self.delays):
            raise ValueError(f"backoff delays must be non-negative, got {self.delays}")

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` consecutive failures (the last delay repeats)."""
        return self.delays[min(failures, len(self.delays) - 1)]
