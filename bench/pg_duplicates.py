"""The duplicate path against the fresh path, on the same idembus workers' configuration.

A fresh run first: ``warmup + count`` new messages, timed as in the comparison but by the
workers' own ``handled`` counter (:class:`bench.pg_clock.Probe`). The workers then stop
gracefully (SIGTERM: the storage writes its last batch of dispatch marks), the *same*
messages — same ids — are queued again and the workers start again on them, timed by the
``duplicate`` counter. A duplicate costs one load that finds the message's processed record,
whose outgoing event was confirmed and compacted: no handler, no write, no publish, one
ack. The run checks that: counters and records unchanged, no event sent again.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.pg_clock import Probe, RunFailed, Window, time_window
from bench.pg_common import RunNames
from bench.pg_handlers import PROBE
from bench.pg_idembus import IdembusVariant, command, preload, totals
from bench.pg_procs import CpuSnapshot, Workers
from bench.pg_runner import ROOT, STALL_TIMEOUT, Config
from bench.pg_topology import Broker, Cleanup

GRACEFUL_STOP = 30.0


@dataclass
class DuplicateResult:
    config: Config
    fresh: Window | None = None
    duplicate: Window | None = None
    cpu_us_per_msg: dict[str, dict[str, float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.fresh is None or self.duplicate is None:
            return None
        return self.duplicate.rate / self.fresh.rate

    def as_json(self) -> dict[str, Any]:
        return {
            "config": self.config.key, "label": self.config.label,
            "fresh_msgs_per_s": None if self.fresh is None else round(self.fresh.rate, 1),
            "duplicate_msgs_per_s": (None if self.duplicate is None
                                     else round(self.duplicate.rate, 1)),
            "duplicate_over_fresh": None if self.ratio is None else round(self.ratio, 3),
            "cpu_us_per_msg": self.cpu_us_per_msg, "problems": self.problems,
        }


def measure(config: Config, *, warmup: int, count: int, logs: Path) -> DuplicateResult:
    """Fresh, then the same messages again, on workers configured as ``config``."""
    result = DuplicateResult(config)
    names = RunNames.fresh()
    total = warmup + count
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    probe = Probe(Path(tempfile.mkdtemp(prefix="probe-", dir=logs)))
    environment = {**names.environment(), PROBE: str(probe.directory)}
    try:
        broker.declare_sink(names)
        IdembusVariant().prepare(names, broker, cleanup, total)
        result.fresh = _timed(result, "fresh", probe.handled, config, environment, logs,
                              warmup=warmup, count=count)
        before = totals(names)
        if before[2]:
            result.problems.append(f"{before[2]} records not marked dispatched after the stop")
        probe.clear()
        preload(broker, names, range(total))
        result.duplicate = _timed(result, "duplicate", probe.duplicates, config, environment,
                                  logs, warmup=warmup, count=count)
        after = totals(names)
        events = broker.depth(names.sink_queue)
        if after[:2] != before[:2] or events != total or probe.handled():
            result.problems.append(
                f"duplicates had effects: counters/records {before[:2]} -> {after[:2]}, "
                f"{events} events for {total} messages, {probe.handled()} handled again")
    except RunFailed as exc:
        result.problems.append(str(exc))
    finally:
        broker.close()
        cleanup.run()
    return result


def _timed(result: DuplicateResult, phase: str, finished: Any, config: Config,
           environment: dict[str, str], logs: Path, *, warmup: int, count: int) -> Window:
    snapshots: list[CpuSnapshot] = []
    log_path = logs / f"idembus-{phase}-{config.key}.log"
    with Workers(command(config), environment=environment, log=log_path, cwd=ROOT,
                 stop_timeout=GRACEFUL_STOP) as workers:
        try:
            window = time_window(
                finished, warmup=warmup, count=count, timeout=STALL_TIMEOUT,
                alive=workers.alive,
                on_start=lambda: snapshots.append(CpuSnapshot.take(workers.tree())),
                on_end=lambda: snapshots.append(CpuSnapshot.take(workers.tree())))
        except RunFailed as exc:
            raise RunFailed(f"{phase}: {exc}; worker log {log_path}:\n{workers.log_tail()}"
                            ) from None
    if workers.process.returncode not in (0, None):
        result.problems.append(f"{phase} workers exited with {workers.process.returncode}")
    result.cpu_us_per_msg[phase] = snapshots[0].per_message(snapshots[1], count)
    return window
