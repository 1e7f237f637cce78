"""What an endpoint process did, reported to its storage for ``idembus status``.

Every running endpoint writes its counters (kept from its signals) every few seconds, and
once more when it stops, under an instance name of its own; ``idembus status`` reads the
reports of every process of the endpoint, on every machine that shares its storage. A
report that cannot be written is a warning, one per cause every 10 s while it lasts.
"""

from __future__ import annotations

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
from ..signals import SIGNAL_NAMES
from ..storage.base import StatusReport, StatusStore
from .background import Periodic

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
    """The reports as one structure; ``total`` adds up the processes still running."""
    instances = []
    total: Counter[str] = Counter()
    for report in reports:
        state = instance_state(report, now, stale_after)
        instances.append({
            "instance": report.instance, "state": state,
            "started_at": format_utc(report.started_at),
            "updated_at": format_utc(report.updated_at),
            "counters": {key: int(report.counters.get(key, 0)) for key in SIGNAL_NAMES},
            "problems": dict(report.problems),
        })
        if state == "running":
            total.update(report.counters)
    return {"endpoint": name,
            "running": sum(1 for i in instances if i["state"] == "running"),
            "total": {key: total.get(key, 0) for key in SIGNAL_NAMES},
            "instances": instances}


def instance_state(report: StatusReport, now: datetime.datetime,
           stale_after: datetime.timedelta) -> str:
    """``running``, ``stopped``, or ``stale`` when not heard of for ``stale_after``."""
    if report.stopped:
        return "stopped"
    return "stale" if now - report.updated_at > stale_after else "running"
