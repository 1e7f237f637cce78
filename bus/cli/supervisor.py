"""Worker processes of one endpoint: ``idembus run package.module:endpoint --workers N``.

The supervisor starts N ``idembus run`` processes of the same endpoint, which compete for
its queue, and restarts any that dies (with backoff when they keep dying). SIGTERM or
SIGINT is passed on to every worker; each stops taking messages, finishes the ones in
flight and exits. Workers that are still busy after the shutdown timeout are killed; their
unacknowledged messages are redelivered by the broker and deduplicated as usual.

An observer (``--metrics-port``: :class:`~idembus.observability.metrics_group.GroupMetricsServer`)
is told when each worker starts and exits, and adds to its environment.
A worker that exits with status 3 (:data:`EXIT_RECYCLE`) asked to be recycled: more of its
handler threads were stuck past their time limits than it tolerates
(:mod:`idembus.runtime.recoverability.time_limits`). It is started again at once, without the
backoff of a worker that keeps dying.

Exit status: 0 after a clean stop; 1 if a worker had to be killed; 2 if a worker reports a
configuration error (restarting would not help).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..policies import Backoff
from ..runtime.recoverability.time_limits import EXIT_RECYCLE
from ..runtime.shutdown import POLL_INTERVAL, StopSignals
from .worker import WORKER_COUNT, WORKER_INDEX

log = logging.getLogger(__name__)

#: Exit status of ``idembus run`` for a configuration error.
EXIT_CONFIGURATION = 2
#: Environment variable telling a worker which process supervises it.
SUPERVISOR_PID = "IDEMBUS_SUPERVISOR_PID"
#: A worker that lived this long before dying is restarted without delay.
_HEALTHY_AFTER = 30.0
#: What a worker runs (``python -c``): ``python -m idembus``, except that the working
#: directory Python put first on ``sys.path`` goes before ``idembus`` is imported.
WORKER_BOOTSTRAP = (
    "import sys\n"
    "if sys.path and sys.path[0] == '' and not getattr(sys.flags, 'safe_path', False):\n"
    "    del sys.path[0]\n"
    "from idembus.cli.commands import main\n"
    "sys.exit(main())\n"
)


class WorkerObserver(Protocol):
    """What a supervisor tells about its workers, by index (from 0)."""

    def starting(self, index: int) -> Mapping[str, str]:
        """Worker ``index`` is about to start: environment variables to add to its own."""

    def started(self, index: int, pid: int) -> None:
        """Worker ``index`` runs as process ``pid``."""

    def exited(self, index: int) -> None:
        """Worker ``index`` has exited (it is restarted, as a new process, unless the
        supervisor stops)."""


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_deaths: int = 0
    #: When to (re)start it; ``None`` while it runs. 0: at once.
    restart_at: float | None = 0.0


class Supervisor:
    """Runs and watches ``workers`` processes of the endpoint named by ``reference``."""

    def __init__(
        self,
        reference: str,
        *,
        workers: int,
        worker_arguments: Sequence[str] = (),
        shutdown_timeout: float = 30.0,
        restart_backoff: Backoff | None = None,
        observer: WorkerObserver | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.reference = reference
        self.shutdown_timeout = shutdown_timeout
        self._arguments = list(worker_arguments)
        self._backoff = restart_backoff or Backoff((0.5, 1.0, 2.0, 5.0, 10.0))
        self._workers = [_Worker(index) for index in range(workers)]
        self._stopping = threading.Event()
        self._observer = observer

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT; return the exit status (see module docstring)."""
        with StopSignals() as signals:  # kept through _stop_all: a second signal only notes
            return self._supervise(signals)

    def _supervise(self, signals: StopSignals) -> int:
        while not self._stopping.is_set() and signals.received is None:
            now = time.monotonic()
            for worker in self._workers:
                if worker.process is None:
                    if worker.restart_at is not None and now >= worker.restart_at:
                        self._spawn(worker)
                    continue
                status = worker.process.poll()
                if status is None:
                    continue
                if status == EXIT_CONFIGURATION:
                    log.error("worker %d reported a configuration error; stopping", worker.index)
                    self._stop_all()
                    return EXIT_CONFIGURATION
                self._schedule_restart(worker, status, now)
            self._stopping.wait(POLL_INTERVAL)
        return self._stop_all()

    def stop(self) -> None:
        """Ask ``run`` to stop the workers and return (as SIGTERM does)."""
        self._stopping.set()

    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers."""
        return [w.process.pid for w in self._workers if w.process and w.process.poll() is None]

    def worker_command(self) -> list[str]:
        """The command line of one worker: ``idembus run`` of the endpoint, in this
        interpreter, with the working directory off the front of ``sys.path`` before
        anything is imported, on every Python version (``-P`` exists from 3.11 on only):
        no module of the user's stands in for a library (the loader adds it last)."""
        return [sys.executable, "-c", WORKER_BOOTSTRAP, "run", self.reference,
                *self._arguments]

    def _spawn(self, worker: _Worker) -> None:
        command = self.worker_command()
        environment = {**os.environ, WORKER_INDEX: str(worker.index),
                       WORKER_COUNT: str(len(self._workers)), SUPERVISOR_PID: str(os.getpid())}
        if self._observer is not None:
            environment.update(self._observer.starting(worker.index))
        worker.process = subprocess.Popen(command, env=environment)
        if self._observer is not None:
            self._observer.started(worker.index, worker.process.pid)
        worker.started_at = time.monotonic()
        worker.restart_at = None
        log.info("worker %d started: pid %d", worker.index, worker.process.pid)

    def _schedule_restart(self, worker: _Worker, status: int, now: float) -> None:
        assert worker.process is not None
        lived = now - worker.started_at
        if status == EXIT_RECYCLE:  # it stopped on purpose, its messages settled: at once
            log.warning("worker %d (pid %d) asked to be recycled after %.1fs (handler threads "
                        "stuck past their time limits); starting a new one", worker.index,
                        worker.process.pid, lived)
            worker.process = None
            worker.restart_at = now
            return
        worker.quick_deaths = 0 if lived >= _HEALTHY_AFTER else worker.quick_deaths + 1
        delay = 0.0 if worker.quick_deaths == 0 else self._backoff.delay(worker.quick_deaths - 1)
        log.warning("worker %d (pid %d) exited with status %s after %.1fs; restarting in %.1fs",
                    worker.index, worker.process.pid, status, lived, delay)
        worker.process = None
        worker.restart_at = now + delay
        if self._observer is not None:
            self._observer.exited(worker.index)

    def _stop_all(self) -> int:
        running = [w.process for w in self._workers if w.process and w.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout
        killed = False
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not stop within %.0fs; killing it",
                          process.pid, self.shutdown_timeout)
                process.kill()
                process.wait()
                killed = True
        # A worker still starting up when SIGTERM came dies of it: it held no message.
        clean = (0, -signal.SIGTERM)
        return 1 if killed or any(p.returncode not in clean for p in running) else 0


def stop_when_orphaned(request_stop: Callable[[], None], *, interval: float = 1.0) -> None:
    """In a worker: call ``request_stop`` once its supervisor is gone (killed with SIGKILL,
    say), so that no worker keeps consuming without anyone to stop it. No-op elsewhere."""
    supervisor = os.environ.get(SUPERVISOR_PID)
    if not supervisor:
        return

    def watch() -> None:
        while os.getppid() == int(supervisor):
            time.sleep(interval)
        log.warning("supervisor %s is gone; stopping this worker", supervisor)
        request_stop()

    threading.Thread(target=watch, name="idembus-orphan-watch", daemon=True).start()
