"""Waiting for the other processes to finish: every order shipped, then the queues empty
with every consumer back, for several checks in a row.

The workers are other processes: there is no event to wait on, so their stores and the
broker's queues are polled, with a deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from idembus.storage.errors import StorageUnavailable
from samples.torture.rabbitmq import QueueStatus

log = logging.getLogger(__name__)


class Probe(Protocol):
    """Tells the depth and consumers of queues (RabbitMQ's, or the PostgreSQL
    transport's); raises while the broker is unreachable."""

    def status(self, queues: list[str]) -> dict[str, QueueStatus]: ...

#: Give up waiting for orders when none was shipped for this long: the chaos costs seconds
#: (a broker restart, workers restarting with a backoff of up to 10 s), not minutes.
STALL_AFTER = 120.0


def wait_until_shipped(
    shipped: Callable[[], int],
    expected: int,
    probe: Probe,
    queues: Sequence[str],
    *,
    deadline: float,
    interval: float = 2.0,
    report_every: float = 15.0,
) -> bool:
    """Poll ``shipped()`` until it reaches ``expected``; False at ``deadline`` or when the
    run stalled (see :data:`STALL_AFTER`). Logs the progress and the queues now and then."""
    last_count, last_change, last_report = -1, time.monotonic(), 0.0
    while True:
        count = _shipped(shipped, last_count)
        now = time.monotonic()
        if count >= expected:
            log.info("all %d orders shipped", expected)
            return True
        if count != last_count:
            last_count, last_change = count, now
        if now - last_report >= report_every:
            log.info("shipped %d/%d; queues %s", count, expected,
                     _describe(_statuses(probe, queues)))
            last_report = now
        if now - last_change > STALL_AFTER:
            log.error("nothing shipped for %.0fs (%d/%d); giving up; queues %s", STALL_AFTER,
                      count, expected, _describe(_statuses(probe, queues)))
            return False
        if now >= deadline:
            log.error("deadline reached with %d/%d orders shipped", count, expected)
            return False
        time.sleep(interval)


def wait_until_drained(
    probe: Probe,
    queues: Sequence[str],
    *,
    consumers: int,
    deadline: float,
    rounds: int = 3,
    interval: float = 1.0,
) -> bool:
    """Poll the broker until every queue in ``queues`` is empty and has ``consumers``
    consumers, ``rounds`` checks in a row; False at ``deadline``."""
    settled = 0
    statuses: dict[str, QueueStatus] | None = None
    while time.monotonic() < deadline:
        statuses = _statuses(probe, queues)
        quiet = statuses is not None and len(statuses) == len(queues) and all(
            s.messages == 0 and s.consumers == consumers for s in statuses.values())
        settled = settled + 1 if quiet else 0
        if settled >= rounds:
            return True
        time.sleep(interval)
    log.error("the queues did not settle: %s", _describe(statuses))
    return False


def _shipped(shipped: Callable[[], int], last_count: int) -> int:
    """``shipped()``, or ``last_count`` while the database cannot answer (it may be failing
    over: a pooled connection to the dead primary fails once)."""
    try:
        return shipped()
    except StorageUnavailable as error:
        log.info("cannot read the shipments: %s", error)
        return last_count


def _statuses(probe: Probe, queues: Sequence[str]) -> dict[str, QueueStatus] | None:
    try:
        return probe.status(list(queues))
    except Exception as error:  # the broker may be restarting; ask again next time
        log.info("cannot ask the broker about the queues: %s", error)
        return None


def _describe(statuses: dict[str, QueueStatus] | None) -> str:
    if statuses is None:
        return "unknown (broker unreachable)"
    return ", ".join(f"{queue}: {s.messages} ready, {s.consumers} consumers"
                     for queue, s in statuses.items())
