"""How the idle consumers of one queue wait for the PostgreSQL transport's notifications.

One :class:`Listener` per transport and queue holds the only ``LISTEN`` connection, in a
thread of its own, for every consumer thread of that queue in the process. A notification
(a message came, one was given back) wakes *one* idle consumer, not all of them: each one
woken would claim, and all but one would find nothing — a herd that cost more the more
consumer threads an endpoint had. A consumer that claimed a full batch passes a wake-up on
(:meth:`Listener.pass_on`), since more may be waiting.

While the listening connection is down, consumers still wake at their next due time and
every ``max_idle_wait`` seconds; once it is back, every idle consumer is woken to look,
since notifications sent meanwhile were lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from ..errors import BusError
from .database import Reconnects

if TYPE_CHECKING:
    from .db_engine import Claim

log = logging.getLogger(__name__)

#: How long one wait lasts before a stop flag is looked at again.
STOP_CHECK = 0.1


class Listener:
    """Listens on ``channel`` for the consumers of ``queue`` (see the module docstring);
    ``connect(role)`` opens a connection or raises a bus error (an outage, a refusal)."""

    def __init__(self, queue: str, channel: str, *,
                 connect: Callable[[str], psycopg.Connection[Any]],
                 reconnects: Reconnects) -> None:
        self.queue = queue
        self._channel = channel
        self._connect = connect
        self._reconnects = reconnects
        self._wakeups = threading.Condition()
        self._tokens = 0
        self._members = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self) -> None:
        """A consumer begins to wait here (the thread starts with the first one)."""
        with self._wakeups:
            self._members += 1
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"idembus-listen-{self.queue}")
                self._thread.start()

    def leave(self) -> None:
        """A consumer stopped (the thread ends with the last one)."""
        with self._wakeups:
            self._members -= 1
            if self._members > 0 or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._stop.set()
        thread.join(timeout=5)

    def close(self) -> None:
        """End the thread whoever still waits (the transport closes)."""
        with self._wakeups:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None:
            thread.join(timeout=5)

    def wait(self, seconds: float, stop: threading.Event) -> None:
        """Wait until woken, ``seconds`` passed, or ``stop`` is set."""
        deadline = time.monotonic() + seconds
        with self._wakeups:
            while self._tokens == 0:
                left = deadline - time.monotonic()
                if left <= 0 or stop.is_set():
                    return
                self._wakeups.wait(min(left, STOP_CHECK))
            self._tokens -= 1

    def claimed(self, claim: Claim[Any]) -> None:
        """A consumer claimed ``claim``: if it was full, more may be waiting, and another
        idle consumer looks (:meth:`pass_on`)."""
        if claim.again:
            self.pass_on()

    def pass_on(self) -> None:
        """Wake one more idle consumer (more messages may be waiting)."""
        self._wake(1)

    def _wake(self, count: int) -> None:
        with self._wakeups:
            self._tokens = min(self._tokens + count, max(self._members, 1))
            self._wakeups.notify(count)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                connection = self._connect("listen")
            except BusError as exc:  # consumers meanwhile look every max_idle_wait
                failures = self._reconnects.pause(self.queue, exc, failures, self._stop)
                continue
            try:
                connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                failures = 0
                self._wake(self._members)  # what was sent while nobody listened
                while not self._stop.is_set():
                    for _ in connection.notifies(timeout=STOP_CHECK):
                        self._wake(1)
            except psycopg.Error as exc:
                failures = self._reconnects.pause(self.queue, exc, failures, self._stop)
            finally:
                try:
                    connection.close()
                except Exception:  # a broken connection may fail to close; nothing to do
                    log.debug("closing the listening connection failed", exc_info=True)
