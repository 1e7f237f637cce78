"""Resident memory of one idembus worker process over a long run.

One ``idembus run bench.pg_handlers:factory --workers 1`` process (no supervisor: the
process the driver starts is the worker) handles fresh messages, fed to its queue in
chunks so that the queue holds a few thousand at a time, until the largest checkpoint. Its
VmRSS (``/proc/<pid>/status``) is read when its ``handled`` counter passes each checkpoint
(the first one, 20,000 by default, is the reference: start-up and warm-up allocations are
done by then) and every 10,000 messages in between. Growth is
``(RSS at the last checkpoint - RSS at the first) / RSS at the first``; the issue asks for
less than 10 %: no cache, counter or signal receiver may grow per message.

The published events go to the run's exchange with no queue bound: the broker confirms and
drops them, so 200,000 of them do not pile up in RabbitMQ.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.pg_clock import POLL_INTERVAL, Probe, RunFailed
from bench.pg_common import RunNames
from bench.pg_handlers import PROBE
from bench.pg_idembus import command, configuration, create_tables, preload
from bench.pg_procs import Workers, resident_kib
from bench.pg_runner import ROOT, STALL_TIMEOUT
from bench.pg_topology import Broker, Cleanup

FEED_CHUNK = 2000
FEED_BELOW = 2000
SAMPLE_EVERY = 10_000


@dataclass
class MemoryResult:
    threads: int
    checkpoints: tuple[int, ...]
    #: Batch size (0: one message at a time).
    batch: int = 0
    #: (messages handled, RSS KiB, seconds since the first message)
    samples: list[tuple[int, int, float]] = field(default_factory=list)
    at_checkpoints: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def growth(self) -> float | None:
        first, last = self.checkpoints[0], self.checkpoints[-1]
        if first not in self.at_checkpoints or last not in self.at_checkpoints:
            return None
        return (self.at_checkpoints[last] - self.at_checkpoints[first]) / self.at_checkpoints[
            first]

    def as_json(self) -> dict[str, Any]:
        return {
            "worker": f"1 process x {self.threads} threads"
                      + (f", batch {self.batch}" if self.batch else ""),
            "rss_kib_at": {str(k): v for k, v in self.at_checkpoints.items()},
            "growth_pct": None if self.growth is None else round(self.growth * 100, 2),
            "samples": [{"handled": n, "rss_kib": rss, "seconds": round(s, 1)}
                        for n, rss, s in self.samples],
            "problems": self.problems,
        }


def measure(checkpoints: tuple[int, ...], *, threads: int, logs: Path,
            batch: int = 0) -> MemoryResult:
    """One worker's resident memory over a long run; ``batch``: in batches of that size."""
    result = MemoryResult(threads, checkpoints, batch=batch)
    names = RunNames.fresh()
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    probe = Probe(Path(tempfile.mkdtemp(prefix="probe-memory-", dir=logs)))
    try:
        broker.declare_sink(names, bind=False)
        cleanup.queues.append(names.error_queue)
        create_tables(names, cleanup)
        broker.declare_queue(names.input_queue)
        log_path = logs / f"idembus-memory-{threads}t.log"
        with Workers(command(configuration(1, threads, batch)),
                     environment={**names.environment(), PROBE: str(probe.directory)},
                     log=log_path, cwd=ROOT, stop_timeout=30.0) as worker:
            try:
                _follow(result, worker, broker, names, probe)
            except RunFailed as exc:
                result.problems.append(f"{exc}; worker log {log_path}:\n{worker.log_tail()}")
    finally:
        broker.close()
        cleanup.run()
    return result


def _follow(result: MemoryResult, worker: Workers, broker: Broker, names: RunNames,
            probe: Probe) -> None:
    fed = 0
    pending = sorted(set(result.checkpoints) | set(range(SAMPLE_EVERY, result.checkpoints[-1],
                                                           SAMPLE_EVERY)))
    started: float | None = None
    last, last_change = -1, time.monotonic()
    while pending:
        handled = probe.handled()
        now = time.monotonic()
        if handled != last:
            last, last_change = handled, now
        if started is None and handled > 0:
            started = now
        while pending and handled >= pending[0]:
            rss = resident_kib(worker.pid)
            result.samples.append((handled, rss, now - (started or now)))
            if pending[0] in result.checkpoints:
                result.at_checkpoints[pending[0]] = rss
            pending.pop(0)
        if fed < result.checkpoints[-1] + FEED_CHUNK and broker.depth(
                names.input_queue) < FEED_BELOW:
            preload(broker, names, range(fed, fed + FEED_CHUNK))
            fed += FEED_CHUNK
        if not worker.alive():
            raise RunFailed(f"the worker exited after {handled} messages")
        if now - last_change > STALL_TIMEOUT:
            raise RunFailed(f"stalled at {handled} messages")
        time.sleep(POLL_INTERVAL * 5)
