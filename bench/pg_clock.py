"""Timing a run by counting finished messages from outside the workers.

Every variant publishes exactly one event per input message to the run's sink queue, and
only after its database transaction; so the sink's depth (read with a passive declare
every 10 ms, which consumes nothing, costs the workers nothing and RabbitMQ the same in
every variant) counts finished messages the same way for idembus, the raw loop, Celery and
Dramatiq. The publish of a message's event precedes its ack by a fraction of a
millisecond in every variant; the workers are stopped only after the last ack.

The workers first get ``warmup`` messages: process start, imports, connections, the
connection pools' growth and the prepared statements are not timed, whatever each
framework needs. The clock starts when the warm-up is done — the moment the first timed
message is taken in steady state — and stops when the last of the ``count`` timed ones is
done: ``count / (t[warmup + count] - t[warmup])``.

The duplicate-path run of idembus cannot count a sink (a duplicate whose outgoing message
was confirmed sends nothing again); it counts the endpoint's own ``handled`` and
``duplicate`` counters, which :mod:`bench.pg_handlers` writes to files (:class:`Probe`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.pg_topology import Broker

POLL_INTERVAL = 0.01


@dataclass
class Window:
    """The timed part of a run."""

    count: int
    started: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def rate(self) -> float:
        return self.count / self.seconds


class RunFailed(RuntimeError):
    """A run did not finish: a worker died or nothing moved for too long."""


def time_window(finished: Callable[[], int], *, warmup: int, count: int, timeout: float,
                alive: Callable[[], bool], on_start: Callable[[], None] | None = None,
                on_end: Callable[[], None] | None = None) -> Window:
    """Poll ``finished()`` until it reaches ``warmup`` (start) and ``warmup + count`` (end).

    ``alive()`` is asked on every poll; ``timeout`` is the longest wait between two
    changes of ``finished()`` (a stalled run fails instead of hanging).
    """
    started: float | None = None
    last, last_change = -1, time.monotonic()
    while True:
        now = time.monotonic()
        done = finished()
        if done != last:
            last, last_change = done, now
        if started is None and done >= warmup:
            started = now
            if on_start is not None:
                on_start()
        if started is not None and done >= warmup + count:
            if on_end is not None:
                on_end()
            return Window(count, started, now)
        if not alive():
            raise RunFailed(f"a worker exited after {done} of {warmup + count} messages")
        if now - last_change > timeout:
            raise RunFailed(f"stalled at {done} of {warmup + count} messages for {timeout:.0f}s")
        time.sleep(POLL_INTERVAL)


def sink_counter(broker: Broker, queue: str) -> Callable[[], int]:
    """Finished messages = depth of the sink queue."""
    return lambda: broker.depth(queue)


class Probe:
    """Reads the counters idembus workers write to ``directory`` (one file per process,
    ``handled duplicate``); see :func:`bench.pg_handlers.start_probe`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def clear(self) -> None:
        for path in self.directory.glob("*.count"):
            path.unlink()

    def totals(self) -> tuple[int, int]:
        handled = duplicate = 0
        for path in self.directory.glob("*.count"):
            try:
                first, second = path.read_text().split()
            except (OSError, ValueError):  # replaced while read; next poll sees it
                continue
            handled += int(first)
            duplicate += int(second)
        return handled, duplicate

    def handled(self) -> int:
        return self.totals()[0]

    def duplicates(self) -> int:
        return self.totals()[1]
