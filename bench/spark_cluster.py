"""A Spark standalone cluster on this machine, on 127.0.0.1: for the replay benchmark and
the cluster test.

One master and ``workers`` workers, each a JVM started with the pyspark package's own
``bin/spark-class`` (``org.apache.spark.deploy.master.Master``,
``org.apache.spark.deploy.worker.Worker``) as a process group of its own, on free ports,
with ``SPARK_LOCAL_IP=127.0.0.1``, its log and its work directory under one directory.
Each worker offers ``cores`` cores and ``memory`` of memory; the master's REST submission
server is off (it would take the fixed port 6066). :meth:`StandaloneCluster.stop` stops
every daemon with SIGTERM and kills what is left of each group, executors included;
the context manager does it whatever happened inside.

An application's executors are JVMs (``CoarseGrainedExecutorBackend``) the workers start as
their children; :meth:`StandaloneCluster.executors` finds them, for a test to kill one.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from bench.pg_procs import Workers, descendants

#: The environment a daemon or a driver on this machine needs to stay on loopback.
LOOPBACK = {"SPARK_LOCAL_IP": "127.0.0.1"}
#: The main class of an executor JVM.
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
#: Properties every daemon reads (``--properties-file``).
_PROPERTIES = "spark.master.rest.enabled false\n"


def spark_class() -> Path:
    """``bin/spark-class`` of the installed pyspark package."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "bin" / "spark-class"


def free_port() -> int:
    """A TCP port nothing listens on at this moment, on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Daemon:
    """One master or worker JVM and the log line that says it is ready."""

    name: str
    group: Workers
    ready_line: str

    @property
    def log(self) -> Path:
        return self.group.log

    def ready(self) -> bool:
        try:
            return self.ready_line in self.log.read_text(errors="replace")
        except OSError:
            return False


class StandaloneCluster:
    """A master and ``workers`` workers on 127.0.0.1; ``with StandaloneCluster(...) as
    cluster:`` starts them and waits until every worker is registered."""

    def __init__(self, directory: Path, *, workers: int = 2, cores: int = 1,
                 memory: str = "1g", start_timeout: float = 180.0) -> None:
        if workers < 1:
            raise ValueError(f"a cluster needs at least one worker, got {workers}")
        self.directory = directory
        self.worker_count = workers
        self.cores = cores
        self.memory = memory
        self.start_timeout = start_timeout
        self.port = free_port()
        self.daemons: list[Daemon] = []

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def workers(self) -> list[Daemon]:
        return [daemon for daemon in self.daemons if daemon.name != "master"]

    def start(self) -> StandaloneCluster:
        """Start the master, then the workers; return once each is up and registered."""
        self.directory.mkdir(parents=True, exist_ok=True)
        properties = self.directory / "spark-daemons.conf"
        properties.write_text(_PROPERTIES)
        deadline = time.monotonic() + self.start_timeout
        try:
            self._launch("master", "org.apache.spark.deploy.master.Master", properties,
                         ["--host", "127.0.0.1", "--port", str(self.port),
                          "--webui-port", str(free_port())],
                         "I have been elected leader")
            self._wait(self.daemons[:1], deadline)
            for index in range(self.worker_count):
                work = self.directory / f"worker-{index}"
                work.mkdir(exist_ok=True)
                self._launch(f"worker-{index}", "org.apache.spark.deploy.worker.Worker",
                             properties,
                             [self.master_url, "--host", "127.0.0.1", "--port", "0",
                              "--webui-port", str(free_port()), "--cores", str(self.cores),
                              "--memory", self.memory, "--work-dir", str(work)],
                             "Successfully registered with master")
            self._wait(self.workers, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, name: str, main_class: str, properties: Path, arguments: list[str],
                ready_line: str) -> None:
        environment = {**os.environ, **LOOPBACK}
        command = [str(spark_class()), main_class, *arguments,
                   "--properties-file", str(properties)]
        group = Workers(command, environment=environment, log=self.directory / f"{name}.log",
                        cwd=self.directory, stop_timeout=10.0)
        self.daemons.append(Daemon(name, group, ready_line))

    def _wait(self, daemons: list[Daemon], deadline: float) -> None:
        """Poll the daemons' logs (another process's state: nothing to join) until each
        says it is ready; fail with the log of one that died or never got there."""
        waiting = list(daemons)
        while waiting:
            for daemon in list(waiting):
                if daemon.ready():
                    waiting.remove(daemon)
                elif not daemon.group.alive():
                    raise RuntimeError(f"Spark {daemon.name} exited while starting:\n"
                                       f"{daemon.group.log_tail()}")
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"Spark {waiting[0].name} was not ready in "
                                   f"{self.start_timeout:.0f}s:\n{waiting[0].group.log_tail()}")
            if waiting:
                time.sleep(0.1)

    def executors(self, worker: int | None = None) -> list[int]:
        """The pids of the executor JVMs running under the workers (or under worker
        ``worker`` only), oldest first."""
        found = []
        for index, daemon in enumerate(self.workers):
            if worker is not None and index != worker:
                continue
            found += [pid for pid in descendants(daemon.group.pid)[1:]
                      if EXECUTOR_CLASS in _command_line(pid)]
        return found

    def python_cpu(self) -> float:
        """CPU seconds the executors' Python workers (the processes that run the tasks:
        where idembus's work is done) have used so far, those that ended included."""
        return sum(_python_cpu(pid) for pid in self.executors())

    def busiest_worker(self) -> int:
        """The worker whose executor's Python workers (its pyspark daemon and what the
        daemon forked, the processes that run the tasks) have used the most CPU so far,
        those that ended included: the one that has done the most of the job's work."""
        spent = {}
        for index in range(len(self.workers)):
            spent[index] = sum(_python_cpu(pid) for pid in self.executors(index))
        return max(spent, key=lambda index: spent[index])

    def kill_executor(self, worker: int = 0) -> int:
        """SIGKILL the executor JVM under worker ``worker``; its pid. ``LookupError`` if
        that worker runs none."""
        pids = self.executors(worker)
        if not pids:
            raise LookupError(f"worker {worker} runs no executor")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def stop(self) -> None:
        """Workers first (with their executors), then the master; nothing is left running."""
        for daemon in reversed(self.daemons):
            daemon.group.stop()

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a driver process for this cluster: this one's, on loopback."""
        return {**os.environ, **LOOPBACK, **(extra or {})}

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def _python_cpu(executor: int) -> float:
    """CPU seconds of the Python processes below executor JVM ``executor``, with what
    their exited children used (``cutime``/``cstime``: the daemon's finished workers)."""
    total = 0.0
    for pid in descendants(executor)[1:]:
        if "python" not in _command_line(pid):
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""
