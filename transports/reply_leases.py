"""Reply queues that outlive their requester by one lease at most (``bus.request`` where
the broker cannot tie a queue to the consumer's connection: Redis, the database queues).

The process consuming a reply queue renews its lease every third of the transport's
``reply_lease`` seconds (:meth:`~idembus.transports.base.Transport.renew_reply_queue`);
that process, and every endpoint when it starts, deletes the reply queues whose lease ran
out, with the replies in them
(:meth:`~idembus.transports.base.Transport.sweep_reply_queues`). A requester that dies
without closing its endpoint (SIGKILL, a lost machine) renews nothing: one lease after its
last renewal, its reply queue and the replies that came for it are gone as soon as a live
process of the transport sweeps.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING

from ..logs import Throttle

if TYPE_CHECKING:
    from .base import Transport

log = logging.getLogger(__name__)

#: What the name of a reply queue ends with (``Requests`` names them so), as a regular
#: expression that PostgreSQL, MongoDB and Python read alike.
REPLY_QUEUE_PATTERN = r"\.replies\.[0-9a-f]{32}$"
_REPLY_QUEUE = re.compile(REPLY_QUEUE_PATTERN)


def is_reply_queue(queue: str) -> bool:
    """Whether ``queue`` is named as a reply queue (``<endpoint>.replies.<32 hex digits>``)."""
    return _REPLY_QUEUE.search(queue) is not None


def check_lease(seconds: float) -> float:
    """``seconds`` as a reply lease; a ``ValueError`` unless it is positive."""
    if not seconds > 0:
        raise ValueError(f"reply_lease must be a positive number of seconds, not {seconds!r}")
    return float(seconds)


class LeaseKeeper:
    """A thread that renews the lease of one reply queue and sweeps the others, every
    third of ``transport.reply_lease``, until :meth:`stop`. A failure (an outage) is
    logged, at most once a minute, and tried again at the next turn."""

    def __init__(self, transport: Transport, queue: str) -> None:
        self._transport = transport
        self._queue = queue
        self._stop = threading.Event()
        self._lines = Throttle(60.0)
        self._thread = threading.Thread(target=self._run, name=f"idembus-lease-{queue}",
                                        daemon=True)

    def start(self) -> None:
        """Start renewing and sweeping."""
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing (the lease then runs out unless the queue is deleted)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(10)

    def _run(self) -> None:
        interval = self._transport.reply_lease / 3
        while not self._stop.wait(interval):
            try:
                self._transport.renew_reply_queue(self._queue)
                self._transport.sweep_reply_queues()
            except Exception as error:
                held = self._lines.allow("renew")
                if held is not None:
                    log.warning("the lease of reply queue %s could not be renewed (%s); "
                                "trying again in %.3gs%s", self._queue, error, interval,
                                self._lines.said(held))
