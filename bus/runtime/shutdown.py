"""SIGINT and SIGTERM as a flag, so that shutdown can never hang in a signal handler.

Python runs signal handlers in the main thread between two bytecodes, possibly while that
thread holds a lock: a handler that takes a lock — ``threading.Event.set()``, logging, a
queue — can wait on itself forever (SIGINT and SIGTERM sent together hung ``idembus run``
6 times in 20). The handlers here only assign an attribute; the main thread notices within
a short wait and does the stopping itself, outside any handler.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any

#: Longest a main thread waits before looking at the flag again (seconds).
POLL_INTERVAL = 0.1


class StopSignals:
    """While entered (in the main thread), SIGINT and SIGTERM set :attr:`received`; the
    previous handlers come back on exit. Elsewhere than the main thread it does nothing."""

    def __init__(self) -> None:
        #: The first stop signal received, if any.
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Nothing else: no lock, no logging, no I/O (see the module docstring).
        if self.received is None:
            self.received = signum

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def wait(self, stop: threading.Event | None = None) -> None:
        """Block until a stop signal arrives or ``stop`` (if given) is set."""
        if stop is None:
            stop = threading.Event()
        while self.received is None and not stop.is_set():
            stop.wait(POLL_INTERVAL)


class Deadline:
    """What is left of a time budget shared by several waits (``None``: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        self._end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        """Seconds left (never negative), or ``None`` without a limit."""
        return None if self._end is None else max(0.0, self._end - time.monotonic())
