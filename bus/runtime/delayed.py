"""The poller of delayed messages: where the broker cannot hold a deferred message back, it
waits in the storage's delayed-message store, and every running endpoint on that storage
sends the due ones (:class:`DelayedDeliveries`)."""

from __future__ import annotations

import logging

from ..envelope import Envelope
from ..errors import MessageRefused
from ..logs import loggable
from ..redaction import redact
from ..storage.base import DelayedStore, ParkingStore
from ..transports.errors import TransportUnavailable
from .background import Periodic
from .endpoint_context import EndpointContext
from .recoverability.parking import park_outgoing

log = logging.getLogger(__name__)


class DelayedDeliveries(Periodic):
    """A thread that sends the storage's delayed messages when they are due.

    Claims are leases: a poller that dies mid-batch leaves its claims to expire, and
    another poller sends them again (with the same ids; receivers deduplicate). It sends
    what its endpoint deferred (with its transport), and what was deferred for any poller.

    Message by message: an outage ends the round (the claims expire and the next round
    takes them again) and counts as no attempt; a message the broker refuses for good, or
    that failed otherwise ``max_attempts`` times, is parked
    (:mod:`idembus.runtime.recoverability.parking`) and
    forgotten here. Failures are counted with the message in the storage
    (``Storage.note_scheduled_failure``): every poller of every process, and a poller
    restarted, gives up after the same number.
    """

    #: The storage role a poller uses.
    storage_roles = (DelayedStore, ParkingStore)

    def __init__(self, context: EndpointContext, *, interval: float = 0.5, batch: int = 100,
                 lease: float = 30.0, max_attempts: int = 5) -> None:
        super().__init__(f"idembus-{context.name}-delayed",
                         backoff=context.recoverability.outage_backoff, health=context.health)
        self._transport = context.transport
        self._clock = context.clock
        self._storage = context.role(DelayedStore)
        self._parking = context.role(ParkingStore)
        self._interval = interval
        self._batch = batch
        self._lease = lease
        #: Whose deferred messages it sends: its endpoint's, and those deferred for any.
        self.owner = context.name
        #: How often one message may fail (other than by an outage) before it is parked.
        self.max_attempts = max_attempts

    def round(self) -> float:
        self.send_due()
        return self._interval

    def send_due(self) -> int:
        """Send what is due now; return how many were sent."""
        sent = 0
        while not self._stop.is_set():
            envelopes = self._storage.claim_due(self._clock.now(), limit=self._batch,
                                                lease=self._lease, owner=self.owner)
            done = [envelope for envelope in envelopes if self._send(envelope)]
            self._storage.forget_scheduled(done)
            sent += len(done)
            if len(envelopes) < self._batch:
                break
        return sent

    def _send(self, envelope: Envelope) -> bool:
        """Send one due message; True when it is done with (sent or parked). An outage
        raises: the round ends, and the claims left expire."""
        try:
            self._transport.dispatch(envelope)
        except TransportUnavailable:
            raise
        except Exception as error:
            attempts = self._storage.note_scheduled_failure(envelope)
            if attempts == 0:  # another poller sent it and forgot it meanwhile
                log.info("sending delayed message %s failed, but it is no longer scheduled: "
                         "%s", loggable(envelope.message_id), redact(str(error)))
                return False
            if not isinstance(error, MessageRefused) and attempts < self.max_attempts:
                log.warning("sending delayed message %s failed (attempt %d of %d): %s",
                            loggable(envelope.message_id), attempts, self.max_attempts,
                            redact(str(error)))
                return False
            park_outgoing(self._parking, envelope, error, endpoint=self.owner,
                          attempts=attempts)
            return True
        return True
