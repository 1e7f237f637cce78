"""Background work in rounds: the base of an endpoint's helper threads (delayed deliveries,
status reports, the outbox relay, the scheduler)."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod

from ..errors import EndpointBlocked
from ..logs import Throttle
from ..policies import Backoff
from ..redaction import redact
from ..storage.base import Lease, OutboxStore
from ..storage.errors import StorageUnavailable
from ..transports.errors import TransportUnavailable
from .health import Health

log = logging.getLogger(__name__)


class Periodic(ABC):
    """A daemon thread doing one round of work at a time until stopped.

    :meth:`round` returns the seconds until the next round. A round that raises is tried
    again after a growing wait (``backoff``): an unreachable broker or database is logged as
    a warning; a refusal only an operator can end (:class:`~idembus.errors.EndpointBlocked`)
    at ERROR and recorded in ``health`` under the thread's name (``idembus status`` shows
    it) until a round succeeds; anything else with its traceback. While the same cause
    repeats, one warning and one ERROR line of it are written every 10 s at most, saying
    how many were held back (:attr:`outage_lines`); an ERROR is never held back by warnings.
    :meth:`wake` starts the next round early.
    """

    def __init__(self, name: str, *, backoff: Backoff | None = None,
                 health: Health | None = None) -> None:
        self.name = name
        self._backoff = backoff or Backoff()
        #: Where this thread says what blocks it (the endpoint's, when it runs one).
        self.health = health or Health()
        #: :meth:`wake_in`: one timer at a time, and the latest moment a round is wanted.
        self._timer: threading.Timer | None = None
        self._wanted_at = 0.0
        self._timer_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: Repeated outage lines: one per cause (and level) every 10 s, with a count.
        self.outage_lines = Throttle(10.0)

    @abstractmethod
    def round(self) -> float:
        """Do one round of work; return how long to wait before the next."""

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Stop after the current round; True if a thread was running."""
        self.request_stop()
        with self._timer_lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        thread, self._thread = self._thread, None
        if thread is None:
            return False
        thread.join(timeout)
        return True

    def request_stop(self) -> None:
        """Ask :meth:`run` to return after its current round (signal handlers may call it)."""
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Start the next round now."""
        self._wake.set()

    def wake_in(self, seconds: float) -> None:
        """Start a round ``seconds`` from now (if none starts before). Calls made while a
        wake is pending share one timer, which fires again for the latest of them."""
        with self._timer_lock:
            self._wanted_at = max(self._wanted_at, time.monotonic() + seconds)
            if self._timer is None and not self._stop.is_set():
                self._start_timer(seconds)

    def _start_timer(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._timer_fired)
        self._timer.daemon = True
        self._timer.start()

    def _timer_fired(self) -> None:
        self.wake()
        with self._timer_lock:
            self._timer = None
            remaining = self._wanted_at - time.monotonic()
            if remaining > 0 and not self._stop.is_set():
                self._start_timer(remaining)

    def run(self) -> None:
        """Do rounds in the calling thread until stopped."""
        failures = 0
        while not self._stop.is_set():
            try:
                wait = self.round()
                failures = 0
                self.health.resolved(self.name)
            except (StorageUnavailable, TransportUnavailable) as outage:
                wait = self._backoff.delay(failures)
                failures += 1
                self._note_outage(outage, wait)
            except Exception:
                wait = self._backoff.delay(failures)
                failures += 1
                log.exception("%s failed; trying again in %.1fs", self.name, wait)
            self._wake.wait(wait)
            self._wake.clear()

    def _note_outage(self, outage: StorageUnavailable | TransportUnavailable,
                     wait: float) -> None:
        """Log ``outage`` (see the class docstring) and record a refusal in ``health``."""
        blocked = isinstance(outage, EndpointBlocked)
        if blocked:
            self.health.problem(self.name, outage)
        level = logging.ERROR if blocked else logging.WARNING
        held = self.outage_lines.allow(f"{logging.getLevelName(level)} {type(outage).__name__}")
        if held is not None:
            log.log(level, "%s: %s; trying again in %.1fs%s", self.name, redact(str(outage)),
                    wait, self.outage_lines.said(held))


class LeasedPeriodic(Periodic):
    """A :class:`Periodic` whose work is done by one process at a time among those sharing
    a storage (the outbox relay, the scheduler): it works while it holds the lease
    ``lease_name``, which :meth:`take_lease` takes or renews for ``lease_ttl`` seconds on
    each round, and gives it up when it stops, so that another process takes over at once.
    """

    def __init__(self, name: str, *, leases: OutboxStore, lease_name: str, lease_ttl: float,
                 backoff: Backoff | None = None, health: Health | None = None) -> None:
        super().__init__(name, backoff=backoff, health=health)
        self._leases = leases
        #: The lease the helpers of this kind compete for.
        self.lease_name = lease_name
        self.lease_ttl = lease_ttl
        #: Who this helper is, in the lease: host, pid and a random part.
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: The lease while held (``None``: another process holds it, or none was taken).
        self.lease: Lease | None = None

    def take_lease(self, now: datetime.datetime) -> Lease | None:
        """Take the lease, or renew it, until ``now + lease_ttl``; ``None`` while another
        owner holds it."""
        self.lease = self._leases.acquire_lease(self.lease_name, self.owner,
                                                ttl=self.lease_ttl, now=now)
        return self.lease

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Stop, and give the lease up so that another process takes over at once."""
        was_running = super().stop(timeout)
        if self.lease is not None:
            try:
                self._leases.release_lease(self.lease)
            except Exception:  # best effort: an unreleased lease expires by itself
                log.debug("releasing the lease %s failed", self.lease_name, exc_info=True)
            self.lease = None
        return was_running
