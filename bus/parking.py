"""Parking: the last place a message can go when the broker refuses every other.

A failed message whose error-queue copy the broker refuses (larger than it accepts, a
policy), or a committed outgoing message the outbox cannot send (its queue refused, a
bounded number of failures), is kept in the storage with the reason and the original
bytes, and the operator sees it with ``idembus errors list``: retried and purged like the
error queue's messages. Nothing is dropped, and nothing loops forever on one message.
"""

from __future__ import annotations

import logging
import uuid

from . import headers as h
from .envelope import Envelope, utc_now
from .recoverability import MAX_EXCEPTION_MESSAGE, failure_headers, without_failure_headers
from .redaction import redact
from .storage.base import PARKED_OUTGOING, ParkedMessage, Storage
from .transports.base import Delivery

log = logging.getLogger(__name__)

#: What ``idembus errors`` shows as the queue of a parked message.
PARKED_QUEUE = "(parked in storage)"


def park(storage: Storage, *, endpoint: str, source: str, envelope: Envelope,
         error: BaseException, queue: str, attempts: int = 0,
         refusal: BaseException | None = None) -> ParkedMessage:
    """Keep ``envelope`` in ``storage`` with the story of ``error`` (and of ``refusal``,
    what refused it a place in the error queue); a retry sends it to
    ``envelope.destination`` (``queue``: the queue named in the failure headers). Raises
    the storage's error if it cannot be kept: the caller must then not let go of it."""
    headers = failure_headers(envelope.headers, error, queue=queue,
                              immediate_attempts=attempts)
    if refusal is not None:
        headers[h.EXCEPTION_MESSAGE] += (f"; parked, because it could not be moved on: "
                                         f"{redact(str(refusal))[:MAX_EXCEPTION_MESSAGE]}")
    parked = ParkedMessage(
        parked_id=uuid.uuid4().hex, endpoint=endpoint, source=source,
        envelope=Envelope(headers, envelope.body, envelope.destination, envelope.content_type),
        parked_at=utc_now())
    storage.park(parked)
    log.error("parked %s of %s in the storage (%s): %s; see idembus errors list",
              envelope.headers.get(h.MESSAGE_ID, "a message"), endpoint, source,
              headers[h.EXCEPTION_MESSAGE])
    return parked


def park_outgoing(storage: Storage, envelope: Envelope, error: BaseException, *,
                  endpoint: str, attempts: int = 0) -> ParkedMessage:
    """Park a committed outgoing message that could not be sent, under the endpoint that
    sent it (``idembus.originating_endpoint``, else ``endpoint``); a retry sends it to its
    destination, or publishes it again."""
    return park(storage, endpoint=envelope.headers.get(h.ORIGINATING_ENDPOINT) or endpoint,
                source=PARKED_OUTGOING, envelope=envelope, error=error, attempts=attempts,
                queue=envelope.destination or f"(published {envelope.message_type})")


class ParkedDelivery(Delivery):
    """A parked message shown among the error queue's messages by ``idembus errors``:
    acknowledging it (retried or purged) removes it from the storage."""

    def __init__(self, storage: Storage, parked: ParkedMessage) -> None:
        super().__init__(queue=PARKED_QUEUE, headers=parked.envelope.headers,
                         body=parked.envelope.body.encode("utf-8", "surrogateescape"),
                         content_type=parked.envelope.content_type, redelivered=False)
        self.parked = parked
        self._storage = storage

    def retried(self) -> Envelope:
        """The message as it was before it failed, for its own destination (an event
        without one is published again)."""
        envelope = self.parked.envelope
        return Envelope(without_failure_headers(envelope.headers), envelope.body,
                        envelope.destination, envelope.content_type)

    def _ack(self) -> None:
        self._storage.unpark([self.parked.parked_id])

    def _requeue(self) -> None:
        """Nothing to give back: it stays parked."""


def parked_deliveries(storage: Storage, endpoint: str) -> list[Delivery]:
    """The messages ``endpoint`` parked, as deliveries for ``idembus errors``."""
    try:
        return [ParkedDelivery(storage, parked) for parked in storage.parked_messages(endpoint)]
    except Exception as error:  # the error queue is still worth showing
        log.warning("cannot read the parked messages of %s: %s", endpoint, redact(str(error)))
        return []
