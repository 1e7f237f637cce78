"""One timed run of one configuration of one variant, the same way for every variant.

For each run: a wait (30 s at most) until the machine is nearly idle; fresh names; the
run's topic exchange and sink queue; the variant prepares its tables and preloads
``warmup + count`` messages into its durable input queue *before* any worker starts; the
workers are started with the framework's own command line; the clock
(:mod:`bench.pg_clock`) times the ``count`` messages after the warm-up by the sink's depth;
the workers are stopped (SIGTERM, then SIGKILL after 1.5 s: every message was acknowledged
by then); the variant checks that every message took effect exactly once (counters,
processed rows, one event each, nothing dead-lettered); everything the run created is
deleted. A run that fails or finds a problem (RabbitMQ restarted by someone else, a worker
died) is run once more with new names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.common import unreachable_reason
from bench.pg_clock import RunFailed, Window, sink_counter, time_window
from bench.pg_common import RunNames
from bench.pg_procs import CpuSnapshot, Workers, wait_for_quiet
from bench.pg_topology import Broker, Cleanup

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
#: Seconds a framework gets to stop gracefully after SIGTERM once its run is over (every
#: message was confirmed by then); Celery's and Dramatiq's take ~3 s, the rest of it is
#: waiting, so the group is killed after this.
STOP_TIMEOUT = 1.5
#: Longest wait for the next finished message before a run counts as stalled.
STALL_TIMEOUT = 60.0


@dataclass(frozen=True)
class Config:
    """One configuration of a variant: ``key`` in the JSON, ``label`` in the table."""

    key: str
    label: str
    settings: dict[str, int] = field(default_factory=dict)


class Variant(Protocol):
    """What :func:`run_configuration` needs from a variant."""

    #: Key in the summary and the JSON (``idembus``, ``raw_kombu``, ...).
    name: str
    #: Heading of the variant's table.
    title: str

    def configurations(self, quick: bool) -> list[Config]:
        """Every configuration to try (a sample of them with ``quick``)."""

    def prepare(self, names: RunNames, broker: Broker, cleanup: Cleanup, total: int) -> None:
        """Create the tables and preload ``total`` messages; tell ``cleanup`` what to
        delete beyond the input and sink queues and the exchange."""

    def command(self, names: RunNames, config: Config) -> list[str]:
        """The command line starting the workers."""

    def verify(self, names: RunNames, broker: Broker, total: int) -> list[str]:
        """What went wrong, if anything, once the workers stopped."""


@dataclass
class RunResult:
    variant: str
    config: Config
    window: Window | None = None
    cpu_us_per_msg: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    attempts: int = 0
    load_average: float = 0.0
    #: Cores the machine kept busy just before the run (it waits up to 30 s for < 0.3).
    busy_before: float = 0.0
    #: What went wrong in attempts before the one reported (a RabbitMQ restart...).
    earlier_problems: list[str] = field(default_factory=list)
    #: Seconds spent preparing, starting and warming up, timed, stopping, checking.
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float | None:
        return self.window.rate if self.window and not self.problems else None

    def as_json(self) -> dict[str, Any]:
        return {
            "config": self.config.key, "label": self.config.label,
            "settings": self.config.settings,
            "msgs_per_s": None if self.rate is None else round(self.rate, 1),
            "seconds": None if self.window is None else round(self.window.seconds, 3),
            "messages": None if self.window is None else self.window.count,
            "cpu_us_per_msg": self.cpu_us_per_msg, "problems": self.problems,
            "earlier_attempts": self.earlier_problems,
            "attempts": self.attempts, "load_average_1m": self.load_average,
            "busy_cores_before": round(self.busy_before, 2),
            "phases_s": {key: round(value, 2) for key, value in self.phases.items()},
        }


def run_configuration(variant: Variant, config: Config, *, warmup: int, count: int,
                      logs: Path, attempts: int = 2) -> RunResult:
    """Time ``config`` of ``variant``; retry once after a failure."""
    result = RunResult(variant.name, config)
    earlier: list[str] = []
    for attempt in range(1, attempts + 1):
        result.attempts = attempt
        result.busy_before = wait_for_quiet()
        result.load_average = _load_average()
        try:
            result.phases = {}
            result.window, result.cpu_us_per_msg, problems = _run_once(
                variant, config, warmup=warmup, count=count, logs=logs, phases=result.phases)
            if not problems:
                result.problems = []
                result.earlier_problems = earlier
                return result
            result.problems = problems
        except Exception as exc:  # noqa: BLE001 - a broker restart, a dead worker: try again
            result.window, result.problems = None, [str(exc)]
        earlier += [f"attempt {attempt}: {problem}" for problem in result.problems]
        log.warning("%s %s failed: %s", variant.name, config.label, "; ".join(result.problems))
        if attempt < attempts:
            wait_for_broker()
    result.earlier_problems = earlier[:-len(result.problems) or None]
    return result


def _run_once(variant: Variant, config: Config, *, warmup: int, count: int, logs: Path,
              phases: dict[str, float]) -> tuple[Window, dict[str, float], list[str]]:
    names = RunNames.fresh()
    mark = _Stopwatch(phases)
    total = warmup + count
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    try:
        broker.declare_sink(names)
        variant.prepare(names, broker, cleanup, total)
        mark("prepare")
        log_path = logs / f"{variant.name}-{config.key}-{names.suffix}.log"
        with Workers(variant.command(names, config), environment=names.environment(),
                     log=log_path, cwd=ROOT, stop_timeout=STOP_TIMEOUT) as workers:
            snapshots: list[CpuSnapshot] = []
            try:
                window = time_window(
                    sink_counter(broker, names.sink_queue), warmup=warmup, count=count,
                    timeout=STALL_TIMEOUT, alive=workers.alive,
                    on_start=lambda: (mark("start+warmup"),
                                      snapshots.append(CpuSnapshot.take(workers.tree()))),
                    on_end=lambda: (snapshots.append(CpuSnapshot.take(workers.tree())),
                                    mark("timed")))
            except RunFailed as exc:
                raise RunFailed(f"{exc}; worker log {log_path}:\n{workers.log_tail()}") from None
        mark("stop")
        problems = variant.verify(names, broker, total)
        events = broker.depth(names.sink_queue)
        if events != total:
            problems.append(f"{events} events in the sink for {total} messages")
        mark("verify")
        return window, snapshots[0].per_message(snapshots[1], count), problems
    finally:
        broker.close()
        cleanup.run()
        mark("cleanup")


class _Stopwatch:
    """Records the seconds since the previous mark under each mark's name."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases = phases
        self.last = time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = now - self.last
        self.last = now


def wait_for_broker(limit: float = 60.0) -> None:
    """After a failure: wait until RabbitMQ listens again (someone may be restarting it)."""
    deadline = time.monotonic() + limit
    time.sleep(2)
    while unreachable_reason(RunNames.fresh().amqp_url) and time.monotonic() < deadline:
        time.sleep(2)
    time.sleep(3)


def _load_average() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def best(results: Sequence[RunResult]) -> RunResult | None:
    """The fastest run that finished cleanly."""
    finished = [result for result in results if result.rate is not None]
    return max(finished, key=lambda result: result.rate or 0.0, default=None)
