"""One worker process of ``idembus run --workers N``: who it is, its title, its set-up hook.

The supervisor (:mod:`idembus.cli.supervisor`) never builds the endpoint: it does not
import the application's module, so neither the factory nor anything the module does at
import time (an OpenTelemetry exporter opening files or connections, a pool) runs in it,
and it stays a small process that only starts, watches and stops its workers. Each
worker, in this order:

1. runs the ``--on-worker-start package.module:function`` hook, if one is given, with a
   :class:`WorkerProcess` saying which worker it is: the place to configure a per-process
   SDK (OpenTelemetry's tracer and meter providers, a Sentry client) before anything
   builds on it;
2. builds the endpoint (the factory runs here, once per worker process);
3. refuses an endpoint whose transport or storage lives inside one process;
4. sets its process title, ``idembus worker 2/4 orders`` (the second of four workers of
   endpoint ``orders``), shown by ``ps`` and in ``/proc/PID/cmdline``, with
   ``setproctitle`` (``pip install idembus[proctitle]``); and, on Linux, with or without
   it, its short name ``idembus w2/4``, which ``top`` shows (``/proc/PID/comm``);
5. tunes the garbage collector for a long run (:func:`tune_garbage_collector`), unless
   ``--no-gc-tuning`` is given; a plain ``idembus run`` does the same.

A worker restarted after a crash is a new process: the hook runs again in it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from ..logs import WORKER
from ..runtime.loading import import_user_module

#: Environment variables the supervisor gives each worker: its index (from 0) and how many
#: workers there are.
WORKER_INDEX = WORKER
WORKER_COUNT = "IDEMBUS_WORKERS"
#: ``prctl`` option naming the calling thread (the process, for the main thread).
_PR_SET_NAME = 15
#: The youngest generation's collection threshold in a worker (:func:`tune_garbage_collector`).
YOUNGEST_THRESHOLD = 5000


@dataclass(frozen=True)
class WorkerProcess:
    """Which worker this process is: ``index`` from 0 to ``count - 1`` (the ``worker``
    field of the JSON log lines; the process title counts from 1). A plain ``idembus run``
    without ``--workers`` is worker 0 of 1."""

    index: int
    count: int

    @property
    def pid(self) -> int:
        """The process id of this worker."""
        return os.getpid()

    def title(self, endpoint: str) -> str:
        """The process title of this worker of ``endpoint``."""
        return f"idembus worker {self.index + 1}/{self.count} {endpoint}"

    @property
    def name(self) -> str:
        """The short name of this worker's process (``top``, ``/proc/PID/comm``: 15 bytes at
        most): ``idembus w2/4``."""
        return f"idembus w{self.index + 1}/{self.count}"


def current() -> WorkerProcess | None:
    """This process as a worker of ``idembus run --workers`` (``None``: not one)."""
    try:
        return WorkerProcess(int(os.environ[WORKER_INDEX]), int(os.environ[WORKER_COUNT]))
    except (KeyError, ValueError):
        return None


def load_hook(reference: str) -> Callable[[WorkerProcess], Any]:
    """The function ``package.module:function`` names, imported but not called."""
    check_reference(reference, "--on-worker-start")
    module_name, _, attribute = reference.partition(":")
    module = import_user_module(module_name, "--on-worker-start: ")
    hook = getattr(module, attribute, None)
    if not callable(hook):
        raise ConfigurationError(
            f"--on-worker-start: {reference} is not a function of the module")
    return hook  # type: ignore[no-any-return]


def check_reference(reference: str, option: str = "the endpoint") -> None:
    """Refuse a reference that is not ``package.module:attribute`` (a configuration
    error), without importing anything."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(
            f"{option} {reference!r} is not of the form package.module:attribute")


def set_title(title: str, name: str) -> bool:
    """Set this process's title (its command line, with ``setproctitle``) and its short
    ``name`` (Linux's 15 bytes, shown by ``top``); True if either was set. Call it from
    the main thread."""
    try:
        import setproctitle  # optional: idembus[proctitle]
    except ImportError:
        titled = False
    else:
        setproctitle.setproctitle(title)
        titled = True
    return _name_thread(name) or titled


def _name_thread(title: str) -> bool:
    """Name the calling thread (the process, from the main thread, and the threads it
    starts later) ``title``, cut to the 15 bytes Linux keeps; False where ``prctl`` is not
    to be had."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        name = title.encode("utf-8", "replace")[:15]
        return bool(libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def tune_garbage_collector() -> None:
    """Make the cyclic garbage collector cheaper for a long-running worker: collect the
    garbage start-up left, take every object alive now out of the collector's reach
    (:func:`gc.freeze`: the modules, classes and the built endpoint live as long as the
    process, and every full collection walked them all again), and let the youngest
    generation grow to :data:`YOUNGEST_THRESHOLD` container objects between collections
    (Python's 700 made a collection every few messages) unless it was set higher or turned
    off. The collector's CPU in a worker on RabbitMQ + PostgreSQL fell from about 16 to
    about 4 µs a message (of some 200). Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
    youngest, *older = gc.get_threshold()
    if 0 < youngest < YOUNGEST_THRESHOLD:
        gc.set_threshold(YOUNGEST_THRESHOLD, *older)
