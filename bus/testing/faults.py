"""Crash points: where tests and the demo make an endpoint "die" without editing code paths.

A fault injector is middleware (``Endpoint(middleware=[RandomCrashes(0.1)])``): its hooks
call ``reached(point, message_id)`` at each point below — before the commit, after a
handler's effects are committed (or found committed), and after every handler's messages
were dispatched, just before the delivery is acknowledged. Put it last in the list, so that
it is the innermost.
A :class:`SimulatedCrash` raised there escapes every ``except Exception``, like a killed
process; the transport then requeues the delivery, which is the redelivery a broker makes
when a consumer dies, and the endpoint goes on as a restarted process would.
"""

from __future__ import annotations

import enum
import random
import threading
from collections import Counter

from ..pipeline import HandlerCall, IncomingMessage, Middleware


class CrashPoint(str, enum.Enum):
    """The moments at which a crash changes what recovery must do (DESIGN §2)."""

    BEFORE_COMMIT = "before_commit"    # the handler ran; nothing is stored
    AFTER_COMMIT = "after_commit"      # state and outgoing are stored; nothing is sent
    AFTER_DISPATCH = "after_dispatch"  # outgoing messages are sent; the incoming is not acked


class SimulatedCrash(BaseException):
    """Stands for the process dying at a crash point. Not an ``Exception`` on purpose."""


class FaultInjector(Middleware):
    """Does nothing by itself: subclass and override :meth:`reached` to inject faults."""

    def reached(self, point: CrashPoint, message_id: str) -> None:
        """Called at every crash point; raise :class:`SimulatedCrash` to crash there."""

    def before_commit(self, call: HandlerCall) -> None:
        self.reached(CrashPoint.BEFORE_COMMIT, call.context.message_id)

    def after_handler(self, call: HandlerCall, error: BaseException | None) -> None:
        if error is None:
            self.reached(CrashPoint.AFTER_COMMIT, call.context.message_id)

    def after_message(self, incoming: IncomingMessage, error: BaseException | None) -> None:
        if error is None and incoming.outcome == "handled" and incoming.message_id:
            self.reached(CrashPoint.AFTER_DISPATCH, incoming.message_id)


class RandomCrashes(FaultInjector):
    """Crash at each point with probability ``rate``, at most ``limit`` times per message
    and point, so that every message eventually gets through. Seeded: runs repeat."""

    def __init__(self, rate: float, *, seed: int = 0, limit: int = 2) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], got {rate}")
        self.rate = rate
        self.limit = limit
        self._random = random.Random(seed)
        self._crashes: Counter[tuple[CrashPoint, str]] = Counter()
        self._lock = threading.Lock()

    def reached(self, point: CrashPoint, message_id: str) -> None:
        with self._lock:
            if self._crashes[point, message_id] >= self.limit:
                return
            if self._random.random() >= self.rate:
                return
            self._crashes[point, message_id] += 1
        raise SimulatedCrash(f"simulated crash {point.value} of {message_id}")

    @property
    def crashes(self) -> int:
        """How many crashes were injected so far."""
        with self._lock:
            return sum(self._crashes.values())
