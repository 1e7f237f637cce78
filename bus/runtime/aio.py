"""Running ``async def`` handlers: one event loop per consumer thread.

Each consumer thread runs its messages one at a time, and an ``async def`` handling method
is one of the steps of that thread's work: :func:`run_to_completion` runs it on the calling
thread's own event loop, created the first time the thread needs one and reused for every
later message of that thread, and returns when the method has returned. The commit that
follows, the dispatch and the acknowledgement are the ones a plain ``def`` gets. The
endpoint ends a consumer thread's loop with :func:`close_thread_loop` when the thread ends.

Why a loop per consumer thread, not one loop for the process (as Dramatiq's ``AsyncIO``
middleware has, in a thread of its own): the method runs in the thread that took the
message, with no hand-over to another thread and back, so an async handler costs about what
a sync one does; a handler that blocks its loop by mistake holds up its own consumer only;
``concurrency=`` still says how many messages are handled at once; and there is no extra
thread to start, watch and stop.

A handler with a time limit is the exception: its method runs on the handler thread of its
consumer thread, and on that thread's loop (:mod:`idembus.runtime.recoverability.time_limits`).

The method's task starts eagerly (where the default event loop policy is in force): its
first step runs at once, in the call, with the loop as the running loop and the task as the
current task, instead of in a loop iteration; a method that never waits is done without
the loop turning at all (one asyncio task, a few microseconds), and one that waits runs the
loop until it is done. On Python 3.12+ this is the task's own eager start; before, the
first step the new task schedules is taken and run at once (:class:`_ConsumerLoop`).
The price: loop-bound resources exist once per consumer thread (four consumer threads,
four client pools), and handlers cannot share them across threads (below).

What it asks of handlers
------------------------
* Every consumer thread has its own loop: never share a loop-bound object (an
  ``asyncio.Lock``, an ``httpx.AsyncClient``, an aiohttp session, an asyncpg pool) between
  consumer threads, for example in an attribute set by the handler's ``__init__`` — the
  handler object is shared by every consumer thread. Create such objects per loop, with
  :class:`LoopLocal`::

      clients = LoopLocal(httpx.AsyncClient, close=lambda client: client.aclose())

      class Payments(Handler):
          @handles
          async def charge(self, message: Charge) -> None:
              await clients.get().post(...)   # this consumer thread's client

  ``close`` runs on the loop when idembus closes it.
* Await everything the method starts. A task left running advances only while a later
  method of the same thread waits on the loop, is cancelled when the loop is closed, and
  what it records through ``self.bus`` after the method returned is never committed.
* A thread that is already running an event loop cannot run a second one, and blocking
  its loop while waiting for itself would deadlock: an ``async def`` method called from
  such a thread (a synchronous ``idembus.testing.handle`` inside an async test,
  ``endpoint.process`` inside an async web route) runs in a helper thread instead, on a loop
  of its own that is closed afterwards, while the calling thread waits (and its loop with
  it; ``idembus.testing.handle_async`` does not hold the loop up).

The loops are kept in one module-level ``threading.local`` (no loop, thread or descriptor
is created at import): a loop belongs to the thread that runs it, and the invoker has no
per-endpoint object in reach of the handler call. A thread that ends without
:func:`close_thread_loop` has its loop closed when the thread's storage is released.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

Closer = Callable[[], Awaitable[object]]


@dataclass(eq=False)
class _ThreadLoop:
    """The loop one thread owns, and what must run on it before it closes."""

    loop: asyncio.AbstractEventLoop
    closers: list[Closer] = field(default_factory=list)
    #: Closes the loop once: from :func:`close_thread_loop`, or when this object is freed.
    closed: weakref.finalize = field(init=False)  # type: ignore[type-arg]

    def __post_init__(self) -> None:
        self.closed = weakref.finalize(self, self.loop.close)


#: ``owned``: this thread's :class:`_ThreadLoop`, if it has one.
_threads = threading.local()


def run_to_completion(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` until it returns, on the calling thread's loop, and return its
    result (or raise what it raised). In a thread whose loop is already running, it runs in
    a helper thread on a loop of its own instead (see the module docstring)."""
    if asyncio.events._get_running_loop() is not None:
        return _in_helper_thread(coroutine)
    try:
        loop = _thread_loop().loop
        if isinstance(loop, _ConsumerLoop):  # its first step runs in there
            task, turn = loop.start_eagerly(coroutine), False
        else:
            task, turn = loop.create_task(coroutine), True
    except BaseException:
        coroutine.close()  # if it never started, closing it keeps "never awaited" away
        raise
    if turn:
        # A stop() before run_forever() makes it run exactly one iteration (documented):
        # all a method that never waits needs.
        loop.stop()
        loop.run_forever()
    if not task.done():  # it waits for something: run the loop, blocking, until it is done
        return loop.run_until_complete(task)
    return task.result()


def close_thread_loop() -> None:
    """Close the calling thread's loop, if it has one: run the ``close`` of its
    :class:`LoopLocal` values, cancel the tasks still pending, finish async generators and
    the default executor, then close it. The next :func:`run_to_completion` of the thread
    creates a new loop. Call it from the thread itself, outside any handler."""
    owned: _ThreadLoop | None = getattr(_threads, "owned", None)
    if owned is None:
        return
    if owned.loop.is_running():
        raise RuntimeError("close_thread_loop() was called on the loop it would close; "
                           "call it when the thread's work is done")
    _threads.owned = None
    try:
        _wind_down(owned)
    finally:
        owned.closed()


@contextlib.contextmanager
def closing_thread_loop() -> Iterator[None]:
    """Within the block, handlers run on the thread's loop as usual; a loop created in the
    block is closed when it ends (a loop the thread had before is kept)."""
    before = getattr(_threads, "owned", None)
    try:
        yield
    finally:
        if getattr(_threads, "owned", None) is not before:
            close_thread_loop()


class LoopLocal(Generic[T]):
    """One value per event loop, created on first use in a loop: how handlers keep
    loop-bound resources (clients, pools, locks) when every consumer thread has its own
    loop. ``close``, if given, runs on the loop when idembus closes that loop (a loop idembus
    does not own keeps its values until it is garbage; closing them is its owner's job)."""

    def __init__(self, factory: Callable[[], T], *,
                 close: Callable[[T], Awaitable[object]] | None = None) -> None:
        self._factory = factory
        self._close = close
        self._values: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    def get(self) -> T:
        """The running loop's value (created now if it has none). Call it in a coroutine."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if loop in self._values:
                return self._values[loop]
        value = self._factory()  # on the loop's own thread: never created twice for a loop
        with self._lock:
            self._values[loop] = value
        owned: _ThreadLoop | None = getattr(_threads, "owned", None)
        close = self._close
        if close is not None and owned is not None and owned.loop is loop:
            owned.closers.append(lambda: close(value))
        return value


def _thread_loop() -> _ThreadLoop:
    """The calling thread's loop, created on first use (or after it was closed)."""
    owned: _ThreadLoop | None = getattr(_threads, "owned", None)
    if owned is None or owned.loop.is_closed():
        owned = _ThreadLoop(_new_loop())
        _threads.owned = owned
    return owned


def _new_loop() -> asyncio.AbstractEventLoop:
    """A :class:`_ConsumerLoop` where the default event loop policy would make a selector
    loop; otherwise the loop the installed policy makes (uvloop's, say), run the plain
    way."""
    if sys.platform != "win32" and type(
            asyncio.get_event_loop_policy()) is asyncio.DefaultEventLoopPolicy:
        return _ConsumerLoop()
    return asyncio.new_event_loop()


#: A callback as ``call_soon`` takes it: the function, its arguments, its context.
_Step = tuple[Callable[..., object], tuple[Any, ...], contextvars.Context | None]


class _ConsumerLoop(asyncio.SelectorEventLoop):
    """The event loop of a consumer thread, which starts a handler's task eagerly.

    :meth:`start_eagerly` runs the task's first step at once, in the calling thread,
    instead of running a loop iteration for it: a method that never waits is done when the
    call returns, one that waits has started, and its caller runs the loop until it is done.
    That is what ``asyncio.eager_task_factory`` does on a running loop (Python 3.12+), and
    what is done here on Python 3.12+; before, the task is created as ``create_task`` does
    and the first step it asks ``call_soon`` for is taken and run at once (an iteration
    would run it next, after polling for I/O). Either way, during that step the loop is the
    running loop and says it is running, the task is the current task, and the loop's async
    generator hooks are installed, as in ``run_forever``.
    """

    def __init__(self) -> None:
        #: While start_eagerly creates a task: the first step it asks call_soon for.
        self._first_steps: list[_Step] | None = None
        self._stepping = False
        super().__init__()
        hooks = sys.get_asyncgen_hooks()
        #: What run_forever installs as the thread's async generator hooks.
        self._asyncgen_hooks = (getattr(self, "_asyncgen_firstiter_hook", hooks.firstiter),
                                getattr(self, "_asyncgen_finalizer_hook", hooks.finalizer))

    def is_running(self) -> bool:
        return self._stepping or super().is_running()

    def call_soon(self, callback: Callable[..., object], *args: Any,  # type: ignore[override]
                  context: contextvars.Context | None = None) -> asyncio.Handle:
        steps = self._first_steps
        if steps is None or steps:
            return super().call_soon(callback, *args, context=context)
        steps.append((callback, args, context))  # run by start_eagerly, not scheduled
        return asyncio.Handle(callback, args, self, context)

    def start_eagerly(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task running ``coroutine``, whose first step has run (see the class)."""
        if sys.version_info >= (3, 12) and self.get_task_factory() is None:
            return self._as_running(asyncio.Task, coroutine, loop=self, eager_start=True)
        steps: list[_Step] = []
        self._first_steps = steps
        try:
            task = self.create_task(coroutine)
        finally:
            self._first_steps = None
        if steps:
            ((step, args, context),) = steps
            if context is None:
                self._as_running(step, *args)
            else:
                self._as_running(context.run, step, *args)
        else:  # a task factory that did not ask for a step: one iteration runs what it did
            self.stop()
            self.run_forever()
        return task

    def _as_running(self, call: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)`` with this loop running, as far as the code it runs can
        tell."""
        hooks = sys.get_asyncgen_hooks()
        self._stepping = True
        asyncio.events._set_running_loop(self)
        sys.set_asyncgen_hooks(*self._asyncgen_hooks)
        try:
            return call(*args, **kwargs)
        finally:
            sys.set_asyncgen_hooks(*hooks)
            asyncio.events._set_running_loop(None)
            self._stepping = False


def _in_helper_thread(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on a new loop in a new thread, with the caller's context
    variables, close that loop, and return (or raise) what the coroutine did."""

    def run() -> T:
        try:
            return run_to_completion(coroutine)
        finally:
            close_thread_loop()

    context = contextvars.copy_context()
    with concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="idembus-async-handler") as helper:
        try:
            running = helper.submit(context.run, run)
        except BaseException:  # no thread to be had (the interpreter is shutting down)
            coroutine.close()
            raise
        return running.result()


def _wind_down(owned: _ThreadLoop) -> None:
    """Everything :func:`close_thread_loop` does before closing the loop itself; a failing
    step is logged and the next one still runs."""
    loop = owned.loop
    for closer in owned.closers:
        _run_logged(loop, closer, "closing a loop-local value")
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        results = loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        for task, result in zip(pending, results, strict=True):
            if isinstance(result, Exception):
                log.warning("a task left running by an async handler failed: %r (%s)",
                            result, task.get_name())
    _run_logged(loop, loop.shutdown_asyncgens, "finishing async generators")
    _run_logged(loop, loop.shutdown_default_executor, "shutting down the default executor")


def _run_logged(loop: asyncio.AbstractEventLoop, step: Closer, what: str) -> None:
    try:
        loop.run_until_complete(step())
    except Exception:
        log.exception("closing a consumer thread's event loop: %s failed", what)
