"""Retry policies: immediate retries of failing handlers, optimistic retries of lost races,
and the backoff while a broker or database is unreachable."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pydantic

from .errors import (
    ConfigurationError,
    HandlerContractError,
    IncompatibleState,
    MessageError,
    RoutingError,
)

#: Errors no retry can fix, whatever a policy lists: bad input, no route, a broken contract,
#: a stored state the code cannot read.
ALWAYS_UNRECOVERABLE: tuple[type[BaseException], ...] = (
    MessageError, RoutingError, HandlerContractError, IncompatibleState)


@dataclass(frozen=True)
class RetryPolicy:
    """What happens when a handler raises: ``immediate_retries`` retries at once; then, if
    they all failed, the message comes back after each of the ``delayed`` waits (seconds),
    with its immediate retries each time; then it goes to the error queue.

    Exceptions of the ``unrecoverable`` types skip every retry: no attempt could fix them;
    idembus's own :data:`ALWAYS_UNRECOVERABLE` do so even when a policy lists other types.
    Set on an endpoint (``Endpoint(retry_policy=...)``) or on one handler class
    (``retry_policy = RetryPolicy(...)``).
    """

    immediate_retries: int = 5
    delayed: tuple[float, ...] = (10.0, 20.0, 30.0)
    unrecoverable: tuple[type[BaseException], ...] = field(
        default=(MessageError, RoutingError, HandlerContractError, pydantic.ValidationError)
    )

    def __post_init__(self) -> None:
        if self.immediate_retries < 0:
            raise ValueError(f"immediate_retries cannot be negative, got {self.immediate_retries}")
        if any(delay <= 0 for delay in self.delayed):
            raise ValueError(f"delayed retries must wait a positive time, got {self.delayed}")

    def should_retry(self, error: BaseException, attempts: int) -> bool:
        """Try again at once after ``attempts`` attempts failed with ``error``?"""
        return not self.is_unrecoverable(error) and attempts <= self.immediate_retries

    def delay_after(self, error: BaseException, rounds: int) -> float | None:
        """The wait before delayed round ``rounds + 1``, or ``None``: give up."""
        if self.is_unrecoverable(error) or rounds >= len(self.delayed):
            return None
        return self.delayed[rounds]

    def is_unrecoverable(self, error: BaseException) -> bool:
        """Whether no retry could fix ``error``."""
        return isinstance(error, (*ALWAYS_UNRECOVERABLE, *self.unrecoverable))

    @property
    def longest_path(self) -> float:
        """Seconds from the first attempt to the last, at the least."""
        return float(sum(self.delayed))


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


@dataclass(frozen=True)
class OutboxPolicy:
    """What an endpoint does with the outgoing messages it committed
    (``Endpoint(outbox=OutboxPolicy(...))``; ``outbox=False`` is ``OutboxPolicy(run=False)``).

    ``run``: run the outbox dispatcher (:mod:`idembus.runtime.outbox`) in this endpoint's processes
    (its processes elect one); off when ``idembus dispatcher`` runs it apart.
    ``grace``: seconds committed messages may stay undispatched before the outbox sends them.
    ``defer_fresh_redispatch``: seconds (default 0: never). A duplicate that finds its entry
    committed less than this long ago and not yet marked dispatched does not send the stored
    messages itself: the committer does, or, if it died, the outbox once ``grace`` has
    passed. Fewer copies downstream, slower recovery from a crash; needs ``run``.
    ``compact_after_dispatch``: drop the stored bodies of outgoing messages once the broker
    confirmed them (their ids stay). Turn off if the transport has no publisher confirms and
    you would rather redispatch than risk a message the broker lost.
    """

    run: bool = True
    grace: float = 10.0
    defer_fresh_redispatch: float = 0.0
    compact_after_dispatch: bool = True

    def __post_init__(self) -> None:
        if self.grace < 0:
            raise ConfigurationError(f"outbox grace cannot be negative, got {self.grace!r}")
        if self.defer_fresh_redispatch < 0 or (self.defer_fresh_redispatch and not self.run):
            raise ConfigurationError(
                f"defer_fresh_redispatch={self.defer_fresh_redispatch!r}: give 0 or more "
                "seconds, and keep run=True: the outbox sends what a crashed committer left")

@dataclass(frozen=True)
class Batching:
    """Batched consumption: ``size`` deliveries at most a batch (``None``: the endpoint's
    ``prefetch``), ``linger`` seconds at most waited for more once one is ready (on RabbitMQ
    only when a second delivery came with the first: a delivery alone goes at once).

    ``Batching(size=1)`` is processing one message at a time, through the same path."""

    size: int | None = None
    linger: float = 0.002

    def __post_init__(self) -> None:
        if self.size is not None and (isinstance(self.size, bool) or self.size < 1):
            raise ValueError(f"batch size must be at least 1, got {self.size!r}")
        if not self.linger >= 0:
            raise ValueError(f"batch linger must be a non-negative number of seconds, "
                             f"got {self.linger!r}")

    def size_for(self, prefetch: int) -> int:
        """The batch size an endpoint with ``prefetch`` uses."""
        return self.size if self.size is not None else prefetch


#: What an endpoint batches with unless told otherwise (``Endpoint(batching=None)``: one
#: message at a time).
DEFAULT_BATCHING = Batching()
