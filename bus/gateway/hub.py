"""Following the event journal and fanning new entries out to connected clients.

One :class:`JournalHub` per gateway polls the storage's journal, in a thread of its own,
after the last position it saw, and offers each new entry to every live
:class:`Subscription`, at most ``batch`` entries every ``interval`` seconds (the gateway
takes half a client buffer per round, so a client that is reading keeps up with up to
``batch / interval`` events a second). Each round's entries are encoded once
(:mod:`idembus.gateway.encoded`) and the same bytes go to every subscription.

A subscription's buffer is bounded: the hub never waits for a client. When a buffer is full
the subscription is marked overflowed and closed (its buffer dropped): the client's stream
ends, the client has everything up to the last event it received and resumes from there
with ``Last-Event-ID``; nothing is dropped silently.

Subscriptions are read from the gateway's event loop: the hub only appends under a lock and
calls the subscription's ``wake`` (which hands a wake-up to that loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from ..policies import Backoff
from ..runtime.background import Periodic
from ..storage.base import JournalStore
from .encoded import Batch, EventCache

log = logging.getLogger(__name__)


class Subscription:
    """One client's buffer of live journal entries, in the batches the hub read them."""

    def __init__(self, capacity: int, wake: Callable[[], None]) -> None:
        self._capacity = capacity
        self._wake = wake
        self._batches: deque[Batch] = deque()
        self._pending = 0
        self._lock = threading.Lock()
        #: True once the buffer was full and the subscription closed because of it.
        self.overflowed = False
        #: True once the subscription is closed, for whatever reason.
        self.closed = False

    def offer(self, batch: Batch) -> bool:
        """Buffer ``batch``; False (and the subscription closed, its buffer dropped) if it
        did not fit."""
        with self._lock:
            if self.closed:
                return False
            if self._pending + len(batch) > self._capacity:
                self.overflowed = True
                self._close()
            else:
                self._batches.append(batch)
                self._pending += len(batch)
        self._wake()
        return not self.overflowed

    def take(self) -> list[Batch]:
        """Every buffered batch (empty once closed)."""
        with self._lock:
            taken = list(self._batches)
            self._batches.clear()
            self._pending = 0
            return taken

    def close(self) -> None:
        """Stop buffering and wake the reader."""
        with self._lock:
            self._close()
        self._wake()

    def _close(self) -> None:
        self.closed = True
        self._batches.clear()
        self._pending = 0


class JournalHub(Periodic):
    """Polls the journal and offers new entries to every subscription."""

    def __init__(self, storage: JournalStore, *, interval: float = 0.05, batch: int = 500,
                 backoff: Backoff | None = None, cache: EventCache | None = None) -> None:
        super().__init__("idembus-gateway-hub", backoff=backoff)
        self._storage = storage
        self._interval = interval
        self._batch = batch
        #: Where entries are encoded, once each (shared with the streams catching up).
        self.cache = cache or EventCache()
        self._lock = threading.Lock()
        self._advanced = threading.Condition(self._lock)
        self._subscriptions: set[Subscription] = set()
        self._stopped = False
        #: The newest position offered to subscribers.
        self.position = 0
        #: Subscriptions closed because their buffer was full.
        self.overflows = 0
        #: When the journal was last read successfully (``time.monotonic()``; 0: never).
        self.last_read = 0.0
        #: The type of error the last read of the journal failed with (``None``: it did not).
        self.failure: str | None = None

    def start(self) -> None:
        self.position = self._storage.journal_bounds().newest
        self.last_read = time.monotonic()
        with self._lock:
            self._stopped = False
        super().start()

    def round(self) -> float:
        try:
            entries = self._storage.read_journal(after=self.position, limit=self._batch)
        except Exception as error:
            self.failure = type(error).__name__
            raise  # logged, and tried again after a backoff, by Periodic
        self.failure = None
        self.last_read = time.monotonic()
        if entries:
            # Encoded outside the lock, and only if someone listens (a subscription that
            # comes meanwhile gets them encoded below).
            batch = self.cache.batch(entries) if self._subscriptions else None
            with self._lock:
                if self._subscriptions and batch is None:
                    batch = self.cache.batch(entries)
                for subscription in list(self._subscriptions):
                    assert batch is not None
                    if not subscription.offer(batch):
                        self._drop(subscription)
                self.position = entries[-1].position
                self._advanced.notify_all()
        # Always pause between rounds, even with more waiting: back-to-back rounds would fill
        # the buffer of a client that is reading but had no turn to run yet.
        return self._interval

    def wait_for_position(self, position: int, timeout: float) -> bool:
        """Wait until entries up to ``position`` were offered; False after ``timeout``."""
        with self._advanced:
            return self._advanced.wait_for(lambda: self.position >= position, timeout)

    def subscribe(self, capacity: int,
                  wake: Callable[[], None]) -> tuple[Subscription, int]:
        """A new subscription, and the position after which it will get every entry (closed
        at once if the hub has stopped)."""
        subscription = Subscription(capacity, wake)
        with self._lock:
            if self._stopped:
                subscription.close()
            else:
                self._subscriptions.add(subscription)
            return subscription, self.position

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscriptions.discard(subscription)

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)

    def _drop(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)
        if subscription.overflowed:
            self.overflows += 1
            log.info("a client's buffer of live events is full; disconnected it (it resumes "
                     "with Last-Event-ID)")

    def stop(self, timeout: float | None = 30.0) -> bool:
        was_running = super().stop(timeout)
        with self._lock:
            self._stopped = True
            subscriptions, self._subscriptions = self._subscriptions, set()
        for subscription in subscriptions:
            subscription.close()
        return was_running
