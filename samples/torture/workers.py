"""The three ``idembus run ... --workers N`` supervisors of a torture run.

Each supervisor's output (its own log and its workers', which inherit it) goes to a log
file through a :class:`~samples.torture.logwatch.LogWatch`. Workers are the supervisor's
child processes, listed from ``/proc`` (Linux).
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import samples
from samples.ordering.deployment import ENDPOINTS, Deployment
from samples.torture.logwatch import LogWatch

log = logging.getLogger(__name__)

#: The directory that holds the ``samples`` package (and the library's packages).
ROOT = pathlib.Path(samples.__file__).resolve().parent.parent
#: Seconds a worker may take to finish its messages after SIGTERM.
SHUTDOWN_TIMEOUT = 20.0


@dataclass
class SupervisorProcess:
    """One ``idembus run`` supervisor and its log."""

    endpoint: str
    queue: str
    process: subprocess.Popen[str]
    log: LogWatch

    def worker_pids(self) -> list[int]:
        """Process ids of the supervisor's children, its workers."""
        pid = self.process.pid
        try:
            text = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text()
        except FileNotFoundError:
            return []
        return [int(child) for child in text.split()]

    @property
    def workers_started(self) -> int:
        """Workers that reported their consumers running, since the supervisor started."""
        return self.log.count(f"endpoint {self.queue} started:")


class Supervisors:
    """Starts, watches and stops one supervisor per endpoint of ``deployment``."""

    def __init__(self, deployment: Deployment, *, workers: int, log_dir: pathlib.Path) -> None:
        self.deployment = deployment
        self.workers = workers
        self.log_dir = log_dir
        self.running: list[SupervisorProcess] = []

    def start(self) -> None:
        """Start ``idembus run samples.ordering.deployment:<endpoint> --workers N`` for
        each endpoint."""
        environment = {**os.environ, **self.deployment.environment(),
                       "PYTHONPATH": os.pathsep.join(
                           filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        for endpoint in ENDPOINTS:
            process = subprocess.Popen(
                [sys.executable, "-m", "idembus", "run",
                 f"samples.ordering.deployment:{endpoint}", "--workers", str(self.workers),
                 "--log-level", "INFO", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)],
                cwd=ROOT, env=environment, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )
            assert process.stdout is not None
            watch = LogWatch(process.stdout, self.log_dir / f"{endpoint}.log")
            self.running.append(SupervisorProcess(endpoint, self.deployment.queue(endpoint),
                                                  process, watch))
            log.info("supervisor of %s started: pid %d", endpoint, process.pid)

    def wait_started(self, timeout: float) -> bool:
        """Wait until every worker of every supervisor has started consuming."""
        deadline = time.monotonic() + timeout
        for supervisor in self.running:
            remaining = max(0.0, deadline - time.monotonic())
            if not supervisor.log.wait_for(f"endpoint {supervisor.queue} started:",
                                           count=self.workers, timeout=remaining):
                return False
        return True

    def worker_pids(self) -> list[int]:
        """Every worker's process id."""
        return [pid for supervisor in self.running for pid in supervisor.worker_pids()]

    def shortfall(self) -> list[str]:
        """Running supervisors that lack workers (killed ones not replaced), in words."""
        return [f"the supervisor of {s.endpoint} runs {len(s.worker_pids())} of "
                f"{self.workers} workers"
                for s in self.running
                if s.process.poll() is None and len(s.worker_pids()) != self.workers]

    def stop(self) -> dict[str, int]:
        """SIGTERM every supervisor (they stop their workers gracefully); their exit
        statuses by endpoint. A supervisor that does not exit in time is killed."""
        for supervisor in self.running:
            if supervisor.process.poll() is None:
                supervisor.process.send_signal(signal.SIGTERM)
        statuses = {}
        for supervisor in self.running:
            try:
                statuses[supervisor.endpoint] = supervisor.process.wait(SHUTDOWN_TIMEOUT + 30)
            except subprocess.TimeoutExpired:
                log.error("supervisor of %s did not stop; killing it and its workers",
                          supervisor.endpoint)
                statuses[supervisor.endpoint] = self._kill(supervisor)
            supervisor.log.join()
        self.running = []
        return statuses

    @staticmethod
    def _kill(supervisor: SupervisorProcess) -> int:
        for pid in supervisor.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        supervisor.process.kill()
        return supervisor.process.wait()
