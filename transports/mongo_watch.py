"""How an idle consumer of the MongoDB transport waits (:class:`_Watch`): following the
capped signal collection with a tailable cursor on a real server (unverified here, guarded),
polling with growing waits on mongomock or when the cursor fails."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import bson
import pymongo
import pymongo.errors

from ..redaction import redact
from .db_engine import Claim

log = logging.getLogger("idembus.transports.mongo")

#: The first wait of an idle consumer on mongomock, doubled up to ``poll_interval``.
_FIRST_POLL = 0.005
#: How long one wait lasts before the stop flag is looked at again.
_STOP_CHECK = 0.1


class _Watch:
    """How an idle consumer of one queue waits: following the signal collection with a
    tailable cursor on a real server (unverified here, guarded), polling with growing waits
    on mongomock or when the cursor fails."""

    def __init__(self, transport: Any, queue: str) -> None:
        self._transport = transport
        self._queue = queue
        self._poll = _FIRST_POLL
        self._cursor: Any = None
        self._failed = False
        #: Wake-ups of the queue counted when the last wait ended (mongomock's, in this
        #: process).
        wakeups = transport._wakeups
        self._seen = wakeups.count(queue) if wakeups is not None else 0

    def claimed(self, claim: Claim[Any]) -> None:
        """A consumer claimed: if a message came, the next idle wait polls quickly again."""
        if claim.deliveries:
            self._poll = _FIRST_POLL

    def wait(self, seconds: float, stop: threading.Event) -> None:
        if self._transport._signals is not None and not self._failed:
            try:
                self._follow(seconds, stop)
                return
            except pymongo.errors.PyMongoError as exc:
                self._failed = True
                log.warning("idle consumers of %r will poll: following %s failed (%s)",
                            self._queue, self._transport._signals_name, redact(str(exc)))
        wakeups = self._transport._wakeups
        if wakeups is not None:  # mongomock: woken in this process, else poll
            # Wake-ups since the last wait came after what the claim since then saw, or
            # before it (then waking at once only costs a claim): none is missed.
            deadline = time.monotonic() + min(seconds, self._poll)
            while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
                if wakeups.wait(self._queue, self._seen, min(left, _STOP_CHECK)):
                    break
            self._seen = wakeups.count(self._queue)
        else:
            stop.wait(min(seconds, self._poll))
        self._poll = min(self._poll * 2, self._transport.poll_interval)

    def _follow(self, seconds: float, stop: threading.Event) -> None:
        """Wait for a signal of this queue (or ``seconds``, or ``stop``) on a tailable,
        awaiting cursor over the capped signal collection."""
        deadline = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < deadline:
            if self._cursor is None or not self._cursor.alive:
                newest = self._transport._signals.find_one(sort=[("$natural", -1)])
                after = newest["_id"] if newest is not None else bson.ObjectId()
                self._cursor = self._transport._signals.find(
                    {"_id": {"$gt": after}, "queue": self._queue},
                    cursor_type=pymongo.CursorType.TAILABLE_AWAIT,
                ).max_await_time_ms(int(_STOP_CHECK * 1000))
            for _ in self._cursor:
                return

    def close(self) -> None:
        if self._cursor is not None:
            with contextlib.suppress(Exception):
                self._cursor.close()

