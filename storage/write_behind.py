"""Writes that may wait: collected from any thread, applied in batches by one thread.

Waiting for them is bounded: a write that blocks (a database without a statement timeout)
must not wedge the process that waits for it, least of all at exit. What was not written
in time is logged at ERROR with its count.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Default seconds :meth:`Batcher.flush` waits for the writes.
FLUSH_TIMEOUT = 30.0
#: Default seconds :meth:`Batcher.close` waits for the last writes (at exit, usually).
CLOSE_TIMEOUT = 5.0


class Batcher(Generic[T]):
    """Collects items and hands them to ``write`` in batches, from a background thread,
    at most ``interval`` seconds after they arrived (sooner once ``size`` are waiting).

    A batch whose write fails is logged and dropped: use this only for writes that are an
    optimisation, whose loss is harmless.
    """

    def __init__(self, write: Callable[[list[T]], None], *, name: str,
                 interval: float = 0.05, size: int = 500) -> None:
        self._write = write
        self._name = name
        self._interval = interval
        self._size = size
        self._pending: list[T] = []
        #: The lock of ``_changed``, taken directly where nothing waits on the condition
        #: (a ``with`` on a Condition runs two Python calls around the lock's own).
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._writing = 0
        #: Items in the batch being written.
        self._in_write = 0
        self._urgent = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, item: T) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if len(self._pending) >= self._size:
                self._changed.notify_all()

    def flush(self, timeout: float | None = FLUSH_TIMEOUT) -> bool:
        """Return once everything added so far was written (or dropped after a failure):
        True; False if that took longer than ``timeout`` seconds (logged at ERROR, with
        how many items are still unwritten)."""
        with self._changed:
            self._urgent = True
            self._changed.notify_all()
            if self._changed.wait_for(lambda: not self._pending and not self._writing,
                                      timeout):
                return True
            unwritten = self._unwritten()
        log.error("%s: %d item(s) not written after waiting %.1fs for them (a write is "
                  "blocked)", self._name, unwritten, timeout)
        return False

    def close(self, timeout: float | None = CLOSE_TIMEOUT) -> bool:
        """Write what is pending, then stop the thread; True if that was done within
        ``timeout`` seconds. Otherwise the items still unwritten are given up (logged at
        ERROR with their count) and the thread, blocked in a write, is left behind (it is a
        daemon). Idempotent."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if not thread.is_alive():
            return True
        with self._changed:
            unwritten = self._unwritten()
        log.error("%s: %d item(s) not written: a write still blocked after %.1fs at close; "
                  "giving them up", self._name, unwritten, timeout)
        return False

    def _unwritten(self) -> int:
        """Items pending or being written (call with the lock held)."""
        return len(self._pending) + self._in_write

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda: self._closed or self._urgent or len(self._pending) >= self._size,
                    self._interval)
                batch, self._pending = self._pending, []
                self._urgent = False
                self._writing += 1
                self._in_write = len(batch)
                closed = self._closed
            try:
                if batch:
                    self._write(batch)
            except Exception:
                log.warning("%s dropped a batch of %d after a failed write", self._name,
                            len(batch), exc_info=True)
            finally:
                with self._changed:
                    self._writing -= 1
                    self._in_write = 0
                    self._changed.notify_all()
            if closed:
                return
