"""Putting outgoing messages on the wire, now or later.

A message without ``idembus.deliver_at``, or whose time has come, goes straight to the
transport. A deferred one goes to the transport too when the broker can hold it back
(RabbitMQ's delay queues); otherwise it waits in the storage's delayed-message store, and
the :class:`DelayedDeliveries` poller of every running endpoint on that storage sends it
when it is due. Either way it survives a restart of the endpoint.

With a journal (:mod:`bus.journal`), events that went out are also appended to the
storage's event journal before their senders mark them dispatched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bus.background import Periodic
from bus.envelope import Envelope, utc_now
from bus.journal import Journal
from bus.policies import Backoff
from storage.base import Lease, Storage
from transports.base import Transport

log = logging.getLogger(__name__)


class Dispatcher:
    """Sends or publishes envelopes, keeping deferred ones where they can wait."""

    def __init__(self, transport: Transport, storage: Storage,
                 journal: Journal | None = None) -> None:
        self._transport = transport
        self._storage = storage
        self._journal = journal

    def dispatch(self, envelope: Envelope) -> None:
        due = envelope.deliver_at
        if due is not None and not self._transport.native_delay and due > utc_now():
            self._storage.schedule(envelope, due)
        else:
            self._transport.dispatch(envelope)

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str,
                        outgoing: Sequence[Envelope], *, keep_bodies: bool,
                        lease: Lease | None = None) -> None:
        """Mark ``key``'s ``outgoing`` messages, just dispatched, in the storage; the
        journaled events among them ride with the mark
        (``Storage.mark_dispatched(..., journal=...)``)."""
        journal = [] if self._journal is None else self._journal.entries(
            outgoing, aggregate_type=aggregate_type, aggregate_id=aggregate_id)
        self._storage.mark_dispatched(aggregate_type, aggregate_id, key,
                                      keep_bodies=keep_bodies, lease=lease, journal=journal)

    def dispatch_now(self, envelope: Envelope) -> None:
        """Dispatch a message sent outside handlers, and journal it."""
        self.dispatch(envelope)
        if self._journal is not None:
            self._journal.record([envelope])


class DelayedDeliveries(Periodic):
    """A thread that sends the storage's delayed messages when they are due.

    Claims are leases: a poller that dies mid-batch leaves its claims to expire, and
    another poller sends them again (with the same ids; receivers deduplicate).
    """

    def __init__(self, transport: Transport, storage: Storage, *, name: str,
                 interval: float = 0.5, batch: int = 100, lease: float = 30.0,
                 backoff: Backoff | None = None) -> None:
        super().__init__(name, backoff=backoff)
        self._transport = transport
        self._storage = storage
        self._interval = interval
        self._batch = batch
        self._lease = lease

    def round(self) -> float:
        self.send_due()
        return self._interval

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
