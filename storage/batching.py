"""Writes that may wait: collected from any thread, applied in batches by one thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        self._changed = threading.Condition()
        self._writing = 0
        self._urgent = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, item: T) -> None:
        with self._changed:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if len(self._pending) >= self._size:
                self._changed.notify_all()

    def flush(self) -> None:
        """Return once everything added so far was written (or dropped after a failure)."""
        with self._changed:
            self._urgent = True
            self._changed.notify_all()
            self._changed.wait_for(lambda: not self._pending and not self._writing)

    def close(self) -> None:
        """Write what is pending, then stop the thread. Idempotent."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda: self._closed or self._urgent or len(self._pending) >= self._size,
                    self._interval)
                batch, self._pending = self._pending, []
                self._urgent = False
                self._writing += 1
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
                    self._changed.notify_all()
            if closed:
                return
