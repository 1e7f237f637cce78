"""Throttling password guesses: failed logins counted per client address.

After ``limit`` failed logins from one address within ``window`` seconds, that address is
answered ``429 Too Many Requests`` (with ``Retry-After``) without its credentials being
looked at, until the oldest of those failures is ``window`` seconds old. Other addresses
are not affected; a successful login forgets the address's failures. Only requests that
carry credentials count: a client that sends none is asked for them (401), not throttled.

Behind a reverse proxy every client has the proxy's address: the proxy should then
throttle (or authenticate) itself. The addresses remembered are bounded
(``addresses``; the least recently failing are forgotten first).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoginThrottle:
    """Failed logins per address; see the module docstring."""

    def __init__(self, limit: int = 10, window: float = 60.0, *, addresses: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1 or window <= 0 or addresses < 1:
            raise ValueError("limit and addresses must be at least 1, window positive")
        self.limit = limit
        self.window = window
        self._addresses = addresses
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()
        #: Requests refused because their address had failed too often.
        self.throttled = 0

    def retry_after(self, address: str) -> int | None:
        """Seconds ``address`` must wait before trying again, or ``None`` if it may try
        now (a refusal is counted in :attr:`throttled`)."""
        with self._lock:
            failures = self._failures.get(address)
            if failures is None or len(failures) < self.limit:
                return None
            left = self.window - (self._clock() - failures[0])
            if left <= 0:
                return None
            self.throttled += 1
            return max(1, math.ceil(left))

    def failed(self, address: str) -> None:
        """Note a failed login from ``address``."""
        with self._lock:
            failures = self._failures.pop(address, None) or deque(maxlen=self.limit)
            failures.append(self._clock())
            self._failures[address] = failures  # the most recent last
            while len(self._failures) > self._addresses:
                self._failures.popitem(last=False)
            blocked = len(failures) == self.limit and failures[-1] - failures[0] < self.window
        if blocked:
            log.warning("%d failed logins from %s within %gs: refusing its logins (429) for "
                        "a while", self.limit, address, self.window)

    def succeeded(self, address: str) -> None:
        """Forget ``address``'s failures."""
        with self._lock:
            self._failures.pop(address, None)
