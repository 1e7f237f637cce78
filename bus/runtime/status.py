"""What an endpoint process did, reported to its storage for ``idembus status``.

Every running endpoint writes its counters (kept from its signals) every few seconds, and
once more when it stops, under an instance name of its own; ``idembus status`` reads the
reports of every process of the endpoint, on every machine that shares its storage. A
report that cannot be written is a warning, one per cause every 10 s while it lasts.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from ..envelope import format_utc, utc_now
from ..redaction import redact
from ..routing import partition_queue
from ..signals import SIGNAL_NAMES
from ..storage.base import StatusReport, StatusStore
from ..transports.base import QueueDepth, Transport
from .background import Periodic
from .counters import LAST_LAG_MS, LAST_SETTLED_AT, ledger

log = logging.getLogger(__name__)


class StatusReporter(Periodic):
    """A thread writing one endpoint process's counters every ``interval`` seconds."""

    def __init__(self, storage: StatusStore, endpoint: str,
                 counters: Callable[[], Mapping[str, int]], *, interval: float = 5.0,
                 problems: Callable[[], Mapping[str, str]] | None = None) -> None:
        super().__init__(f"idembus-{endpoint}-status")
        self._storage = storage
        self._endpoint = endpoint
        self._counters = counters
        #: What blocks the process now (:class:`~idembus.runtime.health.Health`), with every report.
        self._problems = problems or dict
        self._interval = interval
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._started_at = utc_now()

    def round(self) -> float:
        self.report()
        return self._interval

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Stop reporting, after a last report that says so."""
        was_running = super().stop(timeout)
        if was_running:
            self.report(stopped=True)
        return was_running

    def report(self, *, stopped: bool = False) -> None:
        try:
            self._storage.report_status(StatusReport(
                endpoint=self._endpoint, instance=self.instance, counters=self._counters(),
                started_at=self._started_at, updated_at=utc_now(), stopped=stopped,
                problems=dict(self._problems()),
            ))
        except Exception as exc:  # observation only: never let it stop the endpoint
            held = self.outage_lines.allow(type(exc).__name__)  # one line per 10 s
            if held is not None:
                log.warning("could not report the status of %s: %s%s", self._endpoint,
                            redact(str(exc)), self.outage_lines.said(held))


#: Reports older than this are not shown unless asked for (``idembus status --all``).
HIDDEN_AFTER = datetime.timedelta(hours=1)


def summarise(name: str, reports: list[StatusReport], *, now: datetime.datetime,
              stale_after: datetime.timedelta) -> dict[str, Any]:
    """The reports as one structure; ``total`` adds up the processes still running.

    Each instance and the total carry the ``counters`` of every signal and the ``ledger``
    (:func:`idembus.runtime.counters.ledger`: received = the sum of its other terms), and
    ``last_settled`` (when its last delivery was settled, ``None``: none yet) with
    ``lag_seconds`` (how long after it was sent or due); the total's are the running
    instance that settled last's."""
    instances = []
    total: Counter[str] = Counter()
    latest: dict[str, Any] = {"last_settled": None, "lag_seconds": None}
    latest_at = -1
    for report in reports:
        state = instance_state(report, now, stale_after)
        last = _last_settled(report.counters)
        instances.append({
            "instance": report.instance, "state": state,
            "started_at": format_utc(report.started_at),
            "updated_at": format_utc(report.updated_at),
            "counters": {key: int(report.counters.get(key, 0)) for key in SIGNAL_NAMES},
            "ledger": ledger(report.counters),
            **last,
            "problems": dict(report.problems),
        })
        if state == "running":
            total.update({key: value for key, value in report.counters.items()
                          if key not in _GAUGES})
            at = report.counters.get(LAST_SETTLED_AT)
            if at is not None and at > latest_at:
                latest, latest_at = last, at
    return {"endpoint": name,
            "running": sum(1 for i in instances if i["state"] == "running"),
            "total": {key: total.get(key, 0) for key in SIGNAL_NAMES},
            "ledger": ledger(total), **latest,
            "instances": instances}


#: Report keys that are readings, not counts: never added up.
_GAUGES = frozenset({LAST_SETTLED_AT, LAST_LAG_MS})


def _last_settled(counters: Mapping[str, int]) -> dict[str, Any]:
    """When the report's process settled its last delivery (UTC text) and that delivery's
    lag in seconds; ``None`` for what it does not say."""
    at, lag = counters.get(LAST_SETTLED_AT), counters.get(LAST_LAG_MS)
    moment = (datetime.datetime.fromtimestamp(at / 1000, datetime.timezone.utc)
              if at is not None else None)
    return {"last_settled": format_utc(moment) if moment is not None else None,
            "lag_seconds": lag / 1000 if lag is not None else None}


def instance_state(report: StatusReport, now: datetime.datetime,
           stale_after: datetime.timedelta) -> str:
    """``running``, ``stopped``, or ``stale`` when not heard of for ``stale_after``."""
    if report.stopped:
        return "stopped"
    return "stale" if now - report.updated_at > stale_after else "running"


def queue_depth(transport: Transport, queue: str, *, visible: bool = True) -> dict[str, Any]:
    """What ``transport`` tells of ``queue`` now (:class:`~idembus.transports.base.QueueDepth`
    as a dict, ``None`` for what it cannot tell), and ``unknown``: why nothing could be
    read (the broker's error, redacted; or not ``visible`` from this process: a
    process-local transport seen from a command's own process), else ``None``."""
    depth: dict[str, Any] = {"queue": queue, **dataclasses.asdict(QueueDepth()),
                             "unknown": None}
    if not visible:
        depth["unknown"] = (f"{type(transport).__name__} is process-local: its queue "
                            "cannot be seen from another process")
        return depth
    try:
        depth.update(dataclasses.asdict(transport.depth(queue)))
    except Exception as error:  # shown, never raised: the rest of the status still matters
        depth["unknown"] = redact(f"{type(error).__name__}: {error}")
    return depth


def ordering_depth(transport: Transport, queue: str, *, partitions: int, ordered: bool,
                   visible: bool = True) -> dict[str, Any] | None:
    """What ``transport`` tells of ``queue``'s ordered messages now, for an endpoint that
    handles ordered types (``ordered``; else ``None``): the depth of each of its
    ``partitions`` partition queues (RabbitMQ: ready and consumers, as
    :func:`queue_depth`), or, where the endpoint's own queue orders them (the database
    queues), the keys in flight and the ordered messages waiting; ``unknown``: why
    nothing could be read."""
    if not ordered:
        return None
    depth: dict[str, Any] = {"partitions": [], "keys_in_flight": None, "waiting": None,
                             "unknown": None}
    if not visible:
        depth["unknown"] = (f"{type(transport).__name__} is process-local: its queues "
                            "cannot be seen from another process")
    elif partitions:
        depth["partitions"] = [queue_depth(transport, partition_queue(queue, index))
                               for index in range(partitions)]
    else:
        try:
            keys = transport.ordered_keys(queue)
        except Exception as error:  # shown, never raised, as the queue's depth
            depth["unknown"] = redact(f"{type(error).__name__}: {error}")
        else:
            if keys is not None:
                depth.update(keys_in_flight=keys.in_flight, waiting=keys.waiting)
    return depth


def duration_text(seconds: float) -> str:
    """``35 ms``, ``4.2 s``, ``3 min``, ``2.5 h``: a wait or a lag as people read it."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
