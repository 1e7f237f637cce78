"""Parking: the last place a message can go when the broker refuses every other.

A failed message whose error-queue copy the broker refuses (larger than it accepts, a
policy), or a committed outgoing message the outbox cannot send (its queue refused, a
bounded number of failures), is kept in the storage with the reason and the original
bytes, and the operator sees it with ``idembus errors list``: retried and purged like the
error queue's messages. Nothing is dropped, and nothing loops forever on one message.

A parked message's id is derived from what it is (where from, whose, which queue, and its
original headers and body), so parking the same message again — its redelivery, another
outbox round — keeps one copy, and two different messages never share one.

If the storage refuses the message itself (a BSON document too large, a character the
database cannot store), :func:`park` keeps a copy without its body instead: the headers,
the reason, and the body's size and SHA-256, so that the operator knows exactly what was
not kept and where it came from. Only when even that is refused does parking fail, and the
caller must hold on to the message.
"""

from __future__ import annotations

import hashlib
import uuid

from ... import headers as h
from ...envelope import Envelope, utc_now
from ...failures import MAX_EXCEPTION_MESSAGE, failure_headers, without_failure_headers
from ...logs import loggable, message_logger
from ...redaction import redact
from ...storage.base import PARKED_OUTGOING, ParkedMessage, ParkingStore
from ...storage.errors import StorageRefused
from ...transports.base import Delivery

log = message_logger(__name__)

#: What ``idembus errors`` shows as the queue of a parked message.
PARKED_QUEUE = "(parked in storage)"
#: Header of a copy parked without its body: why, and the body's size and SHA-256.
BODY_NOT_KEPT = "idembus.parked.body_not_kept"
_PARKED_IDS = uuid.UUID("6f1c2a4e-7d0b-5c8e-9a3f-1b2d4c6e8f00")


def parked_id(source: str, endpoint: str, queue: str, envelope: Envelope) -> str:
    """The id of ``envelope`` parked by ``endpoint`` from ``source``: the same for the same
    message (parked again, it keeps one place), different for any other."""
    digest = hashlib.sha256()
    for part in (source, endpoint, queue, envelope.destination or "", envelope.body,
                 *(f"{name}={value}" for name, value in sorted(envelope.headers.items()))):
        encoded = part.encode("utf-8", "surrogateescape")
        digest.update(len(encoded).to_bytes(8, "big") + encoded)
    return uuid.uuid5(_PARKED_IDS, digest.hexdigest()).hex


def park(storage: ParkingStore, *, endpoint: str, source: str, envelope: Envelope,
         error: BaseException, queue: str, attempts: int = 0, delayed_attempts: int = 0,
         refusal: BaseException | None = None) -> ParkedMessage:
    """Keep ``envelope`` in ``storage`` with the story of ``error`` (and of ``refusal``,
    what refused it a place in the error queue); a retry sends it to
    ``envelope.destination`` (``queue``: the queue named in the failure headers). Raises
    the storage's error if it cannot be kept, even without its body: the caller must then
    not let go of it."""
    headers = failure_headers(envelope.headers, error, queue=queue,
                              immediate_attempts=attempts, delayed_attempts=delayed_attempts)
    if refusal is not None:
        headers[h.EXCEPTION_MESSAGE] += (f"; parked, because it could not be moved on: "
                                         f"{redact(str(refusal))[:MAX_EXCEPTION_MESSAGE]}")
    parked = ParkedMessage(
        parked_id=parked_id(source, endpoint, queue, envelope), endpoint=endpoint,
        source=source,
        envelope=Envelope(headers, envelope.body, envelope.destination, envelope.content_type,
                          envelope.content_encoding),
        parked_at=utc_now())
    kept = keep(storage, parked, envelope)
    if kept is not parked:
        return kept
    log.error("parked %s of %s in the storage (%s): %s; see idembus errors list",
              loggable(envelope.headers.get(h.MESSAGE_ID, "a message")), endpoint, source,
              loggable(headers[h.EXCEPTION_MESSAGE], MAX_EXCEPTION_MESSAGE))
    return parked


def keep(storage: ParkingStore, parked: ParkedMessage, original: Envelope) -> ParkedMessage:
    """Store ``parked`` (``original``: the message as it came); if the storage refuses it,
    a copy without its body (:func:`park`). What was stored; the storage's error if it
    refuses even that: the caller must then not let go of the message."""
    try:
        storage.park(parked)
    except StorageRefused as refused:
        kept = _without_body(parked, original, refused)
        storage.park(kept)  # refused too: the caller holds on to the message
        log.error("parked %s of %s in the storage (%s) WITHOUT its body, which the storage "
                  "refused (%s): %s; see idembus errors list",
                  loggable(original.headers.get(h.MESSAGE_ID, "a message")), parked.endpoint,
                  parked.source, redact(str(refused)),
                  loggable(parked.envelope.headers.get(h.EXCEPTION_MESSAGE, ""),
                           MAX_EXCEPTION_MESSAGE))
        return kept
    return parked


def _without_body(parked: ParkedMessage, original: Envelope,
                  refused: StorageRefused) -> ParkedMessage:
    """The last resort: ``parked`` with an empty body, and what the body was."""
    body = original.body.encode("utf-8", "surrogateescape")
    note = (f"{len(body)} bytes, sha256 {hashlib.sha256(body).hexdigest()}, not kept: "
            f"{redact(str(refused))[:MAX_EXCEPTION_MESSAGE]}")
    kept = parked.envelope
    return ParkedMessage(parked.parked_id, parked.endpoint, parked.source,
                         Envelope({**kept.headers, BODY_NOT_KEPT: note}, "", kept.destination,
                                  kept.content_type, kept.content_encoding),
                         parked.parked_at)


def park_outgoing(storage: ParkingStore, envelope: Envelope, error: BaseException, *,
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

    def __init__(self, storage: ParkingStore, parked: ParkedMessage) -> None:
        super().__init__(queue=PARKED_QUEUE, headers=parked.envelope.headers,
                         body=parked.envelope.body.encode("utf-8", "surrogateescape"),
                         content_type=parked.envelope.content_type, redelivered=False,
                         content_encoding=parked.envelope.content_encoding)
        self.parked = parked
        self._storage = storage

    def retried(self) -> Envelope:
        """The message as it was before it failed, for its own destination (an event
        without one is published again)."""
        envelope = self.parked.envelope
        return Envelope(without_failure_headers(envelope.headers), envelope.body,
                        envelope.destination, envelope.content_type, envelope.content_encoding)

    def _ack(self) -> None:
        self._storage.unpark([self.parked.parked_id])

    def _requeue(self) -> None:
        """Nothing to give back: it stays parked."""

