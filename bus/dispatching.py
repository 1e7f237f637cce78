"""Putting outgoing messages on the wire, now or later.

A message without ``idembus.deliver_at``, or whose time has come, goes straight to the
transport. A deferred one goes to the transport too when the broker can hold it back
(RabbitMQ's delay queues); otherwise it waits in the storage's delayed-message store, and
the :class:`DelayedDeliveries` poller of every running endpoint on that storage sends it
when it is due. Either way it survives a restart of the endpoint.
"""

from __future__ import annotations

import logging
import threading

from bus.envelope import Envelope, utc_now
from bus.policies import Backoff
from storage.base import Storage
from storage.errors import StorageUnavailable
from transports.base import Transport
from transports.errors import TransportUnavailable

log = logging.getLogger(__name__)


class Dispatcher:
    """Sends or publishes envelopes, keeping deferred ones where they can wait."""

    def __init__(self, transport: Transport, storage: Storage) -> None:
        self._transport = transport
        self._storage = storage

    def dispatch(self, envelope: Envelope) -> None:
        due = envelope.deliver_at
        if due is not None and not self._transport.native_delay and due > utc_now():
            self._storage.schedule(envelope, due)
        else:
            self._transport.dispatch(envelope)


class DelayedDeliveries:
    """A thread that sends the storage's delayed messages when they are due.

    Claims are leases: a poller that dies mid-batch leaves its claims to expire, and
    another poller sends them again (with the same ids; receivers deduplicate).
    """

    def __init__(self, transport: Transport, storage: Storage, *, name: str,
                 interval: float = 0.5, batch: int = 100, lease: float = 30.0,
                 backoff: Backoff | None = None) -> None:
        self._transport = transport
        self._storage = storage
        self._name = name
        self._interval = interval
        self._batch = batch
        self._lease = lease
        self._backoff = backoff or Backoff()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def send_due(self) -> int:
        """Send what is due now; return how many were sent."""
        sent = 0
        while not self._stop.is_set():
            envelopes = self._storage.claim_due(utc_now(), limit=self._batch, lease=self._lease)
            for envelope in envelopes:
                self._transport.dispatch(envelope)
            self._storage.forget_scheduled(envelopes)
            sent += len(envelopes)
            if len(envelopes) < self._batch:
                break
        return sent

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.send_due()
                failures = 0
                wait = self._interval
            except (StorageUnavailable, TransportUnavailable) as outage:
                wait = self._backoff.delay(failures)
                failures += 1
                log.warning("sending delayed messages failed (%s); trying again in %.1fs",
                            outage, wait)
            except Exception:
                wait = self._backoff.delay(failures)
                failures += 1
                log.exception("sending delayed messages failed; trying again in %.1fs", wait)
            self._stop.wait(wait)
