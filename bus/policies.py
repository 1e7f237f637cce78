"""Retry policies: immediate retries of failing handlers, optimistic retries of lost races."""

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
