"""Following the event journal and fanning new entries out to connected clients.

One :class:`JournalHub` per gateway polls the storage's journal after the last position it
saw and offers each new entry to every live :class:`Subscription`, at most ``batch`` entries
every ``interval`` seconds (the gateway takes half a client buffer per round, so a client
that is reading keeps up with up to ``batch / interval`` events a second).

A subscription's buffer is bounded: the hub never waits for a client. When a buffer is full
the subscription is marked overflowed and closed (its connection is shut down): the client
has everything up to the last event it received and resumes from there with
``Last-Event-ID``; nothing is dropped silently.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from ..background import Periodic
from ..policies import Backoff
from ..storage.base import JournalEntry, Storage

log = logging.getLogger(__name__)


class Subscription:
    """One client's buffer of live journal entries."""

    def __init__(self, capacity: int, on_close: Callable[[], None]) -> None:
        self._entries: queue.Queue[JournalEntry | None] = queue.Queue(capacity)
        self._on_close = on_close
        #: Set when the buffer was full and the subscription closed because of it.
        self.overflowed = threading.Event()
        #: Set when the subscription is closed, for whatever reason.
        self.closed = threading.Event()

    def offer(self, entries: Sequence[JournalEntry]) -> bool:
        """Buffer ``entries``; False (and the subscription closed) if they did not fit."""
        if self.closed.is_set():
            return False
        for entry in entries:
            try:
                self._entries.put_nowait(entry)
            except queue.Full:
                self.overflowed.set()
                self.close()
                return False
        return True

    def take(self, timeout: float) -> list[JournalEntry]:
        """Every buffered entry, waiting up to ``timeout`` seconds for the first; empty after
        the timeout or once closed."""
        if self.closed.is_set():
            return []
        try:
            first = self._entries.get(timeout=timeout)
        except queue.Empty:
            return []
        taken = []
        while first is not None:
            taken.append(first)
            try:
                first = self._entries.get_nowait()
            except queue.Empty:
                break
        return taken

    def close(self) -> None:
        """Stop buffering; wake the reader; shut the client's connection down."""
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            self._entries.put_nowait(None)  # wakes a reader waiting in take()
        except queue.Full:
            pass
        self._on_close()


class JournalHub(Periodic):
    """Polls the journal and offers new entries to every subscription."""

    def __init__(self, storage: Storage, *, interval: float = 0.05, batch: int = 500,
                 backoff: Backoff | None = None) -> None:
        super().__init__("idembus-gateway-hub", backoff=backoff)
        self._storage = storage
        self._interval = interval
        self._batch = batch
        self._lock = threading.Lock()
        self._advanced = threading.Condition(self._lock)
        self._subscriptions: set[Subscription] = set()
        #: The newest position offered to subscribers.
        self.position = 0
        #: Subscriptions closed because their buffer was full.
        self.overflows = 0

    def start(self) -> None:
        self.position = self._storage.journal_bounds().newest
        super().start()

    def round(self) -> float:
        entries = self._storage.read_journal(after=self.position, limit=self._batch)
        if entries:
            with self._lock:
                for subscription in list(self._subscriptions):
                    if not subscription.offer(entries):
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

    def subscribe(self, capacity: int, on_close: Callable[[], None]) -> tuple[Subscription, int]:
        """A new subscription, and the position after which it will get every entry."""
        subscription = Subscription(capacity, on_close)
        with self._lock:
            self._subscriptions.add(subscription)
            return subscription, self.position

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscriptions.discard(subscription)

    def _drop(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)
        if subscription.overflowed.is_set():
            self.overflows += 1
            log.info("a client's buffer of live events is full; disconnected it (it resumes "
                     "with Last-Event-ID)")

    def stop(self, timeout: float | None = 30.0) -> bool:
        was_running = super().stop(timeout)
        with self._lock:
            subscriptions, self._subscriptions = self._subscriptions, set()
        for subscription in subscriptions:
            subscription.close()
        return was_running
