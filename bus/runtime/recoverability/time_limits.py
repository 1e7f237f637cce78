"""Handler time limits: a handler that runs past its limit is abandoned, and nothing it did
is committed.

A handler's limit is its class's ``time_limit`` (seconds), else the endpoint's
``Recoverability(time_limits=TimeLimits(default=...))``; ``None`` (the default): no limit,
and the handling method runs on the consumer thread as ever.

A limited handling method runs on a **handler thread** that belongs to its consumer thread
(started on first use), while the consumer thread waits for it, up to the limit:

* A plain ``def`` still running at its limit is **abandoned**: the consumer raises
  :class:`~idembus.errors.TimeLimitExceeded` at once, so nothing the method did is committed
  (the state it changed is a copy, what it sent a list that is dropped) and the message goes
  through the retry policy like any failure, to the error queue in the end. Python cannot
  stop a thread from outside: the handler thread is left running as a daemon, what it
  returns is ignored, what it sends through ``self.bus`` from then on raises
  :class:`~idembus.errors.TimeLimitExceeded` in it, and the consumer thread starts a new
  handler thread for its next message.
* An ``async def`` is **cancelled** at its limit (``asyncio.CancelledError`` at the
  ``await`` where it waits: its ``finally`` blocks and ``async with`` exits run) and fails
  the same way; its handler thread is kept. One that is still running ``grace`` seconds
  after its cancellation (it swallowed the cancellation, or blocks its event loop with
  synchronous work) is abandoned as a plain ``def`` is.
* **Stuck threads**: abandoned handler threads that are still running. When there are more
  than ``max_stuck_threads`` in the process's endpoint, the endpoint asks to be
  **recycled**: it stops as on SIGTERM (no new message, those in progress finish; an
  abandoned message is settled already) and ``idembus run`` exits with status
  :data:`EXIT_RECYCLE`, which the ``--workers`` supervisor answers by starting a new worker
  at once (a service manager restarting on failure does the same for a lone process).
  Embedded, :meth:`Endpoint.run <idembus.Endpoint.run>` returns and
  ``endpoint.recycle_requested`` says why.
* **Hang reports**: every handling method running for ``report_after`` seconds or more
  (with a limit or without), and every abandoned one still running, is a line of the
  process's problems in its status reports, which ``idembus status`` and the dashboard show
  while it lasts: ``handling test.Deposit 9f3c... for 42 s (limit 30 s)``.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ...errors import ConfigurationError, TimeLimitExceeded
from ...logs import loggable
from ...pipeline import handler_option
from ..aio import close_thread_loop

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Exit status of ``idembus run`` for a process that asks to be recycled (too many handler
#: threads stuck past their time limits).
EXIT_RECYCLE = 3
#: The problem source under which a recycle request is shown.
RECYCLE_SOURCE = "time limits"


@dataclass(frozen=True)
class TimeLimits:
    """The time limits of an endpoint's handlers (``Recoverability(time_limits=...)``).

    ``default``: seconds a handling method may run, for handlers whose class sets no
    ``time_limit``; ``None``: no limit. ``grace``: seconds a cancelled ``async def`` method
    gets to end before it is abandoned as a thread. ``max_stuck_threads``: abandoned handler
    threads still running that the process tolerates; one more and it asks to be recycled
    (``None``: never). ``report_after``: seconds after which a running handling method is
    shown by ``idembus status`` and the dashboard.
    """

    default: float | None = None
    grace: float = 2.0
    max_stuck_threads: int | None = 8
    report_after: float = 10.0

    def __post_init__(self) -> None:
        check_seconds(self.default, "TimeLimits(default=...)", optional=True)
        if not _is_number(self.grace) or self.grace < 0:
            raise ConfigurationError(
                f"TimeLimits(grace=...) must be 0 or more seconds, got {self.grace!r}")
        if not _is_number(self.report_after) or self.report_after < 0:
            raise ConfigurationError(
                f"TimeLimits(report_after=...) must be 0 or more seconds, "
                f"got {self.report_after!r}")
        stuck = self.max_stuck_threads
        if stuck is not None and (isinstance(stuck, bool) or not isinstance(stuck, int)
                                  or stuck < 0):
            raise ConfigurationError(
                f"TimeLimits(max_stuck_threads=...) must be a whole number, 0 or more, or "
                f"None (never recycle), got {stuck!r}")


def check_seconds(value: object, where: str, *, optional: bool = False) -> None:
    """Refuse a time limit that is not a positive, finite number of seconds."""
    if optional and value is None:
        return
    if not _is_number(value) or not 0 < value < math.inf:  # type: ignore[operator]
        raise ConfigurationError(
            f"{where} must be a positive number of seconds{' or None' if optional else ''}, "
            f"got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(eq=False)
class Running:
    """One handling method running now (or abandoned and still running)."""

    handler: str
    message_type: str
    message_id: str
    limit: float | None
    started: float = field(default_factory=time.monotonic)
    #: When it was abandoned (``time.monotonic()``), if it was.
    abandoned: float | None = None

    def describe(self, now: float) -> str:
        """``handling <type> <id> for 42 s (limit 30 s)``, and whether it was abandoned."""
        limit = f"limit {self.limit:g} s" if self.limit is not None else "no time limit"
        text = (f"handling {loggable(self.message_type, 100)} {loggable(self.message_id, 40)} "
                f"for {now - self.started:.0f} s ({limit})")
        if self.abandoned is not None:
            text += ("; abandoned at its limit, its thread still runs (result ignored, the "
                     "message retried per policy)")
        return text


class _Call:
    """A function handed to a handler thread, and what came of it."""

    def __init__(self, function: Callable[[], Any], running: Running,
                 on_late: Callable[[_Call], None]) -> None:
        self.function = function
        self.running = running
        self.context = contextvars.copy_context()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._on_late = on_late
        self._settled = threading.Lock()
        self._finished = False
        self.abandoned = False

    def run(self) -> None:
        try:
            self.result = self.context.run(self.function)
        except BaseException as error:  # handed to the consumer thread
            self.error = error
        finally:
            with self._settled:
                self._finished = True
                late = self.abandoned
            self.done.set()
        if late:
            self._on_late(self)

    def abandon(self) -> bool:
        """Give up waiting: True, unless it finished meanwhile (then its result counts)."""
        with self._settled:
            if self._finished:
                return False
            self.abandoned = True
            return True


class _HandlerThread:
    """A daemon thread running the calls of one consumer thread, one at a time; it ends
    after a call that was abandoned."""

    _numbers = itertools.count(1)

    def __init__(self, endpoint: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.abandoned = False
        self.thread = threading.Thread(
            target=self._serve, name=f"idembus-{endpoint}-handler-{next(self._numbers)}",
            daemon=True)
        self.thread.start()

    def submit(self, call: _Call) -> None:
        self._calls.put(call)

    def close(self) -> None:
        """End the thread once its current call (if any) returns."""
        self._calls.put(None)

    def _serve(self) -> None:
        try:
            while True:
                call = self._calls.get()
                if call is None:
                    return
                call.run()
                if call.abandoned:
                    return
        finally:
            close_thread_loop()  # its event loop, if async handlers made one


class _Owned:
    """The handler thread of one consumer thread; closed with it (thread-local storage is
    released when its thread ends)."""

    def __init__(self, thread: _HandlerThread) -> None:
        self.thread = thread
        weakref.finalize(self, thread.close)


class TimeLimiter:
    """Runs an endpoint's handling methods within their time limits, and knows which are
    running (see the module docstring); safe to share between consumer threads."""

    #: The handler options it reads (:func:`idembus.pipeline.handler_option`).
    handler_options = ("time_limit",)

    def __init__(self, endpoint: str, policy: TimeLimits, handlers: Iterable[object], *,
                 stopping: threading.Event) -> None:
        self.endpoint = endpoint
        self.policy = policy
        self._stopping = stopping
        #: Why the process should be recycled, once it should.
        self._recycle: str | None = None
        #: The time limit of each handler class (``policy.default`` for any other).
        self.limits: dict[type, float | None] = {}
        for handler in handlers:
            limit = handler_option(self, handler, "time_limit", policy.default)
            check_seconds(limit, f"{type(handler).__qualname__}.time_limit", optional=True)
            self.limits[type(handler)] = limit
        #: The handling methods running now, by the ``id()`` of their handler object or
        #: :class:`Running`: a :class:`Running`, or for a method without limit (watched at
        #: the least cost) ``(handler name, its MessageContext, time.monotonic() at start)``.
        #: Single dict operations, atomic: no lock.
        self.running: dict[int, Running | tuple[str, Any, float]] = {}
        self._local = threading.local()

    @property
    def recycle_requested(self) -> bool:
        """Whether too many handler threads were stuck: the process should be recycled."""
        return self._recycle is not None

    def limit(self, handler: object) -> float | None:
        """The time limit of ``handler`` (a handler of the endpoint, or a copy of one)."""
        return self.limits.get(type(handler), self.policy.default)

    @property
    def stuck(self) -> int:
        """Abandoned handler threads still running."""
        return sum(1 for running in list(self.running.values())
                   if isinstance(running, Running) and running.abandoned)

    def run(self, running: Running, function: Callable[[], T], *, patience: float) -> T:
        """``function()`` on the calling thread's handler thread, watched as ``running``,
        waited for ``patience`` seconds at most before it is abandoned with
        :class:`TimeLimitExceeded`."""
        key = id(running)
        self.running[key] = running
        call = _Call(function, running, self._returned)
        handler_thread = self._handler_thread()
        handler_thread.submit(call)
        if call.done.wait(patience) or not call.abandon():
            del self.running[key]
            if call.error is not None:
                raise call.error
            result: T = call.result
            return result
        self._abandon(handler_thread, running)
        raise _exceeded(running, cancelled=False)

    def hung(self) -> dict[str, str]:
        """The status lines of the handling methods running for ``report_after`` seconds
        or more, and of those abandoned and still running, by a name of their own."""
        now = time.monotonic()
        every = [running if isinstance(running, Running) else Running(
                     running[0], running[1].message_type, running[1].message_id, None,
                     started=running[2]) for running in list(self.running.values())]
        shown = [running for running in every if running.abandoned is not None
                 or now - running.started >= self.policy.report_after]
        shown.sort(key=lambda running: running.started)
        lines = {f"handler {running.handler} #{index}": running.describe(now)
                 for index, running in enumerate(shown, 1)}
        if self._recycle is not None:
            lines[RECYCLE_SOURCE] = self._recycle
        return lines

    def _handler_thread(self) -> _HandlerThread:
        owned: _Owned | None = getattr(self._local, "owned", None)
        if owned is None or owned.thread.abandoned:
            owned = self._local.owned = _Owned(_HandlerThread(self.endpoint))
        return owned.thread

    def _abandon(self, handler_thread: _HandlerThread, running: Running) -> None:
        handler_thread.abandoned = True
        running.abandoned = time.monotonic()
        self._local.owned = None
        stuck = self.stuck
        log.warning("%s ran past its time limit of %g s on %s %s: abandoned (its thread %s "
                    "keeps running, its result will be ignored); %d handler thread(s) stuck. "
                    "Where it is now:\n%s", running.handler, running.limit,
                    loggable(running.message_type), loggable(running.message_id),
                    handler_thread.thread.name, stuck, _where(handler_thread.thread),
                    extra={"endpoint": self.endpoint, "handler": running.handler})
        most = self.policy.max_stuck_threads
        if most is not None and stuck > most and self._recycle is None:
            self._recycle = (f"{stuck} handler threads are stuck past their time limits (at "
                             f"most {most}): this process stops to be recycled")
            log.error("endpoint %s: %s", self.endpoint, self._recycle,
                      extra={"endpoint": self.endpoint})
            self._stopping.set()

    def _returned(self, call: _Call) -> None:
        """An abandoned call returned at last (in its handler thread, which then ends)."""
        running = call.running
        self.running.pop(id(running), None)
        outcome = "raised " + repr(call.error) if call.error is not None else "returned"
        log.warning("%s %s after %.0f s on %s %s, abandoned at its time limit: ignored",
                    running.handler, loggable(outcome, 200), time.monotonic() - running.started,
                    loggable(running.message_type), loggable(running.message_id),
                    extra={"endpoint": self.endpoint, "handler": running.handler})


async def cancelled_after(coroutine: Coroutine[Any, Any, T], seconds: float,
                          running: Running) -> T:
    """Await ``coroutine`` in a task of its own, cancelled after ``seconds``; then raise
    :class:`TimeLimitExceeded` (once it has ended: its ``finally`` blocks run)."""
    task = asyncio.ensure_future(coroutine)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except BaseException:
        task.cancel()
        raise
    if done:
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception as error:  # what it raised while unwinding: kept as the cause
        raise _exceeded(running, cancelled=True) from error
    raise _exceeded(running, cancelled=True)


def _where(thread: threading.Thread) -> str:
    """The stack of ``thread`` now, innermost call last (what a hung handler waits in)."""
    frame = sys._current_frames().get(thread.ident or 0)
    if frame is None:
        return "(it has just returned)"
    stack = traceback.extract_stack(frame)
    ours = (threading.__file__, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    start = 0  # the frames of the thread's start and of idembus before the handler's
    while start < len(stack) - 1 and stack[start].filename.startswith(ours):
        start += 1
    return "".join(traceback.format_list(stack[start:])).rstrip()


def _exceeded(running: Running, *, cancelled: bool) -> TimeLimitExceeded:
    what = "cancelled" if cancelled else "abandoned"
    return TimeLimitExceeded(
        f"{running.handler} ran past its time limit of {running.limit:g} s on "
        f"{running.message_type} {running.message_id}; it was {what} and nothing it did is "
        "committed")
