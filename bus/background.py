"""Background work in rounds: the base of an endpoint's helper threads (delayed deliveries,
status reports, the outbox dispatcher)."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod

from .errors import EndpointBlocked
from .health import Health
from .logs import Throttle
from .policies import Backoff
from .redaction import redact
from .storage.errors import StorageUnavailable
from .transports.errors import TransportUnavailable

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
