"""Worker processes of a run, and where the CPU went (read from ``/proc``).

Each variant's workers are started by that framework's own command line as one process
group (a session of their own), stopped with SIGTERM (every framework's graceful stop),
and killed as a group if they do not stop in time — also when the driver itself fails.

CPU accounting: the workers' process tree, PostgreSQL's processes and RabbitMQ's, each as
user + system seconds; a run reports them per timed message. The services' figures include
anything else they did meanwhile, so read them as a comparison between variants run the
same way, on a quiet machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Process names (``/proc/<pid>/comm``) of the services.
SERVICES = {"postgresql": ("postgres",), "rabbitmq": ("beam.smp",)}


class Workers:
    """One variant's worker processes, started as a group; a context manager that stops
    them (and kills what does not stop) on exit."""

    def __init__(self, command: Sequence[str], *, environment: dict[str, str], log: Path,
                 cwd: Path | None = None, stop_timeout: float = 20.0) -> None:
        self.command = list(command)
        self.log = log
        self.stop_timeout = stop_timeout
        self._log_file: IO[bytes] = log.open("ab")
        self.process = subprocess.Popen(
            self.command, env=environment, stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def tree(self) -> list[int]:
        """The pids of the group's process tree (the top process and its descendants)."""
        return descendants(self.pid)

    def stop(self) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole group; the top process' exit status."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        status = self._kill_group()
        self._log_file.close()
        return status

    def _kill_group(self) -> int:
        """Kill what is left of the group, reap the top process (a zombie still counts as
        a member of its group) and wait a little for the rest to go."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        status = self.process.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _group_alive(self.pid):
            time.sleep(0.02)
        return status

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def _group_alive(group: int) -> bool:
    """True while a process of ``group`` runs (zombies waiting to be reaped do not)."""
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields is not None and int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (2nd field) may contain spaces: split after its closing ')'.
    return text[text.rindex(")") + 2:].split()


def _all_pids() -> list[int]:
    # A list, not a generator over the scandir iterator: a caller that stops early (a
    # group found alive) would leave the iterator open until garbage collection.
    with os.scandir("/proc") as entries:
        return [int(entry.name) for entry in entries if entry.name.isdigit()]


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(pid)
    found, frontier = [root], [root]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """User + system CPU seconds of each of ``pids`` that still exists."""
    found = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            found[pid] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return found


def _spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU spent between two readings by the processes alive at the second (one that
    started meanwhile counts in full; one that ended meanwhile is not seen)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def service_pids(names: Sequence[str]) -> list[int]:
    found = []
    for pid in _all_pids():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() in names:
                found.append(pid)
        except OSError:
            continue
    return found


def resident_kib(pid: int, field: str = "VmRSS") -> int:
    """``field`` of ``/proc/<pid>/status`` in KiB (VmRSS: resident now; VmHWM: its peak);
    ``LookupError`` once the process has gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(f"no {field} for pid {pid}")


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent on anything but idling, since boot (``/proc/stat``)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


def wait_for_quiet(*, below: float = 0.3, longest: float = 30.0, interval: float = 0.5
                   ) -> float:
    """Wait until the machine is nearly idle between runs (below ``below`` cores busy over
    ``interval``), for at most ``longest`` seconds; return the last busy figure (cores).
    On a shared machine this keeps someone else's burst out of a run's window."""
    deadline = time.monotonic() + longest
    while True:
        before = machine_busy_seconds()
        time.sleep(interval)
        busy = (machine_busy_seconds() - before) / interval
        if busy < below or time.monotonic() >= deadline:
            return busy


@dataclass
class CpuSnapshot:
    """CPU seconds of the workers' processes, of each service's, of this driver and of
    the whole machine at one moment."""

    workers: dict[int, float]
    services: dict[str, dict[int, float]]
    driver: float
    machine: float

    @classmethod
    def take(cls, workers: Sequence[int]) -> CpuSnapshot:
        times = os.times()
        return cls(cpu_seconds(workers),
                   {name: cpu_seconds(service_pids(comms)) for name, comms in SERVICES.items()},
                   times.user + times.system, machine_busy_seconds())

    def per_message(self, later: CpuSnapshot, messages: int) -> dict[str, float]:
        """Microseconds of CPU per message between this snapshot and ``later``: the
        workers, each service, and ``other`` (the rest of the machine but this driver)."""
        result = {"workers": _spent(self.workers, later.workers)}
        for name, pids in later.services.items():
            result[name] = _spent(self.services.get(name, {}), pids)
        accounted = sum(result.values()) + later.driver - self.driver
        result["other"] = max(0.0, later.machine - self.machine - accounted)
        return {key: round(value / messages * 1e6, 1) for key, value in result.items()}
