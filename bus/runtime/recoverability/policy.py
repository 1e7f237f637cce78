"""Recoverability: what an endpoint does when a handler fails or infrastructure is down.

:class:`Recoverability` is the configuration (``Endpoint(recoverability=...)``): the retry
policy of failing handlers, the optimistic retries of lost races, the circuit breaker and the
backoff while the broker or the database is unreachable. :class:`Recovery` applies it for one
endpoint's consumers: it waits out outages (a message keeps its place and its retries),
says why a message waits, and weighs failures in the breaker.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ...errors import BusError, EndpointBlocked, MessageRefused
from ...logs import Throttle, loggable, message_logger
from ...pipeline import handler_option
from ...policies import Backoff, ConflictPolicy, RetryPolicy
from ...redaction import redact
from ...storage.errors import StorageUnavailable
from ..health import Health
from .breaker import BreakerPolicy, CircuitBreaker
from .time_limits import TimeLimits

log = message_logger(__name__)


@dataclass(frozen=True)
class Recoverability:
    """How an endpoint recovers from failures (a handler class may set its own
    ``retry_policy``, which wins over ``retries`` for that handler, and its own
    ``time_limit``, which wins over ``time_limits.default``)."""

    #: Immediate and delayed retries of a failing handler, then the error queue.
    retries: RetryPolicy = field(default_factory=RetryPolicy)
    #: Re-runs of a handler whose commit lost an optimistic race.
    conflicts: ConflictPolicy = field(default_factory=ConflictPolicy)
    #: After how many failed messages in a row consumers pause, and for how long.
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    #: Waits between attempts while the database or broker is unreachable.
    outage_backoff: Backoff = field(default_factory=Backoff)
    #: How long handling methods may run before they are abandoned (default: no limit), and
    #: what happens to their threads (:mod:`.time_limits`).
    time_limits: TimeLimits = field(default_factory=TimeLimits)


class Recovery:
    """Applies one endpoint's :class:`Recoverability`; safe to share between consumers."""

    #: The handler options it reads (:func:`idembus.pipeline.handler_option`).
    handler_options = ("retry_policy",)

    def __init__(self, endpoint: str, settings: Recoverability, *, stopping: threading.Event,
                 health: Health) -> None:
        self.endpoint = endpoint
        self.settings = settings
        self.breaker = CircuitBreaker(settings.breaker)
        self.stopping = stopping
        self.health = health
        #: Repeated outage warnings: one line per cause every 10 s, with a count.
        self._outage_lines = Throttle(10.0)

    def retry_policy(self, handler: object) -> RetryPolicy:
        """The retry policy of ``handler``: its class's own, else the endpoint's."""
        policy: RetryPolicy = handler_option(self, handler, "retry_policy",
                                             self.settings.retries)
        return policy

    def wait_out(self, outage: BusError, waits: int, *, who: str, message_id: str) -> None:
        """Wait before attempt ``waits + 1`` of something an outage stopped, saying why; when
        the endpoint is stopping, raise ``outage`` instead (the broker redelivers the
        message)."""
        if self.stopping.is_set():
            raise outage
        delay = self.settings.outage_backoff.delay(waits)
        self._note(outage, who, message_id, delay)
        self.stopping.wait(delay)

    def recovered(self) -> None:
        """What blocked the endpoint works again."""
        self.health.resolved()

    def _note(self, outage: BusError, who: str, message_id: str, delay: float) -> None:
        """At ERROR, and in ``idembus status``, when only an operator can end the wait (a
        refused login, missing tables); otherwise a throttled warning."""
        message_id = loggable(message_id)
        fields = {"endpoint": self.endpoint, "message_id": message_id, "handler": who}
        if isinstance(outage, EndpointBlocked):
            source = "storage" if isinstance(outage, StorageUnavailable) else "transport"
            self.health.problem(source, outage)
            log.error("%s cannot process %s: %s; trying again in %.1fs", who, message_id,
                      redact(str(outage)), delay, extra=fields)
            return
        held_back = self._outage_lines.allow(type(outage).__name__)
        if held_back is not None:
            log.warning("%s cannot process %s (%s); trying again in %.1fs%s", who,
                        message_id, redact(str(outage)), delay,
                        f" ({held_back} more such line(s) held back in 10s)" if held_back
                        else "", extra=fields)

    def message_failed(self, error: BaseException, policy: RetryPolicy) -> float:
        """Weigh a message that failed for good in the breaker; the pause to take (0: none).
        A message's own fault (unrecoverable, refused) says nothing about the
        dependencies and does not count."""
        if policy.is_unrecoverable(error) or isinstance(error, MessageRefused):
            return 0.0
        pause = self.breaker.failed()
        if pause:
            log.warning("%d messages in a row failed; %s pauses %.1fs before the next",
                        self.breaker.policy.threshold, self.endpoint, pause)
        return pause

    def message_succeeded(self) -> None:
        self.breaker.succeeded()
